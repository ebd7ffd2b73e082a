"""A published needle-in-a-haystack claim, and kvlab's own measurement laid beside it.

An article claims that on a needle test at 4096 tokens, H2O keeps 100% accuracy from 10% up to 90% pruning while
StreamingLLM falls to 14% and random eviction to 5% at 90%. kvlab shows that table only next to its own measurement
of the same grid on a real model, never alone.
"""

from __future__ import annotations

import pandas as pd

from kvlab.policies import is_full_cache

PRUNING = (0.1, 0.3, 0.5, 0.7, 0.9)
CLAIM_CONTEXT = 4096

#: Accuracy (%) by pruning ratio, as published (the article's "H2O / StreamingLLM / Random" table).
PUBLISHED_NEEDLE_CLAIM: dict[str, tuple[float, ...]] = {
    "h2o": (100.0, 100.0, 100.0, 100.0, 100.0),
    "streaming": (90.0, 62.0, 51.0, 40.0, 14.0),
    "random": (91.0, 76.0, 52.0, 34.0, 5.0),
}


def _columns() -> list[str]:
    return [f"{round(100 * p)}% pruned" for p in PRUNING]


def published_table() -> pd.DataFrame:
    """The article's table: one row per policy, one column per pruning ratio (accuracy in %)."""
    rows = {f"{policy} (article)": list(values) for policy, values in PUBLISHED_NEEDLE_CLAIM.items()}
    return pd.DataFrame.from_dict(rows, orient="index", columns=_columns())


def measured_table(trials: pd.DataFrame, context: int = CLAIM_CONTEXT) -> pd.DataFrame:
    """kvlab's accuracy (%) by pruning ratio, one row per policy and mode, with the fewest trials behind any cell
    of the row, from a trials frame (``Store.trials_frame()``) of runs at ``context`` tokens."""
    rows = trials[(trials["context_length"] == context) & trials["keep"].notna()].copy()
    if rows.empty:
        return pd.DataFrame(columns=[*_columns(), "trials per cell"])
    rows["pruning"] = (1.0 - rows["keep"].astype(float)).round(4)
    rows["row"] = rows["policy"] + " " + rows["mode"] + " (kvlab)"
    grouped = rows.groupby(["row", "pruning"])["correct"].agg(["mean", "count"])
    accuracy = (100 * grouped["mean"]).unstack("pruning").reindex(columns=list(PRUNING))
    accuracy.columns = _columns()
    accuracy["trials per cell"] = grouped["count"].groupby("row").min()
    return accuracy


def side_by_side(trials: pd.DataFrame, context: int = CLAIM_CONTEXT) -> pd.DataFrame:
    """The article's rows and kvlab's rows for the same pruning ratios, each article policy followed by kvlab's
    measurement of it, then the other policies, then the full cache (which prunes nothing) as the ceiling."""
    measured = measured_table(trials, context)
    published = published_table()
    order: list[str] = []
    for policy in PUBLISHED_NEEDLE_CLAIM:
        order.append(f"{policy} (article)")
        order += [row for row in measured.index if row.startswith(f"{policy} ")]
    order += [row for row in measured.index if row not in order]
    table = pd.concat([published, measured]).reindex(order)
    full = trials[(trials["context_length"] == context) & trials["policy"].map(is_full_cache)]
    if not full.empty:
        table.loc["full cache (kvlab)", _columns()] = 100 * full["correct"].mean()
        table.loc["full cache (kvlab)", "trials per cell"] = len(full)
    return table
