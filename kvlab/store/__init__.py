"""The run store: every run and trial kvlab measures, kept in one DuckDB file.

A *run* is one configuration (model, weights, tokenizer, policy and its parameters, budget, mode, chunk, KV heap
layout, task and its content, generation settings, seed, device, dtype) with the provenance that produced it; a
*trial* is one prompt answered under that run. Sweeps are resumable because a run is found again by
:func:`run_key`, the hash of its configuration, and a trial by its ``trial_key``: re-running a sweep skips what
:meth:`Store.stored_trials` returns, and storing a trial twice stores it once.

The package's modules: :mod:`~kvlab.store.rows` (the values), :mod:`~kvlab.store.schema` (migrations and kvlab's
marker), :mod:`~kvlab.store.connection` (opening files for reading or writing), :mod:`~kvlab.store.queries` (the
:class:`Store`), :mod:`~kvlab.store.export` (CSV and Parquet files) and :mod:`~kvlab.store.errors` (one sentence per
failure). Schema, migrations and the default location are described in ``docs/store.md``.
"""

from kvlab.store.connection import StoreVersion, default_db_path, has_database, store_version
from kvlab.store.errors import DB_ENV_VAR
from kvlab.store.export import export_runs, export_trials
from kvlab.store.queries import Store, open_store
from kvlab.store.rows import ClaimRecord, EndStatus, RunConfig, RunFilter, SweepRecord, SweepStatus, Trial, run_key
from kvlab.store.schema import MIGRATIONS, SCHEMA_VERSION

__all__ = [
    "DB_ENV_VAR",
    "MIGRATIONS",
    "SCHEMA_VERSION",
    "ClaimRecord",
    "EndStatus",
    "RunConfig",
    "RunFilter",
    "Store",
    "StoreVersion",
    "SweepRecord",
    "SweepStatus",
    "Trial",
    "default_db_path",
    "export_runs",
    "export_trials",
    "has_database",
    "open_store",
    "run_key",
    "store_version",
]
