"""The run store: every run and trial kvlab measures, kept in one DuckDB file.

A *run* is one configuration (model, weights, policy and its parameters, budget, mode, chunk, task, context length,
seed, device, dtype) with the provenance that produced it; a *trial* is one prompt answered under that run. Sweeps
are resumable because a run is found again by :func:`run_key`, the hash of its configuration, and a trial by its
``trial_key``, unique within its run: re-running a sweep skips what :meth:`Store.stored_trial_keys` returns, and
storing a trial twice stores it once.

Concurrency: DuckDB lets one process at a time open a file for writing, so each process keeps one connection per
database file (a registry guarded by a lock) and every unit of work runs on its own cursor of it, so no cursor is
ever shared between threads. Writes are explicit transactions, retried when they collide with another thread's.

A file that is locked by another process, corrupt, not a kvlab database, or written by a newer schema gives a
:class:`~kvlab.errors.KvlabError` and is never written to. Schema, migrations and the default location are
described in ``docs/store.md``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import re
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Literal, Mapping, TypeVar, get_args

import duckdb
import pandas as pd

from kvlab.errors import KvlabError
from kvlab.provenance import Provenance, collect_provenance

#: Environment variable naming the database file; overrides the per-user default.
DB_ENV_VAR = "KVLAB_DB"

EndStatus = Literal["finished", "interrupted"]
#: Where a dashboard sweep stands: waiting for the device, running, or ended (``interrupted``: its process died).
SweepStatus = Literal["queued", "running", "finished", "stopped", "failed", "interrupted"]
Cursor = duckdb.DuckDBPyConnection
T = TypeVar("T")

_WRITE_ATTEMPTS = 20
_RETRY_PAUSE_S = 0.002


def default_db_path(env: Mapping[str, str] = os.environ) -> Path:
    """Where runs are stored unless a path is given: ``$KVLAB_DB``, else ``$XDG_DATA_HOME/kvlab/runs.duckdb``,
    else ``~/.local/share/kvlab/runs.duckdb``.

    Per user rather than per checkout, so the dashboard and every sweep of one user see the same runs.
    """
    explicit = env.get(DB_ENV_VAR)
    if explicit:
        return Path(explicit).expanduser()
    data_home = env.get("XDG_DATA_HOME")
    base = Path(data_home) if data_home and Path(data_home).is_absolute() else Path.home() / ".local" / "share"
    return base / "kvlab" / "runs.duckdb"


@dataclass(frozen=True)
class RunConfig:
    """Everything that makes two runs the same experiment; :func:`run_key` hashes exactly these fields.

    ``keep`` is the kept fraction of the context and ``budget_tokens`` a fixed token budget; a run sets one of
    them (or neither, for the full cache). ``task`` describes the prompts, e.g. ``"needle"`` or
    ``"jsonl:<file>"``; ``context_length`` is the target length when the run has one.
    """

    model: str
    policy: str
    mode: str
    task: str
    policy_params: dict[str, Any] = field(default_factory=dict)
    weights_hash: str | None = None
    keep: float | None = None
    budget_tokens: int | None = None
    chunk: int | None = None
    context_length: int | None = None
    seed: int | None = None
    device: str | None = None
    dtype: str | None = None


@dataclass(frozen=True)
class Trial:
    """One answered prompt of a run. ``trial_key`` identifies it within the run, so a resumed sweep can skip it.

    Byte counts are of the KV cache as physically held (``kv_bytes``, at the end of the trial) and at its peak;
    ``peak_gpu_bytes`` is the device's peak allocation where there is a GPU.
    """

    trial_key: str
    task_id: str
    context_tokens: int
    correct: bool
    exact: bool | None = None
    depth: float | None = None
    expected: str | None = None
    output: str | None = None
    kept_tokens: int | None = None
    kv_bytes: int | None = None
    peak_kv_bytes: int | None = None
    peak_gpu_bytes: int | None = None
    prefill_s: float | None = None
    decode_s: float | None = None


@dataclass(frozen=True)
class RunFilter:
    """Which runs a query covers: each non-empty field keeps runs whose column is one of its values."""

    run_ids: tuple[int, ...] = ()
    models: tuple[str, ...] = ()
    policies: tuple[str, ...] = ()
    modes: tuple[str, ...] = ()
    tasks: tuple[str, ...] = ()
    context_lengths: tuple[int, ...] = ()


@dataclass(frozen=True)
class SweepRecord:
    """A stored sweep: its grid (``spec``, the JSON object it was started with), where it stands, why it failed
    (``message``), who started it first, and when it was created and last changed (UTC)."""

    sweep_id: int
    spec: dict[str, Any]
    status: SweepStatus
    message: str | None
    started_by: str | None
    created_at: datetime
    updated_at: datetime


_FILTER_COLUMNS: dict[str, str] = {
    "run_ids": "run_id",
    "models": "model",
    "policies": "policy",
    "modes": "mode",
    "tasks": "task",
    "context_lengths": "context_length",
}


def run_key(config: RunConfig) -> str:
    """The stable identity of a run configuration: sha256 of its fields as canonical JSON.

    Fields that are ``None`` are left out, so adding an optional field to :class:`RunConfig` later keeps the keys
    of existing runs, and their sweeps stay resumable.
    """
    identity = {name: value for name, value in dataclasses.asdict(config).items() if value is not None}
    return hashlib.sha256(_to_json(identity).encode()).hexdigest()


def _to_json(value: Any) -> str:
    """Canonical JSON (sorted keys, no spaces), so equal values give equal text."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def _utcnow() -> datetime:
    """The current UTC time without a zone: timestamps are stored as UTC ``TIMESTAMP``."""
    return datetime.now(timezone.utc).replace(tzinfo=None)


# --- schema -------------------------------------------------------------------------------------------------------


def _v1_initial(cursor: Cursor) -> None:
    """The first schema: runs with one ``budget`` column and trials numbered by a sequence."""
    cursor.execute(
        """
        CREATE TABLE schema_version (version INTEGER NOT NULL);
        CREATE SEQUENCE run_id_seq START 1;
        CREATE SEQUENCE trial_id_seq START 1;
        CREATE TABLE runs (
            run_id BIGINT PRIMARY KEY DEFAULT nextval('run_id_seq'),
            model VARCHAR NOT NULL,
            weights_hash VARCHAR,
            policy VARCHAR NOT NULL,
            policy_params VARCHAR NOT NULL,
            budget DOUBLE,
            mode VARCHAR NOT NULL,
            chunk BIGINT,
            context_length BIGINT,
            device VARCHAR,
            dtype VARCHAR,
            seed BIGINT,
            kvlab_version VARCHAR,
            git_commit VARCHAR,
            packages VARCHAR,
            started_at TIMESTAMP NOT NULL,
            ended_at TIMESTAMP
        );
        CREATE TABLE trials (
            trial_id BIGINT PRIMARY KEY DEFAULT nextval('trial_id_seq'),
            run_id BIGINT NOT NULL,
            task_id VARCHAR NOT NULL,
            depth DOUBLE,
            context_tokens BIGINT NOT NULL,
            expected VARCHAR,
            output VARCHAR,
            correct BOOLEAN NOT NULL,
            kept_tokens BIGINT,
            kv_bytes BIGINT,
            peak_kv_bytes BIGINT,
            peak_gpu_bytes BIGINT,
            prefill_s DOUBLE,
            decode_s DOUBLE
        );
        """
    )


def _v2_resumable_sweeps(cursor: Cursor) -> None:
    """Resumable sweeps: a unique ``run_key`` per configuration, a unique ``trial_key`` per trial of a run, a run
    ``status``, ``task`` and ``started_by``; ``budget`` splits into ``keep`` (values <= 1) and ``budget_tokens``.

    Older runs were never hashed, so they get ``run_key = 'v1:<run_id>'`` (no sweep resumes them) and status
    finished or interrupted by whether they have an end time; their trials get ``trial_key = 'v1:<n>'``, numbered
    in the order they were stored. DuckDB cannot add a unique constraint to a table, so both are rebuilt.
    """
    cursor.execute(
        """
        CREATE TABLE runs_v2 (
            run_id BIGINT PRIMARY KEY DEFAULT nextval('run_id_seq'),
            run_key VARCHAR NOT NULL UNIQUE,
            status VARCHAR NOT NULL CHECK (status IN ('running', 'finished', 'interrupted')),
            model VARCHAR NOT NULL,
            policy VARCHAR NOT NULL,
            mode VARCHAR NOT NULL,
            task VARCHAR,
            policy_params VARCHAR NOT NULL,
            weights_hash VARCHAR,
            keep DOUBLE,
            budget_tokens BIGINT,
            chunk BIGINT,
            context_length BIGINT,
            seed BIGINT,
            device VARCHAR,
            dtype VARCHAR,
            kvlab_version VARCHAR,
            git_commit VARCHAR,
            packages VARCHAR,
            started_by VARCHAR,
            started_at TIMESTAMP NOT NULL,
            ended_at TIMESTAMP
        );
        INSERT INTO runs_v2
        SELECT run_id, 'v1:' || run_id, CASE WHEN ended_at IS NULL THEN 'interrupted' ELSE 'finished' END,
               model, policy, mode, NULL, policy_params, weights_hash,
               CASE WHEN budget <= 1 THEN budget END, CASE WHEN budget > 1 THEN round(budget)::BIGINT END,
               chunk, context_length, seed, device, dtype, kvlab_version, git_commit, packages,
               NULL, started_at, ended_at
        FROM runs;
        DROP TABLE runs;
        ALTER TABLE runs_v2 RENAME TO runs;
        CREATE TABLE trials_v2 (
            run_id BIGINT NOT NULL,
            trial_key VARCHAR NOT NULL,
            task_id VARCHAR NOT NULL,
            context_tokens BIGINT NOT NULL,
            depth DOUBLE,
            expected VARCHAR,
            output VARCHAR,
            correct BOOLEAN NOT NULL,
            kept_tokens BIGINT,
            kv_bytes BIGINT,
            peak_kv_bytes BIGINT,
            peak_gpu_bytes BIGINT,
            prefill_s DOUBLE,
            decode_s DOUBLE,
            recorded_at TIMESTAMP,
            PRIMARY KEY (run_id, trial_key)
        );
        INSERT INTO trials_v2
        SELECT run_id, 'v1:' || row_number() OVER (PARTITION BY run_id ORDER BY trial_id), task_id, context_tokens,
               depth, expected, output, correct, kept_tokens, kv_bytes, peak_kv_bytes, peak_gpu_bytes,
               prefill_s, decode_s, NULL
        FROM trials;
        DROP TABLE trials;
        DROP SEQUENCE trial_id_seq;
        ALTER TABLE trials_v2 RENAME TO trials;
        """
    )


def _v3_exact_match(cursor: Cursor) -> None:
    """Two scores per trial: ``correct`` (the answer appears in the output) and ``exact`` (the output's first line
    is the answer). Older trials have no exact score (NULL)."""
    cursor.execute("ALTER TABLE trials ADD COLUMN exact BOOLEAN")


def _v4_sweeps(cursor: Cursor) -> None:
    """Sweeps started from the dashboard run in the server, not in a browser tab, and must outlive the server
    process: each is kept with its grid as JSON (``spec``), unique by the hash of that JSON (``sweep_key``, so
    starting the same grid again resumes the same sweep), its status and who started it. A sweep left queued or
    running by a process that died reads as interrupted, as runs do."""
    cursor.execute(
        """
        CREATE SEQUENCE sweep_id_seq START 1;
        CREATE TABLE sweeps (
            sweep_id BIGINT PRIMARY KEY DEFAULT nextval('sweep_id_seq'),
            sweep_key VARCHAR NOT NULL UNIQUE,
            spec VARCHAR NOT NULL,
            status VARCHAR NOT NULL
                CHECK (status IN ('queued', 'running', 'finished', 'stopped', 'failed', 'interrupted')),
            message VARCHAR,
            started_by VARCHAR,
            created_at TIMESTAMP NOT NULL,
            updated_at TIMESTAMP NOT NULL
        );
        """
    )


#: Migration ``i`` takes a database from schema version ``i`` to ``i + 1``; a new database runs all of them.
MIGRATIONS: tuple[Callable[[Cursor], None], ...] = (_v1_initial, _v2_resumable_sweeps, _v3_exact_match, _v4_sweeps)
SCHEMA_VERSION = len(MIGRATIONS)


def _stored_version(cursor: Cursor) -> int | None:
    """The schema version of a database: 0 when it has no tables yet, ``None`` when its tables are not kvlab's."""
    tables = {name for (name,) in cursor.execute("SELECT table_name FROM duckdb_tables()").fetchall()}
    if "schema_version" not in tables:
        return None if tables else 0
    version = _scalar(cursor, "SELECT max(version) FROM schema_version")
    return None if version is None else int(version)


def _scalar(cursor: Cursor, sql: str, params: list[Any] | None = None) -> Any:
    """The single value a query returns (its first row's first column)."""
    return cursor.execute(sql, params or []).fetchall()[0][0]


def _usable_version(path: Path, cursor: Cursor) -> int:
    """The schema version of an open database, refusing one that is unreadable, not kvlab's, or newer than this
    code: such a file must not be migrated or written to."""
    try:
        version = _stored_version(cursor)
    except duckdb.Error as exc:
        raise _unreadable(path, exc) from exc
    if version is None:
        raise KvlabError(f"The file {path} is a DuckDB database but not a kvlab one; it was left untouched.")
    if version > SCHEMA_VERSION:
        raise KvlabError(
            f"The database {path} has schema version {version}, newer than the {SCHEMA_VERSION} this kvlab "
            f"knows; upgrade kvlab or choose another file with --db or {DB_ENV_VAR}."
        )
    return version


def _migrate(connection: Cursor, version: int) -> None:
    """Bring a database from ``version`` to :data:`SCHEMA_VERSION`, one transaction per step, so an interrupted
    migration leaves the last complete version behind."""
    for target in range(version + 1, SCHEMA_VERSION + 1):
        with _transaction(connection):
            MIGRATIONS[target - 1](connection)
            connection.execute("DELETE FROM schema_version")
            connection.execute("INSERT INTO schema_version VALUES (?)", [target])


@contextlib.contextmanager
def _transaction(cursor: Cursor) -> Iterator[None]:
    """Run the block in one transaction: committed if it returns, rolled back if it raises."""
    cursor.begin()
    try:
        yield
    except BaseException:
        cursor.rollback()
        raise
    cursor.commit()


# --- opening ------------------------------------------------------------------------------------------------------

_connections: dict[Path, duckdb.DuckDBPyConnection] = {}
_registry_lock = threading.Lock()
_LOCK_MESSAGE = re.compile(r"\block\b", re.IGNORECASE)  # a word: "block" appears in corruption messages
_LOCK_HOLDER = re.compile(r"PID (\d+)")
_CORRUPT_MARKERS = ("not a valid DuckDB database", "Corrupt database", "checksum")
_ERROR_CATEGORY = re.compile(r"^[A-Za-z ]*Error: ")  # DuckDB's "IO Error: " prefix


def _new_cursor(path: Path) -> Cursor:
    """A new cursor of this process's connection to ``path``, which is opened (and migrated) on first use.

    Made under the registry lock, so it never races another thread opening or closing the connection.
    """
    with _registry_lock:
        connection = _connections.get(path)
        if connection is None:
            connection = _connections[path] = _connect(path)
        return connection.cursor()


def _connect(path: Path) -> duckdb.DuckDBPyConnection:
    """Open ``path`` for writing and bring its schema up to date.

    An existing file is first inspected read-only, so a file that will be refused is never opened for writing.
    Runs still marked running, and sweeps still queued or running, are marked interrupted: DuckDB's file lock means
    no other process can be writing them, and this process has only just opened the file.
    """
    if path.exists():
        with contextlib.closing(_duckdb_connect(path, read_only=True)) as inspection:
            _usable_version(path, inspection)
    else:
        _create_parent(path)
    connection = _duckdb_connect(path, read_only=False)
    try:
        _migrate(connection, _usable_version(path, connection))
        connection.execute("UPDATE runs SET status = 'interrupted' WHERE status = 'running'")
        connection.execute("UPDATE sweeps SET status = 'interrupted', updated_at = ? "
                           "WHERE status IN ('queued', 'running')", [_utcnow()])
    except BaseException:
        connection.close()
        raise
    return connection


def _duckdb_connect(path: Path, *, read_only: bool) -> duckdb.DuckDBPyConnection:
    """``duckdb.connect`` with its failures turned into one sentence."""
    try:
        return duckdb.connect(str(path), read_only=read_only)
    except duckdb.Error as exc:
        raise _open_error(path, exc) from exc


def _open_error(path: Path, exc: duckdb.Error) -> KvlabError:
    """The sentence for a file DuckDB would not open: held by another process, or unreadable."""
    message = str(exc)
    if not _LOCK_MESSAGE.search(message):
        return _unreadable(path, exc)
    holder = _LOCK_HOLDER.search(message)
    pid = f" (pid {holder.group(1)})" if holder else ""
    return KvlabError(
        f"The database {path} is in use by another process{pid}; close it or choose another file with --db "
        f"or {DB_ENV_VAR}."
    )


def _unreadable(path: Path, exc: duckdb.Error) -> KvlabError:
    """The sentence for a file that cannot be read as a database; it always says the file was not touched."""
    detail = _ERROR_CATEGORY.sub("", str(exc).splitlines()[0])
    if any(marker in detail for marker in _CORRUPT_MARKERS):
        return KvlabError(
            f"The file {path} is not a readable kvlab database (it is corrupt or not a DuckDB file); "
            "it was left untouched."
        )
    return KvlabError(f"The database {path} cannot be opened ({detail.rstrip('.!')}); it was left untouched.")


def _create_parent(path: Path) -> None:
    """Create the directory of a new database file."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise KvlabError(f"The directory {path.parent} for the database cannot be created ({exc.strerror}).") from exc


def open_store(path: str | Path | None = None, *, create: bool = True) -> Store:
    """Open (and, when ``create``, create) the run database at ``path``, or at :func:`default_db_path`.

    Opening is where a locked, corrupt, foreign or newer file is refused, so callers learn it before any work.
    """
    resolved = Path(path if path is not None else default_db_path()).expanduser().resolve()
    if not create and not resolved.exists():
        raise KvlabError(f"There is no kvlab database at {resolved}; choose one with --db or {DB_ENV_VAR}.")
    _new_cursor(resolved).close()  # opens the database now, so a refused file is reported here
    return Store(resolved)


# --- the store ----------------------------------------------------------------------------------------------------


class Store:
    """A handle on one run database, safe to share between threads; obtain it from :func:`open_store`."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Close this process's connection to the database, for every handle on it, and release the file lock.

        A later call on any handle opens it again, which marks runs still running as interrupted: close only when
        no run of this process is in flight.
        """
        with _registry_lock:
            connection = _connections.pop(self.path, None)
        if connection is not None:
            connection.close()

    def schema_version(self) -> int:
        """The schema version of the database (always :data:`SCHEMA_VERSION` once opened)."""
        with self._cursor() as cursor:
            return int(_scalar(cursor, "SELECT max(version) FROM schema_version"))

    def begin_run(
        self, config: RunConfig, *, started_by: str | None = None, provenance: Provenance | None = None
    ) -> int:
        """Start a run of ``config``, or resume the stored run with the same :func:`run_key`; returns its run_id.

        A resumed run is marked running again and keeps its first start time and provenance;
        :meth:`stored_trial_keys` then says which trials to skip.
        """
        key = run_key(config)
        row = _run_row(config, key, provenance or collect_provenance(), started_by)

        def find_or_insert(cursor: Cursor) -> int:
            found = cursor.execute("SELECT run_id FROM runs WHERE run_key = ?", [key]).fetchone()
            if found is not None:
                cursor.execute("UPDATE runs SET status = 'running', ended_at = NULL WHERE run_id = ?", [found[0]])
                return int(found[0])
            return int(_scalar(cursor, _insert_sql("runs", row) + " RETURNING run_id", list(row.values())))

        return self._write(find_or_insert)

    def finish_run(self, run_id: int, status: EndStatus = "finished") -> None:
        """Mark a run finished (or interrupted, when a sweep stops early) and record its end time."""
        if status not in get_args(EndStatus):
            raise ValueError(f"a run ends finished or interrupted, not {status!r}")

        def update(cursor: Cursor) -> None:
            _require_run(cursor, self.path, run_id)
            cursor.execute("UPDATE runs SET status = ?, ended_at = ? WHERE run_id = ?", [status, _utcnow(), run_id])

        self._write(update)

    def add_trials(self, run_id: int, trials: Iterable[Trial]) -> int:
        """Store trials of a run in one transaction; returns how many were new.

        A trial whose ``trial_key`` the run already has is skipped, so storing the same trial twice (a resumed or
        concurrent sweep) never duplicates it.
        """
        recorded_at = _utcnow()
        rows = [{"run_id": run_id, **dataclasses.asdict(trial), "recorded_at": recorded_at} for trial in trials]

        def insert(cursor: Cursor) -> int:
            _require_run(cursor, self.path, run_id)
            return sum(
                len(cursor.execute(_insert_sql("trials", row) + _SKIP_EXISTING, list(row.values())).fetchall())
                for row in rows
            )

        return self._write(insert)

    def add_trial(self, run_id: int, trial: Trial) -> bool:
        """Store one trial; ``False`` if the run already had it."""
        return self.add_trials(run_id, [trial]) == 1

    def stored_trial_keys(self, run_id: int) -> set[str]:
        """The trial keys already stored for a run: what a resumed sweep skips."""
        with self._cursor() as cursor:
            rows = cursor.execute("SELECT trial_key FROM trials WHERE run_id = ?", [run_id]).fetchall()
        return {key for (key,) in rows}

    def begin_sweep(self, spec: Mapping[str, Any], *, started_by: str | None = None) -> int:
        """Record a sweep of ``spec`` as queued, or queue the stored sweep with the same spec again (resuming it);
        returns its sweep_id. A resumed sweep keeps who started it first."""
        text = _to_json(spec)
        key = hashlib.sha256(text.encode()).hexdigest()
        now = _utcnow()

        def find_or_insert(cursor: Cursor) -> int:
            found = cursor.execute("SELECT sweep_id FROM sweeps WHERE sweep_key = ?", [key]).fetchone()
            if found is not None:
                cursor.execute("UPDATE sweeps SET status = 'queued', message = NULL, updated_at = ? WHERE sweep_id = ?",
                               [now, found[0]])
                return int(found[0])
            row = {"sweep_key": key, "spec": text, "status": "queued", "started_by": started_by, "created_at": now,
                   "updated_at": now}
            return int(_scalar(cursor, _insert_sql("sweeps", row) + " RETURNING sweep_id", list(row.values())))

        return self._write(find_or_insert)

    def set_sweep_status(self, sweep_id: int, status: SweepStatus, message: str | None = None) -> None:
        """Record where a sweep stands, with the sentence that says why when it failed."""
        if status not in get_args(SweepStatus):
            raise ValueError(f"unknown sweep status {status!r}")

        def update(cursor: Cursor) -> None:
            if cursor.execute("SELECT 1 FROM sweeps WHERE sweep_id = ?", [sweep_id]).fetchone() is None:
                raise KvlabError(f"There is no sweep {sweep_id} in {self.path}.")
            cursor.execute("UPDATE sweeps SET status = ?, message = ?, updated_at = ? WHERE sweep_id = ?",
                           [status, message, _utcnow(), sweep_id])

        self._write(update)

    def sweeps(self) -> list[SweepRecord]:
        """Every stored sweep, the most recently changed first."""
        with self._cursor() as cursor:
            rows = cursor.execute(
                "SELECT sweep_id, spec, status, message, started_by, created_at, updated_at FROM sweeps "
                "ORDER BY updated_at DESC, sweep_id DESC"
            ).fetchall()
        return [SweepRecord(int(sweep_id), json.loads(spec), status, message, started_by, created_at, updated_at)
                for sweep_id, spec, status, message, started_by, created_at, updated_at in rows]

    def list_runs(self, filters: RunFilter = RunFilter()) -> pd.DataFrame:
        """Runs matching ``filters``, oldest first, with their number of trials and accuracy (NaN without trials)."""
        where, params = _where(filters)
        return self._read(
            f"""
            SELECT r.*, coalesce(t.trials, 0) AS trials, t.accuracy, t.exact_accuracy
            FROM runs r LEFT JOIN (
                SELECT run_id, count(*) AS trials, avg(correct::DOUBLE) AS accuracy, avg(exact::DOUBLE) AS exact_accuracy FROM trials GROUP BY run_id
            ) t USING (run_id)
            WHERE {where} ORDER BY r.run_id
            """,
            params,
        )

    def trials_frame(self, filters: RunFilter = RunFilter()) -> pd.DataFrame:
        """One row per trial of the matching runs, with all run columns first; JSON columns stay JSON text."""
        return self._read_trials(
            "r.*, t.* EXCLUDE (run_id)", filters, "ORDER BY r.run_id, t.recorded_at, t.trial_key"
        )

    def accuracy_by_depth(self, filters: RunFilter = RunFilter()) -> pd.DataFrame:
        """Accuracy per (run, context length, depth), for needle-in-a-haystack heatmaps.

        The context length is the run's target length, or each trial's token count when the run has none.
        """
        return self._read_trials(
            "run_id, coalesce(r.context_length, t.context_tokens) AS context_length, t.depth, "
            "count(*) AS trials, avg(t.correct::DOUBLE) AS accuracy, avg(t.exact::DOUBLE) AS exact_accuracy",
            filters,
            "GROUP BY ALL ORDER BY ALL",
        )

    def accuracy_frontier(self, filters: RunFilter = RunFilter()) -> pd.DataFrame:
        """Accuracy and memory per (policy, mode, keep, budget_tokens), for accuracy-against-memory frontiers.

        Also grouped by model and task: averaging over different models or tasks would mix unlike things.
        """
        return self._read_trials(
            "r.model, r.task, r.policy, r.mode, r.keep, r.budget_tokens, count(DISTINCT run_id) AS runs, "
            "count(*) AS trials, avg(t.correct::DOUBLE) AS accuracy, avg(t.exact::DOUBLE) AS exact_accuracy, avg(t.kv_bytes) AS mean_kv_bytes, "
            "avg(t.peak_kv_bytes) AS mean_peak_kv_bytes, avg(t.kept_tokens) AS mean_kept_tokens",
            filters,
            "GROUP BY ALL ORDER BY ALL",
        )

    def _read_trials(self, select: str, filters: RunFilter, tail: str) -> pd.DataFrame:
        """A query over trials joined with their runs, restricted to the runs matching ``filters``."""
        where, params = _where(filters)
        return self._read(f"SELECT {select} FROM trials t JOIN runs r USING (run_id) WHERE {where} {tail}", params)

    def _read(self, sql: str, params: list[Any]) -> pd.DataFrame:
        """Run one query on a fresh cursor and return its rows as a DataFrame."""
        with self._cursor() as cursor:
            return cursor.execute(sql, params).df()

    def _write(self, work: Callable[[Cursor], T]) -> T:
        """Run ``work`` in one transaction, retrying when it collides with another thread's transaction.

        DuckDB resolves such collisions by failing one transaction (a write-write conflict, or a key that another
        uncommitted transaction inserted); the retry then sees the other's committed rows.
        """
        attempt = 1
        while True:
            with self._cursor() as cursor:
                try:
                    with _transaction(cursor):
                        return work(cursor)
                except (duckdb.TransactionException, duckdb.ConstraintException):
                    if attempt == _WRITE_ATTEMPTS:
                        raise
            time.sleep(_RETRY_PAUSE_S * attempt)
            attempt += 1

    @contextlib.contextmanager
    def _cursor(self) -> Iterator[Cursor]:
        """A cursor of this process's connection for the current unit of work, closed afterwards."""
        cursor = _new_cursor(self.path)
        try:
            yield cursor
        finally:
            cursor.close()


_SKIP_EXISTING = " ON CONFLICT DO NOTHING RETURNING trial_key"


def _run_row(config: RunConfig, key: str, provenance: Provenance, started_by: str | None) -> dict[str, Any]:
    """The runs row of a new run, column name to value."""
    return {
        "run_key": key,
        "status": "running",
        **dataclasses.asdict(config),
        "policy_params": _to_json(config.policy_params),
        "kvlab_version": provenance.kvlab_version,
        "git_commit": provenance.git_commit,
        "packages": _to_json(provenance.packages),
        "started_by": started_by,
        "started_at": _utcnow(),
    }


def _insert_sql(table: str, row: Mapping[str, Any]) -> str:
    """An INSERT of ``row``'s columns with one placeholder each (values are passed as parameters)."""
    return f"INSERT INTO {table} ({', '.join(row)}) VALUES ({', '.join('?' for _ in row)})"


def _require_run(cursor: Cursor, path: Path, run_id: int) -> None:
    """Refuse to touch a run that does not exist, so no trial is stored without its run."""
    if cursor.execute("SELECT 1 FROM runs WHERE run_id = ?", [run_id]).fetchone() is None:
        raise KvlabError(f"There is no run {run_id} in {path}.")


def _where(filters: RunFilter) -> tuple[str, list[Any]]:
    """The SQL condition on runs (aliased ``r``) for ``filters``, and its parameters."""
    clauses, params = ["TRUE"], []
    for name, column in _FILTER_COLUMNS.items():
        values = list(getattr(filters, name))
        if values:
            clauses.append(f"list_contains(?, r.{column})")
            params.append(values)
    return " AND ".join(clauses), params


# --- export -------------------------------------------------------------------------------------------------------

_EXPORT_SUFFIXES = (".csv", ".parquet")


def export_trials(store: Store, out_path: str | Path, filters: RunFilter = RunFilter()) -> int:
    """Write one row per trial of the matching runs, with the run's columns, to a .csv or .parquet file.

    Returns the number of rows written.
    """
    return _write_frame(lambda: store.trials_frame(filters), Path(out_path))


def export_runs(store: Store, out_path: str | Path, filters: RunFilter = RunFilter()) -> int:
    """Write one row per matching run (with its trial count and accuracy) to a .csv or .parquet file.

    Returns the number of rows written.
    """
    return _write_frame(lambda: store.list_runs(filters), Path(out_path))


def _write_frame(query: Callable[[], pd.DataFrame], out: Path) -> int:
    """Write the frame ``query`` returns to ``out`` in the format its extension names; the extension is checked
    before the query runs, so a typo costs nothing."""
    suffix = out.suffix.lower()
    if suffix not in _EXPORT_SUFFIXES:
        raise KvlabError(f"Cannot export to {out}: the file name must end in .csv or .parquet.")
    frame = query()
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        if suffix == ".csv":
            frame.to_csv(out, index=False)
        else:
            frame.to_parquet(out, index=False)
    except OSError as exc:
        raise KvlabError(f"Cannot write {out} ({exc.strerror}).") from exc
    return len(frame)
