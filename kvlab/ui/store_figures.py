"""Figures of stored runs and of the cost model, pure functions of the tables in :mod:`kvlab.ui.tables` and of
:class:`kvlab.costs.CostEstimate`."""

from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go
from plotly.colors import qualitative
from plotly.subplots import make_subplots

from kvlab.costs import CostEstimate
from kvlab.costs.gpus import GIB
from kvlab.ui.tables import METRICS, Metric

ACCURACY_SCALE = [[0.0, "#b2182b"], [0.5, "#fddbc7"], [0.75, "#d1e5f0"], [1.0, "#2166ac"]]


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


def frontier_figure(
    points: pd.DataFrame, x_title: str, bytes_axis: bool, metric: Metric = METRICS["accuracy"]
) -> go.Figure:
    """Quality against memory, one line per policy and mode, the Pareto front circled. Byte axes are in MiB on a
    logarithmic scale (budgets span orders of magnitude); the kept fraction is linear from 0 to 1. Percentages span
    0 to 100; a perplexity or a KL spans what was measured, its title saying that lower is better."""
    figure = go.Figure()
    if points.empty:
        figure.add_annotation(
            text="No stored runs for this selection.", showarrow=False, x=0.5, y=0.5, xref="paper", yref="paper"
        )
        figure.update_layout(xaxis_visible=False, yaxis_visible=False, height=360)
        return figure
    divisor = float(1 << 20) if bytes_axis else 1.0
    y_hover = "%{y:.0f}%" if metric.percent else "%{y:.4g}"
    colours = qualitative.Plotly
    for index, (line, group) in enumerate(points.groupby("line", sort=True)):
        figure.add_trace(
            go.Scatter(
                x=group["x"] / divisor,
                y=group["y"],
                mode="lines+markers",
                name=line,
                line=dict(color=colours[index % len(colours)]),
                customdata=group[["label", "trials"]].to_numpy(),
                hovertemplate=f"%{{customdata[0]}}<br>x %{{x:.3g}}<br>{y_hover} (n=%{{customdata[1]}})<extra></extra>",
            )
        )
    front = points[points["front"]].sort_values("x")
    figure.add_trace(
        go.Scatter(
            x=front["x"] / divisor,
            y=front["y"],
            mode="markers+lines",
            name="Pareto front",
            line=dict(color="black", dash="dot", shape="hv", width=1),
            marker=dict(symbol="circle-open", size=16, color="black", line=dict(width=2)),
            hoverinfo="skip",
        )
    )
    figure.update_layout(
        height=380,
        margin=dict(t=30, b=40),
        xaxis=dict(
            title=f"{x_title} (MiB)" if bytes_axis else x_title,
            type="log" if bytes_axis else "linear",
            range=None if bytes_axis else [0, 1.05],
        ),
        yaxis=dict(title=metric.title, range=[-3, 103] if metric.percent else None),
        legend=dict(orientation="h", y=-0.25),
    )
    return figure


def _short(value: float) -> str:
    """A bar label: whole numbers with separators from 100 up, three significant digits below."""
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.3g}"


def cost_bars(full: CostEstimate, evicted: CostEstimate) -> go.Figure:
    """Full cache against the evicted one on four outputs that decide a deployment."""
    panels = (
        ("KV per sequence (GiB)", full.kv_bytes_per_sequence / GIB, evicted.kv_bytes_per_sequence / GIB),
        ("sequences that fit", full.max_sequences, evicted.max_sequences),
        ("decode tokens/s (batch)", full.tokens_per_second, evicted.tokens_per_second),
        ("$ per million tokens", full.cost_per_million_tokens, evicted.cost_per_million_tokens),
    )
    figure = make_subplots(rows=1, cols=len(panels), subplot_titles=[title for title, *_ in panels])
    names = ("full cache", f"evicted (keep {evicted.keep_fraction:.0%})")
    for index, (_, *values) in enumerate(panels, start=1):
        figure.add_trace(
            go.Bar(
                x=list(names),
                y=values,
                marker_color=["#888888", "#1f4e9c"],
                text=[_short(v) for v in values],
                textposition="auto",
                showlegend=False,
            ),
            row=1,
            col=index,
        )
    figure.update_layout(height=300, margin=dict(t=50, b=30))
    return figure
