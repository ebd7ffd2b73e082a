"""The cache as a managed heap: precision tiers, head-adaptive and layer-adaptive budgets, the generational cache,
run end to end through the engine on tiny random models."""

from __future__ import annotations

import math

import pytest
import torch
from tiny_models import prompt, small_policy, tiny_model

from kvlab.budget import Budget
from kvlab.cache.spec import TierSpec
from kvlab.cache.tiers import freeze
from kvlab.engine.generation import Generation, generate
from kvlab.engine.spec import RunSpec
from kvlab.errors import KvlabError
from kvlab.models.loading import wrap_model
from kvlab.policies import configure

BUDGET = 12
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def llama():
    return wrap_model(tiny_model("llama"))


@pytest.fixture(scope="module")
def gemma2():
    return wrap_model(tiny_model("gemma2"))


def run(loaded, name: str, budget: int | None = BUDGET, mode: str = "prefill", **params):
    """A generation of ``name`` (with ``params``) over a fixed prompt and question, drained, with its events."""
    base = small_policy(name)
    variant = configure(name, **{**base.params(), **params})
    spec = RunSpec(
        variant.policy,
        None if budget is None else Budget(tokens=budget),
        mode=mode,
        chunk=8,
        max_new_tokens=NEW_TOKENS,
        stop_token_ids=(),
        cache=variant.cache(),
    )
    generation = Generation(loaded, spec, prompt(batch=2, length=41, seed=3), prompt(batch=2, length=4, seed=8))
    events = []
    for event in generation.events():  # survivors are read while the event is current
        event.kept = [s.tolist() for s in event.survivors()]
        events.append(event)
    return generation, events, generation.result()


def dense_token_bytes(loaded) -> int:
    """K and V bytes of one token of one sequence and KV head at the model's dtype."""
    return 2 * loaded.arch.head_dim * loaded.kv_bytes_per_element


@pytest.mark.parametrize("name", ["h2o", "snapkv", "knorm", "streaming", "tova"])
def test_a_cold_tier_at_16_bits_equals_its_base_policy(llama, gemma2, name):
    for loaded in (llama, gemma2):
        _, base_events, base = run(loaded, name)
        _, tier_events, tiered = run(loaded, name, hot=0.25)
        assert tiered.tokens == base.tokens
        if loaded.arch.sliding_layers:  # a frozen tier keeps what a window no longer sees; dense slots drop it
            assert tiered.kv_bytes > base.kv_bytes
            continue
        assert tiered.kv_bytes == base.kv_bytes
        assert [e.kept for e in tier_events] == [e.kept for e in base_events]


def test_quantised_bytes_are_those_of_the_packed_codes_and_scales(llama):
    group, key_bits, value_bits = 4, 4, 2
    generation, _, result = run(llama, "h2o", hot=0.25, key_bits=key_bits, value_bits=value_bits, quant_group=group)
    arch = llama.arch
    batch, kv_heads, head_dim = 2, arch.num_kv_heads, arch.head_dim
    hot = math.ceil(0.25 * BUDGET)
    cold = BUDGET - hot
    padded = math.ceil(cold / group) * group
    scale_bytes = 2  # float16 scales and zero points
    keys = padded * head_dim * key_bits // 8 + (padded // group) * head_dim * 2 * scale_bytes
    values = cold * head_dim * value_bits // 8 + cold * (head_dim // group) * 2 * scale_bytes
    frozen = batch * kv_heads * (hot * dense_token_bytes(llama) + keys + values)
    appended = 4 + NEW_TOKENS - 1  # the question and every generated token but the last are in the dense heap
    dense = batch * kv_heads * appended * dense_token_bytes(llama)
    assert result.kv_bytes == arch.num_layers * (frozen + dense)
    assert all(layer.frozen is not None for layer in generation.cache.layers)


def test_fewer_bits_hold_fewer_bytes(llama):
    held = [run(llama, "h2o", hot=0.0, key_bits=bits, value_bits=bits)[2].kv_bytes for bits in (16, 8, 4, 2)]
    assert held == sorted(held, reverse=True) and len(set(held)) == 4


def test_a_budget_covering_the_prompt_quantises_every_token_and_evicts_none(llama):
    generation, events, _ = run(llama, "h2o", budget=64, hot=0.0, key_bits=8, value_bits=8)
    assert events[-1].kept_per_layer == [41 + 4 + NEW_TOKENS - 1] * llama.arch.num_layers
    assert all(layer.frozen is not None and layer.frozen.tokens() == 2 * 2 * 41 for layer in generation.cache.layers)


def test_frozen_tokens_are_placed_by_position_and_dequantised_within_their_bound():
    torch.manual_seed(0)
    keys, values = torch.randn(1, 2, 10, 16), torch.randn(1, 2, 10, 16)
    positions = torch.arange(10, dtype=torch.int32).flip(0).expand(1, 2, 10).contiguous()
    hot = torch.zeros(1, 2, 10, dtype=torch.bool)
    hot[0, 0, :3] = True
    cold = torch.zeros(1, 2, 10, dtype=torch.bool)
    cold[0, 0, 5:9] = True
    cold[0, 1, :7] = True
    exact = freeze(keys, values, positions, hot, cold, TierSpec())
    dense_keys, dense_values = exact.materialise(torch.float32)
    for head in range(2):
        held = exact.positions[0, head]
        for slot, position in enumerate(held.tolist()):
            if position < 0:
                continue
            source = int((positions[0, head] == position).nonzero())
            assert torch.equal(dense_keys[0, head, slot], keys[0, head, source])
            assert torch.equal(dense_values[0, head, slot], values[0, head, source])
    assert exact.held_per_head.tolist() == [[7, 7]]
    coarse = freeze(keys, values, positions, hot, cold, TierSpec(key_bits=8, value_bits=8, group=4))
    coarse_keys, _ = coarse.materialise(torch.float32)
    error = (coarse_keys - dense_keys).abs().max()
    assert 0 < error < (keys.max() - keys.min()) / 255
    assert coarse.kv_bytes() < exact.kv_bytes()


def test_adakv_heads_hold_different_counts_and_the_bytes_follow_them(llama):
    generation, events, result = run(llama, "snapkv", head_allocation="adakv")
    arch = llama.arch
    counts = [layer.frozen.held_per_head for layer in generation.cache.layers if layer.frozen is not None]
    assert len(counts) == arch.num_layers
    assert any(len(set(per_head.flatten().tolist())) > 1 for per_head in counts)
    for per_head in counts:
        assert per_head.sum(dim=1).tolist() == [BUDGET * arch.num_kv_heads] * 2
    frozen_bytes = sum(int(per_head.sum()) for per_head in counts) * dense_token_bytes(llama)
    appended = 2 * arch.num_kv_heads * (4 + NEW_TOKENS - 1) * dense_token_bytes(llama) * arch.num_layers
    assert result.kv_bytes == frozen_bytes + appended
    compress = next(e for e in events if e.kind == "compress")
    widest = max(int(per_head.max()) for per_head in counts)
    survivors = [torch.tensor(kept) for kept in compress.kept]
    assert max(s.shape[-1] for s in survivors) == widest and any(bool((s < 0).any()) for s in survivors)


def test_frozen_options_are_refused_in_streaming_mode(llama):
    for params in ({"hot": 0.5}, {"head_allocation": "adakv"}, {"layer_allocation": "cake"}):
        with pytest.raises(KvlabError, match="prefill mode"):
            run(llama, "h2o", mode="streaming", **params)


def test_layer_allocations_move_budget_between_layers_at_the_same_total(llama):
    totals = {}
    for allocation in ("uniform", "preset", "cake"):
        generation, events, _ = run(llama, "h2o", layer_allocation=allocation)
        compress = next(e for e in events if e.kind == "compress")
        totals[allocation] = compress.kept_per_layer
        assert sum(compress.kept_per_layer) == BUDGET * llama.arch.num_layers
        assert generation.layer_budgets == compress.kept_per_layer
    assert totals["preset"][0] > totals["preset"][-1]
    assert totals["uniform"] == [BUDGET] * llama.arch.num_layers


def test_the_entropy_allocation_names_the_command_that_profiles_a_model(llama):
    with pytest.raises(KvlabError, match="kvlab profile"):
        run(llama, "h2o", layer_allocation="entropy")


def test_the_generational_cache_ranks_fewer_slots_than_h2o_and_times_its_rankings(llama):
    generational = run(llama, "generational", mode="streaming", budget=20, young=0.2, middle=0.2)[2]
    h2o = run(llama, "h2o", mode="streaming", budget=20)[2]
    assert 0 < generational.ranked_slots < h2o.ranked_slots
    assert generational.ranking_seconds > 0 and h2o.ranking_seconds > 0


def test_noise_changes_what_is_kept_and_scale_zero_changes_nothing(llama):
    base = run(llama, "h2o", mode="streaming")[1]
    silent = run(llama, "h2o", mode="streaming", noise="gaussian", noise_scale=0.0)[1]
    noisy = run(llama, "h2o", mode="streaming", noise="gaussian", noise_scale=5.0)[1]
    kept = [e.kept for e in base]
    assert [e.kept for e in silent] == kept
    assert [e.kept for e in noisy] != kept


def test_quantised_runs_decode_eagerly_after_the_compression(llama):
    variant = configure("h2o", hot=0.5, key_bits=8, value_bits=8)
    spec = RunSpec(
        variant.policy,
        Budget(tokens=BUDGET),
        cache=variant.cache(),
        max_new_tokens=NEW_TOKENS,
        stop_token_ids=(),
        static=True,
    )
    static = generate(llama, prompt(batch=1, length=30, seed=2), spec)
    eager = generate(llama, prompt(batch=1, length=30, seed=2), RunSpec(**{**spec.__dict__, "static": False}))
    assert static.tokens == eager.tokens and static.decode_graphs == 0
