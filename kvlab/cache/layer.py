"""One layer of the heap: keys and values in slots, the original position of each slot's token, and what kvlab
observes about them.

:class:`HeapLayer` is the dense layer every run has: ``(batch, kv_heads, capacity, head_dim)`` tensors (GQA-native:
one entry per KV head, never expanded to the query heads), the position of the token in each slot as ``(batch,
kv_heads, capacity)`` (:data:`FREE` where a slot holds no token), and, for the policies that need them, the attention
each slot has accumulated, the last few queries and the running moments of every query. The layer types that store
more than that (:class:`~kvlab.cache.tiers.TieredLayer`: frozen tokens at their precision;
:class:`~kvlab.cache.demotion.DemotingLayer`: evicted tokens kept in CPU memory and on disk) extend it and change what
attention reads (:meth:`HeapLayer.read`) and what eviction does with the freed tokens (:meth:`HeapLayer.before_free`).

The slot maths that every layout and policy shares live here too: slots ordered by position, the survivors of a
layer, the first free slots, and a function applied along positions whatever order the slots are in.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvlab.models.rope import Rope

#: The position stored in a slot that holds no token.
FREE = -1
#: Queries at positions below this one take no part in a layer's query moments: the first tokens' hidden states are
#: outliers (attention sinks), and kvpress's Expected Attention leaves out the same four.
MOMENTS_SKIP = 4
_LAST = torch.iinfo(torch.int32).max

#: Keys, values and positions as attention reads them, ``(batch, kv_heads, n, head_dim)`` twice and ``(batch,
#: kv_heads, n)``.
Slots = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


@dataclass
class QueryMoments:
    """Running first and second moments of a layer's queries before RoPE, per sequence and query head, in float32:
    ``total`` ``(batch, q_heads, head_dim)``, ``outer`` ``(batch, q_heads, head_dim, head_dim)`` and ``count`` (a
    device scalar, so that a captured decode step can add to it). What a policy that models future queries as a
    Gaussian (Expected Attention) needs from every query seen, in constant memory."""

    total: torch.Tensor
    outer: torch.Tensor
    count: torch.Tensor

    @classmethod
    def empty(cls, batch: int, q_heads: int, head_dim: int, device: torch.device) -> QueryMoments:
        return cls(
            torch.zeros(batch, q_heads, head_dim, device=device),
            torch.zeros(batch, q_heads, head_dim, head_dim, device=device),
            torch.zeros((), device=device),
        )

    def add(self, queries: torch.Tensor, weights: torch.Tensor) -> None:
        """Add ``queries`` (``(batch, q_heads, n, head_dim)``, float32, before RoPE), each counted with its weight
        (``(n,)``: 1, or 0 for a query left out), in place."""
        weighted = queries * weights.view(1, 1, -1, 1)
        self.total += weighted.sum(dim=2)
        self.outer += torch.einsum("bhnd,bhne->bhde", weighted, queries)
        self.count += weights.sum()

    def mean_and_covariance(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The queries' mean and (population) covariance, as kvpress computes them over a prefill's queries."""
        count = self.count.clamp_min(1.0)
        mean = self.total / count
        return mean, self.outer / count - mean.unsqueeze(-1) * mean.unsqueeze(-2)

    def clone(self) -> QueryMoments:
        return QueryMoments(self.total.clone(), self.outer.clone(), self.count.clone())

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.total, self.outer, self.count))


@dataclass
class AttentionShape:
    """What a layer's attention does beyond q.K^T, as the model's own attention call says it (its sliding window, its
    scaling, its logit soft-cap): recorded once, at the layer's first forward, so that scores computed outside the
    forward pass (an observation window's) use exactly the model's attention."""

    sliding_window: int | None = None
    scaling: float = 1.0
    softcap: float | None = None


@dataclass
class HeapLayer:
    """One layer's slots and what kvlab knows about them.

    ``used`` counts the slots written since the last compaction (``[0, used)``; the rest of the capacity has never
    held a token), ``live`` the slots that hold one (the same for every sequence and KV head: all are evicted to the
    same budget). ``ordered`` says that the live slots are exactly ``[0, used)`` in increasing position order, as
    after a compaction or a run of appends, which lets attention use slot order instead of position masks.
    ``recent_queries`` keeps the last post-RoPE query vectors ``(batch, q_heads, w, head_dim)`` with their positions,
    for policies that score the cache by an observation window (SnapKV, TOVA), and in static steps under the ``flex``
    backend ``recent_query_lse``, each remembered query's log-sum-exp over the slots held now ``(batch, q_heads, w)``
    (float32): carried from step to step (the new query's from its attention kernel, the others' less what each
    eviction frees, :func:`kvlab.attention.observe.forget_victims`), so that the window's votes are one pass over the
    keys instead of two (:mod:`kvlab.attention.slot_sums`). ``planned`` is the capacity the
    engine planned for the layer; ``shared`` names the tensors a fork still shares with its source. ``received`` is
    the attention each slot received from the one query of the pass in flight, summed over each KV head's query
    heads, where the attention kernel gave it (the ``flex`` backend, from its log-sum-exp): what a window of one query
    (TOVA) is scored by, without a second pass over the keys.
    """

    planned: int = 0
    keys: torch.Tensor | None = None
    values: torch.Tensor | None = None
    positions: torch.Tensor | None = None
    scores: torch.Tensor | None = None
    recent_queries: torch.Tensor | None = None
    recent_query_positions: torch.Tensor | None = None
    recent_query_lse: torch.Tensor | None = None
    used: int = 0
    live: int = 0
    ordered: bool = True
    shape: AttentionShape | None = None
    moments: QueryMoments | None = None
    received: torch.Tensor | None = None
    shared: set[str] = field(default_factory=set, repr=False)

    @property
    def attention(self) -> AttentionShape:
        """What the layer's attention does beyond q.K^T (the defaults until its first forward records it)."""
        return AttentionShape() if self.shape is None else self.shape

    @property
    def sliding_window(self) -> int | None:
        """The layer's sliding window (``None``: it sees everything, or its first forward has not run yet)."""
        return None if self.shape is None else self.shape.sliding_window

    @property
    def scaling(self) -> float:
        return 1.0 if self.shape is None else self.shape.scaling

    @property
    def softcap(self) -> float | None:
        return None if self.shape is None else self.shape.softcap

    def slots(self, span: int) -> Slots:
        """Keys, values and positions of the first ``span`` slots of an allocated layer."""
        assert self.keys is not None and self.values is not None and self.positions is not None
        return self.keys[:, :, :span], self.values[:, :, :span], self.positions[:, :, :span]

    def in_order(self, static: bool) -> bool:
        """Whether the slots attention reads over ``span(static)`` hold their tokens in position order with none free
        among them, so that slot order can stand for positions (SDPA, causal masks by slot)."""
        return self.ordered and self.dead == 0 and not static

    def read(self, span: int, static: bool, query: torch.Tensor, decoding: bool) -> tuple[Slots, bool]:
        """What a forward pass's attention reads for ``query`` (``(batch, q_heads, n, head_dim)`` after RoPE): the
        first ``span`` slots, and whether they are in position order (:meth:`in_order`). Layer types that hold more
        than their dense slots add it here."""
        return self.slots(span), self.in_order(static)

    def remember_queries(
        self, query: torch.Tensor, query_positions: torch.Tensor, window: int, oldest: torch.Tensor | None
    ) -> None:
        """Keep the last ``window`` post-RoPE queries ``(batch, q_heads, n, head_dim)`` for observation-window
        policies, as a copy (a view would keep a whole prefill's queries alive). In a static step ``oldest`` is where
        the window's oldest query is (``(1,)``, :meth:`kvlab.cache.heap.KVHeap.begin_pass`, which writes the new
        position there for every layer): the new query replaces it in place. A window's votes are a sum over its
        queries, whatever their order; shifting it by one copied every layer's window at every token (~0.1 ms of a
        32k SnapKV step on an H200)."""
        if oldest is not None:
            assert self.recent_queries is not None
            self.recent_queries.index_copy_(2, oldest, query)
            return
        if self.recent_queries is None or self.recent_query_positions is None:
            queries, positions = query, query_positions
        else:
            queries = torch.cat([self.recent_queries, query], dim=2)
            positions = torch.cat([self.recent_query_positions, query_positions])
        self.recent_queries = queries[:, :, -window:].detach().clone()
        self.recent_query_positions = positions[-window:].clone()

    def remember_lse(self, lse: torch.Tensor, oldest: torch.Tensor) -> None:
        """Carry the log-sum-exp ``(batch, q_heads, 1)`` of a static step's query (its attention kernel's) in the
        place of the window's oldest query, where the query went (:meth:`remember_queries`)."""
        assert self.recent_query_lse is not None
        self.recent_query_lse.index_copy_(2, oldest, lse.float())

    def add_query_moments(self, query: torch.Tensor, query_positions: torch.Tensor, rope: Rope) -> None:
        """Add a forward's queries, rotated back to before RoPE, to the running moments; queries at the first
        :data:`MOMENTS_SKIP` positions are weighed zero (no data-dependent shape: a captured step can add)."""
        if self.moments is None:
            batch, q_heads, _, head_dim = query.shape
            self.moments = QueryMoments.empty(batch, q_heads, head_dim, query.device)
        weights = (query_positions >= MOMENTS_SKIP).float()
        self.moments.add(rope.rotate(query, -query_positions), weights)

    def accumulate(self, received: torch.Tensor) -> None:
        """Add the attention the first slots received in a pass, ``(batch, kv_heads, n)``, to their accumulated scores
        (H2O); the slots past them (recalled demoted tokens, attended after the heap's) have no score here."""
        assert self.scores is not None
        self.scores[:, :, : received.shape[-1]] += received

    def note_received(self, received: torch.Tensor | None) -> None:
        """Keep what the pass in flight's query gave each slot (``(batch, kv_heads, n)``), or forget the last pass's
        (``None``: this pass gives none)."""
        self.received = received

    def replace_scores(self, scores: torch.Tensor) -> None:
        """Put scores measured apart (KVzip's reconstruction) in place of the accumulated ones, owned by this layer."""
        self.scores = scores
        self.shared.discard("scores")

    def before_free(self, victims: torch.Tensor) -> None:
        """Called with the slots an eviction is about to free (``(batch, kv_heads, k)``), while they still hold their
        tokens: the dense layer deletes them."""

    def held_positions(self) -> torch.Tensor:
        """Positions of every slot that can hold a token (free ones negative)."""
        assert self.positions is not None
        return self.positions

    def held_per_head(self) -> int:
        """Tokens held per (sequence, KV head), the mean where heads hold different numbers."""
        return self.live

    def capturable(self) -> bool:
        """Whether a decode step over this layer can be captured in a CUDA graph (fixed shapes, nothing chosen or
        copied from the host)."""
        return True

    @property
    def device(self) -> torch.device:
        """Where the layer's tensors live (the CPU before any is allocated)."""
        return torch.device("cpu") if self.keys is None else self.keys.device

    @property
    def capacity(self) -> int:
        """Slots allocated per (sequence, KV head)."""
        return 0 if self.keys is None else self.keys.shape[2]

    @property
    def dead(self) -> int:
        """Free slots among those in use: evicted tokens whose slots wait to be refilled or compacted away."""
        return self.used - self.live

    def span(self, static: bool) -> int:
        """How many slots attention and scoring look at: those in use, or in static mode the whole capacity."""
        return self.capacity if static else self.used

    def slot_bytes(self) -> int:
        """Bytes of K and V in one slot of every sequence and KV head."""
        if self.keys is None:
            return 0
        batch, kv_heads, _, head_dim = self.keys.shape
        return 2 * batch * kv_heads * head_dim * self.keys.element_size()

    def reserved_bytes(self) -> int:
        """Bytes of the K and V tensors allocated, read from the tensors themselves."""
        if self.keys is None or self.values is None:
            return 0
        return self.keys.numel() * self.keys.element_size() + self.values.numel() * self.values.element_size()

    def live_bytes(self) -> int:
        """Bytes of K and V in the slots that hold a token."""
        return self.live * self.slot_bytes()

    def aux_bytes(self) -> int:
        """Bytes of kvlab's bookkeeping for this layer (positions, scores, remembered queries and their log-sum-exps,
        query moments, what the last decoded query gave each slot)."""
        tensors = (self.positions, self.scores, self.recent_queries, self.recent_query_lse, self.received)
        moments = 0 if self.moments is None else self.moments.nbytes()
        return moments + sum(t.numel() * t.element_size() for t in tensors if t is not None)


def first_free(positions: torch.Tensor, count: int) -> torch.Tensor:
    """The first ``count`` free slots of every sequence and KV head, in slot order, found on the device:
    ``(batch, kv_heads, count)``. One slot (a decode step's) is the first holding the lowest position, :data:`FREE`
    where a slot is free: one reduction. More: a stable sort puts free slots (key 0) before held ones (key 1) in slot
    order."""
    if count == 1:
        return positions.argmin(dim=-1, keepdim=True)
    return torch.sort((positions >= 0).to(torch.int8), dim=-1, stable=True).indices[..., :count]


def position_order(positions: torch.Tensor) -> torch.Tensor:
    """The slots of each sequence and KV head ordered by the position they hold, free slots last."""
    return positions.masked_fill(positions < 0, _LAST).argsort(dim=-1)


def survivors(positions: torch.Tensor, live: int) -> torch.Tensor:
    """The original positions held in a layer, ``(batch, kv_heads, live)`` in increasing order, whatever the slot
    order."""
    return positions.gather(-1, position_order(positions)[..., :live])


def along_positions(
    layer: HeapLayer,
    positions: torch.Tensor,
    values: torch.Tensor,
    along: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """``along`` applied to ``values`` (``(batch, kv_heads, span)``, one per slot of ``layer`` whose positions are
    ``positions``) as if the slots were in position order (free ones last), and the result put back in slot order:
    what pools or draws along the sequence gives the same answer in every layout."""
    if layer.ordered and layer.dead == 0:  # live slots first, in position order, free ones after
        return along(values)
    order = position_order(positions)
    return torch.empty_like(values).scatter_(2, order, along(values.gather(2, order)))


def gather_slots(tensor: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """``tensor[b, h, order[b, h, i]]`` for tensors of slots, with or without a trailing feature dimension."""
    if tensor.dim() == 4:
        return tensor.gather(2, order.unsqueeze(-1).expand(-1, -1, -1, tensor.shape[-1]))
    return tensor.gather(2, order)
