"""One query's attention over the heap's slots by ``flex_attention``: the ``flex`` backend of static decode steps.

A static step attends over the heap's whole capacity, whatever it holds. Here the slots are cut into blocks of
:data:`BLOCK` and a ``BlockMask`` lists, per sequence, the blocks holding a visible token in some KV head: those
visible in every slot of every head are read without a mask, the others through ``mask_mod`` (one lookup in the
head's visibility of each slot), and empty blocks are never read. The mask's tables are rebuilt on the device at
every step from the slots' positions, with fixed shapes and no host synchronisation, so that the step is captured in
a CUDA graph with them. On CUDA everything here is compiled: flex_attention becomes Triton's split-K decoding kernel
(one KV head's slots read once for all of its query heads) and the tables a few fused kernels; on a CPU PyTorch's
reference implementation gives the same numbers slowly, which is how the tests check the mask and the observation.

What H2O accumulates and what TOVA scores by (the attention each slot received from the query, summed over the query
heads of its KV head) comes from the kernel's log-sum-exp: ``exp(q.k * scale - lse)`` is exactly the probability
the kernel used, so one product of the query with the keys gives it, without a softmax or a second product with the
values, and without TOVA's second pass over the keys at eviction (on CUDA, kvlab's kernel of
:mod:`kvlab.attention.slot_sums` takes that product, reading each key once). Where the layers are stacked with their
keys (:mod:`kvlab.cache.stack`), each layer puts that product off and one product after the pass computes it for
every layer (:func:`settle_received`).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
from torch.nn.attention.flex_attention import AuxRequest, BlockMask, flex_attention

from kvlab.attention.context import PendingReceived
from kvlab.attention.masks import allowed_keys
from kvlab.attention.observe import votes
from kvlab.attention.slot_sums import slot_sums, sums_by_kernel
from kvlab.cache.layer import AttentionShape, HeapLayer
from kvlab.cache.stack import LayerStack
from kvlab.fusion import fused, fuses

#: Slots per block of the block mask: flex_attention's default tile, so that a block is one tile of the kernel.
BLOCK = 128
#: Compute capabilities (Hopper, Blackwell) whose decoding kernel loads its slots through a three-stage pipeline.
PIPELINED = frozenset({(9, 0), (10, 0), (10, 3)})
#: The decoding kernel's options there: PyTorch's own heuristics name three stages for these chips (tiles of 64
#: slots, two warps), but a later branch resets every chip but one to a single stage, which leaves each tile's load
#: waiting on the one before. Measured on an H200 in a captured step over 8 KV heads of 128 (bf16), one stage
#: against three: 69.4 against 56.3 us over 32,832 slots, 203.2 against 151.3 over 131,136, 23.0 against 22.3 over
#: 4,301 (``bench/results/heap_gpu/flex_decode_configs_h200.json``, 24 tile/stage/warp options and 5 splits tried).
PIPELINED_DECODE = {"num_stages": 3}


def flex_compiles() -> bool:
    """Whether flex_attention compiles to a fused kernel here: CUDA with Triton."""
    return fuses("cuda")


def ordered_blocks(chosen: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The count ``(…, query_blocks)`` and the indices ``(…, query_blocks, blocks)`` of the ``chosen`` key blocks of
    each query block (``(…, query_blocks, blocks)`` booleans), chosen ones first in block order, then the others, as
    ``BlockMask`` takes them (``int32``; indices past the count are ignored). A scatter to each block's rank among its
    kind: no sort, a few fused operations once compiled."""
    count = chosen.sum(dim=-1, dtype=torch.int32)
    before = torch.cumsum(chosen.to(torch.int32), dim=-1) - 1
    after = count.unsqueeze(-1) + torch.cumsum((~chosen).to(torch.int32), dim=-1) - 1
    rank = torch.where(chosen, before, after).long()
    blocks = torch.arange(chosen.shape[-1], dtype=torch.int32, device=chosen.device).expand_as(rank)
    indices = torch.empty_like(blocks).scatter_(-1, rank, blocks)
    return count, indices


def ordered_kinds(kinds: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`ordered_blocks` of the partial blocks ``kinds[0]`` and the full blocks ``kinds[1]`` in one call: the
    count and indices of each, as ``BlockMask.from_kv_blocks`` takes them. Outside a compiled step each operation is
    a kernel launched from the host, once per layer and chunk, so one call over both halves them."""
    count, indices = ordered_blocks(kinds)
    return count[0], indices[0], count[1], indices[1]


def block_tables(
    positions: torch.Tensor, query_position: torch.Tensor, sliding_window: int | None
) -> tuple[torch.Tensor, ...]:
    """What the block mask of one query at ``query_position`` (``(1,)``) over slots holding ``positions`` (``(batch,
    kv_heads, slots)``) is made of: each slot's visibility padded to whole blocks, then the count and indices of the
    partly visible blocks and of the blocks visible in every slot of every head. One list for all heads, since
    flex_attention's decoding kernel (one KV head's slots read once for all of its query heads) takes no per-head
    lists: given them it falls back to a kernel over 128-row query tiles, 5-10x slower on one query."""
    batch, kv_heads, slots = positions.shape
    visible = allowed_keys(positions, query_position, sliding_window).squeeze(-2)
    padded = visible.new_zeros(batch, kv_heads, -(-slots // BLOCK) * BLOCK)
    padded[..., :slots] = visible
    blocks = padded.view(batch, kv_heads, -1, BLOCK)
    full = blocks.all(dim=-1).all(dim=1, keepdim=True).unsqueeze(-2)  # one query block
    partial = blocks.any(dim=-1).any(dim=1, keepdim=True).unsqueeze(-2) & ~full
    return (padded, *ordered_kinds(torch.stack((partial, full))))


def stacked_block_tables(stacked_positions: torch.Tensor, query_position: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """:func:`block_tables` of every layer at once, from the positions of stacked layers (``(layers, batch, kv_heads,
    slots)``, :mod:`kvlab.cache.stack`) with no sliding window: each table's rows are every layer's sequences in
    turn (:func:`layer_tables` takes one layer's), so that a static step builds its masks in one fused call instead of
    one per layer."""
    device = stacked_positions.device.type
    tables: tuple[torch.Tensor, ...] = fused(device, block_tables)(
        stacked_positions.flatten(0, 1), query_position, None
    )
    return tables


def layer_tables(tables: tuple[torch.Tensor, ...], layer_idx: int, batch: int) -> tuple[torch.Tensor, ...]:
    """One layer's rows of :func:`stacked_block_tables`' tables: exactly its own :func:`block_tables`."""
    return tuple(table[layer_idx * batch : (layer_idx + 1) * batch] for table in tables)


def block_mask(tables: tuple[torch.Tensor, ...], slots: int, groups: int) -> BlockMask:
    """The ``BlockMask`` of :func:`block_tables`' tables over ``slots`` keys, ``groups`` query heads per KV head: full
    blocks read without a mask, partial ones through ``mask_mod`` (each head's own visibility of each slot), the
    others never read."""
    padded, partial_count, partial_indices, full_count, full_indices = tables

    def mask_mod(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return padded[b, h // groups, k]

    return BlockMask.from_kv_blocks(
        partial_count,
        partial_indices,
        full_count,
        full_indices,
        BLOCK_SIZE=BLOCK,
        mask_mod=mask_mod,
        seq_lengths=(1, slots),
        compute_q_blocks=False,
    )


def accumulated_attention(
    query: torch.Tensor,
    query_position: torch.Tensor,
    keys: torch.Tensor,
    positions: torch.Tensor,
    lse: torch.Tensor,
    shape: AttentionShape,
    scores: torch.Tensor,
) -> torch.Tensor:
    """What each slot received from one query at ``query_position`` (:func:`kvlab.attention.observe.votes` of a
    window of one, normalised by the kernel's log-sum-exp ``lse``), added in place to a layer's accumulated
    ``scores`` (``(batch, kv_heads, slots)``, H2O) in the same fused kernel: one launch per layer, not two."""
    received = votes(query, query_position, keys, positions, shape, lse)
    scores.add_(received)
    return received


def decode_kernel(query: torch.Tensor) -> dict[str, int] | None:
    """The options of flex_attention's decoding kernel for ``query`` (:data:`PIPELINED_DECODE` on the chips of
    :data:`PIPELINED` but for float32 heads wider than 128, which PyTorch keeps at one stage for lack of shared
    memory), or none for flex's own defaults."""
    if query.device.type != "cuda" or (query.dtype == torch.float32 and query.shape[-1] > 128):
        return None
    return PIPELINED_DECODE if torch.cuda.get_device_capability(query.device) in PIPELINED else None


def softcap_mod(cap: float) -> Callable[..., torch.Tensor]:
    """Logit soft-capping (Gemma-2) as a score modification."""

    def score_mod(score: torch.Tensor, b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        return torch.tanh(score / cap) * cap

    return score_mod


def flex_decode_attention(
    query: torch.Tensor,
    layer: HeapLayer,
    keys: torch.Tensor,
    values: torch.Tensor,
    positions: torch.Tensor,
    query_position: torch.Tensor,
    tables: tuple[torch.Tensor, ...] | None = None,
    kernel_options: dict[str, int] | None = None,
    later: list[PendingReceived] | None = None,
    oldest: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query's attention ``(batch, q_heads, 1, head_dim)`` at ``query_position`` over ``keys`` and ``values``
    (``(batch, kv_heads, slots, head_dim)``, read in place) holding the tokens at ``positions``, through the block
    mask of ``tables`` (built here from ``positions`` where not given); the attention each slot received is added to
    the layer's accumulated scores where it keeps them, and kept as its last-query attention where it remembers a
    window of one query, and the kernel's log-sum-exp is carried at ``oldest`` (the place the query took in the
    remembered window, :meth:`kvlab.cache.layer.HeapLayer.remember_lse`) where the layer carries its window's; or,
    where ``later`` is given, that is put off to :func:`settle_received`, for every layer at once.
    ``kernel_options`` are flex_attention's (its decoding kernel's tile, stages, warps and splits),
    :func:`decode_kernel`'s where not given."""
    device, slots = query.device.type, keys.shape[2]
    groups = query.shape[1] // keys.shape[1]
    shape = layer.attention
    if tables is None:
        tables = fused(device, block_tables)(positions, query_position, shape.sliding_window)
    score_mod = None if shape.softcap is None else softcap_mod(shape.softcap)
    observed = _receives(layer) or layer.recent_query_lse is not None
    with warnings.catch_warnings():  # the CPU's reference path warns that it is not compiled: it is meant not to be
        warnings.filterwarnings("ignore", message=".*flex_attention.*without torch.compile.*")
        found = fused(device, flex_attention)(
            query,
            keys,
            values,
            score_mod=score_mod,
            block_mask=block_mask(tables, slots, groups),
            scale=shape.scaling,
            enable_gqa=groups > 1,
            return_aux=AuxRequest(lse=True) if observed else None,
            kernel_options=decode_kernel(query) if kernel_options is None else kernel_options,
        )
    if not observed:
        return found
    output, aux = found
    if later is not None:
        later.append(PendingReceived(layer, query, aux.lse))
        return output
    if layer.recent_query_lse is not None:
        assert oldest is not None, "a carried log-sum-exp goes where the query went in the window"
        layer.remember_lse(aux.lse, oldest)
    if _receives(layer):
        _note_received(layer, _received(query, query_position, keys, positions, aux.lse, shape, layer.scores))
    return output


def settle_received(
    stack: LayerStack, pending: list[PendingReceived], query_position: torch.Tensor, oldest: torch.Tensor | None
) -> None:
    """What each slot received from the pass's query at ``query_position`` in every layer (``pending``, in layer
    order: every layer of the ``stack`` put it off), from the stacked keys and positions: one reading of every
    layer's keys in one kernel, where each layer would run its own (at 32k tokens, 32 layers' small kernels cost more
    than the second reading of the keys they do). Added to the stacked accumulated scores (H2O), or noted as each
    layer's last-query attention (TOVA). Where the layers remember a window of queries, every layer's query joins
    its window at ``oldest`` (in place of the oldest one) in one copy, and where they carry their windows'
    log-sum-exps, every layer's kernel's is written there too."""
    assert stack.keys is not None and len(pending) == stack.keys.shape[0]
    first = pending[0].layer
    batch = stack.keys.shape[1]
    if stack.queries is not None:
        assert oldest is not None, "a static step's query replaces the window's oldest"
        stack.queries.index_copy_(3, oldest, torch.stack([entry.query for entry in pending]))
    if stack.lse is not None:
        assert oldest is not None
        stack.lse.index_copy_(3, oldest, torch.stack([entry.lse for entry in pending]).float())
    if not _receives(first):
        pending.clear()
        return
    query = torch.cat([entry.query for entry in pending])
    lse = torch.cat([entry.lse for entry in pending])
    scores = None if stack.scores is None else stack.flat(stack.scores)
    positions = stack.flat(stack.positions)
    received = _received(query, query_position, stack.flat(stack.keys), positions, lse, first.attention, scores)
    for entry, part in zip(pending, received.split(batch)):
        _note_received(entry.layer, part)
    pending.clear()


def _receives(layer: HeapLayer) -> bool:
    """Whether the layer keeps what each slot received from the pass's query: accumulated (H2O), or as the votes of
    a window of one query (TOVA)."""
    return layer.scores is not None or _one_query_window(layer)


def _one_query_window(layer: HeapLayer) -> bool:
    """Whether the layer remembers a window of one query (TOVA): the pass's own, whose attention its kernel gives."""
    return layer.recent_queries is not None and layer.recent_queries.shape[2] == 1


def _received(
    query: torch.Tensor,
    query_position: torch.Tensor,
    keys: torch.Tensor,
    positions: torch.Tensor,
    lse: torch.Tensor,
    shape: AttentionShape,
    scores: torch.Tensor | None,
) -> torch.Tensor:
    """What each slot received from ``query`` (:func:`kvlab.attention.observe.votes` with the kernel's log-sum-exp
    ``lse``; on CUDA, the kernel of :func:`kvlab.attention.slot_sums.slot_sums`), added to the accumulated ``scores``
    where the layers keep them (a static step's: they span the slots read)."""
    device = query.device.type
    if sums_by_kernel(device):
        return slot_sums(query, query_position, keys, positions, shape, lse, scores)
    if scores is not None:
        return fused(device, accumulated_attention)(query, query_position, keys, positions, lse, shape, scores)
    return fused(device, votes)(query, query_position, keys, positions, shape, lse)


def _note_received(layer: HeapLayer, received: torch.Tensor) -> None:
    """Keep what a layer's slots received as its last-query attention where it remembers a window of one query."""
    if _one_query_window(layer):
        layer.note_received(received)
