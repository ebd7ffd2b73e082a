"""Decode times measured on a GPU, read from the committed benchmark results, for the cost views to show beside
their estimates.

The cost formulas (:mod:`kvlab.costs.formulas`) estimate a decode step from datasheet bandwidth; a reader comparing
eviction policies also wants what a step took. ``bench/heap_gpu.py`` measures kvlab's own decode on a GPU
(Llama-3-8B shape, random bf16 weights, batch 1, keep 10%), side by side in one call per context, and commits the
result with the device named: :data:`MEASURED_DECODE` is the newest such file. Its figures are shown as what they
are (that device, that shape, those contexts), never scaled to another GPU or model: a scenario uses them in place of
the formulas (:func:`measured_times`) only when it is what was measured, and :func:`measured_against_formula` sets
each beside the formulas' figure for the same configuration.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path

import pandas as pd

from kvlab.costs.formulas import cost_per_million_tokens, cost_per_query, decode_tokens_per_second, query_seconds
from kvlab.costs.gpus import GPU_PRESETS
from kvlab.costs.models import MODEL_PRESETS
from kvlab.costs.report import CostEstimate, Scenario, estimate
from kvlab.errors import KvlabError
from kvlab.paths import bench_results

#: The newest side-by-side decode measurement, relative to the benchmark results folder.
MEASURED_DECODE = "heap_gpu/carried_lse_decode_h200.json"
#: How a time is labelled where the formulas made it (no GPU benchmark measured that scenario).
COMPUTED = "computed"
#: How a time is labelled where a GPU benchmark measured it (the device is named beside it).
MEASURED = "measured"
#: The cost preset whose shape the benchmark decodes.
MEASURED_MODEL = "Llama-3-8B"
#: The attention backend users get on CUDA (what ``--attention auto`` picks), whose figures stand for a configuration.
MEASURED_BACKEND = "flex"
#: What the benchmark decodes: the shape its figures hold for.
MEASURED_SHAPE = "Llama-3-8B shape, random bf16 weights, batch 1"
#: How the figures were taken, as the cost views say it.
MEASURED_METHOD = (
    "kvlab's own decode timed by bench/heap_gpu.py: each configuration run twice at the same shapes and the second "
    "reported (once at 131,072 tokens), milliseconds per token (median of the steady half, after the step's graph "
    "is captured); backend flex is what --attention auto picks on "
    "CUDA, sdpa kvlab's own kernels; x roofline is the time over (weights + kept KV bytes) / measured copy bandwidth."
)
#: The configurations the cost views show, by the benchmark's label, with the names readers know them by.
SHOWN = {
    "full": "full cache",
    "streaming streaming": "StreamingLLM",
    "h2o streaming": "H2O",
    "tova streaming": "TOVA",
    "snapkv streaming": "SnapKV (streaming mode)",
    "snapkv prefill threshold": "SnapKV (prefill mode)",
}
#: The benchmark's label of each stored configuration it measured, by (policy, mode); the full cache has no mode.
BENCHMARK_LABELS = {
    ("streaming", "streaming"): "streaming streaming",
    ("h2o", "streaming"): "h2o streaming",
    ("tova", "streaming"): "tova streaming",
    ("snapkv", "streaming"): "snapkv streaming",
    ("snapkv", "prefill"): "snapkv prefill threshold",
}


@dataclass(frozen=True)
class MeasuredRow:
    """One configuration's decode at one context: milliseconds per token and the memory roofline's."""

    context: int
    configuration: str
    attention: str
    decode_ms: float
    roofline_ms: float
    prefill_s: float | None = None


@dataclass(frozen=True)
class MeasuredDecode:
    """A benchmark's decode figures: the device they ran on, the file they come from, the kept share."""

    device: str
    source: str
    keep_fraction: float
    rows: tuple[MeasuredRow, ...]

    def contexts(self) -> list[int]:
        return sorted({row.context for row in self.rows})

    def nearest_context(self, tokens: int) -> int:
        """The measured context closest to ``tokens`` (the earlier on a tie)."""
        return min(self.contexts(), key=lambda context: (abs(context - tokens), context))

    def row(self, context: int, configuration: str, attention: str) -> MeasuredRow | None:
        """The figures of one configuration at one context under one backend; None where none was measured."""
        for row in self.rows:
            if (row.context, row.configuration, row.attention) == (context, configuration, attention):
                return row
        return None

    def decode_ms(self, context: int, configuration: str, attention: str) -> float | None:
        row = self.row(context, configuration, attention)
        return None if row is None else row.decode_ms

    def measures(self, model_name: str, gpu_name: str) -> bool:
        """Whether these figures were taken for ``model_name`` (a cost preset) on the GPU preset ``gpu_name``: the
        benchmark's shape is that preset's and the device's name holds the preset's family (``H200``)."""
        family = gpu_name.split()[0].lower()
        return model_name == MEASURED_MODEL and family in self.device.lower().split()


def load_measured_decode(results: Path | None = None) -> MeasuredDecode | None:
    """The figures of :data:`MEASURED_DECODE` under ``results`` (default: the checkout's benchmark results), or None
    where there are none (an installed kvlab ships no benchmark results). A file that is not such a result is one
    sentence."""
    folder = bench_results() if results is None else results
    if folder is None or not (folder / MEASURED_DECODE).is_file():
        return None
    path = folder / MEASURED_DECODE
    try:
        data = json.loads(path.read_text())
        rows = tuple(
            MeasuredRow(
                int(context),
                row["config"],
                row["attention"],
                float(row["decode_ms"]),
                row["roofline_ms"],
                None if row.get("prefill_s") is None else float(row["prefill_s"]),
            )
            for context, context_rows in data["decode"].items()
            for row in context_rows
            if row["config"] in SHOWN
        )
        device = str(data["device"])
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise KvlabError(f"{path} is not a decode benchmark result kvlab can read ({error}).") from error
    if not rows:
        raise KvlabError(f"{path} holds no decode figures of the configurations kvlab shows.")
    return MeasuredDecode(device, f"bench/results/{MEASURED_DECODE}", 0.1, rows)


def measured_table(measured: MeasuredDecode) -> pd.DataFrame:
    """Rows ``Context | Configuration | Backend | ms per token | x roofline | vs full cache``: every measured
    configuration, the last its time over the full cache's at the same context and backend."""
    records = []
    for row in sorted(measured.rows, key=lambda r: (r.context, list(SHOWN).index(r.configuration), r.attention)):
        full = measured.decode_ms(row.context, "full", row.attention)
        records.append(
            {
                "Context": row.context,
                "Configuration": SHOWN[row.configuration],
                "Backend": row.attention,
                "ms per token": row.decode_ms,
                "x roofline": round(row.decode_ms / row.roofline_ms, 2),
                "vs full cache": round(row.decode_ms / full, 2) if full else None,
            }
        )
    return pd.DataFrame(records)


def measured_summary(measured: MeasuredDecode, context_tokens: int) -> str:
    """One sentence: what the device measured at the context nearest ``context_tokens``, full cache against
    StreamingLLM, under the backend users get there (``flex``, what ``auto`` picks on CUDA)."""
    context = measured.nearest_context(context_tokens)
    full = measured.decode_ms(context, "full", "flex")
    streaming = measured.decode_ms(context, "streaming streaming", "flex")
    if full is None or streaming is None:
        return f"Measured on {measured.device} ({MEASURED_SHAPE}): see the table ({measured.source})."
    return (
        f"Measured on {measured.device} at {context:,} tokens ({MEASURED_SHAPE}, keep "
        f"{measured.keep_fraction:.0%}): full cache {full:.2f} ms per token, StreamingLLM {streaming:.2f} ms "
        f"({measured.source})."
    )


@dataclass(frozen=True)
class MeasuredTimes:
    """What a GPU benchmark measured for one scenario: decode seconds per token and prefill seconds (None where
    it did not time the prefill), on ``device``, for the configuration readers know as ``configuration``."""

    device: str
    configuration: str
    context: int
    decode_s: float
    prefill_s: float | None
    source: str

    @property
    def label(self) -> str:
        """``measured on NVIDIA H200 (StreamingLLM, 32,768 tokens, batch 1)``."""
        return f"measured on {self.device} ({self.configuration}, {self.context:,} tokens, batch 1)"


def measured_times(
    measured: MeasuredDecode | None, model_name: str, gpu_name: str, scenario: Scenario, configuration: str
) -> MeasuredTimes | None:
    """The benchmark's times for ``scenario`` priced for the preset ``model_name`` on the GPU preset ``gpu_name``,
    the cache held as ``configuration`` (a key of :data:`SHOWN`), under the backend users get on CUDA; None unless
    that is what was measured: the benchmark's shape and device family, one GPU, batch 1, bf16 weights and cache,
    a prompt of a measured length and, for an evicting configuration, the benchmark's kept share."""
    if measured is None or configuration not in SHOWN or not measured.measures(model_name, gpu_name):
        return None
    plain = scenario.gpu_count == 1 and scenario.batch == 1 and scenario.quant_group_size is None
    if not plain or (scenario.kv_precision, scenario.weight_precision) != ("bf16", "bf16"):
        return None
    if configuration != "full" and not math.isclose(scenario.keep_fraction, measured.keep_fraction):
        return None
    row = measured.row(scenario.prompt_tokens, configuration, MEASURED_BACKEND)
    if row is None:
        return None
    return MeasuredTimes(
        measured.device, SHOWN[configuration], row.context, row.decode_ms / 1000.0, row.prefill_s, measured.source
    )


def gpu_preset_of(device: str) -> str | None:
    """The first GPU preset of the device's family (``NVIDIA H200`` → ``H200 141GB``); None when there is none."""
    words = device.lower().split()
    return next((name for name in GPU_PRESETS if name.split()[0].lower() in words), None)


def measured_against_formula(measured: MeasuredDecode) -> pd.DataFrame:
    """Rows ``Context | Configuration | Backend | decode ms measured | decode ms formula | measured / formula |
    prefill s measured | prefill s formula``: each measured configuration beside the formulas' figure for the
    benchmark's shape on the datasheet of the device's GPU preset, at the same prompt length (one token generated,
    so the cache is the prompt's) and kept share. Empty where no preset matches the device."""
    gpu_name = gpu_preset_of(measured.device)
    if gpu_name is None:
        return pd.DataFrame()
    model, gpu = MODEL_PRESETS[MEASURED_MODEL], GPU_PRESETS[gpu_name]
    records = []
    for row in sorted(measured.rows, key=lambda r: (r.context, list(SHOWN).index(r.configuration), r.attention)):
        keep = 1.0 if row.configuration == "full" else measured.keep_fraction
        formula = estimate(model, gpu, Scenario(prompt_tokens=row.context, output_tokens=1, keep_fraction=keep))
        step = formula.decode_step_seconds
        records.append(
            {
                "Context": row.context,
                "Configuration": SHOWN[row.configuration],
                "Backend": row.attention,
                "decode ms measured": row.decode_ms,
                "decode ms formula": None if step is None else round(1000.0 * step, 3),
                "measured / formula": None if step is None else round(row.decode_ms / (1000.0 * step), 2),
                "prefill s measured": row.prefill_s,
                "prefill s formula": None if formula.prefill_seconds is None else round(formula.prefill_seconds, 3),
            }
        )
    return pd.DataFrame(records)


def with_measured_times(
    priced: CostEstimate, times: MeasuredTimes, scenario: Scenario, price_per_hour: float
) -> CostEstimate:
    """``priced`` with the measured decode step (and prefill, where timed) in place of the formulas', and the
    throughput and prices that follow from them; a configuration that does not fit stays without times."""
    if not priced.fits:
        return priced
    prefill = priced.prefill_seconds if times.prefill_s is None else times.prefill_s
    seconds = query_seconds(prefill or 0.0, times.decode_s, scenario.batch, scenario.output_tokens)
    query_cost = cost_per_query(seconds, price_per_hour, scenario.gpu_count)
    return replace(
        priced,
        stage_seconds=(times.decode_s,),
        decode_step_seconds=times.decode_s,
        tokens_per_second=decode_tokens_per_second(scenario.batch, times.decode_s),
        prefill_seconds=prefill,
        cost_per_query=query_cost,
        cost_per_million_tokens=cost_per_million_tokens(query_cost, scenario.output_tokens),
    )
