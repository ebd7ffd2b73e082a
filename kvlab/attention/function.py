"""kvlab's attention function, registered with transformers' ``AttentionInterface``.

Inside a kvlab run it computes each layer's attention over the KV heap with masks built from the tokens' original
positions (free slots, causal order and sliding windows stay right however the heap was evicted, refilled or
compacted), and it observes only what was asked for:

* nothing, over slots in position order with no free slot among them: plain ``scaled_dot_product_attention``
  (causal by slot order), so ``full`` runs at SDPA speed and no L x L mask is ever built;
* one query (decoding) over a heap with free or refilled slots, or in a captured decode step: the query's attention
  written out (q.K^T, masked softmax, .V) per KV head with its query heads as rows, reading the heap in place (no
  key or value is copied per query head); under a sparse reader (Quest, RocketKV) its mask keeps only the tokens
  the reader selected for that query (:mod:`kvlab.cache.sparse`), and the bytes read are counted;
* accumulated attention per slot (H2O), the dashboard's statistics, an observer of the probabilities (KVzip's
  reconstruction), logit soft-capping, or several queries over refilled slots: an exact attention computed in blocks
  of queries, so that at most a block x heap of scores exists at once;
* the last few query vectors, for policies that score the heap by an observation window (SnapKV, PyramidKV, TOVA):
  these are scored later by :func:`window_attention`;
* the running moments of every query before RoPE (:class:`kvlab.cache.heap.QueryMoments`), for policies that model the
  queries still to come (Expected Attention).

Outside a kvlab run (no :class:`ForwardContext` active) it defers to transformers' SDPA attention, so a model loaded
by kvlab still works with plain ``model.generate`` for unpadded inputs.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from kvlab.cache.heap import MOMENTS_SKIP, HeapLayer, KVHeap, QueryMoments, on_device
from kvlab.cache.sparse import ReadCount, SparseRead
from kvlab.models.rope import Rope

ATTN_IMPLEMENTATION = "kvlab"
#: The most (query, key) scores an observed attention block holds at once, in float32: 512 MiB. Larger blocks mean
#: fewer launches (H2O's observation over a long prefill was launch-bound at 2^24).
SCORE_BLOCK_ELEMENTS = 1 << 27


@dataclass
class StatsRequest:
    """What the dashboard asks to observe: sinks are the first ``n_sink`` positions; attention rows are pooled into
    ``n_bins`` bins over original positions ``[0, span)``."""

    n_sink: int = 4
    n_bins: int = 64
    span: int = 1

    def bin_of(self, positions: torch.Tensor) -> torch.Tensor:
        """The bin of each original position (the dashboard draws bins with this same formula)."""
        return (positions.long() * self.n_bins // max(self.span, 1)).clamp_(0, self.n_bins - 1)


@dataclass
class StatsAccumulator:
    """Per-layer sums over the queries of one forward pass, turned into means by :meth:`finish`."""

    request: StatsRequest
    num_layers: int
    entropy: list[torch.Tensor | None] = field(default_factory=list)
    sink_mass: list[torch.Tensor | None] = field(default_factory=list)
    pooled: list[torch.Tensor | None] = field(default_factory=list)
    queries: int = 0

    def __post_init__(self) -> None:
        self.entropy = [None] * self.num_layers
        self.sink_mass = [None] * self.num_layers
        self.pooled = [None] * self.num_layers

    def add(self, layer: int, probs: torch.Tensor, key_positions: torch.Tensor) -> None:
        """Add the statistics of a block of attention rows ``(b, kv_heads, groups, q, keys)``."""
        batch, kv_heads, groups, n_queries, n_keys = probs.shape
        entropy = -(probs * torch.log(probs.clamp_min(1e-30))).sum(-1).sum(-1)
        positions = key_positions.unsqueeze(2).unsqueeze(3)
        sink = (probs * (positions < self.request.n_sink)).sum(-1).sum(-1)
        bins = self.request.bin_of(key_positions)
        per_key = probs.sum(dim=(2, 3))
        pooled = torch.zeros(batch, kv_heads, self.request.n_bins, device=probs.device, dtype=torch.float32)
        pooled.scatter_add_(2, bins.expand(batch, kv_heads, n_keys), per_key.float())
        pooled = pooled.sum(1) / (kv_heads * groups)
        entropy = entropy.reshape(batch, kv_heads * groups).float()
        sink = sink.reshape(batch, kv_heads * groups).float()
        for sums, value in ((self.entropy, entropy), (self.sink_mass, sink), (self.pooled, pooled)):
            earlier = sums[layer]
            sums[layer] = value if earlier is None else earlier + value

    def finish(self, n_queries: int) -> dict[str, Any]:
        """Means over the forward's queries as CPU tensors: entropy and sink mass ``(layers, batch, q_heads)``, pooled
        attention rows ``(layers, batch, bins)``."""

        def stack(values: list[torch.Tensor | None]) -> torch.Tensor:
            return torch.stack([v.cpu() for v in values if v is not None]) / n_queries

        return {"entropy": stack(self.entropy), "sink_mass": stack(self.sink_mass), "pooled": stack(self.pooled)}


#: What observes a forward's attention probabilities block by block (see :attr:`ForwardContext.observe`).
Observer = Callable[[int, torch.Tensor, torch.Tensor], None]


@dataclass
class ForwardContext:
    """What the attention function needs to know during one forward pass of a kvlab run."""

    cache: KVHeap
    query_positions: torch.Tensor
    last_position: int
    stats: StatsAccumulator | None = None
    #: Called with every block of attention probabilities the pass computes: ``(layer_idx, probs, key_positions)``,
    #: ``probs`` ``(batch, kv_heads, groups, queries, keys)`` in float32 and the keys' original positions
    #: ``(batch, kv_heads, keys)``, keys in slot order (KVzip's reconstruction, :mod:`kvlab.engine.reconstruction`).
    observe: Observer | None = None
    #: While decoding under a sparse reader (Quest, RocketKV): its selection, applied to every layer it reads
    #: sparsely, and the count of the bytes attention read (:mod:`kvlab.cache.sparse`).
    reader: SparseRead | None = None
    reads: ReadCount | None = None
    #: Whether the pass decodes a token (what demoted pages it recalls is then counted per decoded token).
    decoding: bool = False
    #: ``query_positions`` by device: copied to each other device a split model's layers run on, once per pass.
    moved_positions: dict[torch.device, torch.Tensor] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self.moved_positions[self.query_positions.device] = self.query_positions

    def positions_on(self, device: torch.device) -> torch.Tensor:
        """The query positions on ``device`` (the layer's, :func:`kvlab.cache.heap.on_device`)."""
        return on_device(self.moved_positions, device)


_CONTEXT: contextvars.ContextVar[ForwardContext | None] = contextvars.ContextVar("kvlab_forward", default=None)


@contextlib.contextmanager
def forward_context(context: ForwardContext) -> Iterator[None]:
    """Make ``context`` visible to the attention function for the duration of one forward pass."""
    token = _CONTEXT.set(context)
    try:
        yield
    finally:
        _CONTEXT.reset(token)


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


def _slot_causal_mask(n_queries: int, n_keys: int, device: torch.device) -> torch.Tensor:
    """Mask for queries that are the last ``n_queries`` of ``n_keys`` slots in position order: every earlier slot
    visible, later ones causal."""
    return torch.ones(n_queries, n_keys, dtype=torch.bool, device=device).tril(diagonal=n_keys - n_queries)


def _ordered_mask(layer: HeapLayer, query_positions: torch.Tensor, last_position: int) -> torch.Tensor | None:
    """The mask of a forward over slots in position order whose queries are the last slots: ``None`` (everything
    visible, or causal by slot order when the forward has no past), ``(q, keys)`` shared by all heads, or
    ``(batch, kv_heads, q, keys)`` once a sliding window can hide some cached tokens. Decided from host-side
    integers only, so that building it never waits for the GPU."""
    n_queries, n_keys = query_positions.shape[0], layer.used
    window = layer.sliding_window
    if window is None or last_position < window:
        if n_queries == 1 or n_queries == n_keys:
            return None
        return _slot_causal_mask(n_queries, n_keys, query_positions.device)
    return allowed_keys(layer.slots(n_keys)[2], query_positions, window)


#: SDPA kernels kvlab lets PyTorch choose from on CUDA. cuDNN's attention is left out: it builds an execution plan
#: for every new key length, and a decoding cache has a new length at every step (measured on an H100 with torch
#: 2.11: the first pass over a decode's shapes ran about 7x slower than flash attention).
CUDA_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


@contextlib.contextmanager
def sdpa_backends(device: torch.device) -> Iterator[None]:
    """The SDPA kernels kvlab allows, set once around a whole forward pass (on CUDA; nothing to choose on a CPU)."""
    if device.type == "cuda":
        with sdpa_kernel(CUDA_SDPA_BACKENDS):
            yield
    else:
        yield


def _sdpa(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None, scaling: float
) -> torch.Tensor:
    """SDPA without expanding the cache when the kernels allow it (no mask, or on the CPU); with no mask and
    several queries it is causal by slot order (the queries are all the slots)."""
    groups = query.shape[1] // key.shape[1]
    if mask is None and query.shape[2] > 1:
        return F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling, enable_gqa=groups > 1)
    if mask is not None and mask.dim() == 4:
        mask = mask.repeat_interleave(groups, dim=1)
    if groups > 1 and mask is not None and query.device.type == "cuda":
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
        groups = 1
    return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling, enable_gqa=groups > 1)


def _logits(grouped: torch.Tensor, keys_t: torch.Tensor, layer: HeapLayer) -> torch.Tensor:
    """Scaled (and, where the model does it, soft-capped) attention logits in float32, from products taken in the
    model's dtype as transformers' eager attention does."""
    logits = torch.matmul(grouped, keys_t).float().mul_(layer.scaling)  # in place: the block is the largest tensor
    if layer.softcap is not None:
        logits = logits.div_(layer.softcap).tanh_().mul_(layer.softcap)
    return logits


def _decode_attention(
    query: torch.Tensor,
    layer: HeapLayer,
    attended: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    mask: torch.Tensor,
    context: ForwardContext,
    layer_idx: int,
) -> torch.Tensor:
    """One query's attention over the heap, written out per KV head with its query heads as rows: reads K and V
    (``attended``: keys, values, positions) in place, adds the probabilities to the accumulated scores and
    statistics when asked. ``mask`` is ``(batch, kv_heads, 1, keys)``."""
    batch, q_heads, _, head_dim = query.shape
    keys, values, positions = attended
    kv_heads, span = keys.shape[1], keys.shape[2]
    grouped = query.reshape(batch, kv_heads, q_heads // kv_heads, head_dim)
    logits = _logits(grouped, keys.transpose(-1, -2), layer).masked_fill_(~mask, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    output = torch.matmul(probs.to(values.dtype), values)
    if layer.scores is not None:  # the heap's slots come first; recalled demoted tokens have no score there
        held = min(span, layer.span(context.cache.static))
        layer.scores[:, :, :held] += probs[..., :held].sum(dim=2)
    if context.stats is not None:
        context.stats.add(layer_idx, probs.unsqueeze(3), positions)
    if context.observe is not None:
        context.observe(layer_idx, probs.unsqueeze(3), positions)
    return output.reshape(batch, q_heads, 1, head_dim)


def _blocked_attention(
    query: torch.Tensor,
    layer: HeapLayer,
    layer_idx: int,
    attended: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    mask: torch.Tensor | None,
    context: ForwardContext,
    ordered: bool,
    output: bool = True,
) -> torch.Tensor | None:
    """Exact attention in blocks of queries, observing the probabilities on the way.

    As in transformers' eager attention, logits are computed in the model's dtype and the softmax in float32, and
    at most ``SCORE_BLOCK_ELEMENTS`` (query, key) pairs exist at a time. Over slots in position order a block reads
    only the slots its queries can see (the later ones are in their future); otherwise ``mask`` says what each
    query sees. Each block adds its column sums to the layer's accumulated scores (H2O) and, when asked, its
    statistics, and goes to the forward's observer. With ``output=False`` only the observation is made (the output
    comes from SDPA): the probabilities are never multiplied by the values, which halves the work of observing.
    """
    keys, values, positions = attended
    span = keys.shape[2]
    batch, q_heads, n_queries, head_dim = query.shape
    kv_heads = keys.shape[1]
    groups = q_heads // kv_heads
    grouped = query.reshape(batch, kv_heads, groups, n_queries, head_dim)
    keys_t = keys.transpose(-1, -2).unsqueeze(2)
    values_g = values.unsqueeze(2)
    block = max(1, SCORE_BLOCK_ELEMENTS // max(1, batch * q_heads * span))
    past = span - n_queries
    outputs = []
    for start in range(0, n_queries, block):
        stop = min(start + block, n_queries)
        visible = past + stop if ordered else span  # in slot order, the block's later queries are its future
        logits = _logits(grouped[:, :, :, start:stop], keys_t[..., :visible], layer)
        if mask is not None:
            block_mask = mask[..., start:stop, :visible]
            block_mask = block_mask.unsqueeze(2) if block_mask.dim() == 4 else block_mask
        elif n_queries > 1:  # causal by slot order, built per block: no queries x keys mask ever exists whole
            block_mask = _slot_causal_mask(stop - start, visible, query.device)
        else:
            block_mask = None
        if block_mask is not None:
            logits.masked_fill_(~block_mask, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        del logits
        if output:
            outputs.append(torch.matmul(probs.to(values.dtype), values_g[:, :, :, :visible]))
        if layer.scores is not None:  # the heap's slots come first; recalled demoted tokens have no score there
            held = min(visible, layer.span(context.cache.static))
            layer.scores[..., :held] += probs[..., :held].sum(dim=(2, 3))
        if context.stats is not None:
            context.stats.add(layer_idx, probs, positions[..., :visible])
        if context.observe is not None:
            context.observe(layer_idx, probs, positions[..., :visible])
    return torch.cat(outputs, dim=3).reshape(batch, q_heads, n_queries, head_dim) if output else None


def _remember_queries(
    layer: HeapLayer, query: torch.Tensor, query_positions: torch.Tensor, window: int, static: bool
) -> None:
    """Keep the last ``window`` post-RoPE queries of this layer for observation-window policies, as a copy (a view
    would keep a whole prefill's queries alive). In static mode the full window shifts by one in place."""
    if static:
        assert layer.recent_queries is not None and layer.recent_query_positions is not None
        layer.recent_queries[:, :, :-1] = layer.recent_queries[:, :, 1:].clone()
        layer.recent_queries[:, :, -1:] = query
        layer.recent_query_positions[:-1] = layer.recent_query_positions[1:].clone()
        layer.recent_query_positions[-1:] = query_positions
        return
    if layer.recent_queries is None or layer.recent_query_positions is None:
        queries, positions = query, query_positions
    else:
        queries = torch.cat([layer.recent_queries, query], dim=2)
        positions = torch.cat([layer.recent_query_positions, query_positions])
    layer.recent_queries = queries[:, :, -window:].detach().clone()
    layer.recent_query_positions = positions[-window:].clone()


def _add_query_moments(layer: HeapLayer, query: torch.Tensor, query_positions: torch.Tensor, rope: Rope) -> None:
    """Add this forward's queries, rotated back to before RoPE, to the layer's running moments; queries at the first
    :data:`~kvlab.cache.heap.MOMENTS_SKIP` positions are weighed zero (no data-dependent shape: a captured step can
    add)."""
    if layer.moments is None:
        batch, q_heads, _, head_dim = query.shape
        layer.moments = QueryMoments.empty(batch, q_heads, head_dim, query.device)
    weights = (query_positions >= MOMENTS_SKIP).float()
    layer.moments.add(rope.rotate(query, -query_positions), weights)


def _sparse_selection(
    context: ForwardContext,
    query: torch.Tensor,
    attended: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    live: torch.Tensor,
    ordered: bool,
) -> torch.Tensor:
    """The keys a sparse reader lets one decoded query read, among the ``live`` ones (``(batch, kv_heads, 1,
    keys)``), its bytes read added to the run's count on the device."""
    assert context.reader is not None and context.reads is not None
    keys, _, positions = attended
    selected, metadata = context.reader.select(query, keys, positions, live.squeeze(2), ordered)
    context.reads.add_selection(selected, metadata, keys)
    return selected.unsqueeze(2)


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
    context = _CONTEXT.get()
    if context is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    if kwargs.get("s_aux") is not None:
        raise NotImplementedError("Learned attention sinks (s_aux) are not supported by kvlab's attention.")
    layer_idx: int = cast(int, module.layer_idx)
    cache = context.cache
    layer = cache.layers[layer_idx]
    layer.sliding_window = kwargs.get("sliding_window")
    layer.scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
    layer.softcap = kwargs.get("softcap")
    query_positions = context.positions_on(query.device)
    if cache.query_window:
        _remember_queries(layer, query, query_positions, cache.query_window, cache.static)
    if cache.query_moments:
        assert cache.rope is not None
        _add_query_moments(layer, query, query_positions, cache.rope)
    span = layer.span(cache.static)
    ordered = layer.ordered and layer.dead == 0 and not cache.static and layer.frozen is None
    observed = (
        layer.scores is not None
        or context.stats is not None
        or context.observe is not None
        or layer.softcap is not None
    )
    attended = layer.attended(span)
    if cache.demotion is not None:  # demoted pages the queries recall, after the heap's slots
        recalled = cache.demotion.recall(layer_idx, query, context.decoding)
        if recalled is not None:
            attended = (
                torch.cat([attended[0], recalled[0]], dim=2),
                torch.cat([attended[1], recalled[1]], dim=2),
                torch.cat([attended[2], recalled[2]], dim=2),
            )
            ordered = False
    keys, values, positions = attended
    sparse = context.reader is not None and context.reader.reads_sparsely(layer_idx)
    if query.shape[2] == 1 and (observed or not ordered or sparse):  # one pass, reading the heap in place
        live = allowed_keys(positions, query_positions, layer.sliding_window)
        if sparse:
            live = _sparse_selection(context, query, attended, live, ordered)
        decoded = _decode_attention(query, layer, attended, live, context, layer_idx)
        return decoded.transpose(1, 2).contiguous(), None
    mask: torch.Tensor | None
    if ordered:
        mask = _ordered_mask(layer, query_positions, context.last_position)
    else:
        mask = allowed_keys(positions, query_positions, layer.sliding_window)
    # the output must come from the observed pass itself for statistics and soft-capping (which SDPA lacks), and
    # for a sliding window's per-head mask over ordered slots (which SDPA would need copied per query head)
    output: torch.Tensor | None
    if context.stats is not None or layer.softcap is not None or (ordered and mask is not None and mask.dim() == 4):
        output = _blocked_attention(query, layer, layer_idx, attended, mask, context, ordered)
    else:
        output = _sdpa(query, keys, values, mask, layer.scaling)
        if layer.scores is not None or context.observe is not None:  # a pass that never multiplies by the values
            _blocked_attention(query, layer, layer_idx, attended, mask, context, ordered, output=False)
    assert output is not None
    return output.transpose(1, 2).contiguous(), None


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
    logits = _logits(grouped, keys.transpose(-1, -2).unsqueeze(2), layer)
    allowed = allowed_keys(positions, layer.recent_query_positions, layer.sliding_window)
    logits = logits.masked_fill(~allowed.unsqueeze(2), float("-inf"))
    return torch.softmax(logits, dim=-1).nan_to_num(0.0)


def window_attention(layer: HeapLayer, span: int) -> torch.Tensor:
    """Attention of the remembered query window over the first ``span`` slots, summed over the window and over the
    query heads of each KV head: ``(batch, kv_heads, span)`` (zero on free slots). Used by SnapKV, PyramidKV and
    TOVA."""
    return window_probabilities(layer, span).sum(dim=(2, 3))


def register_attention() -> None:
    """Register kvlab's attention function with transformers under the name ``kvlab`` (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, kvlab_attention)
