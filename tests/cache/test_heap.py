"""The KV heap in its three layouts: the same results in every layout and in static (graph-ready) decode steps,
memory accounting read from the tensors, a bitmask that never reallocates, and a threshold that compacts exactly
where it should."""

from __future__ import annotations

import pytest
import torch
from tiny_models import ARCHITECTURES, prompt, runs_in, small_policy, tiny_model

from kvlab.budget import Budget
from kvlab.cache.layer import FREE
from kvlab.cache.layouts import DEFAULT_COMPACT_AT, LAYOUTS, HeapLayout
from kvlab.cache.spec import CacheSpec
from kvlab.engine.generation import Generation, generate, prefill_once
from kvlab.engine.spec import RunSpec
from kvlab.errors import KvlabError
from kvlab.models.loading import wrap_model
from kvlab.policies import POLICIES, evicting, make_policy


@pytest.fixture(scope="module", params=ARCHITECTURES)
def arch(request):
    return request.param, wrap_model(tiny_model(request.param))


def spec(policy: str, mode: str, layout: str, budget: int | None = 12, **changes) -> RunSpec:
    compact_at = changes.pop("compact_at", DEFAULT_COMPACT_AT)
    values = dict(mode=mode, chunk=7, max_new_tokens=10, stop_token_ids=(), cache=CacheSpec(layout, compact_at))
    values.update(changes)
    return RunSpec(small_policy(policy), None if budget is None else Budget(tokens=budget), **values)


def run(loaded, run_spec: RunSpec, ids: torch.Tensor, suffix: torch.Tensor | None = None):
    """Tokens, survivors after every event, and the result of a generation."""
    generation = Generation(loaded, run_spec, ids, suffix)
    tokens, kept = [], []
    for event in generation.events():
        kept.append([s.tolist() for s in event.survivors()])
        if event.kind == "decode":
            tokens.append(event.token_ids)
    return tokens, kept, generation


#: The architectures the every-policy checks (layouts, static steps) run on: Gemma-2 adds what the others lack
#: (sliding windows, soft-capping); layouts and static mode are the heap's, the same code on every architecture, and
#: the other tests here cover all four.
EVERY_POLICY_ARCHITECTURES = ("llama", "gemma2")


@pytest.mark.parametrize("arch", EVERY_POLICY_ARCHITECTURES, indirect=True)
@pytest.mark.parametrize("policy,mode", [(policy, mode) for policy in evicting() for mode in runs_in(policy)])
def test_every_layout_keeps_the_same_tokens_and_answers_the_same(arch, policy, mode):
    _, loaded = arch
    ids, question = prompt(batch=2, length=41, seed=3), prompt(batch=2, length=4, seed=8)
    reference = run(loaded, spec(policy, mode, "compact"), ids, question)
    for layout in ("bitmask", "threshold"):
        tokens, kept, _ = run(loaded, spec(policy, mode, layout), ids, question)
        assert tokens == reference[0], (policy, mode, layout)
        assert kept == reference[1], (policy, mode, layout)


@pytest.mark.parametrize("arch", EVERY_POLICY_ARCHITECTURES, indirect=True)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("policy", list(POLICIES))
def test_static_decode_steps_give_the_tokens_of_eager_decoding(arch, policy, layout):
    _, loaded = arch
    ids = prompt(batch=2, length=40, seed=5)
    for mode in runs_in(policy):
        budget = 14 if POLICIES[policy].evicts else None
        eager, eager_kept, eager_run = run(loaded, spec(policy, mode, layout, budget, static=False), ids)
        static, static_kept, static_run = run(loaded, spec(policy, mode, layout, budget, static=True), ids)
        assert static == eager, (policy, mode, layout)
        assert static_kept == eager_kept
        assert static_run.peak_kv_bytes == eager_run.peak_kv_bytes
        assert static_run.peak_kv_reserved_bytes == eager_run.peak_kv_reserved_bytes
        # no growing back to the plan (eager decoding may reserve more: it resizes a layer at every compaction)
        assert static_run.cache.reserved_bytes() <= eager_run.cache.reserved_bytes()
        assert static_run.cache.compactions == eager_run.cache.compactions
        assert static_run.decode_graphs == 0  # a CPU runs static steps eagerly


@pytest.mark.parametrize("policy", ["h2o", "snapkv", "chunkkv"])
def test_static_steps_keep_the_tokens_with_an_eviction_interval_and_a_budget_filled_while_decoding(policy):
    """Several tokens appended between two evictions (or none evicted for a while): H2O's accumulated scores, and
    the pooling along positions of SnapKV and ChunkKV over slots freed and refilled out of order."""
    loaded = wrap_model(tiny_model("llama"))
    ids = prompt(length=20, seed=2)
    for changes in ({"compression_interval": 3}, {"budget": 26}):
        values = {"budget": 12, **changes}
        budget = values.pop("budget")
        eager = run(loaded, spec(policy, "streaming", "bitmask", budget, static=False, **values), ids)
        static = run(loaded, spec(policy, "streaming", "bitmask", budget, static=True, **values), ids)
        assert static[0] == eager[0] and static[1] == eager[1], (policy, changes)
        assert static[2].cache.static and not eager[2].cache.static  # the steps were static ones


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
def test_budget_at_least_length_equals_full_in_every_layout(arch, layout):
    _, loaded = arch
    ids = prompt(length=40)
    full = generate(loaded, ids, spec("full", "prefill", layout, None))
    for policy in evicting():
        for mode in runs_in(policy):
            result = generate(loaded, ids, spec(policy, mode, layout, budget=50))
            assert result.tokens == full.tokens, (policy, mode, layout)


def test_a_bitmask_never_reallocates_its_tensors():
    loaded = wrap_model(tiny_model("mistral"))
    generation = Generation(loaded, spec("h2o", "streaming", "bitmask", budget=12), prompt(length=60))
    pointers = None
    dead_shares = []
    for event in generation.events():
        now = [
            (layer.keys.data_ptr(), layer.values.data_ptr(), layer.positions.data_ptr())
            for layer in generation.cache.layers
        ]
        pointers = pointers or now
        assert now == pointers
        dead_shares.append(event.dead_share)
    assert generation.cache.compactions == 0 and max(dead_shares) > 0
    assert all(layer.capacity == layer.planned for layer in generation.cache.layers)


@pytest.mark.parametrize("compact_at,compacts", [(0.3, True), (0.4, False)])
def test_the_threshold_layout_compacts_exactly_when_the_dead_share_reaches_it(compact_at, compacts):
    """Budget 16 and chunks of 8: after each chunk's eviction 8 of 24 slots in use are dead (a share of 1/3)."""
    loaded = wrap_model(tiny_model("llama"))
    generation = Generation(
        loaded,
        spec("streaming", "streaming", "threshold", budget=16, chunk=8, compact_at=compact_at, max_new_tokens=1),
        prompt(length=48),
    )
    shares = []
    for event in generation.events():
        if event.kind == "prefill":
            shares.append((event.seen_tokens, event.dead_share, event.compactions))
    # 48 tokens in chunks of 8: the first eviction is after the third chunk (24 > 16)
    assert [seen for seen, _, _ in shares] == [8, 16, 24, 32, 40, 48]
    if compacts:
        assert [share for _, share, _ in shares] == [0.0] * 6
        assert shares[-1][2] == 4 * loaded.arch.num_layers
    else:
        assert [round(share, 4) for _, share, _ in shares[2:]] == [round(1 / 3, 4)] * 4
        assert shares[-1][2] == 0


def test_prefill_mode_compaction_returns_memory_and_a_bitmask_holds_it():
    loaded = wrap_model(tiny_model("llama"))
    ids = prompt(length=80)
    bitmask = generate(loaded, ids, spec("h2o", "prefill", "bitmask", budget=20, max_new_tokens=6))
    compact = generate(loaded, ids, spec("h2o", "prefill", "compact", budget=20, max_new_tokens=6))
    slot = 2 * loaded.arch.num_kv_heads * loaded.arch.head_dim * loaded.kv_bytes_per_element
    layers = loaded.arch.num_layers
    assert bitmask.kv_reserved_bytes == (80 + 6) * slot * layers  # planned once, held to the end
    assert compact.kv_reserved_bytes == (20 + 6) * slot * layers  # survivors plus room for the answer
    assert bitmask.kv_bytes == compact.kv_bytes == (20 + 5) * slot * layers  # live: the last token is never fed
    assert bitmask.peak_kv_reserved_bytes == compact.peak_kv_reserved_bytes == (80 + 6) * slot * layers
    assert round(bitmask.dead_share, 6) == round((80 - 20 - 5) / 80, 6) and compact.dead_share == 0.0
    assert bitmask.tokens == compact.tokens and compact.compactions == layers


@pytest.mark.parametrize("layout", LAYOUTS)
def test_bytes_are_those_of_the_tensors_held(layout):
    loaded = wrap_model(tiny_model("qwen2"))
    generation = Generation(loaded, spec("tova", "streaming", layout, budget=12, chunk=6), prompt(batch=2, length=50))
    budget_plus_chunk = 0
    slot = 2 * 2 * loaded.arch.num_kv_heads * loaded.arch.head_dim * loaded.kv_bytes_per_element
    for event in generation.events():
        layers = generation.cache.layers
        reserved = sum(layer.keys.numel() * layer.keys.element_size() * 2 for layer in layers)
        live = sum(int((layer.positions[0, 0] != FREE).sum()) for layer in layers) * slot
        assert event.kv_reserved_bytes == reserved and event.kv_bytes == live
        assert all(kept <= 12 + 6 for kept in event.kept_per_layer)
        budget_plus_chunk = max(budget_plus_chunk, max(layer.capacity for layer in layers))
    assert budget_plus_chunk <= 12 + 6
    assert generation.peak_kv_bytes <= (12 + 6) * slot * loaded.arch.num_layers


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("chunk", [None, 9])
def test_a_shared_prefill_gives_each_layout_the_result_of_its_own_run(layout, chunk):
    loaded = wrap_model(tiny_model("llama"))
    ids, question = prompt(batch=2, length=40, seed=4), prompt(batch=2, length=5, seed=6)
    policies = [small_policy(name) for name in ("h2o", "snapkv", "knorm")]
    shared = prefill_once(loaded, ids, policies, chunk=chunk)
    for policy in policies:
        run_spec = RunSpec(
            policy, Budget(tokens=12), chunk=chunk, max_new_tokens=6, stop_token_ids=(), cache=CacheSpec(layout)
        )
        alone = generate(loaded, ids, run_spec, suffix_ids=question)
        forked = generate(loaded, None, run_spec, suffix_ids=question, prefilled=shared)
        assert forked.tokens == alone.tokens and forked.kept_per_layer == alone.kept_per_layer, policy.name
    assert all(layer.shared == set() or layer.keys is not None for layer in shared.cache.layers)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("static", [False, True])
def test_a_fork_that_outgrows_its_shared_context_decodes_like_its_own_run(layout, static):
    """A large budget keeps most of the context, so the question and the new tokens do not fit the tensors the
    fork shares with the context's read: the fork grows to its own plan, also before static steps (as on a GPU)."""
    loaded = wrap_model(tiny_model("llama"))
    ids, question = prompt(length=40, seed=4), prompt(length=5, seed=6)
    policy = small_policy("h2o")
    shared = prefill_once(loaded, ids, [policy])
    run_spec = RunSpec(
        policy, Budget(keep=0.8), max_new_tokens=10, stop_token_ids=(), cache=CacheSpec(layout), static=static
    )
    alone = generate(loaded, ids, run_spec, suffix_ids=question)
    forked = generate(loaded, None, run_spec, suffix_ids=question, prefilled=shared)
    assert forked.tokens == alone.tokens and forked.kept_per_layer == alone.kept_per_layer
    assert forked.kv_reserved_bytes == alone.kv_reserved_bytes


def test_a_layout_is_checked():
    with pytest.raises(KvlabError, match="Unknown layout 'heap'; use one of compact, bitmask, threshold"):
        RunSpec(make_policy("full"), cache=CacheSpec(layout="heap"))
    with pytest.raises(KvlabError, match="dead share in \\(0, 1\\]"):
        HeapLayout("threshold", 0.0)


class _FakeEvent:
    """A recorded device event whose elapsed time to another is fixed (what a CUDA event pair reports)."""

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, other: "_FakeEvent") -> float:
        return 2.0  # milliseconds


def test_clock_totals_read_device_clocks_in_bounded_memory():
    from kvlab.cache.clocks import PENDING_CLOCKS, ClockTotal, DeviceClock

    total = ClockTotal()
    for _ in range(3 * PENDING_CLOCKS):
        total.add(DeviceClock(_FakeEvent(), _FakeEvent()))
    assert len(total.pending) < PENDING_CLOCKS
    assert total.seconds() == pytest.approx(3 * PENDING_CLOCKS * 0.002)
    host = ClockTotal()
    host.add(DeviceClock(1.0, 1.5))
    assert host.pending == [] and host.seconds() == 0.5
