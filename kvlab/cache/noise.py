"""A noise floor on eviction scores: which tokens a policy keeps made less predictable from outside.

The articles propose adding noise to H2O's ranking so that an observer cannot infer from the cache's behaviour which
tokens were kept. kvlab adds seeded Gaussian or Laplace noise to any scoring policy's scores, scaled to the spread of
the scores being ranked (their standard deviation over the held tokens of each sequence and KV head), so one scale
means the same thing for attention sums, key norms and positions. Tokens a policy always keeps (``+inf``: sinks,
windows) and never keeps (``-inf``) are left as they are: noise blurs the ranking, not a policy's rules.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvlab.cache.layer import HeapLayer, along_positions
from kvlab.cache.ranking import KEEP


def unit_noise(kind: str, shape: torch.Size, generator: torch.Generator, device: torch.device) -> torch.Tensor:
    """Draws of unit scale (standard normal, or Laplace with unit scale parameter) from ``generator``."""
    if kind == "gaussian":
        return torch.randn(shape, generator=generator, device=device)
    if kind == "laplace":  # inverse CDF of a uniform draw in (-1/2, 1/2)
        uniform = torch.rand(shape, generator=generator, device=device).clamp(1e-7, 1 - 1e-7) - 0.5
        return -uniform.sign() * torch.log1p(-2 * uniform.abs())
    raise ValueError(f"unknown noise kind {kind!r}")


def score_spread(scores: torch.Tensor) -> torch.Tensor:
    """The standard deviation of the finite scores of each row ``(..., slots) -> (..., 1)``: the unit that a noise
    scale is relative to (zero for a row with fewer than two finite scores)."""
    finite = torch.isfinite(scores)
    count = finite.sum(dim=-1, keepdim=True).clamp_min(1)
    values = torch.where(finite, scores.float(), 0.0)
    mean = values.sum(dim=-1, keepdim=True) / count
    variance = (torch.where(finite, values - mean, 0.0) ** 2).sum(dim=-1, keepdim=True) / (count - 1).clamp_min(1)
    return variance.sqrt()


def add_noise(scores: torch.Tensor, draws: torch.Tensor, scale: float) -> torch.Tensor:
    """``scores`` plus ``scale`` x their spread x ``draws`` where the score is finite; infinite scores (always or
    never kept) unchanged."""
    noisy = scores.float() + scale * score_spread(scores) * draws
    return torch.where(torch.isfinite(scores), noisy, scores.float())


@dataclass(frozen=True)
class NoiseFloor:
    """The noise a run's cache adds to a policy's scores before ranking them (``kind`` ``none``: nothing)."""

    kind: str = "none"
    scale: float = 0.0

    def perturb(
        self,
        layer: HeapLayer,
        positions: torch.Tensor,
        scores: torch.Tensor,
        generator: torch.Generator,
        heads_share_ranking: bool,
    ) -> torch.Tensor:
        """``scores`` (``(batch, kv_heads, span)`` for the slots whose ``positions`` are given) with the noise floor
        added (unchanged without noise or at scale 0). One draw per held token in position order, as the random
        policy draws, so every layout adds the same noise to the same token; one draw per token for all KV heads
        where they share a ranking (TOVA). Free slots take no part in the spread."""
        if self.kind == "none" or self.scale == 0.0:
            return scores

        def draw(ordered: torch.Tensor) -> torch.Tensor:
            batch, kv_heads, span = ordered.shape
            heads = 1 if heads_share_ranking else kv_heads
            held = unit_noise(self.kind, torch.Size((batch, heads, layer.live)), generator, ordered.device)
            held = held.expand(batch, kv_heads, layer.live)
            return torch.cat([held, ordered.new_zeros((batch, kv_heads, span - layer.live))], dim=-1)

        draws = along_positions(layer, positions, positions.float(), draw)
        return add_noise(scores.masked_fill(positions < 0, KEEP), draws, self.scale)
