"""The benchmarks an accuracy floor is judged on, the stored task and share metric each reads, the shipped store that
holds each one's evidence, and the needle depths a sweep asks for by default; torch-free, so that the command line
can offer them without loading a model."""

from __future__ import annotations

from typing import Literal

from kvlab.paths import shipped

Benchmark = Literal["needle", "ruler", "perplexity"]
#: The stored task (a run's task, or the family before its ``:``, as ``quality:<text>``) and the metric each benchmark
#: is judged on: a share (a key of :data:`kvlab.runs.tables.SHARE_COLUMNS`), or perplexity.
BENCHMARKS: dict[str, tuple[str, str]] = {
    "needle": ("needle", "accuracy"),
    "ruler": ("ruler", "recall"),
    "perplexity": ("quality", "perplexity"),
}
#: The metric judged by perplexity (lower is better) rather than by a share of right answers.
PERPLEXITY = "perplexity"
#: The needle depths a sweep asks for unless told otherwise (``kvlab sweep --depths``).
NEEDLE_DEPTHS = "0,0.25,0.5,0.75,1"
#: The shipped store each benchmark's evidence is read from unless another is named.
SHIPPED_EVIDENCE = {
    "needle": shipped("runs", "claims.duckdb"),
    "ruler": shipped("runs", "ruler.duckdb"),
    "perplexity": shipped("runs", "claims.duckdb"),
}
