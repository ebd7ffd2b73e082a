"""A chunk of queries' attention over the heap's slots by ``flex_attention``: the ``flex`` backend of chunked
prefill (streaming mode, or any pass whose slots are no longer in position order).

SDPA needs a mask there: the queries are the last of a chunk while the cache before them was evicted and refilled,
so the mask is built whole (``queries x slots``), copied per query head, converted to an additive bias, and the keys
and values are copied per query head too, for the memory-efficient kernel (the only one taking a mask). On an H200
with a Llama-3-8B shape that kernel and the mask's copies took two thirds of a StreamingLLM prefill. Here the mask is
a ``mask_mod`` over the slots' original positions, and a ``BlockMask`` lists, per block of 128 queries, the slot blocks
every query of it sees whole (read without a mask), those it sees in part (masked slot by slot) and skips the rest
(free blocks, the future, what a sliding window hides). The keys are read over the layer's whole capacity, so that a
stream's chunks share one compiled kernel.

What H2O accumulates (the attention each slot received from the chunk, summed over its queries and the query heads of
its KV head) comes from the same kernel's log-sum-exp, in a second flex pass with the roles swapped: the slots are the
queries and the chunk's queries (every query head of the KV head) the keys, each score less its query's log-sum-exp,
so that the second pass's log-sum-exp of a slot is the logarithm of the sum of the probabilities it received. No
probability is ever written out, and both passes take the products in float32 from the same operands, so the column
sums are those of the probabilities the output was made with.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import AuxRequest, BlockMask, FlexKernelOptions, flex_attention

from kvlab.attention.flex import BLOCK, ordered_kinds, softcap_mod
from kvlab.cache.layer import FREE, HeapLayer
from kvlab.fusion import fused

#: A chunk's passes always run ``flex_attention``'s main kernel: a chunk shorter than 128 queries (a prompt's last)
#: would otherwise get its decoding kernel, which found no configuration to compile for float32 on an H200
#: (torch 2.11, "NoValidChoicesError" for 60 queries of 8 heads over 2 KV heads).
CHUNK_KERNEL: FlexKernelOptions = {"FORCE_USE_FLEX_ATTENTION": True}
#: Head size of the swapped pass's values: its output is not used, only its log-sum-exp, so its values are the
#: smallest the kernel takes.
SWAPPED_VALUE_DIM = 16


def _padded(tensor: torch.Tensor, length: int, fill: int) -> torch.Tensor:
    """``tensor`` padded along its last dimension to ``length`` with ``fill``."""
    padded = tensor.new_full((*tensor.shape[:-1], length), fill)
    padded[..., : tensor.shape[-1]] = tensor
    return padded


def chunk_tables(
    positions: torch.Tensor, query_positions: torch.Tensor, sliding_window: int | None
) -> tuple[torch.Tensor, ...]:
    """What the block masks of ``query_positions`` (``(queries,)``) over slots holding ``positions`` (``(batch,
    kv_heads, slots)``, :data:`~kvlab.cache.layer.FREE` where empty) are made of: the positions padded to whole blocks
    (free slots and past-the-end queries see nothing), and per batch, query block and slot block whether every
    (query, slot) pair of the two blocks is visible in every head (``full``) or some may be (``some``): ``(batch, 1,
    query_blocks, slot_blocks)`` booleans. Decided from each block's smallest and largest position, so a ``some``
    block may turn out empty slot by slot; a ``full`` one never hides anything. Run eagerly (a dozen small kernels
    per layer and chunk): compiled for a heap of 14,131 slots on an H200 (torch 2.11), its kernel read a misaligned
    address."""
    batch, kv_heads, slots = positions.shape
    queries = query_positions.shape[0]
    keys = _padded(positions.long(), -(-slots // BLOCK) * BLOCK, FREE)
    asked = _padded(query_positions.long(), -(-queries // BLOCK) * BLOCK, FREE)
    key_blocks = keys.view(batch, kv_heads, -1, BLOCK)
    held = key_blocks >= 0
    biggest = torch.iinfo(torch.long).max
    first_key = key_blocks.masked_fill(~held, biggest).amin(dim=(1, 3)).view(batch, 1, 1, -1)
    last_key = key_blocks.amax(dim=(1, 3)).view(batch, 1, 1, -1)
    every_held = held.all(dim=3).all(dim=1).view(batch, 1, 1, -1)
    query_blocks = asked.view(-1, BLOCK)
    real = query_blocks >= 0
    first_query = query_blocks.masked_fill(~real, biggest).amin(dim=1).view(1, 1, -1, 1)
    last_query = query_blocks.amax(dim=1).view(1, 1, -1, 1)
    every_real = real.all(dim=1).view(1, 1, -1, 1)
    full = every_held & every_real & (last_key <= first_query)
    some = (last_key >= 0) & (last_query >= 0) & (first_key <= last_query)
    if sliding_window is not None:
        full &= (last_query - first_key) < sliding_window
        some &= (first_query - last_key) < sliding_window
    return keys, asked, full, some & ~full


def _visible(key: torch.Tensor, query: torch.Tensor, sliding_window: int | None) -> torch.Tensor:
    """Whether a slot holding position ``key`` is visible to a query at ``query`` (as
    :func:`kvlab.attention.masks.allowed_keys`, one pair at a time). Written without in-place operations: inside a
    ``mask_mod`` compiled into flex_attention's kernel, one fails to lower ("Buffers cannot be created while
    lowering a pointwise subgraph"), as it did for every sliding-window model on CUDA."""
    seen = (key >= 0) & (key <= query) & (query >= 0)
    if sliding_window is None:
        return seen
    return seen & ((query - key) < sliding_window)


def chunk_mask(
    tables: tuple[torch.Tensor, ...], lengths: tuple[int, int], groups: int, sliding_window: int | None
) -> BlockMask:
    """The ``BlockMask`` of the chunk's queries (every query head; ``groups`` per KV head) over the slots, of
    ``lengths`` (queries, slots)."""
    keys, asked, full, some = tables

    def mask_mod(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return _visible(keys[b, h // groups, k], asked[q], sliding_window)

    return BlockMask.from_kv_blocks(
        *ordered_kinds(torch.stack((some, full))),
        BLOCK_SIZE=BLOCK,
        mask_mod=mask_mod,
        seq_lengths=lengths,
        compute_q_blocks=False,
    )


def swapped_mask(tables: tuple[torch.Tensor, ...], slots: int, groups: int, sliding_window: int | None) -> BlockMask:
    """The ``BlockMask`` of the swapped pass: the ``slots`` as queries over every query head's queries of their KV
    head as keys (``groups`` copies of the padded chunk, one after the other)."""
    keys, asked, full, some = tables
    padded_queries = asked.shape[0]

    def mask_mod(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return _visible(keys[b, h, q], asked[k % padded_queries], sliding_window)

    kinds = torch.stack((some, full)).transpose(-1, -2)
    return BlockMask.from_kv_blocks(
        *ordered_kinds(kinds.repeat(*(1,) * (kinds.dim() - 1), groups)),
        BLOCK_SIZE=BLOCK,
        mask_mod=mask_mod,
        seq_lengths=(slots, groups * padded_queries),
        compute_q_blocks=False,
    )


def _less_lse(lse: torch.Tensor, inner: Callable[..., torch.Tensor] | None) -> Callable[..., torch.Tensor]:
    """The swapped pass's score modification: the model's own (soft-capping) where it has one, then less the
    log-sum-exp of the query the score is the key of (``lse``: ``(batch, kv_heads, groups x padded queries)``)."""

    def score_mod(score: torch.Tensor, b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        modified = score if inner is None else inner(score, b, h, q, k)
        return modified - lse[b, h, k]

    return score_mod


def received_by_slots(
    query: torch.Tensor,
    keys: torch.Tensor,
    lse: torch.Tensor,
    tables: tuple[torch.Tensor, ...],
    layer: HeapLayer,
) -> torch.Tensor:
    """The attention every slot received from the chunk's ``query`` (``(batch, q_heads, queries, head_dim)``), summed
    over its queries and the query heads of its KV head: ``(batch, kv_heads, slots)``, from the chunk's log-sum-exp
    ``lse`` (``(batch, q_heads, queries)``) by the swapped pass."""
    batch, q_heads, queries, head_dim = query.shape
    kv_heads = keys.shape[1]
    groups = q_heads // kv_heads
    padded = tables[1].shape[0]
    grouped = query.reshape(batch, kv_heads, groups, queries, head_dim)
    grouped_lse = lse.reshape(batch, kv_heads, groups, queries)
    if padded > queries:  # zeros past the chunk's end, which its mask hides
        grouped = F.pad(grouped, (0, 0, 0, padded - queries))
        grouped_lse = F.pad(grouped_lse, (0, padded - queries))
    values = query.new_zeros(batch, kv_heads, groups * padded, SWAPPED_VALUE_DIM)
    shape = layer.attention
    score_mod = _less_lse(
        grouped_lse.reshape(batch, kv_heads, -1), None if shape.softcap is None else softcap_mod(shape.softcap)
    )
    _, aux = fused(query.device.type, flex_attention)(
        keys,
        grouped.reshape(batch, kv_heads, groups * padded, head_dim),
        values,
        score_mod=score_mod,
        block_mask=swapped_mask(tables, keys.shape[2], groups, shape.sliding_window),
        scale=shape.scaling,
        return_aux=AuxRequest(lse=True),
        kernel_options=CHUNK_KERNEL,
    )
    return aux.lse.exp()


def flex_chunk_attention(query: torch.Tensor, layer: HeapLayer, query_positions: torch.Tensor) -> torch.Tensor:
    """The chunk's attention ``(batch, q_heads, queries, head_dim)`` at ``query_positions`` over the layer's slots
    (its whole capacity, read in place); what each slot received is added to the layer's accumulated scores where it
    keeps them (H2O)."""
    device = query.device.type
    keys, values, positions = layer.slots(layer.capacity)
    groups = query.shape[1] // keys.shape[1]
    shape = layer.attention
    tables = chunk_tables(positions, query_positions, shape.sliding_window)  # eager: see chunk_tables
    observed = layer.scores is not None
    with warnings.catch_warnings():  # the CPU's reference path warns that it is not compiled: it is meant not to be
        warnings.filterwarnings("ignore", message=".*flex_attention.*without torch.compile.*")
        found = fused(device, flex_attention)(
            query,
            keys,
            values,
            score_mod=None if shape.softcap is None else softcap_mod(shape.softcap),
            block_mask=chunk_mask(tables, (query.shape[2], keys.shape[2]), groups, shape.sliding_window),
            scale=shape.scaling,
            enable_gqa=groups > 1,
            return_aux=AuxRequest(lse=True) if observed else None,
            kernel_options=CHUNK_KERNEL,
        )
        if not observed:
            return found
        output, aux = found
        layer.accumulate(received_by_slots(query, keys, aux.lse, tables, layer))
    return output
