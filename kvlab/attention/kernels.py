"""The ways kvlab computes one layer's attention over the heap's slots.

* SDPA (``scaled_dot_product_attention``) over slots in position order or with a mask, when nothing is observed: the
  full cache runs at SDPA speed and no L x L mask is ever built;
* one query's attention written out per KV head with its query heads as rows, reading the heap in place (no key or
  value is copied per query head): decoding over free or refilled slots, inside a captured step, under a sparse
  reader, or when the step's probabilities are observed;
* exact attention computed in blocks of queries, so that at most a block x heap of scores exists at once: when
  accumulated scores, statistics, an observer of the probabilities or logit soft-capping are needed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from kvlab.attention.context import ForwardContext
from kvlab.attention.masks import slot_causal_mask
from kvlab.cache.layer import AttentionShape, HeapLayer, Slots

#: The most (query, key) scores an observed attention block holds at once, in float32: 512 MiB. Larger blocks mean
#: fewer launches (H2O's observation over a long prefill was launch-bound at 2^24).
SCORE_BLOCK_ELEMENTS = 1 << 27


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


def sdpa(
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


def scaled_logits(grouped: torch.Tensor, keys_t: torch.Tensor, shape: AttentionShape) -> torch.Tensor:
    """Scaled (and, where the model does it, soft-capped) attention logits in float32, from products taken in the
    model's dtype as transformers' eager attention does."""
    return scaled(torch.matmul(grouped, keys_t), shape)


def scaled(products: torch.Tensor, shape: AttentionShape) -> torch.Tensor:
    """Products of queries and keys taken in the model's dtype, as float32 logits scaled (and soft-capped) as the
    model's attention does."""
    logits = products.float().mul_(shape.scaling)  # in place: the block is the largest tensor
    if shape.softcap is not None:
        logits = logits.div_(shape.softcap).tanh_().mul_(shape.softcap)
    return logits


def decode_attention(
    query: torch.Tensor,
    layer: HeapLayer,
    attended: Slots,
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
    logits = scaled_logits(grouped, keys.transpose(-1, -2), layer.attention).masked_fill_(~mask, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    output = torch.matmul(probs.to(values.dtype), values)
    if layer.scores is not None:  # the heap's slots come first; recalled demoted tokens have no score there
        layer.accumulate(probs[..., : min(span, layer.span(context.cache.static))].sum(dim=2))
    if context.stats is not None:
        context.stats.add(layer_idx, probs.unsqueeze(3), positions, mask.unsqueeze(2))
    if context.observe is not None:
        context.observe(layer_idx, probs.unsqueeze(3), positions)
    return output.reshape(batch, q_heads, 1, head_dim)


def blocked_attention(
    query: torch.Tensor,
    layer: HeapLayer,
    layer_idx: int,
    attended: Slots,
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
        logits = scaled_logits(grouped[:, :, :, start:stop], keys_t[..., :visible], layer.attention)
        if mask is not None:
            block_mask = mask[..., start:stop, :visible]
            block_mask = block_mask.unsqueeze(2) if block_mask.dim() == 4 else block_mask
        elif n_queries > 1:  # causal by slot order, built per block: no queries x keys mask ever exists whole
            block_mask = slot_causal_mask(stop - start, visible, query.device)
        else:
            block_mask = None
        if block_mask is not None:
            logits.masked_fill_(~block_mask, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        del logits
        if output:
            outputs.append(torch.matmul(probs.to(values.dtype), values_g[:, :, :, :visible]))
        if layer.scores is not None:  # the heap's slots come first; recalled demoted tokens have no score there
            layer.accumulate(probs[..., : min(visible, layer.span(context.cache.static))].sum(dim=(2, 3)))
        if context.stats is not None:
            context.stats.add(layer_idx, probs, positions[..., :visible], block_mask)
        if context.observe is not None:
            context.observe(layer_idx, probs, positions[..., :visible])
    return torch.cat(outputs, dim=3).reshape(batch, q_heads, n_queries, head_dim) if output else None
