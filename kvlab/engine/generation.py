"""The generation loop: read a context into the KV heap, let the policy evict, decode greedily.

One :class:`Generation` is one run of one policy over a batch of same-length prompts. It yields an :class:`Event`
after every prefill chunk, after the compression of ``prefill`` mode, and for every decoded token, carrying what the
dashboard draws (token, survivors, live and reserved bytes, requested attention statistics) and the seconds the
engine took to produce it. The generation measures itself: it times every event (the device synchronised, the
consumer's time between events not counted), keeps the peak GPU allocation and the tokens, and gives one
:class:`GenerationResult` at the end (:meth:`Generation.result`), which the command line, ``eval``, sweeps and the
live page all store the same way. :func:`generate` drains the events and returns that result.

Modes:

* ``prefill``: the context is read (in chunks of ``chunk`` tokens, or at once), then compressed once to the budget;
  decoding appends without evicting. Peak memory is the full context.
* ``streaming``: the budget holds the whole time. After every chunk and every decoded token each layer is cut back
  to its budget, so the heap never holds more than budget + chunk tokens per layer.

The heap (:mod:`kvlab.cache.heap`) is planned once per run from the budget and written in place; its layout decides what
becomes of evicted slots. Decoding runs in *static* steps where it can (:mod:`kvlab.engine.static`): on a GPU each step
is captured in a CUDA graph and replayed, with no host synchronisation but reading the generated ids.

Survivors keep their original RoPE positions and every new token gets its true position; the attention function
builds masks from those positions.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from kvlab.attention.function import (
    ForwardContext,
    Observer,
    StatsAccumulator,
    StatsRequest,
    forward_context,
    sdpa_backends,
    window_probabilities,
)
from kvlab.budget import Budget, check_budget
from kvlab.cache.allocation import CAKE_WINDOW, cake_preference
from kvlab.cache.demotion import Demotion, DemotionReport
from kvlab.cache.heap import DeviceClock, HeapLayer, KVHeap, survivors
from kvlab.cache.layouts import DEFAULT_COMPACT_AT, DEFAULT_LAYOUT, HeapLayout
from kvlab.cache.scopes import global_budgets, local_budgets
from kvlab.cache.sparse import ReadCount
from kvlab.cache.tiers import hot_and_cold
from kvlab.engine.profile import require_profile
from kvlab.engine.reconstruction import reconstruct
from kvlab.errors import KvlabError, shown_name
from kvlab.models.loading import LoadedModel, device_name
from kvlab.models.rope import Rope
from kvlab.policies import LayerView, Policy, evict_layer, eviction_count
from kvlab.policies.base import kept_slots
from kvlab.policies.full import Full
from kvlab.policies.scoring import ScoringPolicy

Mode = Literal["prefill", "streaming"]
MODES: tuple[str, ...] = ("prefill", "streaming")
DEFAULT_STREAMING_CHUNK = 256
NO_BUDGET = 1 << 62


@dataclass
class RunSpec:
    """How to run one generation: the policy, its budget, the mode, the heap's layout, and what to observe.

    ``chunk`` is the number of context tokens read per forward pass; ``None`` reads the whole context at once in
    ``prefill`` mode and :data:`DEFAULT_STREAMING_CHUNK` tokens in ``streaming`` mode. ``compression_interval``
    (``streaming`` mode) evicts during decoding once every that many tokens instead of at every token, as kvpress's
    ``DecodingPress`` does: the heap then holds up to budget + interval tokens, which must stay within the chunk so
    that the budget + chunk bound holds. ``layout`` and ``compact_at`` choose what becomes of evicted slots
    (:class:`kvlab.cache.layouts.HeapLayout`). ``static`` chooses how decoding runs: ``None`` in static steps captured
    in CUDA graphs where the run allows it on a GPU, else eagerly; ``True`` in static steps always (eagerly on a CPU:
    the same computation a graph replays); ``False`` eagerly. Decoding is greedy.
    """

    policy: Policy
    budget: Budget | None = None
    mode: Mode = "prefill"
    chunk: int | None = None
    max_new_tokens: int = 32
    stop_token_ids: tuple[int, ...] | None = None
    seed: int = 0
    stats: StatsRequest | None = None
    compression_interval: int = 1
    layout: str = DEFAULT_LAYOUT
    compact_at: float = DEFAULT_COMPACT_AT
    static: bool | None = None

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise KvlabError(f"Unknown mode {self.mode!r}; use 'prefill' or 'streaming'.")
        if self.chunk is not None and self.chunk <= 0:
            raise KvlabError(f"A chunk of {self.chunk} tokens is not possible; it must be a positive number.")
        if self.max_new_tokens < 0:
            raise KvlabError(f"max_new_tokens must be zero or more, not {self.max_new_tokens}.")
        if self.compression_interval < 1:
            raise KvlabError(f"The compression interval must be at least one token, not {self.compression_interval}.")
        self.policy.check_mode(self.mode)
        if self.mode == "streaming" and self.compression_interval > self.chunk_size(self.compression_interval):
            raise KvlabError(
                f"A compression interval of {self.compression_interval} tokens is larger than the chunk of "
                f"{self.chunk_size(self.compression_interval)}; the cache would exceed budget + chunk."
            )
        self.heap_layout()

    def chunk_size(self, context_tokens: int) -> int:
        """Tokens per prefill forward pass."""
        if self.chunk is not None:
            return self.chunk
        return context_tokens if self.mode == "prefill" else DEFAULT_STREAMING_CHUNK

    def heap_layout(self) -> HeapLayout:
        """The layout of the run's heap (checked: an unknown layout or threshold is one sentence)."""
        return HeapLayout(self.layout, self.compact_at)  # type: ignore[arg-type]


@dataclass
class Event:
    """One step of a generation as the dashboard sees it.

    ``kind`` is ``prefill`` (a chunk of context was read), ``compress`` (prefill mode's one eviction) or ``decode``
    (a token was chosen; ``token_ids`` holds it for each sequence). ``kv_bytes`` are the K/V bytes of the slots
    holding a token after the step (live slots times the bytes one slot takes in the heap's tensors) and
    ``kv_reserved_bytes`` those of the heap's tensors (their sizes as allocated); ``kv_bytes_full`` is what a full
    cache of the same dtype and shapes would hold after the same tokens (computed, since no full cache exists).
    ``dead_share`` is the share of free slots among those in use, ``compactions`` the compactions so far. ``stats``
    holds the requested attention statistics of the step's forward pass, as CPU tensors. ``positions`` are the
    heap's position tensors, valid until the generation goes on. ``demoted_bytes`` are the bytes demotion holds in
    each tier (:data:`kvlab.cache.demotion.TIERS`; ``None`` where the run deletes what it evicts). ``seconds`` is the
    wall time the engine took to produce the event, the device synchronised.
    """

    kind: Literal["prefill", "compress", "decode"]
    step: int
    seen_tokens: int
    kept_per_layer: list[int]
    kv_bytes: int
    kv_bytes_full: int
    kv_reserved_bytes: int = 0
    dead_share: float = 0.0
    compactions: int = 0
    token_ids: list[int] | None = None
    stats: dict[str, torch.Tensor] | None = None
    logits: torch.Tensor | None = None
    positions: list[torch.Tensor] = field(default_factory=list, repr=False)
    demoted_bytes: dict[str, int] | None = None
    seconds: float = 0.0

    def survivors(self) -> list[torch.Tensor]:
        """Original positions of the tokens held after this step, per layer, ``(batch, kv_heads, kept)`` in
        increasing order on CPU; where KV heads hold different numbers of tokens (Ada-KV), ``kept`` is the most any
        holds and the others end in free (negative) entries."""
        held = [positions.cpu() for positions in self.positions]
        return [survivors(positions, int((positions >= 0).sum(-1).max())) for positions in held]


@dataclass
class GenerationResult:
    """What one generation produced and held, with figures read from the tensors and clocks.

    ``kv_bytes`` and ``peak_kv_bytes`` are the bytes of slots holding a token (at the end; at the most, after a
    forward pass and before eviction); ``kv_reserved_bytes`` and ``peak_kv_reserved_bytes`` those of the heap's
    tensors. ``compactions`` counts the heap's compactions and ``compaction_seconds`` times those outside static
    decode steps (inside one, a compaction is part of the step's time); ``decode_graphs`` is the number of CUDA
    graphs the decode steps were captured in (0: eager). ``ranked_slots`` counts the slots the evictions ranked
    (over sequences, KV heads and layers) and ``ranking_seconds`` times their scoring and selection outside static
    steps; ``tie_share`` is the share of their cuts (per layer, KV head and eviction) that fell on tied scores, so
    that the position tie-break decided (``None``: nothing was evicted). ``read_bytes_per_token`` is the mean K/V
    bytes attention read per decoded token over the batch (``None`` without decoding). ``prefill_seconds`` and
    ``decode_seconds`` are the engine's
    own time reading (and compressing) the prompt and decoding, summed over its events; a generation continuing a
    context read once for several policies counts that read's seconds and peak GPU allocation too, as a separate run
    would. ``reconstruction_seconds`` is the part of ``prefill_seconds`` that KVzip's reconstruction of the context
    took (0 for every other policy). ``demotion`` reports a demoting run's tiers and what moved between them
    (:class:`kvlab.cache.demotion.DemotionReport`; ``None`` where evicted tokens are deleted). ``token_seconds`` is the
    time of each decode step (so the first steps carry a graph's warm-up and capture, and the steady rate is read
    from the later ones). ``peak_gpu_bytes`` is
    ``torch.cuda.max_memory_allocated`` over the generation (None on a CPU); on a model split over several GPUs it is
    the sum of each GPU's own peak (``peak_gpu_bytes_per_device``, by device name), which bounds the peak of their sum
    from above since the GPUs need not peak at the same moment. ``kv_bytes_per_device`` and
    ``kv_reserved_bytes_per_device`` are ``kv_bytes`` and ``kv_reserved_bytes`` by the device the heap's tensors live
    on, each layer's where the layer runs. ``device`` names every device the model computed on (``cuda:0+cuda:1``).
    ``scope_seconds`` is the part of ``prefill_seconds`` the global eviction scope took to gather every layer's scores
    to one device and decide the layer budgets (0 in the local scope, :mod:`kvlab.cache.scopes`).
    """

    tokens: list[list[int]]
    texts: list[str]
    context_tokens: int
    budget_tokens: int | None
    kept_per_layer: list[int]
    kv_bytes: int
    kv_bytes_full: int
    peak_kv_bytes: int
    kv_reserved_bytes: int
    peak_kv_reserved_bytes: int
    dead_share: float
    compactions: int
    compaction_seconds: float
    aux_bytes: int
    prefill_seconds: float
    decode_seconds: float
    peak_gpu_bytes: int | None
    device: str
    dtype: str
    layout: str
    decode_graphs: int
    ranked_slots: int = 0
    ranking_seconds: float = 0.0
    tie_share: float | None = None
    reconstruction_seconds: float = 0.0
    kv_bytes_per_device: dict[str, int] = field(default_factory=dict)
    kv_reserved_bytes_per_device: dict[str, int] = field(default_factory=dict)
    peak_gpu_bytes_per_device: dict[str, int] | None = None
    scope_seconds: float = 0.0
    read_bytes_per_token: float | None = None
    demotion: DemotionReport | None = None
    token_seconds: list[float] = field(default_factory=list)

    @property
    def mean_kept_tokens(self) -> int:
        """Tokens held per layer and KV head at the end, the mean over layers."""
        return round(sum(self.kept_per_layer) / len(self.kept_per_layer)) if self.kept_per_layer else 0

    def to_json(self) -> dict[str, Any]:
        """The CLI's ``--json`` object (first sequence's text and tokens at top level)."""
        return {
            "text": self.texts[0],
            "tokens": self.tokens[0],
            "texts": self.texts,
            "batch_tokens": self.tokens,
            **{
                name: getattr(self, name)
                for name in (
                    "context_tokens",
                    "budget_tokens",
                    "kv_bytes",
                    "kv_bytes_full",
                    "peak_kv_bytes",
                    "kv_reserved_bytes",
                    "peak_kv_reserved_bytes",
                    "dead_share",
                    "compactions",
                    "compaction_seconds",
                    "aux_bytes",
                    "kept_per_layer",
                    "prefill_seconds",
                    "decode_seconds",
                    "peak_gpu_bytes",
                    "device",
                    "dtype",
                    "layout",
                    "decode_graphs",
                    "ranked_slots",
                    "ranking_seconds",
                    "tie_share",
                    "reconstruction_seconds",
                    "kv_bytes_per_device",
                    "kv_reserved_bytes_per_device",
                    "peak_gpu_bytes_per_device",
                    "scope_seconds",
                    "read_bytes_per_token",
                    "token_seconds",
                )
            },
            "demotion": None if self.demotion is None else dataclasses.asdict(self.demotion),
        }


def eos_token_ids(loaded: LoadedModel) -> tuple[int, ...]:
    """The model's end-of-sequence ids from its generation config (one id, a list, or none)."""
    eos = getattr(loaded.model.generation_config, "eos_token_id", None)
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)


def observed_window(policy: Policy) -> int:
    """How many recent queries a run must remember for ``policy``: its own observation window, and CAKE's when its
    layer budgets follow the prompt's attention."""
    return max(policy.query_window(), CAKE_WINDOW if policy.measures_layers() == "prompt" else 0)


def _supports(model: Any, argument: str) -> bool:
    import inspect

    return argument in inspect.signature(model.forward).parameters


@dataclass
class Prefilled:
    """A batch of contexts read once with a full heap that remembers what every listed policy needs (accumulated
    attention, an observation window of queries), so that several ``prefill``-mode policies can each compress a
    fork of it instead of reading the context again. The results are those of separate runs (a tested equivalence)."""

    input_ids: torch.Tensor
    cache: KVHeap
    logits: torch.Tensor
    peak_kv_bytes: int
    peak_kv_reserved_bytes: int
    seconds: float
    peak_gpu_bytes_per_device: dict[str, int]


def prefill_once(
    loaded: LoadedModel, input_ids: torch.Tensor, policies: Sequence[Policy], chunk: int | None = None
) -> Prefilled:
    """Read ``input_ids`` once for all ``policies`` (see :class:`Prefilled`)."""
    reader = Generation(loaded, RunSpec(Full(), chunk=chunk, max_new_tokens=0), input_ids, observe_for=policies)
    last = None
    for last in reader.events():
        pass
    assert last is not None and last.logits is not None
    return Prefilled(
        reader.input_ids,
        reader.cache,
        last.logits,
        reader.peak_kv_bytes,
        reader.peak_kv_reserved_bytes,
        reader.prefill_seconds,
        reader.peak_gpu_bytes_per_device,
    )


class Generation:
    """One generation of one policy over a batch of same-length token sequences.

    ``suffix_ids`` are read after the context and, in ``prefill`` mode, after compression (a question asked of a
    compressed context); in ``streaming`` mode they are read in chunks like the context. ``prefilled`` continues
    from a context already read by :func:`prefill_once` (``prefill`` mode only) instead of ``input_ids``; the heap
    also remembers what the policies in ``observe_for`` need, for forks that they will compress.

    ``forced_ids`` (``(batch, max_new_tokens)``) are fed as the decoded tokens instead of the greedy choice: teacher
    forcing, a known text read one token at a time as if it had been generated, the cache evicting as decoding
    does, each decode event carrying the logits the step computed. Stop tokens do not end them, and the steps run
    eagerly (:mod:`kvlab.runs.quality` scores a text this way).

    Its steps are public (:meth:`read`, :meth:`compress`, :meth:`decode`); :meth:`events` runs them in order and
    measures each event, and :meth:`result` reports the whole run once the events are exhausted.
    """

    def __init__(
        self,
        loaded: LoadedModel,
        spec: RunSpec,
        input_ids: torch.Tensor | None = None,
        suffix_ids: torch.Tensor | None = None,
        prefilled: Prefilled | None = None,
        observe_for: Sequence[Policy] = (),
        forced_ids: torch.Tensor | None = None,
    ) -> None:
        if prefilled is not None:
            if spec.mode != "prefill":
                raise KvlabError("A context read once for several policies can only be compressed in prefill mode.")
            input_ids = prefilled.input_ids
        if input_ids is None:
            raise KvlabError("Give the prompt's token ids, or a context already read.")
        if input_ids.dim() != 2 or input_ids.shape[1] == 0:
            raise KvlabError("The prompt is empty; give at least one token of context.")
        if suffix_ids is not None and (suffix_ids.dim() != 2 or suffix_ids.shape[0] != input_ids.shape[0]):
            raise KvlabError("The question tokens must have one row per prompt.")
        if forced_ids is not None and tuple(forced_ids.shape) != (input_ids.shape[0], spec.max_new_tokens):
            raise KvlabError("The forced tokens must have one row per prompt and max_new_tokens tokens in each.")
        self.loaded = loaded
        self.spec = spec
        self.input_ids = input_ids.to(loaded.device)
        self.suffix_ids = suffix_ids.to(loaded.device) if suffix_ids is not None and suffix_ids.shape[1] else None
        self.context_tokens = int(input_ids.shape[1])
        suffix_tokens = 0 if self.suffix_ids is None else int(self.suffix_ids.shape[1])
        loaded.limits.check(self.context_tokens + suffix_tokens, spec.max_new_tokens, shown_name(loaded.name))
        self.budget_tokens = check_budget(spec.policy, spec.budget, self.context_tokens)
        #: How a sparse reader reads while decoding (its budget is the tokens it reads, :mod:`kvlab.cache.sparse`), else
        #: ``None``: attention reads every token held; and the tokens each layer holds per KV head (``None``: all).
        self.reader = (
            spec.policy.sparse_read(self.budget_tokens, self.context_tokens + suffix_tokens + spec.max_new_tokens)
            if self.budget_tokens is not None
            else None
        )
        self.held_tokens = self.budget_tokens if self.reader is None else self.reader.held
        self.evicting = self.held_tokens is not None
        #: Whether the compression moves the kept tokens into frozen layers (:mod:`kvlab.cache.tiers`).
        self.freezes = spec.policy.freezes()
        #: Whether evictions can free anything: a budget, sliding-window layers, or tokens the policy never keeps.
        self.prunes = self.evicting or bool(loaded.arch.sliding_layers) or spec.policy.removes() > 0
        arch = loaded.arch
        #: The stored attention profile the layer budgets follow (the ``entropy`` allocation), else ``None``.
        self.profile = require_profile(loaded) if spec.policy.measures_layers() == "profile" else None
        self.layer_budgets = (
            local_budgets(
                spec.policy,
                self.held_tokens,
                loaded.layer_groups,
                capacity=self.context_tokens,
                measured=None if self.profile is None else self.profile.entropy,
            )
            if self.held_tokens is not None
            else [NO_BUDGET] * arch.num_layers
        )
        self._span = self.context_tokens + suffix_tokens + spec.max_new_tokens
        capacities, room = self._plan()
        observed = [*([spec.policy] if self.evicting or self.freezes or spec.policy.removes() else []), *observe_for]
        track_scores = any(policy.needs_scores for policy in observed)
        query_moments = any(policy.needs_query_moments for policy in observed)
        #: The model's rotary embedding (for policies that model future queries), found once per generation.
        self.rope = Rope.of_model(loaded.model)
        query_window = max((observed_window(policy) for policy in observed), default=0)
        keep_planned = spec.mode == "streaming"
        if prefilled is not None:
            self.cache = prefilled.cache.fork(
                capacities=capacities,
                track_scores=track_scores,
                query_window=query_window,
                layout=spec.heap_layout(),
                room=room,
                keep_planned=keep_planned,
                query_moments=query_moments,
            )
        else:
            self.cache = KVHeap(
                capacities,
                layout=spec.heap_layout(),
                track_scores=track_scores,
                query_window=query_window,
                room=room,
                keep_planned=keep_planned,
                query_moments=query_moments,
                rope=self.rope,
            )
        demotion = spec.policy.demotion() if self.evicting else None
        if demotion is not None:
            self.cache.demotion = Demotion(demotion, arch.num_layers)
        #: The run's random draws (noise floor, random eviction), one seeded generator per device a layer runs on.
        self.generators = {device: torch.Generator(device=device).manual_seed(spec.seed) for device in loaded.devices}
        self.peak_kv_bytes = 0 if prefilled is None else prefilled.peak_kv_bytes
        self.peak_kv_reserved_bytes = 0 if prefilled is None else prefilled.peak_kv_reserved_bytes
        self._start_logits: torch.Tensor | None = None if prefilled is None else prefilled.logits
        self.decode_graphs = 0
        #: The K/V bytes attention reads while decoding (:class:`kvlab.cache.sparse.ReadCount`).
        self.reads = ReadCount(loaded.device)
        self.prefill_seconds = 0.0 if prefilled is None else prefilled.seconds
        self.reconstruction_seconds = 0.0
        self.scope_seconds = 0.0
        self.decode_seconds = 0.0
        self.peak_gpu_bytes_per_device = {} if prefilled is None else dict(prefilled.peak_gpu_bytes_per_device)
        self.tokens: list[list[int]] = [[] for _ in range(int(input_ids.shape[0]))]
        self._step_seconds: list[float] = []
        self._logits_to_keep = _supports(loaded.model, "logits_to_keep")
        self.forced_ids = forced_ids.to(loaded.device) if forced_ids is not None else None
        self.stops = (
            set()
            if forced_ids is not None
            else set(spec.stop_token_ids if spec.stop_token_ids is not None else eos_token_ids(loaded))
        )

    @property
    def batch_size(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def peak_gpu_bytes(self) -> int | None:
        """The peak GPU allocation so far, summed over the GPUs the model runs on (``None`` on a CPU)."""
        return sum(self.peak_gpu_bytes_per_device.values()) if self.peak_gpu_bytes_per_device else None

    def _plan(self) -> tuple[list[int], int]:
        """Slots per layer, and the room a compaction leaves for the tokens still to come between evictions.

        In streaming mode a layer holds at most its budget (or, on sliding-window layers, the window) plus one chunk;
        in prefill mode everything until the one compression, which then leaves room for the question and the
        tokens to generate. A layer of PyramidKV that holds no more than the uniform budget keeps everything, so
        its capacity covers the uniform budget too.
        """
        arch = self.loaded.arch
        chunk = self.spec.chunk_size(self.context_tokens)
        uniform = self.held_tokens if self.held_tokens is not None else NO_BUDGET
        capacities = []
        for layer, budget in enumerate(self.layer_budgets):
            keep = max(budget, uniform)
            if arch.is_sliding(layer) and arch.sliding_window is not None:
                keep = min(keep, arch.sliding_window - 1)
            capacities.append(self._span if self.spec.mode == "prefill" else min(self._span, keep + chunk))
        room = chunk if self.spec.mode == "streaming" else self._span - self.context_tokens
        return capacities, room

    def full_cache_bytes(self) -> int:
        """What a full (never evicted) cache of the same dtype and shapes would hold after the tokens seen so far;
        sliding-window layers counted at the ``window - 1`` tokens transformers' own cache keeps there."""
        arch = self.loaded.arch
        seen = self.cache.seen_tokens
        per_token = 2 * self.batch_size * arch.num_kv_heads * arch.head_dim * self.loaded.kv_bytes_per_element
        total = 0
        for layer_idx, layer in enumerate(self.cache.layers):
            window = (
                layer.sliding_window
                if layer.sliding_window is not None
                else (arch.sliding_window if arch.is_sliding(layer_idx) else None)
            )
            total += per_token * (min(seen, window - 1) if window is not None else seen)
        return total

    def record_peak(self) -> None:
        """Note the bytes held now (after a forward pass, before eviction) if they are the most so far."""
        self.peak_kv_bytes = max(self.peak_kv_bytes, self.cache.kv_bytes())
        self.peak_kv_reserved_bytes = max(self.peak_kv_reserved_bytes, self.cache.reserved_bytes())

    def account_read(self) -> None:
        """Count one decode step's reads (after its forward pass, before eviction): every layer read in full, the
        bytes it holds now; a sparse reader's layers add what they selected on the device as they read."""
        reader = self.reader
        layers = enumerate(self.cache.layers)
        self.reads.add_step(
            sum(layer.live_bytes() for index, layer in layers if reader is None or not reader.reads_sparsely(index))
        )

    def model_forward(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        last_position: int,
        stats: StatsAccumulator | None = None,
        cache: KVHeap | None = None,
        observe: Observer | None = None,
        decoding: bool = False,
    ) -> torch.Tensor:
        """The model over ``ids`` at ``positions`` (a device tensor), writing into the heap (or into ``cache``, a fork
        of it), its attention handed to ``observe`` when given; the last logits. A ``decoding`` step reads through
        the sparse reader, if any."""
        heap = self.cache if cache is None else cache
        context = ForwardContext(heap, positions, last_position, stats, observe)
        context.decoding = decoding
        if decoding and self.reader is not None:
            context.reader, context.reads = self.reader, self.reads
        kwargs: dict[str, Any] = {
            self.loaded.cache_kwarg: heap,
            "position_ids": positions.unsqueeze(0).expand(ids.shape[0], -1),
            "use_cache": True,
        }
        if self._logits_to_keep:
            kwargs["logits_to_keep"] = 1
        heap.begin_forward(positions)
        with forward_context(context), sdpa_backends(self.loaded.device):
            output = self.loaded.model(input_ids=ids, **kwargs)
        heap.end_forward(int(ids.shape[1]))
        return output.logits[:, -1, :].to(self.loaded.device)  # from the last layer's device, where split

    def _forward(
        self, ids: torch.Tensor, decoding: bool = False
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor] | None]:
        """Run the model over ``ids`` (appended at their true positions, a decode step's token when ``decoding``);
        return the last position's logits."""
        start = self.cache.seen_tokens
        n_new = int(ids.shape[1])
        positions = torch.arange(start, start + n_new, device=self.loaded.device)
        stats = None
        if self.spec.stats is not None:
            request = StatsRequest(self.spec.stats.n_sink, self.spec.stats.n_bins, self._span)
            stats = StatsAccumulator(request, self.loaded.arch.num_layers)
        logits = self.model_forward(ids, positions, start + n_new - 1, stats, decoding=decoding)
        self.record_peak()
        if decoding:
            self.account_read()
        return logits, (stats.finish(n_new) if stats is not None else None)

    def eviction_counts(self) -> list[int]:
        """How many tokens each layer gives up at the next eviction (host counts only: the same rule as
        :func:`kvlab.policies.evict_layer`)."""
        if not self.prunes:
            return [0] * len(self.layer_budgets)
        budgets = self.budgets()
        return [eviction_count(layer, budget, uniform) for layer, (budget, uniform) in zip(self.cache.layers, budgets)]

    def budgets(self) -> list[tuple[int, int]]:
        """Each layer's budget and the uniform budget for an eviction now: the run's, at most the tokens seen after
        those an ablation removes (:meth:`~kvlab.policies.Policy.removes`)."""
        uniform = self.held_tokens or NO_BUDGET
        removed = self.spec.policy.removes()
        most = max(self.cache.seen_tokens - removed, 0) if removed else NO_BUDGET
        return [(min(budget, most), min(uniform, most)) for budget in self.layer_budgets]

    def evict(self, next_position: int | torch.Tensor | None = None) -> None:
        """Cut every layer back to its budget."""
        if not self.prunes:
            return
        for layer_idx, view in enumerate(self.layer_views(next_position)):
            evict_layer(self.cache, layer_idx, self.spec.policy, view)

    def layer_views(self, next_position: int | torch.Tensor | None = None) -> list[LayerView]:
        """What the policy sees of each layer for an eviction now, with the layer's budget."""
        position = self.cache.seen_tokens if next_position is None else next_position
        return [
            LayerView(
                layer_idx,
                len(self.layer_budgets),
                layer,
                budget,
                uniform,
                position,
                self.generators[self.loaded.layer_devices[layer_idx]],
                layer.span(self.cache.static),
                self.rope,
                self.cache,
            )
            for layer_idx, (layer, (budget, uniform)) in enumerate(zip(self.cache.layers, self.budgets()))
        ]

    def demoted_bytes(self) -> dict[str, int] | None:
        """Bytes demotion holds now in each tier (``gpu``: beside the heap), or ``None`` where nothing is demoted."""
        return None if self.cache.demotion is None else self.cache.demotion.tier_bytes()

    def make_event(self, kind: Literal["prefill", "compress", "decode"], step: int, **extra: Any) -> Event:
        """An event describing the heap as it is now."""
        return Event(
            kind=kind,
            step=step,
            seen_tokens=self.cache.seen_tokens,
            kept_per_layer=self.cache.kept_per_layer(),
            kv_bytes=self.cache.kv_bytes(),
            kv_bytes_full=self.full_cache_bytes(),
            kv_reserved_bytes=self.cache.reserved_bytes(),
            dead_share=self.cache.dead_share(),
            compactions=self.cache.compactions,
            positions=[layer.held_positions() for layer in self.cache.layers if layer.positions is not None],
            demoted_bytes=self.demoted_bytes(),
            **extra,
        )

    def read(self, ids: torch.Tensor, first_step: int) -> Iterator[Event]:
        """Read tokens in chunks, evicting after each in streaming mode; each event carries its chunk's last
        logits."""
        chunk = self.spec.chunk_size(self.context_tokens)
        for index, start in enumerate(range(0, ids.shape[1], chunk)):
            logits, stats = self._forward(ids[:, start : start + chunk])
            if self.spec.mode == "streaming":
                self.evict()
            yield self.make_event("prefill", first_step + index, stats=stats, logits=logits)

    def compress(self, step: int) -> Event:
        """Prefill mode's one eviction: cut every layer to its budget (the heap's room, planned for prefill mode,
        leaves space for the question and the tokens to generate), or freeze what every layer keeps."""
        if self.evicting and self.spec.policy.measures_layers() == "prompt":
            self.allocate_by_prompt()
        if self.spec.policy.reconstructs() and (self.freezes or any(self.eviction_counts())):
            self.reconstruct()
        if self.evicting and _global_scope(self.spec.policy) and any(self.eviction_counts()):
            self.allocate_globally()
        if self.freezes:
            self.freeze()
        else:
            self.evict()
        self.cache.stop_observing()
        return self.make_event("compress", step)

    def reconstruct(self) -> None:
        """KVzip's scores: the model reconstructs the context on a fork of the heap
        (:mod:`kvlab.engine.reconstruction`), timed on its own (the device synchronised); its seconds are also part of
        the compression event's, so of the prefill's."""
        _synchronize(*self.loaded.devices)
        started = time.perf_counter()
        reconstruct(self)
        _synchronize(*self.loaded.devices)
        self.reconstruction_seconds += time.perf_counter() - started

    def allocate_globally(self) -> None:
        """The global eviction scope's layer budgets (:func:`kvlab.cache.scopes.global_budgets`): every layer's eviction
        scores gathered on the input device under one threshold, timed on its own (the devices synchronised; the
        decision reads its counts on the host); its seconds are also part of the compression event's."""
        assert self.held_tokens is not None
        _synchronize(*self.loaded.devices)
        started = time.perf_counter()
        self.layer_budgets = global_budgets(
            self.spec.policy, self.layer_views(), self.held_tokens, self.context_tokens, self.loaded.device
        )
        self.scope_seconds += time.perf_counter() - started

    def allocate_by_prompt(self) -> None:
        """CAKE's layer budgets for this prompt: each layer's preference from its observation window's attention over
        the tokens before the window, measured once the whole context is read (the whole batch shares them); on a
        model split over devices, each placement group splits its own total by its own layers' preferences."""
        assert self.budget_tokens is not None
        preferences = []
        for layer in self.cache.layers:
            span = layer.span(self.cache.static)
            assert layer.recent_query_positions is not None
            first_query = int(layer.recent_query_positions[0])
            positions = layer.slots(span)[2]
            before_window = (positions >= 0) & (positions < first_query)
            preferences.append(cake_preference(window_probabilities(layer, span), keys=before_window))
        self.layer_budgets = local_budgets(
            self.spec.policy,
            self.budget_tokens,
            self.loaded.layer_groups,
            capacity=self.context_tokens,
            measured=preferences,
        )

    def freeze(self) -> None:
        """Move what each layer keeps into its frozen part (:mod:`kvlab.cache.tiers`): the hot share at 16 bits, the
        rest at the policy's bits, each KV head its own number of tokens under Ada-KV; everything else is evicted."""
        policy = self.spec.policy
        assert isinstance(policy, ScoringPolicy)
        for layer_idx, view in enumerate(self.layer_views()):
            clock = DeviceClock.start(view.cache.device)
            kept, ranking, tied = kept_slots(policy, view, policy.head_safeguard())
            self.cache.account_ranking(view.cache, view.span, clock.stop())
            if tied is not None:
                self.cache.account_cut(view.cache, tied)
            hot, cold = hot_and_cold(ranking, kept, policy.hot)
            self.cache.freeze(layer_idx, hot, cold, policy.tier())

    def decode(self, logits: torch.Tensor, step: int) -> Iterator[Event]:
        """Greedy decoding (or the forced tokens) from the prompt's last ``logits``: in static steps where they
        apply (:mod:`kvlab.engine.static`), else one eager forward pass per token (always on a model whose layers run on
        several devices)."""
        from kvlab.engine.static import StaticDecoder

        decoder = StaticDecoder.for_generation(self) if self.forced_ids is None else None
        return decoder.decode(logits, step) if decoder is not None else self._decode_eagerly(logits, step)

    def events(self) -> Iterator[Event]:
        """Run the generation, yielding an event per prefill chunk, compression and decoded token, each with the
        seconds it took (the device synchronised; the consumer's time between events is not counted). A GPU that
        runs out of memory becomes one sentence, and the memory is handed back for the next run. Every device the
        model runs on is synchronised, and each GPU's peak allocation read."""
        devices = self.loaded.devices
        gpus = [device for device in devices if device.type == "cuda"]
        for gpu in gpus:
            torch.cuda.reset_peak_memory_stats(gpu)
        with torch.inference_mode(), _out_of_memory_as_error(self.cache):
            steps = self._steps()
            try:
                while True:
                    started = time.perf_counter()
                    event = next(steps, None)
                    if event is None:
                        return
                    _synchronize(*devices)
                    event.seconds = time.perf_counter() - started
                    self._account(event)
                    yield event
            finally:  # read once, also when the consumer stops early (reading it builds the allocator's statistics)
                for gpu in gpus:
                    name, peak = device_name(gpu), torch.cuda.max_memory_allocated(gpu)
                    self.peak_gpu_bytes_per_device[name] = max(self.peak_gpu_bytes_per_device.get(name, 0), peak)
                if self.cache.demotion is not None:  # the offload file goes with the run; the counts stay
                    self.cache.demotion.close()

    def _account(self, event: Event) -> None:
        """Add an event to the run's seconds and tokens."""
        if event.kind == "decode":
            self.decode_seconds += event.seconds
            self._step_seconds.append(event.seconds)
            for sequence, token in zip(self.tokens, event.token_ids or []):
                sequence.append(token)
        else:
            self.prefill_seconds += event.seconds

    def _steps(self) -> Iterator[Event]:
        step = 0
        logits = self._start_logits
        if logits is None:
            for event in self.read(self.input_ids, step):
                step, logits = step + 1, event.logits
                yield event
        if self.spec.mode == "prefill" and (self.evicting or self.freezes or self.spec.policy.removes()):
            yield self.compress(step)
            step += 1
        if self.suffix_ids is not None:
            for event in self.read(self.suffix_ids, step):
                step, logits = step + 1, event.logits
                yield event
        assert logits is not None
        if self.spec.max_new_tokens:
            yield from self.decode(logits, step)

    def _decode_eagerly(self, logits: torch.Tensor, step: int) -> Iterator[Event]:
        """Greedy decoding (or the forced tokens), one eager forward pass per token."""
        finished = torch.zeros(self.batch_size, dtype=torch.bool)
        for index in range(self.spec.max_new_tokens):
            next_ids = logits.argmax(dim=-1) if self.forced_ids is None else self.forced_ids[:, index]
            tokens = next_ids.tolist()
            finished |= torch.tensor([token in self.stops for token in tokens])
            if index == self.spec.max_new_tokens - 1 or bool(finished.all()):
                yield self.make_event("decode", step + index, token_ids=tokens, logits=logits)
                return
            logits, stats = self._forward(next_ids.unsqueeze(1), decoding=True)
            if self.spec.mode == "streaming" and (index + 1) % self.spec.compression_interval == 0:
                self.evict()
            yield self.make_event("decode", step + index, token_ids=tokens, logits=logits, stats=stats)

    def result(self) -> GenerationResult:
        """What the generation produced and held, once :meth:`events` is exhausted."""
        tokens = [_trim(sequence, self.stops) for sequence in self.tokens]
        tokenizer = self.loaded.tokenizer
        heap = self.cache
        return GenerationResult(
            tokens=tokens,
            texts=[tokenizer.decode(t, skip_special_tokens=True) if tokenizer is not None else "" for t in tokens],
            context_tokens=self.context_tokens,
            budget_tokens=self.budget_tokens,
            kept_per_layer=heap.kept_per_layer(),
            kv_bytes=heap.kv_bytes(),
            kv_bytes_full=self.full_cache_bytes(),
            peak_kv_bytes=self.peak_kv_bytes,
            kv_reserved_bytes=heap.reserved_bytes(),
            peak_kv_reserved_bytes=self.peak_kv_reserved_bytes,
            dead_share=heap.dead_share(),
            compactions=heap.compactions,
            compaction_seconds=heap.compaction_seconds(),
            aux_bytes=heap.aux_bytes(),
            prefill_seconds=self.prefill_seconds,
            decode_seconds=self.decode_seconds,
            peak_gpu_bytes=self.peak_gpu_bytes,
            device="+".join(device_name(device) for device in self.loaded.devices),
            dtype=self.loaded.dtype_name,
            layout=self.spec.layout,
            decode_graphs=self.decode_graphs,
            ranked_slots=heap.ranked_slots,
            ranking_seconds=heap.ranking_seconds(),
            tie_share=heap.tie_share(),
            read_bytes_per_token=self.reads.per_step(),
            reconstruction_seconds=self.reconstruction_seconds,
            kv_bytes_per_device=heap.per_device(HeapLayer.live_bytes),
            kv_reserved_bytes_per_device=heap.per_device(HeapLayer.reserved_bytes),
            peak_gpu_bytes_per_device=self.peak_gpu_bytes_per_device or None,
            scope_seconds=self.scope_seconds,
            demotion=None if heap.demotion is None else heap.demotion.report(self.reads.steps),
            token_seconds=self._step_seconds[:-1],  # the last decode event runs no step
        )


def _trim(tokens: list[int], stops: set[int]) -> list[int]:
    """Tokens up to and including the first stop token."""
    for index, token in enumerate(tokens):
        if token in stops:
            return tokens[: index + 1]
    return tokens


def generate(
    loaded: LoadedModel,
    input_ids: torch.Tensor | None,
    spec: RunSpec,
    suffix_ids: torch.Tensor | None = None,
    prefilled: Prefilled | None = None,
) -> GenerationResult:
    """Run one generation to the end and report what it produced and held (:meth:`Generation.result`)."""
    generation = Generation(loaded, spec, input_ids, suffix_ids, prefilled)
    for _ in generation.events():
        pass
    return generation.result()


@contextlib.contextmanager
def _out_of_memory_as_error(cache: KVHeap) -> Iterator[None]:
    """Turn a GPU out-of-memory error into one sentence, after releasing the allocator's cached blocks."""
    try:
        yield
    except torch.OutOfMemoryError:
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        raise KvlabError(
            f"The GPU ran out of memory after {cache.seen_tokens} tokens; lower the context, batch or budget, or "
            "use streaming mode."
        ) from None


def _synchronize(*devices: torch.device) -> None:
    for device in devices:
        if device.type == "cuda":
            torch.cuda.synchronize(device)


def _global_scope(policy: Policy) -> bool:
    """Whether one threshold over every layer's scores decides the layer budgets (:mod:`kvlab.cache.scopes`)."""
    return isinstance(policy, ScoringPolicy) and policy.scope == "global"
