"""The attention of an observation window (the last queries a layer remembers, :meth:`kvlab.cache.layer.HeapLayer.
remember_queries`) over the cache, which observation-window policies (SnapKV, PyramidKV, TOVA, CAKE's allocation)
score by, computed as the model's own attention computes it (on CUDA, summed per slot by the kernels of
:mod:`kvlab.attention.slot_sums`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from kvlab.attention.kernels import scaled
from kvlab.attention.masks import allowed_keys
from kvlab.attention.slot_sums import slot_sums, sums_by_kernel
from kvlab.cache.layer import AttentionShape, HeapLayer
from kvlab.cache.stack import LayerStack
from kvlab.fusion import fused


def window_probabilities(layer: HeapLayer, span: int) -> torch.Tensor:
    """Attention of each remembered query of the window over the first ``span`` slots, ``(batch, kv_heads, groups,
    window, span)`` (zero on free slots and on slots a query may not see). Logits are taken as the model's own
    attention takes them (products in its dtype, softmax in float32)."""
    assert layer.recent_queries is not None and layer.recent_query_positions is not None
    keys, _, positions = layer.slots(span)
    return probabilities(layer.recent_queries, layer.recent_query_positions, keys, positions, layer.attention)


def probabilities(
    queries: torch.Tensor,
    query_positions: torch.Tensor,
    keys: torch.Tensor,
    positions: torch.Tensor,
    shape: AttentionShape,
) -> torch.Tensor:
    """Attention of ``queries`` (``(batch, q_heads, window, head_dim)`` at ``query_positions``) over ``keys``
    holding the tokens at ``positions``, ``(batch, kv_heads, groups, window, span)``: one product per KV head with
    its query heads' window as columns and the slots as rows, so that its output is aligned whatever the span (an
    odd span's rows of slots sent cuBLAS to a kernel four times slower on an H200), and never the keys broadcast over
    the query heads (which copies them)."""
    batch, q_heads, window, head_dim = queries.shape
    kv_heads, span = keys.shape[1], keys.shape[2]
    rows = queries.reshape(batch, kv_heads, q_heads // kv_heads * window, head_dim)
    products = torch.matmul(keys, rows.transpose(-1, -2)).transpose(-1, -2)
    logits = scaled(products, shape).view(batch, kv_heads, -1, window, span)
    allowed = allowed_keys(positions, query_positions, shape.sliding_window)
    logits = logits.masked_fill(~allowed.unsqueeze(2), float("-inf"))
    return torch.softmax(logits, dim=-1).nan_to_num(0.0)


def votes(*operands: Any) -> torch.Tensor:
    """:func:`probabilities` of the same operands summed over the window and each KV head's query heads,
    ``(batch, kv_heads, span)``: a pure function, so that a static step fuses it (:func:`kvlab.fusion.fused`) into
    the product and a few kernels."""
    return probabilities(*operands).sum(dim=(2, 3))


def window_attention(layer: HeapLayer, span: int, static: bool = False) -> torch.Tensor:
    """Attention of the remembered query window over the first ``span`` slots, summed over the window and over the
    query heads of each KV head: ``(batch, kv_heads, span)`` (zero on free slots). Used by SnapKV, PyramidKV and
    TOVA. A window of one query is the query of the pass just made: where its kernel gave what each slot received
    (:attr:`~kvlab.cache.layer.HeapLayer.received`), that is the answer, without a second pass over the keys. In a
    ``static`` step the scoring is fused for its fixed shapes."""
    assert layer.recent_queries is not None and layer.recent_query_positions is not None
    if layer.received is not None and layer.recent_queries.shape[2] == 1:
        return layer.received[..., :span]
    keys, _, positions = layer.slots(span)
    return _summed(keys.device.type, static)(
        layer.recent_queries, layer.recent_query_positions, keys, positions, layer.attention
    )


def stacked_window_attention(layers: Sequence[HeapLayer], span: int, stack: LayerStack | None) -> torch.Tensor:
    """Every layer's :func:`window_attention`, stacked as the layers' stack folds them into the batch (``(layers x
    batch, kv_heads, span)``, :mod:`kvlab.cache.stack`). In a static step (``stack``, the heap's; ``None`` outside
    static steps) where the stack holds every layer's keys and remembered queries and the layers attend alike, that
    is one fused scoring of all layers at once; a window of one query whose kernel gave what each slot received,
    layers that differ, and passes outside static steps (whose spans change, so nothing is fused for them) are
    scored layer by layer."""
    first = layers[0]
    assert first.recent_queries is not None and first.recent_query_positions is not None
    one_query = first.received is not None and first.recent_queries.shape[2] == 1
    alike = all(layer.attention == first.attention for layer in layers)
    if stack is None or stack.keys is None or stack.queries is None or one_query or not alike:
        return torch.cat([window_attention(layer, span, static=stack is not None) for layer in layers])
    keys = stack.flat(stack.keys)[:, :, :span]
    positions = stack.flat(stack.positions)[..., :span]
    summed = _summed(keys.device.type, static=True)
    return summed(stack.flat(stack.queries), first.recent_query_positions, keys, positions, first.attention)


def _summed(device_type: str, static: bool) -> Callable[..., torch.Tensor]:
    """What computes :func:`votes` on a ``device_type`` device: the kernels of :mod:`kvlab.attention.slot_sums`
    where they run (each key read twice, no logits written), else PyTorch's product, fused in a ``static`` step."""
    if sums_by_kernel(device_type):
        return slot_sums
    return fused(device_type, votes) if static else votes
