"""Decode times measured on a GPU, read from the committed benchmark results, for the cost views to show beside
their estimates.

The cost formulas (:mod:`kvlab.costs.formulas`) estimate a decode step from datasheet bandwidth; a reader comparing
eviction policies also wants what a step took. ``bench/heap_gpu.py`` measures kvlab's own decode on a GPU
(Llama-3-8B shape, random bf16 weights, batch 1, keep 10%), side by side in one call per context, and commits the
result with the device named: :data:`MEASURED_DECODE` is the newest such file. Its figures are shown as what they
are (that device, that shape, those contexts), never scaled to another GPU or model.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from kvlab.errors import KvlabError
from kvlab.paths import bench_results

#: The newest side-by-side decode measurement, relative to the benchmark results folder.
MEASURED_DECODE = "heap_gpu/stacked_decode_h200.json"
#: What the benchmark decodes: the shape its figures hold for.
MEASURED_SHAPE = "Llama-3-8B shape, random bf16 weights, batch 1"
#: How the figures were taken, as the cost views say it.
MEASURED_METHOD = (
    "kvlab's own decode timed by bench/heap_gpu.py: each configuration run twice at the same shapes and the second "
    "reported, milliseconds per token (median of the steady half); backend flex is what --attention auto picks on "
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


@dataclass(frozen=True)
class MeasuredRow:
    """One configuration's decode at one context: milliseconds per token and the memory roofline's."""

    context: int
    configuration: str
    attention: str
    decode_ms: float
    roofline_ms: float


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

    def decode_ms(self, context: int, configuration: str, attention: str) -> float | None:
        for row in self.rows:
            if (row.context, row.configuration, row.attention) == (context, configuration, attention):
                return row.decode_ms
        return None


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
            MeasuredRow(int(context), row["config"], row["attention"], float(row["decode_ms"]), row["roofline_ms"])
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
