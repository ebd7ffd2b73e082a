"""Sweeps: policies x budgets x modes x context lengths x depths x trials, stored trial by trial.

Every cell of the grid answers the same items (the same haystack windows, facts and depths, drawn from the seed),
so policies are compared like with like. A grid asks needle questions of one kind, or RULER's tasks
(:mod:`kvlab.tasks.ruler`): then each trial is one item of one task, its needles at depths the task draws itself.
A cell at one context length is one stored run; each answered item is one trial, stored as soon as its batch
finishes. Re-running a sweep finds its runs by their configuration and skips the trials already stored, so an
interrupted sweep loses at most the batch in flight and never duplicates a trial.

Policies in ``prefill`` mode share one read of each batch of contexts (:func:`kvlab.engine.prefill_once`): the
context is read once, remembering what every policy needs, and each policy compresses its own fork of that cache.
``streaming``-mode policies evict while reading, so each reads for itself.
"""

from __future__ import annotations

import hashlib
import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal, cast

import torch

from kvlab.budget import Budget, check_budget
from kvlab.engine import MODES, GenerationResult, Mode, Prefilled, RunSpec, generate, prefill_once
from kvlab.errors import KvlabError, shown_name
from kvlab.layouts import DEFAULT_COMPACT_AT, DEFAULT_LAYOUT, HeapLayout
from kvlab.limits import check_seed
from kvlab.models import LoadedModel
from kvlab.policies import Policy, make_policy
from kvlab.records import batch_trials, needle_sources_hash, run_config, stops_for
from kvlab.store import RunConfig, Store
from kvlab.store.rows import canonical_json
from kvlab.tasks.facts import TRAIN_TEMPLATES, Fact, make_fact
from kvlab.tasks.items import TaskItem, from_needle, from_ruler
from kvlab.tasks.needle import Kind, build_needle, load_haystacks
from kvlab.tasks.ruler import RULER_SOURCES, RULER_TASKS, check_tasks, ruler_item, task_set_name

Progress = Callable[[int, int, str], None]
#: What a grid asks: needle questions of one kind, or the RULER tasks of ``SweepGrid.ruler_tasks``.
GridKind = Kind | Literal["ruler"]


@dataclass(frozen=True)
class Cell:
    """One policy at one budget in one mode: a stored run per context length."""

    policy: Policy
    keep: float | None
    mode: Mode

    @property
    def label(self) -> str:
        keep = "" if self.keep is None else f" keep {self.keep:g}"
        return f"{self.policy.name}{keep} {self.mode}"


@dataclass(frozen=True)
class SweepGrid:
    """The grid to run. ``depths=None`` puts each trial's needle at a random depth (seeded). With ``kind="ruler"``,
    every cell answers ``trials`` items of each of ``ruler_tasks`` (RULER's names), and ``depths`` must be None:
    RULER's tasks draw their needles' depths themselves."""

    policies: tuple[Policy, ...]
    keeps: tuple[float, ...]
    contexts: tuple[int, ...]
    depths: tuple[float, ...] | None
    trials: int
    modes: tuple[str, ...] = ("prefill",)
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

    def __post_init__(self) -> None:
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
            raise KvlabError("A sweep needs at least one mode (prefill, streaming).")
        if self.max_new_tokens < 1:
            raise KvlabError(f"A sweep must generate at least one token per answer, not {self.max_new_tokens}.")
        check_seed(self.seed)
        HeapLayout(self.layout, self.compact_at)  # type: ignore[arg-type]
        if self.trials < 1:
            raise KvlabError(f"A sweep needs at least one trial per cell, not {self.trials}.")
        if self.batch_size < 1:
            raise KvlabError(f"The batch size must be at least 1, not {self.batch_size}.")
        for mode in self.modes:
            if mode not in MODES:
                raise KvlabError(f"Unknown mode {mode!r}; use 'prefill' or 'streaming'.")
        for keep in self.keeps:
            Budget(keep=keep)
        for depth in self.depths or ():
            if not 0.0 <= depth <= 1.0:
                raise KvlabError(f"A needle depth must lie in [0, 1], not {depth}.")
        if any(p.evicts for p in self.policies) and not self.keeps:
            raise KvlabError(
                "Policies that take a budget (evicting ones, and sparse readers) need at least one kept fraction "
                "(--keep)."
            )
        for cell in self.cells():
            for context in self.contexts:
                check_budget(cell.policy, Budget(keep=cell.keep) if cell.keep is not None else None, context)

    def check_fits(self, loaded: LoadedModel) -> None:
        """Refuse, before anything runs or is stored, a context that with its answer does not fit the model, and a
        RULER task whose first item does not fit its context (its instructions and lists alone are longer)."""
        for context in self.contexts:
            loaded.limits.check(context, self.max_new_tokens, shown_name(loaded.name))
            if self.kind == "ruler":
                for task in self.ruler_tasks:
                    ruler_item(loaded.tokenizer, task, context, _item_rng(self, context, f"{task}/trial=0"))

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
        return cell.mode == "prefill" and cell.policy.evicts and self.share_prefill

    def cells(self) -> list[Cell]:
        """Every (policy, keep, mode) of the grid; ``full`` once, in the first mode (it keeps everything)."""
        cells: list[Cell] = []
        for policy in self.policies:
            if not policy.evicts:
                cells.append(Cell(policy, None, cast(Mode, self.modes[0])))
                continue
            cells.extend(Cell(policy, keep, cast(Mode, mode)) for mode in self.modes for keep in self.keeps)
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
    (:func:`~kvlab.records.needle_sources_hash`: the haystacks, which are RULER's essay, and the needle helpers)
    and the RULER generators with their word lists (:data:`~kvlab.tasks.ruler.RULER_SOURCES`)."""
    digest = hashlib.sha256(needle_sources_hash(task, "sweep").encode() + b"\n")
    for path in RULER_SOURCES:
        digest.update(path.name.encode() + b"\n" + hashlib.sha256(path.read_bytes()).hexdigest().encode() + b"\n")
    return digest.hexdigest()


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
        item = ruler_item(loaded.tokenizer, task, context, _item_rng(grid, context, key))
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
        item = build_needle(tokenizer, haystack, context, depth, fact, distractors=distractors, rng=rng)
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


class SweepRunner:
    """Runs a grid against one model and one store."""

    def __init__(
        self,
        loaded: LoadedModel,
        store: Store,
        grid: SweepGrid,
        *,
        started_by: str | None = None,
        progress: Progress | None = None,
        should_stop: Callable[[], bool] | None = None,
    ) -> None:
        grid.check_fits(loaded)
        self.loaded, self.store, self.grid = loaded, store, grid
        self.started_by = started_by
        self.progress = progress or (lambda done, total, label: None)
        self.should_stop = should_stop or (lambda: False)
        self.stops = stops_for(loaded, one_line_answers=True)
        self.summary = SweepSummary()
        self._done = 0
        self._total = 0

    def config(self, cell: Cell, context: int) -> RunConfig:
        """The stored configuration of a cell's run at one context length: what finds the run again."""
        return run_config(
            self.loaded,
            self._spec(cell),
            task=self.grid.task,
            task_hash=self.grid.task_hash,
            stop_rule=self.stops.rule,
            query_aware=self.grid.query_aware,
            context_length=context,
        )

    def _spec(self, cell: Cell) -> RunSpec:
        budget = Budget(keep=cell.keep) if cell.keep is not None else None
        return RunSpec(
            cell.policy,
            budget,
            mode=cell.mode,
            chunk=self.grid.chunk,
            max_new_tokens=self.grid.max_new_tokens,
            stop_token_ids=self.stops.token_ids,
            seed=self.grid.seed,
            layout=self.grid.layout,
            compact_at=self.grid.compact_at,
            static=self.grid.static,
        )

    def _store(
        self,
        run_id: int,
        batch: Sequence[tuple[str, TaskItem]],
        result: GenerationResult,
        label: str,
        counted: int,
    ) -> None:
        """Store a batch's trials (those the run already has are skipped) and report ``counted`` more done."""
        self.summary.ran += self.store.add_trials(run_id, batch_trials(batch, result))
        self._done += counted
        self.progress(self._done, self._total, label)

    def run(self) -> SweepSummary:
        """Run every pending trial of the grid; mark runs finished, or interrupted if stopped or killed."""
        cells = self.grid.cells()
        plan = []
        # every item first: a context too short for one of them is refused before any run is stored
        items_at = {context: grid_items(self.loaded, self.grid, context) for context in self.grid.contexts}
        for context, items in items_at.items():
            for cell in cells:
                run_id = self.store.begin_run(self.config(cell, context), started_by=self.started_by)
                self.summary.run_ids.append(run_id)
                stored = self.store.stored_trials(run_id)
                _check_same_prompts(run_id, stored, items)
                pending = [(key, item) for key, item in items if key not in stored]
                self.summary.skipped += len(items) - len(pending)
                plan.append((context, cell, run_id, pending))
        self._total = sum(len(pending) for *_, pending in plan)
        self.progress(0, self._total, "starting")
        open_runs = {run_id for *_, run_id, pending in plan if pending}
        for *_, run_id, pending in plan:
            if not pending:
                self.store.finish_run(run_id)
        try:
            for context in self.grid.contexts:
                cells_here = [
                    (cell, run_id, pending) for ctx, cell, run_id, pending in plan if ctx == context and pending
                ]
                self._run_context(cells_here)
                for _, run_id, _ in cells_here:
                    if not self.summary.stopped:
                        self.store.finish_run(run_id)
                        open_runs.discard(run_id)
                if self.summary.stopped:
                    break
        finally:
            for run_id in open_runs:
                self.store.finish_run(run_id, "interrupted")
        return self.summary

    def _stop_requested(self) -> bool:
        if self.should_stop():
            self.summary.stopped = True
        return self.summary.stopped

    def _run_context(self, cells: list[tuple[Cell, int, list[tuple[str, TaskItem]]]]) -> None:
        shared = [c for c in cells if self.grid.shares_read(c[0])]
        alone = [c for c in cells if c not in shared]
        if shared:
            self._run_shared(shared)
        for cell, run_id, pending in alone:
            for batch in shape_batches(pending, self.grid.batch_size, self.grid.query_aware):
                if self._stop_requested():
                    return
                context, question = prompt_tensors(batch, self.grid.query_aware, self.loaded.device)
                result = generate(self.loaded, context, self._spec(cell), suffix_ids=question)
                self._store(run_id, batch, result, cell.label, len(batch))

    def _run_shared(self, cells: list[tuple[Cell, int, list[tuple[str, TaskItem]]]]) -> None:
        """Prefill-mode cells: read each batch once, then let every cell that still needs it compress a fork."""
        union: dict[str, TaskItem] = {}
        for _, _, pending in cells:
            union.update(pending)
        wanted = {run_id: {key for key, _ in pending} for _, run_id, pending in cells}
        for batch in shape_batches(sorted(union.items()), self.grid.batch_size, self.grid.query_aware):
            if self._stop_requested():
                return
            keys = {key for key, _ in batch}
            needing = [(cell, run_id) for cell, run_id, _ in cells if wanted[run_id] & keys]
            context, question = prompt_tensors(batch, self.grid.query_aware, self.loaded.device)
            prefilled: Prefilled = prefill_once(
                self.loaded, context, [cell.policy for cell, _ in needing], chunk=self.grid.chunk
            )
            for cell, run_id in needing:
                result = generate(self.loaded, None, self._spec(cell), suffix_ids=question, prefilled=prefilled)
                self._store(run_id, batch, result, cell.label, len(wanted[run_id] & keys))


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


def parse_policies(names: str, params: Sequence[str] = ()) -> tuple[Policy, ...]:
    """Policies from a comma list, each optionally with its own parameters in brackets, so that one policy can take
    part several times (``h2o,h2o[layer_allocation=preset],h2o[hot=0.25,key_bits=4,value_bits=4]``), and with
    ``policy.key=value`` parameters addressed to every listed variant of one policy by name."""
    from kvlab.policies import parse_params

    variants = [_variant(text) for text in _split_outside_brackets(names)]
    per_policy: dict[str, list[str]] = {name: [] for name, _ in variants}
    for pair in params:
        target, dot, rest = pair.partition(".")
        if not dot or target not in per_policy:
            raise KvlabError(f"Sweep parameters are written policy.key=value for a listed policy, not {pair!r}.")
        per_policy[target].append(rest)
    policies = tuple(make_policy(name, **parse_params(name, own + per_policy[name])) for name, own in variants)
    seen: set[str] = set()
    for policy in policies:
        identity = canonical_json([policy.name, policy.params()])
        if identity in seen:
            raise KvlabError(f"Policy {policy.name!r} is listed twice with the same parameters.")
        seen.add(identity)
    return policies


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
