"""Stored runs and trials written out as CSV or Parquet files, safely.

An export never writes over the database it reads (or its write-ahead log), nor over any other DuckDB database,
whatever path, symlink or hard link names it; it never writes through a symlink into the file it points to (the
link itself is replaced); it never creates directories (a typo in a path is a sentence, not a new directory tree);
and it writes a temporary file next to the target and renames it, so a full disk leaves the old file, not half a
new one. In CSV, text cells that a spreadsheet would run as a formula (starting with ``=``,
``+``, ``-``, ``@``, a tab or a carriage return) get a leading apostrophe, as OWASP advises against formula
injection; Parquet keeps values exactly, since it is read as data.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path

import pandas as pd

from kvlab.errors import KvlabError
from kvlab.settings import positive_setting
from kvlab.store.connection import store_files
from kvlab.store.queries import Store
from kvlab.store.rows import RunConfig, RunFilter, Trial, canonical_json

EXPORT_SUFFIXES = (".csv", ".parquet")
#: What a spreadsheet treats as the start of a formula.
FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")
#: Raises the most rows one export may hold (an export is built in memory before it is written).
MAX_EXPORT_ROWS_ENV = "KVLAB_MAX_EXPORT_ROWS"
DEFAULT_MAX_EXPORT_ROWS = 1_000_000
_DUCKDB_MAGIC = b"DUCK"
_DUCKDB_MAGIC_OFFSET = 8


def most_export_rows() -> int:
    """The most rows one export may hold: ``KVLAB_MAX_EXPORT_ROWS``, or a million (about 1 GiB of memory while
    it is written)."""
    return positive_setting(MAX_EXPORT_ROWS_ENV, "rows") or DEFAULT_MAX_EXPORT_ROWS


def export_trials(store: Store, out_path: str | Path, filters: RunFilter = RunFilter()) -> int:
    """Write one row per trial of the matching runs, with the run's columns, to a .csv or .parquet file.

    Returns the number of rows written.
    """
    rows = store.count_trials(filters)
    if rows > most_export_rows():
        raise KvlabError(
            f"The export would write {rows:,} trials, more than the {most_export_rows():,} one export may hold; "
            f"narrow it (--run-id, --policy, --mode, ...) or set {MAX_EXPORT_ROWS_ENV} to raise the limit."
        )
    return write_frame(lambda: store.trials_frame(filters), Path(out_path), protected=_in_use(store))


def export_runs(store: Store, out_path: str | Path, filters: RunFilter = RunFilter()) -> int:
    """Write one row per matching run (with its trial count and accuracy) to a .csv or .parquet file.

    Returns the number of rows written.
    """
    return write_frame(lambda: store.list_runs(filters), Path(out_path), protected=_in_use(store))


def _in_use(store: Store) -> list[Path]:
    """The files an export of ``store`` must never write: the database and its write-ahead log."""
    return list(store_files(store.path))


def record_frame(config: RunConfig, trial: Trial) -> pd.DataFrame:
    """One run and one of its trials as one row with the columns of a trials export (run columns first), for a
    result that could not be stored."""
    row = {
        **dataclasses.asdict(config),
        "policy_params": canonical_json(config.policy_params),
        **dataclasses.asdict(trial),
    }
    return pd.DataFrame([row])


def escape_formulas(frame: pd.DataFrame) -> pd.DataFrame:
    """The frame with every text cell that a spreadsheet would read as a formula prefixed by an apostrophe."""
    escaped = frame.copy()
    for column in escaped.columns:
        if escaped[column].dtype == object or pd.api.types.is_string_dtype(escaped[column]):
            escaped[column] = escaped[column].map(
                lambda value: "'" + value if isinstance(value, str) and value.startswith(FORMULA_STARTS) else value
            )
    return escaped


def frame_bytes(frame: pd.DataFrame, suffix: str) -> bytes:
    """A frame as the bytes of a .csv (formulas escaped) or .parquet file."""
    if suffix == ".csv":
        return escape_formulas(frame).to_csv(index=False).encode("utf-8")
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "frame.parquet"
        frame.to_parquet(path, index=False)
        return path.read_bytes()


def check_output(out: Path, protected: Iterable[Path] = ()) -> Path:
    """The file an export may write for ``out`` (its directory resolved, its own name kept: a symlink there is
    replaced by the export, never written through), or one sentence saying why not: a wrong extension, a missing
    directory, a directory, a file in use (``protected``: compared after resolving links, and by inode for hard
    links), or any DuckDB database."""
    suffix = out.suffix.lower()
    if suffix not in EXPORT_SUFFIXES:
        raise KvlabError(f"Cannot export to {out}: the file name must end in .csv or .parquet.")
    given = out.expanduser()
    target = given.parent.resolve() / given.name  # the name itself, not what a link there points to
    if not target.parent.is_dir():
        raise KvlabError(f"Cannot export to {out}: the directory {out.parent} does not exist; create it first.")
    if target.is_dir():
        raise KvlabError(f"Cannot export to {out}: it is a directory.")
    for path in protected:
        if target.resolve() == path.resolve() or (target.exists() and path.exists() and os.path.samefile(target, path)):
            raise KvlabError(f"Refusing to export to {out}: it is {path}, which the export reads; choose another file.")
    if target.is_file() and _is_duckdb(target):
        raise KvlabError(f"Refusing to export to {out}: it is a DuckDB database, and an export never writes over one.")
    return target


def _is_duckdb(path: Path) -> bool:
    """Whether a file starts like a DuckDB database."""
    try:
        with path.open("rb") as handle:
            head = handle.read(_DUCKDB_MAGIC_OFFSET + len(_DUCKDB_MAGIC))
    except OSError:
        return False
    return head[_DUCKDB_MAGIC_OFFSET:] == _DUCKDB_MAGIC


def write_frame(query: Callable[[], pd.DataFrame], out: Path, protected: Iterable[Path] = ()) -> int:
    """Write the frame ``query`` returns to ``out`` in the format its extension names; the path is checked before
    the query runs, so a typo costs nothing. Returns the number of rows."""
    target = check_output(out, protected)
    frame = query()
    data = frame_bytes(frame, target.suffix.lower())
    try:
        handle, temporary = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".part", dir=target.parent)
    except OSError as exc:  # a directory that takes no new files (/proc, a read-only mount)
        raise KvlabError(f"Cannot write {out} ({exc.strerror}); nothing was written.") from None
    try:
        with os.fdopen(handle, "wb") as stream:
            stream.write(data)
        os.replace(temporary, target)
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise KvlabError(f"Cannot write {out} ({exc.strerror}); nothing was written.") from exc
    return len(frame)
