"""KVzip: each cached token scored by how much the model needs it to reconstruct the context."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvlab.cache.ranking import KEEP
from kvlab.errors import KvlabError
from kvlab.modes import STREAMING
from kvlab.params import param
from kvlab.policies.base import LayerView
from kvlab.policies.scoring import ScoringPolicy


@dataclass
class KVzip(ScoringPolicy):
    """KVzip (Kim et al., "KVzip: Query-Agnostic KV Cache Compression with Context Reconstruction",
    arXiv:2505.23416, 2025): once the context is read, the model is asked to repeat it ("Repeat the previous context
    exactly.") and fed the context again after the request (teacher forcing), ``chunk_size`` context tokens per
    forward pass; each cached token's score is the most attention any query of that repetition gives it, the maximum
    over the queries and over the query heads of its KV head (:mod:`kvlab.engine.reconstruction`). The first ``sinks``
    tokens are always kept. The score does not depend on any question, so one compressed cache serves every
    question asked after it.

    Differs from the paper and kvpress 0.5.5 (``KVzipPress``, whose request, chunking and normalisation kvlab
    follows): kvlab's budget holds the same number of tokens in every layer and KV head (the reference code's
    ``pair-uniform`` level); the paper's default and kvpress's ``layerwise=False`` rank all layers and heads
    together (``head_allocation='adakv'`` is kvlab's nearest: one ranking over a layer's KV heads). The head-level
    variant (one score per head, from a calibration set) and kvpress's KVzip+ normalisation are not implemented.
    Scores are float32 (the references keep them in the model's dtype, bf16 on a GPU, where many tie); the model's
    own attention scaling, soft-capping and sliding windows are applied (the references use ``1/sqrt(head_dim)``
    and neither). A model without a tokenizer gets no request: its reconstruction reads the context again.
    The chat template's opening tokens, when the context starts with them, are kept whole and not reconstructed,
    as the paper keeps its system prompt (kvpress scores them zero beyond its sinks).
    """

    name: ClassVar[str] = "kvzip"
    sinks: int = param(4, minimum=0, help="first tokens always kept (attention sinks)")
    chunk_size: int = param(2048, minimum=1, help="context tokens reconstructed per forward pass")

    def min_budget(self) -> int:
        return self.sinks + 1

    def describe_min_budget(self) -> str:
        return f"its {self.sinks} sinks plus one scored token"

    def check_mode(self, mode: str) -> None:
        if mode == STREAMING:
            raise KvlabError(
                "Policy 'kvzip' scores a whole context once, by having the model reconstruct it, so it runs in "
                "prefill mode only."
            )
        super().check_mode(mode)

    def reconstructs(self) -> bool:
        return True

    def score(self, view: LayerView) -> torch.Tensor:
        return view.scores.masked_fill(view.positions < self.sinks, KEEP)
