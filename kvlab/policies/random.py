"""Random eviction: the control group."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvlab.policies.base import LayerView
from kvlab.policies.scoring import ScoringPolicy


@dataclass
class RandomPolicy(ScoringPolicy):
    """Keep a uniformly random subset of the cache at every eviction, reproducible from the run's seed (``--seed``).
    Not from a paper: the baseline that shows how much of a policy's accuracy comes from choosing at all."""

    name: ClassVar[str] = "random"
    capturable: ClassVar[bool] = False

    def score(self, view: LayerView) -> torch.Tensor:
        def draw(ordered: torch.Tensor) -> torch.Tensor:
            """One draw per held token, in position order (free slots, last, get none), so that every layout and
            mode draws the same numbers for the same tokens."""
            batch, kv_heads, span = ordered.shape
            held = torch.rand((batch, kv_heads, view.cache.live), generator=view.generator, device=ordered.device)
            return torch.cat([held, ordered.new_full((batch, kv_heads, span - view.cache.live), float("inf"))], -1)

        return view.in_position_order(view.positions.float(), draw)
