"""StreamingLLM: attention sinks plus a window of recent tokens."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvlab.cache.ranking import KEEP
from kvlab.params import param
from kvlab.policies.base import LayerView
from kvlab.policies.scoring import ScoringPolicy


@dataclass
class Streaming(ScoringPolicy):
    """StreamingLLM (Xiao et al., "Efficient Streaming Language Models with Attention Sinks", ICLR 2024,
    arXiv:2309.17453): keep the first ``sinks`` tokens and the most recent ``budget - sinks``.

    Differs from the paper: tokens keep their original RoPE positions; the paper re-assigns positions inside the
    cache (section 3.2) so that relative distances never exceed the cache size. kvlab keeps one position contract for
    all policies so that they compare like with like; with RoPE models at contexts inside their trained length this
    matters little, beyond it the paper's variant extrapolates better.
    """

    name: ClassVar[str] = "streaming"
    scores_layers_alike: ClassVar[bool] = True
    sinks: int = param(4, minimum=0, help="first tokens always kept (attention sinks)")

    def min_budget(self) -> int:
        return self.sinks + 1

    def describe_min_budget(self) -> str:
        return f"its {self.sinks} sinks plus a recent window of at least one token"

    def score(self, view: LayerView) -> torch.Tensor:
        positions = view.positions
        return positions.float().masked_fill(positions < self.sinks, KEEP)
