"""The benchmarks an accuracy floor is judged on, the stored task and share metric each reads, and the shipped store
that holds each one's evidence; torch-free, so that the command line can offer them without loading a model."""

from __future__ import annotations

from typing import Literal

from kvlab.paths import shipped

Benchmark = Literal["needle", "ruler"]
#: The stored task and the share metric (a key of :data:`kvlab.runs.tables.SHARE_COLUMNS`) each benchmark is judged on.
BENCHMARKS: dict[str, tuple[str, str]] = {"needle": ("needle", "accuracy"), "ruler": ("ruler", "recall")}
#: The shipped store each benchmark's evidence is read from unless another is named.
SHIPPED_EVIDENCE = {"needle": shipped("runs", "claims.duckdb"), "ruler": shipped("runs", "ruler.duckdb")}
