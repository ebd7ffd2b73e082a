"""What each slot received from a window of queries, summed over the window and over the query heads of its KV head,
by two Triton kernels that read each key once per pass: the scoring of H2O, TOVA and the window-voting policies on
CUDA.

PyTorch gives these sums only through a product whose output is the whole block of logits (``queries x slots`` per
KV head), written and read again by the softmax and the sums: at 32k tokens, H2O's product of every layer's query
heads with their keys ran at about 0.45 TB/s in cuBLAS (256 products of 4 rows), and SnapKV's window of 32 queries
wrote logits as large as the keys at every decoded token. Here one program loads a block of slots' keys once and
takes their products with every row of the window (the query heads of their KV head times the window's queries), so
the logits never leave the chip (the summing pass: a program loops over its part of the slots with its rows' queries
held, the next blocks' keys loading while one is summed):

- :func:`slot_sums` with the rows' log-sum-exp given (a decoding kernel's, as flex_attention returns it: H2O, TOVA;
  or carried from step to step, :func:`kvlab.attention.observe.carry_window_lse`: SnapKV's window in static steps)
  is one pass over the keys;
- without it, a first pass computes each row's log-sum-exp over the visible slots (online, as flash attention does,
  in parts of :attr:`Tiles.lse_split` slots added up after), and the second sums ``exp(logit - lse)`` per slot:
  two readings of the keys in all, none of the logits.

The logits are rounded to the model's dtype before they are scaled, as PyTorch's product in that dtype rounds them
(:func:`kvlab.attention.kernels.scaled`), so that both paths rank the slots alike. Triton's interpreter runs the same
kernels on a CPU (``TRITON_INTERPRET=1``), which is how the tests check them against the PyTorch path.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from kvlab.cache.layer import AttentionShape
from kvlab.fusion import fuses

kernels: ModuleType | None
try:
    from kvlab.attention import slot_kernels as kernels
except ModuleNotFoundError as missing:  # Triton comes with CUDA builds of torch; without it PyTorch's products serve
    if missing.name != "triton":
        raise
    kernels = None


@dataclass(frozen=True)
class Tiles:
    """How the kernels cut their work. Each program takes a block of rows of the window (at most ``sum_rows`` /
    ``lse_rows``, at least :data:`MIN_SIDE`) and a part of the slots (``sum_split`` / ``lse_split``: the parts'
    sums are combined after, since one program per block of rows looping over every slot left most of an H200
    idle), which it reads in steps of ``sum_slots`` / ``lse_slots``, loading the next ``sum_stages`` - 1 steps' keys
    while it sums one; ``warps`` per program. A summing program that loops so over its part was 1.9x faster on an
    H200 than one per block of 128 slots (``bench/results/heap_gpu/sums_carried_lse_h200.json``); its defaults were
    the fastest of 16 tilings for a window of 32 at 32k and 128k tokens, and tied for one query
    (``sums_tiles_carried_lse_h200.json``, where four warps also took both passes of the window together faster than
    eight); the log-sum-exp pass's tiles were the fastest of 16 before (``sums_tiles_slot_sums_h200.json``)."""

    sum_slots: int = 64
    sum_split: int = 2048
    sum_rows: int = 128
    sum_stages: int = 3
    lse_slots: int = 64
    lse_split: int = 2048
    lse_rows: int = 64
    warps: int = 4


#: The tiles the kernels run with.
TILES = Tiles()
#: The smallest side of a Triton product: a block of rows, or of the head dimension, is never narrower.
MIN_SIDE = 16


def sums_by_kernel(device_type: str) -> bool:
    """Whether :func:`slot_sums` serves a ``device_type`` device: CUDA with Triton (PyTorch's products elsewhere)."""
    return fuses(device_type) and kernels is not None


def slot_sums(
    queries: torch.Tensor,
    query_positions: torch.Tensor,
    keys: torch.Tensor,
    positions: torch.Tensor,
    shape: AttentionShape,
    lse: torch.Tensor | None = None,
    scores: torch.Tensor | None = None,
) -> torch.Tensor:
    """What each slot received ``(batch, kv_heads, slots)`` (float32) from ``queries`` ``(batch, q_heads, window,
    head_dim)`` at ``query_positions`` ``(window,)``, over ``keys`` ``(batch, kv_heads, slots, head_dim)`` holding
    the tokens at ``positions`` ``(batch, kv_heads, slots)``: the softmax probabilities of each query head over the
    slots it may see (:func:`kvlab.attention.masks.allowed_keys`), summed over the window and the query heads of each
    KV head. ``lse`` ``(batch, q_heads, window)`` is each row's log-sum-exp where a kernel already gave it (computed
    here otherwise); the sums are also added in place to ``scores`` (H2O's accumulated attention) where given."""
    assert kernels is not None, "the kernels need Triton"
    batch, kv_heads, slots = positions.shape
    tiles = TILES
    rows, block_rows = _rows(queries, kv_heads, tiles.sum_rows)
    row_blocks = -(-rows // block_rows)
    if lse is None:
        lse = log_sum_exps(queries, query_positions, keys, positions, shape)
    parts = torch.empty(row_blocks, batch, kv_heads, slots, dtype=torch.float32, device=keys.device)
    # the kernel adds to the scores where it sums every row
    target = scores if scores is not None and row_blocks == 1 else parts
    accumulate = target is scores
    kernels.sums_kernel[(batch * kv_heads, row_blocks, -(-slots // tiles.sum_split))](
        *_common(queries, query_positions, keys, positions, shape, rows, kernels.INTERPRETED),
        lse,
        *lse.stride(),
        parts,
        parts.stride(0),
        target,
        *target.stride()[-3:],
        tiles.sum_split,
        ACCUMULATE=accumulate,
        BLOCK_ROWS=block_rows,
        BLOCK_SLOTS=tiles.sum_slots,
        STAGES=tiles.sum_stages,
        num_warps=tiles.warps,
    )
    received = parts[0] if row_blocks == 1 else parts.sum(dim=0)
    if scores is not None and not accumulate:
        scores.add_(received)
    return received


def log_sum_exps(
    queries: torch.Tensor,
    query_positions: torch.Tensor,
    keys: torch.Tensor,
    positions: torch.Tensor,
    shape: AttentionShape,
    stale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Each query head's log-sum-exp over the slots it may see ``(batch, q_heads, window)`` (float32; operands as
    :func:`slot_sums`): the first pass, in parts of :attr:`Tiles.lse_split` slots added up after. Where ``stale``
    (carried log-sum-exps of the same shape) is given, only its NaN rows are computed, its others kept: programs over
    rows none of which is stale leave at once."""
    assert kernels is not None, "the kernels need Triton"
    batch, q_heads, window, _ = queries.shape
    kv_heads, slots = keys.shape[1], keys.shape[2]
    tiles = TILES
    rows, block_rows = _rows(queries, kv_heads, tiles.lse_rows)
    splits = -(-slots // tiles.lse_split)
    parts = torch.empty(batch, q_heads, window, splits, dtype=torch.float32, device=keys.device)
    given = parts[..., 0] if stale is None else stale
    kernels.lse_kernel[(batch * kv_heads, -(-rows // block_rows), splits)](
        *_common(queries, query_positions, keys, positions, shape, rows, kernels.INTERPRETED),
        parts,
        *parts.stride()[:3],
        tiles.lse_split,
        given,
        *given.stride(),
        BLOCK_ROWS=block_rows,
        BLOCK_SLOTS=tiles.lse_slots,
        STALE_ONLY=stale is not None,
        num_warps=tiles.warps,
    )
    computed = parts.logsumexp(dim=-1)
    return computed if stale is None else torch.where(stale.isnan(), computed, stale)


def _rows(queries: torch.Tensor, kv_heads: int, most: int) -> tuple[int, int]:
    """The rows of the window each KV head's slots meet (its query heads times the window's queries), and how many
    a program takes (a power of two, at most ``most``)."""
    _, q_heads, window, _ = queries.shape
    rows = q_heads // kv_heads * window
    return rows, min(most, max(MIN_SIDE, next_power_of_2(rows)))


def next_power_of_2(number: int) -> int:
    """The smallest power of two at least ``number`` (Triton's blocks have power-of-two sides)."""
    return 1 << max(0, number - 1).bit_length()


def _common(
    queries: torch.Tensor,
    query_positions: torch.Tensor,
    keys: torch.Tensor,
    positions: torch.Tensor,
    shape: AttentionShape,
    rows: int,
    interpreted: bool,
) -> tuple[Any, ...]:
    """The arguments both kernels start with: the tensors, their strides, the sizes and the attention's shape, its
    scale and soft-cap in base 2 (as the kernels take logits), and products in float32 for float32 inputs and under
    the interpreter."""
    assert kernels is not None
    head_dim = queries.shape[-1]
    assert queries.stride(-1) == 1 and keys.stride(-1) == 1, "the head dimension must be contiguous"
    return (
        queries,
        *queries.stride()[:3],
        query_positions.to(torch.int64),
        keys,
        *keys.stride()[:3],
        positions,
        *positions.stride(),
        keys.shape[1],
        keys.shape[2],
        queries.shape[2],
        rows,
        shape.scaling * kernels.LOG2E.value,
        (shape.softcap or 0.0) * kernels.LOG2E.value,
        shape.sliding_window or 0,
        head_dim,
        shape.softcap is not None,
        shape.sliding_window is not None,
        next_power_of_2(max(MIN_SIDE, head_dim)),
        queries.dtype == torch.float32 or interpreted,
    )
