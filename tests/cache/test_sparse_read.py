"""Sparse reads (Quest, RocketKV): a selection of the held cache per decoded token, masked into attention, with the
bytes held and the bytes read counted apart."""

from __future__ import annotations

import pytest
import torch
from tiny_models import prompt, tiny_model

from kvlab.budget import Budget
from kvlab.cache.sparse import page_key_bounds, page_of_slots, quest_bounds
from kvlab.cache.spec import CacheSpec
from kvlab.engine.generation import Generation, generate
from kvlab.engine.spec import RunSpec
from kvlab.errors import KvlabError
from kvlab.models.loading import load_model, wrap_model
from kvlab.policies import POLICIES, evicting, make_policy, sparse_readers
from kvlab.policies.base import check_budget
from kvlab.policies.quest import QuestRead
from kvlab.runs.sweep import SweepGrid, SweepRunner
from kvlab.store import open_store

NEW_TOKENS = 6


@pytest.fixture(scope="module")
def llama():
    return wrap_model(tiny_model("llama"))


def element_bytes(loaded) -> int:
    """Bytes of one key (or value) of one sequence and KV head."""
    return loaded.arch.head_dim * loaded.kv_bytes_per_element


def decoded(loaded, spec: RunSpec, ids: torch.Tensor) -> tuple[list[list[int]], torch.Tensor, Generation]:
    """Tokens, the logits of every decode step (eager steps carry them) and the generation."""
    generation = Generation(loaded, spec, ids)
    events = [event for event in generation.events() if event.kind == "decode"]
    return [event.token_ids for event in events], torch.stack([event.logits for event in events]), generation


def test_the_sparse_readers_take_a_read_budget_and_are_not_evicting_methods():
    assert set(sparse_readers()) == {"quest", "rocketkv"} and not set(sparse_readers()) & set(evicting())
    assert all(POLICIES[name].evicts for name in sparse_readers())  # they take a budget: sweeps plan them with one
    with pytest.raises(KvlabError, match="'quest' reads a budget of tokens per decoded token, so it needs a budget"):
        check_budget(make_policy("quest"), None, 100)
    assert check_budget(make_policy("quest"), Budget(keep=0.25), 100) == 25
    assert check_budget(make_policy("quest"), Budget(keep=1.0), 100) is None  # reading everything is the full cache
    with pytest.raises(KvlabError, match="multiple must be 0 or at least 1"):
        make_policy("rocketkv", multiple=0.5)
    with pytest.raises(KvlabError, match="odd"):
        make_policy("rocketkv", kernel=4)


@pytest.mark.parametrize("mode", ["prefill", "streaming"])
def test_a_read_budget_covering_the_cache_equals_full(llama, mode):
    """Quest reading every page, and RocketKV whose top-k (half its budget) covers what stage 1 keeps, which then
    keeps everything: the tokens and logits of the full cache, and Quest reads exactly what the full cache reads."""
    ids = prompt(length=40)
    common = dict(mode=mode, chunk=9, max_new_tokens=NEW_TOKENS, stop_token_ids=(), static=False)
    tokens, logits, full = decoded(llama, RunSpec(make_policy("full"), **common), ids)
    span = 40 + NEW_TOKENS  # Quest reads whole pages: 48 tokens cover the 12 pages of 4 the run fills
    covering = ((make_policy("quest", page_size=4, dense_layers=1), 48), (make_policy("rocketkv", window=4), 2 * span))
    for policy, budget in covering:
        sparse_tokens, sparse_logits, sparse = decoded(llama, RunSpec.of(policy, Budget(tokens=budget), **common), ids)
        assert sparse_tokens == tokens, policy.name
        torch.testing.assert_close(sparse_logits, logits, atol=1e-4, rtol=1e-4)
        assert sparse.result().kept_per_layer == full.result().kept_per_layer
        if policy.name == "quest":  # every page fits: no page bound is read, nor any token twice
            assert sparse.result().read_bytes_per_token == full.result().read_bytes_per_token


def test_quest_reads_fewer_bytes_than_it_holds_and_counts_what_it_read(llama):
    """One decode step over 41 held tokens, pages of 4, a budget of 12 (3 pages): the dense first layer reads its 41
    tokens; each sparse layer reads all 11 pages' minimum and maximum keys, then the newest page (1 token) and the two
    best full pages (8 tokens)."""
    spec = RunSpec(make_policy("quest", page_size=4, dense_layers=1), Budget(tokens=12), max_new_tokens=2)
    result = generate(llama, prompt(length=40), spec)
    per_head = element_bytes(llama) * llama.arch.num_kv_heads  # batch of one
    dense = 41 * 2 * per_head
    sparse = (9 * 2 + 11 * 2) * per_head
    assert result.read_bytes_per_token == dense + 2 * sparse
    assert result.kept_per_layer == [41] * 3 and result.kv_bytes == 3 * dense
    assert result.read_bytes_per_token < result.kv_bytes


def test_rocketkv_keeps_its_stage_one_budget_and_counts_what_it_read(llama):
    """A read budget of 8 over 42 tokens: c = 5.25, r = 0.2 + 0.06 log2 c = 0.3435, stage 1 keeps int(42 / c^r) = 23;
    stage 2's ratio 23 / 8 gives pages of 2 tokens and int(16 * 2 / 2.875) = 11 of 16 components; after one decode
    step 24 tokens fill 12 pages, and the top 4 tokens are read exactly."""
    ids = prompt(length=40)
    spec = RunSpec(make_policy("rocketkv", window=4), Budget(tokens=8), max_new_tokens=2)
    generation = Generation(llama, spec, ids)
    compress = [event for event in generation.events() if event.kind == "compress"]
    assert [event.kept_per_layer for event in compress] == [[23] * 3]
    result = generation.result()
    per_head = llama.kv_bytes_per_element * llama.arch.num_kv_heads
    assert result.read_bytes_per_token == 3 * (4 * 2 * llama.arch.head_dim + 12 * 11) * per_head
    assert result.read_bytes_per_token < result.kv_bytes == 3 * 24 * 2 * llama.arch.head_dim * per_head
    doubled = RunSpec(make_policy("rocketkv", window=4, multiple=2.0), Budget(tokens=8), max_new_tokens=1)
    assert generate(llama, ids, doubled).kept_per_layer == [16] * 3


def test_quest_bounds_equal_the_formula_and_bound_every_key_of_their_page():
    """Slots out of position order, two not allowed: pages are 3 consecutive allowed tokens by position, and each
    page's bound is sum_i max(q_i min_i, q_i max_i), at least q . k for every key of the page and query head; two pages
    are read: the newest and the one whose bound, the largest over its query heads, is the higher."""
    generator = torch.Generator().manual_seed(0)
    batch, kv_heads, group, slots, head_dim, page_size = 1, 2, 2, 11, 6, 3
    keys = torch.randn(batch, kv_heads, slots, head_dim, generator=generator)
    query = torch.randn(batch, kv_heads, group, head_dim, generator=generator)
    positions = torch.stack([torch.randperm(slots, generator=generator) for _ in range(kv_heads)]).unsqueeze(0)
    allowed = positions < 9  # positions 9 and 10: in the query's future
    page, pages = page_of_slots(positions.int(), allowed, page_size, in_order=False)
    low, high = page_key_bounds(keys, page, pages)
    bounds = quest_bounds(query, low, high)
    assert pages == 4 and bounds.shape == (batch, kv_heads, group, pages)
    for head in range(kv_heads):
        by_position = keys[0, head][positions[0, head].argsort()][:9]
        for number in range(3):
            members = by_position[page_size * number : page_size * (number + 1)]
            assert torch.equal(low[0, head, number], members.min(0).values)
            assert torch.equal(high[0, head, number], members.max(0).values)
            for q in range(group):
                vector = query[0, head, q]
                direct = torch.maximum(vector * members.min(0).values, vector * members.max(0).values).sum()
                torch.testing.assert_close(bounds[0, head, q, number], direct)
                assert ((members @ vector) <= bounds[0, head, q, number] + 1e-5).all()
            in_page = (page[0, head] == number).nonzero().flatten()
            assert sorted(positions[0, head, in_page].tolist()) == list(range(3 * number, 3 * number + 3))
        assert (page[0, head][~allowed[0, head]] == pages).all()
    selected, metadata = QuestRead(6, None, 0, page_size).select(
        query.reshape(batch, kv_heads * group, 1, head_dim), keys, positions.int(), allowed, in_order=False
    )
    best = bounds.amax(dim=2)[..., :2].argmax(-1)  # the newest page (2) and the better of the two before it
    for head in range(kv_heads):
        read_pages = set(page[0, head][selected[0, head]].tolist())
        assert read_pages == {2, int(best[0, head])} and int(selected[0, head].sum()) == 6
    assert metadata.tolist() == [[3 * 2 * head_dim] * kv_heads]
    ordered = torch.arange(slots).expand(batch, kv_heads, slots).int()
    in_order = page_of_slots(ordered, ordered < 9, page_size, in_order=True)[0]
    assert torch.equal(in_order, page_of_slots(ordered, ordered < 9, page_size, in_order=False)[0])


@pytest.mark.parametrize("mode", ["prefill", "streaming"])
def test_static_decode_steps_read_and_answer_as_eager_ones(llama, mode):
    """A bitmask heap (slots out of position order once RocketKV has evicted): the same tokens and the same bytes read
    in static steps (eager on a CPU) as in eager steps, each sequence of the batch selecting its own tokens."""
    ids = prompt(batch=2, length=40, seed=5)
    for policy in (make_policy("quest", page_size=4, dense_layers=0), make_policy("rocketkv", window=4)):
        eager, static = (
            generate(
                llama,
                ids,
                RunSpec(
                    policy,
                    Budget(tokens=8),
                    mode=mode,
                    chunk=10,
                    max_new_tokens=6,
                    stop_token_ids=(),
                    cache=CacheSpec(layout="bitmask"),
                    static=static,
                ),
            )
            for static in (False, True)
        )
        assert static.tokens == eager.tokens, (policy.name, mode)
        assert static.read_bytes_per_token == eager.read_bytes_per_token
        assert eager.read_bytes_per_token is not None and eager.read_bytes_per_token < eager.peak_kv_bytes


def test_a_sweep_of_sparse_readers_stores_their_trials_with_bytes_held_and_read(checkpoint, tmp_path):
    store = open_store(tmp_path / "runs.duckdb")
    grid = SweepGrid(
        policies=(make_policy("quest"), make_policy("rocketkv")),
        keeps=(0.25,),
        contexts=(256,),
        depths=(0.5,),
        trials=1,
        max_new_tokens=4,
    )
    summary = SweepRunner(load_model(checkpoint), store, grid).run()
    assert summary.ran == 2
    trials = store.trials_frame().set_index("policy")
    assert (trials["keep"] == 0.25).all()
    assert (trials["read_bytes"] < trials["kv_bytes"]).all()
    assert trials.loc["quest", "kept_tokens"] > 256 > trials.loc["rocketkv", "kept_tokens"]
    store.close()
