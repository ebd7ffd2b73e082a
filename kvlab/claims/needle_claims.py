"""Claims measured on the needle table at 4,096 tokens: accuracy by policy, mode and pruning ratio, each cell with
its 95% interval, on the model with the most needle trials in the store; where a claim sets two cells against each
other and they answered the same items, McNemar's paired test stands beside them.

Accuracy is taken to fall as pruning grows (it does in every measured row): a claim about a ratio kvlab did not
run is refuted by a less pruned cell that already fails it and confirmed by a more pruned cell that passes it.
"""

from __future__ import annotations

from collections.abc import Callable

import pandas as pd

from kvlab.claims.commands import needle_sweep
from kvlab.claims.evidence import Evidence, Group, largest_group
from kvlab.claims.needle import (
    PRUNING,
    PUBLISHED_NEEDLE_CLAIM,
    cell_trials,
    full_cache_cell,
    full_cache_trials,
    interval_text,
    needle_cells,
    plain,
    scored,
)
from kvlab.claims.verdicts import FAILS, HOLDS, Evaluation, judged, missing, unmeasurable
from kvlab.stats import MIN_PAIRED_ITEMS, mcnemar, pair_by_item

#: How article 004 divides policies: eviction by attention scores, and "simpler heuristics".
ATTENTION_BASED = ("h2o", "snapkv", "pyramidkv", "tova")
HEURISTIC = ("streaming", "random", "knorm")
NEGLIGIBLE_LOSS = 5.0
"""An accuracy loss (percentage points) a reader would call negligible: about the half-width of a 95% interval of
100 trials near the top of the scale."""
NEEDLE_TASK = "the needle task at 4,096 tokens"


def needle_group(evidence: Evidence) -> Group | None:
    """The needle trials of the model with the most of them, or None when the store has none."""
    trials = evidence.needle_trials
    if trials.empty or scored(trials).empty:
        return None
    return largest_group(scored(trials), ["model"])


def model_of(group: Group | None) -> str | None:
    """The model a reproducing command names: the one the figure came from, or the default when there is none."""
    return group.model if group is not None else None


def _cells(group: Group) -> pd.DataFrame:
    """The needle cells of policies as published: these claims are about the methods, not their variants."""
    return plain(needle_cells(group.trials))


def cell_text(cell: pd.Series) -> str:
    """One cell as ``12% (7–20, 100 trials)``."""
    return f"{cell['accuracy']:.0f}% ({interval_text(cell['low'], cell['high'])}, {int(cell['trials'])} trials)"


def paired_clause(a: pd.DataFrame, b: pd.DataFrame, a_name: str, b_name: str) -> str:
    """McNemar's test of two cells' scored trials on the items both answered (by prompt hash), as a clause of a
    figure: ``; paired on 100 items, only tova right on 12, only full right on 2, McNemar p = 0.013 (exact)``.
    Empty when fewer than :data:`~kvlab.stats.MIN_PAIRED_ITEMS` pair up (different prompts, or trials stored
    before prompts were hashed): the cells' intervals then stand alone."""

    def outcomes(trials: pd.DataFrame) -> pd.Series:
        return pd.Series(trials["correct"].astype(float).to_numpy(), index=pd.Index(trials["item_hash"], dtype=object))

    if "item_hash" not in a or "item_hash" not in b:
        return ""
    a_values, b_values = pair_by_item(outcomes(a), outcomes(b))
    if len(a_values) < MIN_PAIRED_ITEMS:
        return ""
    test = mcnemar(a_values >= 1, b_values >= 1)
    return (
        f"; paired on {test.pairs} items, only {a_name} right on {test.b10}, only {b_name} right on {test.b01}, "
        f"McNemar p = {test.p_value:.2g} ({test.method})"
    )


def _perfect_at(rows: pd.DataFrame, pruning: float) -> tuple[bool | None, pd.Series | None]:
    """Whether a policy's accuracy in one mode (``rows`` of :func:`needle_cells`) is 100% at ``pruning``, and the
    cell that decides it: the cell at that ratio; else the nearest less pruned cell when it already misses a needle;
    else the nearest more pruned cell when it still finds every one. ``(None, None)`` when no cell decides."""
    exact = rows[(rows["pruning"] - pruning).abs() < 1e-9]
    if not exact.empty:
        cell = exact.iloc[0]
        return bool(cell["correct"] == cell["trials"]), cell
    less = rows[rows["pruning"] < pruning].sort_values("pruning")
    if not less.empty and less.iloc[-1]["correct"] < less.iloc[-1]["trials"]:
        return False, less.iloc[-1]
    more = rows[rows["pruning"] > pruning].sort_values("pruning")
    if not more.empty and more.iloc[0]["correct"] == more.iloc[0]["trials"]:
        return True, more.iloc[0]
    return None, None


def _perfect_recall_claim(pruning: float, what: str) -> Callable[[Evidence], Evaluation]:
    """A claim that H2O finds every needle at ``pruning`` (claims 8 and 10)."""

    def evaluate(evidence: Evidence) -> Evaluation:
        group = needle_group(evidence)
        command = needle_sweep(evidence.db, ("full", "h2o"), (pruning,), model=model_of(group))
        cells = _cells(group) if group is not None else pd.DataFrame()
        h2o = cells[cells["policy"] == "h2o"] if not cells.empty else cells
        if group is None or h2o.empty:
            return missing(f"H2O on {NEEDLE_TASK}", evidence.db, command)
        parts, facts = [], []
        for mode, rows in h2o.groupby("mode"):
            perfect, cell = _perfect_at(rows, pruning)
            if perfect is None or cell is None:
                continue
            parts.append((f"in {mode} mode", perfect))
            facts.append(f"{mode} mode {cell_text(cell)} at {cell['pruning']:.0%} pruning")
        if not parts:
            return unmeasurable(
                f"the H2O cells in {evidence.db} ({', '.join(f'{p:.0%}' for p in sorted(h2o['pruning'].unique()))} "
                f"pruned) neither reach nor refute {pruning:.0%}; run: {command}",
                command=command,
            )
        figure = f"H2O {what}: " + "; ".join(facts)
        return judged(parts, figure, model=group.model, device=group.device, command=command)

    return evaluate


h2o_at_80 = _perfect_recall_claim(0.8, "finding every needle")
heavy_hitters_5pct = _perfect_recall_claim(0.95, "(heavy hitters and a recent window) finding every needle")


def published_table_claim(evidence: Evidence) -> Evaluation:
    """Claim 9: the article's table, cell by cell: does each published accuracy lie in kvlab's 95% interval?"""
    group = needle_group(evidence)
    command = needle_sweep(evidence.db, ("full", *PUBLISHED_NEEDLE_CLAIM), model=model_of(group))
    cells = _cells(group) if group is not None else pd.DataFrame()
    rows = cells[cells["policy"].isin(list(PUBLISHED_NEEDLE_CLAIM))] if not cells.empty else cells
    if group is None or rows.empty:
        return missing(f"H2O, StreamingLLM or random eviction on {NEEDLE_TASK}", evidence.db, command)
    parts, facts = [], []
    for policy, values in PUBLISHED_NEEDLE_CLAIM.items():
        for mode, row in rows[rows["policy"] == policy].groupby("mode"):
            published = dict(zip(PRUNING, values))
            inside = [
                cell["low"] <= published[cell["pruning"]] <= cell["high"]
                for _, cell in row.iterrows()
                if cell["pruning"] in published
            ]
            if not inside:
                continue
            ordered = [cell for _, cell in row.sort_values("pruning").iterrows()]
            measured = "/".join(f"{cell['accuracy']:.0f}" for cell in ordered)
            intervals = "/".join(interval_text(cell["low"], cell["high"]) for cell in ordered)
            parts.append((f"for {policy} in {mode} mode", all(inside)))
            facts.append(
                f"{policy} {mode} {measured}% (95% intervals {intervals}; {sum(inside)} of {len(inside)} published "
                "cells inside)"
            )
    if not parts:
        return missing(f"the published pruning ratios on {NEEDLE_TASK}", evidence.db, command)
    fewest = int(rows["trials"].min())
    figure = (
        f"kvlab at 10/30/50/70/90% pruning, at least {fewest} trials per cell: " + "; ".join(facts) + ". A published "
        "cell is inside when it lies in kvlab's 95% interval"
    )
    return judged(parts, figure, model=group.model, device=group.device, command=command)


def pruned_beats_full(evidence: Evidence) -> Evaluation:
    """Claim 24: a pruned cache can be more accurate than the full cache (less distracting history)."""
    group = needle_group(evidence)
    command = needle_sweep(evidence.db, model=model_of(group))
    full = full_cache_cell(group.trials) if group is not None else None
    cells = _cells(group) if group is not None else pd.DataFrame()
    if group is None or full is None or cells.empty:
        return missing(f"the full cache and evicting policies on {NEEDLE_TASK}", evidence.db, command)
    if full["correct"] == full["trials"]:
        return unmeasurable(
            "the full cache finds every needle, so no pruned cache can do better on this task; it needs a task the "
            "full cache fails",
            figure=f"full cache {cell_text(full)}",
            model=group.model,
            device=group.device,
            command=command,
        )
    better = cells[cells["low"] > full["high"]]
    best = cells.sort_values("accuracy").iloc[-1]
    shown = better.iloc[0] if not better.empty else best
    figure = (
        f"full cache {cell_text(full)}; {'above it' if not better.empty else 'best pruned cell'}: {shown['policy']} "
        f"{shown['mode']} at {shown['pruning']:.0%} pruning, {cell_text(shown)}"
        + paired_clause(full_cache_trials(group.trials), cell_trials(group.trials, shown), "full", shown["policy"])
    )
    return Evaluation(
        HOLDS if not better.empty else FAILS, figure=figure, model=group.model, device=group.device, command=command
    )


def _best(cells: pd.DataFrame, policies: tuple[str, ...]) -> pd.Series | None:
    """The most accurate cell among ``policies``, or None."""
    chosen = cells[cells["policy"].isin(list(policies))]
    return chosen.sort_values(["accuracy", "trials"]).iloc[-1] if not chosen.empty else None


def negligible_loss_at_90(evidence: Evidence) -> Evaluation:
    """Claim 28: evicting 90% of the cache intelligently (by attention) often loses a negligible accuracy."""
    pruning = 0.9
    group = needle_group(evidence)
    command = needle_sweep(evidence.db, ("full", *ATTENTION_BASED), (pruning,), model=model_of(group))
    full = full_cache_cell(group.trials) if group is not None else None
    cells = _cells(group) if group is not None else pd.DataFrame()
    at_90 = cells[(cells["pruning"] - pruning).abs() < 1e-9] if not cells.empty else cells
    if group is None or full is None or _best(at_90, ATTENTION_BASED) is None:
        return missing(
            f"the full cache and attention-based policies at 90% pruning on {NEEDLE_TASK}", evidence.db, command
        )
    parts, facts = [], []
    for mode, rows in at_90.groupby("mode"):
        best = _best(rows, ATTENTION_BASED)
        if best is None:
            continue
        parts.append((f"in {mode} mode", full["accuracy"] - best["accuracy"] <= NEGLIGIBLE_LOSS))
        paired = paired_clause(full_cache_trials(group.trials), cell_trials(group.trials, best), "full", best["policy"])
        facts.append(f"{mode} mode: best {best['policy']} {cell_text(best)}{paired}")
    figure = (
        f"at 90% pruning against the full cache's {cell_text(full)}: " + "; ".join(facts) + f" (negligible: a loss "
        f"of at most {NEGLIGIBLE_LOSS:.0f} points)"
    )
    return judged(parts, figure, model=group.model, device=group.device, command=command)


def attention_beats_heuristics(evidence: Evidence) -> Evaluation:
    """Claim 36: with at least 30% of the cache, prefer attention-based eviction to heuristics."""
    pruning = 0.7
    group = needle_group(evidence)
    command = needle_sweep(evidence.db, ("full", *ATTENTION_BASED, *HEURISTIC), (pruning,), model=model_of(group))
    cells = _cells(group) if group is not None else pd.DataFrame()
    trials = group.trials if group is not None else pd.DataFrame()
    at_30 = cells[(cells["pruning"] - pruning).abs() < 1e-9] if not cells.empty else cells
    parts, facts = [], []
    for mode, rows in at_30.groupby("mode") if not at_30.empty else []:
        attention, heuristic = _best(rows, ATTENTION_BASED), _best(rows, HEURISTIC)
        if attention is None or heuristic is None:
            continue
        parts.append((f"in {mode} mode", attention["low"] > heuristic["high"]))
        paired = paired_clause(
            cell_trials(trials, attention),
            cell_trials(trials, heuristic),
            attention["policy"],
            heuristic["policy"],
        )
        facts.append(
            f"{mode} mode: {attention['policy']} {cell_text(attention)} against {heuristic['policy']} "
            f"{cell_text(heuristic)}{paired}"
        )
    if group is None or not parts:
        return missing(f"attention-based and heuristic policies at 70% pruning on {NEEDLE_TASK}", evidence.db, command)
    figure = (
        "best attention-based against best heuristic policy at a 30% budget (70% pruned), on needle retrieval (no "
        "reasoning task here): " + "; ".join(facts) + " (preferred: its 95% interval lies above the other's)"
    )
    return judged(parts, figure, model=group.model, device=group.device, command=command)
