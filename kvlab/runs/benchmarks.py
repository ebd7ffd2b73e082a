"""The benchmarks an accuracy floor is judged on, the stored task and share metric each reads, the shipped store that
holds each one's evidence, and the needle depths a sweep asks for by default; torch-free, so that the command line
can offer them without loading a model."""

from __future__ import annotations

from typing import Literal

from kvlab.paths import shipped

Benchmark = Literal["needle", "ruler"]
#: The stored task and the share metric (a key of :data:`kvlab.runs.tables.SHARE_COLUMNS`) each benchmark is judged on.
BENCHMARKS: dict[str, tuple[str, str]] = {"needle": ("needle", "accuracy"), "ruler": ("ruler", "recall")}
#: The needle depths a sweep asks for unless told otherwise (``kvlab sweep --depths``).
NEEDLE_DEPTHS = "0,0.25,0.5,0.75,1"
#: The shipped store each benchmark's evidence is read from unless another is named.
SHIPPED_EVIDENCE = {"needle": shipped("runs", "claims.duckdb"), "ruler": shipped("runs", "ruler.duckdb")}
