"""Databases as an older kvlab left them, for the tests of the store's migrations."""

from __future__ import annotations

import duckdb

from kvlab.store import MIGRATIONS


def at_schema(connection: duckdb.DuckDBPyConnection, version: int) -> None:
    """Give an empty database kvlab's schema ``version``: its first ``version`` migrations, and that version
    recorded, as that kvlab would have left it."""
    for migration in MIGRATIONS[:version]:
        migration(connection)
    connection.execute("INSERT INTO schema_version VALUES (?)", [version])
