"""A sweep's estimate: its arithmetic on synthetic speeds, the trials it counts as stored, and the time it estimates
against a real small sweep of the shipped model (generous bounds: a check, not a benchmark)."""

from __future__ import annotations

import time

import pandas as pd
import pytest

from kvlab.cli import main
from kvlab.policies import make_policy
from kvlab.runs.estimate import (
    Speed,
    SweepWork,
    duration_text,
    estimate_sentence,
    estimated_seconds,
    measure_speed,
    speed_from_trials,
    stored_speed,
    sweep_estimate,
    sweep_work,
)
from kvlab.runs.sweep import SweepGrid, SweepRunner

#: How far an estimate may be from the sweep it estimates, either way, on a busy machine.
FACTOR = 6


def small_grid(**changes) -> SweepGrid:
    settings = dict(
        policies=tuple(make_policy(name) for name in ("full", "h2o", "streaming")),
        keeps=(0.5,),
        contexts=(256,),
        depths=(0.0, 1.0),
        trials=1,
        batch_size=2,
        max_new_tokens=4,
    )
    return SweepGrid(**{**settings, **changes})


def test_the_time_is_the_tokens_read_and_the_answers_decoded():
    speed = Speed(read_s_per_token=0.001, decode_s_per_answer=0.5, basis="three made-up trials")
    work = SweepWork(trials=10, stored=4, read_tokens=3000)
    assert work.pending == 6
    assert estimated_seconds(work, speed) == pytest.approx(3000 * 0.001 + 6 * 0.5)
    assert estimated_seconds(SweepWork(10, 10, 0), speed) == 0
    doubled = Speed(0.002, 1.0, "slower")
    assert estimated_seconds(work, doubled) == pytest.approx(2 * estimated_seconds(work, speed))


@pytest.mark.parametrize(
    "seconds,text",
    [(0.4, "under a second"), (3.2, "about 4 s"), (89, "about 89 s"), (840, "about 14 min"), (9000, "about 2.5 h")],
)
def test_durations_are_rounded_as_estimates(seconds, text):
    assert duration_text(seconds) == text


def test_the_sentence_says_the_counts_the_time_and_what_it_is_based_on():
    speed = Speed(0.001, 0.5, "the median speed of 12 stored needle trials of this model on cpu")
    sentence = estimate_sentence(SweepWork(960, 0, 960_000), speed, "cpu")
    assert sentence == (
        "960 trials (0 stored); about 24 min on cpu for the 960 to run, from the median speed of 12 stored needle "
        "trials of this model on cpu (an estimate)."
    )
    assert estimate_sentence(SweepWork(4, 4, 0), speed, "cpu") == "4 trials (4 stored): nothing left to run."
    assert estimate_sentence(SweepWork(1, 0, 256), None, "cpu") == "1 trial (0 stored); 1 to run."


def test_a_speed_is_the_median_of_stored_trials_per_prompt():
    trials = pd.DataFrame(
        {
            "prefill_s": [0.2, 0.4, 10.0, None],
            "decode_s": [0.1, 0.3, 5.0, 0.2],
            "context_tokens": [200, 200, 200, 200],
        }
    )
    speed = speed_from_trials(trials, "needle trials")
    assert speed is not None
    assert speed.read_s_per_token == pytest.approx(0.002)  # the outlier of 10 s does not move the median
    assert speed.decode_s_per_answer == pytest.approx(0.3)
    assert speed.basis == "the median speed of 3 stored needle trials"
    assert speed_from_trials(trials.iloc[3:], "needle trials") is None


@pytest.mark.model
def test_a_shared_read_counts_once(shipped):
    work = sweep_work(shipped, small_grid(), None)
    # full reads its two prompts itself; h2o and streaming (prefill mode) share one read of the same two
    assert (work.trials, work.stored, work.read_tokens) == (6, 0, 4 * 256)
    assert sweep_work(shipped, small_grid(share_prefill=False), None).read_tokens == 6 * 256
    assert sweep_work(shipped, small_grid(modes=("streaming",)), None).read_tokens == 6 * 256


@pytest.mark.model
@pytest.mark.slow
def test_stored_trials_are_counted_and_the_estimate_comes_within_a_few_times_of_real_sweeps(shipped, store):
    first = small_grid(policies=(make_policy("full"), make_policy("h2o")))
    measured = measure_speed(shipped, first)
    assert measured.basis == "one timed read of 2 x 256 tokens and 8 decode steps on cpu just now"
    assert stored_speed(shipped, first, store) is None
    work = sweep_work(shipped, first, store)
    assert work == SweepWork(4, 0, 4 * 256)  # full and h2o each read the two prompts: nothing to share
    started = time.perf_counter()
    SweepRunner(shipped, store, first).run()
    took = time.perf_counter() - started
    assert took / FACTOR < estimated_seconds(work, measured) < took * FACTOR, (took, measured)

    assert sweep_work(shipped, first, store) == SweepWork(4, 4, 0)
    assert sweep_estimate(shipped, first, store, lambda: None) == "4 trials (4 stored): nothing left to run."
    assert sweep_work(shipped, small_grid(depths=(0.0, 0.5, 1.0)), store) == SweepWork(9, 4, 4 * 256)
    assert sweep_work(shipped, small_grid(max_new_tokens=2), store).stored == 0  # another answer length: other runs

    again = small_grid(policies=(make_policy("full"), make_policy("h2o")), seed=1)  # other items, nothing stored
    from_store = stored_speed(shipped, again, store)
    assert from_store is not None
    assert from_store.basis == "the median speed of 4 stored needle trials of this model on cpu"
    work = sweep_work(shipped, again, store)
    started = time.perf_counter()
    SweepRunner(shipped, store, again).run()
    took = time.perf_counter() - started
    assert took / FACTOR < estimated_seconds(work, from_store) < took * FACTOR, (took, from_store)
    assert sweep_estimate(shipped, small_grid(), store, lambda: None).endswith("(an estimate).")


@pytest.mark.model
@pytest.mark.slow
def test_the_sweep_command_says_its_estimate_and_a_dry_run_only_that(tmp_path, capsys):
    db = tmp_path / "runs.duckdb"
    sweep = ["sweep", "--policies", "full,h2o", "--keep", "0.5", "--contexts", "256", "--depths", "0,1"]
    sweep += ["--batch-size", "2", "--max-new-tokens", "4", "--db", str(db)]
    assert main([*sweep, "--dry-run"]) == 0
    out = capsys.readouterr().out.strip()
    assert out.startswith("4 trials (0 stored); ") and out.endswith("(an estimate).")
    assert "from one timed read of 2 x 256 tokens" in out
    assert not db.exists()  # a dry run creates no database

    assert main(sweep) == 0
    captured = capsys.readouterr()
    assert "4 trials (0 stored); " in captured.err and captured.out.startswith("ran 4 trials")
    assert main([*sweep, "--dry-run"]) == 0
    assert capsys.readouterr().out.strip() == "4 trials (4 stored): nothing left to run."
    assert main([*sweep, "--trials", "2", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("8 trials (4 stored); ") and "the median speed of 4 stored needle trials" in out
    assert main([*sweep, "--quiet"]) == 0
    assert "trials (" not in capsys.readouterr().err  # quiet: no estimate
