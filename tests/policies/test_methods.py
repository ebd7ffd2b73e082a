"""KeyDiff, Expected Attention and ChunkKV: their scores are their papers' formulas, their budgets hold in both modes,
and a budget covering the sequence changes nothing."""

from __future__ import annotations

import math

import pytest
import torch
from tiny_models import prompt, small_policy, tiny_model

from kvlab.budget import Budget
from kvlab.cache.layer import FREE, AttentionShape, HeapLayer, QueryMoments
from kvlab.cache.ranking import KEEP
from kvlab.engine.generation import Generation, generate
from kvlab.engine.spec import RunSpec
from kvlab.errors import KvlabError
from kvlab.models.loading import wrap_model
from kvlab.models.rope import Rope
from kvlab.policies import configure, make_policy
from kvlab.policies.base import LayerView
from kvlab.policies.chunkkv import chunk_ids, chunk_ranks, chunk_sums, in_chunks_of

METHODS = ("keydiff", "expected_attention", "chunkkv")


@pytest.fixture(scope="module")
def llama():
    return wrap_model(tiny_model("llama"))


def hand_view(
    keys: torch.Tensor,
    positions: list[int],
    values: torch.Tensor | None = None,
    moments: QueryMoments | None = None,
    rope: Rope | None = None,
    next_position: int | None = None,
) -> LayerView:
    """A view of one hand-built layer holding ``keys`` (``(1, kv_heads, slots, head_dim)``) at ``positions`` (the
    same for every KV head; ``FREE`` where a slot is free), scaled as ``1/sqrt(head_dim)``."""
    kv_heads, slots, head_dim = keys.shape[1:]
    held = torch.tensor(positions, dtype=torch.int32).expand(1, kv_heads, slots).clone()
    live = sum(p >= 0 for p in positions)
    cache = HeapLayer(
        keys=keys, values=values, positions=held, live=live, used=slots, shape=AttentionShape(scaling=head_dim**-0.5)
    )
    cache.moments = moments
    after = max(positions) + 1 if next_position is None else next_position
    return LayerView(0, 1, cache, 4, 4, after, torch.Generator(), slots, rope=rope)


# --- KeyDiff --------------------------------------------------------------------------------------------------------


def test_keydiff_scores_are_the_negative_cosine_to_the_mean_unit_key_of_the_held_keys():
    generator = torch.Generator().manual_seed(0)
    keys = torch.randn(1, 2, 7, 8, generator=generator)
    positions = [0, 1, FREE, 3, 4, 5, 6]
    scores = make_policy("keydiff").score(hand_view(keys, positions))
    assert scores.shape == (1, 2, 7)
    held = [slot for slot, position in enumerate(positions) if position >= 0]
    for head in range(2):
        unit = [keys[0, head, slot] / keys[0, head, slot].norm() for slot in held]
        anchor = sum(unit) / len(unit)
        for slot in held:
            key = keys[0, head, slot]
            expected = -float(key @ anchor) / (float(key.norm()) * float(anchor.norm()))
            assert float(scores[0, head, slot]) == pytest.approx(expected, abs=1e-5)
    changed = keys.clone()
    changed[:, :, 2] = 100.0  # a free slot's stale key takes no part in the anchor
    moved = make_policy("keydiff").score(hand_view(changed, positions))
    torch.testing.assert_close(moved[..., held], scores[..., held])


# --- Expected Attention ---------------------------------------------------------------------------------------------


def kvpress_expected_attention(queries, keys, values, next_position, n_future, n_sink, inv_freq):
    """kvpress 0.5.5's ``ExpectedAttentionPress.score`` written out on plain tensors: ``queries`` before RoPE
    ``(1, q_heads, n, d)`` (the sinks' already left out), ``keys``/``values`` ``(1, kv_heads, slots, d)`` with the
    slots in position order from 0."""
    head_dim = keys.shape[-1]
    mu = queries.mean(dim=2, keepdim=True)
    centred = queries - mu
    cov = torch.einsum("bnsi,bnsj->bnij", centred, centred) / queries.shape[2]
    mu = mu.squeeze(2)
    angles = torch.arange(next_position, next_position + n_future).float().unsqueeze(-1) * inv_freq
    angles = torch.cat([angles, angles], dim=-1)
    cos, sin = angles.cos(), angles.sin()
    identity = torch.eye(head_dim)
    swap = torch.zeros(head_dim, head_dim)
    half = head_dim // 2
    swap[half:, :half], swap[:half, half:] = torch.eye(half), -torch.eye(half)
    rotation = (cos.unsqueeze(1) * identity + sin.unsqueeze(1) * swap).mean(dim=0)
    mu = mu @ rotation.T
    cov = rotation @ cov @ rotation.T
    keys, values = keys[:, :, n_sink:], values[:, :, n_sink:]
    batch, kv_heads, slots, _ = keys.shape
    groups = queries.shape[1] // kv_heads
    repeated = keys.repeat_interleave(groups, dim=1).transpose(2, 3)
    scores = (mu.unsqueeze(2) @ repeated).squeeze(2) / math.sqrt(head_dim)
    scores = scores + torch.einsum("bhin,bhij,bhjn->bhn", repeated, cov, repeated) / head_dim / 2
    scores = torch.softmax(scores, dim=-1).view(batch, kv_heads, groups, slots).mean(dim=2)
    return scores * values.norm(dim=-1)


def test_expected_attention_scores_are_the_papers_formula():
    generator = torch.Generator().manual_seed(1)
    head_dim, slots, n_sink, next_position, n_future = 8, 10, 2, 30, 16
    queries = torch.randn(1, 4, 20, head_dim, generator=generator)
    keys = torch.randn(1, 2, slots, head_dim, generator=generator)
    values = torch.randn(1, 2, slots, head_dim, generator=generator)
    inv_freq = 1.0 / 10000 ** (torch.arange(0, head_dim, 2).float() / head_dim)
    moments = QueryMoments.empty(1, 4, head_dim, torch.device("cpu"))
    moments.add(queries, torch.ones(20))
    free_key = torch.full((1, 2, 1, head_dim), 50.0)  # a free slot at the end: no part in the softmax
    view = hand_view(
        torch.cat([keys, free_key], dim=2),
        [*range(slots), FREE],
        values=torch.cat([values, free_key], dim=2),
        moments=moments,
        rope=Rope(inv_freq),
        next_position=next_position,
    )
    policy = make_policy("expected_attention", n_sink=n_sink, n_future_positions=n_future)
    scores = policy.score(view)
    assert scores.shape == (1, 2, slots + 1)
    expected = kvpress_expected_attention(queries, keys, values, next_position, n_future, n_sink, inv_freq)
    torch.testing.assert_close(scores[..., n_sink:slots], expected, atol=1e-6, rtol=1e-4)
    assert (scores[..., :n_sink] == KEEP).all()
    view.rope = None
    with pytest.raises(KvlabError, match="rotary embedding"):
        policy.score(view)


# --- ChunkKV --------------------------------------------------------------------------------------------------------


def test_chunks_are_aligned_to_original_positions():
    positions = torch.tensor([[[0, 1, 2, 5, 9, 10, 11, FREE]]])
    assert chunk_ids(positions, 4).tolist() == [[[0, 0, 0, 1, 2, 2, 2, 3]]]


def test_chunk_sums_add_each_chunk_in_position_order_whatever_the_slots_order():
    """Floats added one by one lose small votes after a large one and keep them before it, so a scatter's order of
    addition (which a GPU does not fix) would decide between chunks a rounding apart: each chunk is summed in
    position order, as kvpress sums it, whatever slots hold it; free slots count for nothing."""
    length = 4
    positions = torch.tensor([[[0, 1, 2, 3, 4, 5, 6, 8, FREE, FREE]]])
    votes = torch.tensor([[[1.0, 4e-8, 4e-8, 4e-8, 0.5, 0.25, 2.0, 4.0, 0.0, 0.0]]])
    chunks = chunk_ids(positions, length)
    sums = chunk_sums(votes, chunks, positions, length)
    expected = torch.tensor([1.0, 4e-8, 4e-8, 4e-8]).view(1, length).sum(dim=-1).item()
    assert sums[0, 0, :4].tolist() == [expected] * 4
    assert sums[0, 0, 4:].tolist() == [2.75, 2.75, 2.75, 4.0, 0.0, 0.0]
    shuffled = torch.tensor([1, 2, 3, 0, 9, 5, 8, 4, 6, 7])  # the small votes first
    again = chunk_sums(votes[..., shuffled], chunks[..., shuffled], positions[..., shuffled], length)
    assert torch.equal(again, sums[..., shuffled])


def paper_selection(
    votes: list[float], positions: list[int], budget: int, window: int, length: int, kernel: int = 5
) -> set[int]:
    """ChunkKV's choice written out: the votes for tokens before the window, in position order, averaged over
    ``kernel`` neighbours (zero beyond them and in the window); the window, then the rest of the chunks it reaches
    into, then whole chunks by their summed pooled votes (ties: the later chunk) while they fit, then the next
    chunk's tokens with the most pooled votes (ties: the later token)."""
    first_window = max(positions) + 1 - window
    ordered = sorted(zip(positions, votes))
    raw = [vote if position < first_window else 0.0 for position, vote in ordered]
    half = kernel // 2
    pooled = [sum(raw[max(i - half, 0) : i + half + 1]) / kernel for i in range(len(raw))]
    window_chunks = {position // length for position, _ in ordered if position >= first_window}
    kept = {position for position, _ in ordered if position >= first_window}
    chunks: dict[int, list[tuple[float, int]]] = {}
    for (position, _), vote in zip(ordered, pooled):
        if position < first_window:
            chunks.setdefault(position // length, []).append((vote, position))
    room = budget - len(kept)
    by_rank = sorted(chunks, key=lambda c: (c in window_chunks, sum(v for v, _ in chunks[c]), c), reverse=True)
    for chunk in by_rank:
        members = sorted(chunks[chunk], reverse=True)
        kept |= {position for _, position in members[:room]}
        if len(members) > room:
            break
        room -= len(members)
    return kept


def kvpress_chunk_selection(votes: list[float], window: int, length: int, kept_chunks: int) -> set[int]:
    """kvpress 0.5.5's ``ChunkKVPress`` rule written out: the window scored above every vote, chunks of ``length``
    from position 0 ranked by their mean score (the last one over its own tokens), the best ``kept_chunks`` kept
    whole."""
    scores = votes[:-window] + [max(votes) + 1.0] * window
    chunks = [list(range(start, min(start + length, len(scores)))) for start in range(0, len(scores), length)]
    ranked = sorted(chunks, key=lambda chunk: sum(scores[p] for p in chunk) / len(chunk), reverse=True)
    return {position for chunk in ranked[:kept_chunks] for position in chunk}


@pytest.mark.parametrize("seed", range(5))
def test_chunk_ranks_keep_the_chunks_kvpress_keeps_at_its_budget(seed):
    """Given the number of tokens kvpress keeps, the top of kvlab's chunk ranks (the window kept by rule) are its
    chunks: the chunk the window reaches into whole, then whole chunks by their votes."""
    tokens, window, length, kept_chunks = 23, 6, 4, 4
    votes = torch.rand(tokens, generator=torch.Generator().manual_seed(seed))
    votes[-window:] = 0.0
    positions = torch.arange(tokens).view(1, 1, tokens)
    recent = positions >= tokens - window
    chunks = chunk_ids(positions, length)
    first = in_chunks_of(recent, chunks)
    ranks = chunk_ranks(votes.view(1, 1, tokens), chunks, first, positions, length).masked_fill(recent, KEEP)
    expected = kvpress_chunk_selection(votes.tolist(), window, length, kept_chunks)
    assert set(ranks[0, 0].topk(len(expected)).indices.tolist()) == expected


@pytest.mark.parametrize("mode", ["prefill", "streaming"])
def test_chunkkv_keeps_the_window_and_whole_chunks_then_the_best_of_the_next(llama, mode, monkeypatch):
    """At every eviction, each layer keeps what the selection written out from its votes keeps."""
    policy = make_policy("chunkkv", window=4, chunk_length=4)
    spec = RunSpec.of(policy, Budget(tokens=14), mode=mode, chunk=9, max_new_tokens=4, stop_token_ids=())
    generation = Generation(llama, spec, prompt(batch=2, length=40, seed=5))
    evict, compress, checked = generation.evict, generation.compress, []

    def checked_cut(cut, next_position=None):
        """Run an eviction (``cut``) and check that every layer kept what the written-out selection keeps."""
        expected = []
        for view in generation.layer_views(next_position):
            votes, positions = view.window_attention().sum(dim=1), view.positions[:, 0]
            held = positions >= 0
            expected.append(
                [paper_selection(votes[b][held[b]].tolist(), positions[b][held[b]].tolist(), 14, 4, 4) for b in (0, 1)]
            )
        done = cut()
        for layer, kept in zip(generation.cache.layers, expected):
            for sequence in (0, 1):
                for head in range(llama.arch.num_kv_heads):
                    survivors = layer.held_positions()[sequence, head]
                    assert set(survivors[survivors >= 0].tolist()) == kept[sequence]
        checked.append(max(len(kept[0]) for kept in expected))
        return done

    def evicted(position=None):
        """A pass's eviction, checked where it cuts to the budget (prefill mode's passes cut only sliding windows,
        which this model has none of)."""
        if mode == "prefill":
            return evict(position)
        return checked_cut(lambda: evict(position), position)

    monkeypatch.setattr(generation, "evict", evicted)
    monkeypatch.setattr(generation, "compress", lambda step: checked_cut(lambda: compress(step)))
    list(generation.events())
    assert checked and max(checked) == 14


def test_chunkkv_refuses_an_even_pooling_kernel():
    with pytest.raises(KvlabError, match="odd"):
        make_policy("chunkkv", kernel=4)


def test_chunkkv_reuses_the_kept_positions_of_its_groups_first_layer(llama):
    policy = make_policy("chunkkv", window=4, reuse_layers=2)
    spec = RunSpec.of(policy, Budget(tokens=12), mode="streaming", chunk=7, max_new_tokens=4, stop_token_ids=())
    differ = False
    for event in Generation(llama, spec, prompt(length=40)).events():
        first, reused, own = event.survivors()
        assert torch.equal(first, reused)
        differ |= not torch.equal(first, own)
    assert differ
    with pytest.raises(KvlabError, match="same budget in every layer"):
        configure("chunkkv", reuse_layers=2, layer_allocation="preset")


# --- every method -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", METHODS)
def test_scores_have_one_value_per_slot_and_kv_head(llama, name):
    policy = small_policy(name)
    generation = Generation(llama, RunSpec.of(policy, Budget(tokens=12), max_new_tokens=0), prompt(batch=2, length=30))
    with torch.inference_mode():
        for _ in generation.read(generation.input_ids, 0):
            pass
        for view in generation.layer_views():
            scores = policy.score(view)
            assert scores.shape == (2, llama.arch.num_kv_heads, 30) and scores.dtype == torch.float32
            assert not scores.isnan().any()


@pytest.mark.parametrize("name", METHODS)
@pytest.mark.parametrize("mode", ["prefill", "streaming"])
def test_budgets_hold_and_a_budget_covering_the_sequence_changes_nothing(llama, name, mode):
    ids = prompt(batch=2, length=40, seed=2)
    spec = RunSpec(small_policy(name), Budget(tokens=12), mode=mode, chunk=6, max_new_tokens=5, stop_token_ids=())
    evictions = 0
    for event in Generation(llama, spec, ids).events():  # survivors are read as each event comes
        if event.kind == "compress" or (mode == "streaming" and event.seen_tokens >= 12):
            evictions += 1
            for positions in event.survivors():
                assert ((positions >= 0).sum(dim=-1) == 12).all()
    assert evictions
    covering = RunSpec(small_policy(name), Budget(tokens=60), mode=mode, chunk=6, max_new_tokens=5, stop_token_ids=())
    full = RunSpec(make_policy("full"), mode=mode, chunk=6, max_new_tokens=5, stop_token_ids=())
    assert generate(llama, ids, covering).tokens == generate(llama, ids, full).tokens
