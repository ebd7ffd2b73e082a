"""Knorm: keep the keys with the smallest L2 norm."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvlab.policies.base import LayerView
from kvlab.policies.scoring import ScoringPolicy


@dataclass
class Knorm(ScoringPolicy):
    """Key-norm eviction (Devoto et al., "A Simple and Effective L2 Norm-Based Strategy for KV Cache Compression",
    EMNLP 2024, arXiv:2406.11430): tokens whose keys have a low L2 norm tend to receive high attention, so the
    tokens with the smallest key norms are kept. It needs no attention scores at all.

    Differs from the paper: the norm is taken of the cached (post-RoPE) keys, as kvpress does; RoPE is a rotation,
    so the norm is the same.
    """

    name: ClassVar[str] = "knorm"

    def score(self, view: LayerView) -> torch.Tensor:
        return -view.keys.float().norm(dim=-1)
