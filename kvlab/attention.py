"""kvlab's attention function, registered with transformers' ``AttentionInterface``.

Inside a kvlab run it computes each layer's attention over the budgeted cache with masks built from the tokens'
original positions (causal order and sliding windows stay right however the cache was compacted), and it observes
only what was asked for:

* nothing: plain ``scaled_dot_product_attention``, so ``full`` runs at SDPA speed;
* accumulated attention per cached token (H2O), the dashboard's statistics, or logit soft-capping: an exact
  attention computed in blocks of queries, so that at most ``block x cache`` scores exist at once and never an
  N x N matrix for the whole context;
* the last few query vectors, for policies that score the cache by an observation window (SnapKV, PyramidKV,
  TOVA): these are scored later by :func:`window_attention`.

Outside a kvlab run (no :class:`ForwardContext` active) it defers to transformers' SDPA attention, so a model loaded
by kvlab still works with plain ``model.generate`` for unpadded inputs.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from kvlab.cache import BudgetedCache, LayerCache

ATTN_IMPLEMENTATION = "kvlab"
SCORE_BLOCK_ELEMENTS = 1 << 24


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
        self.entropy[layer] = entropy if self.entropy[layer] is None else self.entropy[layer] + entropy
        self.sink_mass[layer] = sink if self.sink_mass[layer] is None else self.sink_mass[layer] + sink
        self.pooled[layer] = pooled if self.pooled[layer] is None else self.pooled[layer] + pooled

    def finish(self, n_queries: int) -> dict[str, Any]:
        """Means over the forward's queries as CPU tensors: entropy and sink mass ``(layers, batch, q_heads)``, pooled
        attention rows ``(layers, batch, bins)``."""
        def stack(values: list[torch.Tensor | None]) -> torch.Tensor:
            return torch.stack([v for v in values if v is not None]).cpu() / n_queries

        return {"entropy": stack(self.entropy), "sink_mass": stack(self.sink_mass), "pooled": stack(self.pooled)}


@dataclass
class ForwardContext:
    """What the attention function needs to know during one forward pass of a kvlab run."""

    cache: BudgetedCache
    query_positions: torch.Tensor
    last_position: int
    stats: StatsAccumulator | None = None


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

    A key is visible when it is not in the query's future and, on sliding-window layers, when it lies fewer than
    ``sliding_window`` positions back (the convention of transformers' sliding-window masks).
    """
    keys = key_positions.unsqueeze(-2).long()
    queries = query_positions.long().unsqueeze(-1)
    allowed = keys <= queries
    if sliding_window is not None:
        allowed &= (queries - keys) < sliding_window
    return allowed


def _slot_causal_mask(n_queries: int, n_keys: int, device: torch.device) -> torch.Tensor:
    """Mask for a forward whose queries are the last ``n_queries`` slots: every past slot visible, new slots causal."""
    return torch.ones(n_queries, n_keys, dtype=torch.bool, device=device).tril(diagonal=n_keys - n_queries)


def _layer_mask(layer: LayerCache, query_positions: torch.Tensor, last_position: int) -> torch.Tensor | None:
    """The mask for this forward in KV-head form: ``None`` (everything visible), ``(q, keys)`` shared by all heads,
    or ``(batch, kv_heads, q, keys)`` once a sliding window can hide some cached tokens. Decided from host-side
    integers only, so that building it never waits for the GPU."""
    n_queries, n_keys = query_positions.shape[0], layer.length
    window = layer.sliding_window
    if window is None or last_position < window:
        if n_queries == 1:
            return None
        return _slot_causal_mask(n_queries, n_keys, query_positions.device)
    return allowed_keys(layer.positions, query_positions, window)


#: SDPA kernels kvlab lets PyTorch choose from on CUDA. cuDNN's attention is left out: it builds an execution plan
#: for every new key length, and a decoding cache has a new length at every step (measured on an H100 with torch
#: 2.11: the first pass over a decode's shapes ran about 7x slower than flash attention).
CUDA_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def _sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
          scaling: float, no_past: bool) -> torch.Tensor:
    """SDPA without expanding the cache when the kernels allow it (no mask, or on the CPU)."""
    if query.device.type == "cuda":
        with sdpa_kernel(CUDA_SDPA_BACKENDS):
            return _sdpa_call(query, key, value, mask, scaling, no_past)
    return _sdpa_call(query, key, value, mask, scaling, no_past)


def _sdpa_call(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
               scaling: float, no_past: bool) -> torch.Tensor:
    groups = query.shape[1] // key.shape[1]
    if no_past and mask is not None and mask.dim() == 2:
        return F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling,
                                              enable_gqa=groups > 1)
    if mask is not None and mask.dim() == 4:
        mask = mask.repeat_interleave(groups, dim=1)
    if groups > 1 and mask is not None and query.device.type == "cuda":
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
        groups = 1
    return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling, enable_gqa=groups > 1)


def _blocked_attention(
    query: torch.Tensor,
    layer: LayerCache,
    layer_idx: int,
    mask: torch.Tensor | None,
    context: ForwardContext,
) -> torch.Tensor:
    """Exact attention in blocks of queries, observing the probabilities on the way.

    As in transformers' eager attention, logits are computed in the model's dtype and the softmax in float32, and
    at most ``SCORE_BLOCK_ELEMENTS`` (query, key) pairs exist at a time. Each block adds its column sums to the
    layer's accumulated scores (H2O) and, when asked, its statistics.
    """
    keys, values = layer.keys, layer.values
    batch, q_heads, n_queries, head_dim = query.shape
    kv_heads, n_keys = keys.shape[1], keys.shape[2]
    groups = q_heads // kv_heads
    grouped = query.reshape(batch, kv_heads, groups, n_queries, head_dim)
    keys_t = keys.transpose(-1, -2).unsqueeze(2)
    values_g = values.unsqueeze(2)
    block = max(1, SCORE_BLOCK_ELEMENTS // max(1, batch * q_heads * n_keys))
    past = n_keys - n_queries
    outputs = []
    for start in range(0, n_queries, block):
        stop = min(start + block, n_queries)
        visible = past + stop  # the block's queries are new slots: later slots are in their future
        logits = torch.matmul(grouped[:, :, :, start:stop], keys_t[..., :visible]).float() * layer.scaling
        if layer.softcap is not None:
            logits = torch.tanh(logits / layer.softcap) * layer.softcap
        if mask is not None:
            block_mask = mask[..., start:stop, :visible]
            block_mask = block_mask.unsqueeze(2) if block_mask.dim() == 4 else block_mask
            logits = logits.masked_fill(~block_mask, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        outputs.append(torch.matmul(probs.to(values.dtype), values_g[:, :, :, :visible]))
        if layer.scores is not None:
            layer.scores[..., :visible] += probs.sum(dim=(2, 3))
        if context.stats is not None:
            context.stats.add(layer_idx, probs, layer.positions[..., :visible])
    return torch.cat(outputs, dim=3).reshape(batch, q_heads, n_queries, head_dim)


def _remember_queries(layer: LayerCache, query: torch.Tensor, query_positions: torch.Tensor, window: int) -> None:
    """Keep the last ``window`` post-RoPE queries of this layer for observation-window policies."""
    if layer.recent_queries is None:
        queries, positions = query, query_positions
    else:
        queries = torch.cat([layer.recent_queries, query], dim=2)
        positions = torch.cat([layer.recent_query_positions, query_positions])
    layer.recent_queries = queries[:, :, -window:].detach()
    layer.recent_query_positions = positions[-window:]


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

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    if kwargs.get("s_aux") is not None:
        raise NotImplementedError("Learned attention sinks (s_aux) are not supported by kvlab's attention.")
    layer_idx = module.layer_idx
    cache = context.cache
    layer = cache.layers[layer_idx]
    layer.sliding_window = kwargs.get("sliding_window")
    layer.scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
    layer.softcap = kwargs.get("softcap")
    query_positions = context.query_positions
    if cache.query_window:
        _remember_queries(layer, query, query_positions, cache.query_window)
    mask = _layer_mask(layer, query_positions, context.last_position)
    observe = layer.scores is not None or context.stats is not None or layer.softcap is not None
    if observe or (mask is not None and mask.dim() == 4):
        output = _blocked_attention(query, layer, layer_idx, mask, context)
    else:
        no_past = layer.length == query.shape[2]
        output = _sdpa(query, layer.keys, layer.values, mask, layer.scaling, no_past)
    return output.transpose(1, 2).contiguous(), None


def window_attention(layer: LayerCache) -> torch.Tensor:
    """Attention of the remembered query window over the cached keys, summed over the window and over the query
    heads of each KV head: ``(batch, kv_heads, slots)``. Used by SnapKV, PyramidKV and TOVA."""
    assert layer.recent_queries is not None and layer.keys is not None
    queries = layer.recent_queries
    batch, q_heads, window, head_dim = queries.shape
    kv_heads = layer.keys.shape[1]
    grouped = queries.reshape(batch, kv_heads, q_heads // kv_heads, window, head_dim).float()
    logits = torch.matmul(grouped, layer.keys.transpose(-1, -2).unsqueeze(2).float()) * layer.scaling
    if layer.softcap is not None:
        logits = torch.tanh(logits / layer.softcap) * layer.softcap
    allowed = allowed_keys(layer.positions, layer.recent_query_positions, layer.sliding_window)
    logits = logits.masked_fill(~allowed.unsqueeze(2), float("-inf"))
    return torch.softmax(logits, dim=-1).sum(dim=(2, 3))


def register_attention() -> None:
    """Register kvlab's attention function with transformers under the name ``kvlab`` (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, kvlab_attention)
