"""The published needle-in-a-haystack table, and kvlab's measurement of the same cells laid beside it.

An article claims that on a needle test at 4096 tokens, H2O keeps 100% accuracy from 10% up to 90% pruning while
StreamingLLM falls to 14% and random eviction to 5% at 90%. kvlab shows that table only next to its own measurement
of the same grid on a real model, never alone, and every measured cell with its 95% interval, so that a cell of ten
trials is not read like one of a hundred.
"""

from __future__ import annotations

import math

import pandas as pd

from kvlab.claims.options import variant
from kvlab.stats import wilson_interval

PRUNING = (0.1, 0.3, 0.5, 0.7, 0.9)
CLAIM_CONTEXT = 4096

#: Accuracy (%) by pruning ratio, as published (the article's "H2O / StreamingLLM / Random" table).
PUBLISHED_NEEDLE_CLAIM: dict[str, tuple[float, ...]] = {
    "h2o": (100.0, 100.0, 100.0, 100.0, 100.0),
    "streaming": (90.0, 62.0, 51.0, 40.0, 14.0),
    "random": (91.0, 76.0, 52.0, 34.0, 5.0),
}

TRIALS_COLUMN = "trials per cell"
CELL_COLUMNS = ["policy", "variant", "mode", "pruning", "correct", "trials", "accuracy", "low", "high", "kv_bytes"]


def pruning_column(pruning: float) -> str:
    """The accuracy column of one pruning ratio: ``90% pruned``."""
    return f"{round(100 * pruning)}% pruned"


def interval_column(pruning: float) -> str:
    """The 95% interval column beside it: ``90% pruned, 95% interval``."""
    return f"{pruning_column(pruning)}, 95% interval"


def _columns() -> list[str]:
    return [pruning_column(p) for p in PRUNING]


def _measured_columns() -> list[str]:
    return [column for p in PRUNING for column in (pruning_column(p), interval_column(p))] + [TRIALS_COLUMN]


FULL_CACHE = "full"
"""The registry's full cache (:class:`kvlab.policies.full.Full`), named here so that reading a store needs no
torch; the tests check that it is the one policy :func:`kvlab.policies.is_full_cache` accepts."""


def full_cache(frame: pd.DataFrame) -> pd.Series:
    """Which rows of a runs or trials frame are the full cache's."""
    return frame["policy"] == FULL_CACHE


def budgeted(frame: pd.DataFrame) -> pd.Series:
    """Which rows evict to a budget (a kept fraction or a token count): the eviction methods, not the full cache
    and not an ablation that removes fixed tokens."""
    return frame["keep"].notna() | frame["budget_tokens"].notna()


def scored(trials: pd.DataFrame) -> pd.DataFrame:
    """The trials that answered a question: those of texts scored by likelihood have no ``correct``."""
    return trials[trials["correct"].notna()]


def _budgeted_rows(trials: pd.DataFrame, context: int) -> pd.DataFrame:
    """The scored trials at ``context`` tokens of runs with a kept fraction, with their variant and pruning ratio."""
    rows = scored(trials[(trials["context_length"] == context) & trials["keep"].notna()])
    return with_variants(rows).assign(pruning=(1.0 - rows["keep"].astype(float)).round(4))


def cell_trials(trials: pd.DataFrame, cell: pd.Series, context: int = CLAIM_CONTEXT) -> pd.DataFrame:
    """The scored trials behind one of :func:`needle_cells`' cells: its policy variant, mode and pruning ratio at
    ``context`` tokens (for a paired test of two cells on the items both answered)."""
    rows = _budgeted_rows(trials, context)
    same = (rows["policy"] == cell["policy"]) & (rows["variant"] == cell["variant"]) & (rows["mode"] == cell["mode"])
    return rows[same & ((rows["pruning"] - cell["pruning"]).abs() < 1e-9)]


def full_cache_trials(trials: pd.DataFrame, context: int = CLAIM_CONTEXT) -> pd.DataFrame:
    """The full cache's scored trials at ``context`` tokens, every mode pooled: :func:`full_cache_cell`'s trials."""
    return scored(trials[(trials["context_length"] == context) & full_cache(trials)])


def needle_cells(trials: pd.DataFrame, context: int = CLAIM_CONTEXT) -> pd.DataFrame:
    """kvlab's cells at ``context`` tokens, one row per (policy variant, mode, pruning ratio) of runs with a kept
    fraction: ``correct`` of ``trials``, ``accuracy`` and its Wilson 95% interval ``low``..``high``, all in %, and
    the mean ``kv_bytes`` a trial held (NaN where the frame has none). A policy with cache options of its own
    (precision tiers, another allocation, noise) is a cell apart, named by its ``variant``
    (:func:`~kvlab.claims.options.variant`); the policy as published has its name as its variant."""
    rows = _budgeted_rows(trials, context)
    if rows.empty:
        return pd.DataFrame(columns=CELL_COLUMNS)
    rows = _countable(rows)
    cells = rows.groupby(["policy", "variant", "mode", "pruning"], as_index=False).agg(
        correct=("correct", "sum"), trials=("correct", "count"), kv_bytes=("kv_bytes", "mean")
    )
    return _with_intervals(cells)[CELL_COLUMNS]


def with_variants(rows: pd.DataFrame) -> pd.DataFrame:
    """Trials with their policy ``variant`` (a frame without parameters holds policies as published)."""
    params = rows["policy_params"] if "policy_params" in rows else pd.Series(None, index=rows.index, dtype=object)
    # Python lists first: iterating a column of Arrow strings converts one element at a time (0.26 s for the shipped
    # evidence's trials), tolist converts the column at once.
    pairs = [(policy, _hashable(stored)) for policy, stored in zip(rows["policy"].tolist(), params.tolist())]
    named = {pair: variant(*pair) for pair in set(pairs)}
    return rows.assign(variant=[named[pair] for pair in pairs])


def _hashable(policy_params: object) -> str | None:
    """Stored parameters as a key: their JSON text; anything else names no parameters (as :func:`variant` reads
    it), whether NaN, None or a missing value."""
    return policy_params if isinstance(policy_params, str) else None


def plain(cells: pd.DataFrame) -> pd.DataFrame:
    """The cells of policies as published (no cache options of their own)."""
    return cells[cells["variant"] == cells["policy"]]


def cell_of(rows: pd.DataFrame) -> pd.Series:
    """Scored trials as one cell: ``correct`` of ``trials``, ``accuracy`` with its Wilson 95% interval
    ``low``..``high`` (in %) and the mean ``kv_bytes`` held (NaN without them)."""
    rows = _countable(rows)
    cell = pd.DataFrame(
        {"correct": [int(rows["correct"].sum())], "trials": [len(rows)], "kv_bytes": [rows["kv_bytes"].mean()]}
    )
    return _with_intervals(cell).iloc[0]


def _countable(rows: pd.DataFrame) -> pd.DataFrame:
    """Scored trials with ``correct`` as 0 or 1 and ``kv_bytes`` as a float (NaN where the frame has none)."""
    kv_bytes = rows["kv_bytes"].astype(float) if "kv_bytes" in rows else math.nan
    return rows.assign(correct=rows["correct"].astype(bool).astype(int), kv_bytes=kv_bytes)


def full_cache_cell(trials: pd.DataFrame, context: int = CLAIM_CONTEXT) -> pd.Series | None:
    """The full cache at ``context`` tokens as one cell (every mode pooled: nothing is evicted in either), or None
    when the frame has no full-cache trial there."""
    rows = full_cache_trials(trials, context)
    return None if rows.empty else cell_of(rows)


def _with_intervals(cells: pd.DataFrame) -> pd.DataFrame:
    """``accuracy``, ``low`` and ``high`` (in %) from the ``correct`` and ``trials`` columns."""
    bounds = [wilson_interval(int(k), int(n)) for k, n in zip(cells["correct"], cells["trials"])]
    return cells.assign(
        accuracy=100 * cells["correct"] / cells["trials"],
        low=[100 * low for low, _ in bounds],
        high=[100 * high for _, high in bounds],
    )


def interval_text(low: float, high: float) -> str:
    """An interval in whole percent, rounded outwards so that it never claims more precision than it has:
    ``37–57``."""
    return f"{math.floor(round(low, 1))}–{math.ceil(round(high, 1))}"


def published_table() -> pd.DataFrame:
    """The article's table: one row per policy, one column per pruning ratio (accuracy in %)."""
    rows = {f"{policy} (article)": list(values) for policy, values in PUBLISHED_NEEDLE_CLAIM.items()}
    return pd.DataFrame.from_dict(rows, orient="index", columns=_columns())


def measured_table(trials: pd.DataFrame, context: int = CLAIM_CONTEXT) -> pd.DataFrame:
    """kvlab's accuracy (%) by pruning ratio, one row per policy and mode, each cell followed by its Wilson 95%
    interval, with the fewest trials behind any cell of the row, from a trials frame (``Store.trials_frame()``) of
    runs at ``context`` tokens. Trials without a ``correct`` answer (texts scored by likelihood) are left out, and so
    are policies with cache options of their own: the published table is about the methods as published."""
    cells = plain(needle_cells(trials, context)).copy()
    if cells.empty:
        return pd.DataFrame(columns=_measured_columns())
    cells["row"] = cells["policy"] + " " + cells["mode"] + " (kvlab)"
    cells["interval"] = [interval_text(low, high) for low, high in zip(cells["low"], cells["high"])]
    by_cell = cells.set_index(["row", "pruning"])
    accuracy = by_cell["accuracy"].unstack("pruning").reindex(columns=list(PRUNING))
    accuracy.columns = _columns()
    intervals = by_cell["interval"].unstack("pruning").reindex(columns=list(PRUNING))
    intervals.columns = [interval_column(p) for p in PRUNING]
    table = pd.concat([accuracy, intervals], axis=1)
    table[TRIALS_COLUMN] = by_cell["trials"].groupby("row").min()
    table.index.name = None
    return _fill_intervals(table[_measured_columns()])


def _fill_intervals(table: pd.DataFrame) -> pd.DataFrame:
    """Interval cells with nothing measured behind them (the article's rows, a ratio kvlab did not run) as ``—``."""
    columns = [interval_column(p) for p in PRUNING]
    return table.assign(
        **{column: table[column].astype(object).where(table[column].notna(), "—") for column in columns}
    )


def side_by_side(trials: pd.DataFrame, context: int = CLAIM_CONTEXT) -> pd.DataFrame:
    """The article's rows and kvlab's rows for the same pruning ratios, each article policy followed by kvlab's
    measurement of it, then the other policies, then the full cache (which prunes nothing) as the ceiling.

    kvlab's rows are those with a measured cell at one of the article's ratios, and an article row appears only
    where kvlab has such a row of its policy: the published figures are never shown without kvlab's beside them
    (:func:`article_rows_left_out` names those left out)."""
    measured = measured_table(trials, context).dropna(how="all", subset=_columns())
    published = published_table()
    order: list[str] = []
    for policy in PUBLISHED_NEEDLE_CLAIM:
        kvlab_rows = [row for row in measured.index if row.startswith(f"{policy} ")]
        order += [f"{policy} (article)", *kvlab_rows] if kvlab_rows else []
    order += [row for row in measured.index if row not in order]
    table = pd.concat([published, measured]).reindex(index=order, columns=_measured_columns())
    full = full_cache_cell(trials, context)
    if full is not None:
        label = "full cache (kvlab)"
        table.loc[label, _columns()] = full["accuracy"]
        table.loc[label, [interval_column(p) for p in PRUNING]] = interval_text(full["low"], full["high"])
        table.loc[label, TRIALS_COLUMN] = full["trials"]
    return _fill_intervals(table)


def article_rows_left_out(table: pd.DataFrame) -> list[str]:
    """The article's policies whose rows a :func:`side_by_side` table leaves out, kvlab having measured none of
    their cells at that length."""
    return [policy for policy in PUBLISHED_NEEDLE_CLAIM if f"{policy} (article)" not in table.index]
