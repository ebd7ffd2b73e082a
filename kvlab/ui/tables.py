"""Stored runs shaped into the tables the pages show: pure functions of the store's DataFrames.

Labels name a run by what distinguishes it on a chart (policy, mode, budget); accuracies are shown in percent
with the number of trials behind them, so a 100 % from one trial is not mistaken for a measurement.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from kvlab.claims.stats import wilson_interval
from kvlab.policies import POLICIES, is_full_cache
from kvlab.ui.units import format_bytes

FRONTIER_AXES: dict[str, str] = {
    "keep": "kept fraction of the context",
    "kv_bytes": "KV bytes held at the end (measured)",
    "peak_kv_bytes": "peak KV bytes (measured)",
}


@dataclass(frozen=True)
class Metric:
    """A quality axis of the frontier: its title, whether higher values are better, and whether it is a share
    shown in percent."""

    title: str
    higher_is_better: bool = True
    percent: bool = False

    @property
    def scale(self) -> float:
        """The factor a stored value is shown with."""
        return 100.0 if self.percent else 1.0


#: The frontier's quality axes, by the column of ``Store.accuracy_frontier`` they read.
METRICS: dict[str, Metric] = {
    "accuracy": Metric("answer contained in the output (%)", percent=True),
    "exact_accuracy": Metric("exact match (%)", percent=True),
    "perplexity": Metric("perplexity of a held-out text (lower is better)", higher_is_better=False),
    "kl": Metric("KL from the full cache, nats per token (lower is better)", higher_is_better=False),
}


def present(value: object) -> bool:
    return value is not None and not (isinstance(value, float) and np.isnan(value)) and value is not pd.NA


#: The run columns a run's label is made of, in :func:`run_label`'s order.
LABELLED_COLUMNS = ["policy", "mode", "keep", "budget_tokens", "policy_params"]


def budget_label(keep: object, budget_tokens: object) -> str:
    """``keep 10%``, ``256 tokens``, or ``full cache`` for a run with neither."""
    if present(keep):
        return f"keep {100 * float(keep):.4g}%"  # type: ignore[arg-type]
    if present(budget_tokens):
        return f"{int(budget_tokens)} tokens"  # type: ignore[call-overload]
    return "full cache"


def policy_name(policy: str, params: object = None) -> str:
    """A policy with the parameters a run set away from the policy's defaults: ``streaming (sinks=0)``. Runs of
    one policy with other parameters are other lines of a chart, never pooled into one."""
    cls = POLICIES.get(policy)
    if cls is None or not present(params):
        return policy
    values = json.loads(params) if isinstance(params, str) else dict(params)  # type: ignore[call-overload]
    defaults = cls().params()
    changed = ", ".join(f"{key}={value}" for key, value in sorted(values.items()) if defaults.get(key) != value)
    return f"{policy} ({changed})" if changed else policy


def run_label(policy: str, mode: str, keep: object = None, budget_tokens: object = None, params: object = None) -> str:
    """How a run is named on charts: ``h2o · prefill · keep 10%``, with the parameters it changed
    (:func:`policy_name`); the full cache has no mode or budget to show."""
    if is_full_cache(policy):
        return "full cache"
    return f"{policy_name(policy, params)} · {mode} · {budget_label(keep, budget_tokens)}"


def short_model_name(path_or_id: str) -> str:
    """A hub id as it is, a local directory by its last component."""
    return Path(path_or_id).name if path_or_id.startswith(("/", ".", "~")) else path_or_id


def _matching(runs: pd.DataFrame, equal: dict[str, object]) -> pd.DataFrame:
    for name, value in equal.items():
        runs = runs[runs[name] == value]
    return runs


def choices(runs: pd.DataFrame, column: str, **equal: object) -> list:
    """The distinct non-missing values of ``column`` among the runs whose other columns equal ``equal``, sorted."""
    return sorted(_matching(runs, equal)[column].dropna().unique().tolist())


def most_runs(runs: pd.DataFrame, column: str, **equal: object) -> list:
    """The same values as :func:`choices`, those with the most runs first (ties: larger values first), so that a
    page can open on the best-measured selection."""
    counts = _matching(runs, equal)[column].dropna().value_counts()
    return sorted(
        counts.index.tolist(), key=lambda value: (-counts[value], -value if isinstance(value, (int, float)) else 0)
    )


def pareto_front(cost: np.ndarray, value: np.ndarray, higher_is_better: bool = True) -> np.ndarray:
    """Which points no other point beats: none has lower or equal cost with a value as good or better (higher, or
    lower where lower is better), and one of them strictly."""
    cost = np.asarray(cost, dtype=float)
    good = np.asarray(value, dtype=float) * (1.0 if higher_is_better else -1.0)
    front = np.ones(len(cost), dtype=bool)
    for i in range(len(cost)):
        dominated = (cost <= cost[i]) & (good >= good[i]) & ((cost < cost[i]) | (good > good[i]))
        front[i] = not dominated.any()
    return front


def frontier_points(frontier: pd.DataFrame, axis: str = "keep", metric: str = "accuracy") -> pd.DataFrame:
    """Points of a quality-against-memory chart from ``Store.accuracy_frontier``: one row per (policy, mode, budget)
    with ``x`` on the chosen axis (a key of :data:`FRONTIER_AXES`), ``y`` the chosen quality (a key of
    :data:`METRICS`, accuracies in percent), ``trials``, the ``line`` it belongs to (policy and mode) and whether it
    is on the Pareto ``front`` (in the metric's own direction: lower perplexity and KL are better).

    On the kept-fraction axis the full cache sits at 1 and runs with a token budget are left out (their fraction
    differs per context length); on the byte axes every run has a measured value.
    """
    columns = ["line", "label", "policy", "mode", "x", "y", "trials", "front"]
    if frontier.empty:
        return pd.DataFrame(columns=columns)
    points = frontier.copy()
    if axis == "keep":
        points["x"] = points["keep"].astype(float).mask(points["policy"].map(is_full_cache), 1.0)
    else:
        points["x"] = points[f"mean_{axis}"].astype(float)
    points = points.dropna(subset=["x", metric])
    points["line"] = [
        ("full cache" if is_full_cache(p) else f"{policy_name(p, params)} · {m}")
        for p, m, params in zip(points["policy"], points["mode"], points["policy_params"])
    ]
    points["label"] = [run_label(*row) for row in points[LABELLED_COLUMNS].itertuples(index=False)]
    shown = METRICS[metric]
    points["y"] = shown.scale * points[metric].astype(float)
    points["front"] = pareto_front(points["x"].to_numpy(), points["y"].to_numpy(), shown.higher_is_better)
    return points.sort_values(["line", "x"])[columns].reset_index(drop=True)


def is_byte_axis(axis: str) -> bool:
    """Whether a frontier axis (a key of :data:`FRONTIER_AXES`) is in bytes: all are but the kept fraction."""
    return axis != "keep"


def memory_text(x: float, in_bytes: bool) -> str:
    """A point's memory as people read it: ``7.81 KiB`` on a byte axis, ``keep 10%`` on the kept fraction."""
    return format_bytes(x) if in_bytes else f"keep {100 * x:.4g}%"


def quality_text(y: float, metric: Metric) -> str:
    """A quality as charts and tables show it (``y`` already scaled): ``50 %`` for a share, four significant
    digits otherwise."""
    return f"{y:.0f} %" if metric.percent else f"{y:.4g}"


def frontier_table(points: pd.DataFrame, axis: str, metric: str) -> pd.DataFrame:
    """The points of a frontier as the table under its chart reads them: the run, its memory in binary units (or
    its kept fraction), its quality, and the trials behind it, all as text."""
    return pd.DataFrame(
        {
            "run": points["label"],
            FRONTIER_AXES[axis]: [memory_text(float(x), is_byte_axis(axis)) for x in points["x"]],
            METRICS[metric].title: [quality_text(float(y), METRICS[metric]) for y in points["y"]],
            "trials": points["trials"].astype(int),
        }
    )


RUN_COLUMNS: dict[str, str] = {
    "run_id": "run",
    "status": "status",
    "model": "model",
    "task": "task",
    "policy": "policy",
    "mode": "mode",
    "budget": "budget",
    "context_length": "context",
    "chunk": "chunk",
    "trials": "trials",
    "accuracy": "accuracy %",
    "exact_accuracy": "exact %",
    "perplexity": "perplexity",
    "kl": "KL (nats)",
    "device": "device",
    "dtype": "dtype",
    "started_at": "started (UTC)",
    "started_by": "started by",
}


def runs_table(runs: pd.DataFrame) -> pd.DataFrame:
    """``Store.list_runs`` for display: newest first, policies with the parameters they changed, budgets as words,
    accuracies in percent, a text's perplexity and KL from the full cache (blank where a run has none)."""
    table = runs.copy()
    table["policy"] = [policy_name(policy, params) for policy, params in zip(table["policy"], table["policy_params"])]
    table["budget"] = [budget_label(k, b) for k, b in zip(table["keep"], table["budget_tokens"])]
    table["model"] = table["model"].map(short_model_name)
    for column in ("accuracy", "exact_accuracy"):
        table[column] = (100 * table[column].astype(float)).round(1)
    table["perplexity"] = table["perplexity"].astype(float).round(3)
    table["kl"] = table["kl"].astype(float).round(4)
    return table[list(RUN_COLUMNS)].rename(columns=RUN_COLUMNS).iloc[::-1].reset_index(drop=True)


def layout_label(layout: object, compact_at: object) -> str:
    """A run's KV heap layout: ``bitmask``, ``compact``, ``threshold at 50%`` (runs stored before layouts: a dash)."""
    if not present(layout):
        return "—"
    if layout == "threshold" and present(compact_at):
        return f"threshold at {100 * float(compact_at):.4g}%"  # type: ignore[arg-type]
    return str(layout)


#: The trial columns averaged per run for a comparison.
MEAN_COLUMNS = ["kept_tokens", "kv_bytes", "peak_kv_bytes", "peak_kv_reserved_bytes", "prefill_s", "decode_s"]


def trial_means(trials: pd.DataFrame) -> pd.DataFrame:
    """The mean of each of :data:`MEAN_COLUMNS` over each run's trials, indexed by run id."""
    if trials.empty:
        return pd.DataFrame(columns=MEAN_COLUMNS)
    return trials.groupby("run_id")[MEAN_COLUMNS].mean()


def compare_runs(runs: pd.DataFrame, trials: pd.DataFrame) -> pd.DataFrame:
    """Selected runs side by side, one column per run: configuration, provenance, and the means of their trials
    (bytes measured from the cache tensors, in binary units; seconds of the model)."""
    means = trial_means(trials)
    columns = {}
    for run in runs.itertuples(index=False):
        mean = means.loc[run.run_id] if run.run_id in means.index else None
        columns[f"run {run.run_id}"] = {
            "model": short_model_name(run.model),
            "task": run.task,
            "policy": run.policy,
            "parameters": ", ".join(f"{k}={v}" for k, v in json.loads(run.policy_params or "{}").items()) or "—",
            "mode": run.mode,
            "budget": budget_label(run.keep, run.budget_tokens),
            "chunk": _text(run.chunk),
            "heap layout": layout_label(run.layout, run.compact_at),
            "question read before compression": _text(run.query_aware),
            "tokens generated at most": _text(run.max_new_tokens),
            "stop rule": _text(run.stop_rule),
            "context length": _text(run.context_length),
            "trials": str(int(run.trials)),
            "accuracy %": _number(100 * run.accuracy),
            "exact match %": _number(100 * run.exact_accuracy),
            "perplexity of the text": _number(run.perplexity, 3),
            "KL from the full cache (nats per token)": _number(run.kl, 4),
            "mean tokens kept per layer": _number(None if mean is None else mean["kept_tokens"]),
            "mean KV bytes at end (measured)": _bytes(None if mean is None else mean["kv_bytes"]),
            "mean peak KV bytes (measured)": _bytes(None if mean is None else mean["peak_kv_bytes"]),
            "mean peak KV bytes reserved (measured)": _bytes(None if mean is None else mean["peak_kv_reserved_bytes"]),
            "mean prefill s": _number(None if mean is None else mean["prefill_s"], 3),
            "mean decode s": _number(None if mean is None else mean["decode_s"], 3),
            "device · dtype": f"{_text(run.device)} · {_text(run.dtype)}",
            "kvlab": _text(run.kvlab_version),
            "commit": _text(run.git_commit),
            "status": run.status,
            "started (UTC)": str(run.started_at)[:19],
        }
    return pd.DataFrame(columns)


def _text(value: object) -> str:
    return str(value) if present(value) else "—"


def _number(value: object, digits: int = 1) -> str:
    if not present(value):
        return "—"
    return f"{float(value):,.{digits}f}"  # type: ignore[arg-type]


def _bytes(value: object) -> str:
    return format_bytes(float(value)) if present(value) else "—"  # type: ignore[arg-type]


def measured_metrics(runs: pd.DataFrame) -> list[str]:
    """The keys of :data:`METRICS` that at least one of ``runs`` (``Store.list_runs`` rows) has a value for, in
    :data:`METRICS`' order: needle runs have accuracies, passes over a text a perplexity and a KL."""
    return [name for name in METRICS if runs[name].notna().any()]


def run_tick(run: Any) -> str:
    """A run (a row of ``Store.list_runs``) as a bar chart's category names it, on three short lines:
    ``run 4<br>h2o<br>keep 10%``."""
    policy = policy_name(run.policy, run.policy_params)
    return f"run {run.run_id}<br>{policy}<br>{budget_label(run.keep, run.budget_tokens)}"


def _run_name(run: Any) -> str:
    """A run's :func:`run_label` from its row of ``Store.list_runs``."""
    return run_label(run.policy, run.mode, run.keep, run.budget_tokens, run.policy_params)


#: The trial column whose share each percent metric is.
_ANSWER_COLUMNS = {"accuracy": "correct", "exact_accuracy": "exact"}


def run_quality(runs: pd.DataFrame, trials: pd.DataFrame, metric: str) -> pd.DataFrame:
    """One row per run (``Store.list_runs`` rows) with its ``value`` on a quality metric (a key of :data:`METRICS`,
    shares in percent), and for shares the Wilson 95% interval ``low``..``high`` from its answered trials, so that
    a bar from two trials is not read like one from two hundred. Runs without the metric are left out."""
    shown = METRICS[metric]
    rows = []
    for run in runs.itertuples(index=False):
        value = getattr(run, metric)
        if not present(value):
            continue
        low, high = _interval(trials[trials["run_id"] == run.run_id], metric)
        rows.append(
            {
                "run_id": run.run_id,
                "tick": run_tick(run),
                "label": _run_name(run),
                "value": shown.scale * float(value),
                "low": low,
                "high": high,
                "trials": int(run.trials),
            }
        )
    return pd.DataFrame(rows, columns=["run_id", "tick", "label", "value", "low", "high", "trials"])


def _interval(trials: pd.DataFrame, metric: str) -> tuple[float, float]:
    """The Wilson 95% interval (in %) of a share metric over the trials that answered; NaN for other metrics or
    when none answered."""
    if metric not in _ANSWER_COLUMNS:
        return float("nan"), float("nan")
    answered = trials[_ANSWER_COLUMNS[metric]].dropna()
    if answered.empty:
        return float("nan"), float("nan")
    low, high = wilson_interval(int(answered.astype(bool).sum()), len(answered))
    return 100 * low, 100 * high


def run_memory(runs: pd.DataFrame, trials: pd.DataFrame) -> pd.DataFrame:
    """One row per run with trials: its mean KV bytes at the end and at the peak (measured from the cache tensors),
    with the run's bar-chart category and label."""
    means = trial_means(trials)
    rows = [
        {
            "run_id": run.run_id,
            "tick": run_tick(run),
            "label": _run_name(run),
            "kv_bytes": float(means.loc[run.run_id, "kv_bytes"]),
            "peak_kv_bytes": float(means.loc[run.run_id, "peak_kv_bytes"]),
        }
        for run in runs.itertuples(index=False)
        if run.run_id in means.index
    ]
    return pd.DataFrame(rows, columns=["run_id", "tick", "label", "kv_bytes", "peak_kv_bytes"])


def claim_table_text(table: pd.DataFrame) -> pd.DataFrame:
    """The needle claim's table (:func:`kvlab.claims.side_by_side`) as text for display: accuracies in whole
    percent, trial counts whole, and ``—`` where a row has nothing at that ratio (never ``None`` or ``nan``)."""
    shown = table.astype(object)
    for column in table.columns:
        if column.endswith("pruned"):
            shown[column] = [f"{float(value):.0f} %" if present(value) else "—" for value in table[column]]
        elif not column.endswith("interval"):
            shown[column] = [f"{int(value)}" if present(value) else "—" for value in table[column]]
    return shown
