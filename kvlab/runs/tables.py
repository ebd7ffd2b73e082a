"""Stored runs shaped into the tables the pages show: pure functions of the store's DataFrames.

Labels name a run by what distinguishes it on a chart (policy, mode, budget); accuracies are shown in percent
with the number of trials behind them and their 95 % interval, so a 100 % from one trial is not mistaken for a
measurement; two runs that answered the same items are compared by McNemar's paired test.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

import numpy as np
import pandas as pd

from kvlab.attention.backends import SDPA
from kvlab.claims.needle import interval_text
from kvlab.policies import POLICIES, is_full_cache
from kvlab.stats import MIN_PAIRED_ITEMS, mcnemar, mean_interval, pair_by_item, paired_difference_interval
from kvlab.units import format_bytes

FRONTIER_AXES: dict[str, str] = {
    "keep": "kept fraction of the context",
    "kv_bytes": "KV bytes held at the end (measured)",
    "peak_kv_bytes": "peak KV bytes (measured)",
    "read_bytes": "KV bytes read per decoded token (measured)",
}
#: The axis title's addition when some points of the read-bytes axis fall back to the bytes they held.
HELD_FALLBACK = " · held bytes where a run recorded no reads"


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
    "recall": Metric("recall of the expected strings (%)", percent=True),
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


@functools.cache
def default_params(policy: str) -> Mapping[str, object]:
    """A registered policy's default parameters, made once: a chart names hundreds of runs, and making a policy
    checks every parameter."""
    return MappingProxyType(POLICIES[policy]().params())


def changed_params(policy: str, params: object = None) -> tuple[str, ...]:
    """The parameters a run set away from its policy's defaults, as ``key=value`` in the keys' order (none for a
    run without parameters, or of a policy no longer registered)."""
    cls = POLICIES.get(policy)
    if cls is None or not present(params):
        return ()
    values = json.loads(params) if isinstance(params, str) else dict(params)  # type: ignore[call-overload]
    defaults = default_params(policy)
    return tuple(f"{key}={value}" for key, value in sorted(values.items()) if defaults.get(key) != value)


def policy_name(policy: str, params: object = None) -> str:
    """A policy with the parameters a run set away from the policy's defaults (:func:`changed_params`):
    ``streaming (sinks=0)``. Runs of one policy with other parameters are other lines of a chart, never pooled into
    one."""
    return policy_with(policy, changed_params(policy, params))


def policy_with(policy: str, changed: Sequence[str]) -> str:
    """A policy named with parameters it changed (``key=value``): ``streaming (sinks=0)``, or the policy alone."""
    return f"{policy} ({', '.join(changed)})" if changed else policy


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


#: The columns ``Store.accuracy_frontier`` groups trials by: one frontier point per distinct value of them.
FRONTIER_KEYS = ["model", "task", "policy", "policy_params", "mode", "keep", "budget_tokens"]
#: The trial column each share metric is the mean of (``recall``: RULER's recall of the expected strings).
SHARE_COLUMNS = {"accuracy": "correct", "exact_accuracy": "exact", "recall": "recall"}


def frontier_points(
    frontier: pd.DataFrame, axis: str = "keep", metric: str = "accuracy", trials: pd.DataFrame | None = None
) -> pd.DataFrame:
    """Points of a quality-against-memory chart from ``Store.accuracy_frontier``: one row per (policy, mode, budget)
    with ``x`` on the chosen axis (a key of :data:`FRONTIER_AXES`), ``y`` the chosen quality (a key of
    :data:`METRICS`, accuracies in percent), ``trials``, the ``line`` it belongs to (policy and mode) and whether it
    is on the Pareto ``front`` (in the metric's own direction: lower perplexity and KL are better). With the
    ``trials`` behind them (``Store.trials_frame`` of the same runs), a share's 95 % interval ``low``..``high``
    (:func:`share_interval`, in percent; NaN otherwise). The keys of the point (:data:`FRONTIER_KEYS`) come along,
    so that its trials can be found again (:func:`point_trials`).

    On the kept-fraction axis the full cache sits at 1 and runs with a token budget are left out (their fraction
    differs per context length); on the byte axes every run has a measured value. On the read-bytes axis a point
    whose runs recorded no reads (runs stored before reads were measured) sits at the bytes it held at the end,
    marked ``held_fallback``.
    """
    columns = ["line", "label", "policy", "mode", "x", "y", "low", "high", "trials", "front", "held_fallback"]
    columns += [key for key in FRONTIER_KEYS if key not in columns and (key in frontier or frontier.empty)]
    if frontier.empty or metric not in frontier:
        return pd.DataFrame(columns=columns)
    points = frontier.copy()
    points["held_fallback"] = False
    if axis == "keep":
        points["x"] = points["keep"].astype(float).mask(points["policy"].map(is_full_cache), 1.0)
    elif axis == "read_bytes":
        read = trial_values(points, "mean_read_bytes")
        points["held_fallback"] = read.isna()
        points["x"] = read.fillna(points["mean_kv_bytes"].astype(float))
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
    points["low"], points["high"] = _point_intervals(points, trials, metric)
    points["front"] = pareto_front(points["x"].to_numpy(), points["y"].to_numpy(), shown.higher_is_better)
    return points.sort_values(["line", "x"])[columns].reset_index(drop=True)


def _key(values: tuple) -> tuple:
    """A row's key values with every missing value as ``None``, so that keys of NaN, ``None`` and ``pd.NA`` match."""
    return tuple(value if present(value) else None for value in values)


def point_trials(trials: pd.DataFrame, point: Any) -> pd.DataFrame:
    """The trials (``Store.trials_frame`` rows) behind one frontier point (a row of :func:`frontier_points`)."""
    if trials.empty:
        return trials
    wanted = _key(tuple(getattr(point, key) for key in FRONTIER_KEYS))
    chosen = np.ones(len(trials), dtype=bool)
    for key, value in zip(FRONTIER_KEYS, wanted, strict=True):
        column = trials[key]
        chosen &= (column.isna() if value is None else column.eq(value).fillna(False)).to_numpy(dtype=bool)
    return trials[chosen]


def _point_intervals(points: pd.DataFrame, trials: pd.DataFrame | None, metric: str) -> tuple[list, list]:
    """Each point's 95 % interval in percent from its trials; NaN without trials or for a metric that is no share."""
    nothing = [np.nan] * len(points)
    if trials is None or trials.empty or metric not in SHARE_COLUMNS:
        return nothing, nothing
    bounds = {
        _key(key): share_interval(trial_values(group, SHARE_COLUMNS[metric]))
        for key, group in trials.groupby(FRONTIER_KEYS, dropna=False)
    }
    found = [bounds.get(_key(row), (np.nan, np.nan)) for row in points[FRONTIER_KEYS].itertuples(index=False)]
    return [100 * low for low, _ in found], [100 * high for _, high in found]


def trial_values(trials: pd.DataFrame, column: str) -> pd.Series:
    """A column as floats (1 and 0 for a right and a wrong answer), NaN where a row has no value or the frame no
    such column (stores from before RULER's recall, the tie share and the bytes read were recorded)."""
    if column not in trials:
        return pd.Series(np.nan, index=trials.index, dtype=float)
    return trials[column].astype(float)


def share_interval(values: pd.Series) -> tuple[float, float]:
    """The 95 % interval (fractions) of a share's mean over the values present: Wilson's where every value is right
    or wrong, the seeded percentile bootstrap for fractions such as RULER's recall
    (:func:`~kvlab.stats.mean_interval`); NaN where there is none."""
    answered = values.dropna()
    if answered.empty:
        return np.nan, np.nan
    return mean_interval(answered.to_numpy())


def percent_interval(low: float, high: float) -> str:
    """An interval of fractions as whole percent rounded outwards (``24–76``), ``—`` where there is none."""
    return "—" if not (present(low) and present(high)) else interval_text(100 * low, 100 * high)


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
    its kept fraction; on the read-bytes axis ``(held)`` where the run recorded no reads), its quality with its
    95 % interval, and the trials behind it, all as text."""
    return pd.DataFrame(
        {
            "run": points["label"],
            FRONTIER_AXES[axis]: [
                memory_text(float(x), is_byte_axis(axis)) + (" (held)" if held else "")
                for x, held in zip(points["x"], points["held_fallback"])
            ],
            METRICS[metric].title: [quality_text(float(y), METRICS[metric]) for y in points["y"]],
            "95% CI": [percent_interval(low / 100, high / 100) for low, high in zip(points["low"], points["high"])],
            "trials": points["trials"].astype(int),
        }
    )


def axis_title(points: pd.DataFrame, axis: str) -> str:
    """A frontier axis's title (:data:`FRONTIER_AXES`), saying when some of ``points`` sit at the bytes they held
    because their runs recorded no reads."""
    fell_back = axis == "read_bytes" and bool(points["held_fallback"].any())
    return FRONTIER_AXES[axis] + (HELD_FALLBACK if fell_back else "")


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
    "layout": "heap layout",
    "attention": "attention",
    "trials": "trials",
    "accuracy": "accuracy %",
    "accuracy_ci": "accuracy 95% CI",
    "exact_accuracy": "exact %",
    "exact_accuracy_ci": "exact 95% CI",
    "recall": "recall %",
    "recall_ci": "recall 95% CI",
    "tie_share": "tie share",
    "perplexity": "perplexity",
    "kl": "KL (nats)",
    "device": "device",
    "dtype": "dtype",
    "started_at": "started (UTC)",
    "started_by": "started by",
}


#: The run columns a heap layout and attention backend are read from (absent from frames of older stores).
_LAYOUT_NAMES = ["layout", "compact_at", "attention"]
#: The columns of :func:`run_shares`.
_SHARE_NAMES = [f"{metric}{end}" for metric in SHARE_COLUMNS for end in ("", "_low", "_high")] + ["tie_share"]


def run_shares(trials: pd.DataFrame) -> pd.DataFrame:
    """Per run of a trials frame (``Store.trials_frame``; indexed by run id): each share of :data:`SHARE_COLUMNS`
    as the mean over the trials that have it, with its 95 % interval (``accuracy``, ``accuracy_low``,
    ``accuracy_high``..., fractions) and the mean ``tie_share`` at the eviction cut; NaN where no trial has one."""
    rows = {}
    # Only the columns read: grouping slices every column of each run's rows, and the trials frame has many.
    read = [column for column in ("run_id", *SHARE_COLUMNS.values(), "tie_share") if column in trials]
    for run_id, group in trials[read].groupby("run_id"):
        row: dict[str, float] = {}
        for metric, column in SHARE_COLUMNS.items():
            values = trial_values(group, column)
            row[metric] = float(values.mean())
            row[f"{metric}_low"], row[f"{metric}_high"] = share_interval(values)
        row["tie_share"] = float(trial_values(group, "tie_share").mean())
        rows[run_id] = row
    return pd.DataFrame.from_dict(rows, orient="index", columns=_SHARE_NAMES)


def share_text(value: object) -> str:
    """A share as text in percent to a tenth (``31.2 %``), ``—`` where there is none."""
    return f"{100 * float(value):.1f} %" if present(value) else "—"  # type: ignore[arg-type]


def with_shares(runs: pd.DataFrame, shares: pd.DataFrame) -> pd.DataFrame:
    """``Store.list_runs`` rows with the columns of :func:`run_shares` (``shares``, of their trials): each share's
    interval, RULER's mean recall and the tie share, for :func:`runs_table`. The rows' own accuracies stay (the
    store's; the same means)."""
    shares = shares.drop(columns=["accuracy", "exact_accuracy"])
    return runs.drop(columns=list(shares.columns), errors="ignore").merge(
        shares, left_on="run_id", right_index=True, how="left"
    )


def runs_table(runs: pd.DataFrame) -> pd.DataFrame:
    """``Store.list_runs`` for display: newest first, policies with the parameters they changed, budgets as words,
    accuracies in percent, a text's perplexity and KL from the full cache (blank where a run has none). Runs with
    their shares (:func:`with_shares`) show each share's 95 % interval, RULER's mean recall and the mean share of
    eviction cuts decided by a tie; ``—`` where a run has none, or the rows came without them."""
    table = runs.reindex(columns=list(dict.fromkeys([*runs.columns, *_SHARE_NAMES, *_LAYOUT_NAMES])))
    table["policy"] = [policy_name(policy, params) for policy, params in zip(table["policy"], table["policy_params"])]
    table["budget"] = [budget_label(k, b) for k, b in zip(table["keep"], table["budget_tokens"])]
    table["model"] = table["model"].map(short_model_name)
    table["layout"] = [layout_label(layout, at) for layout, at in zip(table["layout"], table["compact_at"])]
    table["attention"] = [attention_label(value) for value in table["attention"]]
    for column in SHARE_COLUMNS:
        table[f"{column}_ci"] = [
            percent_interval(low, high) for low, high in zip(table[f"{column}_low"], table[f"{column}_high"])
        ]
        table[column] = (100 * table[column].astype(float)).round(1)
    table["tie_share"] = [share_text(value) for value in table["tie_share"]]
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


def attention_label(stored: object) -> str:
    """The attention backend a run's static steps used: as stored, or ``sdpa`` where none is (kvlab's own kernels,
    which every run used before the choice existed)."""
    return str(stored) if present(stored) else SDPA


#: The trial columns averaged per run for a comparison.
MEAN_COLUMNS = [
    "kept_tokens",
    "kv_bytes",
    "peak_kv_bytes",
    "peak_kv_reserved_bytes",
    "read_bytes",
    "prefill_s",
    "decode_s",
]


def trial_means(trials: pd.DataFrame) -> pd.DataFrame:
    """The mean of each of :data:`MEAN_COLUMNS` over each run's trials, indexed by run id (NaN for a column the
    trials do not have)."""
    if trials.empty:
        return pd.DataFrame(columns=MEAN_COLUMNS)
    values = pd.DataFrame({column: trial_values(trials, column) for column in MEAN_COLUMNS})
    return values.groupby(trials["run_id"].rename("run_id")).mean()


def compare_runs(runs: pd.DataFrame, trials: pd.DataFrame) -> pd.DataFrame:
    """Selected runs side by side, one column per run: configuration, provenance, their shares with 95 % intervals
    and the means of their trials (bytes measured from the cache tensors, in binary units; seconds of the model)."""
    means = trial_means(trials)
    shares = run_shares(trials)
    columns = {}
    for run in runs.itertuples(index=False):
        mean = means.loc[run.run_id] if run.run_id in means.index else None
        share = shares.loc[run.run_id] if run.run_id in shares.index else None
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
            "accuracy % (95% CI)": _share(run.accuracy, share, "accuracy"),
            "exact match % (95% CI)": _share(run.exact_accuracy, share, "exact_accuracy"),
            "recall of the expected strings % (95% CI)": _share(
                None if share is None else share["recall"], share, "recall"
            ),
            "tie share at the eviction cut": share_text(None if share is None else share["tie_share"]),
            "perplexity of the text": _number(run.perplexity, 3),
            "KL from the full cache (nats per token)": _number(run.kl, 4),
            "mean tokens kept per layer": _number(None if mean is None else mean["kept_tokens"]),
            "mean KV bytes at end (measured)": _bytes(None if mean is None else mean["kv_bytes"]),
            "mean peak KV bytes (measured)": _bytes(None if mean is None else mean["peak_kv_bytes"]),
            "mean peak KV bytes reserved (measured)": _bytes(None if mean is None else mean["peak_kv_reserved_bytes"]),
            "mean KV bytes read per decoded token (measured)": _bytes(None if mean is None else mean["read_bytes"]),
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


def _share(value: object, share: pd.Series | None, metric: str) -> str:
    """A share in percent with its 95 % interval from :func:`run_shares`: ``50.0 (24–76)``; ``—`` without it."""
    if not present(value):
        return "—"
    interval = "—" if share is None else percent_interval(share[f"{metric}_low"], share[f"{metric}_high"])
    return f"{100 * float(value):.1f} ({interval})"  # type: ignore[arg-type]


def _bytes(value: object) -> str:
    return format_bytes(float(value)) if present(value) else "—"  # type: ignore[arg-type]


def measured_metrics(runs: pd.DataFrame, trials: pd.DataFrame | None = None) -> list[str]:
    """The keys of :data:`METRICS` that at least one of ``runs`` (``Store.list_runs`` rows) or, for shares, of their
    ``trials`` has a value for, in :data:`METRICS`' order: needle runs have accuracies, RULER runs a recall, passes
    over a text a perplexity and a KL."""

    def measured(name: str) -> bool:
        if name in runs and runs[name].notna().any():
            return True
        return trials is not None and name in SHARE_COLUMNS and trial_values(trials, SHARE_COLUMNS[name]).notna().any()

    return [name for name in METRICS if measured(name)]


def run_tick(run: Any) -> str:
    """A run (a row of ``Store.list_runs``) as a bar chart's category names it, on three short lines:
    ``run 4<br>h2o<br>keep 10%``."""
    policy = policy_name(run.policy, run.policy_params)
    return f"run {run.run_id}<br>{policy}<br>{budget_label(run.keep, run.budget_tokens)}"


def _run_name(run: Any) -> str:
    """A run's :func:`run_label` from its row of ``Store.list_runs``."""
    return run_label(run.policy, run.mode, run.keep, run.budget_tokens, run.policy_params)


def run_quality(runs: pd.DataFrame, trials: pd.DataFrame, metric: str) -> pd.DataFrame:
    """One row per run (``Store.list_runs`` rows) with its ``value`` on a quality metric (a key of :data:`METRICS`,
    shares in percent), and for shares the 95 % interval ``low``..``high`` from its trials (:func:`run_shares`), so
    that a bar from two trials is not read like one from two hundred. Runs without the metric are left out."""
    shown = METRICS[metric]
    shares = run_shares(trials)
    rows = []
    for run in runs.itertuples(index=False):
        share = shares.loc[run.run_id] if run.run_id in shares.index else None
        if metric in SHARE_COLUMNS:
            value, low, high = (np.nan,) * 3 if share is None else share[[metric, f"{metric}_low", f"{metric}_high"]]
        else:
            value, low, high = getattr(run, metric), np.nan, np.nan
        if not present(value):
            continue
        rows.append(
            {
                "run_id": run.run_id,
                "tick": run_tick(run),
                "label": _run_name(run),
                "value": shown.scale * float(value),
                "low": shown.scale * float(low),
                "high": shown.scale * float(high),
                "trials": int(run.trials),
            }
        )
    return pd.DataFrame(rows, columns=["run_id", "tick", "label", "value", "low", "high", "trials"])


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


#: The 5 % level at which a paired test's reading calls a difference shown.
SIGNIFICANCE = 0.05
PAIRED_COLUMNS = [
    "A",
    "B",
    "items both answered",
    "only A right",
    "only B right",
    "McNemar p",
    "test",
    "B − A, points (95% CI)",
    "reading",
]
_TEST_NAMES = {"exact": "exact binomial", "chi-square": "chi-square, continuity-corrected"}


def by_item(trials: pd.DataFrame, column: str) -> pd.Series:
    """The values of ``column`` (:func:`trial_values`) indexed by the ``item_hash`` of the prompt each trial
    answered (``None`` for trials stored before prompts were hashed), for
    :func:`~kvlab.stats.pair_by_item`."""
    items = trials["item_hash"] if "item_hash" in trials else pd.Series(None, index=trials.index, dtype=object)
    return pd.Series(trial_values(trials, column).to_numpy(), index=pd.Index(items.to_numpy(), dtype=object))


def paired_test(a: pd.DataFrame, b: pd.DataFrame, a_name: str, b_name: str, metric: str = "accuracy") -> dict:
    """Two sets of trials compared on the items both answered (:func:`~kvlab.stats.pair_by_item`), as a row of
    :data:`PAIRED_COLUMNS`: McNemar's test of who is right where they disagree (for RULER's recall, right is every
    expected string recalled) and the mean paired difference B − A in points with its bootstrap 95 % interval. Fewer
    than :data:`MIN_PAIRED_ITEMS` paired items are ``not comparable``."""
    a_values, b_values = pair_by_item(by_item(a, SHARE_COLUMNS[metric]), by_item(b, SHARE_COLUMNS[metric]))
    row = dict.fromkeys(PAIRED_COLUMNS, "—") | {"A": a_name, "B": b_name, "items both answered": str(len(a_values))}
    if len(a_values) < MIN_PAIRED_ITEMS:
        row["reading"] = f"not comparable: {len(a_values)} items pair up, fewer than {MIN_PAIRED_ITEMS}"
        return row
    test = mcnemar(a_values >= 1, b_values >= 1)
    difference, low, high = paired_difference_interval(a_values, b_values)
    if test.p_value >= SIGNIFICANCE:
        reading = "no difference shown at the 5% level"
    else:
        reading = f"{'B' if test.b01 > test.b10 else 'A'} right more often (difference shown at the 5% level)"
    return row | {
        "only A right": str(test.b10),
        "only B right": str(test.b01),
        "McNemar p": f"{test.p_value:.2g}",
        "test": _TEST_NAMES[test.method],
        "B − A, points (95% CI)": f"{100 * difference:+.1f} ({100 * low:+.1f} to {100 * high:+.1f})",
        "reading": reading,
    }


def paired_tests(runs: pd.DataFrame, trials: pd.DataFrame, metric: str = "accuracy") -> pd.DataFrame:
    """Every two of ``runs`` (``Store.list_runs`` rows, A the earlier in their order) by :func:`paired_test` on a
    share metric, from their ``trials`` (``Store.trials_frame``)."""
    rows = [
        paired_test(
            trials[trials["run_id"] == a.run_id],
            trials[trials["run_id"] == b.run_id],
            f"run {a.run_id}",
            f"run {b.run_id}",
            metric,
        )
        for index, a in enumerate(runs.itertuples(index=False))
        for b in runs.iloc[index + 1 :].itertuples(index=False)
    ]
    return pd.DataFrame(rows, columns=PAIRED_COLUMNS)


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
