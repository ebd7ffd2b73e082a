"""The attention of an observation window (the last queries a layer remembers, :meth:`kvlab.cache.layer.HeapLayer.
remember_queries`) over the cache, which observation-window policies (SnapKV, PyramidKV, TOVA, CAKE's allocation)
score by, computed as the model's own attention computes it."""

from __future__ import annotations

import torch

from kvlab.attention.kernels import scaled_logits
from kvlab.attention.masks import allowed_keys
from kvlab.cache.layer import HeapLayer


def window_probabilities(layer: HeapLayer, span: int) -> torch.Tensor:
    """Attention of each remembered query of the window over the first ``span`` slots, ``(batch, kv_heads, groups,
    window, span)`` (zero on free slots and on slots a query may not see). Logits are taken as the model's own
    attention takes them (products in its dtype, softmax in float32)."""
    assert layer.recent_queries is not None and layer.recent_query_positions is not None
    queries = layer.recent_queries
    batch, q_heads, window, head_dim = queries.shape
    keys, _, positions = layer.slots(span)
    kv_heads = keys.shape[1]
    grouped = queries.reshape(batch, kv_heads, q_heads // kv_heads, window, head_dim)
    logits = scaled_logits(grouped, keys.transpose(-1, -2).unsqueeze(2), layer.attention)
    allowed = allowed_keys(positions, layer.recent_query_positions, layer.sliding_window)
    logits = logits.masked_fill(~allowed.unsqueeze(2), float("-inf"))
    return torch.softmax(logits, dim=-1).nan_to_num(0.0)


def window_attention(layer: HeapLayer, span: int) -> torch.Tensor:
    """Attention of the remembered query window over the first ``span`` slots, summed over the window and over the
    query heads of each KV head: ``(batch, kv_heads, span)`` (zero on free slots). Used by SnapKV, PyramidKV and
    TOVA. A window of one query is the query of the pass just made: where its kernel gave what each slot received
    (:attr:`~kvlab.cache.layer.HeapLayer.received`), that is the answer, without a second pass over the keys."""
    assert layer.recent_queries is not None
    if layer.received is not None and layer.recent_queries.shape[2] == 1:
        return layer.received[..., :span]
    return window_probabilities(layer, span).sum(dim=(2, 3))
