"""A live run on the shipped model: its prompt, its trace, its outcome and how it is stored."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvlab.budget import Budget
from kvlab.engine.generation import Generation
from kvlab.errors import KvlabError
from kvlab.runs.live import LiveRun, LiveSettings, NeedleTask, RedrawClock, TextTask, build_prompt, warm_up
from kvlab.runs.live_store import store_live_run
from kvlab.store import open_store
from kvlab.tasks.needle import score

pytestmark = pytest.mark.model


def run_to_end(run: LiveRun) -> list:
    return list(run.events())


def test_a_needle_prompt_has_the_asked_length_and_knows_where_its_needle_is(shipped):
    prompt = build_prompt(shipped, NeedleTask(context_tokens=300, depth=0.5, template="access-code", seed=3))
    assert prompt.context_tokens == 300 and prompt.task == "needle"
    start, end = prompt.needle
    statement = shipped.tokenizer.decode(prompt.context_ids[start:end])
    assert prompt.answer in statement and "access code" in statement
    assert 0.3 < start / 300 < 0.7
    assert prompt.question.startswith("What is the access code of")
    again = build_prompt(shipped, NeedleTask(context_tokens=300, depth=0.5, template="access-code", seed=3))
    assert again.trial_key == prompt.trial_key and again.context_ids == prompt.context_ids
    with pytest.raises(KvlabError, match="Unknown fact template"):
        build_prompt(shipped, NeedleTask(300, 0.5, template="no-such-template"))


def test_text_prompts(shipped):
    asked = build_prompt(
        shipped, TextTask("The cache keeps what matters.", "What does the cache keep?", "what matters")
    )
    assert asked.question_ids and asked.answer == "what matters" and asked.task == "text"
    plain = build_prompt(shipped, TextTask("The attention sink is"))
    assert plain.question_ids == () and plain.answer is None
    assert plain.context_ids[0] == shipped.tokenizer.bos_token_id
    with pytest.raises(KvlabError, match="no text to read"):
        build_prompt(shipped, TextTask("   ", "a question?"))


def test_a_streaming_run_records_every_pass_and_its_memory(shipped, tmp_path):
    prompt = build_prompt(shipped, NeedleTask(context_tokens=256, depth=0.25))
    settings = LiveSettings(
        "h2o", {"recent_ratio": 0.5}, Budget(keep=0.25), "streaming", chunk=64, max_new_tokens=8, n_bins=32
    )
    run = LiveRun(shipped, prompt, settings)
    events = run_to_end(run)
    trace = run.trace
    assert [step.kind for step in trace.observed][:4] == ["prefill"] * 4
    assert len(trace.memory) == len(events) and trace.span == 256 + 8
    budget = 64  # ceil(0.25 x 256)
    assert all(kept <= budget for kept in trace.kept_per_layer())
    assert max(point.kv_bytes for point in trace.memory) <= trace.memory[-1].kv_bytes_full
    first = trace.observed[0]
    assert first.pooled.shape == (shipped.arch.num_layers, 32) and first.held[:, 8:].sum() == 0  # nothing read yet
    np.testing.assert_allclose(first.pooled.sum(axis=1), 1.0, rtol=1e-4)  # each pass's attention sums to one
    assert len(trace.token_ids) == len([e for e in events if e.kind == "decode"])
    outcome = run.outcome()
    measured = outcome.result
    assert measured.prefill_seconds == pytest.approx(sum(e.seconds for e in events if e.kind != "decode"))
    assert measured.decode_seconds == pytest.approx(sum(e.seconds for e in events if e.kind == "decode"))
    assert measured.kv_bytes == events[-1].kv_bytes and measured.peak_kv_bytes >= measured.kv_bytes
    assert outcome.contains == score(outcome.text, prompt.answer).contains
    assert 0.0 <= trace.needle_held() <= 1.0

    store = open_store(tmp_path / "runs.duckdb")
    run_id = store_live_run(store, run, outcome, started_by="ann")
    assert store_live_run(store, run, outcome) == run_id  # the same run, not a new one
    runs = store.list_runs()
    assert len(runs) == 1 and runs.loc[0, "trials"] == 1 and runs.loc[0, "keep"] == 0.25
    assert runs.loc[0, "task"] == "needle" and runs.loc[0, "status"] == "finished"
    assert runs.loc[0, "started_by"] == "ann" and runs.loc[0, "weights_hash"]
    trial = store.trials_frame().iloc[0]
    assert trial["kv_bytes"] == measured.kv_bytes and trial["prefill_s"] == pytest.approx(measured.prefill_seconds)
    assert trial["context_tokens"] == 256 and trial["depth"] == prompt.depth
    store.close()


def test_prefill_mode_compresses_once_after_reading(shipped):
    prompt = build_prompt(shipped, NeedleTask(context_tokens=200, depth=0.5))
    run = LiveRun(
        shipped,
        prompt,
        LiveSettings(
            "snapkv", {"window": 8}, Budget(tokens=40), "prefill", chunk=100, max_new_tokens=4, query_aware=False
        ),
    )
    kinds = [event.kind for event in run_to_end(run)]
    assert kinds[:3] == ["prefill", "prefill", "compress"]
    memory = run.trace.memory
    assert memory[2].kv_bytes < memory[1].kv_bytes  # the compression freed memory


def test_an_unscored_text_run_is_not_stored(shipped, tmp_path):
    prompt = build_prompt(shipped, TextTask("def cache(size):\n    return", ""))
    run = LiveRun(shipped, prompt, LiveSettings("full", max_new_tokens=3, chunk=16))
    run_to_end(run)
    outcome = run.outcome()
    assert outcome.contains is None and len(run.trace.token_ids) == 3
    store = open_store(tmp_path / "runs.duckdb")
    assert store_live_run(store, run, outcome) is None
    assert store.list_runs().empty
    store.close()


def test_running_out_of_gpu_memory_is_one_sentence(shipped, monkeypatch):
    def exhausted(self, ids):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

    monkeypatch.setattr(Generation, "forward", exhausted)
    run = LiveRun(shipped, build_prompt(shipped, NeedleTask(128, 0.5)), LiveSettings("h2o", budget=Budget(keep=0.5)))
    with pytest.raises(KvlabError, match="ran out of memory after 0 tokens"):
        run_to_end(run)


def test_a_budget_below_the_policy_minimum_is_refused_before_running(shipped):
    with pytest.raises(KvlabError, match="smaller than snapkv's minimum"):
        LiveRun(shipped, build_prompt(shipped, NeedleTask(128, 0.5)), LiveSettings("snapkv", budget=Budget(tokens=8)))


def test_warm_up_runs(shipped):
    warm_up(shipped)


def test_a_running_page_redraws_at_most_once_per_interval(shipped):
    run = LiveRun(
        shipped,
        build_prompt(shipped, NeedleTask(context_tokens=256, depth=0.5)),
        LiveSettings("h2o", {}, Budget(keep=0.25), "streaming", chunk=32, max_new_tokens=8, n_bins=16),
    )
    now = [0.0]
    clock = RedrawClock(interval_s=1.0, every_decoded=4, clock=lambda: now[0])
    drawn = []
    for index, _ in enumerate(run.events()):
        now[0] = 0.4 * index  # each event takes 0.4 s
        if clock.due(run.trace):
            drawn.append(index)
    assert drawn[0] == 0  # the first event is drawn at once
    assert all(later - earlier >= 3 for earlier, later in zip(drawn, drawn[1:]))  # 1 s apart: every third event
    assert len(run.trace.history) > 3 * len(drawn) - 3
