"""``kvlab claims``: evaluates every claim against a store and prints the chosen ones, reading the store only unless
``--refresh`` asks it to store the evaluation in its claims table."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from kvlab.claims import CATALOGUE, evidence
from kvlab.claims.report import as_table
from kvlab.cli import main
from kvlab.store import open_store


def claims(*argv: str) -> int:
    return main(["claims", *argv])


def test_the_table_shows_the_chosen_claims_and_every_claim_is_stored(tmp_path, capsys):
    db = tmp_path / "runs.duckdb"
    assert claims("--db", str(db), "--refresh", "--only", "5", "--only", "9,3") == 0
    out, err = capsys.readouterr()
    assert [line[:3].strip() for line in out.splitlines() if line[:3].strip().isdigit()] == ["3", "5", "9"]
    flat = " ".join(out.split())  # the table wraps long cells, a long path even inside a word
    assert "327,680 bytes" in flat and "does not hold" in flat
    missing = f"no runs of H2O, StreamingLLM or random eviction on the needle task at 4,096 tokens in {db}"
    assert "".join(missing.split()) in "".join(out.split())
    assert f"{len(CATALOGUE)} claims evaluated against {db}" in err
    with open_store(db, read_only=True) as store:
        assert len(store.claims_frame()) == len(CATALOGUE)


def test_without_refresh_the_store_is_only_read(tmp_path, capsys):
    db = tmp_path / "runs.duckdb"
    assert claims("--db", str(db), "--only", "1") == 0  # no store yet: evaluated as empty, none made
    assert not db.exists() and "read only (--refresh stores them)" in capsys.readouterr().err
    open_store(db).close()
    before = db.read_bytes()
    assert claims("--db", str(db)) == 0
    assert db.read_bytes() == before
    with open_store(db, read_only=True) as store:
        assert store.claims_frame().empty


def test_machine_readable_formats(tmp_path, capsys):
    db = str(tmp_path / "runs.duckdb")
    assert claims("--db", db, "--format", "json", "--only", "1,2") == 0
    rows = json.loads(capsys.readouterr().out)
    assert [row["claim_id"] for row in rows] == ["1", "2"] and rows[1]["verdict"] == "holds"
    assert claims("--db", db, "--format", "csv") == 0
    frame = pd.read_csv(io.StringIO(capsys.readouterr().out), dtype=str)
    assert len(frame) == len(CATALOGUE) and list(frame.columns)[:3] == ["claim_id", "article", "claim"]
    assert (frame["figure"].notna() | frame["reason"].notna()).all()
    assert claims("--db", db, "--format", "markdown", "--only", "3") == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("| # | article | claim | kvlab |") and lines[2].startswith("| 3 |")


def test_an_unknown_claim_or_format_is_refused_before_any_store_is_made(tmp_path, capsys):
    db = tmp_path / "runs.duckdb"
    assert claims("--db", str(db), "--only", "5,99") == 2
    assert "no claim 99" in capsys.readouterr().err and not db.exists()
    assert claims("--db", str(db), "--format", "html") == 2
    assert "invalid choice" in capsys.readouterr().err and not db.exists()


def test_a_store_that_is_not_kvlabs_is_one_sentence(tmp_path, capsys):
    db = tmp_path / "notes.duckdb"
    db.write_text("not a database")
    assert claims("--db", str(db)) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and len(err.strip().splitlines()) == 1


def test_the_shipped_evidence_is_the_default_when_there_is_one(tmp_path, monkeypatch):
    monkeypatch.setenv("KVLAB_DB", str(tmp_path / "mine.duckdb"))
    monkeypatch.setattr(evidence, "EVIDENCE_DB", tmp_path / "evidence.duckdb")
    assert evidence.default_claims_db() == tmp_path / "mine.duckdb"
    open_store(tmp_path / "evidence.duckdb").close()
    assert evidence.default_claims_db() == tmp_path / "evidence.duckdb"


def test_the_table_wraps_long_figures_under_their_label(tmp_path):
    from kvlab.claims import evaluate_file

    text = as_table(evaluate_file(tmp_path / "none.duckdb")[8:9], width=60)  # claim 9: a long reason
    lines = text.splitlines()
    assert all(len(line) <= 60 for line in lines)
    assert lines[1].startswith("     ") and any(line.startswith("     reason   no runs of") for line in lines)


@pytest.mark.slow
def test_evaluating_from_the_command_line_loads_no_torch(tmp_path):
    code = (
        "import sys; from kvlab.cli import main; "
        f"main(['claims', '--db', {str(tmp_path / 'x.duckdb')!r}, '--format', 'json']); "
        "print('torch' in sys.modules, file=sys.stderr)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stderr.strip().endswith("False") and len(json.loads(done.stdout)) == len(CATALOGUE)


@pytest.fixture(autouse=True)
def _no_repository_writes():
    """The commands here write only under tmp_path: the shipped evidence store, if any, is left as it was."""
    shipped: Path = evidence.EVIDENCE_DB
    before = shipped.stat().st_mtime_ns if shipped.exists() else None
    yield
    assert (shipped.stat().st_mtime_ns if shipped.exists() else None) == before


@pytest.fixture
def installed(tmp_path, monkeypatch) -> Path:
    """kvlab as a wheel installs it: no source checkout, its shipped files under ``tmp_path/data`` (the shipped
    evidence store among them) and no benchmark results."""
    from kvlab import paths

    monkeypatch.setattr(paths, "checkout", lambda package_dir=paths.PACKAGE_DIR: None)
    monkeypatch.setattr(paths, "SHIPPED_DIR", tmp_path / "data")
    monkeypatch.delenv(paths.BENCH_RESULTS_ENV, raising=False)
    shipped = tmp_path / "data" / "runs" / "claims.duckdb"
    monkeypatch.setattr(evidence, "EVIDENCE_DB", shipped)
    open_store(shipped).close()
    return shipped


def test_an_installed_kvlab_evaluates_its_shipped_evidence_without_writing_it(installed, capsys):
    before = (installed.read_bytes(), installed.stat().st_mtime_ns)
    assert claims("--only", "1,29") == 0
    out, err = capsys.readouterr()
    flat = " ".join(out.split())
    assert [line[:3].strip() for line in out.splitlines() if line[:3].strip().isdigit()] == ["1", "29"]
    assert "bench/results/attention (the benchmark results are not installed when kvlab runs from a wheel" in flat
    assert f"claims evaluated against {installed}, read only" in err
    assert claims("--refresh") == 2
    assert "is installed with kvlab and is not written" in capsys.readouterr().err
    assert (installed.read_bytes(), installed.stat().st_mtime_ns) == before
    with open_store(installed, read_only=True) as store:
        assert store.claims_frame().empty


def test_the_benchmark_results_can_be_named_for_an_installed_kvlab(installed, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("KVLAB_BENCH_RESULTS", str(tmp_path / "results"))
    assert evidence.Evidence(None, installed).results == tmp_path / "results"
    assert claims("--only", "29", "--format", "json") == 0
    [row] = json.loads(capsys.readouterr().out)
    assert f"no attention profile in {tmp_path / 'results' / 'attention'}" in row["reason"]
