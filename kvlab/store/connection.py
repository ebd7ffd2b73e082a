"""Connections to run databases: one per database file and process, opened for reading or for writing.

DuckDB lets one process at a time open a file for writing, and one process cannot hold the same file open in two
ways at once. So each process keeps one connection per file in a registry, and every unit of work runs on its own
cursor of it (no cursor is shared between threads). A reader uses whatever connection the file has, or opens it
read-only: reading never creates, migrates or otherwise changes a file, so a read-only file can be listed and
another application's file is left exactly as it was. A database of an older schema is read through a copy
upgraded in memory. A writer needs a writable connection: a read-only one is closed once no cursor uses it and the
file is opened again for writing, which is the one moment a database is migrated.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import duckdb

from kvlab.errors import KvlabError
from kvlab.paths import user_file
from kvlab.store.errors import DB_ENV_VAR, disk_full, is_disk_full, open_error, query_error, unreadable
from kvlab.store.rows import utcnow
from kvlab.store.schema import SCHEMA_VERSION, migrate, usable_version

Cursor = duckdb.DuckDBPyConnection


def default_db_path(env: Mapping[str, str] = os.environ) -> Path:
    """Where runs are stored unless a path is given: ``$KVLAB_DB``, else ``$XDG_DATA_HOME/kvlab/runs.duckdb``,
    else ``~/.local/share/kvlab/runs.duckdb``.

    Per user rather than per checkout, so the dashboard and every sweep of one user see the same runs.
    """
    return user_file(env, DB_ENV_VAR, "XDG_DATA_HOME", ".local/share", "kvlab", "runs.duckdb")


def has_database(path: Path) -> bool:
    """Whether ``path`` is a file with a database to read: an empty file (what a creation that found a full disk
    leaves) holds none, so a reader treats it as missing."""
    return path.is_file() and path.stat().st_size > 0


@dataclass
class _Entry:
    """This process's connection to one file, whether it may write, and how many cursors use it now."""

    connection: duckdb.DuckDBPyConnection
    writable: bool
    users: int = 0
    broken: bool = False


_entries: dict[Path, _Entry] = {}
_condition = threading.Condition()


@contextlib.contextmanager
def cursor(path: Path, *, write: bool) -> Iterator[Cursor]:
    """A cursor of this process's connection to ``path`` for one unit of work, closed afterwards; writable when
    ``write``. The connection is opened (for writing: created and migrated) on first use."""
    with _condition:
        entry = _usable_entry(path, write)
        entry.users += 1
        try:
            unit = entry.connection.cursor()
        except BaseException:
            entry.users -= 1
            raise
    try:
        yield unit
    except duckdb.FatalException:
        entry.broken = True  # DuckDB invalidates a database after a fatal error; the next unit opens it again
        raise
    finally:
        unit.close()
        with _condition:
            entry.users -= 1
            _condition.notify_all()


def _usable_entry(path: Path, write: bool) -> _Entry:
    """The registry's entry for ``path``, (re)opened when there is none, it is broken, or a writer finds it
    read-only; called with the registry's condition held."""
    while True:
        entry = _entries.get(path)
        if entry is not None and not entry.broken and (entry.writable or not write):
            return entry
        if entry is None:
            opened = _open_writable(path) if write else _open_read_only(path)
            _entries[path] = _Entry(opened, writable=write)
            continue
        if entry.users:
            _condition.wait()  # the read-only or broken connection is still in use; look again when it is not
            continue
        del _entries[path]
        with contextlib.suppress(duckdb.Error):
            entry.connection.close()


def close(path: Path) -> None:
    """Close this process's connection to ``path`` (once no cursor uses it) and release the file."""
    with _condition:
        entry = _entries.get(path)
        while entry is not None and entry.users:
            _condition.wait()
            entry = _entries.get(path)
        if entry is not None:
            del _entries[path]
            entry.connection.close()


def check_openable(path: Path, *, write: bool) -> None:
    """Open ``path`` now in the way asked, so that a refused file is reported before any work."""
    with cursor(path, write=write):
        pass


def read_every_block(path: Path, connection: duckdb.DuckDBPyConnection) -> None:
    """Read every column of every table of the database once (DuckDB checks each block's checksum as it reads), so
    that a damaged block is one sentence now: a writer refuses what a reader would call damaged, before it writes."""
    tables = connection.execute("SELECT table_name FROM duckdb_tables() WHERE schema_name = 'main'").fetchall()
    for (table,) in tables:
        try:
            connection.execute(f'SELECT bit_xor(hash(COLUMNS(*))) FROM "{table}"').fetchall()
        except duckdb.Error as exc:
            raise query_error(path, exc, writing=False) from exc


def _open_writable(path: Path) -> duckdb.DuckDBPyConnection:
    """Open ``path`` for writing, creating it when missing, and bring its schema up to date.

    An existing file is first inspected read-only, every block of it read as a reader would (a damaged store is
    refused untouched, not written into), so a file that will be refused is never opened for writing. An
    empty file (what a database whose creation found a full disk leaves) holds nothing and is created afresh; a
    file this call created is removed again when creating it fails. Runs still marked running, and sweeps still
    queued or running, are marked interrupted: DuckDB's file lock means no other process can be writing them, and
    this process has no writable connection yet, so none of its own is in flight.
    """
    created = not path.exists() or (path.is_file() and path.stat().st_size == 0)
    if created:
        _create_parent(path)
        path.unlink(missing_ok=True)
    else:
        with contextlib.closing(_duckdb_connect(path, read_only=True)) as inspection:
            usable_version(path, inspection)
            read_every_block(path, inspection)
    try:
        connection = _duckdb_connect(path, read_only=False)
    except KvlabError:
        if created:
            _remove_new_database(path)
        raise
    try:
        migrate(connection, usable_version(path, connection))
        connection.execute("UPDATE runs SET status = 'interrupted' WHERE status = 'running'")
        connection.execute(
            "UPDATE sweeps SET status = 'interrupted', updated_at = ? WHERE status IN ('queued', 'running')", [utcnow()]
        )
    except duckdb.Error as exc:
        connection.close()
        if created:
            _remove_new_database(path)
        raise (disk_full(path) if is_disk_full(exc) else unreadable(path, exc)) from exc
    except BaseException:
        connection.close()
        if created:
            _remove_new_database(path)
        raise
    return connection


def _open_read_only(path: Path) -> duckdb.DuckDBPyConnection:
    """Open ``path`` read-only, or, when its schema is older than this code's, an upgraded copy of it in memory
    (the file itself is upgraded only by a command that writes)."""
    if not has_database(path):
        raise KvlabError(f"There is no kvlab database at {path}; choose one with --db or {DB_ENV_VAR}.")
    connection = _duckdb_connect(path, read_only=True)
    try:
        version = usable_version(path, connection)
    except BaseException:
        connection.close()
        raise
    if version == SCHEMA_VERSION:
        return connection
    connection.close()
    copy = duckdb.connect(":memory:")
    try:
        copy.execute(f"ATTACH {_sql_string(str(path))} AS source (READ_ONLY)")
        copy.execute("COPY FROM DATABASE source TO memory")
        copy.execute("DETACH source")
        migrate(copy, version)
    except duckdb.Error as exc:
        copy.close()
        raise unreadable(path, exc) from exc
    return copy


def _sql_string(text: str) -> str:
    """``text`` as an SQL string literal (ATTACH takes no parameters)."""
    return "'" + text.replace("'", "''") + "'"


def store_files(path: Path) -> tuple[Path, Path]:
    """A store's files: the database and its write-ahead log (where a commit goes until a checkpoint moves it)."""
    return path, path.with_name(path.name + ".wal")


#: A store's version as :func:`store_version` gives it.
StoreVersion = tuple[tuple[int, int], ...]


def store_version(path: Path) -> StoreVersion:
    """What changes whenever a commit changes the store at ``path``: the size and modification time of each of its
    files (``(-1, -1)`` for one that is absent). The key of what is read from it and kept (the dashboard's frames)."""
    version = []
    for file in store_files(path):
        try:
            stat = file.stat()
        except FileNotFoundError:
            version.append((-1, -1))
        else:
            version.append((stat.st_size, stat.st_mtime_ns))
    return tuple(version)


def _remove_new_database(path: Path) -> None:
    """Remove what a failed creation left (the file and its write-ahead log), so no broken file stays behind."""
    for leftover in store_files(path):
        with contextlib.suppress(OSError):
            leftover.unlink()


def _duckdb_connect(path: Path, *, read_only: bool) -> duckdb.DuckDBPyConnection:
    """``duckdb.connect`` with its failures turned into one sentence."""
    try:
        return duckdb.connect(str(path), read_only=read_only)
    except duckdb.Error as exc:
        raise open_error(path, exc) from exc


def _create_parent(path: Path) -> None:
    """Create the directory of a new database file."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise KvlabError(f"The directory {path.parent} for the database cannot be created ({exc.strerror}).") from exc
