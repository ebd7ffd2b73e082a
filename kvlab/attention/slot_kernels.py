"""The Triton kernels of :mod:`kvlab.attention.slot_sums` (what each slot received from a window of queries): a
module of their own, which fails to import without Triton, because Triton resolves the functions a kernel calls among
its module's globals, so the kernels and their helpers are defined at its top level."""

import os

import triton
import triton.language as tl

#: Whether the kernels below were defined for Triton's interpreter (which reads the switch as it defines them: the
#: tests set it before anything imports Triton).
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


#: ``log2(e)``, which turns natural logits into base-2 ones (the chips' exponential is base 2), and its inverse.
LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def _logits(a, b, scale, softcap, HAS_SOFTCAP: tl.constexpr, WIDE: tl.constexpr):
    """Scaled logits of ``a``'s rows with ``b``'s (queries with keys, or keys with queries) in float32, rounded to the
    inputs' dtype first, as PyTorch's product in that dtype rounds them, and soft-capped if asked; in base 2 where
    ``scale`` and ``softcap`` are given times ``log2(e)`` (``c log2(e) tanh(x / c)`` of ``x log2(e)`` is the capped
    logit times ``log2(e)``), as the kernels below take them. ``WIDE`` takes the products in float32 by IEEE rules,
    for float32 inputs (which TF32 would round) and under Triton's interpreter (which multiplies bfloat16 blocks
    wrongly): the exact products of the same values, summed in float32 as the tensor cores sum them."""
    if WIDE:
        products = tl.dot(a.to(tl.float32), tl.trans(b.to(tl.float32)), input_precision="ieee")
    else:
        products = tl.dot(a, tl.trans(b))
    logits = products.to(a.dtype).to(tl.float32) * scale
    if HAS_SOFTCAP:
        logits = softcap * (2.0 * tl.sigmoid(2.0 * logits / softcap) - 1.0)  # tanh
    return logits


@triton.jit
def _rows(
    Q, s_qb, s_qh, s_qw, QPOS, b, kv_head, first, WINDOW, ROWS, HEAD_DIM, D: tl.constexpr, BLOCK_ROWS: tl.constexpr
):
    """A block of rows of the window: their queries ``(BLOCK_ROWS, D)``, positions, and where they exist."""
    row = first + tl.arange(0, BLOCK_ROWS)
    exists = row < ROWS
    groups = ROWS // WINDOW
    head = kv_head * groups + row // WINDOW
    step = row % WINDOW
    dims = tl.arange(0, D)
    q = tl.load(
        Q + b * s_qb + head[:, None] * s_qh + step[:, None] * s_qw + dims[None, :],
        mask=exists[:, None] & (dims[None, :] < HEAD_DIM),
        other=0.0,
    )
    query_position = tl.load(QPOS + step, mask=exists, other=-1).to(tl.int32)
    return q, query_position, exists, head, step


@triton.jit
def _slots(
    K, s_kb, s_kh, s_ks, P, s_pb, s_ph, s_ps, b, kv_head, first, SLOTS, HEAD_DIM, D: tl.constexpr, BLOCK: tl.constexpr
):
    """A block of slots: their keys ``(BLOCK, D)`` and positions (-1 from ``SLOTS`` on, the end of the slots or of
    a program's part of them)."""
    slot = first + tl.arange(0, BLOCK)
    inside = slot < SLOTS
    dims = tl.arange(0, D)
    k = tl.load(
        K + b * s_kb + kv_head * s_kh + slot[:, None] * s_ks + dims[None, :],
        mask=inside[:, None] & (dims[None, :] < HEAD_DIM),
        other=0.0,
    )
    position = tl.load(P + b * s_pb + kv_head * s_ph + slot * s_ps, mask=inside, other=-1).to(tl.int32)
    return k, position, slot, inside


@triton.jit
def _allowed(query_position, position, exists, sliding_window, HAS_WINDOW: tl.constexpr):
    """Which slots each row may see (:func:`kvlab.attention.masks.allowed_keys`), from the rows' and the slots'
    positions and the rows' existence broadcast against each other (32-bit: positions past two billion tokens are
    not kept)."""
    allowed = (position >= 0) & (position <= query_position) & exists
    if HAS_WINDOW:
        allowed = allowed & ((query_position - position) < sliding_window)
    return allowed


@triton.jit
def lse_kernel(
    Q, s_qb, s_qh, s_qw, QPOS, K, s_kb, s_kh, s_ks, P, s_pb, s_ph, s_ps,
    KV_HEADS, SLOTS, WINDOW, ROWS, scale, softcap, sliding_window, HEAD_DIM,
    HAS_SOFTCAP: tl.constexpr, HAS_WINDOW: tl.constexpr, D: tl.constexpr, WIDE: tl.constexpr,
    PARTS, s_lb, s_lh, s_lw, SPLIT, GIVEN, s_gb, s_gh, s_gw,
    BLOCK_ROWS: tl.constexpr, BLOCK_SLOTS: tl.constexpr, STALE_ONLY: tl.constexpr,
):  # fmt: skip
    """Each row's log-sum-exp over the slots it may see in the program's ``SPLIT`` slots (the third axis of the grid
    says which), online over blocks of slots in base 2 (``scale`` and ``softcap`` times ``log2(e)``), given back in
    base e (-inf where it sees none): one part of ``PARTS``' last axis. Where ``STALE_ONLY``, a program none of whose
    rows' ``GIVEN`` log-sum-exps is stale (NaN) leaves at once, writing nothing."""
    b = (tl.program_id(0) // KV_HEADS).to(tl.int64)  # 64-bit offsets: stacked layers pass 2**31 elements
    kv_head = (tl.program_id(0) % KV_HEADS).to(tl.int64)
    q, query_position, exists, head, step = _rows(
        Q, s_qb, s_qh, s_qw, QPOS, b, kv_head, tl.program_id(1) * BLOCK_ROWS, WINDOW, ROWS, HEAD_DIM, D, BLOCK_ROWS
    )
    if STALE_ONLY:
        given = tl.load(GIVEN + b * s_gb + head * s_gh + step * s_gw, mask=exists, other=0.0)
        if tl.sum((given != given).to(tl.int32)) == 0:  # NaN is the one value unequal to itself
            return
    highest = tl.full((BLOCK_ROWS,), float("-inf"), tl.float32)
    total = tl.zeros((BLOCK_ROWS,), tl.float32)
    start = tl.program_id(2) * SPLIT
    end = tl.minimum(start + SPLIT, SLOTS)  # the next part's slots are its own, however the blocks fall
    for first in range(start, end, BLOCK_SLOTS):
        k, position, _, _ = _slots(
            K, s_kb, s_kh, s_ks, P, s_pb, s_ph, s_ps, b, kv_head, first, end, HEAD_DIM, D, BLOCK_SLOTS
        )
        logits = _logits(q, k, scale, softcap, HAS_SOFTCAP, WIDE)
        allowed = _allowed(query_position[:, None], position[None, :], exists[:, None], sliding_window, HAS_WINDOW)
        logits = tl.where(allowed, logits, float("-inf"))
        new_highest = tl.maximum(highest, tl.max(logits, axis=1))
        shift = tl.where(new_highest == float("-inf"), 0.0, new_highest)
        total = total * tl.exp2(highest - shift) + tl.sum(tl.exp2(logits - shift[:, None]), axis=1)
        highest = new_highest
    lse = (tl.where(highest == float("-inf"), 0.0, highest) + tl.log2(total)) * LN2
    tl.store(PARTS + b * s_lb + head * s_lh + step * s_lw + tl.program_id(2), lse, mask=exists)


@triton.jit
def sums_kernel(
    Q, s_qb, s_qh, s_qw, QPOS, K, s_kb, s_kh, s_ks, P, s_pb, s_ph, s_ps,
    KV_HEADS, SLOTS, WINDOW, ROWS, scale, softcap, sliding_window, HEAD_DIM,
    HAS_SOFTCAP: tl.constexpr, HAS_WINDOW: tl.constexpr, D: tl.constexpr, WIDE: tl.constexpr,
    LSE, s_lb, s_lh, s_lw, OUT, s_ob, TARGET, s_tb, s_th, s_ts, SPLIT,
    ACCUMULATE: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_SLOTS: tl.constexpr, STAGES: tl.constexpr,
):  # fmt: skip
    """The program's ``SPLIT`` slots (the grid's third axis says which), block by block: ``exp(logit - lse)``
    summed over the program's block of rows (the second axis) that may see them, written to its part of ``OUT``
    and, where ``ACCUMULATE``, added to ``TARGET``. The rows' queries and log-sum-exps are loaded once, the next
    blocks' keys while a block is summed (``STAGES``); a block whose slots every row sees (all but the window's own
    tokens, for a window over a long context) is summed without the mask."""
    b = (tl.program_id(0) // KV_HEADS).to(tl.int64)  # 64-bit offsets: stacked layers pass 2**31 elements
    kv_head = (tl.program_id(0) % KV_HEADS).to(tl.int64)
    q, query_position, exists, head, step = _rows(
        Q, s_qb, s_qh, s_qw, QPOS, b, kv_head, tl.program_id(1) * BLOCK_ROWS, WINDOW, ROWS, HEAD_DIM, D, BLOCK_ROWS
    )
    # rows that do not exist sum exp2(0 - inf) = 0, with no mask
    lse = tl.load(LSE + b * s_lb + head * s_lh + step * s_lw, mask=exists, other=float("inf")) * LOG2E
    earliest = tl.min(tl.where(exists, query_position, 2147483647))
    out = OUT + tl.program_id(1) * s_ob + (b * KV_HEADS + kv_head) * SLOTS
    start = tl.program_id(2) * SPLIT
    end = tl.minimum(start + SPLIT, SLOTS)
    for first in tl.range(start, end, BLOCK_SLOTS, num_stages=STAGES):
        k, position, slot, inside = _slots(
            K, s_kb, s_kh, s_ks, P, s_pb, s_ph, s_ps, b, kv_head, first, end, HEAD_DIM, D, BLOCK_SLOTS
        )
        p = tl.exp2(_logits(k, q, scale, softcap, HAS_SOFTCAP, WIDE) - lse[None, :])  # slots x rows
        if (tl.max(position) > earliest) | HAS_WINDOW:  # some row may not see some slot
            allowed = _allowed(query_position[None, :], position[:, None], exists[None, :], sliding_window, HAS_WINDOW)
            p = tl.where(allowed, p, 0.0)
        else:
            p = tl.where(position[:, None] >= 0, p, 0.0)
        received = tl.sum(p, axis=1)
        tl.store(out + slot, received, mask=inside)
        if ACCUMULATE:
            at = TARGET + b * s_tb + kv_head * s_th + slot * s_ts
            tl.store(at, tl.load(at, mask=inside, other=0.0) + received, mask=inside)
