"""Figures of stored runs and of the cost model, pure functions of the tables in :mod:`kvlab.ui.tables` and of
:class:`kvlab.costs.CostEstimate`."""

from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go
from plotly.colors import qualitative

from kvlab.ui.tables import METRICS, Metric


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
