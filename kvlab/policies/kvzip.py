"""KVzip: each cached token scored by how much the model needs it to reconstruct the context."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
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

    The budget is ranked as the paper's default and kvpress's ``KVzipPress(layerwise=False)`` rank it: one ranking
    over every layer's and KV head's scores, so that layers and heads keep different numbers of tokens (the
    published cache options, :attr:`cache_defaults`: the global scope over KV heads that share their layer's budget,
    with no per-head floor; :mod:`kvlab.cache.scopes`). ``scope='local'`` ranks each layer alone with its heads
    pooled (kvpress's ``layerwise=True``); ``head_allocation='uniform'`` gives every layer and KV head the same budget
    (the reference code's ``pair-uniform`` level).

    Differs from the paper and kvpress 0.5.5 (``KVzipPress``, whose request, chunking and normalisation kvlab
    follows): a layer keeps at least one token per KV head of the global ranking (kvpress sets no floor; the sinks,
    always kept, are more). The head-level variant (one score per head, from a calibration set) and kvpress's
    KVzip+ normalisation are not implemented.
    Scores are float32 (the references keep them in the model's dtype, bf16 on a GPU, where many tie); the model's
    own attention scaling, soft-capping and sliding windows are applied (the references use ``1/sqrt(head_dim)``
    and neither). A model without a tokenizer gets no request: its reconstruction reads the context again.
    The chat template's opening tokens, when the context starts with them, are kept whole and not reconstructed,
    as the paper keeps its system prompt (kvpress scores them zero beyond its sinks).
    """

    name: ClassVar[str] = "kvzip"
    cache_defaults: ClassVar[Mapping[str, object]] = MappingProxyType(
        {"scope": "global", "head_allocation": "adakv", "head_floor": 0.0}
    )
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
