"""The dashboard's attention statistics, accumulated over the queries of one forward pass: each layer's attention
entropy, the mass on the first tokens (the sinks) and the attention rows pooled over original positions."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class StatsRequest:
    """What the dashboard asks to observe: sinks are the first ``n_sink`` positions; attention rows are pooled into
    ``n_bins`` bins over original positions ``[0, span)``."""

    n_sink: int = 4
    n_bins: int = 64
    span: int = 1

    def bin_of(self, positions: torch.Tensor) -> torch.Tensor:
        """The bin of each original position (the dashboard draws bins with this same formula)."""
        return (positions.long() * self.n_bins // max(self.span, 1)).clamp_(0, self.n_bins - 1)


@dataclass
class StatsAccumulator:
    """Per-layer sums over the queries of one forward pass, turned into means by :meth:`finish`."""

    request: StatsRequest
    num_layers: int
    entropy: list[torch.Tensor | None] = field(default_factory=list)
    sink_mass: list[torch.Tensor | None] = field(default_factory=list)
    pooled: list[torch.Tensor | None] = field(default_factory=list)
    queries: int = 0

    def __post_init__(self) -> None:
        self.entropy = [None] * self.num_layers
        self.sink_mass = [None] * self.num_layers
        self.pooled = [None] * self.num_layers

    def add(self, layer: int, probs: torch.Tensor, key_positions: torch.Tensor) -> None:
        """Add the statistics of a block of attention rows ``(b, kv_heads, groups, q, keys)``."""
        batch, kv_heads, groups, n_queries, n_keys = probs.shape
        entropy = -(probs * torch.log(probs.clamp_min(1e-30))).sum(-1).sum(-1)
        positions = key_positions.unsqueeze(2).unsqueeze(3)
        sink = (probs * (positions < self.request.n_sink)).sum(-1).sum(-1)
        bins = self.request.bin_of(key_positions)
        per_key = probs.sum(dim=(2, 3))
        pooled = torch.zeros(batch, kv_heads, self.request.n_bins, device=probs.device, dtype=torch.float32)
        pooled.scatter_add_(2, bins.expand(batch, kv_heads, n_keys), per_key.float())
        pooled = pooled.sum(1) / (kv_heads * groups)
        entropy = entropy.reshape(batch, kv_heads * groups).float()
        sink = sink.reshape(batch, kv_heads * groups).float()
        for sums, value in ((self.entropy, entropy), (self.sink_mass, sink), (self.pooled, pooled)):
            earlier = sums[layer]
            sums[layer] = value if earlier is None else earlier + value

    def finish(self, n_queries: int) -> dict[str, Any]:
        """Means over the forward's queries as CPU tensors: entropy and sink mass ``(layers, batch, q_heads)``, pooled
        attention rows ``(layers, batch, bins)``."""

        def stack(values: list[torch.Tensor | None]) -> torch.Tensor:
            return torch.stack([v.cpu() for v in values if v is not None]) / n_queries

        return {"entropy": stack(self.entropy), "sink_mass": stack(self.sink_mass), "pooled": stack(self.pooled)}
