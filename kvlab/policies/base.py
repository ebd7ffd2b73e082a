"""What every eviction policy is, and the one place where a policy's scores become an eviction.

A policy is a small dataclass. It says what it needs observed (accumulated attention, an observation window of
queries), the smallest budget it can work with, how the budget is spread over layers, and one score per cached
token and KV head (higher is kept). :func:`evict_layer` turns scores into survivors the same way for all of them,
so that they differ only where their papers differ.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import ClassVar

import torch

from kvlab.attention import window_attention
from kvlab.cache import BudgetedCache, LayerCache
from kvlab.errors import KvlabError

KEEP = float("inf")


@dataclass
class LayerView:
    """What a policy may look at when scoring one layer."""

    layer_idx: int
    num_layers: int
    cache: LayerCache
    budget: int
    uniform_budget: int
    next_position: int
    generator: torch.Generator

    @property
    def positions(self) -> torch.Tensor:
        """Original positions of the cached tokens, ``(batch, kv_heads, slots)``."""
        assert self.cache.positions is not None
        return self.cache.positions

    def most_recent(self, count: int) -> torch.Tensor:
        """Whether each slot holds one of the ``count`` most recent positions seen."""
        return self.positions >= self.next_position - count

    def window_attention(self) -> torch.Tensor:
        """Attention of the remembered query window over the cache, ``(batch, kv_heads, slots)``."""
        return window_attention(self.cache)


@dataclass
class Policy:
    """Base of all eviction policies. Subclasses are dataclasses whose fields are the policy's parameters."""

    name: ClassVar[str] = ""
    needs_scores: ClassVar[bool] = False

    def query_window(self) -> int:
        """How many recent queries per layer the attention function must remember for :meth:`score`."""
        return 0

    def min_budget(self) -> int:
        """The smallest per-layer budget the policy can honour (its sinks and windows)."""
        return 1

    def describe_min_budget(self) -> str:
        """Why the budget cannot be smaller than :meth:`min_budget`, for error messages."""
        return "one token"

    def layer_budgets(self, budget: int, num_layers: int, capacity: int | None = None) -> list[int]:
        """Tokens each layer keeps per KV head, for contexts of at most ``capacity`` tokens. Uniform unless the
        policy spreads the total differently."""
        return [budget] * num_layers

    def evicts(self) -> bool:
        """Whether the policy ever drops tokens (``full`` does not)."""
        return True

    def score(self, view: LayerView) -> torch.Tensor:
        """One score per cached token and KV head, ``(batch, kv_heads, slots)``; the highest ``budget`` survive."""
        raise NotImplementedError

    def params(self) -> dict[str, object]:
        """The policy's parameters by name, for storage and display."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


def evict_layer(cache: BudgetedCache, layer_idx: int, policy: Policy, view: LayerView) -> None:
    """Shrink one layer to its budget: drop tokens no query can see any more (outside a sliding window) first, then
    the lowest-scoring ones. The survivors stay in position order.

    A layer that holds no more than the uniform budget keeps everything even if its own (PyramidKV) share is
    smaller: as in PyramidKV's reference code, compression starts only once the context exceeds the budget.
    """
    layer = cache.layers[layer_idx]
    budget = view.budget if layer.length > view.uniform_budget else layer.length
    window = layer.sliding_window
    if window is not None:
        budget = min(budget, window - 1)
    if layer.length <= budget:
        return
    scores = policy.score(view) if policy.evicts() else view.positions.float()
    if window is not None:
        dead = view.positions <= view.next_position - window
        scores = scores.masked_fill(dead, float("-inf"))
    keep = scores.topk(budget, dim=-1, sorted=False).indices.sort(dim=-1).values
    cache.keep(layer_idx, keep)


def check_fields(cls: type[Policy], params: dict[str, object]) -> None:
    """Reject parameter names the policy does not have, naming the ones it does."""
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(params) - known)
    if unknown:
        accepted = ", ".join(sorted(known)) or "none"
        raise KvlabError(
            f"Policy {cls.name!r} has no parameter {', '.join(map(repr, unknown))}; its parameters are: {accepted}."
        )
