"""The cost calculator's figure and tables: pure functions of :class:`kvlab.costs.CostEstimate`, of
``kvlab.costs.cost_table`` and of the stored runs' budgets."""

from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from kvlab.costs import CostEstimate
from kvlab.costs.gpus import GIB
from kvlab.ui.tables import present, run_label, short_model_name


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


def stored_keep_fractions(runs: pd.DataFrame) -> dict[str, float]:
    """Kept fractions that stored runs used, by a label naming one run each: the run's ``keep``, or its token
    budget over its context length. The full cache and runs whose fraction is unknown are left out."""
    options: dict[str, float] = {}
    for run in runs.itertuples(index=False):
        if present(run.keep):
            fraction = float(run.keep)
        elif present(run.budget_tokens) and present(run.context_length) and run.context_length:
            fraction = min(1.0, int(run.budget_tokens) / int(run.context_length))
        else:
            continue
        label = f"run {run.run_id}: {run_label(run.policy, run.mode, run.keep, run.budget_tokens, run.policy_params)}"
        options[f"{label}, {short_model_name(run.model)}, {run.task} ({fraction:.1%})"] = fraction
    return options


def formatted_costs(table: pd.DataFrame) -> pd.DataFrame:
    """``kvlab.costs.cost_table`` with every number written out for reading: thousands separated, three significant
    digits for fractional values, dollars to four significant digits."""

    def cell(value: object, unit: str) -> str:
        if isinstance(value, str):
            return value
        number = float(value)  # type: ignore[arg-type]
        if unit == "$":
            return f"${number:,.4g}" if number < 1000 else f"${number:,.0f}"
        if number == int(number) and abs(number) >= 1:
            return f"{int(number):,}"
        return f"{number:,.3f}" if abs(number) >= 1 else f"{number:.3g}"

    shown = table.copy()
    for column in shown.columns[2:]:
        shown[column] = [cell(value, unit) for value, unit in zip(shown[column], shown["Unit"])]
    return shown
