"""A live run as data: the prompt, the settings, the trace of the engine's events, and how it is stored.

The live page reads a prompt under a policy and redraws after every event. Everything it draws comes from a
:class:`LiveTrace`, which keeps, per observed forward pass, the attention statistics the engine measured and which
key positions the cache held during that pass, and, after every event, the physical bytes and the survivors. The
trace is plain numpy, so the figure builders are pure functions of it and can be tested without a model.

:class:`LiveRun` drives :class:`kvlab.engine.generation.Generation` one event at a time; the engine times itself
(drawing between events is not counted), so the stored prefill and decode seconds are the engine's, not the page's, and
a live run is stored from the same :class:`~kvlab.engine.generation.GenerationResult` as any other run. It runs only
while it holds the device (:meth:`LiveRun.on_device`), so that sessions sharing one GPU take turns.
"""

from __future__ import annotations

import contextlib
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import numpy as np
import torch

from kvlab.attention.stats import StatsRequest
from kvlab.budget import Budget
from kvlab.cache.layouts import DEFAULT_COMPACT_AT, DEFAULT_LAYOUT
from kvlab.engine.events import Event, GenerationResult
from kvlab.engine.generation import Generation
from kvlab.engine.plan import layer_profile
from kvlab.engine.spec import RunSpec
from kvlab.errors import KvlabError
from kvlab.models.limits import check_seed
from kvlab.models.loading import LoadedModel
from kvlab.modes import STREAMING, check_mode
from kvlab.policies import Variant, configure, make_policy
from kvlab.runs.device_queue import DeviceQueue, Waiting
from kvlab.runs.records import needle_sources_hash, stops_for
from kvlab.tasks.facts import TEMPLATES, make_fact
from kvlab.tasks.items import TaskItem, item_hash, prompt_ids, stop_token_ids, text_ids
from kvlab.tasks.needle import Haystack, build_needle, encode, fact_piece, load_haystacks, score


@dataclass(frozen=True)
class NeedleTask:
    """A generated needle prompt of exactly ``context_tokens`` tokens with one fact at ``depth`` (0 to 1)."""

    context_tokens: int
    depth: float
    template: str = "magic-number"
    seed: int = 0


@dataclass(frozen=True)
class TextTask:
    """A text the user pasted or uploaded, an optional question about it and the expected answer.

    Without a question the model simply continues the text; without an answer the run is shown but not stored,
    since it cannot be scored. ``chat``: a model with a chat template reads the text (and question) as one user
    turn and answers in its own, as it was trained to; off, it reads the text as it is.
    """

    context: str
    question: str = ""
    answer: str = ""
    chat: bool = True


@dataclass(frozen=True)
class LivePrompt:
    """What the model reads, and how the run is filed in the store.

    ``task_hash`` identifies the task's content (a pasted text with its question and answer, or what generated
    needles are made from); ``needle`` is the ``[start, end)`` token range of the fact sentence when there is one,
    so the page can show whether those tokens survived. ``chat`` says whether a chat model reads it in its chat
    template (and so answers in its own turn).
    """

    context_ids: tuple[int, ...]
    question_ids: tuple[int, ...]
    answer: str | None
    task: str
    task_hash: str
    task_id: str
    trial_key: str
    question: str = ""
    depth: float | None = None
    needle: tuple[int, int] | None = None
    seed: int | None = None
    chat: bool = True

    @property
    def context_tokens(self) -> int:
        """Every prompt token, context and question together."""
        return len(self.context_ids) + len(self.question_ids)

    def item(self) -> TaskItem | None:
        """The prompt as a task item to score and store, or None without an expected answer."""
        if self.answer is None:
            return None
        return TaskItem(self.task_id, self.context_ids, self.question_ids, self.answer, self.depth)


@lru_cache(maxsize=4)
def _haystacks(tokenizer: Any) -> tuple[Haystack, ...]:
    """The haystacks tokenised once per tokenizer: tokenising them takes longer than the first chunk of a run."""
    return tuple(load_haystacks(tokenizer))


def find_span(ids: tuple[int, ...], piece: list[int]) -> tuple[int, int] | None:
    """Where ``piece`` first occurs in ``ids``, as ``[start, end)``."""
    width = len(piece)
    for start in range(len(ids) - width + 1):
        if list(ids[start : start + width]) == piece:
            return start, start + width
    return None


def build_prompt(loaded: LoadedModel, task: NeedleTask | TextTask) -> LivePrompt:
    """The prompt of a task, in the format the tokenizer's model expects."""
    tokenizer = loaded.tokenizer
    if isinstance(task, NeedleTask):
        template = TEMPLATES.get(task.template)
        if template is None:
            raise KvlabError(f"Unknown fact template {task.template!r}; choose one of {', '.join(TEMPLATES)}.")
        check_seed(task.seed)
        rng = random.Random(f"live/{task.seed}")
        fact = make_fact(template, rng)
        haystacks = _haystacks(tokenizer)
        item = build_needle(
            tokenizer, haystacks[task.seed % len(haystacks)], task.context_tokens, task.depth, fact, rng=rng
        )
        return LivePrompt(
            context_ids=item.context_ids,
            question_ids=item.question_ids,
            answer=item.answer,
            task="needle",
            task_hash=needle_sources_hash("single", "live"),
            task_id=f"needle-live-{template.name}-{task.seed}",
            trial_key=f"live/depth={task.depth:.4f}/template={template.name}/seed={task.seed}",
            question=fact.question,
            depth=item.depth,
            needle=find_span(item.context_ids, encode(tokenizer, fact_piece(fact.statements[0]))),
            seed=task.seed,
        )
    if not task.context.strip():
        raise KvlabError("There is no text to read; paste a text or upload a UTF-8 text file.")
    loaded.limits.check_text(task.context + task.question, "The text")
    if task.question.strip():
        context_ids, question_ids = prompt_ids(tokenizer, task.context, task.question.strip(), chat=task.chat)
    else:
        context_ids, question_ids = text_ids(tokenizer, task.context, chat=task.chat), ()
    answer = task.answer.strip() or None
    digest = item_hash(context_ids, question_ids, answer)
    return LivePrompt(
        context_ids=context_ids,
        question_ids=question_ids,
        answer=answer,
        task="text",
        task_hash=digest,
        task_id=f"text-{digest[:8]}",
        trial_key=f"live/text={digest[:16]}",
        question=task.question.strip(),
        chat=task.chat,
    )


@dataclass(frozen=True)
class LiveSettings:
    """How to run: policy and parameters, budget, mode, chunk, tokens to generate, and what to observe.

    ``query_aware`` reads the question with the context, before any compression (what kvlab's sweeps do);
    otherwise the question is read after prefill mode's compression, which the cache must then serve blind.
    ``layout`` and ``compact_at`` choose what the KV heap does with evicted slots (:mod:`kvlab.cache.heap`).
    """

    policy: str
    params: dict[str, object] = field(default_factory=dict)
    budget: Budget | None = None
    mode: str = STREAMING
    chunk: int = 256
    max_new_tokens: int = 24
    query_aware: bool = True
    layout: str = DEFAULT_LAYOUT
    compact_at: float = DEFAULT_COMPACT_AT
    n_bins: int = 128
    n_sink: int = 4

    def checked_variant(self, loaded: LoadedModel | None = None) -> Variant:
        """The policy with its parameters and cache options, refused in one sentence where it cannot run as set: a
        bad combination of its options (key bits below 16 while every kept token stays at 16 bits), a mode its
        options cannot run in (precision tiers in streaming mode), or, on ``loaded``, layer budgets that follow an
        attention profile the model does not have yet (the sentence names the command that measures it)."""
        variant = configure(self.policy, **self.params)
        variant.check_mode(self.mode)
        if loaded is not None:
            layer_profile(loaded, variant.cache())
        return variant


def prompt_tokens(loaded: LoadedModel, task: NeedleTask | TextTask) -> int | None:
    """How many tokens the task's prompt will have, before a run: a needle prompt's asked length, a text's once
    tokenised; ``None`` for a text that cannot be read (the run says why)."""
    if isinstance(task, NeedleTask):
        return task.context_tokens
    try:
        return build_prompt(loaded, task).context_tokens
    except KvlabError:
        return None


@dataclass
class ObservedStep:
    """One forward pass as the engine observed it.

    ``pooled`` is the attention share per key bin (mean over the pass's queries and the layer's query heads),
    ``held`` the number of distinct key positions per bin that some KV head of the layer held during the pass
    (zero: evicted or not yet read), ``sinks_held`` how many of the first ``n_sink`` positions each layer held,
    ``entropy`` (nats) and ``sink_mass`` (attention share on the first ``n_sink`` positions) per layer and query
    head.
    """

    kind: str
    first_position: int
    end_position: int
    pooled: np.ndarray
    held: np.ndarray
    sinks_held: np.ndarray
    entropy: np.ndarray
    sink_mass: np.ndarray


@dataclass(frozen=True)
class MemoryPoint:
    """The heap after one event: ``kv_bytes`` in the slots holding a token and ``kv_reserved_bytes`` in its
    tensors (both measured from the tensors held), ``kv_bytes_full`` computed; the dead share and the compactions
    so far; and ``demoted_bytes``, what demotion holds in each of :data:`kvlab.cache.demotion.TIERS` (``None`` in a run
    that deletes what it evicts)."""

    kind: str
    seen_tokens: int
    kv_bytes: int
    kv_bytes_full: int
    kv_reserved_bytes: int = 0
    dead_share: float = 0.0
    compactions: int = 0
    demoted_bytes: dict[str, int] | None = None


@dataclass(frozen=True)
class EventMark:
    """What the trace held right after one event, so that a replay can show the run as it stood then: how many
    observed passes and generated tokens there were, and the positions each layer's KV heads held (a ``[layers,
    kv_heads, span]`` mask packed into bits along the positions, a few KiB per event)."""

    observed: int
    tokens: int
    held: np.ndarray


@dataclass
class LiveTrace:
    """Everything the live figures draw, accumulated event by event (first sequence of the batch).

    Key positions are pooled into ``n_bins`` bins over ``[0, span)``, the same bins as the engine's pooled
    attention rows, so a bin's attention share and what the cache held in it line up.
    """

    num_layers: int
    prompt_tokens: int
    max_new_tokens: int
    n_bins: int
    n_sink: int
    needle: tuple[int, int] | None = None
    observed: list[ObservedStep] = field(default_factory=list)
    memory: list[MemoryPoint] = field(default_factory=list)
    survivors: list[np.ndarray] = field(default_factory=list)
    seen_tokens: int = 0
    token_ids: list[int] = field(default_factory=list)
    history: list[EventMark] = field(default_factory=list)

    @property
    def span(self) -> int:
        """Positions the run can reach: the prompt and every token it may generate (the engine's bin range)."""
        return self.prompt_tokens + self.max_new_tokens

    def status(self) -> str:
        """Where the run is, in words."""
        if self.token_ids:
            return f"Decoding: {len(self.token_ids)} of at most {self.max_new_tokens} tokens generated."
        return f"Reading the prompt: {min(self.seen_tokens, self.prompt_tokens):,} of {self.prompt_tokens:,} tokens."

    @property
    def demotes(self) -> bool:
        """Whether the run demotes what it evicts (its events carry the tiers' bytes)."""
        return any(point.demoted_bytes is not None for point in self.memory)

    def redraw_due(self, every: int) -> bool:
        """Whether the page should redraw after the latest event: after every prefill pass and compression, and
        after the first and every ``every``-th decoded token."""
        last = self.memory[-1] if self.memory else None
        return last is None or last.kind != "decode" or len(self.token_ids) % every == 1

    def bin_of(self, positions: np.ndarray) -> np.ndarray:
        """The bin of each position, by the formula the engine's statistics use."""
        request = StatsRequest(n_bins=self.n_bins, span=self.span)
        return request.bin_of(torch.as_tensor(positions)).numpy()

    def bin_edges(self) -> np.ndarray:
        """The first position of each bin, and ``span`` at the end (``n_bins + 1`` values)."""
        first = -(-np.arange(self.n_bins + 1) * self.span // self.n_bins)
        first[-1] = self.span
        return first

    def held_during(self, survivors: list[np.ndarray], new: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Distinct positions per layer and bin among ``survivors`` (any KV head) and the ``new`` positions, and
        how many of the first ``n_sink`` positions each layer holds. Linear in the span, whatever the heads."""
        held = np.zeros((self.num_layers, self.span), dtype=bool)
        for layer, positions in enumerate(survivors):
            held[layer, positions[positions >= 0]] = True
        held[:, new] = True
        running = np.concatenate([np.zeros((self.num_layers, 1), dtype=np.int64), held.cumsum(axis=1)], axis=1)
        edges = self.bin_edges()
        return running[:, edges[1:]] - running[:, edges[:-1]], running[:, min(self.n_sink, self.span)]

    def add(self, event: Event) -> None:
        """Record one event. A pass's statistics belong to the keys held during it: the survivors of the previous
        event plus the positions the pass read."""
        new = np.arange(self.seen_tokens, event.seen_tokens, dtype=np.int64)
        if event.stats is not None:
            held, sinks = self.held_during(self.survivors, new)
            self.observed.append(
                ObservedStep(
                    kind=event.kind,
                    first_position=self.seen_tokens,
                    end_position=event.seen_tokens,
                    pooled=event.stats["pooled"][:, 0, :].float().numpy(),
                    held=held,
                    sinks_held=sinks,
                    entropy=event.stats["entropy"][:, 0, :].float().numpy(),
                    sink_mass=event.stats["sink_mass"][:, 0, :].float().numpy(),
                )
            )
        self.memory.append(
            MemoryPoint(
                event.kind,
                event.seen_tokens,
                event.kv_bytes,
                event.kv_bytes_full,
                event.kv_reserved_bytes,
                event.dead_share,
                event.compactions,
                None if event.demoted_bytes is None else dict(event.demoted_bytes),
            )
        )
        self.survivors = [positions[0].numpy() for positions in event.survivors()]
        self.seen_tokens = event.seen_tokens
        if event.kind == "decode" and event.token_ids:
            self.token_ids.append(event.token_ids[0])
        self.history.append(EventMark(len(self.observed), len(self.token_ids), self.held_bits(self.survivors)))

    def held_bits(self, survivors: list[np.ndarray]) -> np.ndarray:
        """Which positions each layer's KV heads hold, as a ``[layers, kv_heads, span]`` mask packed into bits."""
        heads = max((positions.shape[0] for positions in survivors if positions.ndim > 1), default=1)
        mask = np.zeros((self.num_layers, heads, self.span), dtype=bool)
        for layer, positions in enumerate(survivors):
            rows = positions.reshape(-1, positions.shape[-1]) if positions.size else positions.reshape(heads, 0)
            head, column = np.nonzero(rows >= 0)  # a head holding fewer tokens (Ada-KV) ends in free entries
            mask[layer, head, rows[head, column]] = True
        return np.packbits(mask, axis=-1)

    def at(self, event: int) -> LiveTrace:
        """The trace as it stood right after event ``event`` (0-based; negative counts from the end): what a
        replay draws at that point."""
        mark = self.history[event]
        index = range(len(self.history))[event]
        mask = np.unpackbits(mark.held, axis=-1, count=self.span).astype(bool)
        return LiveTrace(
            num_layers=self.num_layers,
            prompt_tokens=self.prompt_tokens,
            max_new_tokens=self.max_new_tokens,
            n_bins=self.n_bins,
            n_sink=self.n_sink,
            needle=self.needle,
            observed=self.observed[: mark.observed],
            memory=self.memory[: index + 1],
            survivors=[held_positions(layer) for layer in mask],
            seen_tokens=self.memory[index].seen_tokens,
            token_ids=self.token_ids[: mark.tokens],
            history=self.history[: index + 1],
        )

    def kept_per_layer(self) -> list[int]:
        """Tokens each layer holds now per KV head (the mean over heads where they hold different numbers)."""
        heads = [positions.shape[0] if positions.ndim > 1 else 1 for positions in self.survivors]
        return [round(int((positions >= 0).sum()) / count) for positions, count in zip(self.survivors, heads)]

    def needle_held(self) -> float | None:
        """The share of the needle's tokens the cache still holds (any KV head), averaged over layers; None
        without a needle."""
        if self.needle is None or not self.survivors:
            return None
        wanted = np.arange(*self.needle)
        return float(np.mean([np.isin(wanted, positions.ravel()).mean() for positions in self.survivors]))


class RedrawClock:
    """When a running page redraws: after the events :meth:`LiveTrace.redraw_due` names, but at most once every
    ``interval_s`` seconds (the first at once). Every redraw sends six figures to the browser, which draws them on
    the same machine's cores as the model on a small server; the finished run is drawn in full anyway."""

    def __init__(self, interval_s: float, every_decoded: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.interval_s, self.every_decoded, self.clock = interval_s, every_decoded, clock
        self.last: float | None = None

    def due(self, trace: LiveTrace) -> bool:
        """Whether to redraw after ``trace``'s latest event (and, if so, the clock starts again)."""
        if not trace.redraw_due(self.every_decoded):
            return False
        now = self.clock()
        if self.last is not None and now - self.last < self.interval_s:
            return False
        self.last = now
        return True


@dataclass(frozen=True)
class LiveOutcome:
    """A finished live run: the engine's result (measured bytes, the engine's own seconds) and, when the prompt
    has an expected answer, how the output scored against it."""

    result: GenerationResult
    contains: bool | None
    exact: bool | None

    @property
    def text(self) -> str:
        """What the model generated."""
        return self.result.texts[0]


class LiveRun:
    """One live generation: the engine's events, each recorded in :attr:`trace` before it is handed on."""

    def __init__(self, loaded: LoadedModel, prompt: LivePrompt, settings: LiveSettings) -> None:
        variant = settings.checked_variant(loaded)
        budget = settings.budget if variant.policy.evicts else None
        self.stops = stops_for(
            loaded, one_line_answers=prompt.answer is not None or bool(prompt.question_ids), chat=prompt.chat
        )
        self.spec = RunSpec(
            variant.policy,
            budget,
            mode=check_mode(settings.mode),
            chunk=settings.chunk,  # RunSpec checks it
            max_new_tokens=settings.max_new_tokens,
            stop_token_ids=self.stops.token_ids,
            seed=prompt.seed or 0,
            stats=StatsRequest(settings.n_sink, settings.n_bins),
            cache=variant.cache(settings.layout, settings.compact_at),
        )
        together = settings.query_aware or not prompt.question_ids
        context = prompt.context_ids + prompt.question_ids if together else prompt.context_ids
        suffix = None if together else torch.tensor([prompt.question_ids])
        self.loaded, self.prompt, self.settings = loaded, prompt, settings
        self.generation = Generation(loaded, self.spec, torch.tensor([context]), suffix)
        self.trace = LiveTrace(
            loaded.arch.num_layers,
            prompt.context_tokens,
            settings.max_new_tokens,
            settings.n_bins,
            settings.n_sink,
            needle=prompt.needle,
        )

    @property
    def label(self) -> str:
        """What the run is, for the sessions waiting behind it."""
        return f"live run of {self.settings.policy} on {self.prompt.context_tokens:,} tokens"

    @contextlib.contextmanager
    def on_device(
        self, queue: DeviceQueue, on_wait: Callable[[Waiting], None] | None = None
    ) -> Iterator[Iterator[Event]]:
        """Wait for the device in ``queue`` (``on_wait`` is told the place meanwhile), then hold it for the block,
        which gets :meth:`events`; each event updates the progress that the sessions waiting behind it see."""
        with queue.turn(self.label, on_wait) as ticket:

            def events() -> Iterator[Event]:
                for event in self.events():
                    ticket.progress = event.seen_tokens / self.trace.span
                    yield event

            yield events()

    def events(self) -> Iterator[Event]:
        """Run the generation, yielding each event once the trace has it. A GPU that runs out of memory becomes
        one sentence, and the memory is handed back so the next run can start."""
        for event in self.generation.events():
            self.trace.add(event)
            yield event

    def outcome(self) -> LiveOutcome:
        """The result once :meth:`events` is exhausted."""
        result = self.generation.result()
        verdict = score(result.texts[0], self.prompt.answer) if self.prompt.answer is not None else None
        return LiveOutcome(
            result,
            contains=None if verdict is None else verdict.contains,
            exact=None if verdict is None else verdict.exact,
        )


def warm_up(loaded: LoadedModel) -> None:
    """Pay the one-time costs of a first run at load time, so that a live run's first chart comes promptly: the
    first observed, evicting forward pass of a process (kernel setup, up to seconds on a CPU), tokenising the
    haystacks, and finding the tokenizer's line-break tokens."""
    _haystacks(loaded.tokenizer)
    stop_token_ids(loaded.tokenizer)
    ids = torch.arange(48, dtype=torch.long).remainder(max(len(loaded.tokenizer), 1)).unsqueeze(0)
    spec = RunSpec(
        make_policy("h2o"), Budget(tokens=16), mode=STREAMING, chunk=16, max_new_tokens=2, stats=StatsRequest(4, 16)
    )
    for _ in Generation(loaded, spec, ids).events():
        pass


def held_positions(heads: np.ndarray) -> np.ndarray:
    """The positions each KV head holds, from a ``[kv_heads, span]`` mask, as ``[kv_heads, most held]`` in
    increasing order, a head that holds fewer (Ada-KV) padded with -1, as
    :meth:`kvlab.engine.generation.Event.survivors` gives them."""
    rows = [np.flatnonzero(head) for head in heads]
    most = max((len(row) for row in rows), default=0)
    return (
        np.stack([np.pad(row, (0, most - len(row)), constant_values=-1) for row in rows])
        if rows
        else np.zeros((0, 0), dtype=np.int64)
    )
