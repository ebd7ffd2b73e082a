"""The needle grid page's cells and heatmap: pure functions of the store's runs and of their accuracy by depth."""

from __future__ import annotations

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from kvlab.policies import POLICIES
from kvlab.ui.tables import LABELLED_COLUMNS, run_label

ACCURACY_SCALE = [[0.0, "#b2182b"], [0.5, "#fddbc7"], [0.75, "#d1e5f0"], [1.0, "#2166ac"]]


def needle_grid(by_depth: pd.DataFrame, runs: pd.DataFrame, depth_bins: int = 11) -> pd.DataFrame:
    """The needle heatmap's cells from ``Store.accuracy_by_depth`` and ``Store.list_runs``: one row per
    (run label, context length, depth bin) with ``accuracy`` in percent and the number of ``trials``.

    Trials record where the needle really sits, which is near but rarely exactly at the requested depth, so depths
    are rounded to ``depth_bins`` evenly spaced values from 0 to 1. Runs with the same label (policy, mode, budget)
    are pooled, weighted by their trials.
    """
    columns = ["label", "context_length", "depth", "accuracy", "trials"]
    frame = by_depth.dropna(subset=["depth"]).merge(runs[["run_id", *LABELLED_COLUMNS]], on="run_id")
    if frame.empty:
        return pd.DataFrame(columns=columns)
    frame["label"] = [run_label(*row) for row in frame[LABELLED_COLUMNS].itertuples(index=False)]
    frame["depth"] = np.round(frame["depth"].astype(float) * (depth_bins - 1)) / (depth_bins - 1)
    frame["correct"] = frame["accuracy"] * frame["trials"]
    cells = frame.groupby(["label", "context_length", "depth"], as_index=False)[["correct", "trials"]].sum()
    cells["accuracy"] = 100 * cells["correct"] / cells["trials"]
    return cells[columns]


def at_budget(runs: pd.DataFrame, keep: float) -> pd.DataFrame:
    """The runs at kept fraction ``keep``, and those of the policies that take no budget: the full cache (the
    ceiling every budget is measured against) and the first-token ablation."""
    budgetless = runs["policy"].map(lambda name: name in POLICIES and not POLICIES[name].evicts)
    return runs[budgetless | (runs["keep"].astype(float).sub(keep).abs() < 1e-9)]


def needle_heatmaps(cells: pd.DataFrame, max_panels: int = 6) -> go.Figure:
    """The classic needle-in-a-haystack grid, one panel per run label side by side: context length (rows) x
    needle depth (columns), colour = accuracy in percent, each cell annotated with its accuracy and trials."""
    labels = sorted(cells["label"].unique())[:max_panels]
    if not labels:
        figure = go.Figure()
        figure.add_annotation(
            text="No stored needle trials for this selection.",
            showarrow=False,
            x=0.5,
            y=0.5,
            xref="paper",
            yref="paper",
        )
        figure.update_layout(xaxis_visible=False, yaxis_visible=False, height=260)
        return figure
    contexts = sorted(cells["context_length"].unique())
    figure = make_subplots(rows=1, cols=len(labels), subplot_titles=labels, shared_yaxes=True, horizontal_spacing=0.03)
    for index, label in enumerate(labels, start=1):
        panel = cells[cells["label"] == label]
        accuracy = panel.pivot(index="context_length", columns="depth", values="accuracy").reindex(contexts)
        trials = panel.pivot(index="context_length", columns="depth", values="trials").reindex(
            index=contexts, columns=accuracy.columns
        )
        text = [
            [("" if pd.isna(a) else f"{a:.0f}%<br>n={int(n)}") for a, n in zip(row_a, row_n)]
            for row_a, row_n in zip(accuracy.to_numpy(), trials.to_numpy())
        ]
        figure.add_trace(
            go.Heatmap(
                z=accuracy.to_numpy(),
                x=[f"{100 * d:.0f}%" for d in accuracy.columns],
                y=[str(c) for c in contexts],
                zmin=0,
                zmax=100,
                colorscale=ACCURACY_SCALE,
                text=text,
                texttemplate="%{text}",
                colorbar=dict(title="accuracy %"),
                showscale=index == 1,
                xgap=2,
                ygap=2,
                hovertemplate="context %{y} tokens<br>depth %{x}<br>accuracy %{z:.0f}%<extra></extra>",
            ),
            row=1,
            col=index,
        )
        figure.update_xaxes(title_text="needle depth", type="category", row=1, col=index)
    figure.update_yaxes(title_text="context length (tokens)", type="category", row=1, col=1)
    figure.update_layout(height=120 + 70 * len(contexts), margin=dict(t=60, b=40))
    return figure
