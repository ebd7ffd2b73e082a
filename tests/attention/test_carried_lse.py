"""The log-sum-exps a window of several queries carries through static steps under the ``flex`` backend
(:attr:`kvlab.cache.layer.HeapLayer.recent_query_lse`): each new query's from its attention kernel, the others' less
what each eviction frees (or, where the victims held most of a query's attention, computed again), so that the votes
are one pass over the keys. Checked against the log-sum-exps computed afresh over the slots held, and the window kept
in place against the one eager decoding shifts."""

from __future__ import annotations

import pytest
import torch
from tiny_models import prompt, small_policy, tiny_model

from kvlab.attention import observe, slot_sums
from kvlab.attention.observe import lse_without, refresh_lse, window_lse
from kvlab.budget import Budget
from kvlab.cache.layer import FREE, AttentionShape, HeapLayer
from kvlab.engine.generation import Generation
from kvlab.engine.spec import RunSpec
from kvlab.models.loading import wrap_model


def afresh(layer: HeapLayer) -> torch.Tensor:
    """The layer's remembered queries' log-sum-exps over every slot it holds now."""
    assert layer.recent_queries is not None and layer.recent_query_positions is not None
    keys, _, positions = layer.slots(layer.capacity)
    return window_lse(layer.recent_queries, layer.recent_query_positions, keys, positions, layer.attention)


def run(architecture: str, policy: str, budget: int, static: bool, attention: str = "sdpa") -> Generation:
    """A streaming run of ``policy`` on a tiny model, decoded to its end."""
    loaded = wrap_model(tiny_model(architecture))
    ids = prompt(batch=2, length=40, seed=7)
    common = dict(mode="streaming", chunk=7, max_new_tokens=12, stop_token_ids=(), static=static, attention=attention)
    spec = RunSpec(small_policy(policy), Budget(tokens=budget), **common)  # type: ignore[arg-type]
    generation = Generation(loaded, spec, ids)
    for _ in generation.events():
        pass
    return generation


@pytest.mark.parametrize(
    "shape", [AttentionShape(None, 0.25, None), AttentionShape(12, 0.25, 20.0)], ids=["plain", "window, softcap"]
)
def test_taking_victims_out_gives_the_log_sum_exps_of_the_slots_left(shape: AttentionShape) -> None:
    generator = torch.Generator().manual_seed(3)
    batch, kv_heads, groups, window, slots, head_dim = 2, 2, 3, 5, 40, 16
    queries = torch.randn(batch, kv_heads * groups, window, head_dim, generator=generator)
    keys = torch.randn(batch, kv_heads, slots, head_dim, generator=generator)
    positions = torch.stack([torch.randperm(slots + 2, generator=generator)[:slots] for _ in range(batch * kv_heads)])
    positions = positions.view(batch, kv_heads, slots).to(torch.int32)
    query_positions = torch.arange(slots + 2 - window, slots + 2)
    victims = torch.stack([torch.randperm(slots, generator=generator)[:3] for _ in range(batch * kv_heads)])
    victims = victims.view(batch, kv_heads, 3)
    before = window_lse(queries, query_positions, keys, positions, shape)
    carried = lse_without(queries, query_positions, keys, positions, victims, before, shape)
    left = positions.scatter(2, victims, FREE)
    expected = window_lse(queries, query_positions, keys, left, shape)
    torch.testing.assert_close(carried, expected, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(carried, before)  # something was taken out


# the interpreter computes the log-sum-exp of a block's rows that do not exist as log(0), and numpy warns about it
@pytest.mark.filterwarnings("ignore:divide by zero encountered in log:RuntimeWarning")
@pytest.mark.parametrize("by_kernel", [False, True], ids=["pytorch", "kernel"])
def test_a_victim_that_held_most_of_a_querys_attention_leaves_it_stale_until_computed_again(
    by_kernel: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One query gives slot 3 almost all its attention (a logit of 30 against 0): taking slot 3 out of its
    log-sum-exp would leave none of its digits (it came out -inf), so that query's is marked stale and computed again
    over the slots left before the next votes, by PyTorch or by the kernel (which computes the stale rows alone)."""
    if by_kernel:
        pytest.importorskip("triton")
        monkeypatch.setattr("kvlab.attention.observe.sums_by_kernel", lambda device_type: True)
    shape = AttentionShape(None, 1.0, None)
    keys = torch.zeros(1, 1, 12, 16)
    keys[..., 0] = 1.0
    keys[0, 0, 3] = torch.zeros(16)
    keys[0, 0, 3, 1] = 1.0
    queries = torch.zeros(1, 1, 2, 16)
    queries[0, 0, 0, 1] = 30.0  # the first query: slot 3 alone
    queries[0, 0, 1, 0] = 0.5  # the second: every slot alike
    positions = torch.arange(12, dtype=torch.int32).view(1, 1, 12)
    query_positions = torch.tensor([10, 11])
    lse = window_lse(queries, query_positions, keys, positions, shape)
    victims = torch.tensor([[[3]]])
    carried = lse_without(queries, query_positions, keys, positions, victims, lse, shape)
    assert bool(carried[0, 0, 0].isnan()) and bool(carried[0, 0, 1].isfinite())
    left = positions.scatter(2, victims, FREE)
    expected = window_lse(queries, query_positions, keys, left, shape)
    torch.testing.assert_close(carried[0, 0, 1], expected[0, 0, 1])  # a small share: taken out exactly
    refresh_lse(carried, queries, query_positions, keys, left, shape)
    torch.testing.assert_close(carried, expected)
    assert float(expected[0, 0, 0]) > 2.0  # log(10): what was left of the first query's attention


@pytest.mark.filterwarnings("ignore:divide by zero encountered in log:RuntimeWarning")
def test_the_kernel_computes_only_the_stale_log_sum_exps() -> None:
    pytest.importorskip("triton")
    generator = torch.Generator().manual_seed(5)
    queries = torch.randn(2, 4, 8, 32, generator=generator)
    keys = torch.randn(2, 2, 150, 32, generator=generator)
    positions = torch.arange(150, dtype=torch.int32).expand(2, 2, 150).clone()
    query_positions = torch.arange(150, 158)
    shape = AttentionShape(None, 32**-0.5, None)
    expected = window_lse(queries, query_positions, keys, positions, shape)
    given = torch.full_like(expected, 7.0)
    given[0, 1, 3] = float("nan")
    given[1, :, 0] = float("nan")
    found = slot_sums.log_sum_exps(queries, query_positions, keys, positions, shape, stale=given)
    stale = given.isnan()
    torch.testing.assert_close(found[stale], expected[stale], rtol=1e-5, atol=1e-5)
    assert bool((found[~stale] == 7.0).all())


@pytest.mark.parametrize(
    "policy, budget, stale",
    [("snapkv", 14, False), ("snapkv", 6, True), ("chunkkv", 14, False), ("pyramidkv", 14, True)],
    ids=["snapkv", "snapkv, a budget of 6", "chunkkv", "pyramidkv"],
)
def test_static_steps_carry_the_log_sum_exps_of_the_slots_held_and_the_eager_window(
    policy: str, budget: int, stale: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a tiny Llama (stacked layers: every layer's query joins its window after the pass, in one copy;
    PyramidKV's layers, of different sizes, are not stacked, and each puts its own query in its window): the tokens
    and kept sets of eager decoding, every carried log-sum-exp that is not stale equal to the one computed afresh
    over the slots held, and the window eager decoding holds. At a budget of 6, and in PyramidKV's upper layers,
    some victims held most of a query's attention (``stale``): those queries' were computed again."""
    in_static_step: list[bool] = []
    remember = HeapLayer.remember_queries

    def counted(layer: HeapLayer, *args: object) -> None:
        in_static_step.append(args[-1] is not None)
        remember(layer, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(HeapLayer, "remember_queries", counted)
    marked_stale: list[int] = []
    without = observe.lse_without

    def counted_stale(*operands: object) -> torch.Tensor:
        carried = without(*operands)  # type: ignore[arg-type]
        marked_stale.append(int(carried.isnan().sum()))
        return carried

    monkeypatch.setattr(observe, "lse_without", counted_stale)
    static = run("llama", policy, budget, static=True, attention="flex")
    eager = run("llama", policy, budget, static=False)
    assert static.result().tokens == eager.result().tokens
    assert static.result().kept_per_layer == eager.result().kept_per_layer
    for carried, shifted in zip(static.cache.layers, eager.cache.layers):
        assert carried.recent_query_lse is not None and shifted.recent_query_lse is None
        current = ~carried.recent_query_lse.isnan()
        torch.testing.assert_close(carried.recent_query_lse[current], afresh(carried)[current], rtol=1e-6, atol=1e-5)
        assert carried.recent_query_positions is not None and shifted.recent_query_positions is not None
        order = carried.recent_query_positions.argsort()
        assert torch.equal(carried.recent_query_positions[order], shifted.recent_query_positions)
        assert carried.recent_queries is not None and shifted.recent_queries is not None
        torch.testing.assert_close(carried.recent_queries[:, :, order], shifted.recent_queries)
    assert not torch.equal(order, torch.arange(order.numel()))  # the steps did write in place
    assert any(in_static_step) == (static.cache.stack is None) == (policy == "pyramidkv")
    assert marked_stale and (sum(marked_stale) > 0) == stale


def test_no_layer_carries_where_a_layer_has_a_sliding_window() -> None:
    """Gemma-2's sliding-window layers evict what the newest query no longer sees, which may hold most of an older
    query's attention at every step: no layer carries (an eviction takes the victims out of every layer or none), and
    the run is eager decoding's."""
    static = run("gemma2", "snapkv", 14, static=True, attention="flex")
    eager = run("gemma2", "snapkv", 14, static=False)
    assert static.result().tokens == eager.result().tokens
    assert all(layer.recent_query_lse is None for layer in static.cache.layers)


def test_a_sparse_reader_with_a_window_decodes_under_flex() -> None:
    """RocketKV remembers a window of 32 but reads sparsely while decoding, which kvlab's own kernel does: nothing
    is carried, and static steps under ``flex`` decode eager decoding's tokens."""
    static = run("llama", "rocketkv", 40, static=True, attention="flex")
    eager = run("llama", "rocketkv", 40, static=False)
    assert static.result().tokens == eager.result().tokens
    assert all(layer.recent_query_lse is None for layer in static.cache.layers)
