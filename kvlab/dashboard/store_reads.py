"""Frames of a run store that pages read, kept once per server process and version of the store's files.

The Runs and Frontier pages read every trial of the runs they show and work out each run's shares with their
intervals: for the shipped evidence, about 0.6 s of a 2-core machine's time per page view, spent again in every new
tab (a new session) and at every redraw, while the store had not changed. The Frontier then works out each
selection's points and builds its chart: about 0.2 s more per selection. Kept by the store's path and version
(:func:`kvlab.store.store_version`: the size and modification time of the database and its write-ahead log), a
frame or chart is worked out again as soon as a commit changes the store, and never otherwise.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import pandas as pd
import plotly.graph_objects as go
import streamlit as st

from kvlab.dashboard.session import open_page_store
from kvlab.dashboard.store_figures import axis_frontier_figure
from kvlab.runs.tables import frontier_points, run_shares
from kvlab.store import RunFilter, Store, StoreVersion, store_version

#: The queries over runs that :func:`read_frame` keeps: :class:`~kvlab.store.Store`'s methods of that name.
FrameQuery = Literal["list_runs", "trials_frame", "accuracy_frontier"]


@st.cache_data(show_spinner=False, max_entries=64)
def _frame(path: str, version: StoreVersion, query: FrameQuery, filters: RunFilter) -> pd.DataFrame:
    """``query`` over the runs ``filters`` keeps, of the store at ``path`` as it was at ``version``."""
    with open_page_store(Path(path)) as store:
        frame: pd.DataFrame = getattr(store, query)(filters)
    return frame


@st.cache_data(show_spinner=False, max_entries=32)
def _shares(path: str, version: StoreVersion, filters: RunFilter) -> pd.DataFrame:
    """:func:`~kvlab.runs.tables.run_shares` of the trials of the runs ``filters`` keeps."""
    return run_shares(_frame(path, version, "trials_frame", filters))


@st.cache_data(show_spinner=False, max_entries=32)
def _frontier(
    path: str, version: StoreVersion, filters: RunFilter, axis: str, metric: str
) -> tuple[pd.DataFrame, go.Figure]:
    """:func:`~kvlab.runs.tables.frontier_points` of the runs ``filters`` keeps, and their chart."""
    trials = _frame(path, version, "trials_frame", filters)
    points = frontier_points(_frame(path, version, "accuracy_frontier", filters), axis, metric, trials)
    return points, axis_frontier_figure(points, axis, metric)


def read_frame(store: Store, query: FrameQuery, filters: RunFilter = RunFilter()) -> pd.DataFrame:
    """``store``'s ``query`` over the runs ``filters`` keeps, read again only when the store has changed."""
    return _frame(str(store.path), store_version(store.path), query, filters)


def read_shares(store: Store, filters: RunFilter = RunFilter()) -> pd.DataFrame:
    """Each run's shares with their intervals (:func:`~kvlab.runs.tables.run_shares`) over the runs ``filters``
    keeps, worked out again only when the store has changed."""
    return _shares(str(store.path), store_version(store.path), filters)


def read_frontier(store: Store, filters: RunFilter, axis: str, metric: str) -> tuple[pd.DataFrame, go.Figure]:
    """The Frontier's points of the runs ``filters`` keeps on ``axis`` and ``metric``
    (:func:`~kvlab.runs.tables.frontier_points`, with their intervals) and their chart
    (:func:`~kvlab.dashboard.store_figures.axis_frontier_figure`), worked out again only when the store has changed.
    Each caller gets its own copy of the figure (a kept figure is unpickled in about a fifth of the time it takes to
    build)."""
    return _frontier(str(store.path), store_version(store.path), filters, axis, metric)
