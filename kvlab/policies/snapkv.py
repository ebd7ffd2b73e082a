"""SnapKV and PyramidKV: the cache as seen by an observation window of recent queries."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from kvlab.budget import PYRAMID_BETA, pyramid_shares, split_budget
from kvlab.errors import KvlabError
from kvlab.policies.base import KEEP, LayerView, param
from kvlab.policies.scoring import ScoringPolicy


@dataclass
class SnapKV(ScoringPolicy):
    """SnapKV (Li et al., "SnapKV: LLM Knows What You are Looking for Before Generation", NeurIPS 2024,
    arXiv:2404.14469): the last ``window`` queries vote for the tokens they attend to; votes are summed over the
    window, pooled along the sequence with a ``kernel``-wide pooling (max by default) so that neighbours of an
    important token survive with it, and the top tokens are kept together with the window itself.

    Differs from the paper: votes are summed over the query heads sharing a KV head (GQA); in ``streaming`` mode,
    which the paper does not have, the window is the last ``window`` queries seen before each eviction.
    """

    name: ClassVar[str] = "snapkv"
    window: int = param(32, minimum=1, help="recent queries that vote (the observation window)")
    kernel: int = param(7, minimum=1, maximum=255, help="width of the pooling along the sequence (odd)")
    pooling: str = param("max", choices=("max", "avg"), help="how votes are pooled along the sequence")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.kernel % 2 == 0:
            raise KvlabError(f"The pooling kernel of {self.name} must be a positive odd number, not {self.kernel}.")

    def query_window(self) -> int:
        return self.window

    def min_budget(self) -> int:
        return self.window + 1

    def describe_min_budget(self) -> str:
        return f"its observation window of {self.window} tokens plus one"

    def score(self, view: LayerView) -> torch.Tensor:
        pooled = view.in_position_order(view.window_attention(), self._pool)
        return pooled.masked_fill(view.most_recent(self.window), KEEP)

    def _pool(self, votes: torch.Tensor) -> torch.Tensor:
        """Votes pooled along the sequence (``votes`` in position order)."""
        batch, kv_heads, slots = votes.shape
        flat = votes.reshape(batch * kv_heads, 1, slots)
        pool = F.max_pool1d if self.pooling == "max" else F.avg_pool1d
        return pool(flat, kernel_size=self.kernel, stride=1, padding=self.kernel // 2).reshape(votes.shape)


@dataclass
class PyramidKV(SnapKV):
    """PyramidKV (Cai et al., "PyramidKV: Dynamic KV Cache Compression based on Pyramidal Information Funneling",
    arXiv:2406.02069): SnapKV's scores with a budget that falls linearly with depth. Outside the window, the top
    layer keeps ``1/beta`` of the average and the bottom layer ``2 - 1/beta`` times it, so the total over layers is
    that of a uniform budget (exactly, after rounding).

    Differs from the paper: as SnapKV above; and where the schedule gives the lower layers more than the context
    holds (large kept fractions), the reference code lets that surplus go unused, so the total falls short of a
    uniform budget; kvlab hands the surplus to the upper layers in proportion to their shares, keeping both the
    total and the fall with depth.
    """

    name: ClassVar[str] = "pyramidkv"
    own_layer_budgets: ClassVar[bool] = True
    beta: int = param(
        PYRAMID_BETA, minimum=1, help="how steeply the budget falls with depth (top layer: 1/beta of the mean)"
    )

    def layer_budgets(
        self, budget: int, num_layers: int, capacity: int | None = None, measured: Sequence[float] | None = None
    ) -> list[int]:
        if num_layers == 1:
            return [budget]
        shares = pyramid_shares(budget - self.window, self.beta, num_layers)
        return split_budget(shares, self.window, budget * num_layers, capacity)
