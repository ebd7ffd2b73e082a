"""The log-sum-exps a window of several queries carries through static steps under the ``flex`` backend
(:attr:`kvlab.cache.layer.HeapLayer.recent_query_lse`): each new query's from its attention kernel, the others' less
what each eviction frees, so that the votes are one pass over the keys. Checked against the log-sum-exps computed
afresh over the slots held, and the window kept in place against the one eager decoding shifts."""

from __future__ import annotations

import pytest
import torch
from tiny_models import prompt, small_policy, tiny_model

from kvlab.attention.observe import lse_without, window_lse
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


@pytest.mark.parametrize("architecture", ["llama", "gemma2"])
def test_static_steps_carry_the_log_sum_exps_of_the_slots_held_and_the_eager_window(
    architecture: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Llama's layers are stacked: every layer's query joins its window after the pass, in one copy; Gemma-2's
    sliding-window layers are not, and each layer's query replaces its window's oldest itself."""
    per_layer: list[bool] = []
    remember = HeapLayer.remember_queries

    def counted(layer: HeapLayer, *args: object) -> None:
        per_layer.append(args[-1] is not None)  # in a static step
        remember(layer, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(HeapLayer, "remember_queries", counted)
    loaded = wrap_model(tiny_model(architecture))
    ids = prompt(batch=2, length=40, seed=7)
    common = dict(mode="streaming", chunk=7, max_new_tokens=12, stop_token_ids=())
    policy, budget = small_policy("snapkv"), Budget(tokens=14)
    static = Generation(loaded, RunSpec(policy, budget, static=True, attention="flex", **common), ids)
    eager = Generation(loaded, RunSpec(policy, budget, static=False, **common), ids)
    for generation in (static, eager):
        for _ in generation.events():
            pass
    assert static.result().tokens == eager.result().tokens
    for carried, shifted in zip(static.cache.layers, eager.cache.layers):
        assert shifted.recent_query_lse is None
        if carried.sliding_window is None:
            assert carried.recent_query_lse is not None
            torch.testing.assert_close(carried.recent_query_lse, afresh(carried), rtol=1e-6, atol=1e-5)
        else:  # recomputed at every step: what a sliding window evicts may hold most of a query's attention
            assert carried.recent_query_lse is None
        # the window kept in place holds the queries the shifted window holds, in another order
        assert carried.recent_query_positions is not None and shifted.recent_query_positions is not None
        order = carried.recent_query_positions.argsort()
        assert torch.equal(carried.recent_query_positions[order], shifted.recent_query_positions)
        assert carried.recent_queries is not None and shifted.recent_queries is not None
        torch.testing.assert_close(carried.recent_queries[:, :, order], shifted.recent_queries)
    assert not torch.equal(order, torch.arange(order.numel()))  # the steps did write in place
    assert any(per_layer) == (architecture == "gemma2")
