"""The run store: round trips, resumable runs, migrations, concurrency, refused files and export."""

from __future__ import annotations

import csv
import dataclasses
import json
import random
import subprocess
import sys
import threading
from pathlib import Path

import duckdb
import pandas as pd
import pytest
from old_schemas import at_schema

from kvlab.errors import KvlabError
from kvlab.paths import shipped
from kvlab.provenance import Provenance
from kvlab.store import (
    MIGRATIONS,
    SCHEMA_VERSION,
    RunConfig,
    RunFilter,
    Store,
    Trial,
    default_db_path,
    export_runs,
    export_trials,
    open_store,
    run_key,
)
from kvlab.store import schema as schema_module

REPO = Path(__file__).resolve().parents[2]
PROVENANCE = Provenance("9.9.9", "abc123", {"python": "3.x", "torch": "2.x"})
CONFIG = RunConfig(
    model="tiny-llama",
    policy="h2o",
    mode="decode",
    task="needle",
    policy_params={"recent": 32, "heavy": 0.5},
    weights_hash="f00d",
    keep=0.25,
    chunk=512,
    context_length=4096,
    seed=7,
    device="cpu",
    dtype="float32",
)
TRIAL = Trial(
    trial_key="ctx=4096/depth=0.5/0",
    task_id="needle-0",
    context_tokens=4096,
    correct=True,
    depth=0.5,
    expected="42",
    output="The answer is 42",
    kept_tokens=1024,
    kv_bytes=1 << 20,
    peak_kv_bytes=1 << 22,
    peak_gpu_bytes=None,
    prefill_s=0.5,
    decode_s=0.25,
)
EXPORT_COLUMNS = {
    "run_id",
    "model",
    "policy",
    "mode",
    "keep",
    "budget_tokens",
    "context_tokens",
    "depth",
    "correct",
    "kv_bytes",
    "peak_kv_bytes",
}


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    return tmp_path / "runs.duckdb"


@pytest.fixture
def store(db_path: Path):
    opened = open_store(db_path)
    yield opened
    opened.close()


def trial(key: str, correct: bool = True, **changes) -> Trial:
    return Trial(**{**TRIAL.__dict__, "trial_key": key, "correct": correct, **changes})


# --- round trip and resumable runs ---------------------------------------------------------------------------------


def test_a_run_and_its_trials_round_trip(store: Store) -> None:
    run_id = store.begin_run(CONFIG, started_by="ann", provenance=PROVENANCE)
    assert store.add_trials(run_id, [TRIAL]) == 1
    store.finish_run(run_id)

    row = store.trials_frame().iloc[0]
    stored = {**row.to_dict(), "policy_params": json.loads(row["policy_params"])}
    for name, value in {**CONFIG.__dict__, **TRIAL.__dict__}.items():
        assert pd.isna(stored[name]) if value is None else stored[name] == value, name
    assert row["run_key"] == run_key(CONFIG)
    assert (row["status"], row["started_by"]) == ("finished", "ann")
    assert (row["kvlab_version"], row["git_commit"]) == ("9.9.9", "abc123")
    assert json.loads(row["packages"]) == PROVENANCE.packages
    assert row["started_at"] <= row["recorded_at"] <= row["ended_at"]


def test_the_same_configuration_resumes_the_same_run(store: Store) -> None:
    run_id = store.begin_run(CONFIG, provenance=PROVENANCE)
    store.add_trials(run_id, [trial("a"), trial("b", correct=False)])
    store.finish_run(run_id, "interrupted")

    reordered = RunConfig(**{**CONFIG.__dict__, "policy_params": {"heavy": 0.5, "recent": 32}})
    assert store.begin_run(reordered, provenance=PROVENANCE) == run_id
    assert store.list_runs()["status"].tolist() == ["running"]
    assert store.stored_trials(run_id) == {"a": None, "b": None}
    assert store.add_trials(run_id, [trial("a"), trial("c")]) == 1
    assert store.add_trial(run_id, trial("c")) is False
    assert sorted(store.trials_frame()["trial_key"]) == ["a", "b", "c"]

    other = RunConfig(**{**CONFIG.__dict__, "keep": 0.5})
    assert store.begin_run(other, provenance=PROVENANCE) != run_id


def test_run_key_ignores_unset_fields_and_parameter_order() -> None:
    bare = RunConfig(model="m", policy="tova", mode="decode", task="needle", policy_params={"a": 1, "b": 2})
    same = RunConfig(model="m", policy="tova", mode="decode", task="needle", policy_params={"b": 2, "a": 1}, seed=None)
    assert run_key(bare) == run_key(same)
    assert run_key(bare) != run_key(RunConfig(**{**bare.__dict__, "seed": 0}))
    assert len(run_key(bare)) == 64


def test_trials_need_an_existing_run_and_runs_end_finished_or_interrupted(store: Store) -> None:
    with pytest.raises(KvlabError, match="no run 41"):
        store.add_trials(41, [TRIAL])
    with pytest.raises(KvlabError, match="no run 41"):
        store.finish_run(41)
    with pytest.raises(ValueError, match="finished or interrupted"):
        store.finish_run(store.begin_run(CONFIG, provenance=PROVENANCE), "running")  # type: ignore[arg-type]
    assert store.trials_frame().empty


def test_runs_left_running_by_a_dead_process_read_as_interrupted(db_path: Path) -> None:
    first = open_store(db_path)
    run_id = first.begin_run(CONFIG, provenance=PROVENANCE)
    first.close()

    reopened = open_store(db_path)
    try:
        assert reopened.list_runs().set_index("run_id").loc[run_id, "status"] == "interrupted"
    finally:
        reopened.close()


SPEC = {"kind": "needle-grid", "policies": ["h2o", "full"], "contexts": [512], "keep": 0.1}


def test_a_sweep_is_stored_with_its_spec_and_found_again_by_it(store: Store) -> None:
    sweep_id = store.begin_sweep(SPEC, started_by="ann")
    reordered = {"keep": 0.1, "contexts": [512], "policies": ["h2o", "full"], "kind": "needle-grid"}
    assert store.begin_sweep(reordered, started_by="bob") == sweep_id
    other = store.begin_sweep({**SPEC, "contexts": [1024]})
    assert other != sweep_id

    store.set_sweep_status(sweep_id, "failed", "The GPU ran out of memory.")
    latest = store.sweeps()[0]
    assert (latest.sweep_id, latest.spec, latest.status, latest.message, latest.started_by) == (
        sweep_id,
        SPEC,
        "failed",
        "The GPU ran out of memory.",
        "ann",
    )
    assert latest.updated_at >= latest.created_at

    assert store.begin_sweep(SPEC, started_by="bob") == sweep_id  # resumed: queued again, first starter kept
    resumed = {record.sweep_id: record for record in store.sweeps()}[sweep_id]
    assert (resumed.status, resumed.message, resumed.started_by) == ("queued", None, "ann")
    assert len(store.sweeps()) == 2
    with pytest.raises(ValueError, match="unknown sweep status"):
        store.set_sweep_status(sweep_id, "paused")  # type: ignore[arg-type]
    with pytest.raises(KvlabError, match="There is no sweep 99"):
        store.set_sweep_status(99, "finished")


def test_sweeps_left_queued_or_running_by_a_dead_process_read_as_interrupted(db_path: Path) -> None:
    first = open_store(db_path)
    queued = first.begin_sweep(SPEC)
    running = first.begin_sweep({**SPEC, "contexts": [1024]})
    first.set_sweep_status(running, "running")
    stopped = first.begin_sweep({**SPEC, "contexts": [2048]})
    first.set_sweep_status(stopped, "stopped")
    first.close()

    reopened = open_store(db_path)
    try:
        statuses = {record.sweep_id: record.status for record in reopened.sweeps()}
        assert statuses == {queued: "interrupted", running: "interrupted", stopped: "stopped"}
    finally:
        reopened.close()


def test_queries_filter_and_aggregate(store: Store) -> None:
    h2o = store.begin_run(CONFIG, provenance=PROVENANCE)
    snapkv = RunConfig(**{**CONFIG.__dict__, "policy": "snapkv", "context_length": None})
    snap = store.begin_run(snapkv, provenance=PROVENANCE)
    store.add_trials(h2o, [trial("a", depth=0.0), trial("b", False, depth=0.0), trial("c", depth=1.0)])
    store.add_trials(
        snap, [trial("a", context_tokens=1000, kv_bytes=10), trial("b", False, context_tokens=1000, kv_bytes=30)]
    )

    listed = store.list_runs(RunFilter(policies=("h2o",)))
    assert listed[["run_id", "trials", "accuracy"]].values.tolist() == [[h2o, 3, 2 / 3]]
    assert store.list_runs(RunFilter(models=("other",))).empty
    assert set(store.trials_frame(RunFilter(run_ids=(snap,)))["run_id"]) == {snap}
    assert len(store.trials_frame(RunFilter(context_lengths=(4096,)))) == 3

    depth = store.accuracy_by_depth()
    assert depth[["run_id", "context_length", "depth", "trials", "accuracy"]].values.tolist() == [
        [h2o, 4096, 0.0, 2, 0.5],
        [h2o, 4096, 1.0, 1, 1.0],
        [snap, 1000, 0.5, 2, 0.5],
    ]
    frontier = store.accuracy_frontier().set_index("policy")
    assert frontier.loc["snapkv", "mean_kv_bytes"] == 20
    assert frontier.loc["h2o", "accuracy"] == pytest.approx(2 / 3)
    assert frontier.loc["h2o", "keep"] == 0.25


# --- schema and migrations -----------------------------------------------------------------------------------------

# The schema as the first release wrote it; kept here verbatim so the migration is tested against real old files.
V1_SCHEMA = """
CREATE TABLE schema_version (version INTEGER NOT NULL);
INSERT INTO schema_version VALUES (1);
CREATE SEQUENCE run_id_seq START 1;
CREATE SEQUENCE trial_id_seq START 1;
CREATE TABLE runs (
    run_id BIGINT PRIMARY KEY DEFAULT nextval('run_id_seq'), model VARCHAR NOT NULL, weights_hash VARCHAR,
    policy VARCHAR NOT NULL, policy_params VARCHAR NOT NULL, budget DOUBLE, mode VARCHAR NOT NULL, chunk BIGINT,
    context_length BIGINT, device VARCHAR, dtype VARCHAR, seed BIGINT, kvlab_version VARCHAR, git_commit VARCHAR,
    packages VARCHAR, started_at TIMESTAMP NOT NULL, ended_at TIMESTAMP
);
CREATE TABLE trials (
    trial_id BIGINT PRIMARY KEY DEFAULT nextval('trial_id_seq'), run_id BIGINT NOT NULL, task_id VARCHAR NOT NULL,
    depth DOUBLE, context_tokens BIGINT NOT NULL, expected VARCHAR, output VARCHAR, correct BOOLEAN NOT NULL,
    kept_tokens BIGINT, kv_bytes BIGINT, peak_kv_bytes BIGINT, peak_gpu_bytes BIGINT, prefill_s DOUBLE,
    decode_s DOUBLE
);
INSERT INTO runs (model, policy, policy_params, budget, mode, started_at, ended_at) VALUES
    ('old-model', 'h2o', '{"recent":8}', 0.25, 'decode', '2025-01-01 10:00', '2025-01-01 11:00'),
    ('old-model', 'streaming', '{}', 512, 'prefill', '2025-01-02 10:00', NULL);
INSERT INTO trials (run_id, task_id, depth, context_tokens, correct, kv_bytes) VALUES
    (1, 'n0', 0.0, 2048, TRUE, 100), (1, 'n1', 1.0, 2048, FALSE, 200), (2, 'n0', 0.5, 1024, TRUE, 300);
"""


def write_v1_database(path: Path) -> None:
    with duckdb.connect(str(path)) as connection:
        connection.execute(V1_SCHEMA)


def test_a_new_database_has_the_latest_schema(store: Store) -> None:
    assert store.schema_version() == SCHEMA_VERSION == len(MIGRATIONS) >= 2


def test_migrating_a_v1_database_keeps_its_data(db_path: Path) -> None:
    write_v1_database(db_path)
    migrated = open_store(db_path)
    try:
        assert migrated.schema_version() == SCHEMA_VERSION
        runs = migrated.list_runs().set_index("run_id")
        assert runs.loc[1, ["run_key", "status", "keep", "policy_params"]].tolist() == [
            "v1:1",
            "finished",
            0.25,
            '{"recent":8}',
        ]
        assert runs.loc[2, ["run_key", "status", "budget_tokens", "mode"]].tolist() == [
            "v1:2",
            "interrupted",
            512,
            "prefill",
        ]
        assert pd.isna(runs.loc[2, "keep"]) and pd.isna(runs.loc[1, "budget_tokens"])
        assert runs["trials"].tolist() == [2, 1]
        assert {"task", "started_by", "run_key", "status"} <= set(runs.columns)

        trials = migrated.trials_frame()
        assert "exact" in trials.columns and trials["exact"].isna().all()
        assert trials[["run_id", "trial_key", "task_id", "correct", "kv_bytes"]].values.tolist() == [
            [1, "v1:1", "n0", True, 100],
            [1, "v1:2", "n1", False, 200],
            [2, "v1:1", "n0", True, 300],
        ]
        new_run = migrated.begin_run(CONFIG, provenance=PROVENANCE)
        assert new_run == 3
        assert migrated.add_trials(1, [trial("v1:1"), trial("fresh")]) == 1
    finally:
        migrated.close()


def test_migrating_a_v3_database_adds_sweeps_and_keeps_its_runs(db_path: Path) -> None:
    """(Opened for writing, an older database is migrated to the latest version.)"""
    with duckdb.connect(str(db_path)) as connection:
        at_schema(connection, 3)
        connection.execute(
            "INSERT INTO runs (run_key, status, model, policy, mode, policy_params, started_by, started_at) "
            "VALUES ('k1', 'running', 'old-model', 'h2o', 'prefill', '{}', 'ann', '2025-01-01 10:00')"
        )
        connection.execute(
            "INSERT INTO trials (run_id, trial_key, task_id, context_tokens, correct, exact) "
            "VALUES (1, 't0', 'n0', 512, TRUE, FALSE)"
        )

    migrated = open_store(db_path)
    try:
        assert migrated.schema_version() == SCHEMA_VERSION == 14
        runs = migrated.list_runs()
        assert runs[["run_id", "status", "started_by", "trials"]].values.tolist() == [[1, "interrupted", "ann", 1]]
        assert migrated.sweeps() == []
        assert migrated.begin_sweep(SPEC) == 1
    finally:
        migrated.close()


def test_a_v11_database_records_the_attention_backend_and_its_runs_keep_their_identity(db_path: Path) -> None:
    with duckdb.connect(str(db_path)) as connection:
        at_schema(connection, 11)
        connection.execute(
            "INSERT INTO runs (run_key, status, model, policy, mode, policy_params, started_at) "
            "VALUES (?, 'finished', 'm', 'h2o', 'prefill', '{}', '2026-01-01 10:00')",
            [run_key(CONFIG)],
        )
    migrated = open_store(db_path)
    try:
        assert migrated.schema_version() == SCHEMA_VERSION
        assert migrated.begin_run(CONFIG, provenance=PROVENANCE) == 1  # kvlab's own kernels: the stored run
        flex = dataclasses.replace(CONFIG, attention="flex")
        assert migrated.begin_run(flex, provenance=PROVENANCE) == 2  # another backend: another run
        attention = migrated.list_runs().set_index("run_id")["attention"]
        assert pd.isna(attention[1]) and attention[2] == "flex"
    finally:
        migrated.close()


def test_a_v13_database_has_its_answers_rescored_without_regard_to_case(db_path: Path) -> None:
    outputs = [  # (output, expected, correct as stored, exact as stored)
        (" Plain glacier.\n\n", "plain glacier", False, False),
        (" GS-1950-t1\n", "GS-1950-t1", True, True),
        (" We8_hvtu", "we8_hvtu", False, False),
        (" 1000000", "nu4_yz6u", False, False),
    ]
    with duckdb.connect(str(db_path)) as connection:
        at_schema(connection, 13)
        connection.execute(
            "INSERT INTO runs (run_key, status, model, policy, mode, policy_params, started_at) "
            "VALUES ('k', 'finished', 'm', 'full', 'prefill', '{}', '2026-01-01 10:00')"
        )
        for index, (output, expected, correct, exact) in enumerate(outputs):
            connection.execute(
                "INSERT INTO trials (run_id, trial_key, task_id, context_tokens, correct, exact, output, expected) "
                "VALUES (1, ?, 'n', 512, ?, ?, ?, ?)",
                [f"t{index}", correct, exact, output, expected],
            )
        connection.execute(  # a RULER trial (no exact verdict): its recall decided, and stays
            "INSERT INTO trials (run_id, trial_key, task_id, context_tokens, correct, output, expected, recall) "
            "VALUES (1, 'r', 'ruler-vt-512-0', 512, FALSE, 'A b', 'a | c', 0.5)"
        )
    expected = {"r": (False, None), "t0": (True, False), "t1": (True, True), "t2": (True, True), "t3": (False, False)}

    def verdicts(store) -> dict:
        rows = store.trials_frame().astype(object)
        return {row.trial_key: (row.correct, None if pd.isna(row.exact) else row.exact) for row in rows.itertuples()}

    with open_store(db_path, read_only=True) as reader:  # an upgraded copy: the file is left as it was
        assert verdicts(reader) == expected
    with duckdb.connect(str(db_path), read_only=True) as untouched:
        assert untouched.execute("SELECT count(*) FROM trials WHERE correct").fetchone() == (1,)
    migrated = open_store(db_path)
    try:
        assert verdicts(migrated) == expected
    finally:
        migrated.close()


def test_a_failing_migration_leaves_the_previous_version(db_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_v1_database(db_path)

    def broken(cursor: duckdb.DuckDBPyConnection) -> None:
        cursor.execute("ALTER TABLE runs ADD COLUMN half_done INTEGER")
        raise RuntimeError("migration bug")

    monkeypatch.setattr(schema_module, "MIGRATIONS", (*MIGRATIONS, broken))
    monkeypatch.setattr(schema_module, "SCHEMA_VERSION", SCHEMA_VERSION + 1)
    with pytest.raises(RuntimeError, match="migration bug"):
        open_store(db_path)

    with duckdb.connect(str(db_path), read_only=True) as connection:
        assert connection.execute("SELECT version FROM schema_version").fetchall() == [(SCHEMA_VERSION,)]
        names = connection.execute("SELECT column_name FROM duckdb_columns() WHERE table_name = 'runs'").fetchall()
        columns = {name for (name,) in names}
        assert "half_done" not in columns and "run_key" in columns
        assert connection.execute("SELECT count(*) FROM trials").fetchone() == (3,)


# --- concurrency ---------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_eight_threads_writing_at_once_lose_nothing(store: Store) -> None:
    threads, own, shared = 8, 40, 10
    run_ids: list[int] = []
    new_counts: list[int] = []
    errors: list[BaseException] = []
    start = threading.Barrier(threads)

    def work(worker: int) -> None:
        try:
            start.wait()
            run_id = store.begin_run(CONFIG, provenance=PROVENANCE)
            keys = [f"w{worker}-{i}" for i in range(own)] + [f"shared-{i}" for i in range(shared)]
            random.Random(worker).shuffle(keys)
            added = sum(store.add_trials(run_id, [trial(key)]) for key in keys)
            run_ids.append(run_id)
            new_counts.append(added)
        except BaseException as exc:  # reported by the assertion below
            errors.append(exc)

    workers = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
    for thread in workers:
        thread.start()
    for thread in workers:
        thread.join()

    assert errors == []
    assert len(set(run_ids)) == 1
    keys = store.trials_frame()["trial_key"]
    assert len(keys) == keys.nunique() == threads * own + shared
    assert sum(new_counts) == threads * own + shared


# --- refused files -------------------------------------------------------------------------------------------------

HOLD_OPEN = (
    "import sys; from kvlab.store import open_store; open_store(sys.argv[1]); print('ready', flush=True); "
    "sys.stdin.read()"
)


def test_a_database_held_by_another_process_gives_one_sentence(db_path: Path) -> None:
    first = open_store(db_path)
    run_id = first.begin_run(CONFIG, provenance=PROVENANCE)
    first.close()
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_OPEN, str(db_path)],
        cwd=REPO,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "ready"
        before = db_path.read_bytes()
        with pytest.raises(KvlabError) as refused:
            open_store(db_path)
        assert str(refused.value) == (
            f"The database {db_path} is in use by another process (pid {holder.pid}); close it or choose another "
            "file with --db or KVLAB_DB."
        )
        assert db_path.read_bytes() == before
    finally:
        holder.communicate(timeout=30)
    assert holder.returncode == 0
    after = open_store(db_path)
    try:
        assert after.list_runs()["run_id"].tolist() == [run_id]
    finally:
        after.close()


def damaged_copy(path: Path) -> bytes:
    """A real store whose blocks after the header were scrambled."""
    healthy = open_store(path)
    healthy.add_trials(healthy.begin_run(CONFIG, provenance=PROVENANCE), [TRIAL])
    healthy.close()
    data = bytearray(path.read_bytes())
    for offset in range(4096, len(data), 3):
        data[offset] ^= 0xA5
    return bytes(data)


@pytest.mark.parametrize(
    "content",
    [
        pytest.param(lambda path: random.Random(0).randbytes(8192), id="garbage"),
        pytest.param(damaged_copy, id="damaged"),
    ],
)
def test_a_corrupt_file_gives_one_sentence_and_is_left_untouched(tmp_path: Path, content) -> None:
    path = tmp_path / "runs.duckdb"
    data = content(tmp_path / "source.duckdb")
    path.write_bytes(data)
    with pytest.raises(KvlabError) as refused:
        open_store(path)
    assert str(refused.value) == (
        f"The file {path} is not a readable kvlab database (it is corrupt or not a DuckDB file); it was left untouched."
    )
    assert path.read_bytes() == data
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("runs")) == ["runs.duckdb"]


def test_a_foreign_duckdb_file_is_refused_untouched(db_path: Path) -> None:
    with duckdb.connect(str(db_path)) as connection:
        connection.execute("CREATE TABLE invoices (id INTEGER); INSERT INTO invoices VALUES (1)")
    before = db_path.read_bytes()
    with pytest.raises(KvlabError, match="is a DuckDB database but not a kvlab one; it was left untouched"):
        open_store(db_path)
    assert db_path.read_bytes() == before


def test_a_newer_schema_is_refused_untouched(db_path: Path) -> None:
    open_store(db_path).close()
    with duckdb.connect(str(db_path)) as connection:
        connection.execute("UPDATE schema_version SET version = 99")
    before = db_path.read_bytes()
    with pytest.raises(KvlabError, match=f"schema version 99, newer than the {SCHEMA_VERSION} this kvlab knows"):
        open_store(db_path)
    assert db_path.read_bytes() == before


def test_a_path_duckdb_cannot_open_gives_its_reason(tmp_path: Path) -> None:
    with pytest.raises(KvlabError) as refused:
        open_store(tmp_path)
    message = str(refused.value)
    assert message.startswith(f"The database {tmp_path} cannot be opened (")
    assert message.endswith("Is a directory); it was left untouched.")
    assert "IO Error" not in message
    assert list(tmp_path.iterdir()) == []


def test_reading_a_missing_database_does_not_create_it(tmp_path: Path) -> None:
    path = tmp_path / "nowhere" / "runs.duckdb"
    with pytest.raises(KvlabError, match="There is no kvlab database at"):
        open_store(path, read_only=True)
    assert not path.parent.exists()


# --- location ------------------------------------------------------------------------------------------------------


def test_the_default_location_honours_kvlab_db_then_xdg(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    assert default_db_path({"KVLAB_DB": "~/lab.duckdb", "XDG_DATA_HOME": "/xdg"}) == tmp_path / "lab.duckdb"
    assert default_db_path({"XDG_DATA_HOME": "/xdg"}) == Path("/xdg/kvlab/runs.duckdb")
    assert default_db_path({"XDG_DATA_HOME": "relative"}) == tmp_path / ".local/share/kvlab/runs.duckdb"
    assert default_db_path({}) == tmp_path / ".local/share/kvlab/runs.duckdb"


def test_opening_without_a_path_uses_kvlab_db_and_creates_its_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "deep" / "er" / "lab.duckdb"
    monkeypatch.setenv("KVLAB_DB", str(target))
    opened = open_store()
    try:
        assert opened.path == target and target.is_file()
    finally:
        opened.close()


# --- export --------------------------------------------------------------------------------------------------------


@pytest.fixture
def filled(store: Store) -> tuple[Store, int, int]:
    h2o = store.begin_run(CONFIG, provenance=PROVENANCE)
    budgeted = RunConfig(**{**CONFIG.__dict__, "policy": "tova", "keep": None, "budget_tokens": 256})
    tova = store.begin_run(budgeted, provenance=PROVENANCE)
    store.add_trials(h2o, [trial("a"), trial("b", False)])
    store.add_trials(tova, [trial("a")])
    return store, h2o, tova


def test_export_writes_one_csv_row_per_trial_with_the_required_columns(filled, tmp_path: Path) -> None:
    store, h2o, tova = filled
    out = tmp_path / "trials.csv"
    assert export_trials(store, out) == 3
    with out.open(newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert EXPORT_COLUMNS | {"git_commit", "kvlab_version", "weights_hash", "packages"} <= set(rows[0])
    assert [[row[name] for name in ("run_id", "policy", "keep", "budget_tokens", "correct")] for row in rows] == [
        [str(h2o), "h2o", "0.25", "", "True"],
        [str(h2o), "h2o", "0.25", "", "False"],
        [str(tova), "tova", "", "256", "True"],
    ]


def test_export_to_parquet_keeps_values_and_filters(filled, tmp_path: Path) -> None:
    store, _, tova = filled
    out = tmp_path / "trials.parquet"
    assert export_trials(store, out, RunFilter(policies=("tova",))) == 1
    frame = pd.read_parquet(out)
    assert EXPORT_COLUMNS <= set(frame.columns)
    assert frame[["run_id", "budget_tokens", "kv_bytes", "peak_kv_bytes"]].values.tolist() == [
        [tova, 256, TRIAL.kv_bytes, TRIAL.peak_kv_bytes]
    ]


def test_export_of_runs_has_one_row_per_run(filled, tmp_path: Path) -> None:
    store, h2o, tova = filled
    out = tmp_path / "runs.csv"
    assert export_runs(store, out) == 2
    assert pd.read_csv(out)[["run_id", "trials"]].values.tolist() == [[h2o, 2], [tova, 1]]


def test_export_refuses_an_unknown_extension(filled, tmp_path: Path) -> None:
    store, _, _ = filled
    out = tmp_path / "trials.xlsx"
    with pytest.raises(KvlabError, match=r"must end in \.csv or \.parquet"):
        export_trials(store, out)
    assert not out.exists()


def test_a_v12_database_records_the_bos_rule_and_its_runs_keep_their_identity(db_path: Path) -> None:
    with duckdb.connect(str(db_path)) as connection:
        at_schema(connection, 12)
        connection.execute(
            "INSERT INTO runs (run_key, status, model, policy, mode, policy_params, started_at) "
            "VALUES (?, 'finished', 'm', 'h2o', 'prefill', '{}', '2026-01-01 10:00')",
            [run_key(CONFIG)],
        )
    migrated = open_store(db_path)
    try:
        assert migrated.schema_version() == SCHEMA_VERSION
        assert migrated.begin_run(CONFIG, provenance=PROVENANCE) == 1  # the BOS always first: the stored run
        auto = dataclasses.replace(CONFIG, bos="auto")
        assert migrated.begin_run(auto, provenance=PROVENANCE) == 2  # other prompts: another run
        bos = migrated.list_runs().set_index("run_id")["bos"]
        assert pd.isna(bos[1]) and bos[2] == "auto"
    finally:
        migrated.close()


@pytest.mark.parametrize("path", sorted(shipped("runs").glob("*.duckdb")), ids=lambda path: path.name)
def test_a_shipped_store_numbers_its_next_run_after_every_stored_one(path: Path) -> None:
    """(Stores merged from several machines keep their sequence ahead of the run ids they hold, so a run added to one
    never takes a stored run's id.)"""
    with duckdb.connect(str(path), read_only=True) as connection:
        highest = connection.execute("SELECT max(run_id) FROM runs").fetchone()
        issued = connection.execute(
            "SELECT last_value FROM duckdb_sequences() WHERE sequence_name = 'run_id_seq'"
        ).fetchone()
    assert highest is not None and issued is not None and (highest[0] or 0) <= (issued[0] or 0)
