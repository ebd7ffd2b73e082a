"""Stored runs shaped into the tables the pages show: pure functions of the store's DataFrames.

Labels name a run by what distinguishes it on a chart (policy, mode, budget); accuracies are shown in percent
with the number of trials behind them, so a 100 % from one trial is not mistaken for a measurement.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from kvlab.policies import POLICIES, is_full_cache

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
    """``Store.list_runs`` for display: newest first, budgets as words, accuracies in percent, a text's perplexity
    and KL from the full cache (blank where a run has none)."""
    table = runs.copy()
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


def compare_runs(runs: pd.DataFrame, trials: pd.DataFrame) -> pd.DataFrame:
    """Selected runs side by side, one column per run: configuration, provenance, and the means of their trials
    (bytes measured from the cache tensors, seconds of the model)."""
    means = (
        trials.groupby("run_id").agg(
            kept_tokens=("kept_tokens", "mean"),
            kv_bytes=("kv_bytes", "mean"),
            peak_kv_bytes=("peak_kv_bytes", "mean"),
            peak_kv_reserved_bytes=("peak_kv_reserved_bytes", "mean"),
            prefill_s=("prefill_s", "mean"),
            decode_s=("decode_s", "mean"),
        )
        if not trials.empty
        else pd.DataFrame()
    )
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
            "mean KV bytes at end (measured)": _number(None if mean is None else mean["kv_bytes"], 0),
            "mean peak KV bytes (measured)": _number(None if mean is None else mean["peak_kv_bytes"], 0),
            "mean peak KV bytes reserved (measured)": _number(
                None if mean is None else mean["peak_kv_reserved_bytes"], 0
            ),
            "mean prefill s": _number(None if mean is None else mean["prefill_s"], 3),
            "mean decode s": _number(None if mean is None else mean["decode_s"], 3),
            "device · dtype": f"{run.device} · {run.dtype}",
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
