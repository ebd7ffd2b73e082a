"""The needle grid as the page asks for it: policies at one kept fraction, in one mode, over context lengths and
evenly spaced depths, run by :class:`kvlab.sweep.SweepRunner` into the store (resumable, trial by trial)."""

from __future__ import annotations

import numpy as np

from kvlab.errors import KvlabError
from kvlab.models import LoadedModel
from kvlab.policies import make_policy
from kvlab.provenance import weights_identity
from kvlab.store import Store
from kvlab.sweep import Progress, SweepGrid, SweepRunner, SweepSummary


def needle_grid_spec(policies: list[str], keep: float, mode: str, contexts: list[int], depths: int, trials: int,
                     batch_size: int) -> SweepGrid:
    """The grid: every policy at ``keep`` (the full cache once), ``depths`` evenly spaced depths from 0 to 1."""
    return SweepGrid(tuple(make_policy(name) for name in policies), keeps=(keep,), contexts=tuple(contexts),
                     depths=tuple(float(d) for d in np.linspace(0.0, 1.0, depths).round(4)), trials=trials,
                     modes=(mode,), batch_size=batch_size)


def run_needle_grid(loaded: LoadedModel, store: Store, grid: SweepGrid, progress: Progress,
                    started_by: str | None = None) -> SweepSummary:
    """Run what the store does not hold yet. An error on the way (a GPU out of memory, which the engine turns into a
    sentence) says that the trials finished before it stay stored."""
    runner = SweepRunner(loaded, store, grid, weights_hash=weights_identity(loaded.name, loaded.model.config),
                         started_by=started_by, progress=progress)
    try:
        return runner.run()
    except KvlabError as error:
        raise KvlabError(f"{error} The needle grid's finished trials are stored; run it again to resume.") from None
