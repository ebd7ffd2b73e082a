"""Every layer's slot bookkeeping as views of one tensor, so that a static decode step evicts from all layers at once.

A decode step's eviction is a handful of tiny kernels per layer (the scores, the victim, the slot freed, the tie
counted); replayed from a CUDA graph for 32 layers that is some 250 launches, more time than the step saves by
reading a tenth of the cache. When every layer holds the same slots (plain dense layers of one capacity on one
device), :meth:`LayerStack.of` moves their positions and accumulated scores into one ``(layers, batch, kv_heads,
capacity)`` tensor each and gives every layer its view, so that a policy that scores each slot from these alone
(or from each layer's window attention, scored first over that layer's keys) ranks all layers as one layer whose
batch is ``layers x batch`` (:meth:`LayerStack.as_layer`), and the heap frees every layer's victims in one scatter.
Ranking row by row, the victims are exactly those of layer-by-layer eviction.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvlab.cache.layer import HeapLayer


@dataclass(frozen=True)
class LayerStack:
    """The ``positions`` and (where attention accumulates them) ``scores`` of every layer, ``(layers, batch,
    kv_heads, capacity)``, whose slices the layers hold as their own tensors; ``held`` is where each layer's view
    starts in memory, to see that the layers still hold them (a compaction outside static mode would replace them)."""

    positions: torch.Tensor
    scores: torch.Tensor | None
    held: tuple[int, ...]

    @classmethod
    def of(cls, layers: list[HeapLayer]) -> LayerStack | None:
        """Stack the layers' positions and scores and hand each layer its views, or ``None`` where the layers differ
        (a layer type that holds more than dense slots, another capacity, another device, a layer not allocated,
        accumulated attention in some layers only)."""
        if not layers or any(type(layer) is not HeapLayer or layer.positions is None for layer in layers):
            return None
        held = [layer.held_positions() for layer in layers]
        if any(positions.shape != held[0].shape or positions.device != held[0].device for positions in held):
            return None
        kept_scores = [layer.scores for layer in layers if layer.scores is not None]
        if kept_scores and len(kept_scores) < len(layers):
            return None
        positions = torch.stack(held)
        scores = torch.stack(kept_scores) if kept_scores else None
        for index, layer in enumerate(layers):
            layer.positions = positions[index]
            if scores is not None:
                layer.scores = scores[index]
        return cls(positions, scores, tuple(positions[index].data_ptr() for index in range(len(layers))))

    def holds(self, layers: list[HeapLayer]) -> bool:
        """Whether every layer still holds its views of the stack."""
        if len(layers) != len(self.held):
            return False
        for index, (layer, start) in enumerate(zip(layers, self.held)):
            if layer.positions is None or layer.positions.data_ptr() != start:
                return False
            if self.scores is not None and (
                layer.scores is None or layer.scores.data_ptr() != self.scores[index].data_ptr()
            ):
                return False
        return True

    def flat(self, tensor: torch.Tensor) -> torch.Tensor:
        """A stacked tensor with its layers folded into the batch: ``(layers x batch, kv_heads, capacity)``."""
        return tensor.flatten(0, 1)

    def as_layer(self, layers: list[HeapLayer]) -> HeapLayer:
        """All layers as one layer whose sequences are every layer's (``layers x batch``): the stacked positions
        and scores. A window's attention is each layer's own, over its own keys (which are not stacked): the
        eviction scores each layer's window first and stacks the results
        (:func:`kvlab.attention.observe.stacked_window_attention`)."""
        first = layers[0]
        return HeapLayer(
            planned=first.planned,
            positions=self.flat(self.positions),
            scores=None if self.scores is None else self.flat(self.scores),
            used=first.used,
            live=first.live,
            ordered=False,
            shape=first.shape,
        )
