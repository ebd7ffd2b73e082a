"""The store's failures as one sentence each: a file held by another process, a file that is not a readable
database, a damaged block met while reading, a full disk met while writing.

Every sentence says what happened to the file (nothing, or nothing beyond the transaction that failed), because the
worry of a user who sees a database error is whether their runs are still there.
"""

from __future__ import annotations

import re
from pathlib import Path

import duckdb

from kvlab.errors import KvlabError

#: Environment variable naming the database file; overrides the per-user default.
DB_ENV_VAR = "KVLAB_DB"

_LOCK_MESSAGE = re.compile(r"\block\b", re.IGNORECASE)  # a word: "block" appears in corruption messages
_LOCK_HOLDER = re.compile(r"PID (\d+)")
_CORRUPT_MARKERS = ("not a valid DuckDB database", "Corrupt database", "checksum", "corrupt")
_DISK_FULL_MARKERS = ("No space left on device", "Disk quota exceeded", "File too large")
_ERROR_CATEGORY = re.compile(r"^[A-Za-z ]*Error: ")  # DuckDB's "IO Error: " prefix


def _detail(exc: BaseException) -> str:
    """DuckDB's reason without its category prefix or trailing punctuation."""
    return _ERROR_CATEGORY.sub("", str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__).rstrip(
        ".!"
    )


def open_error(path: Path, exc: duckdb.Error) -> KvlabError:
    """The sentence for a file DuckDB would not open: held by another process, or unreadable."""
    message = str(exc)
    if not _LOCK_MESSAGE.search(message):
        return unreadable(path, exc)
    holder = _LOCK_HOLDER.search(message)
    pid = f" (pid {holder.group(1)})" if holder else ""
    return KvlabError(
        f"The database {path} is in use by another process{pid}; close it or choose another file with --db "
        f"or {DB_ENV_VAR}."
    )


def unreadable(path: Path, exc: BaseException) -> KvlabError:
    """The sentence for a file that cannot be read as a database; it always says the file was not touched."""
    detail = _detail(exc)
    if any(marker in detail for marker in _CORRUPT_MARKERS):
        return KvlabError(
            f"The file {path} is not a readable kvlab database (it is corrupt or not a DuckDB file); "
            "it was left untouched."
        )
    if is_disk_full(exc):
        return disk_full(path)
    return KvlabError(f"The database {path} cannot be opened ({detail}); it was left untouched.")


def is_disk_full(exc: BaseException) -> bool:
    """Whether a failure is the file system refusing more bytes."""
    return any(marker in str(exc) for marker in _DISK_FULL_MARKERS)


def disk_full(path: Path) -> KvlabError:
    """The sentence for a write that found no space."""
    return KvlabError(
        f"The database {path} could not be written because its disk is full; what was stored before is intact, "
        "and nothing of this step was kept: free some space and run again."
    )


def query_error(path: Path, exc: duckdb.Error, writing: bool) -> KvlabError:
    """The sentence for a query or write that failed on a database that opened: a damaged block, a full disk, or
    anything else DuckDB reports."""
    if is_disk_full(exc):
        return disk_full(path)
    detail = _detail(exc)
    if any(marker in detail for marker in _CORRUPT_MARKERS) or "Could not read" in detail:
        return KvlabError(
            f"The database {path} is damaged: part of it cannot be read ({detail}); it was left untouched."
        )
    action = "written" if writing else "read"
    return KvlabError(f"The database {path} could not be {action} ({detail}); nothing of this step was kept.")
