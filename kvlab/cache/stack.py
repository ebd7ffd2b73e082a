"""Every layer's slot bookkeeping as views of one tensor, so that a static decode step evicts from all layers at once.

A decode step's eviction is a handful of tiny kernels per layer (the scores, the victim, the slot freed, the tie
counted); replayed from a CUDA graph for 32 layers that is some 250 launches, more time than the step saves by
reading a tenth of the cache. When every layer holds the same slots (plain dense layers of one capacity on one
device), :meth:`LayerStack.of` moves their positions and accumulated scores into one ``(layers, batch, kv_heads,
capacity)`` tensor each and gives every layer its view, so that a policy that scores each slot from these alone
(or from each layer's window attention) ranks all layers as one layer whose batch is ``layers x batch``
(:meth:`LayerStack.as_layer`), and the heap frees every layer's victims in one scatter. Ranking row by row, the
victims are exactly those of layer-by-layer eviction. Outside static steps (after a prefill chunk, an eager decode
step) the layers' tensors are their own, so an eviction ranks a copy of their positions and scores stacked the same
way (:meth:`LayerStack.copied`), and each layer frees its own victims: for a stream of 4,096-token chunks, one
top-k over 256 rows in place of 32 over 8 rows each took an H200 from 28,854 to 30,839 tokens per second.

Where the layers remember a window of queries (SnapKV, TOVA), their keys and remembered queries are stacked too, so
that the window's attention over every layer's keys is one product and one fused softmax
(:func:`kvlab.attention.observe.stacked_window_attention`) rather than a product and three small kernels per layer,
which took 1.2 ms of a 7.6 ms SnapKV step at 32k on an H200. Under the ``flex`` backend the keys of layers that
accumulate attention (H2O) are stacked too, so that what every slot received in a step is one product for all
layers (:func:`kvlab.attention.flex.settle_received`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from kvlab.cache.layer import HeapLayer


@dataclass(frozen=True)
class LayerStack:
    """The ``positions`` and (where attention accumulates them) ``scores`` of every layer, ``(layers, batch,
    kv_heads, capacity)``, and (where the layers remember a window of queries) their ``keys`` ``(layers, batch,
    kv_heads, capacity, head_dim)``, remembered ``queries`` ``(layers, batch, q_heads, window, head_dim)`` and, where
    they carry them, the queries' log-sum-exps ``lse`` ``(layers, batch, q_heads, window)``, whose slices the layers
    hold as their own tensors; ``held`` is where each layer's views start in memory, to see that the layers still
    hold them (a compaction outside static mode would replace them)."""

    positions: torch.Tensor
    scores: torch.Tensor | None
    held: tuple[tuple[int, ...], ...]
    keys: torch.Tensor | None = None
    queries: torch.Tensor | None = None
    lse: torch.Tensor | None = None

    @classmethod
    def of(cls, layers: list[HeapLayer], received_at_once: bool = False) -> LayerStack | None:
        """Stack the layers' positions and scores and hand each layer its views, or ``None`` where the layers differ
        (a layer type that holds more than dense slots, another capacity, another device, a layer not allocated,
        accumulated attention in some layers only). Their keys are stacked too where every layer remembers a window
        of queries, and where the layers accumulate attention and ``received_at_once`` says that what each slot
        received in a step is computed for every layer at once (:func:`kvlab.attention.flex.settle_received`)."""
        if not _dense(layers):
            return None
        held = [layer.held_positions() for layer in layers]
        kept_scores = _alike(held, [layer.scores for layer in layers])
        if kept_scores is None:
            return None
        positions = torch.stack(held)
        scores = torch.stack(kept_scores) if kept_scores else None
        queries = _stacked_queries(layers)
        keys = _stacked_keys(layers) if queries is not None or (received_at_once and scores is not None) else None
        lse = _stacked_lse(layers) if queries is not None else None
        for index, layer in enumerate(layers):
            layer.positions = positions[index]
            if scores is not None:
                layer.scores = scores[index]
            if queries is not None:
                layer.recent_queries = queries[index]
            if lse is not None:
                layer.recent_query_lse = lse[index]
        stack = cls(positions, scores, (), keys, queries, lse)
        return dataclasses.replace(stack, held=tuple(stack._views(layer) for layer in layers))

    def holds(self, layers: list[HeapLayer]) -> bool:
        """Whether every layer still holds its views of the stack."""
        return len(layers) == len(self.held) and all(
            self._views(layer) == held for layer, held in zip(layers, self.held)
        )

    def _views(self, layer: HeapLayer) -> tuple[int, ...]:
        """Where the layer's tensors that the stack holds start in memory (-1 for one the layer has not)."""
        stacked = [layer.positions]
        if self.scores is not None:
            stacked.append(layer.scores)
        if self.keys is not None:
            stacked.append(layer.keys)
        if self.queries is not None:
            stacked.append(layer.recent_queries)
        if self.lse is not None:
            stacked.append(layer.recent_query_lse)
        return tuple(-1 if tensor is None else tensor.data_ptr() for tensor in stacked)

    def flat(self, tensor: torch.Tensor) -> torch.Tensor:
        """A stacked tensor with its layers folded into the batch: ``(layers x batch, kv_heads, capacity)``."""
        return tensor.flatten(0, 1)

    def as_layer(self, layers: list[HeapLayer]) -> HeapLayer:
        """All layers as one layer whose sequences are every layer's (``layers x batch``): the stacked positions
        and scores, and where they are stacked the keys, remembered queries and their log-sum-exps. A window's
        attention is each layer's own, over its own keys: the eviction scores every layer's window first
        (:func:`kvlab.attention.observe.stacked_window_attention`)."""
        first = layers[0]
        return HeapLayer(
            planned=first.planned,
            keys=None if self.keys is None else self.flat(self.keys),
            positions=self.flat(self.positions),
            scores=None if self.scores is None else self.flat(self.scores),
            recent_queries=None if self.queries is None else self.flat(self.queries),
            recent_query_positions=first.recent_query_positions,
            recent_query_lse=None if self.lse is None else self.flat(self.lse),
            used=first.used,
            live=first.live,
            ordered=False,
            shape=first.shape,
        )

    @staticmethod
    def copied(layers: list[HeapLayer]) -> HeapLayer | None:
        """Every layer's positions and (where attention accumulates them) scores over the slots in use, copied into
        one layer whose sequences are every layer's (``layers x batch``), as :meth:`as_layer` gives them in a static
        step: what an eviction of all layers at once ranks outside static steps (a prefill chunk's, an eager decode
        step's), where each layer then frees its own victims. ``None`` where the layers differ (as :meth:`of`), or
        hold different numbers of slots in use."""
        if not _dense(layers):
            return None
        first = layers[0]
        span = first.used
        if any(layer.used != span for layer in layers):
            return None
        held = [layer.slots(span)[2] for layer in layers]
        kept_scores = _alike(held, [None if layer.scores is None else layer.scores[..., :span] for layer in layers])
        if kept_scores is None:
            return None
        return HeapLayer(
            planned=first.planned,
            positions=torch.cat(held),
            scores=torch.cat(kept_scores) if kept_scores else None,
            used=span,
            live=first.live,
            ordered=False,
            shape=first.shape,
        )


def _dense(layers: list[HeapLayer]) -> bool:
    """Whether there are layers and each holds dense slots only, allocated (a layer type that holds more, frozen
    parts or pages on the host, is never stacked)."""
    return bool(layers) and all(type(layer) is HeapLayer and layer.positions is not None for layer in layers)


def _alike(held: list[torch.Tensor], scores: list[torch.Tensor | None]) -> list[torch.Tensor] | None:
    """The layers' accumulated ``scores`` to stack beside their ``held`` positions (none where no layer keeps them),
    or ``None`` where the layers differ: positions of another shape or on another device, or scores in some layers
    only."""
    if any(positions.shape != held[0].shape or positions.device != held[0].device for positions in held):
        return None
    kept = [layer_scores for layer_scores in scores if layer_scores is not None]
    if kept and len(kept) < len(scores):
        return None
    return kept


def _stacked_queries(layers: list[HeapLayer]) -> torch.Tensor | None:
    """Every layer's remembered queries stacked, where every layer remembers a window of the same shape and holds
    keys of one shape; ``None`` otherwise."""
    shapes = set()
    for layer in layers:
        if layer.recent_queries is None or layer.keys is None:
            return None
        shapes.add((layer.keys.shape, layer.recent_queries.shape))
    if len(shapes) != 1:
        return None
    return torch.stack([layer.recent_queries for layer in layers if layer.recent_queries is not None])


def _stacked_lse(layers: list[HeapLayer]) -> torch.Tensor | None:
    """Every layer's carried log-sum-exps of its remembered queries stacked, where every layer carries them
    (:attr:`~kvlab.cache.layer.HeapLayer.recent_query_lse`); ``None`` otherwise."""
    carried = [layer.recent_query_lse for layer in layers]
    if any(lse is None for lse in carried):
        return None
    return torch.stack([lse for lse in carried if lse is not None])


def _stacked_keys(layers: list[HeapLayer]) -> torch.Tensor | None:
    """Every layer's keys moved into one tensor, each layer's own freed as soon as it is copied (so that the move
    costs one layer's keys at its peak, not every layer's), and each layer given its view; ``None`` where a layer
    holds none or keys of another shape."""
    first = layers[0].keys
    if first is None or any(layer.keys is None or layer.keys.shape != first.shape for layer in layers):
        return None
    stacked = first.new_empty((len(layers), *first.shape))
    for index, layer in enumerate(layers):
        assert layer.keys is not None
        stacked[index].copy_(layer.keys)
        layer.keys = stacked[index]
    return stacked
