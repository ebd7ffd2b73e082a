"""The Advisor page's chart: every stored configuration's accuracy relative to the full cache against its computed
cost per query, with the floor drawn; a pure function of :class:`kvlab.runs.advisor.Advice`."""

from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go

from kvlab.dashboard.guides import ChartGuide
from kvlab.runs.advisor import Advice

MEETS_COLOUR = "#1f4e9c"
BELOW_COLOUR = "#999999"

ADVICE_GUIDE = ChartGuide(
    axes=(
        "One point per stored configuration of the evidence model: across, the cost per query the cost model computes "
        "for the chosen model and GPUs (computed for every point, so that all are priced alike, even where the table "
        "shows a measured time); up, its accuracy as a share of the full cache's on the same items, measured on the "
        "evidence model, with its 95% interval. The dashed line is the floor; blue points meet it, grey ones do not."
    ),
    good=(
        "Blue points far to the left: configurations that keep the floor while holding a small cache, so they cost "
        "less per query than the full cache (the blue point at 100%, furthest right). Short bars: enough items to "
        "tell the configuration from the floor."
    ),
    bad=(
        "Every point left of the full cache below the dashed line: nothing stored saves memory at this floor. Bars "
        "that cross the line: the point meets the floor but the items cannot tell; a sweep with more items would."
    ),
)


def _points(table: pd.DataFrame, meets: bool) -> go.Scatter:
    label = table["parameters"] + " · " + table["budget"] + " · " + table["precision"]
    return go.Scatter(
        x=table["cost per query, computed ($)"],
        y=100 * table["relative accuracy"],
        error_y=dict(
            type="data",
            symmetric=False,
            array=100 * (table["relative 95% CI high"] - table["relative accuracy"]),
            arrayminus=100 * (table["relative accuracy"] - table["relative 95% CI low"]),
            thickness=1,
            width=0,
        ),
        mode="markers",
        marker=dict(color=MEETS_COLOUR if meets else BELOW_COLOUR, size=8, opacity=0.8),
        name="meets the floor" if meets else "below the floor",
        customdata=label,
        hovertemplate="%{customdata}<br>%{y:.0f}% of the full cache<br>$%{x:.4g} per query (computed)<extra></extra>",
    )


def advice_figure(advice: Advice) -> go.Figure:
    """Relative accuracy (percent, with its interval) against the computed cost per query of every configuration
    that fits, the floor a dashed line."""
    request, evidence = advice.request, advice.evidence
    below = advice.below[advice.below["fits"].astype(bool)] if not advice.below.empty else advice.below
    figure = go.Figure([_points(below, meets=False), _points(advice.ranked, meets=True)])
    figure.add_hline(
        y=100 * request.floor,
        line_dash="dash",
        line_color="#c0392b",
        annotation_text=f"floor {request.floor:.0%}",
        annotation_position="bottom right",
    )
    where = "" if evidence is None else f" · accuracy measured on {evidence.model} at {evidence.context:,} tokens"
    figure.update_layout(
        title=f"Accuracy against cost per query<br><sup>{request.model} on {request.gpu_count} × {request.gpu}"
        f"{where}</sup>",
        xaxis_title="cost per query, $ (computed)",
        yaxis_title=f"% of the full cache's {request.benchmark} score",
        height=420,
        margin=dict(t=80, b=50, l=70, r=20),
        legend=dict(orientation="h", yanchor="bottom", y=1.0, x=1, xanchor="right"),
    )
    return figure
