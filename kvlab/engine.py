"""The generation loop: read a context under a budgeted cache, let the policy evict, decode greedily.

One :class:`Generation` is one run of one policy over a batch of same-length prompts. It yields an :class:`Event`
after every prefill chunk, after the compression of ``prefill`` mode, and for every decoded token, carrying what the
dashboard draws (token, survivors, physical bytes, requested attention statistics). :func:`generate` drains the
events and returns a :class:`GenerationResult`.

Modes:

* ``prefill``: the context is read (in chunks of ``chunk`` tokens, or at once), then compressed once to the budget;
  decoding appends without evicting. Peak memory is the full context.
* ``streaming``: the budget holds the whole time. After every chunk and every decoded token each layer is cut back
  to its budget, so the cache never holds more than budget + chunk tokens per layer.

Survivors keep their original RoPE positions and every new token gets its true position; the attention function
builds masks from those positions.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from kvlab.attention import ForwardContext, StatsAccumulator, StatsRequest, forward_context
from kvlab.budget import Budget, check_budget
from kvlab.cache import BudgetedCache
from kvlab.errors import KvlabError
from kvlab.models import LoadedModel, shown_name
from kvlab.policies import LayerView, Policy, evict_layer

Mode = Literal["prefill", "streaming"]
MODES: tuple[str, ...] = ("prefill", "streaming")
DEFAULT_STREAMING_CHUNK = 256
NO_BUDGET = 1 << 62


@dataclass
class RunSpec:
    """How to run one generation: the policy, its budget, the mode, and what to observe.

    ``chunk`` is the number of context tokens read per forward pass; ``None`` reads the whole context at once in
    ``prefill`` mode and :data:`DEFAULT_STREAMING_CHUNK` tokens in ``streaming`` mode. ``compression_interval``
    (``streaming`` mode) evicts during decoding once every that many tokens instead of at every token, as kvpress's
    ``DecodingPress`` does: the cache then holds up to budget + interval tokens, which must stay within the chunk so
    that the budget + chunk bound holds. Decoding is greedy.
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

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise KvlabError(f"Unknown mode {self.mode!r}; use 'prefill' or 'streaming'.")
        if self.chunk is not None and self.chunk <= 0:
            raise KvlabError(f"A chunk of {self.chunk} tokens is not possible; it must be a positive number.")
        if self.max_new_tokens < 0:
            raise KvlabError(f"max_new_tokens must be zero or more, not {self.max_new_tokens}.")
        if self.compression_interval < 1:
            raise KvlabError(f"The compression interval must be at least one token, not {self.compression_interval}.")
        if self.mode == "streaming" and self.compression_interval > self.chunk_size(self.compression_interval):
            raise KvlabError(
                f"A compression interval of {self.compression_interval} tokens is larger than the chunk of "
                f"{self.chunk_size(self.compression_interval)}; the cache would exceed budget + chunk."
            )

    def chunk_size(self, context_tokens: int) -> int:
        """Tokens per prefill forward pass."""
        if self.chunk is not None:
            return self.chunk
        return context_tokens if self.mode == "prefill" else DEFAULT_STREAMING_CHUNK


@dataclass
class Event:
    """One step of a generation as the dashboard sees it.

    ``kind`` is ``prefill`` (a chunk of context was read), ``compress`` (prefill mode's one eviction) or ``decode``
    (a token was chosen; ``token_ids`` holds it for each sequence). ``kv_bytes`` is read from the cache tensors
    held after the step; ``kv_bytes_full`` is what a full cache of the same dtype and shapes would hold after the
    same tokens (computed, since no full cache exists). ``stats`` holds the requested attention statistics of the
    step's forward pass, as CPU tensors.
    """

    kind: Literal["prefill", "compress", "decode"]
    step: int
    seen_tokens: int
    kept_per_layer: list[int]
    kv_bytes: int
    kv_bytes_full: int
    token_ids: list[int] | None = None
    stats: dict[str, torch.Tensor] | None = None
    logits: torch.Tensor | None = None
    positions: list[torch.Tensor] = field(default_factory=list, repr=False)

    def survivors(self) -> list[torch.Tensor]:
        """Original positions of the tokens held after this step, per layer, ``(batch, kv_heads, slots)`` on CPU."""
        return [p.cpu() for p in self.positions]


@dataclass
class GenerationResult:
    """What one generation produced and held, with figures read from the tensors and clocks."""

    tokens: list[list[int]]
    texts: list[str]
    context_tokens: int
    budget_tokens: int | None
    kept_per_layer: list[int]
    kv_bytes: int
    kv_bytes_full: int
    peak_kv_bytes: int
    aux_bytes: int
    prefill_seconds: float
    decode_seconds: float
    peak_gpu_bytes: int | None
    device: str
    dtype: str

    def to_json(self) -> dict[str, Any]:
        """The CLI's ``--json`` object (first sequence's text and tokens at top level)."""
        return {
            "text": self.texts[0],
            "tokens": self.tokens[0],
            "texts": self.texts,
            "batch_tokens": self.tokens,
            "context_tokens": self.context_tokens,
            "budget_tokens": self.budget_tokens,
            "kv_bytes": self.kv_bytes,
            "kv_bytes_full": self.kv_bytes_full,
            "peak_kv_bytes": self.peak_kv_bytes,
            "aux_bytes": self.aux_bytes,
            "kept_per_layer": self.kept_per_layer,
            "prefill_seconds": self.prefill_seconds,
            "decode_seconds": self.decode_seconds,
            "peak_gpu_bytes": self.peak_gpu_bytes,
            "device": self.device,
            "dtype": self.dtype,
        }


def eos_token_ids(loaded: LoadedModel) -> tuple[int, ...]:
    """The model's end-of-sequence ids from its generation config (one id, a list, or none)."""
    eos = getattr(loaded.model.generation_config, "eos_token_id", None)
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)


def _supports(model: Any, argument: str) -> bool:
    import inspect

    return argument in inspect.signature(model.forward).parameters


@dataclass
class Prefilled:
    """A batch of contexts read once with a full cache that remembers what every listed policy needs (accumulated
    attention, an observation window of queries), so that several ``prefill``-mode policies can each compress a
    fork of it instead of reading the context again. The results are those of separate runs (a tested equivalence)."""

    input_ids: torch.Tensor
    cache: BudgetedCache
    logits: torch.Tensor
    peak_kv_bytes: int
    seconds: float


def prefill_once(loaded: LoadedModel, input_ids: torch.Tensor, policies: list[Policy],
                 chunk: int | None = None) -> Prefilled:
    """Read ``input_ids`` once for all ``policies`` (see :class:`Prefilled`)."""
    from kvlab.policies import make_policy

    reader = Generation(loaded, RunSpec(make_policy("full"), chunk=chunk, max_new_tokens=0), input_ids)
    reader.cache = BudgetedCache(
        loaded.arch.num_layers,
        track_scores=any(policy.needs_scores for policy in policies),
        query_window=max((policy.query_window() for policy in policies), default=0),
    )
    started = time.perf_counter()
    logits = None
    with torch.inference_mode(), _out_of_memory_as_error(reader.cache):
        for _, logits in reader._read(reader.input_ids, 0):
            pass
    _synchronize(loaded.device)
    assert logits is not None
    return Prefilled(reader.input_ids, reader.cache, logits, reader.peak_kv_bytes, time.perf_counter() - started)


class Generation:
    """One generation of one policy over a batch of same-length token sequences.

    ``suffix_ids`` are read after the context and, in ``prefill`` mode, after compression (a question asked of a
    compressed context); in ``streaming`` mode they are read in chunks like the context. ``prefilled`` continues
    from a context already read by :func:`prefill_once` (``prefill`` mode only) instead of ``input_ids``.
    """

    def __init__(
        self,
        loaded: LoadedModel,
        spec: RunSpec,
        input_ids: torch.Tensor | None = None,
        suffix_ids: torch.Tensor | None = None,
        prefilled: Prefilled | None = None,
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
        self.loaded = loaded
        self.spec = spec
        self.input_ids = input_ids.to(loaded.device)
        self.suffix_ids = suffix_ids.to(loaded.device) if suffix_ids is not None and suffix_ids.shape[1] else None
        self.context_tokens = int(input_ids.shape[1])
        suffix_tokens = 0 if self.suffix_ids is None else int(self.suffix_ids.shape[1])
        loaded.limits.check(self.context_tokens + suffix_tokens, spec.max_new_tokens, shown_name(loaded.name))
        self.budget_tokens = check_budget(spec.policy, spec.budget, self.context_tokens)
        self.evicting = self.budget_tokens is not None
        arch = loaded.arch
        self.layer_budgets = (
            spec.policy.layer_budgets(self.budget_tokens, arch.num_layers, capacity=self.context_tokens)
            if self.budget_tokens is not None
            else [NO_BUDGET] * arch.num_layers
        )
        self.cache = BudgetedCache(arch.num_layers, track_scores=self.evicting and spec.policy.needs_scores,
                                   query_window=spec.policy.query_window() if self.evicting else 0)
        self.generator = torch.Generator(device=loaded.device).manual_seed(spec.seed)
        self.peak_kv_bytes = 0
        self._start_logits: torch.Tensor | None = None
        self.prefill_finished_at: float | None = None
        if prefilled is not None:
            self.cache = prefilled.cache.fork(track_scores=self.cache.track_scores,
                                              query_window=self.cache.query_window)
            self.peak_kv_bytes = prefilled.peak_kv_bytes
            self._start_logits = prefilled.logits
        self._logits_to_keep = _supports(loaded.model, "logits_to_keep")
        self._stops = set(spec.stop_token_ids if spec.stop_token_ids is not None else eos_token_ids(loaded))
        self._span = self.context_tokens + suffix_tokens + spec.max_new_tokens

    @property
    def batch_size(self) -> int:
        return int(self.input_ids.shape[0])

    def full_cache_bytes(self) -> int:
        """What a full (never evicted) cache of the same dtype and shapes would hold after the tokens seen so far;
        sliding-window layers counted at the ``window - 1`` tokens transformers' own cache keeps there."""
        arch = self.loaded.arch
        seen = self.cache.seen_tokens
        per_token = 2 * self.batch_size * arch.num_kv_heads * arch.head_dim * self.loaded.kv_bytes_per_element
        total = 0
        for layer_idx, layer in enumerate(self.cache.layers):
            window = layer.sliding_window if layer.sliding_window is not None else (
                arch.sliding_window if arch.is_sliding(layer_idx) else None)
            total += per_token * (min(seen, window - 1) if window is not None else seen)
        return total

    def _forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor] | None]:
        """Run the model over ``ids`` (appended at their true positions); return the last position's logits."""
        start = self.cache.seen_tokens
        n_new = int(ids.shape[1])
        positions = torch.arange(start, start + n_new, device=self.loaded.device)
        self.cache.begin_forward(positions)
        stats = None
        if self.spec.stats is not None:
            request = StatsRequest(self.spec.stats.n_sink, self.spec.stats.n_bins, self._span)
            stats = StatsAccumulator(request, self.loaded.arch.num_layers)
        context = ForwardContext(self.cache, positions, start + n_new - 1, stats)
        kwargs: dict[str, Any] = {
            self.loaded.cache_kwarg: self.cache,
            "position_ids": positions.unsqueeze(0).expand(ids.shape[0], -1),
            "use_cache": True,
        }
        if self._logits_to_keep:
            kwargs["logits_to_keep"] = 1
        with forward_context(context):
            output = self.loaded.model(input_ids=ids, **kwargs)
        self.cache.end_forward()
        self.peak_kv_bytes = max(self.peak_kv_bytes, self.cache.kv_bytes())
        return output.logits[:, -1, :], (stats.finish(n_new) if stats is not None else None)

    def _evict(self) -> None:
        """Cut every layer back to its budget."""
        if not self.evicting and not self.loaded.arch.sliding_layers:
            return
        for layer_idx, budget in enumerate(self.layer_budgets):
            view = LayerView(layer_idx, len(self.layer_budgets), self.cache.layers[layer_idx], budget,
                             self.budget_tokens or NO_BUDGET, self.cache.seen_tokens, self.generator)
            evict_layer(self.cache, layer_idx, self.spec.policy, view)

    def _event(self, kind: Literal["prefill", "compress", "decode"], step: int, **extra: Any) -> Event:
        return Event(
            kind=kind,
            step=step,
            seen_tokens=self.cache.seen_tokens,
            kept_per_layer=self.cache.kept_per_layer(),
            kv_bytes=self.cache.kv_bytes(),
            kv_bytes_full=self.full_cache_bytes(),
            positions=[layer.positions for layer in self.cache.layers if layer.positions is not None],
            **extra,
        )

    def _read(self, ids: torch.Tensor, first_step: int) -> Iterator[tuple[Event, torch.Tensor]]:
        """Read tokens in chunks, evicting after each in streaming mode."""
        chunk = self.spec.chunk_size(self.context_tokens)
        for index, start in enumerate(range(0, ids.shape[1], chunk)):
            logits, stats = self._forward(ids[:, start:start + chunk])
            if self.spec.mode == "streaming":
                self._evict()
            yield self._event("prefill", first_step + index, stats=stats, logits=logits), logits

    def events(self) -> Iterator[Event]:
        """Run the generation, yielding an event per prefill chunk, compression and decoded token. A GPU that runs
        out of memory becomes one sentence, and the memory is handed back for the next run."""
        with torch.inference_mode(), _out_of_memory_as_error(self.cache):
            yield from self._run()

    def _run(self) -> Iterator[Event]:
        step = 0
        logits = self._start_logits
        if logits is None:
            for event, logits in self._read(self.input_ids, step):
                step += 1
                yield event
        if self.spec.mode == "prefill" and self.budget_tokens is not None:
            self._evict()
            self.cache.stop_observing()
            yield self._event("compress", step)
            step += 1
        if self.suffix_ids is not None:
            for event, logits in self._read(self.suffix_ids, step):
                step += 1
                yield event
        assert logits is not None
        _synchronize(self.loaded.device)
        self.prefill_finished_at = time.perf_counter()
        finished = torch.zeros(self.batch_size, dtype=torch.bool)
        for index in range(self.spec.max_new_tokens):
            next_ids = logits.argmax(dim=-1)
            tokens = next_ids.tolist()
            finished |= torch.tensor([token in self._stops for token in tokens])
            if index == self.spec.max_new_tokens - 1 or bool(finished.all()):
                yield self._event("decode", step + index, token_ids=tokens, logits=logits)
                return
            logits, stats = self._forward(next_ids.unsqueeze(1))
            if self.spec.mode == "streaming" and (index + 1) % self.spec.compression_interval == 0:
                self._evict()
            yield self._event("decode", step + index, token_ids=tokens, logits=logits, stats=stats)


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
    """Run one generation to the end and report what it produced and held. With ``prefilled``, the context was read
    earlier (its time is not counted here) and the peak GPU memory is that of this call only."""
    device = loaded.device
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    generation = Generation(loaded, spec, input_ids, suffix_ids, prefilled)
    per_sequence: list[list[int]] = [[] for _ in range(generation.batch_size)]
    started = time.perf_counter()
    for event in generation.events():
        if event.kind == "decode":
            for sequence, token in zip(per_sequence, event.token_ids or []):
                sequence.append(token)
    _synchronize(device)
    finished = time.perf_counter()
    prefill_done = generation.prefill_finished_at or finished
    stops = generation._stops
    tokens = [_trim(sequence, stops) for sequence in per_sequence]
    tokenizer = loaded.tokenizer
    texts = [tokenizer.decode(t, skip_special_tokens=True) if tokenizer is not None else "" for t in tokens]
    return GenerationResult(
        tokens=tokens,
        texts=texts,
        context_tokens=generation.context_tokens,
        budget_tokens=generation.budget_tokens,
        kept_per_layer=generation.cache.kept_per_layer(),
        kv_bytes=generation.cache.kv_bytes(),
        kv_bytes_full=generation.full_cache_bytes(),
        peak_kv_bytes=generation.peak_kv_bytes,
        aux_bytes=generation.cache.aux_bytes(),
        prefill_seconds=prefill_done - started,
        decode_seconds=finished - prefill_done,
        peak_gpu_bytes=torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
        device=str(device),
        dtype=str(loaded.dtype).replace("torch.", ""),
    )


@contextlib.contextmanager
def _out_of_memory_as_error(cache: BudgetedCache) -> Iterator[None]:
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


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
