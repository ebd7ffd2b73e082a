"""A layer's slots in the order of the positions they hold, and that order kept from step to step in static decoding.

A policy that pools or draws along the sequence (SnapKV's and PyramidKV's pooled votes, ChunkKV's chunks, the
generational cache's oldest tokens, random draws) reads a layer's slots in position order. After a few evictions the
slots hold their tokens in no order, and sorting them by position at every step took 0.27 ms of a 6.8 ms SnapKV
step at 128k tokens and keep 10% on an H200 (32 layers of 13,107 slots), a quarter of what SnapKV's step costs
over StreamingLLM's.

Between two evictions of a static decode run a layer changes by little: the last eviction's victims were freed
(anywhere in the order) and the tokens decoded since were appended, at the next positions, in slots freed before.
So where the policy reads the order (:attr:`kvlab.policies.base.Policy.reads_position_order`), the heap keeps it
(:class:`SlotOrder`) and brings it up to date before every eviction by a stable partition instead of a sort
(:func:`caught_up`): two cumulative sums and a scatter, fused into a few kernels on a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvlab.fusion import fused

#: The key a free slot sorts by: after every position a slot can hold.
_LAST = torch.iinfo(torch.int32).max


def position_order(positions: torch.Tensor) -> torch.Tensor:
    """The slots of each sequence and KV head ordered by the position they hold, free slots last."""
    return positions.masked_fill(positions < 0, _LAST).argsort(dim=-1)


def caught_up(order: torch.Tensor, positions: torch.Tensor, mark: torch.Tensor) -> torch.Tensor:
    """``order`` (slots by position, free ones last, as they were when ``mark`` (``(..., 1)``) was the next position)
    brought up to date with ``positions`` (``(..., slots)``), where since then slots were only freed and tokens
    appended at the positions from ``mark`` on, each still held: the slots that still hold an older token keep their
    relative order, the appended ones follow by position (``mark`` first), the free ones go last. The same slots in
    the same order as :func:`position_order`'s for the held ones, without a sort."""
    held = positions.gather(-1, order)
    older = (held >= 0) & (held < mark)
    appended = held >= mark
    free = held < 0
    older_count = older.sum(dim=-1, keepdim=True)
    appended_count = appended.sum(dim=-1, keepdim=True)
    place = torch.where(
        older,
        older.cumsum(dim=-1) - 1,
        torch.where(appended, older_count + (held - mark), older_count + appended_count + free.cumsum(dim=-1) - 1),
    )
    return torch.empty_like(order).scatter_(-1, place, order)


@dataclass(frozen=True)
class SlotOrder:
    """The slots of a layer (or of every layer, stacked) by the position they hold, free ones last: ``slots``
    ``(..., capacity)``, and ``mark`` ``(..., 1)``, the next position when it was last brought up to date (the tokens
    from there on were appended since)."""

    slots: torch.Tensor
    mark: torch.Tensor

    @classmethod
    def of(cls, positions: torch.Tensor, next_position: int) -> SlotOrder:
        """The order of ``positions`` ``(..., capacity)`` now, one sort, with ``next_position`` the next token's."""
        mark = torch.full((*positions.shape[:-1], 1), next_position, dtype=torch.long, device=positions.device)
        return cls(position_order(positions), mark)

    @classmethod
    def stacked(cls, orders: list[SlotOrder]) -> SlotOrder:
        """The orders of several layers as one, ``(layers, ...)``."""
        return cls(torch.stack([order.slots for order in orders]), torch.stack([order.mark for order in orders]))

    def __getitem__(self, index: int) -> SlotOrder:
        """One layer's views of a stacked order."""
        return SlotOrder(self.slots[index], self.mark[index])

    def flat(self) -> SlotOrder:
        """A stacked order with its layers folded into the batch (as :meth:`kvlab.cache.stack.LayerStack.flat`)."""
        return SlotOrder(self.slots.flatten(0, 1), self.mark.flatten(0, 1))

    def catch_up(self, positions: torch.Tensor, next_position: int | torch.Tensor) -> None:
        """Bring the order up to date with ``positions`` in place (:func:`caught_up`), before an eviction whose next
        token is at ``next_position`` (a number, or in a captured step a device tensor)."""
        self.slots.copy_(fused(self.slots.device.type, caught_up)(self.slots, positions, self.mark))
        if isinstance(next_position, torch.Tensor):
            self.mark.copy_(next_position.reshape(-1)[:1].expand_as(self.mark))
        else:
            self.mark.fill_(next_position)

    def compacted(self) -> None:
        """After an in-place compaction (the held slots gathered to the front in position order): slot order."""
        self.slots.copy_(torch.arange(self.slots.shape[-1], device=self.slots.device).expand_as(self.slots))

    def nbytes(self) -> int:
        """Bytes of the order's tensors."""
        return self.slots.numel() * self.slots.element_size() + self.mark.numel() * self.mark.element_size()
