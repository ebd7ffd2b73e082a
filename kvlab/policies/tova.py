"""TOVA: keep what the current query attends to."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvlab.params import param
from kvlab.policies.base import LayerView
from kvlab.policies.scoring import ScoringPolicy


@dataclass
class TOVA(ScoringPolicy):
    """TOVA (Oren et al., "Transformers are Multi-State RNNs", arXiv:2401.06104): when the cache is over budget,
    drop the tokens the last query attends to least. As in the paper, the attention is averaged over all heads of
    the layer, so every head of a layer keeps the same tokens (``per_head=True`` scores each KV head on its own).

    Differs from the paper: in ``prefill`` mode the context is compressed once by the last context token's query,
    where the paper evicts one token per step from the start (that is kvlab's ``streaming`` mode with chunk 1).
    """

    name: ClassVar[str] = "tova"
    scores_layers_alike: ClassVar[bool] = True
    per_head: bool = param(False, help="score each KV head on its own instead of the layer's mean")

    def query_window(self) -> int:
        return 1

    def heads_share_ranking(self) -> bool:
        return not self.per_head

    def score(self, view: LayerView) -> torch.Tensor:
        votes = view.window_attention()
        if self.per_head:
            return votes
        return votes.mean(dim=1, keepdim=True).expand_as(votes)
