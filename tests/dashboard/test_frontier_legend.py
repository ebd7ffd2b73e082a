"""The frontier's legend: lines listed under their policy with the parameters they share said once, each line drawn
its own way and named exactly, and a legend of many lines kept to a fixed height (it scrolls) so the plot keeps its
size."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from kvlab.claims import EVIDENCE_DB
from kvlab.dashboard.store_figures import (
    AXIS_BAND_PX,
    FRONTIER_PLOT_PX,
    LEGEND_MAX_PX,
    LEGEND_ROW_PX,
    POLICY_COLOURS,
    frontier_figure,
    frontier_legend,
)
from kvlab.runs import tables
from kvlab.store import RunFilter, open_store


def frontier(rows: list[tuple[str, dict[str, object], str]]) -> pd.DataFrame:
    """Frontier points of one budget per (policy, parameters, mode)."""
    count = len(rows)
    stored = pd.DataFrame(
        {
            "policy": [policy for policy, _, _ in rows],
            "policy_params": [json.dumps(params) for _, params, _ in rows],
            "mode": [mode for _, _, mode in rows],
            "keep": [0.5] * count,
            "budget_tokens": [None] * count,
            "accuracy": [0.5] * count,
            "mean_kv_bytes": [1e6 * (index + 1) for index in range(count)],
            "trials": [4] * count,
        }
    )
    return tables.frontier_points(stored, "kv_bytes", "accuracy")


def full_name(title: str, entry: str) -> str:
    """A line's name put back together from its legend group's title and its entry."""
    policy, _, shared = title.partition(" (")
    *left, mode = entry.split(" · ")
    params = [value for part in (shared.rstrip(")"), *left) for value in part.split(", ") if value]
    return f"{tables.policy_with(policy, sorted(params, key=lambda value: value.split('=')[0]))} · {mode}"


def test_lines_are_listed_under_their_policy_with_shared_parameters_said_once():
    shared = {"kernel": 7, "pooling": "max"}
    points = frontier(
        [
            ("full", {}, "prefill"),
            ("snapkv", shared, "prefill"),
            ("snapkv", shared, "streaming"),
            ("snapkv", {**shared, "window": 8}, "prefill"),
            ("snapkv", {**shared, "window": 16}, "prefill"),
            ("streaming", {}, "streaming"),
        ]
    )
    legend = frontier_legend(points)
    assert legend.loc["full cache", "title"] == "" and legend.loc["full cache", "entry"] == "full cache"
    snapkv = legend[legend["group"] == "snapkv"]
    assert set(snapkv["title"]) == {"snapkv (kernel=7, pooling=max)"}
    assert snapkv["entry"].tolist() == ["prefill", "streaming", "window=16 · prefill", "window=8 · prefill"]
    assert set(snapkv["colour"]) == {POLICY_COLOURS[1]}  # one colour per policy, the full cache's first
    assert snapkv["dash"].tolist() == ["solid", "dash", "solid", "solid"]  # one dash per mode
    assert snapkv["symbol"].nunique() == 3  # one marker per parameter setting
    for line, row in legend.drop(index="full cache").iterrows():
        assert full_name(row["title"], row["entry"]) == line
    figure = frontier_figure(points, "KV bytes", bytes_axis=True)
    assert [trace.meta for trace in figure.data] == [*legend.index, "Pareto front"]
    assert [trace.name for trace in figure.data[:-1]] == legend["entry"].tolist()
    assert {trace.legendgrouptitle.text for trace in figure.data[1:5]} == {"<b>snapkv (kernel=7, pooling=max)</b>"}
    assert figure.layout.height == FRONTIER_PLOT_PX + LEGEND_ROW_PX * (6 + 2)  # a row per line and per group title


def test_policies_past_the_palette_keep_lines_told_apart():
    points = frontier([(f"policy{index:02}", {}, mode) for index in range(12) for mode in ("prefill", "streaming")])
    legend = frontier_legend(points)
    assert legend[["colour", "symbol", "dash"]].drop_duplicates().shape[0] == len(legend) == 24
    assert legend.loc["policy10 · prefill", "symbol"].endswith("-open")


@pytest.mark.skipif(not EVIDENCE_DB.is_file(), reason="no shipped evidence")
def test_the_shipped_frontier_keeps_its_plot_whatever_the_number_of_lines():
    with open_store(EVIDENCE_DB, read_only=True) as store:
        runs = store.list_runs(RunFilter(tasks=("needle",)))
        model = tables.most_runs(runs, "model", task="needle")[0]
        chosen = RunFilter(models=(model,), tasks=("needle",), context_lengths=(4096,))
        points = tables.frontier_points(store.accuracy_frontier(chosen), "kv_bytes", "accuracy")
    figure = frontier_figure(points, "KV bytes", bytes_axis=True)
    lines = [trace for trace in figure.data if trace.meta != "Pareto front"]
    assert len(lines) > 30
    assert figure.layout.height == FRONTIER_PLOT_PX + LEGEND_MAX_PX  # not taller with more lines: it scrolls
    assert figure.layout.legend.maxheight == LEGEND_MAX_PX and figure.layout.legend.traceorder == "grouped"
    legend = figure.layout.legend  # under the plot (which comes first) and its axis' band, in the bottom margin
    assert legend.yref == "container" and legend.yanchor == "top"
    assert legend.y * figure.layout.height == pytest.approx(LEGEND_MAX_PX)
    assert figure.layout.margin.b == AXIS_BAND_PX + LEGEND_MAX_PX
    assert len({trace.legendgroup for trace in lines}) == points["policy"].nunique() < len(lines) / 2
    assert len({(trace.line.color, trace.marker.symbol, trace.line.dash) for trace in lines}) == len(lines)
    longest = max(len(str(trace.meta)) for trace in lines)
    assert max(len(str(trace.name)) for trace in lines) < longest * 2 / 3  # shared parameters said once
