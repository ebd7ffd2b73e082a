"""The needle grid as the page asks for it: policies at one kept fraction, in one mode, over context lengths and
evenly spaced depths, run by :class:`kvlab.sweep.SweepRunner` into the store (resumable, trial by trial).

A request is plain values so that it can be stored as a sweep's JSON spec (:meth:`kvlab.store.Store.begin_sweep`)
and rebuilt after a server restart to resume the sweep; the grid it describes is built from it each time.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvlab.errors import KvlabError
from kvlab.models import LoadedModel
from kvlab.policies import make_policy
from kvlab.store import Store
from kvlab.sweep import Progress, SweepGrid, SweepRunner, SweepSummary

#: What a stored spec says it is: a spec without it (or with another) is not read as a needle grid.
SPEC_KIND = "needle-grid"


def evenly_spaced_depths(count: int) -> tuple[float, ...]:
    """``count`` needle depths evenly spaced from the start of the text (0) to its end (1), at least two: the one
    rule by which a needle grid's number of depths becomes its depths."""
    if count < 2:
        raise KvlabError(f"A needle grid needs at least two depths (the start and the end), not {count}.")
    return tuple(float(d) for d in np.linspace(0.0, 1.0, count).round(4))


def depth_label(depth: float) -> str:
    """A needle depth as a share of the text, as the page and its heatmap write it: ``25%``, ``12.5%``."""
    return f"{round(100 * depth, 1):g}%"


@dataclass(frozen=True)
class NeedleGridRequest:
    """A needle grid on one model: every policy at ``keep`` (the full cache once) in ``mode``, at each context
    length, ``depths`` evenly spaced depths from 0 to 1 (:func:`evenly_spaced_depths`), ``trials`` items per depth,
    ``batch_size`` prompts per forward pass."""

    model: str
    policies: tuple[str, ...]
    keep: float
    mode: str
    contexts: tuple[int, ...]
    depths: int
    trials: int
    batch_size: int = 8

    def grid(self) -> SweepGrid:
        """The sweep grid; a policy, budget or mode it cannot run is one sentence."""
        return SweepGrid(
            tuple(make_policy(name) for name in self.policies),
            keeps=(self.keep,),
            contexts=self.contexts,
            depths=evenly_spaced_depths(self.depths),
            trials=self.trials,
            modes=(self.mode,),
            batch_size=self.batch_size,
        )

    def fills(self, other: NeedleGridRequest) -> bool:
        """Whether this grid's trials show on ``other``'s heatmap: the same model, kept fraction and mode, and a
        policy and a context length in common."""
        return (
            (self.model, self.keep, self.mode) == (other.model, other.keep, other.mode)
            and bool(set(self.policies) & set(other.policies))
            and bool(set(self.contexts) & set(other.contexts))
        )

    def runs(self) -> int:
        """How many stored runs the grid fills: one per cell and context length."""
        return len(self.grid().cells()) * len(self.contexts)

    def describe(self) -> str:
        """The grid in one line, for the page's list of sweeps."""
        trials = "1 trial" if self.trials == 1 else f"{self.trials} trials"
        return (
            f"{', '.join(self.policies)} · keep {self.keep:g} · {self.mode} · "
            f"{', '.join(f'{c:,}' for c in self.contexts)} tokens · {self.depths} depths x {trials}"
        )

    def spec(self) -> dict[str, Any]:
        """The request as the JSON object a sweep is stored with."""
        return {"kind": SPEC_KIND, **dataclasses.asdict(self)}

    @classmethod
    def from_spec(cls, spec: Mapping[str, Any]) -> NeedleGridRequest:
        """The request a stored sweep was started with; a spec this version cannot read is one sentence."""
        fields = {field.name for field in dataclasses.fields(cls)}
        if spec.get("kind") != SPEC_KIND or not fields <= set(spec):
            raise KvlabError("This stored sweep is not a needle grid this version of kvlab can read.")
        values = {name: spec[name] for name in fields}
        return cls(**{**values, "policies": tuple(values["policies"]), "contexts": tuple(values["contexts"])})


def run_needle_grid(
    loaded: LoadedModel,
    store: Store,
    grid: SweepGrid,
    progress: Progress,
    started_by: str | None = None,
    should_stop: Callable[[], bool] | None = None,
) -> SweepSummary:
    """Run what the store does not hold yet, until ``should_stop`` says so. An error on the way (a GPU out of
    memory, which the engine turns into a sentence) says that the trials finished before it stay stored."""
    runner = SweepRunner(loaded, store, grid, started_by=started_by, progress=progress, should_stop=should_stop)
    try:
        return runner.run()
    except KvlabError as error:
        raise KvlabError(f"{error} The needle grid's finished trials are stored; resume it to go on.") from None
