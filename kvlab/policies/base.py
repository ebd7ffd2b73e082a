"""What every eviction policy is, and the one place where a policy's scores become an eviction.

A policy is a small dataclass. It says what it needs observed (accumulated attention, an observation window of
queries), the smallest budget it can work with, how the budget is spread over layers, and one score per cached
token and KV head (higher is kept). :func:`evict_layer` turns scores into survivors the same way for all of them,
so that they differ only where their papers differ.
"""

from __future__ import annotations

import math
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

import torch

from kvlab.attention.function import window_attention
from kvlab.cache.demotion import DemotionSpec
from kvlab.cache.heap import FREE, DeviceClock, HeapLayer, KVHeap, position_order
from kvlab.cache.sparse import SparseRead
from kvlab.cache.tiers import adakv_kept
from kvlab.errors import KvlabError
from kvlab.models.rope import Rope

KEEP = float("inf")
#: The score half of :func:`by_score_then_position`'s key for an infinite score.
_INFINITE_KEY = torch.tensor(KEEP).view(torch.int32).item()


@dataclass
class LayerView:
    """What a policy may look at when scoring one layer: the first ``span`` slots of its heap (free ones included:
    their position is negative, and whatever a policy scores them, they are never chosen). ``next_position`` is the
    position the next token will get (a number, or in a captured decode step a device tensor). ``rope`` is the
    model's rotary embedding where kvlab found one, and ``heap`` the whole heap, for a policy that reuses the decision
    of a layer evicted before this one (layers are evicted in order)."""

    layer_idx: int
    num_layers: int
    cache: HeapLayer
    budget: int
    uniform_budget: int
    next_position: int | torch.Tensor
    generator: torch.Generator
    span: int
    rope: Rope | None = None
    heap: KVHeap | None = None

    @property
    def positions(self) -> torch.Tensor:
        """Original positions of the tokens in the slots, ``(batch, kv_heads, span)``; negative where free."""
        assert self.cache.positions is not None
        return self.cache.positions[:, :, : self.span]

    @property
    def keys(self) -> torch.Tensor:
        """The cached keys (post-RoPE), ``(batch, kv_heads, span, head_dim)``."""
        assert self.cache.keys is not None
        return self.cache.keys[:, :, : self.span]

    @property
    def scores(self) -> torch.Tensor:
        """The attention each slot has accumulated, ``(batch, kv_heads, span)``."""
        assert self.cache.scores is not None
        return self.cache.scores[:, :, : self.span]

    def in_position_order(self, values: torch.Tensor, along_positions) -> torch.Tensor:
        """``along_positions`` applied to ``values`` (``(batch, kv_heads, span)``, one per slot) as if the slots were
        in position order (free ones last), and the result put back in slot order: what pools or draws along the
        sequence gives the same answer in every layout."""
        if self.cache.ordered and self.cache.dead == 0:  # live slots first, in position order, free ones after
            return along_positions(values)
        order = position_order(self.positions)
        return torch.empty_like(values).scatter_(2, order, along_positions(values.gather(2, order)))

    def most_recent(self, count: int) -> torch.Tensor:
        """Whether each slot holds one of the ``count`` most recent positions seen."""
        return self.positions >= self.next_position - count

    def window_attention(self) -> torch.Tensor:
        """Attention of the remembered query window over the slots, ``(batch, kv_heads, span)``."""
        return window_attention(self.cache, self.span)

    def query_moments(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """Mean ``(batch, q_heads, head_dim)`` and covariance ``(batch, q_heads, head_dim, head_dim)`` of the layer's
        queries before RoPE (every query seen at positions from :data:`~kvlab.cache.heap.MOMENTS_SKIP` on), with their
        count as a device scalar; ``None`` when they were not accumulated (the policy does not declare
        ``needs_query_moments``, or the model has no rotary embedding kvlab can find)."""
        moments = self.cache.moments
        if moments is None:
            return None
        mean, covariance = moments.mean_and_covariance()
        return mean, covariance, moments.count


@dataclass(frozen=True)
class ParamSpec:
    """What values one policy parameter takes: bounds (inclusive unless ``open_minimum``/``open_maximum``), a list
    of ``choices`` for text (or whole-number) parameters, and one line of ``help``. The policy checks its values
    against it, and the dashboard draws its widgets from it."""

    minimum: float | None = None
    maximum: float | None = None
    open_minimum: bool = False
    open_maximum: bool = False
    choices: tuple[str | int, ...] = ()
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
            return not isinstance(value, bool) and value in self.choices
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
    #: Whether the policy evicts to a budget, and so takes one. ``full`` does not, nor do the ablations
    #: (``drop_first``, ``drop_pillars``), which remove a fixed number of tokens whatever the budget.
    evicts: ClassVar[bool] = True
    #: Whether :meth:`score` reads the attention each cached token received (H2O), which the attention function
    #: then accumulates.
    needs_scores: ClassVar[bool] = False
    #: Whether its eviction can be captured in a CUDA graph (random draws from a generator a graph would not advance).
    capturable: ClassVar[bool] = True
    #: Whether :meth:`score` reads the running moments of the queries before RoPE (:meth:`LayerView.query_moments`),
    #: which the attention function then accumulates.
    needs_query_moments: ClassVar[bool] = False
    #: Whether the policy reads a selection of the held tokens for each decoded token (:meth:`sparse_read`): its
    #: budget is then the tokens it reads per step, layer and KV head, and it declares ``evicts`` to take one.
    reads_sparsely: ClassVar[bool] = False

    def __post_init__(self) -> None:
        hints = typing.get_type_hints(type(self))
        for item in fields(self):
            value = getattr(self, item.name)
            kind = hints[item.name]
            typed = (
                isinstance(value, bool)
                if kind is bool
                else isinstance(value, int) and not isinstance(value, bool)
                if kind is int
                else isinstance(value, (int, float)) and not isinstance(value, bool)
                if kind is float
                else isinstance(value, kind)
            )
            spec = item.metadata.get("param", ParamSpec())
            if not typed or not spec.allows(value):
                expected = {int: "a whole number", float: "a number", bool: "true or false"}.get(kind, "text")
                allowed = (
                    spec.describe() if spec.choices else expected if kind is bool else f"{expected} ({spec.describe()})"
                )
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

    def layer_budgets(
        self, budget: int, num_layers: int, capacity: int | None = None, measured: Sequence[float] | None = None
    ) -> list[int]:
        """Tokens each layer keeps per KV head, for contexts of at most ``capacity`` tokens. Uniform unless the
        policy spreads the total differently; ``measured`` are per-layer weights measured for the run where its
        allocation follows them (:meth:`measures_layers`)."""
        return [budget] * num_layers

    def measures_layers(self) -> str | None:
        """What the layer allocation follows that only the run can measure: ``profile`` (the model's stored
        attention entropy), ``prompt`` (CAKE's preferences from the prompt's own attention, at the compression), or
        ``None``."""
        return None

    def score(self, view: LayerView) -> torch.Tensor:
        """One score per cached token and KV head, ``(batch, kv_heads, slots)``; the highest ``budget`` survive."""
        raise NotImplementedError

    def candidates(self, view: LayerView, count: int) -> tuple[int, int] | None:
        """The slots ``[start, stop)`` the ``count`` victims are chosen from, or ``None`` for every slot in view. A
        policy that ranks only part of the cache (the generational cache) names that part; the range must hold at
        least ``count`` evictable slots."""
        return None

    def removes(self) -> int:
        """How many tokens an ablation removes whatever its budget (it takes none): none for every method; the
        first token for :class:`~kvlab.policies.drop_first.DropFirst`, the heaviest hitters for
        :class:`~kvlab.policies.drop_pillars.DropPillars`."""
        return 0

    def removed(self, view: LayerView) -> torch.Tensor | None:
        """Which slots of a layer the ablation removes at an eviction (``(batch, kv_heads, span)``), or ``None``."""
        return None

    def demotion(self) -> DemotionSpec | None:
        """Where evicted tokens are demoted instead of deleted, and how they are recalled (:mod:`kvlab.cache.demotion`);
        ``None``: deleted. A cache option of the scoring policies."""
        return None

    def freezes(self) -> bool:
        """Whether prefill mode's compression moves the kept tokens into frozen layers (precision tiers or
        head-adaptive budgets, :mod:`kvlab.cache.tiers`) instead of evicting in place."""
        return False

    def check_mode(self, mode: str) -> None:
        """Refuse, in one sentence, a mode the policy's options cannot run in."""

    def reconstructs(self) -> bool:
        """Whether prefill mode's compression first has the model reconstruct the context on a fork of the heap, the
        attention of that pass scoring the cache (KVzip, :mod:`kvlab.engine.reconstruction`)."""
        return False

    def heads_share_ranking(self) -> bool:
        """Whether every KV head of a layer is ranked by one shared score (TOVA's layer mean), so that whatever is
        added to the scores must be the same for all of them."""
        return False

    def can_capture(self) -> bool:
        """Whether its eviction can be captured in a CUDA graph."""
        return self.capturable

    def sparse_read(self, budget: int, span: int) -> SparseRead | None:
        """How the policy reads the cache while decoding at a read ``budget`` over a run of ``span`` tokens (prompt,
        question and generation): the tokens it holds and its selection per step (:mod:`kvlab.cache.sparse`); ``None``
        for a policy that reads every token it holds."""
        return None

    def perturb(self, view: LayerView, scores: torch.Tensor) -> torch.Tensor:
        """The scores as ranked: unchanged, unless the policy adds a noise floor
        (:class:`~kvlab.policies.scoring.ScoringPolicy`)."""
        return scores

    def params(self) -> dict[str, object]:
        """The policy's parameters by name, for storage and display."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


def evict_layer(heap: KVHeap, layer_idx: int, policy: Policy, view: LayerView) -> None:
    """Cut one layer back to its budget: free the tokens no query can see any more (outside a sliding window) and
    those an ablation removes (:meth:`Policy.removed`) first, then the lowest-scoring ones. The layer's
    layout decides what becomes of the freed slots.

    A layer that holds no more than the uniform budget keeps everything even if its own (PyramidKV) share is
    smaller: as in PyramidKV's reference code, compression starts only once the context exceeds the budget.

    The victims are chosen among the slots :meth:`Policy.candidates` names (all by default); the heap counts the
    slots ranked and, outside static steps, times the scoring and selection (not the freeing).
    """
    layer = heap.layers[layer_idx]
    count = eviction_count(layer, view.budget, view.uniform_budget)
    if count == 0:
        return
    clock = None if heap.static else DeviceClock.start(layer.device)
    start, stop = policy.candidates(view, count) or (0, view.span)
    scores = eviction_scores(policy, view).masked_fill(view.positions == FREE, float("inf"))  # free: no victims
    order = by_score_then_position(scores[..., start:stop], view.positions[..., start:stop])
    if count < stop - start:  # the lowest count + 1 in order: the victims and the best survivor, to see a tie
        lowest = order.topk(count + 1, dim=-1, largest=False, sorted=True)
        victims, tied = lowest.indices[..., :count], tied_cut(lowest.values[..., count - 1], lowest.values[..., count])
    else:
        victims, tied = order.topk(count, dim=-1, largest=False, sorted=False).indices, None
    heap.account_ranking(layer, stop - start, clock.stop() if clock is not None else None)
    heap.account_cut(layer, tied)
    heap.evict(layer_idx, victims + start if start else victims)


def eviction_scores(policy: Policy, view: LayerView) -> torch.Tensor:
    """The scores a layer's slots are ranked by (higher kept): the policy's own with its noise floor, the tokens no
    query can see any more (outside a sliding window) and those an ablation removes at ``-inf``."""
    positions = view.positions
    scores = policy.perturb(view, policy.score(view)) if policy.evicts else positions.float()
    if view.cache.sliding_window is not None:
        scores = scores.masked_fill(positions <= view.next_position - view.cache.sliding_window, float("-inf"))
    removed = policy.removed(view)
    if removed is not None:
        scores = scores.masked_fill(removed, float("-inf"))
    return scores


def kept_slots(
    policy: Policy, view: LayerView, safeguard: float | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Which held slots a compression keeps, ``(batch, kv_heads, span)``, and the ranking key they were chosen by
    (:func:`by_score_then_position`, higher kept): the same scores and tie-break as :func:`evict_layer`, each KV head
    keeping its budget, or with ``safeguard`` set the layer's heads sharing theirs (Ada-KV,
    :func:`kvlab.cache.tiers.adakv_kept`); and per KV head whether the cut fell on tied scores (:func:`tied_cut`;
    ``None`` when nothing is cut, or for Ada-KV's one cut over the layer's heads, whose ties are not counted)."""
    held = view.positions >= 0
    ranking = by_score_then_position(eviction_scores(policy, view), view.positions)
    keep = view.cache.live - eviction_count(view.cache, view.budget, view.uniform_budget)
    if safeguard is not None:
        return adakv_kept(ranking, held, keep, safeguard), ranking, None
    highest = ranking.masked_fill(~held, torch.iinfo(torch.int64).min).topk(min(keep + 1, view.span), dim=-1)
    top = highest.indices[..., :keep]
    tied = tied_cut(highest.values[..., keep], highest.values[..., keep - 1]) if keep < view.cache.live else None
    return torch.zeros_like(held).scatter_(-1, top, True) & held, ranking, tied


def tied_cut(best_victim: torch.Tensor, worst_survivor: torch.Tensor) -> torch.Tensor:
    """Whether each cut (keys of :func:`by_score_then_position`) fell on a tie: the best victim's score equals the
    worst survivor's, so the position decided which of them stayed (an infinite score is a token kept by rule, not
    a tie of measured scores)."""
    victim_score, survivor_score = best_victim >> 32, worst_survivor >> 32
    return (victim_score == survivor_score) & (victim_score != _INFINITE_KEY)


def by_score_then_position(scores: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """One int64 per slot that orders slots by score and, among equal scores, by position: the float32 score's
    bits made monotonic (negative floats have their magnitude bits flipped) in the high half, the position in the
    low half. Ties (equal key norms of a repeated token, say) are then broken the same way whatever order the slots
    are in, so every layout evicts the same tokens; no sort is needed."""
    bits = scores.float().contiguous().view(torch.int32).to(torch.int64)
    monotonic = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    return monotonic * (1 << 32) + positions.to(torch.int64)


def eviction_count(layer: HeapLayer, budget: int, uniform_budget: int) -> int:
    """How many tokens a layer gives up to get back to its budget: none while it holds no more than the uniform
    budget (PyramidKV), and on sliding-window layers at least what its window can no longer see."""
    keep = budget if layer.live > uniform_budget else layer.live
    if layer.sliding_window is not None:
        keep = min(keep, layer.sliding_window - 1)
    return max(0, layer.live - keep)


def check_fields(cls: type[Policy], params: dict[str, object]) -> None:
    """Reject parameter names the policy does not have, naming the ones it does."""
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(params) - known)
    if unknown:
        accepted = ", ".join(sorted(known)) or "none"
        raise KvlabError(
            f"Policy {cls.name!r} has no parameter {', '.join(map(repr, unknown))}; its parameters are: {accepted}."
        )
