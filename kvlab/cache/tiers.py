"""The frozen part of a layer: the tokens kept at prefill mode's compression, held per KV head and at their precision.

Two things cannot live in the heap's dense ``(batch, kv_heads, slots, head_dim)`` tensors, where every KV head holds
the same number of 16-bit tokens:

* **precision tiers** (the hybrid cache): the ``hot`` share of the kept tokens stays at 16 bits, the rest is held at
  ``key_bits``/``value_bits`` (KIVI's grouping, :mod:`kvlab.cache.quant`), physically packed with its scales;
* **head-adaptive budgets** (Ada-KV): the heads of a layer share its budget, so each holds its own number of tokens.

So at the compression the kept tokens of a :class:`TieredLayer` (the layer type a cache spec with either option
builds) leave its dense slots for a :class:`FrozenLayer`: flat tensors of tokens, head
by head in position order, the hot ones as they were, the cold ones quantised (keys in groups of ``group``
consecutive tokens of one head, padded with copies of the head's last token to a whole group, as KIVI groups keys
along tokens). Nothing is added to it afterwards: the question and the generated tokens go to the now empty dense
heap, at 16 bits (KIVI's full-precision residual). The bytes a layer holds are those of these tensors.

Attention reads a frozen layer by materialising it: the tokens dequantised into a dense ``(batch, kv_heads, width,
head_dim)`` tensor (``width``: the most any head holds), padded with free slots, one layer at a time, and masked from
positions like any heap. That transient tensor is freed after the layer's attention; it counts in the GPU's peak
allocation, not in the bytes held. (A fused kernel would read the packed codes directly.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvlab.cache.layer import FREE, HeapLayer, Slots, position_order
from kvlab.cache.quant import Quantized, quantize_keys, quantize_values
from kvlab.cache.spec import TierSpec


@dataclass
class FrozenLayer:
    """A layer's kept tokens after compression, flat and grouped by KV head.

    ``positions`` is dense ``(batch, kv_heads, width)`` (:data:`FREE` where a head holds fewer tokens than the widest),
    and ``hot_dest``/``cold_dest`` say where each hot and cold token goes in the dense tensor flattened to
    ``(batch * kv_heads * width,)``; ``cold_rows`` picks the real tokens out of the padded key groups.
    ``held_per_head`` counts the tokens each (sequence, KV head) holds.
    """

    positions: torch.Tensor
    hot_keys: torch.Tensor
    hot_values: torch.Tensor
    hot_dest: torch.Tensor
    cold_keys: Quantized | None
    cold_values: Quantized | None
    cold_rows: torch.Tensor
    cold_dest: torch.Tensor
    held_per_head: torch.Tensor

    @property
    def width(self) -> int:
        """Slots of the dense view: the most tokens any (sequence, KV head) holds."""
        return int(self.positions.shape[2])

    def tokens(self) -> int:
        """Tokens held, over sequences and KV heads."""
        return int(self.held_per_head.sum())

    def kv_bytes(self) -> int:
        """Bytes of the K and V tensors held (packed codes, scales and zero points included), read from them."""
        cold = sum(q.nbytes() for q in (self.cold_keys, self.cold_values) if q is not None)
        return cold + sum(t.numel() * t.element_size() for t in (self.hot_keys, self.hot_values))

    def aux_bytes(self) -> int:
        """Bytes of the bookkeeping: positions and the indices that place the tokens."""
        tensors = (self.positions, self.hot_dest, self.cold_rows, self.cold_dest, self.held_per_head)
        return sum(t.numel() * t.element_size() for t in tensors)

    def materialise(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values as dense ``(batch, kv_heads, width, head_dim)`` tensors (zeros in free slots)."""
        batch, kv_heads, width = self.positions.shape
        head_dim = self.hot_keys.shape[-1]
        dense = []
        for hot, cold, rows in (
            (self.hot_keys, self.cold_keys, self.cold_rows),
            (self.hot_values, self.cold_values, None),
        ):
            flat = hot.new_zeros(batch * kv_heads * width, head_dim, dtype=dtype)
            flat.index_copy_(0, self.hot_dest, hot.to(dtype))
            if cold is not None:
                tokens = cold.dequantize(dtype).reshape(-1, head_dim)
                flat.index_copy_(0, self.cold_dest, tokens if rows is None else tokens.index_select(0, rows))
            dense.append(flat.view(batch, kv_heads, width, head_dim))
        return dense[0], dense[1]


def freeze(
    keys: torch.Tensor,
    values: torch.Tensor,
    positions: torch.Tensor,
    hot: torch.Tensor,
    cold: torch.Tensor,
    tier: TierSpec,
) -> FrozenLayer:
    """A frozen layer holding the slots marked ``hot`` at 16 bits and those marked ``cold`` at the tier's bits.

    ``keys``/``values`` are a layer's ``(batch, kv_heads, slots, head_dim)`` tensors, ``positions`` its slot
    positions and ``hot``/``cold`` disjoint ``(batch, kv_heads, slots)`` masks of held slots. Tokens are taken head by
    head in position order. The counts per head are read to the host once (the compression's one synchronisation).
    """
    batch, kv_heads, _, head_dim = keys.shape
    hot_counts = hot.sum(-1).flatten()
    cold_counts = cold.sum(-1).flatten()
    held = hot_counts + cold_counts
    width = max(int(held.max()), 1)
    hot_order = _in_position_order(positions, hot)
    cold_order = _in_position_order(positions, cold)
    segment_base = torch.arange(batch * kv_heads, device=keys.device) * width
    hot_slots, hot_segments, hot_offsets = _flat(hot_order, hot_counts, hot_counts)
    hot_dest = segment_base[hot_segments] + hot_offsets
    flat_keys, flat_values = keys.flatten(0, 1), values.flatten(0, 1)
    flat_positions = positions.flatten(0, 1)
    dense_positions = positions.new_full((batch * kv_heads * width,), FREE)
    dense_positions[hot_dest] = flat_positions[hot_segments, hot_slots]
    hot_keys = flat_keys[hot_segments, hot_slots]
    hot_values = flat_values[hot_segments, hot_slots]
    key_group = 1 if tier.key_bits == 16 else tier.group
    padded = torch.div(cold_counts + key_group - 1, key_group, rounding_mode="floor") * key_group
    cold_slots, cold_segments, cold_offsets = _flat(cold_order, padded, cold_counts)
    real = cold_offsets < cold_counts[cold_segments]
    cold_rows = real.nonzero().flatten()
    cold_dest = segment_base[cold_segments[cold_rows]] + hot_counts[cold_segments[cold_rows]] + cold_offsets[cold_rows]
    dense_positions[cold_dest] = flat_positions[cold_segments[cold_rows], cold_slots[cold_rows]]
    cold_keys = cold_values = None
    if cold_rows.numel():
        grouped = flat_keys[cold_segments, cold_slots].reshape(-1, key_group, head_dim)
        cold_keys = quantize_keys(grouped, tier.key_bits)
        real_slots = (cold_segments[cold_rows], cold_slots[cold_rows])
        cold_values = quantize_values(flat_values[real_slots], tier.value_bits, tier.group)
    return FrozenLayer(
        positions=dense_positions.view(batch, kv_heads, width),
        hot_keys=hot_keys,
        hot_values=hot_values,
        hot_dest=hot_dest,
        cold_keys=cold_keys,
        cold_values=cold_values,
        cold_rows=cold_rows,
        cold_dest=cold_dest,
        held_per_head=held.view(batch, kv_heads).to(torch.int32),
    )


def _in_position_order(positions: torch.Tensor, selected: torch.Tensor) -> torch.Tensor:
    """The slots of each (sequence, KV head), the selected ones first in position order."""
    last = torch.iinfo(torch.int32).max
    return positions.masked_fill(~selected, last).argsort(dim=-1, stable=True).flatten(0, 1)


def _flat(order: torch.Tensor, lengths: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The first ``lengths[s]`` entries of each row ``s`` of ``order`` as flat (slot, segment, offset) tensors, an
    entry past the row's ``counts[s]`` selected ones repeating its last selected slot (the padding of a key group)."""
    most = max(int(lengths.max()), 1) if lengths.numel() else 1
    offsets = torch.arange(most, device=order.device).expand(order.shape[0], most)
    keep = offsets < lengths.unsqueeze(1)
    clamped = torch.minimum(offsets, (counts - 1).clamp_min(0).unsqueeze(1))
    clamped = clamped.clamp_max(order.shape[1] - 1)
    slots = order.gather(1, clamped)
    segments = torch.arange(order.shape[0], device=order.device).unsqueeze(1).expand_as(offsets)
    return slots[keep], segments[keep], offsets[keep]


@dataclass
class TieredLayer(HeapLayer):
    """A layer whose kept tokens leave the dense slots at prefill mode's compression for a :class:`FrozenLayer`
    (precision tiers, Ada-KV); the dense slots then take the question and the generated tokens. Attention reads the
    frozen tokens, materialised at the heap's dtype for that layer's call only, before the dense slots, masked by
    position."""

    frozen: FrozenLayer | None = None

    def read(self, span: int, static: bool, query: torch.Tensor, decoding: bool) -> tuple[Slots, bool]:
        if self.frozen is None:
            return super().read(span, static, query, decoding)
        keys, values, positions = self.slots(span)
        frozen_keys, frozen_values = self.frozen.materialise(keys.dtype)
        slots = (
            torch.cat([frozen_keys, keys], dim=2),
            torch.cat([frozen_values, values], dim=2),
            torch.cat([self.frozen.positions, positions], dim=2),
        )
        return slots, False

    def held_positions(self) -> torch.Tensor:
        """Positions of every slot that can hold a token, frozen ones first (free ones negative)."""
        dense = super().held_positions()
        return dense if self.frozen is None else torch.cat([self.frozen.positions, dense], dim=2)

    def held_per_head(self) -> int:
        """Tokens held per (sequence, KV head), the mean where heads hold different numbers (frozen Ada-KV)."""
        if self.frozen is None or self.keys is None:
            return self.live
        batch, kv_heads = self.keys.shape[:2]
        return self.live + round(self.frozen.tokens() / (batch * kv_heads))

    def capturable(self) -> bool:
        """A frozen part is materialised at every step, with shapes of its own."""
        return self.frozen is None

    def reserved_bytes(self) -> int:
        """Bytes of the K and V tensors allocated, the frozen ones as held, read from the tensors."""
        return super().reserved_bytes() + (0 if self.frozen is None or self.keys is None else self.frozen.kv_bytes())

    def live_bytes(self) -> int:
        """Bytes of K and V in the slots that hold a token and of the frozen tokens (packed and scaled, as held)."""
        return super().live_bytes() + (0 if self.frozen is None else self.frozen.kv_bytes())

    def aux_bytes(self) -> int:
        """Bytes of the bookkeeping, the frozen part's indices included."""
        return super().aux_bytes() + (0 if self.frozen is None else self.frozen.aux_bytes())

    def freeze(self, hot: torch.Tensor, cold: torch.Tensor, tier: TierSpec) -> torch.Tensor:
        """Move the ``hot`` and ``cold`` slots (``(batch, kv_heads, span)`` masks of held slots) into the frozen part at
        the ``tier``'s precision; returns the layer's live slots in position order, which the heap then frees."""
        span = hot.shape[-1]
        keys, values, positions = self.slots(span)
        self.frozen = freeze(keys, values, positions, hot, cold, tier)
        return position_order(positions)[..., : self.live]
