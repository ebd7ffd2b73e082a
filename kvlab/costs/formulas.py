"""The cost model's formulas, one small pure function each.

Every function takes plain numbers or :class:`~kvlab.models.arch.ArchFacts`, so the calculator page, the tests and a
notebook all price a cache the same way. Sizes are in bytes, times in seconds, rates per second, prices in the
currency of the price per hour.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

from kvlab.budget import kept_tokens
from kvlab.errors import KvlabError
from kvlab.models.arch import ArchFacts

PRECISION_BYTES: Mapping[str, float] = MappingProxyType(
    {"fp32": 4.0, "fp16": 2.0, "bf16": 2.0, "fp8": 1.0, "int8": 1.0, "int4": 0.5, "int2": 0.25}
)
"""Bytes per stored number for each precision name; ``int2`` is the 2-bit format of KIVI-style caches."""

QUANT_GROUP_META_BYTES = 4
"""Bytes of metadata per quantisation group: one fp16 scale and one fp16 zero-point."""

MOST_GPUS = 64
"""The most GPUs the calculator splits one model over; a configuration that needs more is reported as not fitting
on any count it offers (64 is eight nodes of eight GPUs)."""

KEY_BYTES = 8
"""Bytes of one slot's ranking key, as a global eviction scope gathers it (:mod:`kvlab.cache.scopes`): the float32
eviction score and the token's position packed into one int64, so that ties break by position on every device alike."""

COUNT_BYTES = 4
"""Bytes of one layer's count of kept tokens, as a global eviction scope reads it back: a float32 mean over the
sequences and KV heads."""


def bytes_per_element(precision: str, group_size: int | None = None) -> float:
    """Bytes one cached (or weight) number takes: ``bits / 8``, plus ``4 / group_size`` when grouped.

    Without ``group_size`` the scales and zero-points of a quantised format are ignored (a per-tensor scale costs
    nothing per token). With it, every ``group_size`` numbers of a format under 16 bits carry one fp16 scale and one
    fp16 zero-point, which is what makes a 2-bit cache with groups of 32 cost 0.375 bytes per number, not 0.25.
    """
    if precision not in PRECISION_BYTES:
        raise KvlabError(f"Unknown precision {precision!r}; choose one of {', '.join(PRECISION_BYTES)}.")
    base = PRECISION_BYTES[precision]
    if group_size is None or base >= 2:
        return base
    if group_size < 1:
        raise KvlabError("The quantisation group size must be a positive number of elements.")
    return base + QUANT_GROUP_META_BYTES / group_size


def kv_elements_per_token_per_layer(arch: ArchFacts) -> int:
    """Numbers one token adds to one layer's cache.

    Multi-head, grouped-query and multi-query attention store a key and a value per KV head:
    ``2 × num_kv_heads × head_dim``. Multi-head latent attention (DeepSeek-V2/V3) stores one compressed latent shared
    by all heads plus one shared RoPE key: ``kv_lora_rank + qk_rope_head_dim`` (512 + 64 = 576 for DeepSeek-V3), with
    no factor of 2 and no per-head term.
    """
    if arch.uses_mla:
        return int(arch.kv_lora_rank or 0) + int(arch.qk_rope_head_dim or 0)
    return 2 * arch.num_kv_heads * arch.head_dim


def kv_bytes_per_token(arch: ArchFacts, precision: str, group_size: int | None = None) -> float:
    """Cache bytes one token costs across all layers, before any window cap or eviction.

    ``num_layers × kv_elements_per_token_per_layer × bytes_per_element``; for Llama-3-8B in 16-bit that is
    32 × (2 × 8 × 128) × 2 = 131,072 bytes.
    """
    return arch.num_layers * kv_elements_per_token_per_layer(arch) * bytes_per_element(precision, group_size)


def cached_tokens(arch: ArchFacts, layer: int, tokens: int, keep_fraction: float = 1.0) -> int:
    """Tokens ``layer`` holds once the sequence is ``tokens`` long: ``kept_tokens``, capped by the window.

    A sliding layer holds at most ``sliding_window`` tokens: the ``sliding_window - 1`` past tokens transformers
    keeps between steps plus the current one, which is exactly what the newest token's attention reads. The cap
    applies after eviction, so keeping half of a 32k context on a 4k-window layer still holds 4k tokens.
    """
    kept = kept_tokens(tokens, keep_fraction)
    if arch.sliding_window is not None and arch.is_sliding(layer):
        return min(kept, arch.sliding_window)
    return kept


def kv_bytes_for_layers(
    arch: ArchFacts,
    layers: Iterable[int],
    tokens: int,
    precision: str,
    keep_fraction: float = 1.0,
    group_size: int | None = None,
) -> float:
    """Cache bytes that ``layers`` hold for one sequence of ``tokens`` tokens.

    ``Σ_layers cached_tokens × kv_elements_per_token_per_layer × bytes_per_element``: summed per layer because
    sliding layers stop growing at the window while full layers keep growing, and over a subset of the layers
    because a pipeline's GPU holds only its own layers' cache.
    """
    per_layer_token = kv_elements_per_token_per_layer(arch) * bytes_per_element(precision, group_size)
    held = sum(cached_tokens(arch, layer, tokens, keep_fraction) for layer in layers)
    return held * per_layer_token


def kv_bytes_for_sequence(
    arch: ArchFacts,
    tokens: int,
    precision: str,
    keep_fraction: float = 1.0,
    group_size: int | None = None,
) -> float:
    """Cache bytes of one sequence of ``tokens`` tokens: :func:`kv_bytes_for_layers` of every layer."""
    return kv_bytes_for_layers(arch, range(arch.num_layers), tokens, precision, keep_fraction, group_size)


def weight_bytes(params: float, precision: str) -> float:
    """Bytes of the weights: ``params × bytes_per_element(precision)`` (quantisation scales ignored)."""
    return params * bytes_per_element(precision)


def sequences_that_fit(
    memory_bytes: float,
    weights_bytes: float,
    kv_bytes_per_sequence: float,
    reserve_fraction: float = 0.10,
) -> int:
    """How many sequences' caches fit beside the weights in one GPU's memory (or one GPU's share of each).

    ``floor((memory × (1 − reserve_fraction) − weights) / kv_bytes_per_sequence)``, and 0 when the weights alone
    do not fit. The reserve stands for activations, the CUDA context, allocator fragmentation and the memory the
    driver keeps; 0.10 matches serving engines that claim 90 % of the GPU.
    """
    if not 0.0 <= reserve_fraction < 1.0:
        raise KvlabError("The memory reserve must be at least 0 and below 1.")
    free = memory_bytes * (1.0 - reserve_fraction) - weights_bytes
    if free <= 0 or kv_bytes_per_sequence <= 0:
        return 0
    return math.floor(free / kv_bytes_per_sequence)


def layer_split(num_layers: int, gpus: int) -> tuple[range, ...]:
    """The layers each GPU of a pipeline holds: consecutive layers, split as evenly as possible.

    Every GPU holds ``num_layers // gpus`` layers and the first ``num_layers % gpus`` GPUs one more (80 layers over 3
    GPUs: 27, 27 and 26), so when the count does not divide the layers the first GPUs are the fullest. A pipeline
    gives every GPU at least one layer, so a model takes at most one GPU per layer.
    """
    if not 1 <= gpus <= num_layers:
        raise KvlabError(
            f"A pipeline gives every GPU at least one layer, so this model's {num_layers} layers take between 1 and "
            f"{num_layers} GPUs, not {gpus}."
        )
    size, remainder = divmod(num_layers, gpus)
    starts = [gpu * size + min(gpu, remainder) for gpu in range(gpus + 1)]
    return tuple(range(start, end) for start, end in zip(starts, starts[1:]))


def layer_share(total_bytes: float, layers: range, num_layers: int) -> float:
    """The part of the weights (held, or read per step) on the GPU that holds ``layers``: ``total × layers held /
    layers``.

    The embedding and the output head are spread in the same proportion, not placed on the first and last GPU, so
    the end GPUs of a real split hold a little more: the two are 3 % of Llama-3-70B's weights and 13 % of
    Llama-3-8B's.
    """
    return total_bytes * (len(layers) / num_layers)


@dataclass(frozen=True)
class GpuShare:
    """What one GPU of a pipeline holds: its layers, their weights and their part of one sequence's cache."""

    layers: range
    weight_bytes: float
    kv_bytes_per_sequence: float


def gpu_shares(
    arch: ArchFacts,
    gpus: int,
    weights_bytes: float,
    tokens: int,
    precision: str,
    keep_fraction: float = 1.0,
    group_size: int | None = None,
) -> tuple[GpuShare, ...]:
    """Each GPU's layers, weights (:func:`layer_share`) and cache (:func:`kv_bytes_for_layers`) under
    :func:`layer_split`; one GPU holds the whole model, exactly as :func:`kv_bytes_for_sequence` sizes it."""
    return tuple(
        GpuShare(
            layers,
            layer_share(weights_bytes, layers, arch.num_layers),
            kv_bytes_for_layers(arch, layers, tokens, precision, keep_fraction, group_size),
        )
        for layers in layer_split(arch.num_layers, gpus)
    )


def sequences_per_gpu(
    memory_bytes: float, shares: Sequence[GpuShare], reserve_fraction: float = 0.10
) -> tuple[int, ...]:
    """How many sequences each GPU has room for: :func:`sequences_that_fit` of its own weights and cache.

    A sequence's cache is spread over every GPU, so the pipeline holds the smallest of these: the fullest GPU
    decides the concurrency.
    """
    return tuple(
        sequences_that_fit(memory_bytes, share.weight_bytes, share.kv_bytes_per_sequence, reserve_fraction)
        for share in shares
    )


def gpus_that_fit(
    arch: ArchFacts,
    memory_bytes: float,
    weights_bytes: float,
    tokens: int,
    precision: str,
    keep_fraction: float = 1.0,
    group_size: int | None = None,
    reserve_fraction: float = 0.10,
    sequences: int = 1,
    most: int = MOST_GPUS,
) -> int | None:
    """The fewest GPUs of ``memory_bytes`` each that hold the weights, the reserve and ``sequences`` caches.

    The smallest count ``g`` whose :func:`gpu_shares` leave every GPU room for ``sequences`` sequences
    (:func:`sequences_per_gpu`); None when even ``most`` GPUs (or one per layer, if fewer) do not.
    """
    for count in range(1, min(most, arch.num_layers) + 1):
        shares = gpu_shares(arch, count, weights_bytes, tokens, precision, keep_fraction, group_size)
        if min(sequences_per_gpu(memory_bytes, shares, reserve_fraction)) >= sequences:
            return count
    return None


def decode_step_seconds(
    weights_read_bytes: float,
    kv_bytes_per_sequence: float,
    batch: int,
    bandwidth_bytes_per_s: float,
) -> float:
    """Bandwidth-bound time of one decode step of the whole batch.

    ``(weights read + batch × kv_bytes_per_sequence) / bandwidth``: every step streams the weights once and every
    sequence's cache once, and compute is assumed to hide behind those reads. Each sequence gains one token per
    step, so this is also the time per generated token that one user sees.
    """
    return (weights_read_bytes + batch * kv_bytes_per_sequence) / bandwidth_bytes_per_s


def stage_seconds(
    shares: Sequence[GpuShare],
    weights_read_bytes: float,
    num_layers: int,
    batch: int,
    bandwidth_bytes_per_s: float,
) -> tuple[float, ...]:
    """Each GPU's part of one decode step: :func:`decode_step_seconds` of its layers' share of the weights read and
    of the batch's cache, at its own bandwidth."""
    return tuple(
        decode_step_seconds(
            layer_share(weights_read_bytes, share.layers, num_layers),
            share.kv_bytes_per_sequence,
            batch,
            bandwidth_bytes_per_s,
        )
        for share in shares
    )


def pipeline_step_seconds(stages: Sequence[float]) -> float:
    """One decode step of a pipeline with one batch in flight: the sum of its GPUs' parts.

    Each GPU waits for the one before it, so a step lasts as long as one GPU reading everything. The slowest GPU's
    part bounds how often a pipeline kept full of micro-batches could finish a step; that schedule is not priced.
    """
    return sum(stages, 0.0)


def decode_tokens_per_second(batch: int, step_seconds: float) -> float:
    """Tokens the batch generates per second: ``batch / decode step``."""
    return batch / step_seconds


def attended_pairs(arch: ArchFacts, layer: int, tokens: int) -> int:
    """Causal (query, key) pairs one layer scores while prefilling ``tokens`` tokens.

    Token ``t`` (1-based) attends to ``min(t, W)`` tokens including itself, so a full layer scores
    ``N (N + 1) / 2`` pairs and a sliding layer with ``N > W`` scores ``W (W + 1) / 2 + (N − W) × W``.
    """
    window = arch.sliding_window if arch.sliding_window is not None and arch.is_sliding(layer) else None
    if window is None or tokens <= window:
        return tokens * (tokens + 1) // 2
    return window * (window + 1) // 2 + (tokens - window) * window


def attention_flops_per_pair(arch: ArchFacts) -> int:
    """FLOPs one layer spends on one (query, key) pair: a dot product for the score and a weighted add of the value.

    Standard attention: ``2 × num_q_heads × head_dim`` for ``QKᵀ`` plus the same for ``PV``. Multi-head latent
    attention is counted in its absorbed form, which scores against the cached 576-element latent directly:
    ``2 × num_q_heads × (kv_lora_rank + qk_rope_head_dim) + 2 × num_q_heads × kv_lora_rank``; implementations that
    decompress keys and values for prefill spend fewer, so this is an upper bound for DeepSeek models.
    """
    if arch.uses_mla:
        latent = int(arch.kv_lora_rank or 0)
        return 2 * arch.num_q_heads * (latent + int(arch.qk_rope_head_dim or 0)) + 2 * arch.num_q_heads * latent
    return 4 * arch.num_q_heads * arch.head_dim


def prefill_flops(arch: ArchFacts, active_params: float, tokens: int) -> float:
    """FLOPs to prefill a prompt: ``2 × active params × N + Σ_layers attended_pairs × attention_flops_per_pair``.

    The first term is every weight's multiply-add for every prompt token; the second is the attention itself,
    which grows with ``N²`` and dominates long prompts. Eviction does not change it: the prompt is read in full
    before anything is dropped.
    """
    pairs = sum(attended_pairs(arch, layer, tokens) for layer in range(arch.num_layers))
    return 2.0 * active_params * tokens + pairs * attention_flops_per_pair(arch)


def prefill_seconds(flops: float, peak_flops_per_s: float, utilization: float | None) -> float:
    """Compute-bound prefill time: ``flops / (peak FLOP/s × utilization)``.

    ``utilization`` (model FLOP utilisation, typically 0.3 to 0.6 for prefill) is None to leave prefill out: the
    result is then 0.
    """
    if utilization is None:
        return 0.0
    if not 0.0 < utilization <= 1.0:
        raise KvlabError("The prefill utilisation must be greater than 0 and at most 1.")
    return flops / (peak_flops_per_s * utilization)


def query_seconds(prefill_s: float, step_seconds: float, batch: int, output_tokens: int) -> float:
    """GPU time one query costs: its own prefill plus its share of the decode steps.

    ``prefill + M × decode step / batch``: prefill occupies the GPU alone, while each decode step serves ``batch``
    queries at once.
    """
    return prefill_s + output_tokens * step_seconds / batch


def cost_per_query(seconds: float, price_per_hour: float, gpus: int = 1) -> float:
    """Price of one query: ``seconds × GPUs × price per hour / 3600``; every GPU of the pipeline is paid for the
    whole query, working or waiting."""
    return seconds * (gpus * price_per_hour) / 3600.0


def cost_per_million_tokens(query_cost: float, output_tokens: int) -> float:
    """Price of a million generated tokens: ``cost per query × 10⁶ / M`` (the prompt's prefill included)."""
    return query_cost * 1_000_000 / output_tokens


def global_scope_gather_bytes(arch: ArchFacts, tokens: int) -> float:
    """Bytes of one sequence's ranking keys that a global eviction scope gathers on one device per compression.

    One threshold over every layer needs every layer's keys in one place: ``layers × KV heads × tokens ×``
    :data:`KEY_BYTES` (each slot's float32 score and position in one int64), for a cache that holds ``tokens`` slots
    per layer and KV head at the compression, as kvlab's heap does on every layer, sliding or not. A local scope
    (each device ranks its own layers) gathers nothing.
    """
    return float(arch.num_layers * arch.num_kv_heads * tokens * KEY_BYTES)


def global_scope_count_bytes(arch: ArchFacts) -> int:
    """Bytes a global eviction scope reads back per compression: one count of kept tokens per layer
    (:data:`COUNT_BYTES`), from which each layer's budget is set."""
    return arch.num_layers * COUNT_BYTES
