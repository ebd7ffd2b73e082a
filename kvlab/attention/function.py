"""kvlab's attention function, registered with transformers' ``AttentionInterface``.

Inside a kvlab run it computes each layer's attention over the KV heap with masks built from the tokens' original
positions, and it observes only what was asked for: it keeps the last queries of an observation window and the
running moments of every query for the policies that score by them (:mod:`kvlab.attention.observe`), reads the
layer's slots as the layer's type says (:meth:`kvlab.cache.layer.HeapLayer.read`: dense slots, frozen tokens before
them, recalled pages after them), and picks one of the kernels of :mod:`kvlab.attention.kernels`:

* nothing observed, over slots in position order with no free slot among them: SDPA, causal by slot order;
* one query (decoding) over a heap with free or refilled slots, in a captured decode step, under a sparse reader
  (Quest, RocketKV: its selection masked into the query's attention, its bytes counted) or with its probabilities
  observed: the query's attention written out per KV head, or, in a static step under the ``flex`` backend
  (:mod:`kvlab.attention.backends`), ``flex_attention`` over the occupied slot blocks (:mod:`kvlab.attention.flex`);
* statistics, logit soft-capping, or a sliding window's per-head mask over ordered slots: exact attention in blocks
  of queries, which also accumulates H2O's scores and feeds an observer (KVzip's reconstruction); where only the
  scores or the observer need the probabilities, SDPA gives the output and the blocked pass skips the values.

Outside a kvlab run (no :class:`~kvlab.attention.context.ForwardContext` active) it defers to transformers' SDPA
attention, so a model loaded by kvlab still works with plain ``model.generate`` for unpadded inputs.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from kvlab.attention.backends import FLEX
from kvlab.attention.context import ForwardContext, PendingReceived, current
from kvlab.attention.flex import (
    flex_decode_attention,
    layer_tables,
    settle_received,
    stacked_block_tables,
)
from kvlab.attention.flex_chunks import flex_chunk_attention
from kvlab.attention.kernels import blocked_attention, decode_attention, sdpa
from kvlab.attention.masks import allowed_keys, needs_ordered_mask, ordered_mask
from kvlab.cache.layer import AttentionShape, HeapLayer, Slots

#: The name kvlab's attention is registered under with transformers.
ATTN_IMPLEMENTATION = "kvlab"


@torch.compiler.disable  # Python over the heap's state: never traced into compiled layers (kvlab.models.compiled)
def kvlab_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The attention function transformers calls for every layer (``ALL_ATTENTION_FUNCTIONS['kvlab']``)."""
    context = current()
    if context is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    if kwargs.get("s_aux") is not None:
        raise NotImplementedError("Learned attention sinks (s_aux) are not supported by kvlab's attention.")
    layer_idx: int = cast(int, module.layer_idx)
    cache = context.cache
    layer = cache.layers[layer_idx]
    if layer.shape is None:
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        cache.describe(layer_idx, AttentionShape(kwargs.get("sliding_window"), scale, kwargs.get("softcap")))
    query_positions = cache.positions.on(query.device)
    if cache.query_moments:
        assert cache.rope is not None
        layer.add_query_moments(query, query_positions, cache.rope[layer_idx])
    layer.note_received(None)  # what the last pass's query gave the slots is stale once this pass attends
    attended, in_order = layer.read(layer.span(cache.static), cache.static, query, context.decoding)
    output = _attend(query, layer, layer_idx, attended, in_order, query_positions, context)
    if cache.query_window and not _handed_over(context, layer):  # the window is read after the pass, by evictions
        layer.remember_queries(query, query_positions, cache.query_window, cache.oldest_query)
    return output.transpose(1, 2).contiguous(), None


def _attend(
    query: torch.Tensor,
    layer: HeapLayer,
    layer_idx: int,
    attended: Slots,
    in_order: bool,
    query_positions: torch.Tensor,
    context: ForwardContext,
) -> torch.Tensor:
    """The layer's attention output ``(batch, q_heads, queries, head_dim)`` by the kernel that fits (see the
    module's description)."""
    keys, values, positions = attended
    observed = layer.scores is not None or context.stats is not None or context.observe is not None
    sparse = context.reader is not None and context.reader.reads_sparsely(layer_idx)
    if query.shape[2] == 1 and (observed or layer.softcap is not None or not in_order or sparse):
        if not sparse and _flex_decodes(context, layer, keys):
            tables = _stacked_tables(context, layer_idx, query_positions)
            later = _received_later(context) if tables is not None else None
            oldest = context.cache.oldest_query
            return flex_decode_attention(
                query, layer, keys, values, positions, query_positions, tables, later=later, oldest=oldest
            )
        assert layer.recent_query_lse is None, "only the flex backend carries a window's log-sum-exps"
        live = allowed_keys(positions, query_positions, layer.sliding_window)
        if sparse:
            live = _sparse_selection(context, query, attended, live, in_order)
        return decode_attention(query, layer, attended, live, context, layer_idx)
    chunk_by_flex = _flex_chunks(context, layer, keys)
    if in_order:
        last_position = context.cache.positions.last
        if chunk_by_flex and needs_ordered_mask(layer, query_positions.shape[0], last_position):
            return flex_chunk_attention(query, layer, query_positions)  # its block mask, no mask built whole
        mask = ordered_mask(layer, query_positions, last_position)
    elif chunk_by_flex:
        return flex_chunk_attention(query, layer, query_positions)
    else:
        mask = allowed_keys(positions, query_positions, layer.sliding_window)
    # the output must come from the observed pass itself for statistics and soft-capping (which SDPA lacks), and
    # for a sliding window's per-head mask over ordered slots (which SDPA would need copied per query head)
    if context.stats is not None or layer.softcap is not None or (in_order and mask is not None and mask.dim() == 4):
        output = blocked_attention(query, layer, layer_idx, attended, mask, context, in_order)
        assert output is not None
        return output
    output = sdpa(query, keys, values, mask, layer.scaling)
    if layer.scores is not None or context.observe is not None:  # a pass that never multiplies by the values
        blocked_attention(query, layer, layer_idx, attended, mask, context, in_order, output=False)
    return output


def _flex_decodes(context: ForwardContext, layer: HeapLayer, keys: torch.Tensor) -> bool:
    """Whether the ``flex`` backend takes a decoded query: in a static step (fixed shapes: one compiled kernel per
    layer shape, capturable) over the layer's dense slots alone, with nothing observed beyond the accumulated scores
    (statistics and observers read every probability)."""
    return (
        context.attention == FLEX
        and context.cache.static
        and context.stats is None
        and context.observe is None
        and keys.shape[2] == layer.capacity
    )


def _flex_chunks(context: ForwardContext, layer: HeapLayer, keys: torch.Tensor) -> bool:
    """Whether the ``flex`` backend takes a chunk of queries that SDPA would need a mask for: in streaming mode (a
    planned capacity: one compiled kernel for every chunk of a stream), over the layer's dense slots alone, with
    nothing observed beyond the accumulated scores."""
    return (
        context.attention == FLEX
        and context.cache.keep_planned
        and not context.cache.static
        and context.stats is None
        and context.observe is None
        and keys.shape[2] == layer.used
    )


def _stacked_tables(
    context: ForwardContext, layer_idx: int, query_positions: torch.Tensor
) -> tuple[torch.Tensor, ...] | None:
    """A layer's block tables out of every layer's, built at the pass's first layer, where the heap placed the
    pass's token in every stacked layer before the pass (so every layer's positions are final) and no layer has a
    sliding window; ``None`` where each layer builds its own."""
    heap = context.cache
    if heap.placed is None or heap.stack is None or any(layer.sliding_window is not None for layer in heap.layers):
        return None
    if context.block_tables is None:
        context.block_tables = stacked_block_tables(heap.stack.positions, query_positions)
    return layer_tables(context.block_tables, layer_idx, heap.stack.positions.shape[1])


def _received_later(context: ForwardContext) -> list[PendingReceived] | None:
    """Where the layers of a static step put off what each slot received to the end of the pass (every layer
    stacked with its keys, attending alike, its block tables stacked): the list they add to, else ``None``."""
    if context.received_later is not None:
        return context.received_later
    heap = context.cache
    first = heap.layers[0]
    if (
        heap.stack is None
        or heap.stack.keys is None
        or any(layer.attention != first.attention for layer in heap.layers)
    ):
        return None
    context.received_later = []
    return context.received_later


def _handed_over(context: ForwardContext, layer: HeapLayer) -> bool:
    """Whether the layer handed its query to the end of the pass (:func:`~kvlab.attention.flex.settle_received`),
    which puts every layer's into its remembered window in one copy (in place of a copy per layer: 32 launches of
    ~2.6 us on an H200)."""
    pending = context.received_later
    return pending is not None and bool(pending) and pending[-1].layer is layer


def finish_pass(context: ForwardContext) -> None:
    """After a forward pass: what each slot received in every layer that put it off
    (:func:`~kvlab.attention.flex.settle_received`)."""
    heap = context.cache
    if context.received_later and heap.stack is not None:
        device = heap.stack.positions.device
        settle_received(heap.stack, context.received_later, heap.positions.on(device), heap.oldest_query)


def _sparse_selection(
    context: ForwardContext, query: torch.Tensor, attended: Slots, live: torch.Tensor, in_order: bool
) -> torch.Tensor:
    """The keys a sparse reader lets one decoded query read, among the ``live`` ones (``(batch, kv_heads, 1,
    keys)``), its bytes read added to the run's count on the device."""
    assert context.reader is not None and context.reads is not None
    keys, _, positions = attended
    selected, metadata = context.reader.select(query, keys, positions, live.squeeze(2), in_order)
    context.reads.add_selection(selected, metadata, keys)
    return selected.unsqueeze(2)


def install_attention(model: Any) -> None:
    """Switch ``model`` to kvlab's attention (registered with transformers once; nothing to do where the model uses
    it already). Outside a kvlab run the function defers to SDPA, so the model still works with plain
    ``model.generate``."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, kvlab_attention)
    if getattr(model.config, "_attn_implementation", None) != ATTN_IMPLEMENTATION:
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
