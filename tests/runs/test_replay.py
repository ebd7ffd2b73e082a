"""Replays: a live run's trace packed into the store and unpacked without a model, equal to what the run recorded
at every event, and two runs of one prompt scrubbed to the same position."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from kvlab.budget import Budget
from kvlab.dashboard import live_figures
from kvlab.errors import KvlabError
from kvlab.runs.live import LiveRun, LiveSettings, LiveTrace, NeedleTask, build_prompt
from kvlab.runs.live_store import generated_texts, store_live_run
from kvlab.runs.replay import Replay, pack, showcase, unpack
from kvlab.store import open_store


def finished(shipped, policy: str, chunk: int = 64, keep: float = 0.25) -> LiveRun:
    """A finished streaming run on a 256-token needle prompt."""
    prompt = build_prompt(shipped, NeedleTask(context_tokens=256, depth=0.5))
    run = LiveRun(shipped, prompt, LiveSettings(policy, {}, Budget(keep=keep), "streaming", chunk, 6, n_bins=32))
    for _ in run.events():
        pass
    return run


def assert_same(one: LiveTrace, other: LiveTrace) -> None:
    """Two traces hold the same events, statistics, bytes, survivors and tokens."""
    assert len(one.observed) == len(other.observed) and one.memory == other.memory
    for a, b in zip(one.observed, other.observed):
        assert (a.kind, a.first_position, a.end_position) == (b.kind, b.first_position, b.end_position)
        for name in ("pooled", "held", "sinks_held", "entropy", "sink_mass"):
            np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
    assert len(one.survivors) == len(other.survivors)
    for a, b in zip(one.survivors, other.survivors):
        np.testing.assert_array_equal(a, b)
    assert one.token_ids == other.token_ids and one.seen_tokens == other.seen_tokens


@pytest.fixture(scope="module")
def h2o_run(shipped) -> LiveRun:
    return finished(shipped, "h2o")


@pytest.mark.model
def test_a_trace_at_each_event_is_the_trace_as_it_stood_then(shipped):
    run = LiveRun(
        shipped,
        build_prompt(shipped, NeedleTask(context_tokens=200, depth=0.3)),
        LiveSettings("snapkv", {}, Budget(tokens=48), "streaming", chunk=50, max_new_tokens=4, n_bins=16),
    )
    snapshots = []
    for _ in run.events():  # a deep copy of what the figures would draw after each event
        trace = run.trace
        snapshots.append(
            (len(trace.observed), list(trace.memory), [s.copy() for s in trace.survivors], list(trace.token_ids))
        )
    for index, (observed, memory, survivors, tokens) in enumerate(snapshots):
        then = run.trace.at(index)
        assert len(then.observed) == observed and then.memory == memory and then.token_ids == tokens
        assert all(np.array_equal(a, b) for a, b in zip(then.survivors, survivors))
    assert len(snapshots) == len(run.trace.history) > 6


@pytest.mark.model
def test_a_packed_trace_unpacks_equal_and_small(h2o_run):
    texts = generated_texts(h2o_run)
    payload = pack(h2o_run.trace, texts, {"policy": "h2o"})
    replay = unpack(payload)
    assert_same(replay.trace, h2o_run.trace)
    for index in range(len(h2o_run.trace.history)):
        assert_same(replay.trace.at(index), h2o_run.trace.at(index))
    assert replay.texts == texts and replay.texts[0] == "" and replay.about == {"policy": "h2o"}
    assert len(payload) < 64 * 1024  # a 256-token run on the shipped model: kilobytes, not megabytes
    for build in (live_figures.memory_figure, live_figures.cache_map, live_figures.sink_figure):
        assert build(replay.trace).to_dict() == build(h2o_run.trace).to_dict()


@pytest.mark.model
def test_a_damaged_or_newer_payload_is_one_sentence(h2o_run):
    payload = pack(h2o_run.trace, generated_texts(h2o_run), {})
    with pytest.raises(KvlabError, match="cannot be read"):
        unpack(payload[: len(payload) // 2])
    with pytest.raises(ValueError, match="texts"):
        pack(h2o_run.trace, ["only one"], {})


@pytest.mark.model
def test_two_runs_of_one_prompt_scrub_to_the_same_position(shipped, h2o_run):
    other = finished(shipped, "snapkv", chunk=32)
    one = Replay(h2o_run.trace, generated_texts(h2o_run))
    two = Replay(other.trace, generated_texts(other))
    for position in (0, 64, 128, 255, 256, 258, 10_000):
        for replay in (one, two):
            trace, text = replay.at(position)
            assert trace.seen_tokens <= max(position, replay.positions[0])
            assert text == replay.texts[len(trace.token_ids)]
    assert one.at(128)[0].seen_tokens == two.at(128)[0].seen_tokens == 128  # chunks of 64 and 32 both end at 128
    assert len(one.at(10_000)[0].memory) == len(h2o_run.trace.memory)


@pytest.mark.model
def test_a_stored_live_run_keeps_its_replay(shipped, h2o_run, tmp_path):
    store = open_store(tmp_path / "runs.duckdb")
    run_id = store_live_run(store, h2o_run, h2o_run.outcome(), started_by="ann")
    assert store_live_run(store, h2o_run, h2o_run.outcome()) == run_id  # the replay is replaced, not duplicated
    listed = store.replays()
    assert listed["run_id"].tolist() == [run_id] and listed.loc[0, "policy"] == "h2o"
    assert listed.loc[0, "replay_bytes"] > 0 and bool(listed.loc[0, "correct"]) == h2o_run.outcome().contains
    replay = unpack(store.replay_payload(run_id, listed.loc[0, "trial_key"]))
    assert_same(replay.trace, h2o_run.trace)
    assert replay.about["model"] == shipped.source.label and replay.about["device"] == "cpu"
    assert replay.about["policy"].startswith("h2o · streaming · keep 25%")
    with pytest.raises(KvlabError, match="no stored replay"):
        store.replay_payload(run_id, "another trial")
    store.close()


def test_the_overview_first_shows_a_model_with_sinks_where_eviction_still_finds_the_answer():
    replays = pd.DataFrame(
        {
            "policy": ["streaming", "full", "h2o", "snapkv", "full"],
            "correct": [False, True, None, True, True],
            "model": ["tiny"] * 4 + ["published"],
        }
    )
    assert showcase(replays.iloc[:4]) == 3  # the full cache evicts nothing; h2o was not scored
    assert showcase(replays.iloc[1:3]) == 1  # none found it after evicting: the first that evicts
    assert showcase(replays.iloc[1:2]) == 0  # none evicts: the newest
    assert showcase(replays, without_sinks={"tiny"}) == 4  # a model with sinks first, though it evicts nothing
    assert showcase(replays.iloc[:4], without_sinks={"tiny"}) == 3  # no other model: the same rule


@pytest.mark.model
def test_a_run_whose_heads_hold_different_counts_replays_and_draws(shipped):
    run = LiveRun(
        shipped,
        build_prompt(shipped, NeedleTask(context_tokens=200, depth=0.3)),
        LiveSettings("snapkv", {"head_allocation": "adakv"}, Budget(tokens=48), "prefill", None, 4, n_bins=16),
    )
    for _ in run.events():
        pass
    heads = [layer for layer in run.trace.survivors if (layer < 0).any()]
    assert heads, "Ada-KV leaves some head of some layer with fewer tokens than another"
    assert all(((layer >= 0).sum(axis=-1) <= layer.shape[-1]).all() for layer in run.trace.survivors)
    replay = unpack(pack(run.trace, generated_texts(run), {"policy": "snapkv"}))
    assert_same(replay.trace, run.trace)
    assert replay.trace.kept_per_layer() == run.trace.kept_per_layer()
    matrix, _ = live_figures.survival(run.trace)
    assert np.nanmax(matrix) <= 1.0 and not np.isnan(matrix[:, 0]).all()
