"""The cost model's formulas, one small pure function each.

Every function takes plain numbers or :class:`~kvlab.arch.ArchFacts`, so the calculator page, the tests and a
notebook all price a cache the same way. Sizes are in bytes, times in seconds, rates per second, prices in the
currency of the price per hour.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from types import MappingProxyType

from kvlab.arch import ArchFacts
from kvlab.budget import kept_tokens
from kvlab.errors import KvlabError

PRECISION_BYTES: Mapping[str, float] = MappingProxyType(
    {"fp32": 4.0, "fp16": 2.0, "bf16": 2.0, "fp8": 1.0, "int8": 1.0, "int4": 0.5, "int2": 0.25}
)
"""Bytes per stored number for each precision name; ``int2`` is the 2-bit format of KIVI-style caches."""

QUANT_GROUP_META_BYTES = 4
"""Bytes of metadata per quantisation group: one fp16 scale and one fp16 zero-point."""

MOST_GPUS = 64
"""The most GPUs the calculator splits one model over; a configuration that needs more is reported as not fitting
on any count it offers (64 is eight nodes of eight GPUs)."""


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


def kv_bytes_for_sequence(
    arch: ArchFacts,
    tokens: int,
    precision: str,
    keep_fraction: float = 1.0,
    group_size: int | None = None,
) -> float:
    """Cache bytes of one sequence of ``tokens`` tokens.

    ``Σ_layers cached_tokens × kv_elements_per_token_per_layer × bytes_per_element``: summed per layer because
    sliding layers stop growing at the window while full layers keep growing.
    """
    per_layer_token = kv_elements_per_token_per_layer(arch) * bytes_per_element(precision, group_size)
    held = sum(cached_tokens(arch, layer, tokens, keep_fraction) for layer in range(arch.num_layers))
    return held * per_layer_token


def weight_bytes(params: float, precision: str) -> float:
    """Bytes of the weights: ``params × bytes_per_element(precision)`` (quantisation scales ignored)."""
    return params * bytes_per_element(precision)


def sequences_that_fit(
    memory_bytes: float,
    weights_bytes: float,
    kv_bytes_per_sequence: float,
    reserve_fraction: float = 0.10,
) -> int:
    """How many sequences' caches fit beside the weights.

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


def gpus_that_fit(
    memory_bytes: float,
    weights_bytes: float,
    kv_bytes_per_sequence: float,
    reserve_fraction: float = 0.10,
    sequences: int = 1,
    most: int = MOST_GPUS,
) -> int | None:
    """The fewest GPUs of ``memory_bytes`` each that hold the weights, the reserve and ``sequences`` caches.

    Under ideal tensor parallelism the GPUs pool their memory, so this is the smallest count ``g`` for which
    :func:`sequences_that_fit` of ``g × memory_bytes`` reaches ``sequences``; None when even ``most`` GPUs do not.
    """
    for count in range(1, most + 1):
        if (
            sequences_that_fit(count * memory_bytes, weights_bytes, kv_bytes_per_sequence, reserve_fraction)
            >= sequences
        ):
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


def cost_per_query(seconds: float, price_per_hour: float) -> float:
    """Price of one query: ``seconds × price per hour / 3600``."""
    return seconds * price_per_hour / 3600.0


def cost_per_million_tokens(query_cost: float, output_tokens: int) -> float:
    """Price of a million generated tokens: ``cost per query × 10⁶ / M`` (the prompt's prefill included)."""
    return query_cost * 1_000_000 / output_tokens
