"""A context read once for several runs: each ``prefill``-mode run compresses its own fork of the heap instead of
reading the context again (:func:`kvlab.engine.generation.prefill_once`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvlab.cache.heap import KVHeap


@dataclass
class Prefilled:
    """A batch of contexts read once with a full heap that remembers what every listed variant needs (accumulated
    attention, an observation window of queries), so that several ``prefill``-mode runs can each compress a fork of
    it instead of reading the context again. The results are those of separate runs (a tested equivalence); each
    counts the read's seconds and peak GPU allocation, as a separate run would."""

    input_ids: torch.Tensor
    cache: KVHeap
    logits: torch.Tensor
    peak_kv_bytes: int
    peak_kv_reserved_bytes: int
    seconds: float
    peak_gpu_bytes_per_device: dict[str, int]
