"""The KV heap: each layer's keys and values in slots allocated once per run, evicted from in one of three layouts.

Every layer holds keys and values as ``(batch, kv_heads, capacity, head_dim)`` tensors (GQA-native: one entry per
KV head, never expanded to the query heads), the original position of the token in each slot as
``(batch, kv_heads, capacity)`` (:data:`FREE` where a slot holds no token), and, for the policies that need them,
the attention each slot has accumulated and the last few queries. The engine plans each layer's capacity from the
run's budget (budget + chunk in streaming mode; the prompt and the tokens to generate in prefill mode), so a run
allocates once and writes in place.

New tokens go into the first free slots (the slots freed by eviction first, then the never-used tail). Eviction
frees slots; the layout says what happens then:

* ``bitmask``: freed slots are only marked free and are filled in place by later tokens: no copy, memory held at
  capacity, slots no longer in position order.
* ``compact``: after every eviction the survivors are gathered to the front of the layer in position order, and
  the tensors are sized to what the run still needs (memory returned, at the cost of a copy).
* ``threshold``: bitmask until the dead share (free slots among those in use) reaches ``compact_at``, then compact.

The counts that shape the work (slots in use, live slots) are kept on the host, so no decision waits for the GPU.
In *static* mode, for a decode step captured in a CUDA graph, nothing depends on them either: attention spans the
whole capacity, the slot of a new token is found on the device, compaction stays in place, nothing is allocated.
Results are the same in both modes (a tested equivalence).

The class implements the part of the transformers ``Cache`` interface that model forwards call (``update`` and
``get_seq_length``); it deliberately does not inherit from ``transformers.Cache`` so that transformers builds no
attention masks of its own for it: kvlab's attention function builds masks from the stored positions.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from kvlab.cache.layouts import HeapLayout
from kvlab.models.rope import Rope

if TYPE_CHECKING:  # the frozen part of a layer and the demoted pages are built from this module's slots
    from kvlab.cache.demotion import Demotion
    from kvlab.cache.tiers import FrozenLayer, TierSpec

#: The position stored in a slot that holds no token.
FREE = -1
#: Queries at positions below this one take no part in a layer's query moments: the first tokens' hidden states are
#: outliers (attention sinks), and kvpress's Expected Attention leaves out the same four.
MOMENTS_SKIP = 4
_LAST = torch.iinfo(torch.int32).max


@dataclass
class HeapLayer:
    """One layer's slots and what kvlab knows about them.

    ``used`` counts the slots written since the last compaction (``[0, used)``; the rest of the capacity has never
    held a token), ``live`` the slots that hold one (the same for every sequence and KV head: all are evicted to the
    same budget). ``ordered`` says that the live slots are exactly ``[0, used)`` in increasing position order, as
    after a compaction or a run of appends, which lets attention use slot order instead of position masks.
    ``recent_queries`` keeps the last post-RoPE query vectors ``(batch, q_heads, w, head_dim)`` with their positions,
    for policies that score the cache by an observation window (SnapKV, TOVA); ``sliding_window``, ``scaling`` and
    ``softcap`` are recorded from the model's own attention call so that scores computed outside the forward pass
    use exactly the model's attention. ``planned`` is the capacity the engine planned for the layer.
    """

    planned: int = 0
    keys: torch.Tensor | None = None
    values: torch.Tensor | None = None
    positions: torch.Tensor | None = None
    scores: torch.Tensor | None = None
    recent_queries: torch.Tensor | None = None
    recent_query_positions: torch.Tensor | None = None
    used: int = 0
    live: int = 0
    ordered: bool = True
    sliding_window: int | None = None
    scaling: float = 1.0
    softcap: float | None = None
    frozen: FrozenLayer | None = None
    moments: QueryMoments | None = None
    shared: set[str] = field(default_factory=set, repr=False)

    def slots(self, span: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Keys, values and positions of the first ``span`` slots of an allocated layer."""
        assert self.keys is not None and self.values is not None and self.positions is not None
        return self.keys[:, :, :span], self.values[:, :, :span], self.positions[:, :, :span]

    def attended(self, span: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Keys, values and positions attention reads: the first ``span`` slots, after the frozen tokens
        materialised at the heap's dtype when the layer has some (:mod:`kvlab.cache.tiers`)."""
        keys, values, positions = self.slots(span)
        if self.frozen is None:
            return keys, values, positions
        frozen_keys, frozen_values = self.frozen.materialise(keys.dtype)
        return (
            torch.cat([frozen_keys, keys], dim=2),
            torch.cat([frozen_values, values], dim=2),
            torch.cat([self.frozen.positions, positions], dim=2),
        )

    def held_positions(self) -> torch.Tensor:
        """Positions of every slot that can hold a token, frozen ones first (free ones negative)."""
        assert self.positions is not None
        if self.frozen is None:
            return self.positions
        return torch.cat([self.frozen.positions, self.positions], dim=2)

    def held_per_head(self) -> int:
        """Tokens held per (sequence, KV head), the mean where heads hold different numbers (frozen Ada-KV)."""
        if self.frozen is None or self.keys is None:
            return self.live
        batch, kv_heads = self.keys.shape[:2]
        return self.live + round(self.frozen.tokens() / (batch * kv_heads))

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
        """Bytes of the K and V tensors allocated (the frozen ones included), read from the tensors themselves."""
        if self.keys is None or self.values is None:
            return 0
        dense = self.keys.numel() * self.keys.element_size() + self.values.numel() * self.values.element_size()
        return dense + self.frozen_bytes()

    def live_bytes(self) -> int:
        """Bytes of K and V in the slots that hold a token, and of the frozen tokens (as held: packed and scaled)."""
        return self.live * self.slot_bytes() + self.frozen_bytes()

    def frozen_bytes(self) -> int:
        """Bytes of the frozen tokens' K and V tensors (none without a frozen part)."""
        return 0 if self.frozen is None else self.frozen.kv_bytes()

    def aux_bytes(self) -> int:
        """Bytes of kvlab's bookkeeping for this layer (positions, scores, remembered queries, frozen indices)."""
        tensors = (self.positions, self.scores, self.recent_queries)
        frozen = 0 if self.frozen is None else self.frozen.aux_bytes()
        moments = 0 if self.moments is None else self.moments.nbytes()
        return frozen + moments + sum(t.numel() * t.element_size() for t in tensors if t is not None)


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


def first_free(positions: torch.Tensor, count: int) -> torch.Tensor:
    """The first ``count`` free slots of every sequence and KV head, in slot order, found on the device:
    ``(batch, kv_heads, count)``. A stable sort puts free slots (key 0) before held ones (key 1) in slot order."""
    free = positions < 0
    if count == 1:
        return free.to(torch.int8).argmax(dim=-1, keepdim=True)
    return torch.sort((~free).to(torch.int8), dim=-1, stable=True).indices[..., :count]


class KVHeap:
    """The KV cache of one generation (one or several same-length sequences), layer by layer.

    ``capacities`` are the planned slots per layer. ``room`` is how many tokens the run may still write between two
    evictions; a compaction sizes the layer to its survivors plus that room, or, with ``keep_planned`` (streaming
    mode, where the plan already is the steady size: budget + chunk, or the whole run when shorter), to the plan.
    """

    def __init__(
        self,
        capacities: list[int],
        *,
        layout: HeapLayout = HeapLayout(),
        track_scores: bool = False,
        query_window: int = 0,
        room: int = 0,
        keep_planned: bool = False,
        query_moments: bool = False,
        rope: Rope | None = None,
    ) -> None:
        self.layers = [HeapLayer(planned=capacity) for capacity in capacities]
        #: Whether attention accumulates each layer's :class:`QueryMoments` (needs ``rope`` to undo the rotation).
        self.query_moments = query_moments and rope is not None
        self.rope = rope
        self.layout = layout
        self.keep_planned = keep_planned
        self.track_scores = track_scores
        self.query_window = query_window
        self.room = room
        self.static = False
        self.seen_tokens = 0
        self.compactions = 0
        self.ranked_slots = 0
        #: Eviction cuts made (one per sequence, KV head and eviction), and on the device those on tied scores.
        self.cuts = 0
        self._tied_cuts: torch.Tensor | None = None
        self._compaction_time = ClockTotal()
        self._ranking_time = ClockTotal()
        #: The positions of the tokens the current forward pass appends, per device a layer of it runs on.
        self._pending_positions: dict[torch.device, torch.Tensor] = {}
        #: Where evicted tokens go instead of being deleted, when the run demotes (:mod:`kvlab.cache.demotion`).
        self.demotion: Demotion | None = None

    # --- the forward pass --------------------------------------------------------------------------------------

    def begin_forward(self, positions: torch.Tensor) -> None:
        """Declare the original positions ``(q,)`` of the tokens the next forward pass appends (consecutive, starting
        at :attr:`seen_tokens`), converted once here for every layer's write."""
        self._pending_positions = {positions.device: positions.to(torch.int32)}

    def end_forward(self, count: int) -> None:
        """Count the ``count`` tokens just appended as seen (no device synchronisation)."""
        self.seen_tokens += count
        self._pending_positions = {}

    def _positions_on(self, device: torch.device) -> torch.Tensor:
        """The declared positions on ``device`` (:func:`on_device`)."""
        assert self._pending_positions, "begin_forward() declares the positions of every forward pass"
        return on_device(self._pending_positions, device)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Tokens seen so far (the next token's position), which is what models use to place new tokens."""
        return self.seen_tokens

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the new tokens' K/V into the layer's first free slots and return the slots attention reads
        (transformers' contract)."""
        layer = self.layers[layer_idx]
        batch, kv_heads, count, head_dim = key_states.shape
        new_positions = self._positions_on(key_states.device).expand(batch, kv_heads, count)
        if layer.keys is None:
            self._allocate(layer, key_states, max(layer.planned, count))
        elif layer.live + count > layer.capacity:
            self._grow(layer, max(layer.planned, layer.live + count))
        self._own(layer, "keys", "values", "positions", "scores")
        keys, values, slot_positions = layer.slots(layer.capacity)
        if layer.dead == 0 and not self.static:  # the free slots are the tail: append in order
            start = layer.used
            keys[:, :, start : start + count] = key_states
            values[:, :, start : start + count] = value_states
            slot_positions[:, :, start : start + count] = new_positions
            if layer.scores is not None:
                layer.scores[:, :, start : start + count] = 0.0
        else:
            slots = first_free(slot_positions, count)
            index = slots.unsqueeze(-1).expand(-1, -1, -1, head_dim)
            keys.scatter_(2, index, key_states.to(keys.dtype))
            values.scatter_(2, index, value_states.to(values.dtype))
            slot_positions.scatter_(2, slots, new_positions)
            if layer.scores is not None:
                layer.scores.scatter_(2, slots, torch.zeros_like(slots, dtype=layer.scores.dtype))
        self.account_write(layer, count)
        span = layer.span(self.static)
        return keys[:, :, :span], values[:, :, :span]

    # --- eviction and compaction -------------------------------------------------------------------------------

    def evict(self, layer_idx: int, victims: torch.Tensor) -> None:
        """Free the slots ``victims`` (``(batch, kv_heads, k)``, distinct held slots) of a layer, then compact when
        the layout says so."""
        layer = self.layers[layer_idx]
        count = victims.shape[-1]
        if count == 0:
            return
        self._own(layer, "positions")
        if self.demotion is not None and layer.sliding_window is None:  # outside a window no query sees them again
            keys, values, positions = layer.slots(layer.capacity)
            index = victims.unsqueeze(-1).expand(-1, -1, -1, keys.shape[-1])
            evicted = keys.gather(2, index), values.gather(2, index), positions.gather(2, victims)
            self.demotion.demote(layer_idx, *evicted)
        layer.slots(layer.capacity)[2].scatter_(2, victims, FREE)
        if self.account_evict(layer, count):
            self._compact(layer)

    # --- the host's counts -------------------------------------------------------------------------------------

    def account_write(self, layer: HeapLayer, count: int) -> None:
        """The host's counts after ``count`` tokens went into a layer's first free slots: freed slots first (out of
        position order), then the tail."""
        if layer.dead:
            layer.ordered = False
        layer.used = max(layer.used, layer.used + count - layer.dead)
        layer.live += count

    def account_evict(self, layer: HeapLayer, count: int) -> bool:
        """The host's counts after ``count`` tokens of a layer were evicted; whether the layout compacts it now
        (after which its live slots are the first ones, in position order)."""
        layer.live -= count
        layer.ordered = False
        if not self.layout.compacts(layer.dead, layer.used):
            return False
        layer.used = layer.live
        layer.ordered = True
        self.compactions += 1
        return True

    def account_ranking(self, layer: HeapLayer, slots: int, clock: DeviceClock | None = None) -> None:
        """Count an eviction's ranking of ``slots`` slots per sequence and KV head, and keep its clock (none inside
        a static step, whose time is the step's)."""
        assert layer.keys is not None
        self.ranked_slots += slots * layer.keys.shape[0] * layer.keys.shape[1]
        if clock is not None:
            self._ranking_time.add(clock)

    def account_cut(self, layer: HeapLayer, tied: torch.Tensor | None = None) -> None:
        """Count an eviction's cut, one per sequence and KV head, and add on the device how many of them fell on tied
        scores (``tied``: a boolean per cut; none inside a replayed step, whose graph adds them itself)."""
        assert layer.keys is not None
        self.cuts += layer.keys.shape[0] * layer.keys.shape[1]
        if tied is not None:
            if self._tied_cuts is None:
                self._tied_cuts = torch.zeros((), device=tied.device)
            self._tied_cuts += tied.sum().to(self._tied_cuts.device)  # layers may live on several devices

    def tie_share(self) -> float | None:
        """The share of eviction cuts where the best victim's score equalled the worst survivor's, so that the
        position tie-break decided (``None`` when nothing was cut; read once, at the end of a run)."""
        if not self.cuts:
            return None
        return 0.0 if self._tied_cuts is None else float(self._tied_cuts) / self.cuts

    def host_state(self) -> tuple[int, int, int, int, list[tuple[int, int, bool]]]:
        """The host's counts (tokens seen, compactions, slots ranked, cuts, and per layer slots in use, live and
        whether ordered)."""
        layers = [(layer.used, layer.live, layer.ordered) for layer in self.layers]
        return self.seen_tokens, self.compactions, self.ranked_slots, self.cuts, layers

    def restore(self, state: tuple[int, int, int, int, list[tuple[int, int, bool]]]) -> None:
        """Put back counts taken by :meth:`host_state` (a captured step ran its host logic without its device
        work)."""
        self.seen_tokens, self.compactions, self.ranked_slots, self.cuts, layers = state
        for layer, (used, live, ordered) in zip(self.layers, layers):
            layer.used, layer.live, layer.ordered = used, live, ordered

    def _compact(self, layer: HeapLayer) -> None:
        """Gather the live slots to the front of the layer in position order (the counts are already the
        compacted ones). Outside static mode the layer is resized to its survivors plus :attr:`room` (returning
        memory); in static mode it is rewritten in place."""
        positions = layer.slots(layer.capacity)[2]
        clock = DeviceClock.start(positions.device) if not self.static else None
        order = position_order(positions)[..., : layer.live]
        if self.static:
            capacity = layer.capacity
        else:
            capacity = max(layer.planned, layer.live) if self.keep_planned else max(layer.live + self.room, 1)
        gathered = {
            name: _gather_slots(getattr(layer, name), order)
            for name in ("keys", "values", "positions", "scores")
            if getattr(layer, name) is not None
        }
        fresh = capacity != layer.capacity or bool(layer.shared & set(gathered))
        for name, survivors in gathered.items():
            target = getattr(layer, name)
            if fresh:
                target = target.new_zeros((*target.shape[:2], capacity, *target.shape[3:]))
            target[:, :, : layer.live] = survivors
            if name == "positions":
                target[:, :, layer.live :] = FREE
            elif name == "scores":
                target[:, :, layer.live :] = 0.0
            setattr(layer, name, target)
            layer.shared.discard(name)
        if clock is not None:
            self._compaction_time.add(clock.stop())

    def _allocate(self, layer: HeapLayer, like: torch.Tensor, capacity: int) -> None:
        """The layer's tensors, allocated once, every slot free."""
        batch, kv_heads, _, head_dim = like.shape
        # zeros, not uninitialised memory: a free slot's keys and values are read (with zero weight) by static
        # steps, and 0 x NaN would poison them
        layer.keys = like.new_zeros(batch, kv_heads, capacity, head_dim)
        layer.values = like.new_zeros(batch, kv_heads, capacity, head_dim)
        layer.positions = torch.full((batch, kv_heads, capacity), FREE, dtype=torch.int32, device=like.device)
        if self.track_scores:
            layer.scores = torch.zeros(batch, kv_heads, capacity, dtype=torch.float32, device=like.device)

    def _grow(self, layer: HeapLayer, capacity: int) -> None:
        """Copy the layer into tensors of ``capacity`` slots: a fork of a context read for several policies holds
        its source's tensors, sized for the context alone, and goes on past them. Never in static mode
        (:meth:`make_static` grows every layer to its plan first)."""
        if self.static:
            raise RuntimeError("a static heap cannot grow; its capacity was planned too small")
        for name in ("keys", "values", "positions", "scores"):
            old = getattr(layer, name)
            if old is None:
                continue
            fill = FREE if name == "positions" else 0
            new = old.new_full((*old.shape[:2], capacity, *old.shape[3:]), fill)
            new[:, :, : layer.used] = old[:, :, : layer.used]
            setattr(layer, name, new)
            layer.shared.discard(name)

    def _own(self, layer: HeapLayer, *names: str) -> None:
        """Copy the tensors a fork still shares with its source before changing them (copy on write)."""
        for name in names:
            if name in layer.shared and getattr(layer, name) is not None:
                setattr(layer, name, getattr(layer, name).clone())
            layer.shared.discard(name)

    # --- forks, observation and figures ------------------------------------------------------------------------

    def fork(
        self,
        *,
        capacities: list[int],
        track_scores: bool,
        query_window: int,
        layout: HeapLayout,
        room: int,
        keep_planned: bool,
        query_moments: bool = False,
    ) -> KVHeap:
        """An independent heap holding the same tokens, for another policy to compress.

        K, V, positions and scores are shared with this heap and copied only when the fork first changes them, so
        a fork costs no memory until it diverges (a compaction builds new tensors without copying first).
        """
        forked = KVHeap(
            capacities,
            layout=layout,
            track_scores=track_scores,
            query_window=query_window,
            room=room,
            keep_planned=keep_planned,
            query_moments=query_moments,
            rope=self.rope,
        )
        forked.seen_tokens = self.seen_tokens
        for source, target in zip(self.layers, forked.layers):
            target.keys, target.values, target.positions = source.keys, source.values, source.positions
            target.used, target.live, target.ordered = source.used, source.live, source.ordered
            target.sliding_window, target.scaling, target.softcap = (
                source.sliding_window,
                source.scaling,
                source.softcap,
            )
            target.shared = {"keys", "values", "positions"}
            if track_scores:
                if source.scores is None:
                    raise ValueError("The shared prefill did not accumulate attention scores.")
                target.scores = source.scores
                target.shared.add("scores")
            if query_window:
                if source.recent_queries is None or source.recent_queries.shape[2] < min(
                    query_window, self.seen_tokens
                ):
                    raise ValueError("The shared prefill did not remember enough queries.")
                assert source.recent_query_positions is not None
                target.recent_queries = source.recent_queries[:, :, -query_window:].clone()
                target.recent_query_positions = source.recent_query_positions[-query_window:].clone()
            if forked.query_moments:
                if source.moments is None:
                    raise ValueError("The shared prefill did not accumulate query moments.")
                target.moments = source.moments.clone()
        return forked

    def make_static(self) -> None:
        """Switch to static mode for captured decode steps: every layer at its planned capacity and every tensor
        owned, so that nothing is allocated while steps run (the generation decodes statically only once an
        observation window is full, see :meth:`kvlab.engine.static.StaticDecoder.for_generation`)."""
        for layer in self.layers:
            if layer.keys is not None and layer.capacity < layer.planned:
                self._grow(layer, layer.planned)  # a fork still at its source's size
            self._own(layer, *list(layer.shared))
        if self._tied_cuts is None:  # a captured eviction adds to it in place: it must exist before the capture
            self._tied_cuts = torch.zeros((), device=self.layers[0].device)
        self.static = True

    def stop_observing(self) -> None:
        """Drop accumulated scores and remembered queries and stop collecting them: after prefill mode's one
        compression nothing is scored again."""
        self.track_scores = False
        self.query_window = 0
        self.query_moments = False
        for layer in self.layers:
            layer.moments = None
            layer.scores = None
            layer.shared.discard("scores")
            layer.recent_queries = None
            layer.recent_query_positions = None

    def compaction_seconds(self) -> float:
        """Time the compactions outside static decode steps took on the device (read from device events on a GPU,
        so no compaction waits for the GPU; inside a static step a compaction is part of the step's time)."""
        return self._compaction_time.seconds()

    def ranking_seconds(self) -> float:
        """Time the evictions outside static steps took to score and choose their victims (read like
        :meth:`compaction_seconds`)."""
        return self._ranking_time.seconds()

    def kv_bytes(self) -> int:
        """Bytes of K and V in the slots that hold a token (live), over all layers."""
        return sum(layer.live_bytes() for layer in self.layers)

    def reserved_bytes(self) -> int:
        """Bytes of the K and V tensors allocated, over all layers, read from the tensors."""
        return sum(layer.reserved_bytes() for layer in self.layers)

    def per_device(self, measure: Callable[[HeapLayer], int]) -> dict[str, int]:
        """``measure`` of every layer (:meth:`HeapLayer.live_bytes`, :meth:`HeapLayer.reserved_bytes`) summed per
        device its tensors live on (``cuda:0``, ``cpu``), for a model whose layers a device map split."""
        totals: dict[str, int] = {}
        for layer in self.layers:
            if layer.keys is not None:
                device = str(layer.device)
                totals[device] = totals.get(device, 0) + measure(layer)
        return totals

    def aux_bytes(self) -> int:
        """Bytes of kvlab's bookkeeping tensors (positions, scores, remembered queries), reported separately."""
        return sum(layer.aux_bytes() for layer in self.layers)

    def dead_share(self) -> float:
        """Free slots among the slots in use, over all layers: what a bitmask holds without using."""
        used = sum(layer.used for layer in self.layers)
        return sum(layer.dead for layer in self.layers) / used if used else 0.0

    def kept_per_layer(self) -> list[int]:
        """Tokens held per (sequence, KV head) in each layer (the mean over heads where they differ)."""
        return [layer.held_per_head() for layer in self.layers]

    def freeze(self, layer_idx: int, hot: torch.Tensor, cold: torch.Tensor, tier: TierSpec) -> None:
        """Move a layer's ``hot`` and ``cold`` slots (``(batch, kv_heads, span)`` masks of held slots) into its
        frozen part at the ``tier``'s precision (:func:`kvlab.cache.tiers.freeze`) and free every slot of
        the dense heap, which then holds only the tokens read afterwards. Done once, at prefill mode's
        compression."""
        from kvlab.cache.tiers import freeze

        layer = self.layers[layer_idx]
        span = hot.shape[-1]
        keys, values, positions = layer.slots(span)
        layer.frozen = freeze(keys, values, positions, hot, cold, tier)
        if layer.live:
            self.evict(layer_idx, position_order(positions)[..., : layer.live])


def on_device(copies: dict[torch.device, torch.Tensor], device: torch.device) -> torch.Tensor:
    """The tensor ``copies`` holds, on ``device``: copied there (and kept in ``copies``) the first time a layer on that
    device asks, so that a forward pass of a model split over devices copies it once per device."""
    found = copies.get(device)
    if found is None:
        found = copies[device] = next(iter(copies.values())).to(device)
    return found


def position_order(positions: torch.Tensor) -> torch.Tensor:
    """The slots of each sequence and KV head ordered by the position they hold, free slots last."""
    return positions.masked_fill(positions < 0, _LAST).argsort(dim=-1)


def survivors(positions: torch.Tensor, live: int) -> torch.Tensor:
    """The original positions held in a layer, ``(batch, kv_heads, live)`` in increasing order, whatever the slot
    order."""
    return positions.gather(-1, position_order(positions)[..., :live])


def _gather_slots(tensor: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """``tensor[b, h, order[b, h, i]]`` for tensors of slots, with or without a trailing feature dimension."""
    if tensor.dim() == 4:
        return tensor.gather(2, order.unsqueeze(-1).expand(-1, -1, -1, tensor.shape[-1]))
    return tensor.gather(2, order)


@dataclass
class DeviceClock:
    """The time of a piece of device work: CUDA events on a GPU (read later, without waiting now), recorded on that
    GPU's own stream (a layer of a model split over GPUs works on its GPU, whichever is current), the host clock on a
    CPU (where work is synchronous)."""

    begin: Any
    end: Any = None
    stream: Any = None

    @classmethod
    def start(cls, device: torch.device) -> DeviceClock:
        if device.type == "cuda":
            stream = torch.cuda.current_stream(device)
            event = torch.cuda.Event(enable_timing=True)
            event.record(stream)
            return cls(event, stream=stream)
        return cls(time.perf_counter())

    def stop(self) -> DeviceClock:
        if isinstance(self.begin, float):
            self.end = time.perf_counter()
        else:
            self.end = torch.cuda.Event(enable_timing=True)
            self.end.record(self.stream)
        return self

    def seconds(self) -> float:
        if isinstance(self.begin, float):
            return self.end - self.begin
        self.end.synchronize()
        return self.begin.elapsed_time(self.end) / 1000.0


#: Device clocks a :class:`ClockTotal` keeps unread at most; then it reads the older half.
PENDING_CLOCKS = 1024


@dataclass
class ClockTotal:
    """The seconds of many clocked pieces of work (every eviction of a long streaming run) in bounded memory: a host
    clock is read at once; device clocks wait unread, and once :data:`PENDING_CLOCKS` of them wait the older half is
    read (finished long since, so reading rarely waits for the GPU)."""

    settled: float = 0.0
    pending: list[DeviceClock] = field(default_factory=list)

    def add(self, clock: DeviceClock) -> None:
        if isinstance(clock.begin, float):
            self.settled += clock.seconds()
            return
        self.pending.append(clock)
        if len(self.pending) >= PENDING_CLOCKS:
            half = len(self.pending) // 2
            self.settled += sum(older.seconds() for older in self.pending[:half])
            del self.pending[:half]

    def seconds(self) -> float:
        return self.settled + sum(clock.seconds() for clock in self.pending)
