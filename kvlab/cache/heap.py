"""The KV heap: each layer's keys and values in slots allocated once per run, evicted from in one of three layouts.

The heap is a list of layer objects (:mod:`kvlab.cache.layer`), one per decoder layer, each of the type the run's
cache spec asks for (:meth:`KVHeap.build`): dense slots, a :class:`~kvlab.cache.tiers.TieredLayer` that freezes what
it keeps at its precision, or a :class:`~kvlab.cache.demotion.DemotingLayer` that demotes what it evicts. The engine
plans each layer's capacity from the run's budget (budget + chunk in streaming mode; the prompt and the tokens to
generate in prefill mode), so a run allocates once and writes in place.

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
attention masks of its own for it: kvlab's attention function builds masks from the stored positions
(:class:`~kvlab.cache.positions.Positions`, the run's one position state).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kvlab.cache.clocks import ClockTotal, DeviceClock
from kvlab.cache.demotion import DemotingLayer, Demotion, DemotionReport
from kvlab.cache.layer import FREE, AttentionShape, HeapLayer, first_free, gather_slots, position_order
from kvlab.cache.layouts import HeapLayout
from kvlab.cache.noise import NoiseFloor
from kvlab.cache.positions import Positions
from kvlab.cache.ranking import Victims, hot_and_cold, kept, victims
from kvlab.cache.spec import CacheSpec, TierSpec
from kvlab.cache.stack import LayerStack
from kvlab.cache.tiers import TieredLayer
from kvlab.fusion import fused
from kvlab.models.rope import LayerRopes

#: A run's host counts, as :meth:`KVHeap.host_state` takes them: tokens seen, compactions, slots ranked, cuts, and
#: per layer slots in use, live and whether ordered.
HostState = tuple[int, int, int, int, list[tuple[int, int, bool]]]
#: A layer's eviction scores for its slots in view (policy scores with the noise floor, higher kept).
Ranker = Callable[[], torch.Tensor]


@dataclass(frozen=True)
class Observed:
    """What attention keeps for the run's policies: the attention each slot accumulates (``scores``: H2O), the last
    ``query_window`` queries (SnapKV, TOVA), the running moments of every query before RoPE (``query_moments``:
    Expected Attention)."""

    scores: bool = False
    query_window: int = 0
    query_moments: bool = False


@dataclass(frozen=True)
class Freezing:
    """How prefill mode's compression freezes what a layer keeps (:class:`~kvlab.cache.tiers.TieredLayer`): the share
    held at 16 bits, the cold tier, and Ada-KV's per-head floor (``None``: every head keeps its budget)."""

    hot: float
    tier: TierSpec
    safeguard: float | None


class KVHeap:
    """The KV cache of one generation (one or several same-length sequences), layer by layer.

    ``room`` is how many tokens the run may still write between two evictions; a compaction sizes the layer to its
    survivors plus that room, or, with ``keep_planned`` (streaming mode, where the plan already is the steady size:
    budget + chunk, or the whole run when shorter), to the plan. Build one with :meth:`build`.
    """

    def __init__(
        self,
        layers: list[HeapLayer],
        *,
        layout: HeapLayout,
        observed: Observed,
        room: int,
        keep_planned: bool,
        rope: LayerRopes | None,
        noise: NoiseFloor,
        freezing: Freezing | None,
        demotion: Demotion | None,
    ) -> None:
        self.layers = layers
        self.layout = layout
        self.room = room
        self.keep_planned = keep_planned
        self.rope = rope
        #: What the layers' scores are perturbed by before ranking (:mod:`kvlab.cache.noise`).
        self.noise = noise
        self.track_scores = observed.scores
        self.query_window = observed.query_window
        #: Whether attention accumulates each layer's query moments (needs each layer's ``rope`` to undo the
        #: rotation).
        self.query_moments = observed.query_moments and rope is not None
        #: The run's one position state (:mod:`kvlab.cache.positions`).
        self.positions = Positions()
        self.static = False
        #: Every layer's positions and scores as views of one tensor, in static mode where the layers allow it.
        self.stack: LayerStack | None = None
        #: Every layer's slot of the token the pass in flight decodes, ``(layers, batch, kv_heads, 1)``, where
        #: :meth:`begin_pass` placed it for all layers at once.
        self.placed: torch.Tensor | None = None
        #: Where the pass in flight's query goes in every layer's remembered window, ``(1,)``: over the oldest, in a
        #: static step (:meth:`begin_pass`); ``None`` elsewhere.
        self.oldest_query: torch.Tensor | None = None
        self.compactions = 0
        self.ranked_slots = 0
        #: Eviction cuts made (one per sequence, KV head and eviction), and on the device those on tied scores.
        self.cuts = 0
        self._tied_cuts: torch.Tensor | None = None
        self._compaction_time = ClockTotal()
        self._ranking_time = ClockTotal()
        self._freezing = freezing
        self._demotion = demotion

    @classmethod
    def build(
        cls,
        capacities: list[int],
        spec: CacheSpec,
        *,
        observed: Observed,
        room: int,
        keep_planned: bool,
        rope: LayerRopes | None,
        evicting: bool,
    ) -> KVHeap:
        """A heap of ``capacities`` planned slots per layer whose layers are of the type the cache ``spec`` asks for:
        tiered where prefill mode's compression freezes what it keeps, demoting where an evicting run demotes what
        it evicts, dense otherwise."""
        options = spec.options
        demotion_spec = options.demotion() if evicting else None
        demotion = None if demotion_spec is None else Demotion(demotion_spec, len(capacities))
        layers: list[HeapLayer]
        if demotion is not None:
            layers = [DemotingLayer(planned=c, demotion=demotion, index=i) for i, c in enumerate(capacities)]
        elif options.freezes:
            layers = [TieredLayer(planned=c) for c in capacities]
        else:
            layers = [HeapLayer(planned=c) for c in capacities]
        freezing = Freezing(options.hot, options.tier(), options.head_safeguard()) if options.freezes else None
        return cls(
            layers,
            layout=spec.heap_layout(),
            observed=observed,
            room=room,
            keep_planned=keep_planned,
            rope=rope,
            noise=NoiseFloor(options.noise, options.noise_scale),
            freezing=freezing,
            demotion=demotion,
        )

    @property
    def seen_tokens(self) -> int:
        """Tokens seen so far: the position the next token gets."""
        return self.positions.seen

    @property
    def freezes(self) -> bool:
        """Whether prefill mode's compression freezes what each layer keeps (precision tiers, Ada-KV), so that every
        layer is compressed even where nothing is evicted."""
        return self._freezing is not None

    # --- the forward pass --------------------------------------------------------------------------------------

    def begin_pass(self, positions: torch.Tensor, last: int) -> None:
        """Before a forward pass that appends the tokens at ``positions`` (:meth:`Positions.begin`). In a static step
        (one token): where the layers remember a window of queries, find the oldest once and write the token's
        position there (:attr:`oldest_query`; every layer remembers the same positions, in one tensor shared since
        :meth:`make_static`); with the layers stacked (:mod:`kvlab.cache.stack`), find every layer's first free slot
        in one reduction and write the token's position there (and zero its accumulated attention), so that each
        layer's :meth:`update` writes only its keys and values, and attention may build every layer's mask at once
        (:attr:`placed`)."""
        self.positions.begin(positions, last)
        self.placed = None
        self.oldest_query = None
        if not self.static or positions.shape[0] != 1:
            return
        window_positions = self.layers[0].recent_query_positions
        if self.query_window and window_positions is not None:
            self.oldest_query = window_positions.argmin().view(1)
            window_positions.index_copy_(0, self.oldest_query, self.positions.on(window_positions.device))
        stack = self.stack
        if stack is None or not stack.holds(self.layers):
            return
        slots = first_free(stack.positions, 1)
        stack.positions.scatter_(3, slots, self.positions.slot_values(slots.device).expand_as(slots))
        if stack.scores is not None:
            stack.scores.scatter_(3, slots, 0.0)
        self.placed = slots

    def end_pass(self, count: int) -> None:
        """After a forward pass that appended ``count`` tokens to every layer."""
        self.positions.end(count)
        self.placed = None
        self.oldest_query = None

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Tokens seen so far (the next token's position), which is what models use to place new tokens."""
        return self.positions.seen

    @torch.compiler.disable  # the heap's bookkeeping stays out of compiled layers (kvlab.models.compiled)
    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the new tokens' K/V into the layer's first free slots and return the slots attention reads
        (transformers' contract)."""
        layer = self.layers[layer_idx]
        batch, kv_heads, count, head_dim = key_states.shape
        new_positions = self.positions.slot_values(key_states.device).expand(batch, kv_heads, count)
        if layer.keys is None:
            self._allocate(layer, key_states, max(layer.planned, count))
        elif layer.live + count > layer.capacity:
            self._grow(layer, max(layer.planned, layer.live + count))
        self._own(layer, "keys", "values", "positions", "scores")
        keys, values, slot_positions = layer.slots(layer.capacity)
        if self.placed is not None:  # the position and the score are written: the keys and values are left
            index = self.placed[layer_idx].unsqueeze(-1).expand(-1, -1, -1, head_dim)
            keys.scatter_(2, index, key_states.to(keys.dtype))
            values.scatter_(2, index, value_states.to(values.dtype))
        elif layer.dead == 0 and not self.static:  # the free slots are the tail: append in order
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

    def describe(self, layer_idx: int, shape: AttentionShape) -> None:
        """Record what a layer's attention does beyond q.K^T (its window, scaling, soft-cap) at its first forward."""
        layer = self.layers[layer_idx]
        if layer.shape is None:
            layer.shape = shape

    # --- eviction and compaction -------------------------------------------------------------------------------

    def ranking_clock(self, layer_idx: int) -> DeviceClock | None:
        """A clock started for an eviction's ranking of a layer (none inside a static step, whose time is the
        step's)."""
        return None if self.static else DeviceClock.start(self.layers[layer_idx].device)

    def cut(
        self,
        layer_idx: int,
        count: int,
        scores: torch.Tensor,
        start: int,
        clock: DeviceClock | None = None,
        before_free: Callable[[torch.Tensor], None] | None = None,
    ) -> None:
        """Evict the ``count`` lowest-ranked slots of a layer among the slots ``[start, start + scores' width)``
        (``scores``: their eviction scores), counting the slots ranked, timing the ranking since ``clock`` started,
        and counting the cut and whether it fell on a tie. ``before_free`` is shown the victims ``(batch, kv_heads,
        count)`` while they still hold their tokens."""
        layer = self.layers[layer_idx]
        positions = layer.slots(layer.capacity)[2][..., start : start + scores.shape[-1]]
        chosen = self._victims(layer, scores, positions, count)
        self.account_ranking(layer, scores.shape[-1], clock.stop() if clock is not None else None)
        self.account_cut(layer, chosen.tied)
        slots = chosen.slots + start if start else chosen.slots
        if before_free is not None:
            before_free(slots)
        self.evict(layer_idx, slots)

    def stacked_layer(self) -> HeapLayer | None:
        """Every layer as one layer whose sequences are all layers' (``layers x batch``), for an eviction of all
        layers at once: in a static step the stack's views (:meth:`LayerStack.as_layer`), otherwise a copy of every
        layer's positions and scores over the slots in use (:meth:`LayerStack.copied`); ``None`` where the layers are
        not stacked or differ, or their noise floor draws per layer."""
        if self.noise.kind != "none":
            return None
        if not self.static:
            return LayerStack.copied(self.layers)
        stack = self.stack
        if stack is None or not stack.holds(self.layers):
            return None
        return stack.as_layer(self.layers)

    def cut_every_layer(
        self,
        count: int,
        scores: torch.Tensor,
        stacked: HeapLayer,
        clock: DeviceClock | None = None,
        before_free: Callable[[torch.Tensor], None] | None = None,
    ) -> None:
        """Evict the ``count`` lowest-ranked slots of every layer at once, ``scores`` being the eviction scores of
        ``stacked``'s slots (:meth:`stacked_layer`, ``(layers x batch, kv_heads, span)``): one ranking and one tie
        count for all layers, the victims those layer-by-layer eviction chooses (:meth:`cut`), timed since ``clock``
        started. A static step frees them in one scatter into the stack; otherwise each layer frees its own
        (:meth:`evict`, which compacts as the layout says). ``before_free`` is shown the victims ``(layers x batch,
        kv_heads, count)`` while they still hold their tokens."""
        positions = stacked.positions
        assert positions is not None
        chosen = self._victims(self.layers[0], scores, positions, count)
        if clock is not None:
            self._ranking_time.add(clock.stop())
        if chosen.tied is not None:
            self._count_ties(chosen.tied)
        if before_free is not None:
            before_free(chosen.slots)
        if self.static:
            positions.scatter_(2, chosen.slots, FREE)  # the stack's own positions: every layer's views
        batch = chosen.slots.shape[0] // len(self.layers)
        for index, layer in enumerate(self.layers):
            self.account_ranking(layer, scores.shape[-1])
            self.account_cut(layer)
            if not self.static:
                self.evict(index, chosen.slots[index * batch : (index + 1) * batch])
            elif self.account_evict(layer, count):
                self._compact(layer)

    def _victims(self, layer: HeapLayer, scores: torch.Tensor, positions: torch.Tensor, count: int) -> Victims:
        """The victims among ``scores`` (:func:`~kvlab.cache.ranking.victims`), fused for the fixed shapes of a static
        step."""
        select = fused(layer.device.type, victims) if self.static else victims
        chosen: Victims = select(scores, positions, count)
        return chosen

    def compress(
        self, layer_idx: int, count: int, rank: Ranker, candidates: tuple[int, int] | None, entries: int | None = None
    ) -> None:
        """Prefill mode's one compression of a layer down to its budget (``count`` tokens fewer): the lowest-ranked
        tokens evicted in place, or, where the cache freezes what it keeps (precision tiers, Ada-KV), every layer's
        kept tokens moved into its frozen part at their precision and the rest evicted. ``rank`` gives the layer's
        eviction scores; ``candidates`` the slots the victims are chosen from (``None``: all); ``entries`` the
        tokens over its KV heads that Ada-KV keeps (``None``: the budget per head)."""
        layer = self.layers[layer_idx]
        freezing = self._freezing
        if freezing is None:
            if count:
                clock = self.ranking_clock(layer_idx)
                start, stop = candidates or (0, layer.span(self.static))
                self.cut(layer_idx, count, rank()[..., start:stop], start, clock)
            return
        assert isinstance(layer, TieredLayer)
        span = layer.span(self.static)
        positions = layer.slots(span)[2]
        if count == 0 and entries is None and freezing.hot == 1.0:  # nothing cut or cold: all frozen, unranked
            hot, cold = positions >= 0, torch.zeros_like(positions, dtype=torch.bool)
        else:
            clock = DeviceClock.start(layer.device)
            keep = layer.live - count
            kept_slots, ranking, tied = kept(rank(), positions, keep, layer.live, freezing.safeguard, entries)
            self.account_ranking(layer, span, clock.stop())
            if tied is not None:
                self.account_cut(layer, tied)
            hot, cold = hot_and_cold(ranking, kept_slots, freezing.hot)
        frozen_slots = layer.freeze(hot, cold, freezing.tier)
        if layer.live:
            self.evict(layer_idx, frozen_slots)

    def evict(self, layer_idx: int, slots: torch.Tensor) -> None:
        """Free the slots ``slots`` (``(batch, kv_heads, k)``, distinct held slots) of a layer, then compact when the
        layout says so."""
        layer = self.layers[layer_idx]
        count = slots.shape[-1]
        if count == 0:
            return
        self._own(layer, "positions")
        layer.before_free(slots)
        layer.slots(layer.capacity)[2].scatter_(2, slots, FREE)
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
            self._count_ties(tied)

    def _count_ties(self, tied: torch.Tensor) -> None:
        """Add on the device how many cuts (``tied``: a boolean per cut) fell on tied scores."""
        if self._tied_cuts is None:
            self._tied_cuts = torch.zeros((), device=tied.device)
        self._tied_cuts += tied.sum().to(self._tied_cuts.device)  # layers may live on several devices

    def account_appended(self, count: int) -> None:
        """The host's counts after a forward pass the host did not run appended ``count`` tokens to every layer (a
        replayed static step, or the plan of one)."""
        self.positions.advance(count)
        for layer in self.layers:
            self.account_write(layer, count)

    def account_evictions(self, counts: tuple[int, ...], replayed: bool) -> tuple[bool, ...]:
        """The host's counts after each layer gave up ``counts[i]`` tokens by the rules an eager eviction follows;
        whether each compacted. A ``replayed`` step's rankings and cuts are counted too (its graph ranked every slot
        of the capacity)."""
        compacts = []
        for layer, count in zip(self.layers, counts):
            if count and replayed:
                self.account_ranking(layer, layer.span(static=True))
                self.account_cut(layer)
            compacts.append(bool(count) and self.account_evict(layer, count))
        return tuple(compacts)

    def tie_share(self) -> float | None:
        """The share of eviction cuts where the best victim's score equalled the worst survivor's, so that the
        position tie-break decided (``None`` when nothing was cut; read once, at the end of a run)."""
        if not self.cuts:
            return None
        return 0.0 if self._tied_cuts is None else float(self._tied_cuts) / self.cuts

    def host_state(self) -> HostState:
        """The host's counts (tokens seen, compactions, slots ranked, cuts, and per layer slots in use, live and
        whether ordered)."""
        layers = [(layer.used, layer.live, layer.ordered) for layer in self.layers]
        return self.positions.seen, self.compactions, self.ranked_slots, self.cuts, layers

    def restore(self, state: HostState) -> None:
        """Put back counts taken by :meth:`host_state` (a captured step ran its host logic without its device
        work, or a planned one was worked out ahead)."""
        self.positions.seen, self.compactions, self.ranked_slots, self.cuts, layers = state
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
            name: gather_slots(getattr(layer, name), order)
            for name in ("keys", "values", "positions", "scores")
            if getattr(layer, name) is not None
        }
        fresh = capacity != layer.capacity or bool(layer.shared & set(gathered))
        for name, kept_slots in gathered.items():
            target = getattr(layer, name)
            if fresh:
                target = target.new_zeros((*target.shape[:2], capacity, *target.shape[3:]))
            target[:, :, : layer.live] = kept_slots
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

    def share(self, source: KVHeap) -> KVHeap:
        """Hold the tokens ``source`` holds, as a fork of it: built for another run's cache spec and what its policy
        observes (:meth:`build`), then given the source's tensors and counts, for that run to compress.

        K, V, positions and scores are shared with the source and copied only when this heap first changes them, so
        a fork costs no memory until it diverges (a compaction builds new tensors without copying first)."""
        self.positions = Positions(source.positions.seen)
        for held, layer in zip(source.layers, self.layers):
            layer.keys, layer.values, layer.positions = held.keys, held.values, held.positions
            layer.used, layer.live, layer.ordered = held.used, held.live, held.ordered
            layer.shape = held.shape
            layer.shared = {"keys", "values", "positions"}
            if self.track_scores:
                if held.scores is None:
                    raise ValueError("The shared prefill did not accumulate attention scores.")
                layer.scores = held.scores
                layer.shared.add("scores")
            window = self.query_window
            if window:
                if held.recent_queries is None or held.recent_queries.shape[2] < min(window, source.seen_tokens):
                    raise ValueError("The shared prefill did not remember enough queries.")
                assert held.recent_query_positions is not None
                layer.recent_queries = held.recent_queries[:, :, -window:].clone()
                layer.recent_query_positions = held.recent_query_positions[-window:].clone()
            if self.query_moments:
                if held.moments is None:
                    raise ValueError("The shared prefill did not accumulate query moments.")
                layer.moments = held.moments.clone()
        return self

    def capturable(self) -> bool:
        """Whether decode steps over every layer can be captured in a CUDA graph (no frozen part materialised per
        step, no pages recalled from the host)."""
        return all(layer.capturable() for layer in self.layers)

    def evictions_capturable(self) -> bool:
        """Whether an eviction of this heap can be captured in a CUDA graph: noise draws from a generator a graph
        would not advance."""
        return self.noise.kind == "none"

    def make_static(self, received_at_once: bool = False) -> None:
        """Switch to static mode for captured decode steps: every layer with the slots the rest of the run needs
        and every tensor owned, so that nothing is allocated while steps run (the generation decodes statically
        only once an observation window is full, see :meth:`kvlab.engine.static.StaticSteps.for_loop`); the layers
        stacked (:meth:`LayerStack.of`, told whether the steps compute what each slot received for every layer at
        once). The slots needed are the plan's in streaming mode (its steady size), and elsewhere those in use plus
        the :attr:`room` for the tokens still to come, at most the plan's: a layer compacted by prefill mode's
        compression keeps its survivors' size, as eager decoding does, rather than growing back to the whole
        context (at 128k tokens and keep 10%, 16 GiB reserved where 1.6 GiB is held). Every layer's remembered
        query positions become one tensor, which :meth:`begin_pass` advances once per step."""
        for layer in self.layers:
            needed = layer.planned if self.keep_planned else min(layer.planned, layer.used + self.room)
            if layer.keys is not None and layer.capacity < needed:
                self._grow(layer, needed)  # a fork still at its source's size
            self._own(layer, *list(layer.shared))
        if self._tied_cuts is None:  # a captured eviction adds to it in place: it must exist before the capture
            self._tied_cuts = torch.zeros((), device=self.layers[0].device)
        window_positions = self.layers[0].recent_query_positions
        for layer in self.layers:  # every layer remembers the passes' queries at the same positions
            layer.recent_query_positions = window_positions
        self.stack = LayerStack.of(self.layers, received_at_once)
        self.static = True

    def windows_full(self) -> bool:
        """Whether every layer remembers a whole observation window of queries (its shape no longer changes)."""
        return not self.query_window or all(
            layer.recent_queries is not None and layer.recent_queries.shape[2] >= self.query_window
            for layer in self.layers
        )

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
            layer.recent_query_lse = None

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

    def tier_bytes(self) -> dict[str, int] | None:
        """Bytes the demotion tiers hold now (``gpu`` beside the heap, ``cpu``, ``disk``), or ``None`` where the run
        deletes what it evicts."""
        return None if self._demotion is None else self._demotion.tier_bytes()

    def demotion_report(self, decode_steps: int) -> DemotionReport | None:
        """What the demotion tiers hold and what moved between them (``None`` where nothing is demoted)."""
        return None if self._demotion is None else self._demotion.report(decode_steps)

    def close(self) -> None:
        """Release what outlives the tensors: the demotion tiers' offload file (the counts stay readable)."""
        if self._demotion is not None:
            self._demotion.close()
