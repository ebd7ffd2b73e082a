"""The attention of an observation window (the last queries a layer remembers, :meth:`kvlab.cache.layer.HeapLayer.
remember_queries`) over the cache, which observation-window policies (SnapKV, PyramidKV, TOVA, CAKE's allocation)
score by, computed as the model's own attention computes it (on CUDA, summed per slot by the kernels of
:mod:`kvlab.attention.slot_sums`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch

from kvlab.attention.kernels import scaled
from kvlab.attention.masks import allowed_keys
from kvlab.attention.slot_sums import log_sum_exps as slot_lse
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
    lse: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of ``queries`` (``(batch, q_heads, window, head_dim)`` at ``query_positions``) over ``keys``
    holding the tokens at ``positions``, ``(batch, kv_heads, groups, window, span)``: one product per KV head with
    its query heads' window as columns and the slots as rows, so that its output is aligned whatever the span (an
    odd span's rows of slots sent cuBLAS to a kernel four times slower on an H200), and never the keys broadcast over
    the query heads (which copies them). ``lse`` ``(batch, q_heads, window)``, where carried
    (:attr:`~kvlab.cache.layer.HeapLayer.recent_query_lse`), normalises the logits in place of a softmax."""
    batch, _, window, _ = queries.shape
    kv_heads = keys.shape[1]
    logits = _masked_logits(queries, query_positions, keys, positions, shape)
    if lse is None:
        return torch.softmax(logits, dim=-1).nan_to_num(0.0)
    return (logits - lse.view(batch, kv_heads, -1, window, 1)).exp()


def _masked_logits(*operands: Any) -> torch.Tensor:
    """The logits of :func:`probabilities` of the same operands (but ``lse``), ``(batch, kv_heads, groups, window,
    span)``, ``-inf`` where a query may not see a slot."""
    queries, query_positions, keys, positions, shape = operands
    batch, q_heads, window, head_dim = queries.shape
    kv_heads, span = keys.shape[1], keys.shape[2]
    rows = queries.reshape(batch, kv_heads, q_heads // kv_heads * window, head_dim)
    products = torch.matmul(keys, rows.transpose(-1, -2)).transpose(-1, -2)
    logits = scaled(products, shape).view(batch, kv_heads, -1, window, span)
    allowed = allowed_keys(positions, query_positions, shape.sliding_window)
    return logits.masked_fill(~allowed.unsqueeze(2), float("-inf"))


def votes(*operands: Any) -> torch.Tensor:
    """:func:`probabilities` of the same operands summed over the window and each KV head's query heads,
    ``(batch, kv_heads, span)``: a pure function, so that a static step fuses it (:func:`kvlab.fusion.fused`) into
    the product and a few kernels."""
    return probabilities(*operands).sum(dim=(2, 3))


def window_lse(*operands: Any) -> torch.Tensor:
    """Each query head's log-sum-exp over the slots it may see, ``(batch, q_heads, window)``, of the operands of
    :func:`probabilities` (but ``lse``)."""
    batch, q_heads, window, _ = operands[0].shape
    logits = _masked_logits(*operands)
    return logits.logsumexp(dim=-1).reshape(batch, q_heads, window)


#: The share of a query's attention above which the victims' removal from its log-sum-exp is not trusted: taking
#: most of a sum out of its logarithm leaves few exact digits (a head that attends almost only to a token that its
#: KV head's other queries do not vote for, at a small budget, lost every digit), so the query's log-sum-exp is
#: marked stale (NaN) and computed again over the slots left before the next votes (:func:`refresh_lse`).
UNTRUSTED_SHARE = 0.5


def carry_window_lse(layers: Sequence[HeapLayer]) -> None:
    """Start carrying each remembered query's log-sum-exp over the slots held (:attr:`~kvlab.cache.layer.HeapLayer.
    recent_query_lse`), computed here over each layer's slots in use: what static steps under the ``flex`` backend
    do where a window of several queries votes, so that each step's votes are one pass over the keys. Every layer or
    none (an eviction of all layers at once takes the victims out of every layer's or of none): none where a layer
    has a sliding window, since such a layer evicts first what the newest query no longer sees, which may hold most
    of an older query's attention at every step (:data:`UNTRUSTED_SHARE`)."""
    if any(layer.sliding_window is not None for layer in layers):
        return
    for layer in layers:
        assert layer.recent_queries is not None and layer.recent_query_positions is not None
        keys, _, positions = layer.slots(layer.used)
        compute = slot_lse if sums_by_kernel(keys.device.type) else window_lse
        layer.recent_query_lse = compute(
            layer.recent_queries, layer.recent_query_positions, keys, positions, layer.attention
        )


def refresh_lse(
    lse: torch.Tensor,
    queries: torch.Tensor,
    query_positions: torch.Tensor,
    keys: torch.Tensor,
    positions: torch.Tensor,
    shape: AttentionShape,
) -> None:
    """Compute again, in place, the carried log-sum-exps ``lse`` ``(batch, q_heads, window)`` marked stale (NaN) by
    :func:`lse_without`, over the slots held now; on CUDA a kernel whose programs leave at once where their rows are
    all current, so that a step with none stale costs a launch."""
    if sums_by_kernel(keys.device.type):
        fresh = slot_lse(queries, query_positions, keys, positions, shape, stale=lse)
    else:
        fresh = torch.where(lse.isnan(), window_lse(queries, query_positions, keys, positions, shape), lse)
    lse.copy_(fresh)


def lse_without(
    queries: torch.Tensor,
    query_positions: torch.Tensor,
    keys: torch.Tensor,
    positions: torch.Tensor,
    victims: torch.Tensor,
    lse: torch.Tensor,
    shape: AttentionShape,
) -> torch.Tensor:
    """The log-sum-exps ``lse`` ``(batch, q_heads, window)`` of ``queries`` with the slots ``victims`` ``(batch,
    kv_heads, k)`` taken out: ``lse + log(1 - p)``, ``p`` the share of each query's attention those slots held, or
    NaN (stale, :func:`refresh_lse`) where that share is over :data:`UNTRUSTED_SHARE`. A pure function, fused in a
    static step."""
    batch, q_heads, window, head_dim = queries.shape
    gone_keys = keys.gather(2, victims.unsqueeze(-1).expand(-1, -1, -1, head_dim))
    gone_positions = positions.gather(2, victims)
    share = probabilities(queries, query_positions, gone_keys, gone_positions, shape, lse).sum(dim=-1)
    share = share.reshape(batch, q_heads, window)
    return (lse + torch.log1p(-share.clamp(max=UNTRUSTED_SHARE))).masked_fill(share > UNTRUSTED_SHARE, float("nan"))


def forget_victims(layer: HeapLayer, victims: torch.Tensor) -> None:
    """Take the slots an eviction is about to free (``victims``, ``(batch, kv_heads, k)``, still holding their
    tokens) out of the log-sum-exps the layer carries for its remembered queries (a layer, or every layer stacked as
    one, :meth:`kvlab.cache.stack.LayerStack.as_layer`)."""
    assert layer.recent_queries is not None and layer.recent_query_positions is not None
    assert layer.keys is not None and layer.positions is not None and layer.recent_query_lse is not None
    without = fused(layer.device.type, lse_without)
    layer.recent_query_lse.copy_(
        without(
            layer.recent_queries,
            layer.recent_query_positions,
            layer.keys,
            layer.positions,
            victims,
            layer.recent_query_lse,
            layer.attention,
        )
    )


def victims_forgotten(layer: HeapLayer) -> Callable[[torch.Tensor], None] | None:
    """What an eviction shows its victims to before freeing them, where the layer carries its window's
    log-sum-exps (:func:`forget_victims`); ``None`` where it carries none."""
    return None if layer.recent_query_lse is None else partial(forget_victims, layer)


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
    lse = layer.recent_query_lse
    if lse is not None:
        refresh_lse(lse, layer.recent_queries, layer.recent_query_positions, keys, positions, layer.attention)
    return _summed(keys.device.type, static)(
        layer.recent_queries, layer.recent_query_positions, keys, positions, layer.attention, lse
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
    queries = stack.flat(stack.queries)
    lse = None if stack.lse is None else stack.flat(stack.lse)
    if lse is not None:
        refresh_lse(lse, queries, first.recent_query_positions, keys, positions, first.attention)
    summed = _summed(keys.device.type, static=True)
    return summed(queries, first.recent_query_positions, keys, positions, first.attention, lse)


def _summed(device_type: str, static: bool) -> Callable[..., torch.Tensor]:
    """What computes :func:`votes` on a ``device_type`` device: the kernels of :mod:`kvlab.attention.slot_sums`
    where they run (each key read twice, once where the log-sum-exps are carried; no logits written), else PyTorch's
    product, fused in a ``static`` step."""
    if sums_by_kernel(device_type):
        return slot_sums
    return fused(device_type, votes) if static else votes
