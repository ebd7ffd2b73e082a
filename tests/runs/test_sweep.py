"""Sweeps: the same items for every cell, one stored trial per grid cell and trial, resumable after a real kill."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from kvlab.errors import KvlabError
from kvlab.models.loading import load_model
from kvlab.policies import make_policy
from kvlab.runs.sweep import InProcess, SweepGrid, SweepRunner, needle_items, parse_policies
from kvlab.store import RunFilter, open_store
from kvlab.tasks.items import has_chat_template, stop_token_ids

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def loaded(checkpoint):
    return load_model(checkpoint)


def grid(**changes) -> SweepGrid:
    values = dict(
        policies=(make_policy("full"), make_policy("h2o"), make_policy("streaming")),
        keeps=(0.5,),
        contexts=(256,),
        depths=(0.0, 1.0),
        trials=2,
        modes=("prefill", "streaming"),
        chunk=32,
        max_new_tokens=4,
        batch_size=3,
    )
    values.update(changes)
    return SweepGrid(**values)


def test_a_grid_builds_its_prompts_and_runs_by_its_bos_rule(loaded):
    bos = loaded.tokenizer.bos_token_id  # the tiny checkpoint's tokenizer has a BOS it does not add
    runner = InProcess(loaded)
    cell = grid().cells()[0]
    for rule, first in (("auto", False), ("always", True)):
        chosen = grid(bos=rule)
        items = needle_items(loaded, chosen, 256)
        assert all(item.context_tokens == 256 and (item.context_ids[0] == bos) == first for _, item in items)
        assert runner.spec(chosen, cell).bos == rule
        assert runner.config(chosen, cell, 256).bos == (None if first else "auto")


def test_items_have_the_requested_length_and_are_the_same_every_time(loaded):
    first = needle_items(loaded, grid(), 256)
    again = needle_items(loaded, grid(), 256)
    assert [key for key, _ in first] == sorted(f"depth={d:.4f}/trial={t}" for d in (0.0, 1.0) for t in range(2))
    assert first == again
    assert all(item.context_tokens == 256 for _, item in first)
    assert needle_items(loaded, grid(seed=1), 256) != first
    randoms = needle_items(loaded, grid(depths=None, trials=5), 256)
    assert len({item.depth for _, item in randoms}) == 5


@pytest.mark.slow
def test_a_sweep_stores_one_trial_per_cell_and_skips_them_when_run_again(loaded, tmp_path):
    store = open_store(tmp_path / "runs.duckdb")
    summary = SweepRunner(loaded, store, grid()).run()
    cells = 1 + 2 * 2  # full once; h2o and streaming in two modes at one keep
    assert summary.ran == cells * 4 and summary.skipped == 0
    runs = store.list_runs()
    assert len(runs) == cells and set(runs["status"]) == {"finished"}
    assert sorted(runs["trials"]) == [4] * cells
    again = SweepRunner(loaded, store, grid()).run()
    assert again.ran == 0 and again.skipped == cells * 4
    trials = store.trials_frame()
    assert len(trials) == cells * 4
    assert not trials.duplicated(["run_id", "trial_key"]).any()
    assert (trials["kv_bytes"] > 0).all() and (trials["context_tokens"] == 256).all()
    h2o = trials[(trials["policy"] == "h2o") & (trials["mode"] == "streaming")]
    full = trials[trials["policy"] == "full"]
    assert (h2o["peak_kv_bytes"] < full["peak_kv_bytes"].max()).all()


@pytest.mark.slow
def test_sharing_the_prefill_changes_nothing_but_the_time(loaded, tmp_path):
    outputs = {}
    for share in (True, False):
        store = open_store(tmp_path / f"share-{share}.duckdb")
        SweepRunner(loaded, store, grid(modes=("prefill",), share_prefill=share)).run()
        frame = store.trials_frame().sort_values(["policy", "trial_key"])
        outputs[share] = frame[["policy", "trial_key", "output", "kv_bytes", "peak_kv_bytes"]].values.tolist()
        store.close()
    assert outputs[True] == outputs[False]


@pytest.mark.slow
def test_a_stop_request_marks_the_runs_interrupted_and_a_rerun_completes_them(loaded, tmp_path):
    store = open_store(tmp_path / "runs.duckdb")
    calls = {"n": 0}

    def stop_after_two() -> bool:
        calls["n"] += 1
        return calls["n"] > 2

    stopped = SweepRunner(loaded, store, grid(), should_stop=stop_after_two).run()
    assert stopped.stopped and 0 < stopped.ran < 20
    assert "interrupted" in set(store.list_runs()["status"])
    resumed = SweepRunner(loaded, store, grid()).run()
    assert resumed.skipped == stopped.ran and resumed.ran + resumed.skipped == 20
    assert set(store.list_runs()["status"]) == {"finished"}


def test_policies_and_their_parameters_parse_by_name():
    policies = parse_policies("snapkv,h2o", ["snapkv.window=8", "h2o.recent_ratio=0.25"])
    assert [p.params() for p in policies] == [
        {"window": 8, "kernel": 5, "pooling": "avg"},
        {"recent_ratio": 0.25, "accumulate": "sum"},
    ]
    with pytest.raises(KvlabError, match="policy.key=value"):
        parse_policies("h2o", ["window=8"])
    with pytest.raises(KvlabError, match="Unknown policy"):
        parse_policies("h2o,nope")


def test_bad_grids_are_refused():
    with pytest.raises(KvlabError, match="at most 1"):
        grid(keeps=(1.5,))
    with pytest.raises(KvlabError, match="depth"):
        grid(depths=(2.0,))
    with pytest.raises(KvlabError, match="Unknown mode"):
        grid(modes=("lazy",))


def test_a_sweep_too_large_to_plan_is_refused_before_it_is_listed(monkeypatch):
    assert grid().planned_trials() == len(grid().cells()) * 1 * 2 * 2  # cells x contexts x depths x trials
    with pytest.raises(KvlabError, match="plans 100,000,000,000 trials, more than the 1,000,000"):
        grid(trials=10**10)
    monkeypatch.setenv("KVLAB_MAX_SWEEP_TRIALS", "10")
    with pytest.raises(KvlabError, match="more than the 10 one sweep may have; split it, or set KVLAB_MAX_SWEEP"):
        grid()
    monkeypatch.setenv("KVLAB_MAX_SWEEP_TRIALS", "lots")
    with pytest.raises(KvlabError, match="KVLAB_MAX_SWEEP_TRIALS must be a positive whole number"):
        grid()


@pytest.mark.slow
@pytest.mark.long
def test_killing_a_sweep_process_and_running_it_again_leaves_one_row_per_cell_and_trial(checkpoint, tmp_path):
    db = tmp_path / "killed.duckdb"
    command = [
        sys.executable,
        "-m",
        "kvlab",
        "sweep",
        "--model",
        checkpoint,
        "--policies",
        "full,h2o,streaming,knorm",
        "--keep",
        "0.3,0.6",
        "--mode",
        "prefill,streaming",
        "--contexts",
        "256,320",
        "--depths",
        "0,0.5,1",
        "--trials",
        "2",
        "--chunk",
        "32",
        "--batch-size",
        "1",
        "--max-new-tokens",
        "4",
        "--db",
        str(db),
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    process = subprocess.Popen(command, stderr=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
    progressed = threading.Event()

    def watch() -> None:
        buffer = b""
        while chunk := process.stderr.read1(256):
            buffer = (buffer + chunk)[-400:]
            if any(int(done) >= 5 for done in re.findall(rb"(\d+)/\d+ \[[^\]]*trial", buffer)):
                progressed.set()

    threading.Thread(target=watch, daemon=True).start()
    assert progressed.wait(timeout=120), "the sweep made no progress"
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=60) == 130
    with open_store(db) as store:
        partial = len(store.trials_frame())
        assert "interrupted" in set(store.list_runs()["status"])
    cells = 1 + 3 * 2 * 2
    expected = cells * 2 * 3 * 2
    assert 0 < partial < expected
    finished = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert finished.returncode == 0, finished.stderr
    assert "were already stored" in finished.stdout
    with open_store(db) as store:
        trials = store.trials_frame()
        assert len(trials) == expected
        assert not trials.duplicated(["run_id", "trial_key"]).any()
        per_run = trials.groupby("run_id").size()
        assert len(per_run) == cells * 2 and set(per_run) == {6}
        assert set(store.list_runs(RunFilter())["status"]) == {"finished"}


def test_a_cell_whose_budget_is_below_the_policy_minimum_is_refused_before_anything_runs():
    with pytest.raises(KvlabError, match="snapkv's minimum"):
        grid(policies=(make_policy("snapkv"),), keeps=(0.1,), contexts=(256,))


def test_a_chat_model_answers_a_sweep_by_the_same_stop_rule_as_a_base_model(loaded, monkeypatch):
    """A sweep's prompts are plain text whatever the model: a chat model stops at the answer's line break too, so
    it neither runs on for all its tokens nor has a later line counted as its answer."""
    base = InProcess(loaded).stops
    monkeypatch.setattr(loaded.tokenizer, "chat_template", "{% for m in messages %}{{ m['content'] }}{% endfor %}")
    assert has_chat_template(loaded.tokenizer)
    assert InProcess(loaded).stops == base
    assert base.rule == "eos+line" and set(stop_token_ids(loaded.tokenizer)) <= set(base.token_ids)


def test_a_stop_request_ends_a_shared_unit_after_the_generation_in_flight(loaded, tmp_path, monkeypatch):
    """A stop asked while a unit's first cell is generating stores that cell's trials and starts no other cell of
    the unit; the runs left are interrupted and a rerun completes them."""
    store = open_store(tmp_path / "runs.duckdb")
    asked: list[bool] = []
    unit_trials = InProcess.unit_trials

    def first_job_asks_to_stop(self, grid, unit):
        for job, trials in unit_trials(self, grid, unit):
            asked.append(True)
            yield job, trials

    monkeypatch.setattr(InProcess, "unit_trials", first_job_asks_to_stop)
    sweep = grid(depths=(0.0,), trials=1, modes=("prefill",), batch_size=1)
    summary = SweepRunner(loaded, store, sweep, should_stop=lambda: bool(asked)).run()
    assert summary.stopped and summary.ran == 1 and len(asked) == 1
    assert sorted(store.list_runs()["status"]) == ["finished", "interrupted", "interrupted"]
    monkeypatch.undo()
    again = SweepRunner(loaded, store, sweep).run()
    assert again.ran == 2 and again.skipped == 1
    assert set(store.list_runs()["status"]) == {"finished"}
