"""The side-channel experiment: can someone outside the server tell whether a secret canary is still in the KV cache?

Threat model. A service answers requests with a model whose KV cache evicts tokens (a policy and a budget). The
attacker knows the prompt template: a document read as context, somewhere in which sits a canary sentence ("The
access code of Ingrid is QZ-4471-k9."), and the probing question that may follow it ("What is the access code of
Ingrid?"). They planted the canary, so they know its code, but not where in the document it sits nor the text
around it, and they cannot read the cache. They see what any client sees of a request: the time between streamed
tokens, what an API could report about the cache (its KV bytes and the tokens it keeps), and the answer. They want
one bit per request: is the canary still cached after eviction? That bit says what the eviction chose, which
depends on the rest of the context, which they do not know.

Trials. Each trial is one needle prompt of ``context_tokens`` tokens (:mod:`kvlab.tasks.needle`) holding the canary
with a fresh random code, in a random window of one of kvlab's held-out haystacks, at a depth stratified over a range
(by default the last two budgets' worth of the context: half within the reach of a recency window as long as the
budget, half just before it), so that both classes are well represented for most policies. The same prompt is
answered under every noise level, the levels of one trial back to back in a rotating order, so that a drift of the
device's speed touches all of them alike. Every trial decodes ``new_tokens`` tokens with no stop token: the
answer's length, which a client sees anyway as the answer, then cannot reach the time and byte channels through the
number of steps. One untimed generation per level warms the device up first.

Ground truth comes from the heap: the canary's tokens are those of its code, and the canary is *cached* when at
least half of the (layer, KV head) pairs hold every one of them when the answer begins (after the context and the
question were read and evicted). The share of pairs is kept with each trial, so another cut can be drawn later.

Channels, observed per trial:

* ``decode_time``: the median of the steady half of the decode steps' seconds (``GenerationResult.token_seconds``,
  measured by the engine with the device synchronised);
* ``kv_bytes`` and ``kept_tokens``: the KV bytes in use at the end and the tokens kept over all layers, what a
  serving API could report;
* ``answer``: the share of the code that the answer's first line reproduces from its start;
* ``position``: where the canary sits. Not observed: the reference for what knowing the position alone predicts,
  which is what a noise floor on the ranking is meant to blur.

The attacker's classifier is the simplest one: a threshold on the observable, in either direction, fitted on one
half of the trials for the best balanced accuracy and scored on the other half, which holds as many cached as
evicted trials, so that chance is exactly 50 %. Accuracy comes with a 95 % Wilson interval. An observable with no
spread is no channel at all, and its verdict says so; retrieval accuracy (the code in the answer's first line) with
each noise level gives the price of the noise.

What to expect: a fixed budget holds the same number of tokens whatever it keeps, so the bytes and kept counts are
constant; the heap decodes every step over the same shapes, so the time carries the device's jitter and nothing
else. The answer remains a channel as long as the model retrieves: noise changes *which* tokens survive, not that an
answer shows whether the code did.
"""

from __future__ import annotations

import dataclasses
import json
import random
import statistics
import types
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from os.path import commonprefix
from typing import Any

import torch

from kvlab.attention.backends import DEFAULT_ATTENTION, AttentionBackend
from kvlab.budget import Budget
from kvlab.cache.layouts import DEFAULT_COMPACT_AT, DEFAULT_LAYOUT
from kvlab.engine.generation import Generation
from kvlab.engine.spec import RunSpec
from kvlab.errors import KvlabError
from kvlab.hashing import text_sha256
from kvlab.models.limits import MAX_SEED
from kvlab.models.loading import LoadedModel
from kvlab.modes import PREFILL, check_mode
from kvlab.policies import POLICIES, Variant, configure
from kvlab.policies.base import check_budget
from kvlab.stats import wilson_interval
from kvlab.tasks.facts import TEMPLATES, Fact, make_fact
from kvlab.tasks.needle import build_needle, encode, fact_piece, load_haystacks

#: The canary: one fact of a fixed template and key, so that every probing question has the same tokens.
CANARY_TEMPLATE = TEMPLATES["access-code"]
CANARY_KEY = "Ingrid"
#: What a file written by :func:`SideChannelResult.to_json` says it is.
RESULT_FORMAT = "kvlab-side-channel/1"
#: The observables, by name, as tables and figures name them, with their unit.
CHANNELS: dict[str, str] = {
    "decode_time": "decode time per token",
    "kv_bytes": "KV bytes in use",
    "kept_tokens": "kept-token count",
    "answer": "answer to the probe",
    "position": "canary position (known, not observed)",
}
UNITS: dict[str, str] = {
    "decode_time": "s",
    "kv_bytes": "B",
    "kept_tokens": "tokens",
    "answer": "of the code",
    "position": "of the context",
}
#: The fewest trials that can give both halves a trial of each class.
MIN_TRIALS = 4


@dataclass(frozen=True)
class NoiseLevel:
    """One noise floor the experiment runs under: a kind (``none``, ``gaussian``, ``laplace``) and a scale relative to
    the spread of the policy's scores (:mod:`kvlab.cache.noise`)."""

    kind: str
    scale: float

    @property
    def label(self) -> str:
        """``no noise`` or ``gaussian 0.5``: how tables, figures and trial records name the level."""
        return "no noise" if self.kind == "none" else f"{self.kind} {self.scale:g}"


NO_NOISE = NoiseLevel("none", 0.0)


@dataclass(frozen=True)
class SideChannelSettings:
    """What one experiment runs: a scoring policy (``params`` without its noise, which ``noise`` sets per level) and
    budget, the mode and heap layout, the trials and the prompts' shape. ``depths`` is the range the canary's depth is
    stratified over (None: the last two budgets' worth of the context)."""

    policy: str
    params: dict[str, object]
    budget: Budget
    noise: tuple[NoiseLevel, ...]
    mode: str = PREFILL
    trials: int = 40
    context_tokens: int = 1024
    new_tokens: int = 16
    seed: int = 0
    depths: tuple[float, float] | None = None
    chunk: int | None = None
    layout: str = DEFAULT_LAYOUT
    compact_at: float = DEFAULT_COMPACT_AT
    static: bool | None = None
    attention: AttentionBackend = DEFAULT_ATTENTION

    def __post_init__(self) -> None:
        cls = POLICIES.get(self.policy.lower())
        if cls is None or not cls.ranks:
            scoring = ", ".join(name for name, kind in POLICIES.items() if kind.ranks)
            raise KvlabError(
                f"The side-channel experiment needs a policy that ranks tokens by a score ({scoring}), not "
                f"{self.policy!r}."
            )
        if {"noise", "noise_scale"} & set(self.params):
            raise KvlabError("Set the noise with --noise and --noise-scale, not as policy parameters.")
        if self.trials < MIN_TRIALS:
            raise KvlabError(f"The experiment needs at least {MIN_TRIALS} trials (two per half), not {self.trials}.")
        if self.new_tokens < 2:
            raise KvlabError(f"Decode at least 2 tokens so that a decode step is timed, not {self.new_tokens}.")
        if self.budget.keep == 1.0:
            raise KvlabError("A kept fraction of 1 evicts nothing, so there is no canary to lose; keep less.")
        if self.depths is not None and not 0.0 <= self.depths[0] < self.depths[1] <= 1.0:
            raise KvlabError(f"The canary's depths must be a range within [0, 1], low before high, not {self.depths}.")
        for level in self.levels():  # the policy, mode and heap settings checked as a run checks them
            check_budget(self.run_spec(level, self.seed).policy, self.budget, self.context_tokens)

    def levels(self) -> tuple[NoiseLevel, ...]:
        """No noise first, then each level asked for once (a level of kind ``none`` is no noise)."""
        levels = [NO_NOISE]
        for level in self.noise:
            level = NO_NOISE if level.kind == "none" else level
            if level not in levels:
                levels.append(level)
        return tuple(levels)

    def policy_at(self, level: NoiseLevel) -> Variant:
        """The policy with the noise floor of ``level`` in its cache options (checked with them)."""
        noise: dict[str, object] = {} if level == NO_NOISE else {"noise": level.kind, "noise_scale": level.scale}
        return configure(self.policy, **self.params, **noise)

    def run_spec(self, level: NoiseLevel, seed: int) -> RunSpec:
        """How one trial runs under ``level``: a fixed number of decoded tokens, no stop token."""
        variant = self.policy_at(level)
        return RunSpec(
            variant.policy,
            self.budget,
            mode=check_mode(self.mode),
            chunk=self.chunk,
            max_new_tokens=self.new_tokens,
            stop_token_ids=(),
            seed=seed,
            cache=variant.cache(self.layout, self.compact_at),
            static=self.static,
            attention=self.attention,
        )

    def depth_range(self) -> tuple[float, float]:
        """The range of depths the canary is stratified over."""
        if self.depths is not None:
            return self.depths
        share = self.budget.resolve(self.context_tokens) / self.context_tokens
        return max(0.0, 1.0 - 2.0 * share), 1.0


@dataclass(frozen=True)
class CanaryPrompt:
    """One trial's prompt: the context (BOS, haystack, canary sentence) and the probing question, the canary's code
    and the positions of its tokens in the context, where it sits, and the seed of the trial's noise."""

    index: int
    context_ids: tuple[int, ...]
    question_ids: tuple[int, ...]
    canary: str
    positions: tuple[int, ...]
    depth: float
    haystack: str
    seed: int


def canary_positions(tokenizer: Any, context_ids: Sequence[int], fact: Fact) -> tuple[int, ...]:
    """Positions in ``context_ids`` of the tokens that spell the fact's value (those whose characters overlap it):
    the canary sentence is found as the ids the needle builder inserted, and its characters are mapped to tokens."""
    piece = fact_piece(fact.statements[0])
    ids = encode(tokenizer, piece)
    start = next(
        (at for at in range(len(context_ids) - len(ids) + 1) if list(context_ids[at : at + len(ids)]) == ids), None
    )
    assert start is not None, "the needle builder inserts the sentence's own ids"
    try:
        offsets = tokenizer(piece, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    except NotImplementedError:
        raise KvlabError(
            "The model's tokenizer cannot map tokens to characters, so the canary's tokens are unknown."
        ) from None
    value_start = piece.rindex(fact.values[0])
    value_end = value_start + len(fact.values[0])
    return tuple(start + i for i, (first, last) in enumerate(offsets) if first < value_end and last > value_start)


def trial_seed(seed: int, index: int) -> int:
    """The seed of one trial's noise, drawn from the experiment's seed: distinct trials, distinct draws."""
    return int(text_sha256(f"{seed}/noise/{index}")[:16], 16) & MAX_SEED


def canary_prompts(tokenizer: Any, settings: SideChannelSettings) -> list[CanaryPrompt]:
    """The experiment's prompts: depths evenly stratified over the range and shuffled, codes, haystacks and windows
    drawn from the seed."""
    if tokenizer is None:
        raise KvlabError("The side-channel experiment writes its prompts as text; it needs a model with a tokenizer.")
    haystacks = load_haystacks(tokenizer)
    low, high = settings.depth_range()
    strata = list(range(settings.trials))
    random.Random(f"{settings.seed}/depths").shuffle(strata)
    prompts = []
    for index, stratum in enumerate(strata):
        rng = random.Random(f"{settings.seed}/trial/{index}")
        fact = make_fact(CANARY_TEMPLATE, rng, key=CANARY_KEY)
        haystack = haystacks[rng.randrange(len(haystacks))]
        depth = low + (high - low) * (stratum + 0.5) / settings.trials
        item = build_needle(tokenizer, haystack, settings.context_tokens, depth, fact, rng=rng)
        positions = canary_positions(tokenizer, item.context_ids, fact)
        seed = trial_seed(settings.seed, index)
        prompts.append(
            CanaryPrompt(
                index, item.context_ids, item.question_ids, fact.values[0], positions, item.depth, haystack.name, seed
            )
        )
    return prompts


def held_share(survivors: Sequence[torch.Tensor], positions: Sequence[int]) -> float:
    """The share of (layer, KV head) pairs that hold every one of ``positions``, from one sequence's survivors per
    layer (``Event.survivors()``: ``(1, kv_heads, kept)`` original positions)."""
    canary = torch.tensor(list(positions))
    held = [bool(torch.isin(canary, head).all()) for layer in survivors for head in layer[0]]
    return sum(held) / len(held)


def steady_seconds(token_seconds: Sequence[float]) -> float:
    """Seconds per decode step over the steady half of the steps (after warm-up and any graph capture): the
    median, which one slow step does not move."""
    return statistics.median(token_seconds[len(token_seconds) // 2 :])


def answer_overlap(answer: str, canary: str) -> float:
    """The share of ``canary`` that ``answer`` reproduces from its start."""
    return len(commonprefix([answer, canary])) / len(canary)


@dataclass
class TrialRecord:
    """One prompt answered under one noise level: where the canary sat, what the heap held (the ground truth), what
    the attacker observed, and whether the trial fitted the threshold (``train``) or scored it (``test``)."""

    trial: int
    noise: str
    depth: float
    haystack: str
    canary: str
    positions: list[int]
    held_share: float
    cached: bool
    answer: str
    correct: bool
    observables: dict[str, float]
    token_seconds: list[float]
    decode_graphs: int
    role: str = "train"


def observe(loaded: LoadedModel, spec: RunSpec, prompt: CanaryPrompt, noise: str) -> TrialRecord:
    """Run one prompt and record the heap's truth and the observables. The canary's fate is read at the last event
    before decoding (the context and question read and evicted), where the answer begins."""
    generation = Generation(
        loaded,
        spec,
        torch.tensor([prompt.context_ids], dtype=torch.long),
        torch.tensor([prompt.question_ids], dtype=torch.long),
    )
    share = 0.0
    for event in generation.events():
        if event.kind != "decode":
            share = held_share(event.survivors(), prompt.positions)
    result = generation.result()
    answer = result.texts[0].split("\n", 1)[0].strip()
    observables = {
        "decode_time": steady_seconds(result.token_seconds),
        "kv_bytes": float(result.kv_bytes),
        "kept_tokens": float(sum(result.kept_per_layer)),
        "answer": answer_overlap(answer, prompt.canary),
        "position": prompt.depth,
    }
    return TrialRecord(
        trial=prompt.index,
        noise=noise,
        depth=prompt.depth,
        haystack=prompt.haystack,
        canary=prompt.canary,
        positions=list(prompt.positions),
        held_share=share,
        cached=share >= 0.5,
        answer=answer,
        correct=prompt.canary in answer,
        observables=observables,
        token_seconds=list(result.token_seconds),
        decode_graphs=result.decode_graphs,
    )


@dataclass(frozen=True)
class Threshold:
    """The attacker's classifier: "cached" when the observable lies above ``cut`` (or below it, when not
    ``cached_above``)."""

    cut: float
    cached_above: bool

    def predict(self, value: float) -> bool:
        return (value > self.cut) == self.cached_above


def balanced_accuracy(threshold: Threshold, values: Sequence[float], labels: Sequence[bool]) -> float:
    """The mean of the shares of cached and of evicted trials that ``threshold`` gets right."""
    shares = []
    for cls in (True, False):
        members = [value for value, label in zip(values, labels) if label == cls]
        shares.append(sum(threshold.predict(value) == cls for value in members) / len(members))
    return sum(shares) / 2


def fit_threshold(values: Sequence[float], labels: Sequence[bool]) -> Threshold:
    """The threshold with the best balanced accuracy on the training trials (both classes present): cuts halfway
    between neighbouring values, and one below them all (every trial on one side); the first best wins."""
    distinct = sorted(set(values))
    cuts = [distinct[0] - 1.0] + [(low + high) / 2 for low, high in zip(distinct, distinct[1:])]
    candidates = [Threshold(cut, above) for cut in cuts for above in (True, False)]
    return max(candidates, key=lambda threshold: balanced_accuracy(threshold, values, labels))


def split_roles(labels: Sequence[bool], seed: int) -> list[str]:
    """``test`` for as many cached as evicted trials (half the smaller class each, drawn from ``seed``), ``train``
    for the rest: chance on the test half is exactly 50 %, and no trial is wasted."""
    rng = random.Random(f"{seed}/split")
    cached = [index for index, label in enumerate(labels) if label]
    evicted = [index for index, label in enumerate(labels) if not label]
    rng.shuffle(cached)
    rng.shuffle(evicted)
    each = min(len(cached), len(evicted)) // 2
    test = set(cached[:each] + evicted[:each])
    return ["test" if index in test else "train" for index in range(len(labels))]


@dataclass
class ChannelScore:
    """How well a threshold on one observable tells cached from evicted on the test half of one noise level's
    trials: the fitted threshold, the test trials it got right, the accuracy with its 95 % Wilson interval (None when
    a class had fewer than two trials), the observable's spread over all trials, and the verdict in words."""

    channel: str
    spread: float
    cut: float | None
    cached_above: bool | None
    test_trials: int
    correct: int
    accuracy: float | None
    low: float | None
    high: float | None
    verdict: str


def score_channel(channel: str, values: Sequence[float], labels: Sequence[bool], roles: Sequence[str]) -> ChannelScore:
    """Fit a threshold on the ``train`` trials and score it on the ``test`` ones (see :func:`split_roles`)."""
    spread = max(values) - min(values)
    train = [(value, label) for value, label, role in zip(values, labels, roles) if role == "train"]
    test = [(value, label) for value, label, role in zip(values, labels, roles) if role == "test"]
    if not test:
        cached = sum(labels)
        verdict = (
            f"Not measurable: the canary was cached in {cached} of {len(labels)} trials, and telling the two apart "
            "needs at least two of each."
        )
        return ChannelScore(channel, spread, None, None, 0, 0, None, None, None, verdict)
    threshold = fit_threshold([value for value, _ in train], [label for _, label in train])
    correct = sum(threshold.predict(value) == label for value, label in test)
    low, high = wilson_interval(correct, len(test))
    accuracy = correct / len(test)
    return ChannelScore(
        channel,
        spread,
        threshold.cut,
        threshold.cached_above,
        len(test),
        correct,
        accuracy,
        low,
        high,
        verdict_for(channel, spread, values[0], correct, len(test), low, high),
    )


def verdict_for(channel: str, spread: float, value: float, correct: int, trials: int, low: float, high: float) -> str:
    """One sentence on what a channel told the attacker."""
    score = f"{correct} of {trials} test trials right ({correct / trials:.0%}, 95 % CI {low:.0%} to {high:.0%})"
    if spread == 0:
        shown = f"{value:,.0f}" if value == int(value) else f"{value:.3g}"
        return (
            f"No channel: every trial had the same {CHANNELS[channel]}, {shown} {UNITS[channel]}, so it cannot tell "
            f"a cached canary from an evicted one ({score}, chance)."
        )
    if low > 0.5:
        return f"Leaks: {score}, above chance."
    return f"No signal detected: {score}, which does not exceed chance (50 %)."


@dataclass
class LevelSummary:
    """One noise level's trials: how often the canary stayed cached, how often the probe was answered (retrieval
    accuracy with its 95 % Wilson interval), the median decode time per token (what the noise costs besides
    retrieval), and every channel's score."""

    noise: str
    kind: str
    scale: float
    trials: int
    cached: int
    retrieved: int
    retrieval: float
    retrieval_low: float
    retrieval_high: float
    decode_seconds: float
    channels: list[ChannelScore]


def summarise(level: NoiseLevel, records: Sequence[TrialRecord], seed: int) -> LevelSummary:
    """Split one level's trials into halves (recording each trial's role) and score every channel on them."""
    labels = [record.cached for record in records]
    roles = split_roles(labels, seed)
    for record, role in zip(records, roles):
        record.role = role
    retrieved = sum(record.correct for record in records)
    low, high = wilson_interval(retrieved, len(records))
    channels = [
        score_channel(channel, [record.observables[channel] for record in records], labels, roles)
        for channel in CHANNELS
    ]
    return LevelSummary(
        level.label,
        level.kind,
        level.scale,
        len(records),
        sum(labels),
        retrieved,
        retrieved / len(records),
        low,
        high,
        statistics.median(record.observables["decode_time"] for record in records),
        channels,
    )


@dataclass
class SideChannelResult:
    """A whole experiment: what ran (model, device, policy, budget, prompts), each noise level's summary and every
    trial's record, from which every figure can be redrawn. Written and read as JSON."""

    model: str
    device: str
    dtype: str
    policy: str
    params: dict[str, object]
    mode: str
    keep: float | None
    budget_tokens: int
    context_tokens: int
    new_tokens: int
    trials: int
    seed: int
    depths: tuple[float, float]
    canary_sentence: str
    question: str
    levels: list[LevelSummary]
    records: list[TrialRecord]
    format: str = field(default=RESULT_FORMAT)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: object, name: str = "the file") -> SideChannelResult:
        """A result read back, each field checked against its declared type; anything else is one sentence."""
        if not isinstance(data, dict) or data.get("format") != RESULT_FORMAT:
            raise KvlabError(f"{name} is not a side-channel result of kvlab (written by kvlab sidechannel --out).")
        try:
            result = _typed(cls, data)
        except (KeyError, TypeError, ValueError) as error:
            raise KvlabError(f"{name} is a damaged side-channel result ({error}).") from None
        if not result.levels or not result.records:
            raise KvlabError(f"{name} is a side-channel result with no trials.")
        return result

    def level(self, noise: str) -> LevelSummary:
        return next(level for level in self.levels if level.noise == noise)


def parse_result(data: bytes, name: str) -> SideChannelResult:
    """A result from the bytes of a JSON file (an upload, or a file on disk)."""
    try:
        decoded = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        raise KvlabError(f"{name} is not a JSON file.") from None
    return SideChannelResult.from_json(decoded, name)


def _typed(kind: Any, value: Any) -> Any:
    """``value`` (parsed JSON) as ``kind`` (a dataclass, list, tuple, dict, optional or scalar type), or an error
    naming what does not fit."""
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if isinstance(kind, type) and dataclasses.is_dataclass(kind):
        if not isinstance(value, dict):
            raise TypeError(f"{kind.__name__} must be an object")
        hints = typing.get_type_hints(kind)
        return kind(**{item.name: _typed(hints[item.name], value[item.name]) for item in dataclasses.fields(kind)})
    if origin is types.UnionType:
        if value is None and type(None) in args:
            return None
        return _typed(next(arg for arg in args if arg is not type(None)), value)
    if origin in (list, tuple):
        if not isinstance(value, list) or (origin is tuple and len(value) != len(args)):
            raise TypeError(f"expected a list, got {type(value).__name__}")
        items = [_typed(arg, item) for arg, item in zip(args, value)] if origin is tuple else value
        return tuple(items) if origin is tuple else [_typed(args[0], item) for item in items]
    if origin is dict:
        if not isinstance(value, dict):
            raise TypeError(f"expected an object, got {type(value).__name__}")
        return {str(key): _typed(args[1], item) for key, item in value.items()}
    if kind is object:
        return value
    if kind is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, kind) and not (kind is int and isinstance(value, bool)):
        return value
    raise TypeError(f"expected {kind.__name__}, got {type(value).__name__}")


Progress = Callable[[int, int], None]


def run_side_channel(
    loaded: LoadedModel, settings: SideChannelSettings, progress: Progress | None = None
) -> SideChannelResult:
    """Run every trial under every noise level, then score the channels level by level."""
    prompts = canary_prompts(loaded.tokenizer, settings)
    levels = settings.levels()
    for level in levels:  # warm-up, not recorded: the first generations pay for loading kernels
        observe(loaded, settings.run_spec(level, prompts[0].seed), prompts[0], level.label)
    records: dict[NoiseLevel, list[TrialRecord]] = {level: [] for level in levels}
    for prompt in prompts:
        for turn in range(len(levels)):
            level = levels[(prompt.index + turn) % len(levels)]
            records[level].append(observe(loaded, settings.run_spec(level, prompt.seed), prompt, level.label))
        if progress is not None:
            progress(prompt.index + 1, len(prompts))
    summaries = [summarise(level, records[level], settings.seed) for level in levels]
    question = loaded.tokenizer.decode(list(prompts[0].question_ids))
    return SideChannelResult(
        model=loaded.source.label,
        device=loaded.device_kind,
        dtype=loaded.dtype_name,
        policy=settings.policy.lower(),
        params=settings.policy_at(NO_NOISE).params(),
        mode=settings.mode,
        keep=settings.budget.keep,
        budget_tokens=settings.budget.resolve(len(prompts[0].context_ids)),
        context_tokens=settings.context_tokens,
        new_tokens=settings.new_tokens,
        trials=settings.trials,
        seed=settings.seed,
        depths=settings.depth_range(),
        canary_sentence=CANARY_TEMPLATE.statement(CANARY_KEY, "<code>"),
        question=question.strip(),
        levels=summaries,
        records=[record for level in levels for record in records[level]],
    )
