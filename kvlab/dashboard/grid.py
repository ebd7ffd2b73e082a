"""The needle grid as the page asks for it: policies at one kept fraction, in one mode, over context lengths and
evenly spaced depths (or RULER's tasks, :mod:`kvlab.tasks.ruler`), run by :class:`kvlab.runs.sweep.SweepRunner` into the
store (resumable, trial by trial).

A request is plain values so that it can be stored as a sweep's JSON spec (:meth:`kvlab.store.Store.begin_sweep`)
and rebuilt after a server restart to resume the sweep; the grid it describes is built from it each time. Its
policies are written as :func:`kvlab.runs.sweep.parse_policies` reads them, so that one grid can hold a policy with and
without cache options (``h2o`` and ``h2o[hot=0.25,key_bits=4,value_bits=4]``); a spec stored before policies took
options lists plain names, which read the same way.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from kvlab.dashboard.inputs import cache_option_fields
from kvlab.engine.plan import layer_profile
from kvlab.errors import KvlabError
from kvlab.models.loading import LoadedModel
from kvlab.policies import POLICIES, Variant
from kvlab.runs.sweep import Progress, SweepGrid, SweepRunner, SweepSummary, format_variant, parse_policies
from kvlab.store import Store
from kvlab.tasks.ruler import MAX_NEW_TOKENS, check_tasks

#: What a stored spec says it is: a spec without it (or with another) is not read as a needle grid.
SPEC_KIND = "needle-grid"
#: Settings added after grids were first stored: a spec leaves them out at their defaults, so that such a grid's
#: spec, and so its stored sweep, is the one it always was.
LATER_SETTINGS = ("tasks", "query_aware")


def evenly_spaced_depths(count: int) -> tuple[float, ...]:
    """``count`` needle depths evenly spaced from the start of the text (0) to its end (1), at least two: the one
    rule by which a needle grid's number of depths becomes its depths."""
    if count < 2:
        raise KvlabError(f"A needle grid needs at least two depths (the start and the end), not {count}.")
    return tuple(float(d) for d in np.linspace(0.0, 1.0, count).round(4))


def depth_label(depth: float) -> str:
    """A needle depth as a share of the text, as the page and its heatmap write it: ``25%``, ``12.5%``."""
    return f"{round(100 * depth, 1):g}%"


def variant(name: str, options: Mapping[str, object]) -> str:
    """A policy with cache options as :func:`kvlab.runs.sweep.parse_policies` reads it: ``h2o`` without any,
    ``h2o[hot=0.25,key_bits=4,value_bits=4]`` with some, the options in their declaration order (so that the same
    settings always give the same text, and so the same stored sweep)."""
    order = [field.name for field in cache_option_fields()]
    return format_variant(name, [(key, options[key]) for key in order if key in options])


def grid_policies(names: Sequence[str], options: Mapping[str, object], also_without: bool) -> tuple[str, ...]:
    """The grid's policies: each of ``names`` with the cache options that differ from their defaults (a policy
    that ranks no tokens, such as the full cache, as it is), and with ``also_without`` each such policy without
    them first, so that one grid compares the two."""
    defaults = {field.name: field.default for field in cache_option_fields()}
    changed = {key: value for key, value in options.items() if defaults.get(key) != value}
    chosen: list[str] = []
    for name in names:
        takes = bool(changed) and POLICIES[name].ranks
        chosen.extend(
            [name, variant(name, changed)] if takes and also_without else [variant(name, changed if takes else {})]
        )
    return tuple(chosen)


@dataclass(frozen=True)
class NeedleGridRequest:
    """A needle grid on one model: every policy at ``keep`` (the full cache once) in ``mode``, at each context
    length, ``depths`` evenly spaced depths from 0 to 1 (:func:`evenly_spaced_depths`), ``trials`` items per depth,
    ``batch_size`` prompts per forward pass. With RULER ``tasks`` (their names), ``trials`` items of each task
    instead of the needle depths. ``query_aware`` reads the question before compression (else after it)."""

    model: str
    policies: tuple[str, ...]
    keep: float
    mode: str
    contexts: tuple[int, ...]
    depths: int
    trials: int
    batch_size: int = 8
    tasks: tuple[str, ...] = ()
    query_aware: bool = True

    def policy_objects(self) -> tuple[Variant, ...]:
        """The policies with their options; one the mode cannot run (precision tiers in streaming mode) or a bad
        combination of options is one sentence."""
        variants = parse_policies(",".join(self.policies))
        for variant in variants:
            variant.check_mode(self.mode)
        return variants

    def grid(self) -> SweepGrid:
        """The sweep grid; a policy, budget, mode or RULER task it cannot run is one sentence. RULER's tasks may
        generate RULER's largest answer budget."""
        if self.tasks:
            return SweepGrid(
                self.policy_objects(),
                keeps=(self.keep,),
                contexts=self.contexts,
                depths=None,
                trials=self.trials,
                modes=(self.mode,),
                kind="ruler",
                ruler_tasks=check_tasks(self.tasks),
                query_aware=self.query_aware,
                max_new_tokens=MAX_NEW_TOKENS,
                batch_size=self.batch_size,
            )
        return SweepGrid(
            self.policy_objects(),
            keeps=(self.keep,),
            contexts=self.contexts,
            depths=evenly_spaced_depths(self.depths),
            trials=self.trials,
            modes=(self.mode,),
            query_aware=self.query_aware,
            batch_size=self.batch_size,
        )

    def check_runs_on(self, loaded: LoadedModel) -> SweepGrid:
        """The grid, once it is known to run on ``loaded``: its contexts fit the model, and a policy whose layer
        budgets follow the model's attention profile finds one (else the sentence names the command that measures
        it)."""
        grid = self.grid()
        grid.check_fits(loaded)
        for variant in grid.variants:
            layer_profile(loaded, variant.cache())
        return grid

    def own_runs(self, runs: pd.DataFrame) -> pd.DataFrame:
        """The stored runs (``Store.list_runs``) of exactly this grid's policies with their parameters, that read
        the question when this grid does, so that a heatmap of ``h2o`` does not pool runs of ``h2o`` with other
        options, parameters or question settings."""
        wanted = {(policy.name, json.dumps(policy.params(), sort_keys=True)) for policy in self.policy_objects()}
        same_question = [not pd.isna(aware) and bool(aware) == self.query_aware for aware in runs["query_aware"]]
        ours = [
            (name, json.dumps(json.loads(params) if isinstance(params, str) else {}, sort_keys=True)) in wanted and same
            for name, params, same in zip(runs["policy"], runs["policy_params"], same_question)
        ]
        return runs[np.array(ours, dtype=bool)]

    def policy_names(self) -> tuple[str, ...]:
        """The distinct policy names of the grid, as a store filter takes them."""
        return tuple(dict.fromkeys(policy.name for policy in self.policy_objects()))

    def fills(self, other: NeedleGridRequest) -> bool:
        """Whether this grid's trials show on ``other``'s heatmap (or RULER table): the same model, kept fraction,
        mode, tasks and question setting, and a policy and a context length in common."""
        return (
            (self.model, self.keep, self.mode, self.tasks, self.query_aware)
            == (other.model, other.keep, other.mode, other.tasks, other.query_aware)
            and bool(set(self.policies) & set(other.policies))
            and bool(set(self.contexts) & set(other.contexts))
        )

    @property
    def name(self) -> str:
        """What the grid is called on the page: ``needle grid`` or ``RULER grid``."""
        return "RULER grid" if self.tasks else "needle grid"

    def runs(self) -> int:
        """How many stored runs the grid fills: one per cell and context length."""
        return len(self.grid().cells()) * len(self.contexts)

    def describe(self) -> str:
        """The grid in one line, for the page's list of sweeps."""
        trials = "1 trial" if self.trials == 1 else f"{self.trials} trials"
        asked = f"RULER {', '.join(self.tasks)} x {trials}" if self.tasks else f"{self.depths} depths x {trials}"
        question = "" if self.query_aware else " · question after compression"
        return (
            f"{', '.join(self.policies)} · keep {self.keep:g} · {self.mode} · "
            f"{', '.join(f'{c:,}' for c in self.contexts)} tokens · {asked}{question}"
        )

    def spec(self) -> dict[str, Any]:
        """The request as the JSON object a sweep is stored with, :data:`LATER_SETTINGS` at their defaults left
        out."""
        values = dataclasses.asdict(self)
        for field in dataclasses.fields(self):
            if field.name in LATER_SETTINGS and values[field.name] == field.default:
                del values[field.name]
        return {"kind": SPEC_KIND, **values}

    @classmethod
    def from_spec(cls, spec: Mapping[str, Any]) -> NeedleGridRequest:
        """The request a stored sweep was started with; a spec this version cannot read is one sentence."""
        fields = dataclasses.fields(cls)
        required = {field.name for field in fields if field.default is dataclasses.MISSING}
        if spec.get("kind") != SPEC_KIND or not required <= set(spec):
            raise KvlabError("This stored sweep is not a needle grid this version of kvlab can read.")
        values = {field.name: spec[field.name] for field in fields if field.name in spec}
        lists: dict[str, tuple] = {
            name: tuple(values[name]) for name in ("policies", "contexts", "tasks") if name in values
        }
        return cls(**{**values, **lists})


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
        name = "RULER" if grid.kind == "ruler" else "needle"
        raise KvlabError(f"{error} The {name} grid's finished trials are stored; resume it to go on.") from None
