"""Sweeps: policies x budgets x modes x context lengths x depths x trials, stored trial by trial.

Every cell of the grid answers the same items (the same haystack windows, facts and depths, drawn from the seed),
so policies are compared like with like. A grid asks needle questions of one kind, or RULER's tasks
(:mod:`kvlab.tasks.ruler`): then each trial is one item of one task, its needles at depths the task draws itself.
A cell at one context length is one stored run; each answered item is one trial. Re-running a sweep finds its runs
by their configuration and skips the trials already stored, so an interrupted sweep loses at most the work in flight
and never duplicates a trial.

The pending items are cut into work units (:class:`WorkUnit`): one batch of items of one context length for one
cell, or for all the cells that share the batch's read. Policies in ``prefill`` mode share one read of each batch of
contexts (:func:`kvlab.engine.generation.prefill_once`): the context is read once, remembering what every policy needs,
and each policy compresses its own fork of that cache. ``streaming``-mode policies evict while reading, so each reads
for itself. A unit is computed by :meth:`InProcess.unit_trials` wherever it runs: in this process, or on the workers of
:mod:`kvlab.runs.cluster`, which return its trials; the :class:`SweepRunner` alone writes them to the store.
"""

from __future__ import annotations

import random
import re
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

import torch

from kvlab.attention.backends import DEFAULT_ATTENTION, AttentionBackend, check_attention
from kvlab.budget import Budget
from kvlab.cache.layouts import DEFAULT_COMPACT_AT, DEFAULT_LAYOUT, HeapLayout
from kvlab.engine.generation import generate, prefill_once
from kvlab.engine.prefilled import Prefilled
from kvlab.engine.spec import RunSpec
from kvlab.errors import KvlabError, shown_name
from kvlab.hashing import sources_sha256
from kvlab.models.limits import check_seed
from kvlab.models.loading import LoadedModel
from kvlab.modes import MODES, PREFILL, Mode, check_mode
from kvlab.policies import Policy, Variant, configure, parse_params
from kvlab.policies.base import check_budget
from kvlab.policies.variants import as_variant
from kvlab.runs.records import batch_trials, needle_sources_hash, run_config, stops_for
from kvlab.settings import positive_setting
from kvlab.store import RunConfig, Store, Trial
from kvlab.store.rows import canonical_json
from kvlab.tasks.bos import DEFAULT_BOS, BosRule, check_bos
from kvlab.tasks.facts import TRAIN_TEMPLATES, Fact, make_fact
from kvlab.tasks.items import TaskItem, from_needle, from_ruler
from kvlab.tasks.needle import Kind, build_needle, load_haystacks
from kvlab.tasks.ruler import RULER_SOURCES, RULER_TASKS, check_tasks, ruler_item, task_set_name

Progress = Callable[[int, int, str], None]
#: What a grid asks: needle questions of one kind, or the RULER tasks of ``SweepGrid.ruler_tasks``.
GridKind = Kind | Literal["ruler"]


#: Raises the most trials one sweep may plan.
MAX_SWEEP_TRIALS_ENV = "KVLAB_MAX_SWEEP_TRIALS"
DEFAULT_MAX_SWEEP_TRIALS = 1_000_000


def most_sweep_trials() -> int:
    """The most trials one sweep may plan: ``KVLAB_MAX_SWEEP_TRIALS``, or a million (a week of an 8B model's
    needles on one GPU)."""
    return positive_setting(MAX_SWEEP_TRIALS_ENV, "trials") or DEFAULT_MAX_SWEEP_TRIALS


@dataclass(frozen=True)
class Cell:
    """One variant (a policy with its cache options) at one budget in one mode: a stored run per context length."""

    variant: Variant
    keep: float | None
    mode: Mode

    @property
    def label(self) -> str:
        keep = "" if self.keep is None else f" keep {self.keep:g}"
        return f"{self.variant.name}{keep} {self.mode}"


@dataclass(frozen=True)
class SweepGrid:
    """The grid to run. ``depths=None`` puts each trial's needle at a random depth (seeded). With ``kind="ruler"``,
    every cell answers ``trials`` items of each of ``ruler_tasks`` (RULER's names), and ``depths`` must be None:
    RULER's tasks draw their needles' depths themselves. ``policies`` are variants (a policy with its cache options;
    a policy alone is its published variant), kept as :attr:`variants`."""

    policies: tuple[Variant | Policy, ...]
    keeps: tuple[float, ...]
    contexts: tuple[int, ...]
    depths: tuple[float, ...] | None
    trials: int
    modes: tuple[str, ...] = (PREFILL,)
    seed: int = 0
    kind: GridKind = "single"
    ruler_tasks: tuple[str, ...] = RULER_TASKS
    chunk: int | None = None
    query_aware: bool = True
    max_new_tokens: int = 24
    batch_size: int = 8
    share_prefill: bool = True
    layout: str = DEFAULT_LAYOUT
    compact_at: float = DEFAULT_COMPACT_AT
    static: bool | None = None
    attention: AttentionBackend = DEFAULT_ATTENTION
    bos: BosRule = DEFAULT_BOS
    variants: tuple[Variant, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        variants = tuple(as_variant(chosen) for chosen in self.policies)
        object.__setattr__(self, "variants", variants)
        if not self.policies:
            raise KvlabError("A sweep needs at least one policy.")
        if not self.contexts:
            raise KvlabError("A sweep needs at least one context length (--contexts).")
        if any(context < 1 for context in self.contexts):
            raise KvlabError(f"Context lengths are positive numbers of tokens, not {min(self.contexts)}.")
        if self.depths is not None and not self.depths:
            raise KvlabError("A sweep needs at least one needle depth (--depths), or 'random'.")
        if self.kind == "ruler":
            check_tasks(self.ruler_tasks)
            if self.depths is not None:
                raise KvlabError("RULER's tasks draw their needles' depths themselves; leave out --depths.")
        if not self.modes:
            raise KvlabError(f"A sweep needs at least one mode ({', '.join(MODES)}).")
        if self.max_new_tokens < 1:
            raise KvlabError(f"A sweep must generate at least one token per answer, not {self.max_new_tokens}.")
        check_seed(self.seed)
        check_attention(self.attention)
        check_bos(self.bos)
        HeapLayout(self.layout, self.compact_at)  # type: ignore[arg-type]
        if self.trials < 1:
            raise KvlabError(f"A sweep needs at least one trial per cell, not {self.trials}.")
        if self.batch_size < 1:
            raise KvlabError(f"The batch size must be at least 1, not {self.batch_size}.")
        for mode in self.modes:
            check_mode(mode)
        for keep in self.keeps:
            Budget(keep=keep)
        for depth in self.depths or ():
            if not 0.0 <= depth <= 1.0:
                raise KvlabError(f"A needle depth must lie in [0, 1], not {depth}.")
        if any(variant.policy.evicts for variant in self.variants) and not self.keeps:
            raise KvlabError(
                "Policies that take a budget (evicting ones, and sparse readers) need at least one kept fraction "
                "(--keep)."
            )
        planned = self.planned_trials()
        if planned > most_sweep_trials():
            raise KvlabError(
                f"This sweep plans {planned:,} trials, more than the {most_sweep_trials():,} one sweep may have; "
                f"split it, or set {MAX_SWEEP_TRIALS_ENV} to raise the limit."
            )
        for cell in self.cells():
            for context in self.contexts:
                check_budget(cell.variant.policy, Budget(keep=cell.keep) if cell.keep is not None else None, context)

    def planned_trials(self) -> int:
        """How many trials the grid holds, counted without listing them (a typo in ``--trials`` must not fill the
        memory before it is refused)."""
        per_context = self.trials * (len(self.depths) if self.depths else 1)
        if self.kind == "ruler":
            per_context *= len(self.ruler_tasks)
        return len(self.cells()) * len(self.contexts) * per_context

    def check_fits(self, loaded: LoadedModel) -> None:
        """Refuse, before anything runs or is stored, a context that with its answer does not fit the model, and a
        RULER task whose first item does not fit its context (its instructions and lists alone are longer)."""
        for context in self.contexts:
            loaded.limits.check(context, self.max_new_tokens, shown_name(loaded.name))
            if self.kind == "ruler":
                for task in self.ruler_tasks:
                    ruler_item(loaded.tokenizer, task, context, _item_rng(self, context, f"{task}/trial=0"), self.bos)

    @property
    def task(self) -> str:
        """The task description stored with each run: ``needle``, ``needle-<kind>``, or for RULER's tasks ``ruler``
        (all of them) or ``ruler:<task>,<task>`` (:func:`~kvlab.tasks.ruler.task_set_name`)."""
        if self.kind == "ruler":
            return task_set_name(self.ruler_tasks)
        return "needle" if self.kind == "single" else f"needle-{self.kind}"

    @property
    def task_hash(self) -> str:
        """The identity of the grid's generated items: everything they are generated from."""
        if self.kind == "ruler":
            return ruler_sources_hash(self.task)
        return needle_sources_hash(self.task, "sweep")

    def shares_read(self, cell: Cell) -> bool:
        """Whether ``cell`` compresses a fork of a context read once for every such cell (evicting policies in
        prefill mode, unless sharing is off) rather than reading each context itself."""
        return cell.mode == PREFILL and cell.variant.policy.evicts and self.share_prefill

    def cells(self) -> list[Cell]:
        """Every (policy, keep, mode) of the grid; ``full`` once, in the first mode (it keeps everything)."""
        cells: list[Cell] = []
        for variant in self.variants:
            if not variant.policy.evicts:
                cells.append(Cell(variant, None, check_mode(self.modes[0])))
                continue
            cells.extend(Cell(variant, keep, check_mode(mode)) for mode in self.modes for keep in self.keeps)
        return cells


@dataclass
class SweepSummary:
    """What a sweep did: trials run now, trials found already stored, and whether it was stopped early."""

    ran: int = 0
    skipped: int = 0
    stopped: bool = False
    run_ids: list[int] = field(default_factory=list)


#: A trial key of a grid with fixed depths, as :func:`trial_slots` writes it: ``depth=0.2500/trial=3``.
_DEPTH_KEY = re.compile(r"depth=([01]\.\d{4})/trial=\d+$")


def ruler_sources_hash(task: str) -> str:
    """The identity of generated RULER items of one task set: what needle prompts are made from
    (:func:`~kvlab.runs.records.needle_sources_hash`: the haystacks, which are RULER's essay, and the needle helpers)
    and the RULER generators with their word lists (:data:`~kvlab.tasks.ruler.RULER_SOURCES`)."""
    return sources_sha256(needle_sources_hash(task, "sweep"), RULER_SOURCES)


def trial_slots(grid: SweepGrid, context: int) -> list[tuple[str, float | None]]:
    """The trial keys of one context length with the depth each asks for, in the order their items are drawn; a
    key of a grid with fixed depths names its depth (:func:`requested_depth` reads it back). A RULER grid's keys
    name the task (``niah_single_1/trial=0``) and ask for no depth."""
    if grid.kind == "ruler":
        return sorted((f"{task}/trial={trial}", None) for task in grid.ruler_tasks for trial in range(grid.trials))
    return list(_needle_slots(grid, context))


def _needle_slots(grid: SweepGrid, context: int) -> list[tuple[str, float]]:
    slots: list[tuple[str, float]] = []
    depth_rng = random.Random(f"{grid.seed}/{context}/depths")
    for trial in range(grid.trials):
        if grid.depths is None:
            slots.append((f"trial={trial}", depth_rng.random()))
        else:
            slots.extend((f"depth={depth:.4f}/trial={trial}", depth) for depth in grid.depths)
    return sorted(slots)


def requested_depth(trial_key: str) -> float | None:
    """The depth a sweep's trial asked for, read from its key (None for a random depth or another kind of key):
    the needle itself sits at a sentence boundary near it, which the trial records as its depth."""
    match = _DEPTH_KEY.match(trial_key)
    return float(match.group(1)) if match else None


def grid_items(loaded: LoadedModel, grid: SweepGrid, context: int) -> list[tuple[str, TaskItem]]:
    """The items of one context length with their trial keys, the same for every cell of the grid: needle items,
    or RULER items (:func:`ruler_items`)."""
    return ruler_items(loaded, grid, context) if grid.kind == "ruler" else needle_items(loaded, grid, context)


def ruler_items(loaded: LoadedModel, grid: SweepGrid, context: int) -> list[tuple[str, TaskItem]]:
    """A RULER grid's items of one context length: ``trials`` of each task, each drawn from the seed, the context
    length and its key, so that an item never changes when other tasks or more trials are added."""
    items: list[tuple[str, TaskItem]] = []
    for key, _ in trial_slots(grid, context):
        task, _, trial = key.partition("/trial=")
        item = ruler_item(loaded.tokenizer, task, context, _item_rng(grid, context, key), grid.bos)
        items.append((key, from_ruler(item, int(trial))))
    return items


def _item_rng(grid: SweepGrid, context: int, key: str) -> random.Random:
    """What a trial's item is drawn from: the grid's seed, the context length and the trial's key."""
    return random.Random(f"{grid.seed}/{context}/{key}")


def needle_items(loaded: LoadedModel, grid: SweepGrid, context: int) -> list[tuple[str, TaskItem]]:
    """The needle items of one context length with their trial keys, the same for every cell of the grid."""
    tokenizer = loaded.tokenizer
    haystacks = load_haystacks(tokenizer)
    items: list[tuple[str, TaskItem]] = []
    for index, (key, depth) in enumerate(_needle_slots(grid, context)):
        rng = _item_rng(grid, context, key)
        template = TRAIN_TEMPLATES[rng.randrange(len(TRAIN_TEMPLATES))]
        fact = make_fact(template, rng, num_values=3 if grid.kind == "multi-value" else 1)
        distractors: list[Fact] = []
        if grid.kind == "multi-key":
            used = {fact.key}
            for _ in range(3):
                distractors.append(make_fact(template, rng, avoid_keys=frozenset(used)))
                used.add(distractors[-1].key)
        haystack = haystacks[rng.randrange(len(haystacks))]
        item = build_needle(tokenizer, haystack, context, depth, fact, distractors=distractors, rng=rng, bos=grid.bos)
        items.append((key, from_needle(item, index)))
    return items


def shape_batches(
    items: Sequence[tuple[str, TaskItem]], size: int, query_aware: bool
) -> list[list[tuple[str, TaskItem]]]:
    """Batches of items whose prompts have the same shape (same context length, and same question length when the
    question is read separately)."""
    groups: dict[tuple[int, int], list[tuple[str, TaskItem]]] = {}
    for key, item in items:
        shape = (item.context_tokens, 0) if query_aware else (len(item.context_ids), len(item.question_ids))
        groups.setdefault(shape, []).append((key, item))
    return [group[i : i + size] for group in groups.values() for i in range(0, len(group), size)]


def prompt_tensors(
    batch: Sequence[tuple[str, TaskItem]], query_aware: bool, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A batch's prompts as the engine reads them: context and question together (``query_aware``), or the
    question apart, to be read after compression."""
    if query_aware:
        ids = [item.context_ids + item.question_ids for _, item in batch]
        return torch.tensor(ids, device=device), None
    context = torch.tensor([item.context_ids for _, item in batch], device=device)
    question = torch.tensor([item.question_ids for _, item in batch], device=device)
    return context, question


@dataclass(frozen=True)
class PendingRun:
    """A cell's stored run at one context length and the items it still has to answer."""

    context: int
    cell: Cell
    run_id: int
    pending: list[tuple[str, TaskItem]]


@dataclass(frozen=True)
class UnitJob:
    """One cell's part of a work unit: the run its trials go to, and how many of the unit's items that run still
    needs (what progress counts; a shared read may answer items a run already holds, which the store skips)."""

    cell: Cell
    run_id: int
    counted: int


@dataclass(frozen=True)
class WorkUnit:
    """What one model computes at once: one batch of same-shape items of one context length, for one cell, or for
    every prefill-mode cell that compresses a fork of the batch's one read (``shared``). A unit is the grain of
    scheduling and of loss: its trials are stored when it comes back, so a unit cut short is computed again whole."""

    context: int
    batch: tuple[tuple[str, TaskItem], ...]
    jobs: tuple[UnitJob, ...]
    shared: bool

    @property
    def label(self) -> str:
        """The unit in words, for a sentence about it."""
        cells = ", ".join(job.cell.label for job in self.jobs)
        return f"{cells} at {self.context:,} tokens, {len(self.batch)} items from {self.batch[0][0]}"


@dataclass(frozen=True)
class SweepPlan:
    """A grid as one model files it: every context length's items, and each cell's stored configuration per context
    length, keyed by the context and the cell's index in :meth:`SweepGrid.cells`."""

    items: dict[int, list[tuple[str, TaskItem]]]
    configs: dict[tuple[int, int], RunConfig]


#: A unit's trials as they come back: the unit, one of its jobs, and that job's trials.
UnitResult = tuple[WorkUnit, UnitJob, list[Trial]]


class UnitExecutor(Protocol):
    """Where a sweep's units are computed: this process's own model (:class:`InProcess`), or workers that each hold
    one (:class:`kvlab.runs.cluster.SweepWorkers`). The runner, the one writer of the store, asks it for the grid's plan
    and stores what it returns."""

    def check_fits(self, grid: SweepGrid) -> None:
        """Refuse a grid the model cannot run (:meth:`SweepGrid.check_fits`)."""
        ...

    def config(self, grid: SweepGrid, cell: Cell, context: int) -> RunConfig:
        """The stored configuration of a cell's run at one context length."""
        ...

    def prepare(self, grid: SweepGrid) -> SweepPlan:
        """The grid's items and configurations."""
        ...

    def results(
        self, grid: SweepGrid, units: Sequence[WorkUnit], should_stop: Callable[[], bool]
    ) -> Iterator[UnitResult]:
        """Every job of every unit with its trials, each once, in any order; no unit (or, in this process, no further
        job of a unit) is started once ``should_stop`` has said so, and those already started still come back."""
        ...


class InProcess:
    """A loaded model in this process computing a sweep's units; each worker of :mod:`kvlab.runs.cluster` holds one too,
    so that a unit is computed by the same code wherever it runs."""

    def __init__(self, loaded: LoadedModel) -> None:
        self.loaded = loaded
        # a sweep's prompts (needles, RULER's tasks) are plain text whatever the model, never a chat turn: the one
        # stop rule of that format (a line break ends the answer) holds for base and chat models alike
        self.stops = stops_for(loaded, one_line_answers=True, chat=False)

    def check_fits(self, grid: SweepGrid) -> None:
        grid.check_fits(self.loaded)

    def spec(self, grid: SweepGrid, cell: Cell) -> RunSpec:
        """What the engine runs for a cell."""
        budget = Budget(keep=cell.keep) if cell.keep is not None else None
        return RunSpec(
            cell.variant.policy,
            budget,
            mode=cell.mode,
            chunk=grid.chunk,
            max_new_tokens=grid.max_new_tokens,
            stop_token_ids=self.stops.token_ids,
            seed=grid.seed,
            cache=cell.variant.cache(grid.layout, grid.compact_at),
            static=grid.static,
            attention=grid.attention,
            bos=grid.bos,
        )

    def config(self, grid: SweepGrid, cell: Cell, context: int) -> RunConfig:
        return run_config(
            self.loaded,
            self.spec(grid, cell),
            task=grid.task,
            task_hash=grid.task_hash,
            stop_rule=self.stops.rule,
            query_aware=grid.query_aware,
            context_length=context,
        )

    def prepare(self, grid: SweepGrid) -> SweepPlan:
        # every item first: a context too short for one of them is refused before any run is stored
        items = {context: grid_items(self.loaded, grid, context) for context in grid.contexts}
        configs = {
            (context, index): self.config(grid, cell, context)
            for context in grid.contexts
            for index, cell in enumerate(grid.cells())
        }
        return SweepPlan(items, configs)

    def unit_trials(self, grid: SweepGrid, unit: WorkUnit) -> Iterator[tuple[UnitJob, list[Trial]]]:
        """The trials of each job of a unit, job by job: a shared unit reads its batch once
        (:func:`~kvlab.engine.generation.prefill_once`) and every job compresses a fork of that read; any other reads
        for itself."""
        context, question = prompt_tensors(unit.batch, grid.query_aware, self.loaded.device)
        if not unit.shared:
            for job in unit.jobs:
                result = generate(self.loaded, context, self.spec(grid, job.cell), suffix_ids=question)
                yield job, batch_trials(unit.batch, result)
            return
        variants = [job.cell.variant for job in unit.jobs]
        prefilled: Prefilled = prefill_once(self.loaded, context, variants, chunk=grid.chunk)
        for job in unit.jobs:
            spec = self.spec(grid, job.cell)
            result = generate(self.loaded, None, spec, suffix_ids=question, prefilled=prefilled)
            yield job, batch_trials(unit.batch, result)

    def results(
        self, grid: SweepGrid, units: Sequence[WorkUnit], should_stop: Callable[[], bool]
    ) -> Iterator[UnitResult]:
        # asked between generations, not only between units: a shared unit runs one generation per cell of its
        # batch, which under load is many minutes that a SIGTERM would otherwise wait for (Ctrl-C does not)
        for unit in units:
            if should_stop():
                return
            for job, trials in self.unit_trials(grid, unit):
                yield unit, job, trials
                if should_stop():
                    return


def work_units(grid: SweepGrid, runs: Sequence[PendingRun]) -> list[WorkUnit]:
    """The units that answer every pending item, context by context: for the cells that share a read, one unit per
    batch of the union of their pending items, naming the cells that still need some of it; for each other cell,
    one unit per batch of its own pending items."""
    units: list[WorkUnit] = []
    for context in grid.contexts:
        here = [run for run in runs if run.context == context and run.pending]
        shared = [run for run in here if grid.shares_read(run.cell)]
        shared_ids = {run.run_id for run in shared}
        union: dict[str, TaskItem] = {}
        for run in shared:
            union.update(run.pending)
        wanted = {run.run_id: {key for key, _ in run.pending} for run in shared}
        for batch in shape_batches(sorted(union.items()), grid.batch_size, grid.query_aware):
            keys = {key for key, _ in batch}
            jobs = tuple(
                UnitJob(run.cell, run.run_id, len(wanted[run.run_id] & keys))
                for run in shared
                if wanted[run.run_id] & keys
            )
            units.append(WorkUnit(context, tuple(batch), jobs, shared=True))
        for run in here:
            if run.run_id in shared_ids:
                continue
            for batch in shape_batches(run.pending, grid.batch_size, grid.query_aware):
                units.append(WorkUnit(context, tuple(batch), (UnitJob(run.cell, run.run_id, len(batch)),), False))
    return units


class SweepRunner:
    """Runs a grid against one model and one store: a loaded model in this process, or workers that each hold one
    (:class:`kvlab.runs.cluster.SweepWorkers`). Either way this object alone writes to the store."""

    def __init__(
        self,
        model: LoadedModel | UnitExecutor,
        store: Store,
        grid: SweepGrid,
        *,
        started_by: str | None = None,
        progress: Progress | None = None,
        should_stop: Callable[[], bool] | None = None,
    ) -> None:
        self.executor: UnitExecutor = InProcess(model) if isinstance(model, LoadedModel) else model
        self.executor.check_fits(grid)
        self.store, self.grid = store, grid
        self.started_by = started_by
        self.progress = progress or (lambda done, total, label: None)
        self.should_stop = should_stop or (lambda: False)
        self.summary = SweepSummary()
        self._done = 0
        self._total = 0

    def config(self, cell: Cell, context: int) -> RunConfig:
        """The stored configuration of a cell's run at one context length: what finds the run again."""
        return self.executor.config(self.grid, cell, context)

    def _store(self, job: UnitJob, trials: list[Trial]) -> None:
        """Store a job's trials (those the run already has are skipped) and report its items done."""
        self.summary.ran += self.store.add_trials(job.run_id, trials)
        self._done += job.counted
        self.progress(self._done, self._total, job.cell.label)

    def _pending_runs(self, plan: SweepPlan) -> list[PendingRun]:
        """Each cell's run at each context length, begun (or found again) in the store, with the items it still
        needs."""
        runs = []
        for context, items in plan.items.items():
            for index, cell in enumerate(self.grid.cells()):
                run_id = self.store.begin_run(plan.configs[(context, index)], started_by=self.started_by)
                self.summary.run_ids.append(run_id)
                stored = self.store.stored_trials(run_id)
                _check_same_prompts(run_id, stored, items)
                pending = [(key, item) for key, item in items if key not in stored]
                self.summary.skipped += len(items) - len(pending)
                runs.append(PendingRun(context, cell, run_id, pending))
        return runs

    def run(self) -> SweepSummary:
        """Run every pending trial of the grid; mark each run finished once its last unit is stored, or interrupted
        if stopped or killed before."""
        runs = self._pending_runs(self.executor.prepare(self.grid))
        units = work_units(self.grid, runs)
        self._total = sum(len(run.pending) for run in runs)
        self.progress(0, self._total, "starting")
        open_jobs = Counter(job.run_id for unit in units for job in unit.jobs)
        for run in runs:
            if run.run_id not in open_jobs:
                self.store.finish_run(run.run_id)
        try:
            for _, job, trials in self.executor.results(self.grid, units, self._stop_requested):
                self._store(job, trials)
                open_jobs[job.run_id] -= 1
                if not open_jobs[job.run_id]:
                    del open_jobs[job.run_id]
                    self.store.finish_run(job.run_id)
        finally:
            for run_id in open_jobs:
                self.store.finish_run(run_id, "interrupted")
        return self.summary

    def _stop_requested(self) -> bool:
        if self.should_stop():
            self.summary.stopped = True
        return self.summary.stopped


def _check_same_prompts(run_id: int, stored: dict[str, str | None], items: Sequence[tuple[str, TaskItem]]) -> None:
    """Refuse to resume a run whose stored trials answered other prompts than the ones now generated for the same
    keys: mixing them would report an accuracy over two different tasks as one."""
    for key, item in items:
        known = stored.get(key)
        if known is not None and known != item.content_hash:
            raise KvlabError(
                f"Run {run_id} already holds trial {key!r} measured on a different prompt than the one "
                "generated now; the task's data changed under the same settings, so start a new "
                "database rather than mix the two."
            )


def parse_policies(names: str, params: Sequence[str] = ()) -> tuple[Variant, ...]:
    """Variants from a comma list of policies, each optionally with its own parameters and cache options in
    brackets, so that one policy can take part several times (``h2o,h2o[layer_allocation=preset],h2o[hot=0.25,
    key_bits=4,value_bits=4]``), and with ``policy.key=value`` parameters addressed to every listed variant of one
    policy by name."""
    variants = [_variant(text) for text in _split_outside_brackets(names)]
    per_policy: dict[str, list[str]] = {name: [] for name, _ in variants}
    for pair in params:
        target, dot, rest = pair.partition(".")
        if not dot or target not in per_policy:
            raise KvlabError(f"Sweep parameters are written policy.key=value for a listed policy, not {pair!r}.")
        per_policy[target].append(rest)
    chosen = tuple(configure(name, **parse_params(name, own + per_policy[name])) for name, own in variants)
    seen: set[str] = set()
    for variant in chosen:
        identity = canonical_json([variant.name, variant.params()])
        if identity in seen:
            raise KvlabError(f"Policy {variant.name!r} is listed twice with the same parameters.")
        seen.add(identity)
    return chosen


def format_variant(name: str, params: Sequence[tuple[str, object]]) -> str:
    """A policy with its own parameters as :func:`parse_policies` reads it: ``h2o``, or
    ``h2o[hot=0.25,key_bits=4,value_bits=4]``."""
    pairs = ",".join(f"{key}={value}" for key, value in params)
    return f"{name}[{pairs}]" if pairs else name


def _split_outside_brackets(text: str) -> list[str]:
    """The comma-separated parts of ``text``, commas inside ``[...]`` kept with their part."""
    parts, depth, current = [], 0, ""
    for character in text:
        depth += {"[": 1, "]": -1}.get(character, 0)
        if character == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += character
    parts.append(current)
    return [part.strip() for part in parts if part.strip()]


def _variant(text: str) -> tuple[str, list[str]]:
    """A policy's name and its own ``key=value`` parameters from ``name`` or ``name[key=value,...]``."""
    name, bracket, rest = text.partition("[")
    if not bracket:
        return name.strip().lower(), []
    if not rest.endswith("]") or "[" in rest[:-1] or "]" in rest[:-1]:
        raise KvlabError(f"A policy with parameters is written name[key=value,...], not {text!r}.")
    return name.strip().lower(), [pair.strip() for pair in rest[:-1].split(",") if pair.strip()]
