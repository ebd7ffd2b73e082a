"""Figures of stored runs, pure functions of the tables in :mod:`kvlab.runs.tables`, each with the
:class:`~kvlab.dashboard.guides.ChartGuide` that the pages and the HTML report show beside it."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.colors import qualitative

from kvlab.dashboard.guides import ChartGuide
from kvlab.modes import PREFILL, STREAMING
from kvlab.policies import is_full_cache
from kvlab.runs.tables import (
    METRICS,
    Metric,
    axis_title,
    changed_params,
    is_byte_axis,
    memory_text,
    percent_interval,
    policy_with,
    quality_text,
)
from kvlab.units import byte_axis, format_bytes

#: How far apart neighbouring lines are drawn on a byte axis, in powers of two (2**0.06: 4.2 %), and on the kept
#: fraction, in kept fraction: a marker's width apart on a half-screen chart.
LOG_DODGE = 0.06
LINEAR_DODGE = 0.015
#: Marker symbols, one per parameter setting of a policy (its lines share the policy's colour), so that its
#: settings are told apart. A policy past the palette's length (:data:`POLICY_COLOURS`) reuses a colour, with the
#: open form of these symbols.
SYMBOLS = (
    "circle",
    "square",
    "diamond",
    "triangle-up",
    "x",
    "triangle-down",
    "cross",
    "star",
    "pentagon",
    "hexagon",
    "hourglass",
    "bowtie",
    "star-diamond",
    "hexagram",
    "triangle-left",
    "triangle-right",
)
#: One colour per policy on a frontier, in the legend's order of policies (the full cache first).
POLICY_COLOURS = qualitative.Plotly
#: One dash per mode, so that a policy's prefill and streaming lines are told apart; a mode not listed is dotted.
MODE_DASHES = {PREFILL: "solid", STREAMING: "dash"}
#: The Pareto front's colour: a mid grey, seen on a light page and on a dark one alike.
FRONT_COLOUR = "#888888"
#: Markers are this opaque, so that a marker under another one still shows.
MARKER_OPACITY = 0.75

FRONTIER_GUIDE = ChartGuide(
    axes=(
        "One line per policy, parameter setting and mode: a colour per policy, a marker per parameter setting "
        "and a dash per mode (solid for prefill, dashed for streaming). Across, the memory each budget kept "
        "(measured from each trial's cache tensors per sequence and averaged, in binary units: KiB, MiB, GiB; or the "
        "kept fraction), up, the quality its trials reached, with its 95 % interval as a whisker (Wilson's for "
        "right-or-wrong answers, a bootstrap for recall). Bytes read per decoded token are less than those held "
        "only for policies that read a subset of the cache; on that axis a run stored before reads were recorded "
        "sits at the bytes it held, and the axis title says so. Lines are drawn "
        "a little apart (4 % of memory, or 1.5 points of kept fraction, per line) so that points at the same "
        "budget do not hide one another; the hover gives the measured values and names every line at that budget. "
        "The legend lists the lines under their policy, with the parameters all of them changed beside the "
        "policy's name; it scrolls when it holds more than it shows. Click a line in it to hide or show that "
        "line; double-click one to see it alone, and again to see them all."
    ),
    good=(
        "A policy whose line stays near the full cache's quality while moving far to the left: the same answers "
        "with much less memory. Circled points are on the Pareto front: nothing else is as good with less memory."
    ),
    bad=(
        "A line that drops as soon as memory shrinks, or points of a few trials each (the hover's n, a long "
        "whisker): a 100 % from two trials is not a measurement, and two points whose whiskers overlap may differ "
        "by chance. Lines far from the full cache at every budget lose what the task needs."
    ),
)

RUN_QUALITY_GUIDE = ChartGuide(
    axes=(
        "One bar per compared run: its quality on the chosen measure. For shares, the whisker is the 95 % "
        "interval of its answered trials (Wilson's for right-or-wrong answers, a seeded bootstrap for RULER's "
        "recall), and the hover gives the interval and how many trials stand behind the bar."
    ),
    good="A bar close to the full cache's, with a short whisker: many trials agree on that quality.",
    bad=(
        "A bar far below the full cache's, or a long whisker: too few trials to tell the runs apart. Overlapping "
        "whiskers mean the difference between two runs may be chance; for runs that answered the same items, the "
        "paired test (McNemar) beside the chart decides it with more power."
    ),
)

RUN_MEMORY_GUIDE = ChartGuide(
    axes=(
        "Two bars per compared run: the KV cache it held at the end of a trial and at its peak, measured from the "
        "cache tensors and averaged over its trials, in binary units (KiB, MiB, GiB)."
    ),
    good="An evicting run far below the full cache's bars, its peak close to its end: the budget held throughout.",
    bad=(
        "A peak far above the end: the cache grew before it was evicted, so the device still needed the larger "
        "memory. Bars as high as the full cache's: nothing was saved."
    ),
)

#: A frontier's height without its legend (the plot, its axes and margins), the height of one row of its legend,
#: and the most its legend may take: a legend of more rows scrolls inside that height, so the plot keeps its size
#: however many lines are drawn.
FRONTIER_PLOT_PX = 500
LEGEND_ROW_PX = 19
LEGEND_MAX_PX = 210
#: The band under a frontier's plot that holds its x axis' ticks and title, above the legend.
AXIS_BAND_PX = 60


def _empty(text: str) -> go.Figure:
    """A blank figure that says why it is blank."""
    figure = go.Figure()
    figure.add_annotation(text=text, showarrow=False, x=0.5, y=0.5, xref="paper", yref="paper")
    figure.update_layout(xaxis_visible=False, yaxis_visible=False, height=360)
    return figure


def _same_budget(points: pd.DataFrame, bytes_axis: bool, metric: Metric) -> list[str]:
    """For each point, the hover lines of every point at its budget (the same measured memory), so that a point
    hidden under another is still named."""
    budget = points["x"].map(lambda x: f"{x:.6g}")
    shown = points[["line", "y", "low", "high", "trials"]].itertuples(index=False)
    lines = [
        f"{line} · {quality_text(y, metric)} ({_interval_text(low, high)}n={trials})"
        for line, y, low, high, trials in shown
    ]
    at_budget = pd.Series(lines, index=points.index).groupby(budget).agg("<br>".join)
    return [
        f"At {memory_text(float(x), bytes_axis)}{' held (no reads recorded)' if held else ''}:<br>{at_budget[key]}"
        for x, held, key in zip(points["x"], points["held_fallback"], budget)
    ]


def _interval_text(low: float, high: float) -> str:
    """A point's 95 % interval (in percent) for its hover, ``95% CI 24–76, `` (nothing where it has none)."""
    text = percent_interval(low / 100, high / 100)
    return "" if text == "—" else f"95% CI {text}, "


def _dodged(points: pd.DataFrame, bytes_axis: bool) -> pd.Series:
    """Each point's drawn position: its line's position among the lines, centred, times a small shift (a factor
    on a logarithmic byte axis, an offset on the kept fraction)."""
    order = {line: index for index, line in enumerate(sorted(points["line"].unique()))}
    offset = points["line"].map(order).astype(float) - (len(order) - 1) / 2
    if bytes_axis:
        return points["x"].astype(float) * np.exp2(LOG_DODGE * offset)
    return points["x"].astype(float) + LINEAR_DODGE * offset


def _log_byte_axis(drawn: pd.Series) -> dict[str, object]:
    """A logarithmic byte axis with round binary ticks, its range reaching the ticks on either side of the data
    so that at least two of them show."""
    axis = byte_axis(float(drawn.min()), float(drawn.max()), log=True)
    ticks = axis["tickvals"]
    assert isinstance(ticks, list)
    low, high = min(ticks[0], float(drawn.min())), max(ticks[-1], float(drawn.max()))
    return {**axis, "range": [math.log10(low) - 0.05, math.log10(high) + 0.05]}


def _fraction_axis(drawn: pd.Series) -> dict[str, object]:
    """A linear kept-fraction axis from 0 to 1, widened to hold lines drawn a little apart at either end."""
    return {"type": "linear", "range": [min(0.0, float(drawn.min()) - 0.02), max(1.05, float(drawn.max()) + 0.03)]}


def frontier_legend(points: pd.DataFrame) -> pd.DataFrame:
    """How each line of a frontier is drawn and listed, one row per line (indexed by ``line``, in the legend's
    order): its policy's legend ``group``, the group's ``title`` (the policy, with the parameters every one of its
    lines changed; none for the full cache's line, named in full), the line's ``entry`` under it (the
    parameters left, and the mode), its ``colour`` (one per policy, :data:`POLICY_COLOURS`), ``symbol`` (one per
    parameter setting of its policy, :data:`SYMBOLS`) and ``dash`` (one per mode, :data:`MODE_DASHES`).

    Why: the shipped runs draw over 30 lines, most of them settings of a few policies; a legend naming each line in
    full wrapped onto a row per line and took half the chart. Under their policy's name, with the parameters they
    share said once, the entries are short, and a line is still named exactly: its group's title and its entry
    together are its name, which the hover gives in full."""
    lines = points.drop_duplicates("line").set_index("line")
    params = lines["policy_params"] if "policy_params" in lines else pd.Series(None, index=lines.index)
    changed = {line: changed_params(policy, value) for line, policy, value in zip(lines.index, lines["policy"], params)}
    policies = sorted(lines["policy"].unique(), key=lambda policy: (not is_full_cache(policy), policy))
    rows = []
    for order, policy in enumerate(policies):
        own = lines.index[lines["policy"] == policy]
        shared = [value for value in changed[own[0]] if all(value in changed[line] for line in own)]
        left = {line: tuple(value for value in changed[line] if value not in shared) for line in own}
        settings = sorted(set(left.values()))  # the setting with only the shared parameters first
        marker_form = "-open" if (order // len(POLICY_COLOURS)) % 2 else ""
        full = is_full_cache(policy)
        for line in sorted(own, key=lambda line: (settings.index(left[line]), str(lines.at[line, "mode"]))):
            mode = str(lines.at[line, "mode"])
            rows.append(
                {
                    "line": line,
                    "group": policy,
                    "title": "" if full else policy_with(policy, shared),
                    "entry": line if full else " · ".join([", ".join(left[line]), mode] if left[line] else [mode]),
                    "colour": POLICY_COLOURS[order % len(POLICY_COLOURS)],
                    "symbol": SYMBOLS[settings.index(left[line]) % len(SYMBOLS)] + marker_form,
                    "dash": MODE_DASHES.get(mode, "dot"),
                }
            )
    return pd.DataFrame(rows).set_index("line")


def frontier_figure(
    points: pd.DataFrame, x_title: str, bytes_axis: bool, metric: Metric = METRICS["accuracy"]
) -> go.Figure:
    """Quality against memory, one line per policy, parameter setting and mode (drawn and listed as
    :func:`frontier_legend` says), the Pareto front circled, each point's 95 % interval a whisker where it has one.
    Byte axes are logarithmic (budgets span orders of magnitude) with ticks at round binary values; the kept
    fraction is linear from 0 to 1. Percentages span 0 to 100; a perplexity or a KL spans what was measured, its
    title saying that lower is better.

    Lines are drawn a little apart (:data:`LOG_DODGE`, :data:`LINEAR_DODGE`) and their markers a little
    transparent, so that points of different policies at the same budget are all seen; each point's hover names
    every line at its budget with its measured values. Each trace carries its line's full name as ``meta``.

    The legend sits under the plot, so that the plot starts right under a selection's controls and is in sight when
    a page opens at 1,280 or 1,920 pixels. The figure leaves it room for one group per row, as on the narrowest
    charts (a half-width column at 1,280 pixels), up to :data:`LEGEND_MAX_PX`; a longer legend scrolls, so the plot
    keeps its height however many lines there are.
    """
    if points.empty:
        return _empty("No stored runs for this selection.")
    points = points.assign(drawn=_dodged(points, bytes_axis), hover=_same_budget(points, bytes_axis, metric))
    legend = frontier_legend(points)
    by_line = dict(tuple(points.groupby("line", sort=False)))
    traces = [
        dict(
            type="scatter",
            x=group["drawn"].to_numpy(),
            y=group["y"].to_numpy(),
            mode="lines+markers",
            name=shown.entry,
            meta=line,
            legendgroup=shown.group,
            legendgrouptitle=dict(text=f"<b>{shown.title}</b>") if shown.title else None,
            line=dict(color=shown.colour, dash=shown.dash, width=1.5),
            marker=dict(symbol=shown.symbol, size=10, opacity=MARKER_OPACITY),
            error_y=dict(
                type="data",
                symmetric=False,
                array=(group["high"] - group["y"]).fillna(0).to_numpy(),
                arrayminus=(group["y"] - group["low"]).fillna(0).to_numpy(),
                visible=bool(group["low"].notna().any()),
                thickness=1,
                width=3,
            ),
            customdata=group[["label", "hover"]].to_numpy(),
            hovertemplate="<b>%{customdata[0]}</b><br>%{customdata[1]}<extra></extra>",
        )
        for line, shown in legend.iterrows()
        for group in (by_line[line],)
    ]
    front = points[points["front"]].sort_values("drawn")
    traces.append(
        dict(
            type="scatter",
            x=front["drawn"].to_numpy(),
            y=front["y"].to_numpy(),
            mode="markers+lines",
            name="Pareto front",
            meta="Pareto front",
            line=dict(color=FRONT_COLOUR, dash="dot", shape="hv", width=1),
            marker=dict(symbol="circle-open", size=18, color=FRONT_COLOUR, line=dict(width=1.5)),
            hoverinfo="skip",
        )
    )
    # The traces as plain dictionaries with NumPy arrays, validated once by the figure: ``go.Scatter`` objects are
    # validated again when added, and pandas columns converted through narwhals, which made the whole figure take
    # 1.6 times as long for the shipped runs (a page waits for this figure before its first chart).
    figure = go.Figure(data=traces)
    x_axis = _log_byte_axis(points["drawn"]) if bytes_axis else _fraction_axis(points["drawn"])
    rows = len(legend) + int((legend["title"] != "").groupby(legend["group"]).any().sum())  # lines and titles
    legend_px = min(LEGEND_MAX_PX, LEGEND_ROW_PX * rows)
    figure.update_layout(
        height=FRONTIER_PLOT_PX + legend_px,
        margin=dict(l=60, r=20, t=20, b=AXIS_BAND_PX + legend_px),
        hovermode="closest",
        xaxis=dict(title=x_title, **x_axis),
        yaxis=dict(title=metric.title, range=[-3, 103] if metric.percent else None),
        # Under the plot and its axis title; groups side by side, each policy's lines under its name. A click
        # toggles the line clicked, not its policy's every line.
        legend=dict(
            orientation="h",
            yref="container",  # its top at the foot of the axis' band, however tall the plot is drawn
            yanchor="top",
            y=legend_px / (FRONTIER_PLOT_PX + legend_px),
            x=0,
            traceorder="grouped",
            groupclick="toggleitem",
            maxheight=LEGEND_MAX_PX,
            tracegroupgap=6,
            itemwidth=46,  # wide enough for a dashed sample to show its dashes beside the marker
            font=dict(size=11),
            grouptitlefont=dict(size=11),
        ),
    )
    return figure


def axis_frontier_figure(points: pd.DataFrame, axis: str, metric: str) -> go.Figure:
    """:func:`frontier_figure` of ``points`` on a frontier axis and a quality metric given by their keys
    (:data:`~kvlab.runs.tables.FRONTIER_AXES`, :data:`~kvlab.runs.tables.METRICS`): every axis but the kept fraction
    is in bytes, and the title of the bytes-read axis says when some points sit at the bytes they held."""
    return frontier_figure(points, axis_title(points, axis), bytes_axis=is_byte_axis(axis), metric=METRICS[metric])


def run_quality_figure(quality: pd.DataFrame, metric: str) -> go.Figure:
    """One bar per run (:func:`kvlab.runs.tables.run_quality`) on a quality metric, with its 95 % interval as a
    whisker where it has one."""
    if quality.empty:
        return _empty("None of these runs has this measure.")
    shown = METRICS[metric]
    figure = go.Figure(
        go.Bar(
            x=quality["tick"],
            y=quality["value"],
            error_y=dict(
                type="data",
                symmetric=False,
                array=(quality["high"] - quality["value"]).fillna(0),
                arrayminus=(quality["value"] - quality["low"]).fillna(0),
                visible=bool(quality["low"].notna().any()),
            ),
            text=[quality_text(value, shown) for value in quality["value"]],
            textposition="inside",
            insidetextanchor="start",
            customdata=np.stack(
                [
                    quality["label"],
                    [_interval_text(low, high) for low, high in zip(quality["low"], quality["high"])],
                    quality["trials"],
                ],
                axis=-1,
            ),
            hovertemplate="<b>%{customdata[0]}</b><br>%{text} (%{customdata[1]}n=%{customdata[2]})<extra></extra>",
            marker_color=qualitative.Plotly[0],
        )
    )
    figure.update_layout(
        height=380,
        margin=dict(l=60, r=20, t=20, b=90),
        yaxis=dict(title=shown.title, range=[0, 103] if shown.percent else None),
        xaxis=dict(type="category"),
    )
    return figure


def run_memory_figure(memory: pd.DataFrame) -> go.Figure:
    """Two bars per run (:func:`kvlab.runs.tables.run_memory`): its mean KV bytes at the end and at the peak, on a
    linear axis from zero with ticks at round binary values."""
    if memory.empty:
        return _empty("None of these runs has trials.")
    figure = go.Figure()
    for column, name, colour in (
        ("kv_bytes", "at the end", qualitative.Plotly[0]),
        ("peak_kv_bytes", "at the peak", qualitative.Plotly[1]),
    ):
        figure.add_trace(
            go.Bar(
                x=memory["tick"],
                y=memory[column],
                name=name,
                marker_color=colour,
                customdata=np.stack([memory["label"], memory[column].map(format_bytes)], axis=-1),
                hovertemplate=f"<b>%{{customdata[0]}}</b><br>{name}: %{{customdata[1]}}<extra></extra>",
            )
        )
    high = float(memory[["kv_bytes", "peak_kv_bytes"]].max().max())
    figure.update_layout(
        height=380,
        barmode="group",
        margin=dict(l=70, r=20, t=20, b=90),
        yaxis=dict(title="mean KV bytes (measured)", **byte_axis(0.0, high, log=False)),
        xaxis=dict(type="category"),
        legend=dict(orientation="h", yanchor="bottom", y=1.0, x=0),
    )
    return figure
