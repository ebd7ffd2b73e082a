"""The RULER grid's table and chart: each run's recall per RULER task and its RULER score, with 95 % intervals.

Pure functions of the store's runs (``Store.list_runs``) and of their scores (:func:`kvlab.tasks.ruler_score.
ruler_scores`), with the :class:`~kvlab.dashboard.guides.ChartGuide` the page shows beside the chart.
"""

from __future__ import annotations

from collections.abc import Mapping

import pandas as pd
import plotly.graph_objects as go

from kvlab.dashboard.guides import ChartGuide
from kvlab.runs.tables import LABELLED_COLUMNS, percent_interval, run_label
from kvlab.tasks.ruler import RULER_TASKS
from kvlab.tasks.ruler_score import SCORE, RulerScore, scores_frame

RULER_GUIDE = ChartGuide(
    axes=(
        "Across, RULER's score (the mean over tasks of each task's mean recall) and then each task; one bar per "
        "policy at the chosen kept fraction (the full cache once) and context length. A bar's height is the recall "
        "in percent (the share of expected strings the answers contain, as RULER scores), its whisker the 95 % "
        "interval."
    ),
    good=(
        "Bars as tall as the full cache's on every task, whiskers overlapping it: at this budget the policy keeps "
        "what each task needs. Short whiskers: enough items per task to tell policies apart."
    ),
    bad=(
        "Bars well below the full cache's, whiskers apart from it: the policy loses the needles, chains or word "
        "counts that task reads (multi-key and aggregation tasks often fall first). A low full cache means the "
        "model itself cannot do the task at this length, and the policies' bars say nothing there."
    ),
)


def ruler_rows(runs: pd.DataFrame, scores: Mapping[int, RulerScore]) -> pd.DataFrame:
    """One row per (run, task) of the scored runs, the RULER score first and the tasks in RULER's order: the run's
    ``label`` and ``context_length``, the ``task``, ``recall``, ``low`` and ``high`` in percent, and the ``items``
    behind it."""
    columns = ["label", "context_length", "task", "recall", "low", "high", "items"]
    rows = scores_frame(scores)
    if rows.empty:
        return pd.DataFrame(columns=columns)
    named = runs[["run_id", "context_length", *LABELLED_COLUMNS]].copy()
    named["label"] = [run_label(*row) for row in named[LABELLED_COLUMNS].itertuples(index=False)]
    frame = rows.merge(named[["run_id", "label", "context_length"]], on="run_id")
    frame[["recall", "low", "high"]] = 100 * frame[["recall", "low", "high"]]
    order = {task: place for place, task in enumerate((SCORE, *RULER_TASKS))}
    frame["order"] = frame["task"].map(order)
    frame = frame.sort_values(["context_length", "label", "order"])
    return frame[columns].reset_index(drop=True)


def ruler_table(rows: pd.DataFrame) -> pd.DataFrame:
    """:func:`ruler_rows` as the page's table: one row per run (label and context length), one column for the RULER
    score and one per task, each cell ``recall (low–high)`` in percent with the items behind it in the column
    ``items``."""
    if rows.empty:
        return pd.DataFrame()
    cells = rows.assign(
        text=[
            f"{recall:.1f} ({percent_interval(low / 100, high / 100)})"
            for recall, low, high in zip(rows["recall"], rows["low"], rows["high"])
        ]
    )
    table = cells.pivot_table(index=["label", "context_length"], columns="task", values="text", aggfunc="first")
    tasks = list(dict.fromkeys(rows["task"]))
    items = cells[cells["task"] == SCORE].set_index(["label", "context_length"])["items"]
    table = table[tasks].assign(items=items)
    table.columns.name = None
    return table.reset_index().rename(columns={"label": "run", "context_length": "context (tokens)"})


def ruler_bars(rows: pd.DataFrame) -> go.Figure:
    """Grouped bars of :func:`ruler_rows`: the RULER score and each task across, one bar per run (with its context
    length when the runs span several), whiskers from each interval."""
    figure = go.Figure()
    several = rows["context_length"].nunique() > 1
    for (label, context), run in rows.groupby(["label", "context_length"], sort=False):
        name = f"{label} · {int(context):,} tokens" if several else label
        figure.add_bar(
            x=run["task"],
            y=run["recall"],
            name=name,
            error_y=dict(
                type="data", symmetric=False, array=run["high"] - run["recall"], arrayminus=run["recall"] - run["low"]
            ),
            customdata=run[["low", "high", "items"]].to_numpy(),
            hovertemplate=(
                f"{name}<br>%{{x}}: %{{y:.1f}}% (95% interval %{{customdata[0]:.1f}}–%{{customdata[1]:.1f}}), "
                "%{customdata[2]} items<extra></extra>"
            ),
        )
    figure.update_layout(
        barmode="group",
        yaxis=dict(title="recall (%)", range=[0, 105]),
        xaxis=dict(title="RULER task", type="category"),
        legend=dict(orientation="h", y=-0.3),
        height=420,
        margin=dict(t=30),
    )
    return figure
