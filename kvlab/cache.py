"""The budgeted KV cache: physical per-layer K/V tensors that really shrink when tokens are evicted.

Each layer holds keys and values as ``(batch, kv_heads, tokens, head_dim)``: one entry per KV head, never expanded
to the query heads (GQA-native). Next to them it keeps, per (sequence, KV head, slot), the original position of the
token in that slot, so that masks, RoPE and the dashboard always know which token survived; and, for policies that
need it, the attention each slot has accumulated.

Slots are always in increasing position order (new tokens are appended, eviction keeps a sorted subset), and the
last ``n_new`` slots of a layer are the tokens of the forward pass in flight. Eviction gathers the survivors into
new tensors, so the memory of the evicted tokens is returned to the allocator: the bytes reported by
:meth:`BudgetedCache.kv_bytes` are those of the tensors actually held.

The class implements the part of the transformers ``Cache`` interface that model forwards call (``update`` and
``get_seq_length``); it deliberately does not inherit from ``transformers.Cache`` so that transformers builds no
attention masks of its own for it: kvlab's attention function builds masks from the stored positions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class LayerCache:
    """One layer's cached tokens and what kvlab knows about them.

    ``recent_queries`` keeps the last few post-RoPE query vectors (``(batch, q_heads, w, head_dim)``) with their
    positions, for policies that score the cache by the attention of an observation window (SnapKV, TOVA).
    ``sliding_window``, ``scaling`` and ``softcap`` are recorded from the model's own attention call so that
    scores computed outside the forward pass use exactly the model's attention.
    """

    keys: torch.Tensor | None = None
    values: torch.Tensor | None = None
    positions: torch.Tensor | None = None
    scores: torch.Tensor | None = None
    recent_queries: torch.Tensor | None = None
    recent_query_positions: torch.Tensor | None = None
    n_new: int = 0
    sliding_window: int | None = None
    scaling: float = 1.0
    softcap: float | None = None

    @property
    def length(self) -> int:
        """Slots held per (sequence, KV head)."""
        return 0 if self.keys is None else self.keys.shape[2]

    def nbytes(self) -> int:
        """Bytes of the K and V tensors held."""
        if self.keys is None or self.values is None:
            return 0
        return self.keys.numel() * self.keys.element_size() + self.values.numel() * self.values.element_size()

    def aux_nbytes(self) -> int:
        """Bytes of kvlab's bookkeeping for this layer (positions, scores, remembered queries)."""
        tensors = (self.positions, self.scores, self.recent_queries)
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)


class BudgetedCache:
    """The KV cache of one generation (one or several same-length sequences), layer by layer."""

    def __init__(self, num_layers: int, *, track_scores: bool = False, query_window: int = 0) -> None:
        self.layers = [LayerCache() for _ in range(num_layers)]
        self.track_scores = track_scores
        self.query_window = query_window
        self.seen_tokens = 0
        self._pending_positions: torch.Tensor | None = None

    def begin_forward(self, positions: torch.Tensor) -> None:
        """Declare the original positions ``(q,)`` of the tokens the next forward pass appends (consecutive, starting
        at :attr:`seen_tokens`)."""
        self._pending_positions = positions

    def end_forward(self) -> None:
        """Count the appended tokens as seen (from shapes only: no device synchronisation)."""
        if self._pending_positions is not None:
            self.seen_tokens += self._pending_positions.shape[0]
        self._pending_positions = None

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append the new tokens' K/V to a layer and return everything the layer holds (transformers' contract)."""
        layer = self.layers[layer_idx]
        batch, kv_heads, n_new, _ = key_states.shape
        if self._pending_positions is None:
            start = self.seen_tokens
            new_positions = torch.arange(start, start + n_new, device=key_states.device)
        else:
            new_positions = self._pending_positions
        new_positions = new_positions.to(device=key_states.device, dtype=torch.int32).expand(batch, kv_heads, n_new)
        if layer.keys is None:
            # The model hands over transposed views; store them in the standard layout so that every later cat,
            # gather and attention kernel sees contiguous tensors.
            layer.keys, layer.values = key_states.contiguous(), value_states.contiguous()
            layer.positions = new_positions.contiguous()
        else:
            layer.keys = torch.cat([layer.keys, key_states], dim=2)
            layer.values = torch.cat([layer.values, value_states], dim=2)
            layer.positions = torch.cat([layer.positions, new_positions], dim=2)
        if self.track_scores:
            zeros = torch.zeros(batch, kv_heads, n_new, device=key_states.device, dtype=torch.float32)
            layer.scores = zeros if layer.scores is None else torch.cat([layer.scores, zeros], dim=2)
        layer.n_new = n_new
        return layer.keys, layer.values

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Tokens seen so far (the next token's position), which is what models use to place new tokens."""
        return self.seen_tokens

    def keep(self, layer_idx: int, indices: torch.Tensor) -> None:
        """Keep only the slots ``indices`` (``(batch, kv_heads, k)``, sorted) of a layer; the rest is freed."""
        layer = self.layers[layer_idx]
        assert layer.keys is not None and layer.values is not None and layer.positions is not None
        head_dim = layer.keys.shape[-1]
        gather_index = indices.unsqueeze(-1).expand(-1, -1, -1, head_dim)
        layer.keys = layer.keys.gather(2, gather_index)
        layer.values = layer.values.gather(2, gather_index)
        layer.positions = layer.positions.gather(2, indices)
        if layer.scores is not None:
            layer.scores = layer.scores.gather(2, indices)
        layer.n_new = 0

    def fork(self, *, track_scores: bool, query_window: int) -> "BudgetedCache":
        """An independent cache holding the same tokens, for another policy to compress.

        K, V and positions are shared, not copied: the cache never changes them in place (appending and eviction
        build new tensors), so a fork costs no memory until it diverges. Accumulated scores, which the attention
        function adds to in place, are copied when the new owner tracks them.
        """
        forked = BudgetedCache(len(self.layers), track_scores=track_scores, query_window=query_window)
        forked.seen_tokens = self.seen_tokens
        for source, target in zip(self.layers, forked.layers):
            target.keys, target.values, target.positions = source.keys, source.values, source.positions
            target.sliding_window, target.scaling, target.softcap = source.sliding_window, source.scaling, source.softcap
            if track_scores:
                if source.scores is None:
                    raise ValueError("The shared prefill did not accumulate attention scores.")
                target.scores = source.scores.clone()
            if query_window:
                if source.recent_queries is None or source.recent_queries.shape[2] < min(query_window, self.seen_tokens):
                    raise ValueError("The shared prefill did not remember enough queries.")
                target.recent_queries = source.recent_queries[:, :, -query_window:]
                target.recent_query_positions = source.recent_query_positions[-query_window:]
        return forked

    def stop_observing(self) -> None:
        """Drop accumulated scores and remembered queries and stop collecting them: after prefill mode's one
        compression nothing is scored again, and decoding then runs at plain SDPA speed."""
        self.track_scores = False
        self.query_window = 0
        for layer in self.layers:
            layer.scores = None
            layer.recent_queries = None
            layer.recent_query_positions = None

    def kv_bytes(self) -> int:
        """Bytes of all K and V tensors held, read from the tensors themselves."""
        return sum(layer.nbytes() for layer in self.layers)

    def aux_bytes(self) -> int:
        """Bytes of kvlab's bookkeeping tensors (positions, scores, remembered queries), reported separately."""
        return sum(layer.aux_nbytes() for layer in self.layers)

    def kept_per_layer(self) -> list[int]:
        """Slots held per (sequence, KV head) in each layer."""
        return [layer.length for layer in self.layers]

    def survivor_positions(self) -> list[torch.Tensor]:
        """Original positions of the tokens held, per layer, as ``(batch, kv_heads, slots)`` CPU tensors."""
        return [
            layer.positions.cpu() if layer.positions is not None else torch.empty(0, 0, 0, dtype=torch.int32)
            for layer in self.layers
        ]
