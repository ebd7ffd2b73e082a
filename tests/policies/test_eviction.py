"""Eviction is physical and exact: budgets are held, survivors are the policy's, and dropping a token from the cache
is the same as masking it out of attention."""

from __future__ import annotations

import pytest
import torch
from tiny_models import prompt, runs_in, small_policy, tiny_gemma3, tiny_model

from kvlab.attention.stats import StatsRequest
from kvlab.budget import Budget
from kvlab.engine.generation import Generation, generate
from kvlab.engine.spec import RunSpec
from kvlab.models.loading import wrap_model
from kvlab.policies import POLICIES, evicting, make_policy


@pytest.fixture(scope="module")
def llama():
    model = tiny_model("llama")
    return model, wrap_model(model)


def per_token_bytes(loaded, batch: int = 1) -> int:
    arch = loaded.arch
    return 2 * batch * arch.num_layers * arch.num_kv_heads * arch.head_dim * loaded.kv_bytes_per_element


def test_evicting_equals_masking(llama):
    """Drop a different random set per sequence and KV head; the next token's logits equal those of the eager model
    run over the whole sequence with those tokens masked out of the last query's attention."""
    model, loaded = llama
    ids = prompt(batch=2, length=30, seed=3)
    batch, length = ids.shape
    kv_heads, groups = loaded.arch.num_kv_heads, loaded.arch.num_q_heads // loaded.arch.num_kv_heads
    generator = torch.Generator().manual_seed(7)
    keep = torch.stack(
        [
            torch.stack([torch.randperm(length, generator=generator)[:18].sort().values for _ in range(kv_heads)])
            for _ in range(batch)
        ]
    )
    generation = Generation(loaded, RunSpec(make_policy("full"), max_new_tokens=1), ids)
    with torch.inference_mode():
        generation.forward(ids)
        dropped = torch.ones(batch, kv_heads, length, dtype=torch.bool).scatter_(2, keep, False)
        victims = dropped.nonzero()[:, 2].reshape(batch, kv_heads, length - 18)
        for layer in range(loaded.arch.num_layers):
            generation.cache.evict(layer, victims)
        assert generation.cache.kept_per_layer() == [18] * loaded.arch.num_layers
        next_token = torch.tensor([[5], [11]])
        evicted_logits, _ = generation.forward(next_token)

    full = torch.cat([ids, next_token], dim=1)
    mask = torch.full((batch, kv_heads, length + 1, length + 1), torch.finfo(torch.float32).min)
    mask = mask.triu(diagonal=1)
    last_row = torch.full((batch, kv_heads, length + 1), torch.finfo(torch.float32).min)
    last_row.scatter_(2, keep, 0.0)
    last_row[..., length] = 0.0
    mask[:, :, length] = last_row
    mask = mask.repeat_interleave(groups, dim=1)
    with torch.no_grad():
        masked_logits = model(input_ids=full, attention_mask=mask).logits[:, -1]
    torch.testing.assert_close(evicted_logits, masked_logits, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(evicted_logits, model(input_ids=full).logits[:, -1], atol=1e-3)


@pytest.mark.parametrize(
    ("policy", "mode"),
    [
        (name, mode)
        for name in evicting()
        if not getattr(POLICIES[name], "own_layer_budgets", False)
        for mode in runs_in(name)
    ],
)
def test_every_layer_holds_its_budget(llama, policy, mode):
    """Policies with one budget for every layer (PyramidKV spreads it: tested below), or the same total where the
    published options rank all layers together (KVzip)."""
    _, loaded = llama
    layers = loaded.arch.num_layers
    ranked_together = POLICIES[policy].cache_defaults.get("scope") == "global"
    spec = RunSpec(small_policy(policy), Budget(tokens=12), mode=mode, chunk=5, max_new_tokens=6, stop_token_ids=())
    events = list(Generation(loaded, spec, prompt(length=40)).events())
    evicted = [e for e in events if e.kind == "compress"] if mode == "prefill" else events
    assert evicted
    for event in evicted:
        expected = 12 if event.kind == "compress" or event.seen_tokens >= 12 else event.seen_tokens
        if ranked_together:
            assert sum(event.kept_per_layer) == expected * layers
        else:
            assert event.kept_per_layer == [expected] * layers
        assert event.kv_bytes == expected * per_token_bytes(loaded)


def test_streaming_keeps_sinks_and_recent_window(llama):
    _, loaded = llama
    spec = RunSpec(
        make_policy("streaming", sinks=4),
        Budget(tokens=12),
        mode="streaming",
        chunk=5,
        max_new_tokens=6,
        stop_token_ids=(),
    )
    for event in Generation(loaded, spec, prompt(length=40)).events():
        if event.seen_tokens < 12:
            continue
        expected = list(range(4)) + list(range(event.seen_tokens - 8, event.seen_tokens))
        for positions in event.survivors():
            assert positions.shape == (1, loaded.arch.num_kv_heads, 12)
            assert (positions == torch.tensor(expected, dtype=positions.dtype)).all()


@pytest.mark.parametrize("policy", [name for name in evicting() if "streaming" in runs_in(name)])
def test_streaming_peak_never_exceeds_budget_plus_chunk(llama, policy):
    _, loaded = llama
    chunk, budget = 6, 10
    spec = RunSpec(
        small_policy(policy),
        Budget(tokens=budget),
        mode="streaming",
        chunk=chunk,
        max_new_tokens=5,
        stop_token_ids=(),
    )
    generation = Generation(loaded, spec, prompt(length=50))
    largest_layer_budget = max(generation.layer_budgets)
    list(generation.events())
    bound = (largest_layer_budget + chunk) * per_token_bytes(loaded)
    assert 0 < generation.peak_kv_bytes <= bound
    if policy != "pyramidkv":
        assert generation.peak_kv_bytes == (budget + chunk) * per_token_bytes(loaded)


def test_prefill_mode_peak_is_the_whole_context(llama):
    _, loaded = llama
    result = generate(
        loaded,
        prompt(length=40),
        RunSpec(make_policy("h2o"), Budget(keep=0.25), max_new_tokens=3, stop_token_ids=()),
    )
    assert result.budget_tokens == 10
    assert result.peak_kv_bytes == 40 * per_token_bytes(loaded)
    assert result.kv_bytes == (10 + 2) * per_token_bytes(loaded)
    assert result.kv_bytes_full == (40 + 2) * per_token_bytes(loaded)


def test_random_is_reproducible_with_its_seed(llama):
    _, loaded = llama

    def survivors(seed: int) -> list[torch.Tensor]:
        spec = RunSpec(make_policy("random"), Budget(tokens=10), max_new_tokens=1, seed=seed)
        events = [e for e in Generation(loaded, spec, prompt(length=40)).events() if e.kind == "compress"]
        return events[0].survivors()

    first, again, other = survivors(1), survivors(1), survivors(2)
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert not all(torch.equal(a, b) for a, b in zip(first, other))


@pytest.mark.parametrize("policy", ["h2o", "knorm", "snapkv"])
def test_each_sequence_of_a_batch_chooses_its_own_survivors(llama, policy):
    _, loaded = llama
    ids = prompt(batch=3, length=36, seed=9)
    spec = RunSpec(
        small_policy(policy), Budget(tokens=10), mode="streaming", chunk=6, max_new_tokens=6, stop_token_ids=()
    )
    batched = generate(loaded, ids, spec)
    singles = [generate(loaded, ids[i : i + 1], spec).tokens[0] for i in range(3)]
    assert batched.tokens == singles


def test_batched_sequences_keep_different_tokens(llama):
    _, loaded = llama
    spec = RunSpec(make_policy("knorm"), Budget(tokens=10), mode="streaming", chunk=6, max_new_tokens=2)
    events = [e for e in Generation(loaded, spec, prompt(batch=3, length=36, seed=9)).events() if e.kind == "prefill"]
    positions = events[-1].survivors()[0]
    assert not torch.equal(positions[0], positions[1])


def test_pyramid_budgets_fall_with_depth_and_keep_the_uniform_total():
    pyramid = make_policy("pyramidkv", window=8, beta=20)
    budgets = pyramid.layer_budgets(100, 32)
    assert sum(budgets) == 100 * 32
    assert budgets == sorted(budgets, reverse=True)
    assert budgets[0] > 100 > budgets[-1] >= 8


def test_tova_keeps_the_same_tokens_in_every_head(llama):
    _, loaded = llama
    spec = RunSpec(make_policy("tova"), Budget(tokens=10), mode="streaming", chunk=7, max_new_tokens=4)
    for event in Generation(loaded, spec, prompt(length=40)).events():
        for positions in event.survivors():
            assert (positions == positions[:, :1]).all()


def test_snapkv_keeps_its_observation_window(llama):
    _, loaded = llama
    spec = RunSpec(make_policy("snapkv", window=6), Budget(tokens=12), max_new_tokens=1)
    compress = [e for e in Generation(loaded, spec, prompt(length=40)).events() if e.kind == "compress"][0]
    for positions in compress.survivors():
        assert set(range(34, 40)) <= set(positions[0, 0].tolist())


def attention_rows(model, ids):
    with torch.no_grad():
        return model(input_ids=ids, output_attentions=True).attentions


@pytest.mark.parametrize("chunk", [None, 7])
def test_h2o_scores_are_accumulated_attention(llama, chunk):
    model, loaded = llama
    ids = prompt(length=30)
    spec = RunSpec(make_policy("h2o"), Budget(tokens=64), chunk=chunk, max_new_tokens=1)
    generation = Generation(loaded, spec, ids)
    list(generation.events())
    kv_heads = loaded.arch.num_kv_heads
    for layer, attention in enumerate(attention_rows(model, ids)):
        batch, heads, queries, keys = attention.shape
        expected = attention.reshape(batch, kv_heads, heads // kv_heads, queries, keys).sum(dim=(2, 3))
        torch.testing.assert_close(generation.cache.layers[layer].scores, expected, atol=1e-4, rtol=1e-4)


def test_requested_statistics_match_the_attention_matrix(llama):
    model, loaded = llama
    ids = prompt(length=30)
    n_bins, n_sink = 5, 2
    spec = RunSpec(make_policy("full"), max_new_tokens=1, stats=StatsRequest(n_sink=n_sink, n_bins=n_bins))
    prefill = [e for e in Generation(loaded, spec, ids).events() if e.kind == "prefill"][0]
    span = 31
    bins = torch.arange(30) * n_bins // span
    for layer, attention in enumerate(attention_rows(model, ids)):
        probs = attention[0]
        entropy = -(probs * probs.clamp_min(1e-30).log()).sum(-1).mean(-1)
        torch.testing.assert_close(prefill.stats["entropy"][layer, 0], entropy, atol=1e-4, rtol=1e-4)
        sink = probs[..., :n_sink].sum(-1).mean(-1)
        torch.testing.assert_close(prefill.stats["sink_mass"][layer, 0], sink, atol=1e-5, rtol=1e-4)
        pooled = torch.zeros(n_bins).index_add_(0, bins, probs.mean(0).mean(0))
        torch.testing.assert_close(prefill.stats["pooled"][layer, 0], pooled, atol=1e-5, rtol=1e-4)
        assert prefill.stats["pooled"][layer, 0].sum().item() == pytest.approx(1.0, abs=1e-5)


def test_observing_does_not_change_the_output(llama):
    _, loaded = llama
    ids = prompt(length=33)
    plain = generate(loaded, ids, RunSpec(make_policy("full"), mode="streaming", chunk=8, max_new_tokens=6))
    observed = generate(
        loaded, ids, RunSpec(make_policy("full"), mode="streaming", chunk=8, max_new_tokens=6, stats=StatsRequest())
    )
    assert plain.tokens == observed.tokens


def test_compression_interval_evicts_every_few_tokens_within_budget_plus_chunk(llama):
    _, loaded = llama
    spec = RunSpec(
        make_policy("streaming"),
        Budget(tokens=12),
        mode="streaming",
        chunk=6,
        max_new_tokens=9,
        stop_token_ids=(),
        compression_interval=3,
    )
    decode = [e for e in Generation(loaded, spec, prompt(length=40)).events() if e.kind == "decode"]
    # the last token is chosen but never fed back, so the last event sees the cache of the step before
    assert [e.kept_per_layer[0] for e in decode] == [13, 14, 12, 13, 14, 12, 13, 14, 14]
    with pytest.raises(Exception, match="larger than the chunk"):
        RunSpec(make_policy("streaming"), Budget(tokens=12), mode="streaming", chunk=4, compression_interval=5)


@pytest.mark.parametrize("chunk", [None, 9])
def test_one_shared_prefill_gives_each_policy_the_result_of_its_own_run(llama, chunk):
    from kvlab.engine.generation import prefill_once

    _, loaded = llama
    ids, question = prompt(batch=2, length=40, seed=4), prompt(batch=2, length=5, seed=6)
    policies = [small_policy(name) for name in evicting()]
    shared = prefill_once(loaded, ids, policies, chunk=chunk)
    for policy in policies:
        spec = RunSpec.of(policy, Budget(tokens=12), chunk=chunk, max_new_tokens=6, stop_token_ids=())
        alone = generate(loaded, ids, spec, suffix_ids=question)
        forked = generate(loaded, None, spec, suffix_ids=question, prefilled=shared)
        assert forked.tokens == alone.tokens, policy.name
        assert forked.kept_per_layer == alone.kept_per_layer
        assert forked.peak_kv_bytes == alone.peak_kv_bytes
    assert (
        generate(
            loaded,
            None,
            RunSpec(make_policy("full"), max_new_tokens=6, stop_token_ids=()),
            suffix_ids=question,
            prefilled=shared,
        ).tokens
        == generate(
            loaded, ids, RunSpec(make_policy("full"), max_new_tokens=6, stop_token_ids=()), suffix_ids=question
        ).tokens
    )


def test_pyramid_hands_what_lower_layers_cannot_hold_to_the_upper_layers():
    pyramid = make_policy("pyramidkv", window=32, beta=20)
    budgets = pyramid.layer_budgets(3687, 10, capacity=4096)
    assert sum(budgets) == 3687 * 10
    assert max(budgets) <= 4096
    assert budgets == sorted(budgets, reverse=True)
    assert budgets[-1] > 32 + (3687 - 32) // 20
    assert pyramid.layer_budgets(4096, 10, capacity=4096) == [4096] * 10


@pytest.mark.parametrize("policy", ["h2o", "snapkv"])
def test_prefill_mode_stops_observing_after_its_one_compression(llama, policy):
    _, loaded = llama
    generation = Generation(
        loaded, RunSpec(small_policy(policy), Budget(tokens=12), max_new_tokens=4), prompt(length=40)
    )
    kinds = []
    for event in generation.events():
        kinds.append(event.kind)
        if event.kind != "prefill":
            assert all(layer.scores is None and layer.recent_queries is None for layer in generation.cache.layers)
    assert kinds.count("compress") == 1


def test_sink_mass_counts_only_the_queries_that_can_see_a_sink():
    """On a sliding-window layer the queries past the window cannot see the first token; the sink mass is the mean
    over those that can (positions 0-5 with a window of 6), as transformers' own attention gives it."""
    model = tiny_gemma3()
    loaded = wrap_model(model)
    ids = prompt(length=30)
    spec = RunSpec(make_policy("full"), max_new_tokens=1, stats=StatsRequest(n_sink=1, n_bins=4))
    prefill = [e for e in Generation(loaded, spec, ids).events() if e.kind == "prefill"][0]
    for layer, attention in enumerate(attention_rows(model, ids)):
        seeing = 6 if loaded.arch.is_sliding(layer) else 30
        sink = attention[0, :, :seeing, 0].mean(-1)
        torch.testing.assert_close(prefill.stats["sink_mass"][layer, 0], sink, atol=1e-5, rtol=1e-4)
        assert prefill.stats["sink_queries"][layer, 0].tolist() == [seeing] * attention.shape[1]
