"""The store under careless and hostile use: other applications' files, read-only reads, older schemas, damaged
blocks, full disks and exports that must never destroy a database or leak formulas into a spreadsheet."""

from __future__ import annotations

import contextlib
import csv
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import duckdb
import pandas as pd
import pytest
from disks import fill, small_disk
from old_schemas import at_schema

from kvlab.errors import KvlabError
from kvlab.provenance import Provenance
from kvlab.store import MIGRATIONS, RunConfig, Trial, export_runs, export_trials, open_store
from kvlab.store.connection import close

REPO = Path(__file__).resolve().parents[2]
PROVENANCE = Provenance("0.0.0", None, {})
CONFIG = RunConfig(model="m", policy="h2o", mode="prefill", task="needle", keep=0.5, seed=0, max_new_tokens=24)


def trial(key: str, **changes) -> Trial:
    return Trial(**{"trial_key": key, "task_id": "t", "context_tokens": 100, "correct": True, **changes})


def write_v4_database(path: Path) -> None:
    """A database as kvlab's schema 4 left it: one finished run (keyed without the settings schema 5 added)."""
    with duckdb.connect(str(path)) as connection:
        at_schema(connection, 4)
        connection.execute(
            "INSERT INTO runs (run_key, status, model, policy, mode, task, policy_params, keep, seed, started_at) "
            "VALUES ('old-key', 'finished', 'm', 'h2o', 'prefill', 'needle', '{}', 0.5, 0, '2025-01-01 10:00')"
        )
        connection.execute(
            "INSERT INTO trials (run_id, trial_key, task_id, context_tokens, correct, exact) "
            "VALUES (1, 'd0', 'n0', 512, FALSE, FALSE)"
        )


def fingerprint(path: Path) -> tuple[bytes, int]:
    return path.read_bytes(), path.stat().st_mtime_ns


def kvlab(*argv: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kvlab", *argv], capture_output=True, text=True, cwd=REPO, timeout=120, **kwargs
    )


# --- other applications' files and read-only reads -----------------------------------------------------------------


def test_another_applications_database_with_a_schema_version_table_is_refused_untouched(tmp_path: Path) -> None:
    path = tmp_path / "billing.duckdb"
    with duckdb.connect(str(path)) as connection:
        connection.execute(
            "CREATE TABLE schema_version (version INTEGER); INSERT INTO schema_version VALUES (1);"
            "CREATE TABLE invoices (id INTEGER); INSERT INTO invoices VALUES (7)"
        )
    before = fingerprint(path)
    for read_only in (True, False):
        with pytest.raises(KvlabError, match="is a DuckDB database but not a kvlab one; it was left untouched"):
            open_store(path, read_only=read_only)
    done = kvlab("runs", "--db", str(path))
    assert done.returncode == 2 and "not a kvlab one" in done.stderr and "Traceback" not in done.stderr
    assert fingerprint(path) == before
    with duckdb.connect(str(path), read_only=True) as connection:
        assert connection.execute("SELECT version FROM schema_version").fetchall() == [(1,)]


@pytest.mark.slow
def test_an_older_kvlab_database_is_read_through_an_upgraded_copy_and_left_as_it_was(tmp_path: Path) -> None:
    path = tmp_path / "runs.duckdb"
    write_v4_database(path)
    before = fingerprint(path)
    store = open_store(path, read_only=True)
    try:
        runs = store.list_runs()
        assert runs["run_id"].tolist() == [1] and runs.loc[0, "trials"] == 1
        assert "max_new_tokens" in runs.columns and pd.isna(runs.loc[0, "max_new_tokens"])
        with pytest.raises(ValueError, match="read-only"):
            store.begin_run(CONFIG)
    finally:
        store.close()
    done = kvlab("export", "--db", str(path), "--out", str(tmp_path / "trials.csv"))
    assert done.returncode == 0, done.stderr
    assert fingerprint(path) == before
    with duckdb.connect(str(path), read_only=True) as connection:
        assert connection.execute("SELECT version FROM schema_version").fetchall() == [(4,)]


def test_migrating_an_older_database_never_merges_a_new_run_into_an_old_one(tmp_path: Path) -> None:
    path = tmp_path / "runs.duckdb"
    write_v4_database(path)
    store = open_store(path)
    try:
        new_run = store.begin_run(CONFIG, provenance=PROVENANCE)
        assert new_run != 1
        store.add_trials(new_run, [trial("d0")])
        runs = store.list_runs().set_index("run_id")
        assert runs.loc[1, "trials"] == 1 and runs.loc[new_run, "trials"] == 1
        assert runs.loc[1, "run_key"] == "old-key"
        meta = store.trials_frame()
        assert sorted(meta["correct"].tolist()) == [False, True]  # the old trial kept its own result
    finally:
        store.close()


@pytest.mark.slow
def test_a_database_on_a_read_only_file_system_is_listed(tmp_path: Path) -> None:
    source = tmp_path / "source"
    source.mkdir()
    store = open_store(source / "runs.duckdb")
    store.add_trials(store.begin_run(CONFIG, provenance=PROVENANCE), [trial("a")])
    store.close()
    before = fingerprint(source / "runs.duckdb")
    view = tmp_path / "read-only"
    view.mkdir()
    if subprocess.run(["mount", "--bind", str(source), str(view)], capture_output=True).returncode != 0:
        pytest.skip("cannot bind-mount a directory here")
    try:
        subprocess.run(["mount", "-o", "remount,ro,bind", str(view)], check=True, capture_output=True)
        done = kvlab("runs", "--db", str(view / "runs.duckdb"))
        assert done.returncode == 0, done.stderr
        assert " h2o " in done.stdout
    finally:
        subprocess.run(["umount", "-l", str(view)], check=False)
    assert fingerprint(source / "runs.duckdb") == before


# --- damaged files and full disks ----------------------------------------------------------------------------------


def damaged_copies(tmp_path: Path) -> Iterator[tuple[Path, bytes]]:
    """Copies of a real store of 3,000 trials, each with one 256 KiB block scrambled (and its bytes)."""
    path = tmp_path / "healthy.duckdb"
    store = open_store(path)
    store.add_trials(
        store.begin_run(CONFIG, provenance=PROVENANCE), [trial(f"k{i}", output="x" * 200) for i in range(3000)]
    )
    store.close()
    healthy = path.read_bytes()
    block = 262144
    for start in range(3 * 4096, len(healthy), block):
        data = bytearray(healthy)
        for offset in range(start + 8, min(start + block, len(data)), 97):
            data[offset] ^= 0xFF
        copy = tmp_path / f"copy-{start}.duckdb"
        copy.write_bytes(data)
        yield copy, bytes(data)


def damaged_database(tmp_path: Path) -> Path:
    """A store that opens, but one of whose data blocks cannot be read."""
    for copy, _ in damaged_copies(tmp_path):
        try:
            reader = open_store(copy, read_only=True)
        except KvlabError:
            continue
        try:
            reader.trials_frame()
        except KvlabError:
            return copy
        finally:
            close(reader.path)
    raise AssertionError("no block of the store held its trials")


@pytest.mark.slow
@pytest.mark.long
def test_a_damaged_block_inside_a_valid_database_is_one_sentence(tmp_path: Path) -> None:
    damaged_reads = 0
    for copy, data in damaged_copies(tmp_path):
        try:
            reader = open_store(copy, read_only=True)
        except KvlabError as refused:  # the damage hit the catalog: refused at opening
            assert "left untouched" in str(refused)
            continue
        try:
            reader.trials_frame()
        except KvlabError as error:
            damaged_reads += 1
            assert str(error).startswith(f"The database {copy} is damaged: part of it cannot be read (")
            assert "left untouched" in str(error) and "\n" not in str(error)
        finally:
            close(reader.path)
        assert copy.read_bytes() == data
    assert damaged_reads >= 1


@pytest.mark.slow
@pytest.mark.long
def test_a_writer_refuses_a_store_a_reader_calls_damaged_and_leaves_its_bytes(tmp_path: Path) -> None:
    copy = damaged_database(tmp_path)
    before = copy.read_bytes()
    with pytest.raises(KvlabError, match=f"The database {copy} is damaged: .*left untouched"):
        open_store(copy)
    done = kvlab("claims", "--db", str(copy), "--refresh")
    assert done.returncode == 2 and "is damaged" in done.stderr
    assert copy.read_bytes() == before


@contextlib.contextmanager
def tiny_disk(tmp_path: Path) -> Iterator[Path]:
    """A 4 MB tmpfs, or a skip where this process may not mount one."""
    try:
        with small_disk(tmp_path, 4) as disk:
            yield disk
    except OSError as error:
        if "cannot mount" not in str(error):
            raise
        pytest.skip(str(error))


@pytest.mark.slow
@pytest.mark.long
def test_a_full_disk_is_one_sentence_and_loses_nothing_stored(tmp_path: Path) -> None:
    with tiny_disk(tmp_path) as disk:
        path = disk / "runs.duckdb"
        store = open_store(path)
        run_id = store.begin_run(CONFIG, provenance=PROVENANCE)
        store.add_trials(run_id, [trial("before")])
        filler = fill(disk)
        with pytest.raises(KvlabError, match="could not be written because its disk is full") as refused:
            store.add_trials(run_id, [trial(f"k{i}", output="y" * 4000) for i in range(2000)])
        assert "\n" not in str(refused.value)
        with pytest.raises(KvlabError, match="disk is full"):
            open_store(disk / "new.duckdb")
        assert not (disk / "new.duckdb").exists()  # no empty file left to be called corrupt later
        filler.unlink()
        assert store.add_trial(run_id, trial("after"))
        store.close()
        reopened = open_store(path, read_only=True)
        assert sorted(reopened.trials_frame()["trial_key"]) == ["after", "before"]
        reopened.close()


def test_an_empty_file_holds_nothing_and_becomes_a_new_database(tmp_path: Path) -> None:
    path = tmp_path / "runs.duckdb"
    path.write_bytes(b"")
    with pytest.raises(KvlabError, match="There is no kvlab database"):
        open_store(path, read_only=True)
    store = open_store(path)
    assert store.list_runs().empty and store.schema_version() == len(MIGRATIONS)
    store.close()


# --- exports -------------------------------------------------------------------------------------------------------


@pytest.fixture
def filled(tmp_path: Path):
    path = tmp_path / "runs.duckdb"
    store = open_store(path)
    run_id = store.begin_run(CONFIG, provenance=PROVENANCE)
    store.add_trials(
        run_id,
        [
            trial("a", expected='=HYPERLINK("http://x","y")', output="+1"),
            trial("b", expected="@SUM(A1)", output="\tx"),
            trial("c", expected="-3", output="ok"),
        ],
    )
    yield store
    store.close()


def test_an_export_never_writes_over_the_database_it_reads(filled, tmp_path: Path) -> None:
    db = filled.path
    before = db.read_bytes()
    link = tmp_path / "link.csv"
    link.symlink_to(db)
    hard = tmp_path / "hard.csv"
    os.link(db, hard)
    for out in (link, hard):
        with pytest.raises(KvlabError, match="Refusing to export"):
            export_trials(filled, out)
    with pytest.raises(KvlabError, match="Refusing to export to .*link.csv: it is .*runs.duckdb"):
        export_trials(filled, link)
    assert db.read_bytes() == before and link.is_symlink()


def test_an_export_to_a_symlink_replaces_the_link_and_leaves_its_target_alone(filled, tmp_path: Path) -> None:
    notes = tmp_path / "notes.txt"
    notes.write_text("a file the link points to")
    link = tmp_path / "link.parquet"
    link.symlink_to(notes)
    assert export_trials(filled, link) == 3
    assert notes.read_text() == "a file the link points to"
    assert not link.is_symlink() and pd.read_parquet(link).shape[0] == 3


def test_an_export_larger_than_its_limit_is_refused_before_it_is_read(filled, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("KVLAB_MAX_EXPORT_ROWS", "2")
    with pytest.raises(KvlabError, match="would write 3 trials, more than the 2 one export may hold; narrow it"):
        export_trials(filled, tmp_path / "t.csv")
    assert not (tmp_path / "t.csv").exists()
    monkeypatch.setenv("KVLAB_MAX_EXPORT_ROWS", "3")
    assert export_trials(filled, tmp_path / "t.csv") == 3


def test_an_export_into_a_directory_that_takes_no_files_is_one_sentence(filled) -> None:
    with pytest.raises(KvlabError, match="Cannot write /proc/self/x.csv .*; nothing was written"):
        export_trials(filled, Path("/proc/self/x.csv"))


@pytest.mark.slow
def test_an_export_named_like_its_database_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "r.parquet"
    store = open_store(path)
    store.add_trials(store.begin_run(CONFIG, provenance=PROVENANCE), [trial("a")])
    store.close()
    before = path.read_bytes()
    done = kvlab("export", "--db", str(path), "--out", str(path))
    assert done.returncode == 2 and "Refusing to export" in done.stderr and done.stderr.count("\n") == 1
    assert path.read_bytes() == before
    other = tmp_path / "other.parquet"
    shutil.copy(path, other)
    done = kvlab("export", "--db", str(path), "--out", str(other))
    assert done.returncode == 2 and "it is a DuckDB database" in done.stderr


def test_an_export_creates_no_directories_and_writes_no_directory(filled, tmp_path: Path) -> None:
    with pytest.raises(KvlabError, match="the directory .*nowhere/deeper does not exist; create it first"):
        export_trials(filled, tmp_path / "nowhere" / "deeper" / "t.csv")
    assert not (tmp_path / "nowhere").exists()
    (tmp_path / "folder.csv").mkdir()
    with pytest.raises(KvlabError, match="it is a directory"):
        export_runs(filled, tmp_path / "folder.csv")


def test_csv_cells_that_a_spreadsheet_would_run_are_escaped_and_parquet_keeps_values(filled, tmp_path) -> None:
    out = tmp_path / "t.csv"
    export_trials(filled, out)
    with out.open(newline="") as handle:
        rows = {row["trial_key"]: row for row in csv.DictReader(handle)}
    assert rows["a"]["expected"] == '\'=HYPERLINK("http://x","y")' and rows["a"]["output"] == "'+1"
    assert rows["b"]["expected"] == "'@SUM(A1)" and rows["b"]["output"] == "'\tx"
    assert rows["c"]["expected"] == "'-3" and rows["c"]["output"] == "ok"
    assert rows["a"]["policy_params"] == "{}"
    frame = pd.read_parquet(tmp_path / "t.parquet") if export_trials(filled, tmp_path / "t.parquet") else None
    assert sorted(frame["expected"]) == ["-3", '=HYPERLINK("http://x","y")', "@SUM(A1)"]


def test_an_export_that_finds_a_full_disk_leaves_the_old_file(filled, tmp_path: Path) -> None:
    with tiny_disk(tmp_path) as disk:
        out = disk / "trials.csv"
        out.write_text("the previous export\n")
        filler = fill(disk)
        with pytest.raises(KvlabError, match="Cannot write .*trials.csv .*nothing was written"):
            export_trials(filled, out)
        assert out.read_text() == "the previous export\n"
        assert [p.name for p in disk.iterdir() if p.name.endswith(".part")] == []
        filler.unlink()
