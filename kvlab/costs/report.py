"""From inputs to outputs: one scenario priced with and without eviction, as numbers and as a table.

The calculator page only lays these out: :func:`compare` gives both estimates, :func:`cost_table` the rows with
units, :data:`FORMULAS` the formulas as short strings.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import pandas as pd

from kvlab.costs import formulas as f
from kvlab.costs.gpus import GIB, GpuSpec
from kvlab.costs.models import ModelSpec
from kvlab.errors import KvlabError


@dataclass(frozen=True)
class Scenario:
    """What is served: queries of ``prompt_tokens`` (N) plus ``output_tokens`` (M), ``batch`` at a time.

    Memory and decode time are taken at the full context ``N + M`` for every step, an upper bound: the cache is
    shorter early in generation. ``gpu_count`` GPUs split the model evenly (ideal tensor parallelism: memory,
    bandwidth, FLOP/s and price all scale, communication is free). ``keep_fraction`` is the share of the context
    an eviction policy keeps (typed, or a stored run's). ``memory_reserve`` is the share of GPU memory kept back for
    activations and fragmentation. ``prefill_utilization`` is the fraction of peak FLOP/s that prefill reaches; None
    leaves prefill out of the time and cost. ``quant_group_size`` adds the scales and zero-points of a grouped
    quantised cache; None ignores them. Invalid values raise :class:`~kvlab.errors.KvlabError` here or when priced.
    """

    prompt_tokens: int
    output_tokens: int
    batch: int = 1
    kv_precision: str = "bf16"
    weight_precision: str = "bf16"
    keep_fraction: float = 1.0
    gpu_count: int = 1
    memory_reserve: float = 0.10
    prefill_utilization: float | None = 0.5
    quant_group_size: int | None = None

    def __post_init__(self) -> None:
        if self.prompt_tokens < 0 or self.output_tokens < 1:
            raise KvlabError("A query needs a prompt of zero or more tokens and at least one generated token.")
        if self.batch < 1 or self.gpu_count < 1:
            raise KvlabError("The batch and the number of GPUs must each be at least 1.")

    @property
    def context_tokens(self) -> int:
        """The sequence length a query reaches: prompt plus generated tokens."""
        return self.prompt_tokens + self.output_tokens


@dataclass(frozen=True)
class CostEstimate:
    """Every output of one scenario at one kept fraction."""

    keep_fraction: float
    most_tokens_per_layer: int
    kv_bytes_per_token: float
    kv_bytes_per_sequence: float
    weight_bytes: float
    max_sequences: int
    batch_fits: bool
    decode_step_seconds: float
    tokens_per_second: float
    prefill_seconds: float
    cost_per_query: float
    cost_per_million_tokens: float


def estimate(model: ModelSpec, gpu: GpuSpec, scenario: Scenario) -> CostEstimate:
    """Price ``scenario`` for ``model`` on ``gpu`` at the scenario's kept fraction."""
    arch = model.arch
    n = scenario.context_tokens
    kv_sequence = f.kv_bytes_for_sequence(
        arch, n, scenario.kv_precision, scenario.keep_fraction, scenario.quant_group_size
    )
    most_held = max(f.cached_tokens(arch, layer, n, scenario.keep_fraction) for layer in range(arch.num_layers))
    weights = f.weight_bytes(model.params, scenario.weight_precision)
    fit = f.sequences_that_fit(scenario.gpu_count * gpu.memory_bytes, weights, kv_sequence, scenario.memory_reserve)
    step = f.decode_step_seconds(
        f.weight_bytes(model.params_per_token, scenario.weight_precision),
        kv_sequence,
        scenario.batch,
        scenario.gpu_count * gpu.bandwidth_bytes_per_s,
    )
    prefill = f.prefill_seconds(
        f.prefill_flops(arch, model.params_per_token, scenario.prompt_tokens),
        scenario.gpu_count * gpu.peak_flops,
        scenario.prefill_utilization,
    )
    seconds = f.query_seconds(prefill, step, scenario.batch, scenario.output_tokens)
    query_cost = f.cost_per_query(seconds, scenario.gpu_count * gpu.price_per_hour)
    return CostEstimate(
        keep_fraction=scenario.keep_fraction,
        most_tokens_per_layer=most_held,
        kv_bytes_per_token=f.kv_bytes_per_token(arch, scenario.kv_precision, scenario.quant_group_size),
        kv_bytes_per_sequence=kv_sequence,
        weight_bytes=weights,
        max_sequences=fit,
        batch_fits=scenario.batch <= fit,
        decode_step_seconds=step,
        tokens_per_second=f.decode_tokens_per_second(scenario.batch, step),
        prefill_seconds=prefill,
        cost_per_query=query_cost,
        cost_per_million_tokens=f.cost_per_million_tokens(query_cost, scenario.output_tokens),
    )


def compare(model: ModelSpec, gpu: GpuSpec, scenario: Scenario) -> tuple[CostEstimate, CostEstimate]:
    """The full cache (kept fraction 1) and the evicted one (the scenario's kept fraction), side by side."""
    return estimate(model, gpu, replace(scenario, keep_fraction=1.0)), estimate(model, gpu, scenario)


_ROWS: tuple[tuple[str, str, str, float], ...] = (
    # (label, unit, CostEstimate field, divisor turning the field into the unit)
    ("Most tokens held by one layer", "tokens", "most_tokens_per_layer", 1.0),
    ("KV per token, all layers", "bytes", "kv_bytes_per_token", 1.0),
    ("KV per sequence", "GiB", "kv_bytes_per_sequence", GIB),
    ("Weights", "GiB", "weight_bytes", GIB),
    ("Sequences that fit beside the weights", "sequences", "max_sequences", 1.0),
    ("Batch fits in memory", "yes/no", "batch_fits", 1.0),
    ("Decode step (time per token per sequence)", "ms", "decode_step_seconds", 1e-3),
    ("Decode throughput of the batch", "tokens/s", "tokens_per_second", 1.0),
    ("Prefill per query", "s", "prefill_seconds", 1.0),
    ("Cost per query", "$", "cost_per_query", 1.0),
    ("Cost per million generated tokens", "$", "cost_per_million_tokens", 1.0),
)


def _cell(value: float | bool, divisor: float) -> float | int | str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    return value / divisor if divisor != 1.0 else value


def cost_table(model: ModelSpec, gpu: GpuSpec, scenario: Scenario) -> pd.DataFrame:
    """The outputs of :func:`compare` as rows ``Quantity | Unit | Full cache | Evicted (keep …)``."""
    full, evicted = compare(model, gpu, scenario)
    evicted_label = f"Evicted (keep {scenario.keep_fraction:.0%})"
    return pd.DataFrame(
        [
            {
                "Quantity": label,
                "Unit": unit,
                "Full cache": _cell(getattr(full, field), divisor),
                evicted_label: _cell(getattr(evicted, field), divisor),
            }
            for label, unit, field, divisor in _ROWS
        ]
    )


FORMULAS: dict[str, str] = {
    "Bytes per element": "bits / 8; with grouped quantisation + 4 / group size (one fp16 scale and zero-point)",
    "KV elements per token per layer": "2 × KV heads × head_dim; MLA: kv_lora_rank + qk_rope_head_dim",
    "KV per token": "layers × KV elements per token per layer × bytes per element",
    "Tokens held per layer": "ceil(keep × (N + M)), at most sliding_window on sliding layers",
    "KV per sequence": "Σ over layers of tokens held × KV elements per token per layer × bytes per element",
    "Weights": "parameters × bytes per weight",
    "Sequences that fit": "floor((GPUs × memory × (1 − reserve) − weights) / KV per sequence)",
    "Decode step": "(active parameters × bytes per weight + batch × KV per sequence) / (GPUs × bandwidth)",
    "Decode throughput": "batch / decode step",
    "Prefill FLOPs": "2 × active parameters × N + Σ over layers of attended pairs × attention FLOPs per pair",
    "Prefill time": "prefill FLOPs / (GPUs × peak FLOP/s × utilisation)",
    "Cost per query": "(prefill time + M × decode step / batch) × GPUs × price per hour / 3600",
    "Cost per million generated tokens": "cost per query × 1,000,000 / M",
}
"""The formulas of :mod:`kvlab.costs.formulas`, as the page shows them (N prompt tokens, M generated tokens)."""
