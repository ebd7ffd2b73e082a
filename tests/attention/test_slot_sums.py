"""The Triton kernels of :mod:`kvlab.attention.slot_sums` (run by Triton's interpreter where there is no CUDA, as
``tests/conftest.py`` sets), against the PyTorch path they replace on CUDA: what each slot received from a window of
queries (SnapKV's votes, TOVA's last query) and H2O's accumulation from a decoding kernel's log-sum-exp."""

from __future__ import annotations

import pytest
import torch
from tiny_models import prompt, small_policy, tiny_model

from kvlab.attention import flex, observe, slot_sums
from kvlab.attention.masks import allowed_keys
from kvlab.attention.observe import votes
from kvlab.budget import Budget
from kvlab.cache.layer import AttentionShape
from kvlab.engine.generation import generate
from kvlab.engine.spec import RunSpec
from kvlab.models.loading import wrap_model

pytest.importorskip("triton")
# the interpreter computes a row's log-sum-exp over no visible slot as log(0) = -inf, as the kernel means it to, and
# numpy warns about it
pytestmark = pytest.mark.filterwarnings("ignore:divide by zero encountered in log:RuntimeWarning")


def operands(
    batch: int, kv_heads: int, groups: int, window: int, slots: int, head_dim: int, dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Queries at the last ``window`` positions of a context, keys over ``slots`` slots holding a shuffled part of
    it per head, a few slots free (-1)."""
    generator = torch.Generator().manual_seed(seed)
    queries = torch.randn(batch, kv_heads * groups, window, head_dim, generator=generator).to(dtype)
    keys = torch.randn(batch, kv_heads, slots, head_dim, generator=generator).to(dtype)
    context = slots + window
    positions = torch.stack(
        [torch.randperm(context, generator=generator)[:slots] for _ in range(batch * kv_heads)]
    ).view(batch, kv_heads, slots)
    positions[..., ::7] = -1
    query_positions = torch.arange(context - window, context)
    return queries, query_positions, keys, positions


CASES = {
    "votes of a window of 8, bf16": (2, 2, 4, 8, 300, 64, torch.bfloat16, AttentionShape(None, 0.125, None)),
    "one query, float32": (1, 3, 2, 1, 200, 32, torch.float32, AttentionShape(None, 32**-0.5, None)),
    "votes over more slots than one program's block": (
        1,
        1,
        2,
        4,
        1100,
        32,
        torch.float32,
        AttentionShape(None, 0.2, None),
    ),
    "sliding window and softcap": (1, 2, 2, 4, 150, 48, torch.float32, AttentionShape(40, 48**-0.5, 30.0)),
}


def tolerance(dtype: torch.dtype) -> dict[str, float]:
    """How near the sums must be: float32's rounding, or, in bfloat16, one unit in the last place of a logit rounded
    to bfloat16 (both paths round their products so, but they sum the head dimension in different orders)."""
    return dict(rtol=2e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=3e-2, atol=2e-3)


@pytest.mark.parametrize("case", CASES)
def test_votes_match_pytorch(case: str) -> None:
    """Without a log-sum-exp given, the kernels compute each row's and sum the probabilities per slot: equal to
    PyTorch's softmax summed over the window and the query heads, zero where no query may see the slot."""
    batch, kv_heads, groups, window, slots, head_dim, dtype, shape = CASES[case]
    queries, query_positions, keys, positions = operands(batch, kv_heads, groups, window, slots, head_dim, dtype, 1)
    expected = votes(queries, query_positions, keys, positions, shape)
    found = slot_sums.slot_sums(queries, query_positions, keys, positions, shape)
    assert found.shape == expected.shape and found.dtype == torch.float32
    torch.testing.assert_close(found, expected, **tolerance(dtype))
    assert (found[positions < 0] == 0).all()
    # every visible query's probabilities sum to one over the slots, so the sums add up to the rows that see any
    sees = allowed_keys(positions, query_positions, shape.sliding_window).any(dim=-1)
    assert torch.allclose(found.sum(dim=-1), sees.sum(dim=-1).float() * groups, rtol=1e-3)


@pytest.mark.parametrize("window, sum_rows", [(1, 128), (8, 16)], ids=["one block of rows", "two blocks of rows"])
def test_given_log_sum_exp_accumulates(window: int, sum_rows: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """With a decoding kernel's log-sum-exp (here PyTorch's), one pass gives the same sums and adds them in place to
    H2O's accumulated scores over a span of a larger capacity (a strided view): in the kernel where one program
    sums every row of a KV head, after it where the rows take several."""
    monkeypatch.setattr(slot_sums, "TILES", slot_sums.Tiles(sum_rows=sum_rows))
    queries, query_positions, keys, positions = operands(2, 2, 4, window, 260, 64, torch.bfloat16, 2)
    shape = AttentionShape(None, 0.125, None)
    lse = observe.window_lse(queries, query_positions, keys, positions, shape)
    capacity = torch.rand(2, 2, 300)
    before = capacity.clone()
    found = slot_sums.slot_sums(queries, query_positions, keys, positions, shape, lse, capacity[..., :260])
    expected = votes(queries, query_positions, keys, positions, shape)
    torch.testing.assert_close(found, expected, **tolerance(torch.bfloat16))
    torch.testing.assert_close(capacity[..., :260], before[..., :260] + found)
    assert torch.equal(capacity[..., 260:], before[..., 260:])


def test_rows_that_see_nothing_give_nothing() -> None:
    """A query whose every slot is free or in its future (a window query older than every kept token) adds zero,
    not NaN."""
    queries, query_positions, keys, positions = operands(1, 1, 2, 4, 64, 32, torch.float32, 3)
    positions = positions.clamp(min=query_positions[1].item())  # the first query sees no slot
    shape = AttentionShape(None, 32**-0.5, None)
    found = slot_sums.slot_sums(queries, query_positions, keys, positions, shape)
    assert torch.isfinite(found).all()
    expected = votes(queries, query_positions, keys, positions, shape)
    torch.testing.assert_close(found, expected, **tolerance(torch.float32))


@pytest.mark.parametrize("case", ["votes of a window of 8, bf16", "votes over more slots than one program's block"])
def test_sums_in_parts_and_blocks_of_rows_add_up(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Both passes taken in parts of the slots (here of 100 slots, which blocks of 64 and 32 do not divide: each
    part must stop at its own end) and in blocks of 16 rows, added up, give the sums of one part and one block."""
    batch, kv_heads, groups, window, slots, head_dim, dtype, shape = CASES[case]
    queries, query_positions, keys, positions = operands(batch, kv_heads, groups, window, slots, head_dim, dtype, 4)
    whole = slot_sums.slot_sums(queries, query_positions, keys, positions, shape)
    tiles = slot_sums.Tiles(lse_split=100, lse_slots=64, lse_rows=16, sum_split=100, sum_slots=32, sum_rows=16)
    monkeypatch.setattr(slot_sums, "TILES", tiles)
    in_parts = slot_sums.slot_sums(queries, query_positions, keys, positions, shape)
    torch.testing.assert_close(in_parts, whole, **tolerance(torch.float32))
    torch.testing.assert_close(in_parts, votes(queries, query_positions, keys, positions, shape), **tolerance(dtype))


@pytest.mark.parametrize("number, power", [(1, 1), (4, 4), (5, 8), (128, 128), (129, 256)])
def test_next_power_of_2(number: int, power: int) -> None:
    """Triton's blocks have power-of-two sides: the one just large enough."""
    assert slot_sums.next_power_of_2(number) == power


@pytest.mark.parametrize(
    "policy, budget",
    [("h2o", 14), ("tova", 14), ("snapkv", 14), ("snapkv", 5)],
    ids=["h2o", "tova", "snapkv", "snapkv, a budget of 5"],
)
def test_runs_scored_by_the_kernels_keep_what_pytorchs_products_keep(
    policy: str, budget: int, monkeypatch: pytest.MonkeyPatch
):
    """With the kernels serving the scoring as they do on CUDA (static steps under ``flex``: H2O's and TOVA's sums
    from the pass's log-sum-exp, settled for every layer at once; SnapKV's window votes from its carried
    log-sum-exps, those marked stale computed again by the kernel at a budget of 5), a run decodes the tokens and
    keeps the sets of the same run scored by PyTorch's products, and the kernels did score it."""
    loaded = wrap_model(tiny_model("llama"))
    ids = prompt(batch=2, length=40, seed=11)
    common = dict(mode="streaming", chunk=7, max_new_tokens=8, stop_token_ids=(), static=True, attention="flex")
    spec = RunSpec(small_policy(policy), Budget(tokens=budget), **common)
    by_pytorch = generate(loaded, ids, spec)
    calls: list[int] = []

    def counted(*args: object, **kwargs: object) -> torch.Tensor:
        calls.append(1)
        return slot_sums.slot_sums(*args, **kwargs)  # type: ignore[arg-type]

    stale_rows: list[int] = []

    def counted_lse(*args: object, stale: torch.Tensor | None = None) -> torch.Tensor:
        if stale is not None:
            stale_rows.append(int(stale.isnan().sum()))
        return slot_sums.log_sum_exps(*args, stale=stale)  # type: ignore[arg-type]

    for module in (flex, observe):
        monkeypatch.setattr(module, "sums_by_kernel", lambda device_type: True)
        monkeypatch.setattr(module, "slot_sums", counted)
    monkeypatch.setattr(observe, "slot_lse", counted_lse)
    by_kernels = generate(loaded, ids, spec)
    assert by_kernels.tokens == by_pytorch.tokens
    assert by_kernels.kept_per_layer == by_pytorch.kept_per_layer
    assert len(calls) >= 8 - 1  # at least every decoded token's scoring
    if policy == "snapkv":  # the carried log-sum-exps refreshed before every vote, stale ones at the small budget
        assert stale_rows and (sum(stale_rows) > 0) == (budget == 5)
