"""A model's attention profile and the layer budgets each allocation gives at one total, as one pure figure with its
"how to read this" (:data:`ALLOCATION_GUIDE`); laid out like the live page's small charts."""

from __future__ import annotations

import plotly.graph_objects as go

from kvlab.cache.allocation import (
    CAKE_TAU1,
    CAKE_TAU2,
    cake_budgets,
    entropy_budgets,
    layer_preference,
    preset_budgets,
    uniform_budgets,
)
from kvlab.dashboard.guides import ChartGuide
from kvlab.models.profiles import Profile

ENTROPY_COLOUR = "#c9d3e3"
ALLOCATION_COLOURS: dict[str, str] = {
    "uniform": "#7f7f7f",
    "preset": "#f58518",
    "entropy": "#1f4e9c",
    "cake": "#54a24b",
}
NO_PROFILE = "No attention profile for this model yet: measure one with kvlab profile."


def profile_budgets(
    profile: Profile,
    budget: int,
    minimum: int = 1,
    capacity: int | None = None,
    tau1: float = CAKE_TAU1,
    tau2: float = CAKE_TAU2,
) -> dict[str, list[int]]:
    """Each allocation's budgets for the profiled model at ``budget`` tokens per layer; CAKE's from the preferences
    of the profile's text (a prompt of its own would give others)."""
    layers = profile.num_layers
    preferences = [layer_preference(h, v, tau1, tau2) for h, v in zip(profile.cake_dispersion, profile.cake_shift)]
    return {
        "uniform": uniform_budgets(budget, layers, minimum, capacity),
        "preset": preset_budgets(budget, layers, minimum, capacity),
        "entropy": entropy_budgets(profile.entropy, budget, layers, minimum, capacity),
        "cake": cake_budgets(preferences, budget, minimum, capacity),
    }


ALLOCATION_GUIDE = ChartGuide(
    axes=(
        "Layers (x). Bars: each layer's mean attention entropy in nats (left axis), measured once with the full "
        "cache on a held-out text; an even spread over n keys is ln n nats. Lines: the tokens per KV head each "
        "layer keeps under each layer allocation at the same total (right axis): uniform (flat), the articles' "
        "preset (40% to the first layers, 10% to the last), entropy (following the bars) and CAKE (from the "
        "text's last window; a run recomputes it for every prompt)."
    ),
    good=(
        "The entropy line rises and falls with the bars, and every line holds the same total (the uniform line "
        "times the layers): layers whose attention rests on a few tokens give tokens to layers that spread it."
    ),
    bad=(
        "A layer with a bar near zero (its attention piled on one token, often a sink) still gets a large share "
        "under the preset, where its tokens buy nothing. Lines pinned flat at the top are layers capped at the "
        "context length: when most are, the budget is too close to the context for the allocations to differ."
    ),
)


def allocation_figure(
    profile: Profile | None,
    budget: int,
    minimum: int = 1,
    capacity: int | None = None,
    tau1: float = CAKE_TAU1,
    tau2: float = CAKE_TAU2,
    chosen: str | None = None,
) -> go.Figure:
    """Bars of the profile's entropy per layer and lines of each allocation's budgets at ``budget`` tokens; with
    ``chosen``, that allocation's line drawn bold and the others faded, so a run's budgets stand out against the
    rest at the same total."""
    title = f"Layer budgets<br>{budget:,} tokens per layer"
    figure = go.Figure()
    frame = dict(
        title=title,
        height=340,
        margin=dict(t=64, b=40),
        legend=dict(orientation="h", yref="container", yanchor="bottom", y=0, x=0),
    )
    if profile is None:
        figure.add_annotation(text=NO_PROFILE, showarrow=False, x=0.5, y=0.5, xref="paper", yref="paper")
        figure.update_layout(**frame, xaxis_visible=False, yaxis_visible=False)
        return figure
    layers = list(range(profile.num_layers))
    figure.add_trace(
        go.Bar(
            x=layers,
            y=list(profile.entropy),
            name="entropy",
            marker_color=ENTROPY_COLOUR,
            hovertemplate="layer %{x}<br>entropy %{y:.2f} nats<extra></extra>",
        )
    )
    for name, budgets in profile_budgets(profile, budget, minimum, capacity, tau1, tau2).items():
        figure.add_trace(
            go.Scatter(
                x=layers,
                y=budgets,
                name=name,
                yaxis="y2",
                mode="lines+markers",
                line=dict(color=ALLOCATION_COLOURS[name], width=3.5 if name == chosen else 2),
                opacity=0.3 if chosen is not None and name != chosen else 1.0,
                hovertemplate=f"layer %{{x}}<br>{name}: %{{y:,}} tokens<extra></extra>",
            )
        )
    figure.update_layout(
        **frame,
        xaxis=dict(title="layer", dtick=1 if profile.num_layers <= 12 else None),
        yaxis=dict(title="entropy (nats)", rangemode="tozero"),
        yaxis2=dict(title="tokens per KV head", overlaying="y", side="right", rangemode="tozero", showgrid=False),
    )
    return figure
