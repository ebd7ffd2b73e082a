"""From inputs to outputs: one scenario priced with and without eviction, as numbers and as a table.

The calculator page only lays these out: :func:`compare` gives both estimates (each GPU's share among them),
:func:`cost_table` the rows with units, :data:`FORMULAS` the formulas as short strings.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import NamedTuple

import pandas as pd

from kvlab.costs import formulas as f
from kvlab.costs.gpus import GpuSpec
from kvlab.costs.models import ModelSpec
from kvlab.errors import KvlabError
from kvlab.models.arch import ArchFacts
from kvlab.units import format_bytes


@dataclass(frozen=True)
class Scenario:
    """What is served: queries of ``prompt_tokens`` (N) plus ``output_tokens`` (M), ``batch`` at a time.

    Memory and decode time are taken at the full context ``N + M`` for every step, an upper bound: the cache is
    shorter early in generation. ``gpu_count`` GPUs (1 to :data:`~kvlab.costs.formulas.MOST_GPUS`) split the model
    as a pipeline: each holds consecutive layers (:func:`~kvlab.costs.formulas.layer_split`), their weights and
    their cache, they work in turn on each step with one batch in flight, and every GPU is paid for.
    ``keep_fraction`` is the share of the context an eviction policy keeps (typed, or a stored run's).
    ``memory_reserve`` is the share of each GPU's memory kept back for activations and fragmentation.
    ``prefill_utilization`` is the fraction of peak FLOP/s that prefill reaches; None leaves prefill out of the time
    and cost. ``quant_group_size`` adds the scales and zero-points of a grouped quantised cache; None ignores them.
    Invalid values raise :class:`~kvlab.errors.KvlabError` here or when priced.
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
        if self.batch < 1:
            raise KvlabError("The batch must be at least 1 sequence.")
        if not 1 <= self.gpu_count <= f.MOST_GPUS:
            raise KvlabError(f"The number of GPUs must be a whole number from 1 to {f.MOST_GPUS}.")

    @property
    def context_tokens(self) -> int:
        """The sequence length a query reaches: prompt plus generated tokens."""
        return self.prompt_tokens + self.output_tokens


@dataclass(frozen=True)
class CostEstimate:
    """Every output of one scenario at one kept fraction.

    A configuration fits when every GPU's memory holds its share of the weights, the reserve and its share of at
    least one sequence's cache (:attr:`fits`). One that does not has no decode time, throughput, prefill time or
    price: those fields are None, so nothing can show a price for a deployment that cannot run. ``gpus_to_fit`` and
    ``gpus_to_fit_batch`` are the fewest GPUs of this kind (split as a pipeline) that hold one sequence and the
    whole batch; None when more than ``gpu_limit`` (:data:`~kvlab.costs.formulas.MOST_GPUS`, or one GPU per layer
    when the model has fewer layers) would be needed. ``gpu_shares``, ``sequences_per_gpu`` and ``stage_seconds``
    are per GPU, in pipeline order. The global-scope fields are the eviction scores one compression gathers on one
    GPU per sequence and the counts it reads back; None when nothing is evicted.
    """

    keep_fraction: float
    most_tokens_per_layer: int
    kv_bytes_per_token: float
    kv_bytes_per_sequence: float
    weight_bytes: float
    max_sequences: int
    batch_fits: bool
    gpu_count: int
    gpu_limit: int
    gpu_shares: tuple[f.GpuShare, ...]
    sequences_per_gpu: tuple[int, ...]
    gpus_to_fit: int | None
    gpus_to_fit_batch: int | None
    stage_seconds: tuple[float, ...] | None
    decode_step_seconds: float | None
    tokens_per_second: float | None
    prefill_seconds: float | None
    cost_per_query: float | None
    cost_per_million_tokens: float | None
    global_scope_gather_bytes: float | None
    global_scope_count_bytes: int | None

    @property
    def fits(self) -> bool:
        """Whether every GPU holds its weights, the reserve and its share of at least one sequence's cache."""
        return self.max_sequences >= 1

    @property
    def fullest_gpus(self) -> tuple[int, ...]:
        """The GPUs (0-based) with room for the fewest sequences: they set :attr:`max_sequences`."""
        return tuple(gpu for gpu, room in enumerate(self.sequences_per_gpu) if room == self.max_sequences)

    @property
    def fullest_gpu(self) -> int:
        """The first of :attr:`fullest_gpus`, whose share the table shows."""
        return self.fullest_gpus[0]

    @property
    def fullest_layers(self) -> int:
        """Layers on the fullest GPU."""
        return len(self.gpu_shares[self.fullest_gpu].layers)

    @property
    def fullest_weight_bytes(self) -> float:
        """Weights on the fullest GPU."""
        return self.gpu_shares[self.fullest_gpu].weight_bytes

    @property
    def fullest_kv_bytes_per_sequence(self) -> float:
        """The fullest GPU's part of one sequence's cache."""
        return self.gpu_shares[self.fullest_gpu].kv_bytes_per_sequence

    @property
    def slowest_gpus(self) -> tuple[int, ...]:
        """The GPUs (0-based) whose part of a decode step is longest; none when nothing fits."""
        if self.stage_seconds is None:
            return ()
        longest = max(self.stage_seconds)
        return tuple(gpu for gpu, seconds in enumerate(self.stage_seconds) if seconds == longest)

    @property
    def slowest_stage_seconds(self) -> float | None:
        """The slowest GPU's part of a decode step; None when nothing fits."""
        return None if self.stage_seconds is None else max(self.stage_seconds)


@dataclass(frozen=True)
class _Timing:
    """The times and prices of a configuration that fits."""

    stage_seconds: tuple[float, ...]
    decode_step_seconds: float
    tokens_per_second: float
    prefill_seconds: float
    cost_per_query: float
    cost_per_million_tokens: float


def _timing(
    model: ModelSpec, arch: ArchFacts, gpu: GpuSpec, scenario: Scenario, shares: tuple[f.GpuShare, ...]
) -> _Timing:
    """Decode step, throughput, prefill and prices of ``scenario`` on the GPUs that hold ``shares``."""
    stages = f.stage_seconds(
        shares,
        f.weight_bytes(model.params_per_token, scenario.weight_precision),
        arch.num_layers,
        scenario.batch,
        gpu.bandwidth_bytes_per_s,
    )
    step = f.pipeline_step_seconds(stages)
    prefill = f.prefill_seconds(  # the GPUs take turns on the prompt too, each computing its own layers
        f.prefill_flops(arch, model.params_per_token, scenario.prompt_tokens),
        gpu.peak_flops,
        scenario.prefill_utilization,
    )
    seconds = f.query_seconds(prefill, step, scenario.batch, scenario.output_tokens)
    query_cost = f.cost_per_query(seconds, gpu.price_per_hour, scenario.gpu_count)
    return _Timing(
        stage_seconds=stages,
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
    cache = (n, scenario.kv_precision, scenario.keep_fraction, scenario.quant_group_size)
    most_held = max(f.cached_tokens(arch, layer, n, scenario.keep_fraction) for layer in range(arch.num_layers))
    weights = f.weight_bytes(model.params, scenario.weight_precision)
    shares = f.gpu_shares(arch, scenario.gpu_count, weights, *cache)
    per_gpu = f.sequences_per_gpu(gpu.memory_bytes, shares, scenario.memory_reserve)
    fit = min(per_gpu)
    timing: _Timing | None = _timing(model, arch, gpu, scenario, shares)  # computed either way: bad inputs refused
    if fit < 1:
        timing = None
    evicts = scenario.keep_fraction < 1.0
    return CostEstimate(
        keep_fraction=scenario.keep_fraction,
        most_tokens_per_layer=most_held,
        kv_bytes_per_token=f.kv_bytes_per_token(arch, scenario.kv_precision, scenario.quant_group_size),
        kv_bytes_per_sequence=f.kv_bytes_for_sequence(arch, *cache),
        weight_bytes=weights,
        max_sequences=fit,
        batch_fits=scenario.batch <= fit,
        gpu_count=scenario.gpu_count,
        gpu_limit=min(f.MOST_GPUS, arch.num_layers),
        gpu_shares=shares,
        sequences_per_gpu=per_gpu,
        gpus_to_fit=f.gpus_that_fit(arch, gpu.memory_bytes, weights, *cache, scenario.memory_reserve),
        gpus_to_fit_batch=f.gpus_that_fit(
            arch, gpu.memory_bytes, weights, *cache, scenario.memory_reserve, sequences=scenario.batch
        ),
        stage_seconds=timing.stage_seconds if timing else None,
        decode_step_seconds=timing.decode_step_seconds if timing else None,
        tokens_per_second=timing.tokens_per_second if timing else None,
        prefill_seconds=timing.prefill_seconds if timing else None,
        cost_per_query=timing.cost_per_query if timing else None,
        cost_per_million_tokens=timing.cost_per_million_tokens if timing else None,
        global_scope_gather_bytes=f.global_scope_gather_bytes(arch, scenario.prompt_tokens) if evicts else None,
        global_scope_count_bytes=f.global_scope_count_bytes(arch) if evicts else None,
    )


def compare(model: ModelSpec, gpu: GpuSpec, scenario: Scenario) -> tuple[CostEstimate, CostEstimate]:
    """The full cache (kept fraction 1) and the evicted one (the scenario's kept fraction), side by side."""
    return estimate(model, gpu, replace(scenario, keep_fraction=1.0)), estimate(model, gpu, scenario)


#: What a table cell says for a time or price of a configuration that does not fit.
DOES_NOT_FIT = "does not fit"
#: What a table cell says for the eviction scope's traffic of the full cache.
NO_EVICTION = "no eviction"


class _Row(NamedTuple):
    """One row of :func:`cost_table`: the :class:`CostEstimate` field it shows, in ``unit`` after dividing by
    ``divisor``; ``missing`` is what the cell says when the field is None (``{limit}``: the estimate's GPU limit)."""

    label: str
    unit: str
    field: str
    divisor: float = 1.0
    missing: str = DOES_NOT_FIT


_FEWEST = "more than {limit}"
_ROWS: tuple[_Row, ...] = (
    _Row("Most tokens held by one layer", "tokens", "most_tokens_per_layer"),
    _Row("KV per token, all layers", "bytes", "kv_bytes_per_token"),
    _Row("KV per sequence", "bytes", "kv_bytes_per_sequence"),
    _Row("Weights", "bytes", "weight_bytes"),
    _Row("Sequences that fit beside the weights", "sequences", "max_sequences"),
    _Row("Batch fits in memory", "yes/no", "batch_fits"),
    _Row("Fewest GPUs that hold one sequence", "GPUs", "gpus_to_fit", missing=_FEWEST),
    _Row("Fewest GPUs that hold the batch", "GPUs", "gpus_to_fit_batch", missing=_FEWEST),
    _Row("Decode step (time per token per sequence)", "ms", "decode_step_seconds", 1e-3),
    _Row("Decode throughput of the batch", "tokens/s", "tokens_per_second"),
    _Row("Prefill per query", "s", "prefill_seconds"),
    _Row("Cost per query", "$", "cost_per_query"),
    _Row("Cost per million generated tokens", "$", "cost_per_million_tokens"),
    _Row(
        "Global scope: scores gathered per compression, per sequence",
        "bytes",
        "global_scope_gather_bytes",
        missing=NO_EVICTION,
    ),
    _Row("Global scope: counts read back per compression", "bytes", "global_scope_count_bytes", missing=NO_EVICTION),
)
#: Rows that only say something when the layers are split over several GPUs, after the row each details.
_SPLIT_ROWS: dict[str, tuple[_Row, ...]] = {
    "KV per sequence": (_Row("KV per sequence on the fullest GPU", "bytes", "fullest_kv_bytes_per_sequence"),),
    "Weights": (
        _Row("Layers on the fullest GPU", "layers", "fullest_layers"),
        _Row("Weights on the fullest GPU", "bytes", "fullest_weight_bytes"),
    ),
    "Decode step (time per token per sequence)": (
        _Row("Slowest GPU's part of a decode step", "ms", "slowest_stage_seconds", 1e-3),
    ),
}


def _rows(gpu_count: int) -> list[_Row]:
    """The table's rows: the detail rows of a split only when there is one."""
    if gpu_count == 1:
        return list(_ROWS)
    return [shown for row in _ROWS for shown in (row, *_SPLIT_ROWS.get(row.label, ()))]


def _cell(value: float | bool | None, row: _Row, estimate: CostEstimate) -> float | int | str:
    if value is None:
        return row.missing.format(limit=estimate.gpu_limit)
    if isinstance(value, bool):
        return "yes" if value else "no"
    return value / row.divisor if row.divisor != 1.0 else value


def cost_table(model: ModelSpec, gpu: GpuSpec, scenario: Scenario) -> pd.DataFrame:
    """The outputs of :func:`compare` as rows ``Quantity | Unit | Full cache | Evicted (keep …)``; byte rows hold
    bytes, and a column whose configuration does not fit says so instead of a time or price. With several GPUs the
    fullest GPU's layers, weights and cache and the slowest GPU's part of a step are added."""
    return estimates_table(*compare(model, gpu, scenario), scenario)


def estimates_table(full: CostEstimate, evicted: CostEstimate, scenario: Scenario) -> pd.DataFrame:
    """:func:`cost_table` of two estimates already made (times measured on a GPU put in place of the formulas',
    :func:`kvlab.costs.measured.with_measured_times`, among them)."""
    evicted_label = f"Evicted (keep {scenario.keep_fraction:.0%})"
    return pd.DataFrame(
        [
            {
                "Quantity": row.label,
                "Unit": row.unit,
                "Full cache": _cell(getattr(full, row.field), row, full),
                evicted_label: _cell(getattr(evicted, row.field), row, evicted),
            }
            for row in _rows(scenario.gpu_count)
        ]
    )


FORMULAS: dict[str, str] = {
    "Bytes per element": "bits / 8; with grouped quantisation + 4 / group size (one fp16 scale and zero-point)",
    "KV elements per token per layer": "2 × KV heads × head_dim; MLA: kv_lora_rank + qk_rope_head_dim",
    "KV per token": "layers × KV elements per token per layer × bytes per element",
    "Tokens held per layer": "ceil(keep × (N + M)), at most sliding_window on sliding layers",
    "KV per sequence": "Σ over layers of tokens held × KV elements per token per layer × bytes per element",
    "Weights": "parameters × bytes per weight",
    "Layers per GPU": "consecutive layers, floor(layers / GPUs) each; the first (layers mod GPUs) GPUs take one more",
    "Weights and KV per GPU": "weights × its layers / layers; KV per sequence summed over its layers only",
    "Sequences that fit": "fewest over GPUs of floor((memory × (1 − reserve) − its weights) / its KV per sequence)",
    "Fewest GPUs that fit": "smallest GPU count with sequences that fit ≥ 1 (or ≥ batch); below 1, no time or price",
    "Decode step": "Σ over GPUs of (its share of active weights × bytes per weight + batch × its KV) / bandwidth",
    "Decode throughput": "batch / decode step",
    "Prefill FLOPs": "2 × active parameters × N + Σ over layers of attended pairs × attention FLOPs per pair",
    "Prefill time": "prefill FLOPs / (peak FLOP/s × utilisation); the GPUs take turns",
    "Cost per query": "(prefill time + M × decode step / batch) × GPUs × price per hour / 3600",
    "Cost per million generated tokens": "cost per query × 1,000,000 / M",
    "Global scope, scores gathered": "layers × KV heads × N × 8 bytes (int64 key: score, position) per sequence",
    "Global scope, counts read back": "layers × 4 bytes (float32) per compression; a local scope moves nothing",
}
"""The formulas of :mod:`kvlab.costs.formulas`, as the page shows them (N prompt tokens, M generated tokens)."""


def formatted_costs(table: pd.DataFrame) -> pd.DataFrame:
    """``kvlab.costs.cost_table`` with every number written out for reading: sizes in binary units (KiB, MiB, GiB),
    thousands separated, three significant digits for fractional values, dollars to four significant digits; text
    cells ("does not fit", "yes") as they are."""

    def cell(value: object, unit: str) -> str:
        if isinstance(value, str):
            return value
        number = float(value)  # type: ignore[arg-type]
        if unit == "bytes":
            return format_bytes(number)
        if unit == "$":
            return f"${number:,.4g}" if number < 1000 else f"${number:,.0f}"
        if number == int(number) and abs(number) >= 1:
            return f"{int(number):,}"
        return f"{number:,.3f}" if abs(number) >= 1 else f"{number:.3g}"

    shown = table.copy()
    for column in shown.columns[2:]:
        shown[column] = [cell(value, unit) for value, unit in zip(shown[column], shown["Unit"])]
    shown["Unit"] = ["" if unit == "bytes" else unit for unit in shown["Unit"]]
    return shown
