"""The needle grid page's cells and heatmap: pure functions of the store's runs and of their accuracy by depth, with
the :class:`~kvlab.ui.guides.ChartGuide` the page shows beside the heatmap."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from kvlab.policies import POLICIES
from kvlab.sweep import requested_depth
from kvlab.ui.grid import depth_label
from kvlab.ui.guides import ChartGuide
from kvlab.ui.tables import LABELLED_COLUMNS, run_label

ACCURACY_SCALE = [[0.0, "#b2182b"], [0.5, "#fddbc7"], [0.75, "#d1e5f0"], [1.0, "#2166ac"]]
#: Characters of a panel title's line when the heatmap is about 850 px wide (the page at 1,280 px with the sidebar
#: open), shared among its panels; a title is wrapped at its `` · `` separators and a part longer is shortened.
TITLE_CHARACTERS = 110
#: The fewest characters a panel title's line is given, however many panels share the width.
MIN_TITLE_CHARACTERS = 14
#: Cells across all panels beyond which the cells carry no text (it would not fit); the hover still has it.
MAX_TEXT_COLUMNS = 24

NEEDLE_GUIDE = ChartGuide(
    axes=(
        "One panel per policy at the chosen kept fraction (the full cache once); down, the context length, across, "
        "the needle depth from the start (0%) to the end (100%) of the text. A cell's colour is the share of its "
        "trials whose answer contains the hidden fact, its text that share and n, the number of trials."
    ),
    good=(
        "A panel as blue as the full cache's at every depth and length: the policy keeps the fact wherever it hides. "
        "Cells of many trials each (n): a share of one or two trials is not a measurement."
    ),
    bad=(
        "Red columns or rows where the full cache is blue: the policy evicts the fact at those depths (often the "
        "middle, or all but the most recent text) or at longer contexts. A red full cache means the model itself "
        "cannot answer, so the policies' panels say nothing there."
    ),
)


def depth_accuracy(trials: pd.DataFrame) -> pd.DataFrame:
    """``Store.accuracy_by_depth``'s rows from ``Store.trials_frame``'s: accuracy per (run, context length, depth),
    where a sweep's trial counts at the depth it asked for (its key names it) and any other trial at the depth where
    its needle sits. The needle lands at a sentence boundary near the depth asked for, sometimes tenths away in a
    short context, so grouping by where it sits would put trials of one requested depth in several columns."""
    columns = ["run_id", "context_length", "depth", "trials", "accuracy"]
    if trials.empty:
        return pd.DataFrame(columns=columns)
    frame = trials.assign(
        context_length=trials["context_length"].fillna(trials["context_tokens"]),
        depth=[
            sits if asked is None else asked
            for asked, sits in zip(map(requested_depth, trials["trial_key"]), trials["depth"])
        ],
        correct=trials["correct"].astype(float),
    ).dropna(subset=["correct"])
    grouped = frame.groupby(["run_id", "context_length", "depth"], as_index=False).agg(
        trials=("correct", "size"), accuracy=("correct", "mean")
    )
    return grouped[columns]


def needle_grid(
    by_depth: pd.DataFrame, runs: pd.DataFrame, depths: Sequence[float] | None = None, depth_bins: int = 11
) -> pd.DataFrame:
    """The needle heatmap's cells from ``by_depth`` (:func:`depth_accuracy`, or ``Store.accuracy_by_depth``) and
    ``Store.list_runs``: one row per (run label, context length, depth) with ``accuracy`` in percent and the number
    of ``trials``.

    With ``depths`` (the grid that was asked for), each row counts in the column of the nearest of them, so the
    columns are exactly those depths; without, depths are rounded to ``depth_bins`` evenly spaced values from 0 to
    1. Runs with the same label (policy, mode, budget) are pooled, weighted by their trials.
    """
    columns = ["label", "context_length", "depth", "accuracy", "trials"]
    frame = by_depth.dropna(subset=["depth"]).merge(runs[["run_id", *LABELLED_COLUMNS]], on="run_id")
    if frame.empty:
        return pd.DataFrame(columns=columns)
    frame["label"] = [run_label(*row) for row in frame[LABELLED_COLUMNS].itertuples(index=False)]
    measured = frame["depth"].astype(float).to_numpy()
    if depths:
        grid = np.asarray(sorted(depths), dtype=float)
        frame["depth"] = grid[np.abs(measured[:, None] - grid[None, :]).argmin(axis=1)]
    else:
        frame["depth"] = np.round(measured * (depth_bins - 1)) / (depth_bins - 1)
    frame["correct"] = frame["accuracy"] * frame["trials"]
    cells = frame.groupby(["label", "context_length", "depth"], as_index=False)[["correct", "trials"]].sum()
    cells["accuracy"] = 100 * cells["correct"] / cells["trials"]
    return cells[columns]


def at_budget(runs: pd.DataFrame, keep: float) -> pd.DataFrame:
    """The runs at kept fraction ``keep``, and those of the policies that take no budget: the full cache (the
    ceiling every budget is measured against) and the first-token ablation."""
    budgetless = runs["policy"].map(lambda name: name in POLICIES and not POLICIES[name].evicts)
    return runs[budgetless | (runs["keep"].astype(float).sub(keep).abs() < 1e-9)]


def panel_title(label: str, characters: int) -> str:
    """A run label as a panel title of lines of at most ``characters``: wrapped at its `` · `` separators and, inside
    a policy's parameters, after their commas; a word longer than a line shortened with an ellipsis (the hover names
    the run in full), so that two variants of one policy stay apart."""
    words = [word for part in label.split(" · ") for word in _after_commas(part)]
    words = [word if len(word) <= characters else word[: characters - 1] + "…" for word in words]
    lines = [words[0]]
    for previous, word in zip(words, words[1:]):
        joint = " " if previous.endswith(",") else " · "
        if len(lines[-1]) + len(joint) + len(word) <= characters:
            lines[-1] += joint + word
        else:
            lines.append(word)
    return "<br>".join(lines)


def _after_commas(part: str) -> list[str]:
    """A label part split after each ``", "`` (the separator of a policy's parameters), commas kept."""
    pieces = part.split(", ")
    return [piece + "," for piece in pieces[:-1]] + [pieces[-1]]


def needle_heatmaps(cells: pd.DataFrame, max_panels: int = 6) -> go.Figure:
    """The classic needle-in-a-haystack grid, one panel per run label side by side: context length (rows) x
    needle depth (columns), colour = accuracy in percent, each cell annotated with its accuracy and trials (when
    the cells are wide enough for the text; the hover always has it)."""
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
    depths = sorted(cells["depth"].unique())
    characters = max(MIN_TITLE_CHARACTERS, TITLE_CHARACTERS // len(labels))
    titles = [panel_title(label, characters) for label in labels]
    title_lines = max(title.count("<br>") + 1 for title in titles)
    with_text = len(labels) * len(depths) <= MAX_TEXT_COLUMNS
    figure = make_subplots(rows=1, cols=len(labels), subplot_titles=titles, shared_yaxes=True, horizontal_spacing=0.03)
    for index, label in enumerate(labels, start=1):
        figure.add_trace(
            _panel(cells[cells["label"] == label], label, contexts, depths, with_text, index == 1), 1, index
        )
        figure.update_xaxes(title_text="needle depth", type="category", row=1, col=index)
    figure.update_annotations(font_size=12)
    figure.update_yaxes(title_text="context length (tokens)", type="category", row=1, col=1)
    figure.update_layout(height=130 + 16 * title_lines + 70 * len(contexts), margin=dict(t=30 + 16 * title_lines, b=40))
    return figure


def _panel(
    panel: pd.DataFrame, label: str, contexts: list[int], depths: list[float], with_text: bool, scale: bool
) -> go.Heatmap:
    """One label's heatmap: every context length and depth of the figure, a cell without trials left blank."""
    accuracy = panel.pivot(index="context_length", columns="depth", values="accuracy").reindex(
        index=contexts, columns=depths
    )
    trials = panel.pivot(index="context_length", columns="depth", values="trials").reindex(
        index=contexts, columns=depths
    )
    text = [
        [("" if pd.isna(a) else f"{a:.0f}%<br>n={int(n)}") for a, n in zip(row_a, row_n)]
        for row_a, row_n in zip(accuracy.to_numpy(), trials.to_numpy())
    ]
    return go.Heatmap(
        z=accuracy.to_numpy(),
        x=[depth_label(depth) for depth in depths],
        y=[str(c) for c in contexts],
        zmin=0,
        zmax=100,
        colorscale=ACCURACY_SCALE,
        text=text,
        texttemplate="%{text}" if with_text else None,
        customdata=trials.fillna(0).astype(int).to_numpy(),
        colorbar=dict(title="accuracy %"),
        showscale=scale,
        xgap=2,
        ygap=2,
        name=label,
        hovertemplate=(
            "%{fullData.name}<br>context %{y} tokens<br>depth %{x}<br>accuracy %{z:.0f}% of %{customdata} trials"
            "<extra></extra>"
        ),
    )
