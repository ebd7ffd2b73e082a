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
    """Per-layer sums over the queries of one forward pass, turned into means by :meth:`finish`. The sink mass is a
    mean over the queries that can see a sink (on a sliding-window layer, those whose window still reaches the
    first tokens): counting the others, which put no attention there because they cannot, would understate a
    sliding layer's sinks by as much as its window is shorter than the text."""

    request: StatsRequest
    num_layers: int
    entropy: list[torch.Tensor | None] = field(default_factory=list)
    sink_mass: list[torch.Tensor | None] = field(default_factory=list)
    sink_queries: list[torch.Tensor | None] = field(default_factory=list)
    pooled: list[torch.Tensor | None] = field(default_factory=list)
    queries: int = 0

    def __post_init__(self) -> None:
        self.entropy = [None] * self.num_layers
        self.sink_mass = [None] * self.num_layers
        self.sink_queries = [None] * self.num_layers
        self.pooled = [None] * self.num_layers

    def add(
        self, layer: int, probs: torch.Tensor, key_positions: torch.Tensor, visible: torch.Tensor | None = None
    ) -> None:
        """Add the statistics of a block of attention rows ``(b, kv_heads, groups, q, keys)``; ``visible`` (boolean,
        broadcastable to ``probs``; ``None``: every key) says which keys each query can see."""
        batch, kv_heads, groups, n_queries, n_keys = probs.shape
        entropy = -(probs * torch.log(probs.clamp_min(1e-30))).sum(-1).sum(-1)
        positions = key_positions.unsqueeze(2).unsqueeze(3)
        sink_keys = (positions >= 0) & (positions < self.request.n_sink)
        sink = (probs * sink_keys).sum(-1).sum(-1)
        seen = sink_keys if visible is None else sink_keys & visible
        seeing = seen.any(-1).expand(batch, kv_heads, groups, n_queries).sum(-1)
        bins = self.request.bin_of(key_positions)
        per_key = probs.sum(dim=(2, 3))
        pooled = torch.zeros(batch, kv_heads, self.request.n_bins, device=probs.device, dtype=torch.float32)
        pooled.scatter_add_(2, bins.expand(batch, kv_heads, n_keys), per_key.float())
        pooled = pooled.sum(1) / (kv_heads * groups)
        entropy = entropy.reshape(batch, kv_heads * groups).float()
        sink = sink.reshape(batch, kv_heads * groups).float()
        seeing = seeing.reshape(batch, kv_heads * groups).float()
        sums_and_values = (
            (self.entropy, entropy),
            (self.sink_mass, sink),
            (self.sink_queries, seeing),
            (self.pooled, pooled),
        )
        for sums, value in sums_and_values:
            earlier = sums[layer]
            sums[layer] = value if earlier is None else earlier + value

    def finish(self, n_queries: int) -> dict[str, Any]:
        """Means as CPU tensors: entropy over the forward's queries and sink mass over those that could see a sink
        (zero where none could), ``(layers, batch, q_heads)``, with how many could (``sink_queries``, to weigh
        passes by); pooled attention rows ``(layers, batch, bins)``."""

        def stack(values: list[torch.Tensor | None]) -> torch.Tensor:
            return torch.stack([v.cpu() for v in values if v is not None])

        seeing = stack(self.sink_queries)
        return {
            "entropy": stack(self.entropy) / n_queries,
            "sink_mass": stack(self.sink_mass) / seeing.clamp_min(1.0),
            "sink_queries": seeing,
            "pooled": stack(self.pooled) / n_queries,
        }
