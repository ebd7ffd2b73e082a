"""What every eviction policy is, and the one place where a policy's scores become an eviction.

A policy is a small dataclass. It says what it needs observed (accumulated attention, an observation window of
queries), the smallest budget it can work with, how the budget is spread over layers, and one score per cached
token and KV head (higher is kept). :func:`evict_layer` turns scores into survivors the same way for all of them,
so that they differ only where their papers differ.
"""

from __future__ import annotations

import math
import typing
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

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


@dataclass(frozen=True)
class ParamSpec:
    """What values one policy parameter takes: bounds (inclusive unless ``open_minimum``/``open_maximum``), a list
    of ``choices`` for text parameters, and one line of ``help``. The policy checks its values against it, and the
    dashboard draws its widgets from it."""

    minimum: float | None = None
    maximum: float | None = None
    open_minimum: bool = False
    open_maximum: bool = False
    choices: tuple[str, ...] = ()
    help: str = ""

    def describe(self) -> str:
        """The allowed values in words, for error messages."""
        if self.choices:
            return "one of " + ", ".join(repr(choice) for choice in self.choices)
        parts = []
        if self.minimum is not None:
            parts.append(f"{'more than' if self.open_minimum else 'at least'} {self.minimum:g}")
        if self.maximum is not None:
            parts.append(f"{'less than' if self.open_maximum else 'at most'} {self.maximum:g}")
        return " and ".join(parts) or "any value"

    def allows(self, value: object) -> bool:
        """Whether ``value`` lies within the bounds or among the choices."""
        if self.choices:
            return value in self.choices
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return True
        if not math.isfinite(value):
            return False
        low_ok = self.minimum is None or (value > self.minimum if self.open_minimum else value >= self.minimum)
        high_ok = self.maximum is None or (value < self.maximum if self.open_maximum else value <= self.maximum)
        return low_ok and high_ok


def param(default: Any, **spec: Any) -> Any:
    """A policy parameter with its default and its :class:`ParamSpec` (bounds, choices, help)."""
    return field(default=default, metadata={"param": ParamSpec(**spec)})


def param_spec(cls: type[Policy], name: str) -> ParamSpec:
    """The spec of a parameter (no bounds when the policy declared none)."""
    for item in fields(cls):
        if item.name == name:
            return item.metadata.get("param", ParamSpec())
    raise KeyError(name)


@dataclass
class Policy:
    """Base of all eviction policies. Subclasses are dataclasses whose fields are the policy's parameters, declared
    with :func:`param` so that every value is checked the same way when the policy is made."""

    name: ClassVar[str] = ""
    needs_scores: ClassVar[bool] = False

    def __post_init__(self) -> None:
        hints = typing.get_type_hints(type(self))
        for item in fields(self):
            value = getattr(self, item.name)
            kind = hints[item.name]
            typed = (isinstance(value, bool) if kind is bool else
                     isinstance(value, int) and not isinstance(value, bool) if kind is int else
                     isinstance(value, (int, float)) and not isinstance(value, bool) if kind is float else
                     isinstance(value, kind))
            spec = item.metadata.get("param", ParamSpec())
            if not typed or not spec.allows(value):
                expected = {int: "a whole number", float: "a number", bool: "true or false"}.get(kind, "text")
                allowed = (spec.describe() if spec.choices else expected if kind is bool else
                           f"{expected} ({spec.describe()})")
                raise KvlabError(f"Parameter {item.name!r} of policy {self.name!r} must be {allowed}, not {value!r}.")

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
