"""From inputs to outputs: one scenario priced with and without eviction, as numbers and as a table.

The calculator page only lays these out: :func:`compare` gives both estimates, :func:`cost_table` the rows with
units, :data:`FORMULAS` the formulas as short strings.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import NamedTuple

import pandas as pd

from kvlab.arch import ArchFacts
from kvlab.costs import formulas as f
from kvlab.costs.gpus import GpuSpec
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
    """Every output of one scenario at one kept fraction.

    A configuration fits when the GPUs' memory holds the weights, the reserve and at least one sequence's cache
    (:attr:`fits`). One that does not has no decode time, throughput, prefill time or price: those fields are None,
    so nothing can show a price for a deployment that cannot run. ``gpus_to_fit`` and ``gpus_to_fit_batch`` are the
    fewest GPUs of this kind (ideal tensor parallelism) that hold one sequence and the whole batch; None when more
    than :data:`~kvlab.costs.formulas.MOST_GPUS` would be needed.
    """

    keep_fraction: float
    most_tokens_per_layer: int
    kv_bytes_per_token: float
    kv_bytes_per_sequence: float
    weight_bytes: float
    max_sequences: int
    batch_fits: bool
    gpus_to_fit: int | None
    gpus_to_fit_batch: int | None
    decode_step_seconds: float | None
    tokens_per_second: float | None
    prefill_seconds: float | None
    cost_per_query: float | None
    cost_per_million_tokens: float | None

    @property
    def fits(self) -> bool:
        """Whether the weights, the reserve and at least one sequence's cache fit in the GPUs' memory."""
        return self.max_sequences >= 1


@dataclass(frozen=True)
class _Timing:
    """The times and prices of a configuration that fits."""

    decode_step_seconds: float
    tokens_per_second: float
    prefill_seconds: float
    cost_per_query: float
    cost_per_million_tokens: float


def _timing(model: ModelSpec, arch: ArchFacts, gpu: GpuSpec, scenario: Scenario, kv_sequence: float) -> _Timing:
    """Decode step, throughput, prefill and prices of ``scenario``, whose sequences cache ``kv_sequence`` bytes."""
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
    return _Timing(
        decode_step_seconds=step,
        tokens_per_second=f.decode_tokens_per_second(scenario.batch, step),
        prefill_seconds=prefill,
        cost_per_query=query_cost,
        cost_per_million_tokens=f.cost_per_million_tokens(query_cost, scenario.output_tokens),
    )


def estimate(model: ModelSpec, gpu: GpuSpec, scenario: Scenario) -> CostEstimate:
    """Price ``scenario`` for ``model`` on ``gpu`` at the scenario's kept fraction (no price when it does not fit)."""
    arch = model.arch
    n = scenario.context_tokens
    kv_sequence = f.kv_bytes_for_sequence(
        arch, n, scenario.kv_precision, scenario.keep_fraction, scenario.quant_group_size
    )
    most_held = max(f.cached_tokens(arch, layer, n, scenario.keep_fraction) for layer in range(arch.num_layers))
    weights = f.weight_bytes(model.params, scenario.weight_precision)
    fit = f.sequences_that_fit(scenario.gpu_count * gpu.memory_bytes, weights, kv_sequence, scenario.memory_reserve)
    timing: _Timing | None = _timing(
        model, arch, gpu, scenario, kv_sequence
    )  # computed either way, so bad inputs are always refused
    if fit < 1:
        timing = None
    return CostEstimate(
        keep_fraction=scenario.keep_fraction,
        most_tokens_per_layer=most_held,
        kv_bytes_per_token=f.kv_bytes_per_token(arch, scenario.kv_precision, scenario.quant_group_size),
        kv_bytes_per_sequence=kv_sequence,
        weight_bytes=weights,
        max_sequences=fit,
        batch_fits=scenario.batch <= fit,
        gpus_to_fit=f.gpus_that_fit(gpu.memory_bytes, weights, kv_sequence, scenario.memory_reserve),
        gpus_to_fit_batch=f.gpus_that_fit(
            gpu.memory_bytes, weights, kv_sequence, scenario.memory_reserve, sequences=scenario.batch
        ),
        decode_step_seconds=timing.decode_step_seconds if timing else None,
        tokens_per_second=timing.tokens_per_second if timing else None,
        prefill_seconds=timing.prefill_seconds if timing else None,
        cost_per_query=timing.cost_per_query if timing else None,
        cost_per_million_tokens=timing.cost_per_million_tokens if timing else None,
    )


def compare(model: ModelSpec, gpu: GpuSpec, scenario: Scenario) -> tuple[CostEstimate, CostEstimate]:
    """The full cache (kept fraction 1) and the evicted one (the scenario's kept fraction), side by side."""
    return estimate(model, gpu, replace(scenario, keep_fraction=1.0)), estimate(model, gpu, scenario)


#: What a table cell says for a time or price of a configuration that does not fit.
DOES_NOT_FIT = "does not fit"


class _Row(NamedTuple):
    """One row of :func:`cost_table`: the :class:`CostEstimate` field it shows, in ``unit`` after dividing by
    ``divisor``; ``missing`` is what the cell says when the field is None."""

    label: str
    unit: str
    field: str
    divisor: float = 1.0
    missing: str = DOES_NOT_FIT


_ROWS: tuple[_Row, ...] = (
    _Row("Most tokens held by one layer", "tokens", "most_tokens_per_layer"),
    _Row("KV per token, all layers", "bytes", "kv_bytes_per_token"),
    _Row("KV per sequence", "bytes", "kv_bytes_per_sequence"),
    _Row("Weights", "bytes", "weight_bytes"),
    _Row("Sequences that fit beside the weights", "sequences", "max_sequences"),
    _Row("Batch fits in memory", "yes/no", "batch_fits"),
    _Row("Fewest GPUs that hold one sequence", "GPUs", "gpus_to_fit", missing=f"more than {f.MOST_GPUS}"),
    _Row("Fewest GPUs that hold the batch", "GPUs", "gpus_to_fit_batch", missing=f"more than {f.MOST_GPUS}"),
    _Row("Decode step (time per token per sequence)", "ms", "decode_step_seconds", 1e-3),
    _Row("Decode throughput of the batch", "tokens/s", "tokens_per_second"),
    _Row("Prefill per query", "s", "prefill_seconds"),
    _Row("Cost per query", "$", "cost_per_query"),
    _Row("Cost per million generated tokens", "$", "cost_per_million_tokens"),
)


def _cell(value: float | bool | None, row: _Row) -> float | int | str:
    if value is None:
        return row.missing
    if isinstance(value, bool):
        return "yes" if value else "no"
    return value / row.divisor if row.divisor != 1.0 else value


def cost_table(model: ModelSpec, gpu: GpuSpec, scenario: Scenario) -> pd.DataFrame:
    """The outputs of :func:`compare` as rows ``Quantity | Unit | Full cache | Evicted (keep …)``; byte rows hold
    bytes, and a column whose configuration does not fit says so instead of a time or price."""
    full, evicted = compare(model, gpu, scenario)
    evicted_label = f"Evicted (keep {scenario.keep_fraction:.0%})"
    return pd.DataFrame(
        [
            {
                "Quantity": row.label,
                "Unit": row.unit,
                "Full cache": _cell(getattr(full, row.field), row),
                evicted_label: _cell(getattr(evicted, row.field), row),
            }
            for row in _ROWS
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
    "Fewest GPUs that fit": "smallest GPU count with sequences that fit ≥ 1 (or ≥ batch); below 1, no time or price",
    "Decode step": "(active parameters × bytes per weight + batch × KV per sequence) / (GPUs × bandwidth)",
    "Decode throughput": "batch / decode step",
    "Prefill FLOPs": "2 × active parameters × N + Σ over layers of attended pairs × attention FLOPs per pair",
    "Prefill time": "prefill FLOPs / (GPUs × peak FLOP/s × utilisation)",
    "Cost per query": "(prefill time + M × decode step / batch) × GPUs × price per hour / 3600",
    "Cost per million generated tokens": "cost per query × 1,000,000 / M",
}
"""The formulas of :mod:`kvlab.costs.formulas`, as the page shows them (N prompt tokens, M generated tokens)."""
