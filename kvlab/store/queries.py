"""A handle on one run database: writes (runs, trials, sweeps) and the queries the pages and commands need.

Writes are explicit transactions, retried when they collide with another thread's. A handle opened for reading
(:func:`open_store` with ``read_only=True``) refuses to write, so the commands and pages that only read can never
change a file. Every failure of the file (a damaged block, a full disk) is one sentence.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, TypeVar, get_args

import duckdb
import pandas as pd

from kvlab.errors import KvlabError
from kvlab.hashing import text_sha256
from kvlab.provenance import Provenance, collect_provenance
from kvlab.store import connection
from kvlab.store.connection import default_db_path
from kvlab.store.errors import is_disk_full, query_error
from kvlab.store.rows import (
    FILTER_COLUMNS,
    ClaimRecord,
    EndStatus,
    RunConfig,
    RunFilter,
    SweepRecord,
    SweepStatus,
    Trial,
    canonical_json,
    run_key,
    utcnow,
)

Cursor = duckdb.DuckDBPyConnection
T = TypeVar("T")

#: Perplexity and KL of a group of trials over all their scored tokens: the exponential of the token-weighted mean
#: negative log-likelihood, and the token-weighted mean KL (NULL for trials that scored none).
_QUALITY = (
    "exp(sum(nll * scored_tokens) / sum(scored_tokens)) AS perplexity, "
    "sum(kl * scored_tokens) / sum(scored_tokens) AS kl"
)
_WRITE_ATTEMPTS = 20
_RETRY_PAUSE_S = 0.002
_SKIP_EXISTING = " ON CONFLICT DO NOTHING RETURNING trial_key"


def open_store(path: str | Path | None = None, *, read_only: bool = False) -> Store:
    """Open the run database at ``path``, or at :func:`~kvlab.store.connection.default_db_path`.

    For writing (the default) a missing file is created and an older schema migrated. ``read_only`` never creates,
    migrates or changes the file, and the handle refuses to write. Opening is where a missing, locked, corrupt,
    foreign or newer file is refused, so callers learn it before any work.
    """
    resolved = Path(path if path is not None else default_db_path()).expanduser().resolve()
    connection.check_openable(resolved, write=not read_only)
    return Store(resolved, read_only=read_only)


class Store:
    """A handle on one run database, safe to share between threads; obtain it from :func:`open_store`."""

    def __init__(self, path: Path, *, read_only: bool = False) -> None:
        self.path = path
        self.read_only = read_only

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Close this process's connection to the database, for every handle on it, and release the file lock.

        A later call on any handle opens it again, which marks runs still running as interrupted: close only when
        no run of this process is in flight.
        """
        connection.close(self.path)

    def schema_version(self) -> int:
        """The schema version of the database as this handle sees it."""
        with self._cursor() as cursor:
            return int(cursor.execute("SELECT max(version) FROM schema_version").fetchall()[0][0])

    # --- writes ------------------------------------------------------------------------------------------------

    def begin_run(
        self, config: RunConfig, *, started_by: str | None = None, provenance: Provenance | None = None
    ) -> int:
        """Start a run of ``config``, or resume the stored run with the same :func:`run_key`; returns its run_id.

        A resumed run is marked running again and keeps its first start time and provenance;
        :meth:`stored_trials` then says which trials to skip.
        """
        key = run_key(config)
        row = _run_row(config, key, provenance or collect_provenance(), started_by)

        def find_or_insert(cursor: Cursor) -> int:
            found = cursor.execute("SELECT run_id FROM runs WHERE run_key = ?", [key]).fetchone()
            if found is not None:
                cursor.execute("UPDATE runs SET status = 'running', ended_at = NULL WHERE run_id = ?", [found[0]])
                return int(found[0])
            return int(
                cursor.execute(_insert_sql("runs", row) + " RETURNING run_id", list(row.values())).fetchall()[0][0]
            )

        return self._write(find_or_insert)

    def finish_run(self, run_id: int, status: EndStatus = "finished") -> None:
        """Mark a run finished (or interrupted, when a sweep stops early) and record its end time."""
        if status not in get_args(EndStatus):
            raise ValueError(f"a run ends finished or interrupted, not {status!r}")

        def update(cursor: Cursor) -> None:
            self._require_run(cursor, run_id)
            cursor.execute("UPDATE runs SET status = ?, ended_at = ? WHERE run_id = ?", [status, utcnow(), run_id])

        self._write(update)

    def add_trials(self, run_id: int, trials: Iterable[Trial]) -> int:
        """Store trials of a run in one transaction; returns how many were new.

        A trial whose ``trial_key`` the run already has is skipped, so storing the same trial twice (a resumed or
        concurrent sweep) never duplicates it.
        """
        recorded_at = utcnow()
        rows = [{"run_id": run_id, **dataclasses.asdict(trial), "recorded_at": recorded_at} for trial in trials]

        def insert(cursor: Cursor) -> int:
            self._require_run(cursor, run_id)
            return sum(
                len(cursor.execute(_insert_sql("trials", row) + _SKIP_EXISTING, list(row.values())).fetchall())
                for row in rows
            )

        return self._write(insert)

    def add_trial(self, run_id: int, trial: Trial) -> bool:
        """Store one trial; ``False`` if the run already had it."""
        return self.add_trials(run_id, [trial]) == 1

    def stored_trials(self, run_id: int) -> dict[str, str | None]:
        """The trials already stored for a run, as trial key to the hash of the prompt each answered (``None`` for
        trials stored before prompts were hashed): what a resumed sweep skips, and checks."""
        with self._cursor() as cursor:
            rows = self._fetch(cursor, "SELECT trial_key, item_hash FROM trials WHERE run_id = ?", [run_id])
        return {key: item_hash for key, item_hash in rows}

    def begin_sweep(self, spec: Mapping[str, Any], *, started_by: str | None = None) -> int:
        """Record a sweep of ``spec`` as queued, or queue the stored sweep with the same spec again (resuming it);
        returns its sweep_id. A resumed sweep keeps who started it first."""
        text = canonical_json(spec)
        key = text_sha256(text)
        now = utcnow()

        def find_or_insert(cursor: Cursor) -> int:
            found = cursor.execute("SELECT sweep_id FROM sweeps WHERE sweep_key = ?", [key]).fetchone()
            if found is not None:
                cursor.execute(
                    "UPDATE sweeps SET status = 'queued', message = NULL, updated_at = ? WHERE sweep_id = ?",
                    [now, found[0]],
                )
                return int(found[0])
            row = {
                "sweep_key": key,
                "spec": text,
                "status": "queued",
                "started_by": started_by,
                "created_at": now,
                "updated_at": now,
            }
            return int(
                cursor.execute(_insert_sql("sweeps", row) + " RETURNING sweep_id", list(row.values())).fetchall()[0][0]
            )

        return self._write(find_or_insert)

    def set_sweep_status(self, sweep_id: int, status: SweepStatus, message: str | None = None) -> None:
        """Record where a sweep stands, with the sentence that says why when it failed."""
        if status not in get_args(SweepStatus):
            raise ValueError(f"unknown sweep status {status!r}")

        def update(cursor: Cursor) -> None:
            if cursor.execute("SELECT 1 FROM sweeps WHERE sweep_id = ?", [sweep_id]).fetchone() is None:
                raise KvlabError(f"There is no sweep {sweep_id} in {self.path}.")
            cursor.execute(
                "UPDATE sweeps SET status = ?, message = ?, updated_at = ? WHERE sweep_id = ?",
                [status, message, utcnow(), sweep_id],
            )

        self._write(update)

    # --- reads -------------------------------------------------------------------------------------------------

    def sweeps(self) -> list[SweepRecord]:
        """Every stored sweep, the most recently changed first."""
        with self._cursor() as cursor:
            rows = self._fetch(
                cursor,
                "SELECT sweep_id, spec, status, message, started_by, created_at, updated_at FROM sweeps "
                "ORDER BY updated_at DESC, sweep_id DESC",
                [],
            )
        return [
            SweepRecord(int(sweep_id), json.loads(spec), status, message, started_by, created_at, updated_at)
            for sweep_id, spec, status, message, started_by, created_at, updated_at in rows
        ]

    def list_runs(self, filters: RunFilter = RunFilter()) -> pd.DataFrame:
        """Runs matching ``filters``, oldest first, with their number of trials, accuracy, and for passes over a text
        perplexity and KL (each NaN where no trial has it: a text has no answer, a needle no perplexity)."""
        where, params = _where(filters)
        return self._read(
            f"""
            SELECT r.*, coalesce(t.trials, 0) AS trials, t.accuracy, t.exact_accuracy, t.recall, t.perplexity, t.kl
            FROM runs r LEFT JOIN (
                SELECT run_id, count(*) AS trials, avg(correct::DOUBLE) AS accuracy,
                       avg(exact::DOUBLE) AS exact_accuracy, avg(recall) AS recall, {_QUALITY}
                FROM trials GROUP BY run_id
            ) t USING (run_id)
            WHERE {where} ORDER BY r.run_id
            """,
            params,
        )

    def trials_frame(self, filters: RunFilter = RunFilter()) -> pd.DataFrame:
        """One row per trial of the matching runs, with all run columns first; JSON columns stay JSON text."""
        return self._read_trials("r.*, t.* EXCLUDE (run_id)", filters, "ORDER BY r.run_id, t.recorded_at, t.trial_key")

    def count_trials(self, filters: RunFilter = RunFilter()) -> int:
        """How many trials the matching runs hold (what :meth:`trials_frame` would return, counted, not read)."""
        return int(self._read_trials("count(*) AS trials", filters, "")["trials"].iloc[0])

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
        """Accuracy and memory per (policy and its parameters, mode, keep, budget_tokens), for accuracy-against-memory
        frontiers; for passes over a text, perplexity and KL over all their scored tokens.

        Also grouped by model and task: averaging over different models or tasks would mix unlike things.
        """
        return self._read_trials(
            "r.model, r.task, r.policy, r.policy_params, r.mode, r.keep, r.budget_tokens, "
            "count(DISTINCT run_id) AS runs, "
            "count(*) AS trials, avg(t.correct::DOUBLE) AS accuracy, avg(t.exact::DOUBLE) AS exact_accuracy, "
            f"{_QUALITY}, "
            "avg(t.recall) AS recall, "
            "avg(t.kv_bytes) AS mean_kv_bytes, avg(t.peak_kv_bytes) AS mean_peak_kv_bytes, "
            "avg(t.read_bytes) AS mean_read_bytes, avg(t.kept_tokens) AS mean_kept_tokens",
            filters,
            "GROUP BY ALL ORDER BY ALL",
        )

    # --- plumbing ----------------------------------------------------------------------------------------------

    def _read_trials(self, select: str, filters: RunFilter, tail: str) -> pd.DataFrame:
        """A query over trials joined with their runs, restricted to the runs matching ``filters``."""
        where, params = _where(filters)
        return self._read(f"SELECT {select} FROM trials t JOIN runs r USING (run_id) WHERE {where} {tail}", params)

    def _read(self, sql: str, params: list[Any]) -> pd.DataFrame:
        """Run one query on a fresh cursor and return its rows as a DataFrame."""
        with self._cursor() as cursor:
            try:
                return cursor.execute(sql, params).df()
            except duckdb.Error as exc:
                raise query_error(self.path, exc, writing=False) from exc

    def _fetch(self, cursor: Cursor, sql: str, params: list[Any]) -> list[tuple[Any, ...]]:
        """Rows of one query, a failure of the file being one sentence."""
        try:
            return cursor.execute(sql, params).fetchall()
        except duckdb.Error as exc:
            raise query_error(self.path, exc, writing=False) from exc

    def _write(self, work: Callable[[Cursor], T]) -> T:
        """Run ``work`` in one transaction, retrying when it collides with another thread's transaction.

        DuckDB resolves such collisions by failing one transaction (a write-write conflict, or a key that another
        uncommitted transaction inserted); the retry then sees the other's committed rows. Any other failure (a full
        disk, a damaged block) rolls the transaction back and is one sentence.
        """
        if self.read_only:
            raise ValueError(f"this handle on {self.path} was opened read-only")
        attempt = 1
        while True:
            with self._cursor(write=True) as cursor:
                try:
                    cursor.begin()
                    try:
                        result = work(cursor)
                        cursor.commit()
                        return result
                    except BaseException:
                        with contextlib.suppress(duckdb.Error):
                            cursor.rollback()
                        raise
                except (duckdb.TransactionException, duckdb.ConstraintException) as exc:
                    if attempt == _WRITE_ATTEMPTS or not _is_collision(exc):
                        raise query_error(self.path, exc, writing=True) from exc
                except duckdb.Error as exc:
                    raise query_error(self.path, exc, writing=True) from exc
            time.sleep(_RETRY_PAUSE_S * attempt)
            attempt += 1

    def _require_run(self, cursor: Cursor, run_id: int) -> None:
        """Refuse to touch a run that does not exist, so no trial is stored without its run."""
        if cursor.execute("SELECT 1 FROM runs WHERE run_id = ?", [run_id]).fetchone() is None:
            raise KvlabError(f"There is no run {run_id} in {self.path}.")

    @contextlib.contextmanager
    def _cursor(self, write: bool = False) -> Iterator[Cursor]:
        """A cursor for the current unit of work, closed afterwards."""
        with connection.cursor(self.path, write=write) as cursor:
            yield cursor

    # --- replays of live runs -----------------------------------------------------------------------------------

    def add_replay(self, run_id: int, trial_key: str, payload: bytes) -> None:
        """Keep a live run's replay (:mod:`kvlab.runs.replay`) with its trial; the latest recording of a trial
        replaces an earlier one, as running the same settings on the same prompt again is the same trial."""

        def upsert(cursor: Cursor) -> None:
            self._require_run(cursor, run_id)
            cursor.execute("INSERT OR REPLACE INTO replays VALUES (?, ?, ?, ?)", [run_id, trial_key, payload, utcnow()])

        self._write(upsert)

    def replays(self, filters: RunFilter = RunFilter()) -> pd.DataFrame:
        """The stored runs that can be replayed, newest first: every run column, the trial, its verdict, the
        payload's size and when it was recorded."""
        where, params = _where(filters)
        return self._read(
            f"""
            SELECT r.*, p.trial_key, t.correct, t.exact, octet_length(p.payload) AS replay_bytes, p.recorded_at
            FROM replays p JOIN runs r USING (run_id)
            LEFT JOIN trials t ON t.run_id = p.run_id AND t.trial_key = p.trial_key
            WHERE {where} ORDER BY p.recorded_at DESC, r.run_id DESC
            """,
            params,
        )

    def replay_payload(self, run_id: int, trial_key: str) -> bytes:
        """One stored replay's payload; a run without one is one sentence."""
        with self._cursor() as cursor:
            rows = self._fetch(
                cursor, "SELECT payload FROM replays WHERE run_id = ? AND trial_key = ?", [run_id, trial_key]
            )
        if not rows:
            raise KvlabError(f"Run {run_id} has no stored replay for {trial_key!r} in {self.path}.")
        return bytes(rows[0][0])

    # --- the articles' claims ----------------------------------------------------------------------------------

    def replace_claims(self, rows: Iterable[ClaimRecord]) -> int:
        """Make the claims table exactly ``rows``, in one transaction, so that a reader never sees half of one
        evaluation and half of the last; returns how many rows it holds."""
        records = [dataclasses.asdict(row) for row in rows]

        def replace(cursor: Cursor) -> int:
            cursor.execute("DELETE FROM claims")
            for record in records:
                cursor.execute(_insert_sql("claims", record), list(record.values()))
            return len(records)

        return self._write(replace)

    def claims_frame(self) -> pd.DataFrame:
        """The claims as last evaluated, one row per claim in the catalogue's numeric order."""
        return self._read("SELECT * FROM claims ORDER BY try_cast(claim_id AS INTEGER), claim_id", [])


def _is_collision(exc: duckdb.Error) -> bool:
    """Whether a failed transaction collided with another thread's (a write-write conflict, or a key another
    uncommitted transaction inserted: worth retrying), rather than failing on its own (a full disk also fails a
    commit with a transaction error, and retrying that would only fail again)."""
    text = str(exc)
    if is_disk_full(exc) or "Could not write" in text or "IO Error" in text:
        return False
    return "conflict" in text.lower() or "duplicate key" in text.lower()


def _run_row(config: RunConfig, key: str, provenance: Provenance, started_by: str | None) -> dict[str, Any]:
    """The runs row of a new run, column name to value."""
    return {
        "run_key": key,
        "status": "running",
        **dataclasses.asdict(config),
        "policy_params": canonical_json(config.policy_params),
        "kvlab_version": provenance.kvlab_version,
        "git_commit": provenance.git_commit,
        "packages": canonical_json(provenance.packages),
        "started_by": started_by,
        "started_at": utcnow(),
    }


def _insert_sql(table: str, row: Mapping[str, Any]) -> str:
    """An INSERT of ``row``'s columns with one placeholder each (values are passed as parameters)."""
    return f"INSERT INTO {table} ({', '.join(row)}) VALUES ({', '.join('?' for _ in row)})"


def _where(filters: RunFilter) -> tuple[str, list[Any]]:
    """The SQL condition on runs (aliased ``r``) for ``filters``, and its parameters."""
    clauses, params = ["TRUE"], []
    for name, column in FILTER_COLUMNS.items():
        values = list(getattr(filters, name))
        if values:
            clauses.append(f"list_contains(?, r.{column})")
            params.append(values)
    return " AND ".join(clauses), params
