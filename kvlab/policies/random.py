"""Random eviction: the control group."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvlab.policies.base import LayerView, Policy


@dataclass
class RandomPolicy(Policy):
    """Keep a uniformly random subset of the cache at every eviction, reproducible from the run's seed (``--seed``).
    Not from a paper: the baseline that shows how much of a policy's accuracy comes from choosing at all."""

    name: ClassVar[str] = "random"

    def score(self, view: LayerView) -> torch.Tensor:
        positions = view.positions
        return torch.rand(positions.shape, generator=view.generator, device=positions.device)
