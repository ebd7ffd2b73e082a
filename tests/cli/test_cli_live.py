"""``kvlab live``: one observed run from the command line, stored with its replay, as the dashboard's live page
stores one; bad input is one sentence before any model loads."""

from __future__ import annotations

import pytest
from test_cli import run

from kvlab.runs.replay import unpack
from kvlab.store import open_store


@pytest.mark.model
def test_a_live_run_is_stored_with_its_replay(tmp_path, capsys):
    db = tmp_path / "runs.duckdb"
    argv = ("live", "--context", "200", "--policy", "h2o", "--keep", "0.3", "--max-new-tokens", "4", "--chunk", "64")
    status, out, err = run(capsys, *argv, "--db", str(db))
    assert status == 0
    assert "[h2o, streaming] 200 prompt tokens" in err and "stored as run 1 with its replay" in err
    with open_store(db, read_only=True) as store:
        replays = store.replays()
        assert replays["run_id"].tolist() == [1] and replays.loc[0, "context_length"] == 200
        replay = unpack(store.replay_payload(1, replays.loc[0, "trial_key"]))
    assert replay.positions[:4] == [64, 128, 192, 200] and replay.about["device"] == "cpu"
    assert replay.about["policy"].startswith("h2o · streaming · keep 30%")


@pytest.mark.model
def test_a_text_without_an_answer_is_run_but_not_stored(tmp_path, capsys):
    text = tmp_path / "notes.txt"
    text.write_text("The cache keeps what matters. " * 20)
    status, _, err = run(capsys, "live", "--text-file", str(text), "--max-new-tokens", "2", "--db", str(tmp_path / "r"))
    assert status == 0 and "not stored: give --answer" in err


def test_bad_input_is_one_sentence_before_the_model_loads(tmp_path, capsys):
    status, out, err = run(capsys, "live", "--policy", "h2o", "--db", str(tmp_path / "r.duckdb"))
    assert status == 2 and out == "" and "needs a budget" in err and err.count("\n") == 1
    status, _, err = run(capsys, "live", "--context", "10")
    assert status == 2 and "--context must be at least 64" in err
