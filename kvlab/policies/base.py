"""What every eviction policy is: a small dataclass that scores the cached tokens.

A policy says what it needs observed (accumulated attention, an observation window of queries, the moments of the
queries), the smallest budget it can work with, whether it spreads the budget over layers itself, and one score per
cached token and KV head (higher is kept). It owns no storage: how the cache holds what the policy keeps (its layout,
precision tiers, demotion, layer and head allocation, scope, noise) is the cache spec's
(:mod:`kvlab.cache.spec`), and the cache turns scores into an eviction the same way for every policy
(:mod:`kvlab.cache.ranking`), so that policies differ only where their papers differ.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from types import MappingProxyType
from typing import ClassVar

import torch

from kvlab.attention.observe import window_attention
from kvlab.budget import Budget
from kvlab.cache.heap import KVHeap
from kvlab.cache.layer import HeapLayer, along_positions
from kvlab.cache.sparse import SparseRead
from kvlab.errors import KvlabError
from kvlab.models.rope import Rope
from kvlab.params import check_values


@dataclass
class LayerView:
    """What a policy may look at when scoring one layer: the first ``span`` slots of its heap (free ones included:
    their position is negative, and whatever a policy scores them, they are never chosen). ``next_position`` is the
    position the next token will get (a number, or in a captured decode step a device tensor). ``rope`` is the
    layer's rotary embedding where kvlab found one (layers of different types rotate by their own frequencies), and
    ``heap`` the whole heap, for a policy that reuses the decision of a layer evicted before this one (layers are
    evicted in order)."""

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
    #: The layer's entries (tokens over its KV heads) where its heads share a global ranking's share
    #: (:func:`kvlab.cache.scopes.global_budgets`), else ``None``.
    entries: int | None = None
    #: The remembered window's attention over the slots where it was scored before the view was made (an eviction
    #: of all layers at once scores each layer's window over its own keys first), else ``None``.
    window_votes: torch.Tensor | None = None

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

    def in_position_order(
        self, values: torch.Tensor, along_positions_fn: Callable[[torch.Tensor], torch.Tensor]
    ) -> torch.Tensor:
        """``along_positions_fn`` applied to ``values`` (``(batch, kv_heads, span)``, one per slot) as if the slots
        were in position order (free ones last), and the result put back in slot order: what pools or draws along the
        sequence gives the same answer in every layout."""
        return along_positions(self.cache, self.positions, values, along_positions_fn)

    def most_recent(self, count: int) -> torch.Tensor:
        """Whether each slot holds one of the ``count`` most recent positions seen."""
        return self.positions >= self.next_position - count

    def window_attention(self) -> torch.Tensor:
        """Attention of the remembered query window over the slots, ``(batch, kv_heads, span)``."""
        if self.window_votes is not None:
            return self.window_votes
        return window_attention(self.cache, self.span, static=self.heap is not None and self.heap.static)

    def query_moments(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """Mean ``(batch, q_heads, head_dim)`` and covariance ``(batch, q_heads, head_dim, head_dim)`` of the layer's
        queries before RoPE (every query seen at positions from :data:`~kvlab.cache.layer.MOMENTS_SKIP` on), with
        their count as a device scalar; ``None`` when they were not accumulated (the policy does not declare
        ``needs_query_moments``, or the model has no rotary embedding kvlab can find)."""
        moments = self.cache.moments
        if moments is None:
            return None
        mean, covariance = moments.mean_and_covariance()
        return mean, covariance, moments.count


@dataclass
class Policy:
    """Base of all eviction policies. Subclasses are dataclasses whose fields are the policy's parameters, declared
    with :func:`kvlab.params.param` so that every value is checked the same way when the policy is made."""

    name: ClassVar[str] = ""
    #: Whether the policy evicts to a budget, and so takes one. ``full`` does not, nor do the ablations
    #: (``drop_first``, ``drop_pillars``), which remove a fixed number of tokens whatever the budget.
    evicts: ClassVar[bool] = True
    #: Whether the policy ranks the cached tokens by a score and so takes the cache's options
    #: (:class:`~kvlab.cache.spec.CacheOptions`): every method but the full cache, the ablations and the sparse
    #: readers (:class:`~kvlab.policies.scoring.ScoringPolicy`).
    ranks: ClassVar[bool] = False
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
    #: Whether the policy spreads its budget over layers itself (PyramidKV, :meth:`layer_budgets`), so takes no layer
    #: allocation of the cache's.
    own_layer_budgets: ClassVar[bool] = False
    #: Whether :meth:`score` reads only a slot's position, its accumulated attention and the attention it received
    #: from the remembered window (:meth:`LayerView.window_attention`), by the same rule in every layer (no layer
    #: index, keys, draws or other layers' decisions), so that a static step may score all layers as one
    #: (:mod:`kvlab.cache.stack`).
    scores_layers_alike: ClassVar[bool] = False
    #: The cache options the policy's paper ranks with where they differ from the cache's defaults (KVzip: one
    #: ranking over all layers and KV heads), which a variant that names none of them runs with
    #: (:func:`kvlab.policies.variants.published_options`); a policy that ranks no tokens has none.
    cache_defaults: ClassVar[Mapping[str, object]] = MappingProxyType({})

    def __post_init__(self) -> None:
        check_values(self, f"policy {self.name!r}")

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
        """Tokens each layer keeps per KV head, for contexts of at most ``capacity`` tokens, where the policy spreads
        the total over layers itself (:attr:`own_layer_budgets`; uniform otherwise: the cache's allocation decides)."""
        return [budget] * num_layers

    def equal_layer_budgets(self) -> bool:
        """Whether the policy needs the same budget in every layer (ChunkKV reusing one layer's choice in the next)."""
        return False

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

    def check_mode(self, mode: str) -> None:
        """Refuse, in one sentence, a mode the policy cannot run in."""

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

    def params(self) -> dict[str, object]:
        """The policy's parameters by name, for storage and display."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


def check_fields(cls: type[Policy], params: dict[str, object]) -> None:
    """Reject parameter names the policy does not have, naming the ones it does."""
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(params) - known)
    if unknown:
        accepted = ", ".join(sorted(known)) or "none"
        raise KvlabError(
            f"Policy {cls.name!r} has no parameter {', '.join(map(repr, unknown))}; its parameters are: {accepted}."
        )


def check_budget(policy: Policy, budget: Budget | None, context_tokens: int) -> int | None:
    """The per-layer budget in tokens for this policy and context, or ``None`` for none: the full cache, the
    first-token ablation, or a kept fraction of 1 (in streaming mode a budget of the prompt's length would still
    evict while decoding).

    Raises one sentence when the budget cannot be honoured, for example a budget below a policy's sinks plus window.
    """
    if not policy.evicts:
        if budget is not None:
            kept = f"every token but the {policy.removes()} it removes" if policy.removes() else "every token"
            raise KvlabError(f"Policy {policy.name!r} keeps {kept}, so it takes no budget; drop --keep/--budget.")
        return None
    if budget is None:
        needs = "reads a budget of tokens per decoded token" if policy.reads_sparsely else "evicts tokens"
        raise KvlabError(f"Policy {policy.name!r} {needs}, so it needs a budget (tokens or a kept fraction).")
    if budget.keep == 1.0:
        return None  # keeping all of the prompt is the full cache, in both modes: nothing is ever evicted
    tokens = budget.resolve(context_tokens)
    if tokens < policy.min_budget():
        of_context = f" (keep {budget.keep:g} of {context_tokens} tokens)" if budget.keep is not None else ""
        raise KvlabError(
            f"A budget of {tokens} tokens{of_context} is smaller than {policy.name}'s minimum of "
            f"{policy.min_budget()}: {policy.describe_min_budget()}."
        )
    return tokens
