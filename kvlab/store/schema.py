"""The store's schema: its migrations, kvlab's own marker, and which files kvlab may read or write.

A database is kvlab's when it carries kvlab's marker (the ``kvlab_meta`` table, from schema version 5 on), or,
for databases made before the marker existed, when it has exactly kvlab's tables with kvlab's columns. Any other
DuckDB file belongs to another application: it is refused and never written to, even when it happens to have a
table called ``schema_version``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import duckdb
import pandas as pd

from kvlab.answers import first_line_is, holds
from kvlab.errors import KvlabError
from kvlab.store.errors import DB_ENV_VAR, unreadable

Cursor = duckdb.DuckDBPyConnection

#: The row of ``kvlab_meta`` that marks a database as kvlab's.
MARKER = ("application", "kvlab")


def v1_initial(cursor: Cursor) -> None:
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


def v2_resumable_sweeps(cursor: Cursor) -> None:
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


def v3_exact_match(cursor: Cursor) -> None:
    """Two scores per trial: ``correct`` (the answer appears in the output) and ``exact`` (the output's first line
    is the answer). Older trials have no exact score (NULL)."""
    cursor.execute("ALTER TABLE trials ADD COLUMN exact BOOLEAN")


def v4_sweeps(cursor: Cursor) -> None:
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


def v5_identity_and_marker(cursor: Cursor) -> None:
    """A run's identity covers every setting that can change its result: the tokenizer, the task's content, the
    compression interval, whether the question is read before compression, the generation length and the stop
    rule get columns of their own (NULL for older runs, whose keys were computed without them and therefore never
    equal a new run's key); each trial records the hash of the prompt it answered. And the database is marked as
    kvlab's, so that no other application's file is ever mistaken for one."""
    cursor.execute(
        """
        CREATE TABLE kvlab_meta (key VARCHAR PRIMARY KEY, value VARCHAR NOT NULL);
        INSERT INTO kvlab_meta VALUES ('application', 'kvlab');
        ALTER TABLE runs ADD COLUMN tokenizer_hash VARCHAR;
        ALTER TABLE runs ADD COLUMN task_hash VARCHAR;
        ALTER TABLE runs ADD COLUMN compression_interval BIGINT;
        ALTER TABLE runs ADD COLUMN query_aware BOOLEAN;
        ALTER TABLE runs ADD COLUMN max_new_tokens BIGINT;
        ALTER TABLE runs ADD COLUMN stop_rule VARCHAR;
        ALTER TABLE trials ADD COLUMN item_hash VARCHAR;
        """
    )


def v6_heap_layouts(cursor: Cursor) -> None:
    """The KV heap: each run records its layout (``compact``, ``bitmask`` or ``threshold``) and the threshold's dead
    share, and each trial the bytes the heap reserved (at the end and at the most) besides those it used, and how
    often it compacted. Older runs (NULL) held their cache as ``compact`` does, without room reserved."""
    cursor.execute(
        """
        ALTER TABLE runs ADD COLUMN layout VARCHAR;
        ALTER TABLE runs ADD COLUMN compact_at DOUBLE;
        ALTER TABLE trials ADD COLUMN kv_reserved_bytes BIGINT;
        ALTER TABLE trials ADD COLUMN peak_kv_reserved_bytes BIGINT;
        ALTER TABLE trials ADD COLUMN compactions BIGINT;
        """
    )


def v7_quality_and_claims(cursor: Cursor) -> None:
    """Quality beyond needles and the articles' claims. A trial may score a text instead of answering a question:
    ``scored_tokens`` next tokens of a held-out text read under the run's cache, their mean negative
    log-likelihood (``nll``, so perplexity is ``exp(nll)``) and the mean KL divergence of each step's next-token
    distribution from the full cache's (``kl``); such a trial has no ``correct`` answer, so ``correct`` may be NULL.
    And ``claims`` holds, per quantitative claim of the articles, kvlab's figure, its verdict, where the figure came
    from (model and device), the command that reproduces it and when it was last refreshed."""
    cursor.execute(
        """
        ALTER TABLE trials ALTER COLUMN correct DROP NOT NULL;
        ALTER TABLE trials ADD COLUMN scored_tokens BIGINT;
        ALTER TABLE trials ADD COLUMN nll DOUBLE;
        ALTER TABLE trials ADD COLUMN kl DOUBLE;
        CREATE TABLE claims (
            claim_id VARCHAR PRIMARY KEY,
            article VARCHAR NOT NULL,
            claim VARCHAR NOT NULL,
            figure VARCHAR,
            verdict VARCHAR NOT NULL,
            reason VARCHAR,
            model VARCHAR,
            device VARCHAR,
            command VARCHAR NOT NULL,
            refreshed_at TIMESTAMP NOT NULL
        );
        """
    )


def v8_replays(cursor: Cursor) -> None:
    """Replays: a stored live run keeps its trace (the statistics of every pass, the bytes and survivors after every
    event, the text after every token) as one compressed payload, so it can be watched again without a model."""
    cursor.execute(
        """
        CREATE TABLE replays (
            run_id BIGINT NOT NULL,
            trial_key VARCHAR NOT NULL,
            payload BLOB NOT NULL,
            recorded_at TIMESTAMP NOT NULL,
            PRIMARY KEY (run_id, trial_key)
        );
        """
    )


def v9_heap_management(cursor: Cursor) -> None:
    """The cache as a managed heap: a run whose layer budgets follow a model's measured attention profile records
    that profile's hash (``profile_hash``, part of its identity), and each trial the slots its evictions ranked
    (``ranked_slots``, over sequences, KV heads and layers) and the seconds that ranking took outside static decode
    steps (``ranking_s``). Older trials (NULL) did not count them."""
    cursor.execute(
        """
        ALTER TABLE runs ADD COLUMN profile_hash VARCHAR;
        ALTER TABLE trials ADD COLUMN ranked_slots BIGINT;
        ALTER TABLE trials ADD COLUMN ranking_s DOUBLE;
        """
    )


def v10_uncertainty_and_reads(cursor: Cursor) -> None:
    """What a result's uncertainty and a sparse reader's cost need per trial: the share of eviction cuts that fell
    on tied scores (``tie_share``: where the position tie-break, not the score, decided), RULER's recall of the
    expected strings (``recall``, in [0, 1]) and the K/V bytes attention read per decoded token (``read_bytes``:
    less than those held for policies that read a subset of the cache) and the seconds of KVzip's reconstruction pass
    (``reconstruction_s``, also part of ``prefill_s``). Older trials (NULL) did not record them."""
    cursor.execute(
        """
        ALTER TABLE trials ADD COLUMN tie_share DOUBLE;
        ALTER TABLE trials ADD COLUMN recall DOUBLE;
        ALTER TABLE trials ADD COLUMN read_bytes DOUBLE;
        ALTER TABLE trials ADD COLUMN reconstruction_s DOUBLE;
        """
    )


def v11_tiers_and_devices(cursor: Cursor) -> None:
    """What a run beyond one GPU's memory records per trial, per sequence: the bytes demotion held at the end on the
    GPU beside the heap (page summaries, partial and recalled pages), in CPU memory and in the offload file
    (``gpu_tier_bytes``, ``cpu_tier_bytes``, ``disk_tier_bytes``), per decoded token the demoted pages and bytes
    fetched back and the seconds recalls took (``recalled_pages``, ``recalled_bytes``, ``recall_s``), and the K/V
    bytes held on each device of a model split over several (``device_bytes``, JSON). Older trials and runs that
    demote nothing or run on one device: NULL."""
    cursor.execute(
        """
        ALTER TABLE trials ADD COLUMN gpu_tier_bytes BIGINT;
        ALTER TABLE trials ADD COLUMN cpu_tier_bytes BIGINT;
        ALTER TABLE trials ADD COLUMN disk_tier_bytes BIGINT;
        ALTER TABLE trials ADD COLUMN recalled_pages DOUBLE;
        ALTER TABLE trials ADD COLUMN recalled_bytes DOUBLE;
        ALTER TABLE trials ADD COLUMN recall_s DOUBLE;
        ALTER TABLE trials ADD COLUMN device_bytes VARCHAR;
        """
    )


def v12_attention_backend(cursor: Cursor) -> None:
    """The attention backend a run's static decode steps used, part of its identity: ``flex``, or NULL for kvlab's own
    kernels (every older run)."""
    cursor.execute("ALTER TABLE runs ADD COLUMN attention VARCHAR;")


def v13_bos_rule(cursor: Cursor) -> None:
    """The rule a run's prompts were tokenised by, part of its identity: ``auto`` or ``never`` where they differ from
    ``always``, or NULL for ``always`` (every older run, whose identity stays what it was)."""
    cursor.execute("ALTER TABLE runs ADD COLUMN bos VARCHAR;")


def v14_answers_ignore_case(cursor: Cursor) -> None:
    """Answers are matched without regard to case, as RULER's scorer matches them (:mod:`kvlab.answers`): every
    trial scored against one expected answer (``exact`` not NULL: the needle tasks) has its ``correct`` and
    ``exact`` recomputed from its stored output, so that older verdicts follow the rule newer ones are made by (a
    base model answering ``Plain glacier.`` for ``plain glacier`` was counted as missing the needle)."""
    rows = cursor.execute(
        "SELECT run_id, trial_key, output, expected FROM trials "
        "WHERE exact IS NOT NULL AND output IS NOT NULL AND expected IS NOT NULL"
    ).fetchall()
    verdicts = pd.DataFrame(
        [
            (run_id, key, holds(output, expected), first_line_is(output, expected))
            for run_id, key, output, expected in rows
        ],
        columns=["run_id", "trial_key", "correct", "exact"],
    )
    cursor.register("rescored", verdicts)
    cursor.execute(
        "UPDATE trials SET correct = rescored.correct, exact = rescored.exact FROM rescored "
        "WHERE trials.run_id = rescored.run_id AND trials.trial_key = rescored.trial_key"
    )
    cursor.unregister("rescored")


#: Migration ``i`` takes a database from schema version ``i`` to ``i + 1``; a new database runs all of them.
MIGRATIONS: tuple[Callable[[Cursor], None], ...] = (
    v1_initial,
    v2_resumable_sweeps,
    v3_exact_match,
    v4_sweeps,
    v5_identity_and_marker,
    v6_heap_layouts,
    v7_quality_and_claims,
    v8_replays,
    v9_heap_management,
    v10_uncertainty_and_reads,
    v11_tiers_and_devices,
    v12_attention_backend,
    v13_bos_rule,
    v14_answers_ignore_case,
)
SCHEMA_VERSION = len(MIGRATIONS)
#: The first version with the marker; older kvlab databases are recognised by their tables and columns.
MARKED_FROM = 5

#: Tables and columns every kvlab database made before the marker has (versions 1 to 4).
_LEGACY_TABLES = {
    "schema_version": {"version"},
    "runs": {"run_id", "model", "policy", "policy_params", "mode", "started_at"},
    "trials": {"run_id", "task_id", "context_tokens", "correct"},
}
_LEGACY_OPTIONAL = {"sweeps"}


def stored_version(cursor: Cursor) -> int | None:
    """The schema version of a database: 0 when it has no tables yet, ``None`` when it is not kvlab's."""
    tables = _columns_by_table(cursor)
    if not tables:
        return 0
    if "kvlab_meta" in tables:
        marker = cursor.execute("SELECT key, value FROM kvlab_meta WHERE key = ?", [MARKER[0]]).fetchone()
        return _version(cursor) if marker == MARKER and "schema_version" in tables else None
    legacy = set(_LEGACY_TABLES) <= set(tables) <= set(_LEGACY_TABLES) | _LEGACY_OPTIONAL and all(
        columns <= tables[name] for name, columns in _LEGACY_TABLES.items()
    )
    version = _version(cursor) if legacy else None
    return version if version is not None and 1 <= version < MARKED_FROM else None


def _columns_by_table(cursor: Cursor) -> dict[str, set[str]]:
    """Every table of the database's main schema with its column names."""
    rows = cursor.execute(
        "SELECT table_name, column_name FROM duckdb_columns() WHERE database_name = current_database() "
        "AND schema_name = 'main'"
    ).fetchall()
    tables: dict[str, set[str]] = {}
    for table, column in rows:
        tables.setdefault(table, set()).add(column)
    return tables


def _version(cursor: Cursor) -> int | None:
    """The largest version recorded in ``schema_version``, if it is a whole number."""
    version = cursor.execute("SELECT max(version) FROM schema_version").fetchall()[0][0]
    return int(version) if isinstance(version, int) else None


def usable_version(path: Path, cursor: Cursor) -> int:
    """The schema version of an open database, refusing one that is unreadable, not kvlab's, or newer than this
    code: such a file must not be migrated or written to."""
    try:
        version = stored_version(cursor)
    except duckdb.Error as exc:
        raise unreadable(path, exc) from exc
    if version is None:
        raise KvlabError(f"The file {path} is a DuckDB database but not a kvlab one; it was left untouched.")
    if version > SCHEMA_VERSION:
        raise KvlabError(
            f"The database {path} has schema version {version}, newer than the {SCHEMA_VERSION} this kvlab "
            f"knows; upgrade kvlab or choose another file with --db or {DB_ENV_VAR}."
        )
    return version


def migrate(connection: Cursor, version: int) -> None:
    """Bring a database from ``version`` to the latest schema, one transaction per step, so an interrupted
    migration leaves the last complete version behind."""
    for target in range(version + 1, SCHEMA_VERSION + 1):
        connection.begin()
        try:
            MIGRATIONS[target - 1](connection)
            connection.execute("DELETE FROM schema_version")
            connection.execute("INSERT INTO schema_version VALUES (?)", [target])
        except BaseException:
            connection.rollback()
            raise
        connection.commit()
