"""Layers stacked for one eviction of all of them: static steps that rank every layer at once keep exactly the tokens
of layer-by-layer eviction, and fall back to it wherever layers differ."""

from __future__ import annotations

import pytest
import torch
from tiny_models import prompt, small_policy, tiny_model

from kvlab.attention import function, observe
from kvlab.attention.observe import stacked_window_attention, votes, window_attention
from kvlab.budget import Budget
from kvlab.cache.heap import KVHeap
from kvlab.cache.layer import FREE, AttentionShape, HeapLayer
from kvlab.cache.spec import CacheSpec
from kvlab.cache.stack import LayerStack
from kvlab.engine import eviction
from kvlab.engine.generation import generate
from kvlab.engine.spec import RunSpec
from kvlab.models.loading import wrap_model


def layer(capacity: int, seed: int, scores: bool = True) -> HeapLayer:
    generator = torch.Generator().manual_seed(seed)
    return HeapLayer(
        planned=capacity,
        keys=torch.zeros(2, 3, capacity, 4),
        values=torch.zeros(2, 3, capacity, 4),
        positions=torch.randperm(capacity, generator=generator).int().expand(2, 3, capacity).clone(),
        scores=torch.rand(2, 3, capacity, generator=generator) if scores else None,
    )


def test_the_layers_hold_views_of_the_stack_until_one_is_replaced():
    layers = [layer(8, seed) for seed in range(3)]
    before = [(held.positions.clone(), held.scores.clone()) for held in layers]
    stack = LayerStack.of(layers)
    assert stack is not None and stack.positions.shape == (3, 2, 3, 8) and stack.holds(layers)
    for held, (positions, scores) in zip(layers, before):
        assert torch.equal(held.positions, positions) and torch.equal(held.scores, scores)
    stack.positions[1, 0, 0, 0] = FREE  # a write to the stack is a write to the layer's own tensor
    assert int(layers[1].positions[0, 0, 0]) == FREE
    flat = stack.as_layer(layers)
    assert flat is not None and flat.positions.shape == (6, 3, 8) and torch.equal(flat.scores[2:4], layers[1].scores)
    layers[2].positions = layers[2].positions.clone()
    assert not stack.holds(layers)


def test_layers_that_differ_are_not_stacked():
    assert LayerStack.of([layer(8, 0), layer(9, 1)]) is None  # another capacity
    assert LayerStack.of([layer(8, 0), HeapLayer(planned=8)]) is None  # a layer not allocated
    mixed = [layer(8, 0), layer(8, 1, scores=False)]
    stack = LayerStack.of(mixed)
    assert stack is None  # accumulated attention in one layer only


def windowed_layers(count: int) -> list[HeapLayer]:
    layers = [layer(8, seed) for seed in range(count)]
    generator = torch.Generator().manual_seed(3)
    for held in layers:
        held.keys = torch.randn(2, 3, 8, 4, generator=generator)
        held.recent_queries = torch.randn(2, 6, 3, 4, generator=generator)
        held.recent_query_positions = torch.tensor([8, 9, 10])
    return layers


def test_every_layers_window_is_scored_over_its_own_keys_at_once_and_stacked_in_layer_order():
    layers = windowed_layers(2)
    expected = [window_attention(held, 8) for held in layers]
    stack = LayerStack.of(layers)
    assert stack is not None and stack.keys is not None and stack.queries is not None
    assert stack.keys.shape == (2, 2, 3, 8, 4) and stack.queries.shape == (2, 2, 6, 3, 4)
    remembered = layers[1].recent_queries.clone()
    layers[1].recent_queries.fill_(7.0)  # the layers hold views: what a static step remembers lands in the stack
    assert torch.equal(stack.queries[1], torch.full_like(remembered, 7.0))
    layers[1].recent_queries.copy_(remembered)
    stacked = stacked_window_attention(layers, 8, stack)
    assert stacked.shape == (4, 3, 8)
    for index, layer_votes in enumerate(expected):
        assert torch.allclose(stacked[2 * index : 2 * index + 2], layer_votes)
    assert torch.allclose(stacked.sum(dim=-1), torch.full((4, 3), 6.0))  # 3 queries x 2 query heads per KV head
    assert torch.allclose(stacked_window_attention(layers, 8, None), stacked)  # layer by layer, the same


def test_layers_that_attend_differently_or_whose_kernel_gave_the_votes_are_scored_layer_by_layer():
    layers = windowed_layers(2)
    stack = LayerStack.of(layers)
    layers[1].shape = AttentionShape(scaling=0.5)
    assert torch.allclose(stacked_window_attention(layers, 8, stack)[2:], window_attention(layers[1], 8))
    for held in layers:
        held.shape = None
        held.recent_queries = held.recent_queries[:, :, -1:]
        held.received = torch.rand(2, 3, 8)  # a window of one query: what the kernel gave each slot
    assert torch.equal(stacked_window_attention(layers, 8, stack)[2:], layers[1].received)
    assert not stack.holds(layers)  # the remembered queries were replaced


@pytest.mark.parametrize(
    "policy,attention,architecture,stacked",
    [
        ("streaming", "sdpa", "llama", True),
        ("h2o", "sdpa", "llama", True),
        ("h2o", "flex", "llama", True),  # what each slot received, computed for every layer at once after the pass
        ("tova", "flex", "llama", True),  # scored by what the flex kernel gave each slot, likewise
        ("tova", "sdpa", "llama", True),  # scored by a second pass over each layer's keys, ranked at once
        ("snapkv", "sdpa", "llama", True),  # a window of several queries, likewise
        ("snapkv", "flex", "llama", True),
        ("pyramidkv", "sdpa", "llama", False),  # a budget per layer
        ("h2o", "sdpa", "gemma2", False),  # sliding-window layers evict what their window no longer sees
    ],
)
@pytest.mark.parametrize("layout", ["bitmask", "threshold", "compact"])
def test_every_layer_evicted_at_once_keeps_the_tokens_of_layer_by_layer_eviction(
    policy, attention, architecture, stacked, layout, monkeypatch
):
    loaded = wrap_model(tiny_model(architecture))
    ids = prompt(batch=2, length=40, seed=5)
    calls = {"one layer, static": 0, "every layer, static": 0, "every layer": 0}
    one_layer, every_layer = KVHeap.cut, KVHeap.cut_every_layer

    def cut(heap, *args, **kwargs):
        calls["one layer, static"] += heap.static
        return one_layer(heap, *args, **kwargs)

    def cut_every(heap, *args, **kwargs):
        calls["every layer, static" if heap.static else "every layer"] += 1
        return every_layer(heap, *args, **kwargs)

    scored_batches = set()

    def scored(queries, *args):
        scored_batches.add(queries.shape[0])
        return votes(queries, *args)

    common = dict(mode="streaming", chunk=7, max_new_tokens=10, stop_token_ids=(), cache=CacheSpec(layout))

    def run(static: bool):
        spec = RunSpec(small_policy(policy), Budget(tokens=14), static=static, attention=attention, **common)
        return generate(loaded, ids, spec)

    with monkeypatch.context() as layer_by_layer:
        layer_by_layer.setattr(eviction, "evict_stacked", lambda *args: False)
        reference = run(static=False)
    settled = []
    settle = function.settle_received

    def settle_every_layer(stack, pending, query_position, oldest):
        settled.append(len(pending))
        return settle(stack, pending, query_position, oldest)

    monkeypatch.setattr(KVHeap, "cut", cut)
    monkeypatch.setattr(KVHeap, "cut_every_layer", cut_every)
    monkeypatch.setattr(observe, "votes", scored)
    monkeypatch.setattr(function, "settle_received", settle_every_layer)
    for static in (False, True):
        result = run(static)
        assert result.tokens == reference.tokens
        assert result.kept_per_layer == reference.kept_per_layer
        assert result.tie_share == reference.tie_share
        assert result.compactions == reference.compactions
    layers = loaded.model.config.num_hidden_layers
    windows_at_once = stacked and (policy == "snapkv" or (policy == "tova" and attention == "sdpa"))
    assert (layers * 2 in scored_batches) == windows_at_once  # every layer's window scored in one call
    # every static step, for all layers at once: what H2O's and TOVA's slots received, SnapKV's carried log-sum-exps
    settled_at_once = stacked and attention == "flex" and policy in ("h2o", "tova", "snapkv")
    assert settled == ([layers] * 9 if settled_at_once else [])
    if stacked:  # every decoded token but the last evicts; the prefill chunks and eager steps at once too
        assert calls["one layer, static"] == 0 and calls["every layer, static"] == 9 and calls["every layer"] >= 9
    else:
        assert calls["every layer, static"] == calls["every layer"] == 0 and calls["one layer, static"] > 0


def test_layers_holding_different_numbers_of_slots_are_not_ranked_as_one():
    layers = [layer(8, seed) for seed in range(2)]
    for held in layers:
        held.used = held.live = 8
    copied = LayerStack.copied(layers)
    assert copied is not None and copied.positions.shape == (4, 3, 8)
    assert torch.equal(copied.scores[2:], layers[1].scores)
    copied.positions.fill_(FREE)  # a copy: the layers keep theirs
    assert bool((layers[0].positions >= 0).all())
    layers[1].used = 7
    assert LayerStack.copied(layers) is None


@pytest.mark.parametrize("policy", ["full", "h2o"])
def test_a_static_step_places_its_token_and_builds_its_masks_for_every_layer_at_once(policy, monkeypatch):
    from kvlab.attention import flex, function

    loaded = wrap_model(tiny_model("llama"))
    ids = prompt(batch=2, length=40, seed=9)
    calls = {"tables": 0, "attention": 0}
    tables, attention = flex.block_tables, function.flex_decode_attention

    def counted(name, wrapped):
        def call(*args, **kwargs):
            calls[name] += 1
            return wrapped(*args, **kwargs)

        return call

    monkeypatch.setattr(flex, "block_tables", counted("tables", tables))
    monkeypatch.setattr(function, "flex_decode_attention", counted("attention", attention))
    budget = None if policy == "full" else Budget(tokens=14)
    common = dict(mode="streaming", chunk=7, max_new_tokens=10, stop_token_ids=())
    flex_run = generate(loaded, ids, RunSpec(small_policy(policy), budget, static=True, attention="flex", **common))
    eager = generate(loaded, ids, RunSpec(small_policy(policy), budget, static=False, **common))
    assert flex_run.tokens == eager.tokens and flex_run.kept_per_layer == eager.kept_per_layer
    assert calls["tables"] > 0 and calls["attention"] == loaded.arch.num_layers * calls["tables"]
