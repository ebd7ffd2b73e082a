"""The needle grid page's cells and heatmap: pure functions of the store's runs and of their accuracy by depth, each
cell with its 95 % interval, and the :class:`~kvlab.dashboard.guides.ChartGuide` the page shows beside the heatmap."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from kvlab.dashboard.grid import depth_label
from kvlab.dashboard.guides import ChartGuide
from kvlab.policies import POLICIES
from kvlab.runs.sweep import requested_depth
from kvlab.runs.tables import LABELLED_COLUMNS, percent_interval, run_label, share_interval, trial_values

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
        "trials whose answer contains the hidden fact (for RULER's tasks, the mean recall of the expected "
        "strings), its text that share, its 95 % interval (Wilson's, or a bootstrap for recall) and n, the number "
        "of trials."
    ),
    good=(
        "A panel as blue as the full cache's at every depth and length: the policy keeps the fact wherever it hides. "
        "Cells of many trials each (n) and narrow intervals: a share of one or two trials is not a measurement, and "
        "two cells whose intervals overlap may differ by chance."
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
    short context, so grouping by where it sits would put trials of one requested depth in several columns.

    A trial's score is its recall where it has one (RULER's tasks), else 1 or 0 for a right or wrong answer;
    ``accuracy`` is their mean, ``scores`` the scores themselves (for the interval of cells that pool runs) and
    ``recalled`` how many of them are recalls."""
    columns = ["run_id", "context_length", "depth", "trials", "accuracy", "scores", "recalled"]
    if trials.empty:
        return pd.DataFrame(columns=columns)
    recall = trial_values(trials, "recall")
    frame = trials.assign(
        context_length=trials["context_length"].fillna(trials["context_tokens"]),
        depth=[
            sits if asked is None else asked
            for asked, sits in zip(map(requested_depth, trials["trial_key"]), trials["depth"])
        ],
        score=recall.fillna(trial_values(trials, "correct")),
        recalled=recall.notna().astype(int),
    ).dropna(subset=["score"])
    grouped = frame.groupby(["run_id", "context_length", "depth"], as_index=False).agg(
        trials=("score", "size"), accuracy=("score", "mean"), scores=("score", tuple), recalled=("recalled", "sum")
    )
    return grouped[columns]


def needle_grid(
    by_depth: pd.DataFrame, runs: pd.DataFrame, depths: Sequence[float] | None = None, depth_bins: int = 11
) -> pd.DataFrame:
    """The needle heatmap's cells from ``by_depth`` (:func:`depth_accuracy`, or ``Store.accuracy_by_depth``) and
    ``Store.list_runs``: one row per (run label, context length, depth) with ``accuracy`` in percent, its 95 %
    interval ``low``..``high`` (:func:`~kvlab.runs.tables.share_interval`, in percent), the number of ``trials`` and
    whether the cell's scores are RULER's ``recall``.

    With ``depths`` (the grid that was asked for), each row counts in the column of the nearest of them, so the
    columns are exactly those depths; without, depths are rounded to ``depth_bins`` evenly spaced values from 0 to
    1. Runs with the same label (policy, mode, budget) are pooled, weighted by their trials. Rows without their
    ``scores`` (``Store.accuracy_by_depth``'s) are right-or-wrong answers, counted from their accuracy and trials.
    """
    columns = ["label", "context_length", "depth", "accuracy", "low", "high", "trials", "recall"]
    frame = by_depth.dropna(subset=["depth"]).merge(runs[["run_id", *LABELLED_COLUMNS]], on="run_id")
    if frame.empty:
        return pd.DataFrame(columns=columns)
    frame["label"] = [run_label(*row) for row in frame[LABELLED_COLUMNS].itertuples(index=False)]
    if "scores" not in frame:
        right = (frame["accuracy"] * frame["trials"]).round().astype(int)
        frame["scores"] = [(1.0,) * k + (0.0,) * (int(n) - k) for k, n in zip(right, frame["trials"])]
        frame["recalled"] = 0
    measured = frame["depth"].astype(float).to_numpy()
    if depths:
        grid = np.asarray(sorted(depths), dtype=float)
        frame["depth"] = grid[np.abs(measured[:, None] - grid[None, :]).argmin(axis=1)]
    else:
        frame["depth"] = np.round(measured * (depth_bins - 1)) / (depth_bins - 1)
    cells = frame.groupby(["label", "context_length", "depth"], as_index=False).agg(
        scores=("scores", lambda pooled: sum(pooled, ())), recalled=("recalled", "sum")
    )
    scores = [pd.Series(values, dtype=float) for values in cells["scores"]]
    bounds = [share_interval(values) for values in scores]
    cells["accuracy"] = [100 * values.mean() for values in scores]
    cells["low"] = [100 * low for low, _ in bounds]
    cells["high"] = [100 * high for _, high in bounds]
    cells["trials"] = [len(values) for values in scores]
    cells["recall"] = cells["recalled"] > 0
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


def _interval_texts(cells: pd.DataFrame) -> list[str]:
    """Each cell's 95 % interval as text (``24–76``); ``—`` for cells without one."""
    if "low" not in cells:
        return ["—"] * len(cells)
    return [percent_interval(low / 100, high / 100) for low, high in zip(cells["low"], cells["high"])]


def _cell_text(accuracy: float, interval: object, trials: float) -> str:
    """A cell's text: ``50%``, its interval ``24–76`` where it has one, ``n=2``; nothing for a cell without trials."""
    if pd.isna(accuracy):
        return ""
    shown = [interval] if isinstance(interval, str) and interval != "—" else []
    return "<br>".join([f"{accuracy:.0f}%", *shown, f"n={int(trials)}"])


def _pivot(panel: pd.DataFrame, values: str, contexts: list[int], depths: list[float]) -> pd.DataFrame:
    """One column of a panel's cells as a context length x depth table over the whole figure's lengths and depths."""
    return panel.pivot(index="context_length", columns="depth", values=values).reindex(index=contexts, columns=depths)


def _panel(
    panel: pd.DataFrame, label: str, contexts: list[int], depths: list[float], with_text: bool, scale: bool
) -> go.Heatmap:
    """One label's heatmap: every context length and depth of the figure, a cell without trials left blank."""
    accuracy = _pivot(panel, "accuracy", contexts, depths)
    trials = _pivot(panel, "trials", contexts, depths)
    intervals = _pivot(panel.assign(interval=_interval_texts(panel)), "interval", contexts, depths)
    text = [
        [_cell_text(a, ci, n) for a, ci, n in zip(row_a, row_ci, row_n)]
        for row_a, row_ci, row_n in zip(accuracy.to_numpy(), intervals.to_numpy(), trials.to_numpy())
    ]
    measure = "recall" if "recall" in panel and panel["recall"].any() else "accuracy"
    return go.Heatmap(
        z=accuracy.to_numpy(),
        x=[depth_label(depth) for depth in depths],
        y=[str(c) for c in contexts],
        zmin=0,
        zmax=100,
        colorscale=ACCURACY_SCALE,
        text=text,
        texttemplate="%{text}" if with_text else None,
        customdata=np.stack(
            [trials.fillna(0).astype(int).to_numpy(), intervals.astype(object).fillna("—").to_numpy()], axis=-1
        ),
        colorbar=dict(title=f"{measure} %"),
        showscale=scale,
        xgap=2,
        ygap=2,
        name=label,
        hovertemplate=(
            f"%{{fullData.name}}<br>context %{{y}} tokens<br>depth %{{x}}<br>{measure} %{{z:.0f}}% "
            "(95% CI %{customdata[1]}) of %{customdata[0]} trials<extra></extra>"
        ),
    )
