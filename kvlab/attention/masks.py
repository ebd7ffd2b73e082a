"""Which keys each query may see, from the tokens' original positions: free slots, causal order and sliding windows
stay right however the heap was evicted, refilled or compacted."""

from __future__ import annotations

import torch

from kvlab.cache.layer import HeapLayer


def allowed_keys(
    key_positions: torch.Tensor, query_positions: torch.Tensor, sliding_window: int | None
) -> torch.Tensor:
    """Which keys each query may attend to, from original positions: ``(..., q, keys)`` booleans.

    A key is visible when its slot holds a token (position 0 or more), it is not in the query's future and, on
    sliding-window layers, it lies fewer than ``sliding_window`` positions back (the convention of transformers'
    sliding-window masks).
    """
    keys = key_positions.unsqueeze(-2).long()
    queries = query_positions.long().unsqueeze(-1)
    allowed = (keys >= 0) & (keys <= queries)
    if sliding_window is not None:
        allowed &= (queries - keys) < sliding_window
    return allowed


def slot_causal_mask(n_queries: int, n_keys: int, device: torch.device) -> torch.Tensor:
    """Mask for queries that are the last ``n_queries`` of ``n_keys`` slots in position order: every earlier slot
    visible, later ones causal."""
    return torch.ones(n_queries, n_keys, dtype=torch.bool, device=device).tril(diagonal=n_keys - n_queries)


def sliding_window_hides(layer: HeapLayer, last_position: int) -> bool:
    """Whether the layer's sliding window can hide some of its cached tokens from a forward up to ``last_position``."""
    window = layer.sliding_window
    return window is not None and last_position >= window


def needs_ordered_mask(layer: HeapLayer, n_queries: int, last_position: int) -> bool:
    """Whether a forward of ``n_queries`` over slots in position order, its queries the last slots, needs a mask
    (:func:`ordered_mask` is not ``None``): decided without building one."""
    return sliding_window_hides(layer, last_position) or n_queries not in (1, layer.used)


def ordered_mask(layer: HeapLayer, query_positions: torch.Tensor, last_position: int) -> torch.Tensor | None:
    """The mask of a forward over slots in position order whose queries are the last slots: ``None`` (everything
    visible, or causal by slot order when the forward has no past), ``(q, keys)`` shared by all heads, or
    ``(batch, kv_heads, q, keys)`` once a sliding window can hide some cached tokens. Decided from host-side
    integers only, so that building it never waits for the GPU."""
    n_queries, n_keys = query_positions.shape[0], layer.used
    if not needs_ordered_mask(layer, n_queries, last_position):
        return None
    if sliding_window_hides(layer, last_position):
        return allowed_keys(layer.slots(n_keys)[2], query_positions, layer.sliding_window)
    return slot_causal_mask(n_queries, n_keys, query_positions.device)
