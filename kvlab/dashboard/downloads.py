"""Stored runs and trials, and comparisons of them, as file contents for the dashboard's download buttons.

The bytes of runs and trials are written by the store's own exporters (:func:`kvlab.store.export_runs` and
:func:`~kvlab.store.export_trials`), so a download is exactly what ``python -m kvlab export`` writes for the same runs.
A comparison is the HTML report of :mod:`kvlab.dashboard.report`, stamped with the time it was downloaded.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvlab.dashboard.report import Report, report_html
from kvlab.store import RunFilter, Store, export_runs, export_trials
from kvlab.store.rows import utcnow

MIME_TYPES = {".csv": "text/csv", ".parquet": "application/vnd.apache.parquet", ".html": "text/html"}


def export_bytes(store: Store, table: str, suffix: str, filters: RunFilter = RunFilter()) -> bytes:
    """The ``runs`` or ``trials`` export of the matching runs, in the format the suffix (``.csv`` or ``.parquet``)
    names."""
    exporter = export_trials if table == "trials" else export_runs
    with tempfile.TemporaryDirectory() as directory:
        out = Path(directory) / f"{table}{suffix}"
        exporter(store, out, filters)
        return out.read_bytes()


def report_file(build: Callable[..., Report], *arguments: Any) -> bytes:
    """The report ``build(*arguments)`` as an HTML file made now: a download button's data, so that a report (its
    figures built again, its tables and guides) costs nothing until it is clicked."""
    return report_html(build(*arguments), utcnow()).encode()
