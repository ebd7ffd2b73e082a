"""The ``runs`` and ``export`` subcommands, called through an argparse parser as the main command will."""

from __future__ import annotations

import argparse
from pathlib import Path

import pandas as pd
import pytest

from kvlab.cli.store import filters_from_args, register
from kvlab.errors import KvlabError
from kvlab.provenance import Provenance
from kvlab.stats import bootstrap_interval
from kvlab.store import RunConfig, RunFilter, Trial, open_store
from kvlab.tasks.ruler_score import ruler_task_id

PROVENANCE = Provenance("0.0.0", None, {})


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="kvlab")
    register(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(argv)


@pytest.fixture
def db(tmp_path: Path):
    """A database with three runs: h2o and tova on one model, h2o on another."""
    path = tmp_path / "runs.duckdb"
    store = open_store(path)
    for model, policy in (("llama", "h2o"), ("llama", "tova"), ("qwen", "h2o")):
        run_id = store.begin_run(
            RunConfig(model=model, policy=policy, mode="decode", task="needle", keep=0.5), provenance=PROVENANCE
        )
        store.add_trials(run_id, [Trial(f"{policy}-{i}", "needle-0", 1024, correct=i == 0) for i in range(2)])
    yield path
    store.close()


def test_filters_combine_repeated_options_and_comma_lists() -> None:
    args = parse("export", "--out", "x.csv", "--run-id", "1,2", "--run-id", "5", "--policy", "h2o", "--mode", "a,b")
    assert filters_from_args(args) == RunFilter(run_ids=(1, 2, 5), policies=("h2o",), modes=("a", "b"))
    assert filters_from_args(parse("runs")) == RunFilter()


def test_a_run_id_that_is_not_a_number_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as usage:
        parse("runs", "--run-id", "1,x")
    assert usage.value.code == 2
    assert "'1,x' is not a comma-separated list of int" in capsys.readouterr().err


def test_runs_lists_the_matching_runs(db: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = parse("runs", "--db", str(db), "--policy", "h2o")
    assert args.func(args) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:4] == ["run_id", "status", "model", "policy"]
    assert [line.split()[:4] for line in lines[1:]] == [
        ["1", "running", "llama", "h2o"],
        ["3", "running", "qwen", "h2o"],
    ]


def test_runs_says_when_nothing_matches(db: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = parse("runs", "--db", str(db), "--model", "mistral")
    assert args.func(args) == 0
    assert capsys.readouterr().out.strip() == f"No matching runs in {db}."


def test_export_writes_the_filtered_trials(db: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "llama.parquet"
    args = parse("export", "--db", str(db), "--out", str(out), "--model", "llama", "--run-id", "2,3")
    assert args.func(args) == 0
    assert capsys.readouterr().out.strip() == f"Wrote 2 trials to {out}."
    frame = pd.read_parquet(out)
    assert frame[["run_id", "model", "policy", "trial_key"]].values.tolist() == [
        [2, "llama", "tova", "tova-0"],
        [2, "llama", "tova", "tova-1"],
    ]


def test_export_of_runs_writes_one_row_per_run(db: Path, tmp_path: Path) -> None:
    out = tmp_path / "runs.csv"
    args = parse("export", "--db", str(db), "--out", str(out), "--table", "runs")
    assert args.func(args) == 0
    assert pd.read_csv(out)[["run_id", "trials", "accuracy"]].values.tolist() == [[1, 2, 0.5], [2, 2, 0.5], [3, 2, 0.5]]


def test_the_database_defaults_to_kvlab_db(db: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    monkeypatch.setenv("KVLAB_DB", str(db))
    args = parse("runs", "--task", "needle")
    assert args.func(args) == 0
    assert len(capsys.readouterr().out.splitlines()) == 4


def test_reading_commands_never_create_a_database(tmp_path: Path) -> None:
    missing = tmp_path / "typo.duckdb"
    for argv in (("runs",), ("export", "--out", str(tmp_path / "x.csv"))):
        args = parse(*argv, "--db", str(missing))
        with pytest.raises(KvlabError, match="There is no kvlab database at"):
            args.func(args)
    assert list(tmp_path.iterdir()) == []


def test_runs_prints_intervals_and_the_tie_share(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "runs.duckdb"
    with open_store(path) as store:
        run_id = store.begin_run(
            RunConfig(model="llama", policy="h2o", mode="prefill", task="ruler", keep=0.5), provenance=PROVENANCE
        )
        recalls = [1.0, 0.5, 0.0, 1.0]
        store.add_trials(
            run_id,
            [
                Trial(
                    f"t{i}",
                    ruler_task_id("niah_multivalue", 1024, i),
                    1024,
                    correct=recall == 1.0,
                    recall=recall,
                    tie_share=0.125 * i,
                )
                for i, recall in enumerate(recalls)
            ],
        )
        store.begin_run(RunConfig(model="llama", policy="full", mode="prefill", task="quality:text"))
    args = parse("runs", "--db", str(path))
    assert args.func(args) == 0
    header, ruler, text = capsys.readouterr().out.splitlines()
    columns = header.split()
    assert columns[columns.index("trials") :][:8] == [
        "trials",
        "accuracy",
        "accuracy_ci",
        "recall",
        "recall_ci",
        "ruler",
        "ruler_ci",
        "tie_share",
    ]
    fields = dict(zip(columns, ruler.split()))
    assert (fields["accuracy"], fields["accuracy_ci"]) == ("0.5", "0.150–0.850")  # Wilson, 2 of 4
    assert fields["recall"] == "0.625" and fields["tie_share"] == "0.188"
    low, high = bootstrap_interval(recalls)
    assert fields["recall_ci"] == f"{low:.3f}–{high:.3f}"
    assert (fields["ruler"], fields["ruler_ci"]) == ("0.625", fields["recall_ci"])  # one task: its mean recall
    assert dict(zip(columns, text.split()))["accuracy_ci"] == "—"  # a run without trials has none
