"""Claims measured by reading held-out text under a cache: attention sinks kept or removed (claims 19 and 20).

Quality runs (tasks ``quality:<text>``) score the next tokens of a text read under the run's cache; each trial
records the tokens it scored, their mean negative log-likelihood and the mean KL divergence of each step's
prediction from the full cache's. Perplexity pools the texts by the tokens they scored.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import pandas as pd

from kvlab.claims.commands import ABLATION_BUDGET, FIRST_TOKEN_ABLATION, SINK_COUNTS, sink_ablation
from kvlab.claims.evidence import Evidence, Group, largest_group
from kvlab.claims.needle import budgeted, full_cache
from kvlab.claims.units import percent
from kvlab.claims.verdicts import ABOUT, FAILS, HOLDS, Evaluation, about, judged, missing, unmeasurable
from kvlab.stats import pooled_perplexity

ENOUGH_SINKS = 4
"""The sinks article 002 says keep the softmax stable; :data:`SINK_COUNTS` above it are the "up to 32"."""
CLAIMED_INCREASE = 4.0
"""Article 002: removing the first token raises perplexity "by 400%"."""
CLAIMED_TOKENS = 1000
"""... "after 1000 tokens of generation"."""


def _group(evidence: Evidence, having: Callable[[pd.DataFrame], bool]) -> Group | None:
    """The scored quality trials of the (model, text, tokens read) with the most trials ``having`` what a claim
    compares, or None: perplexities compare only on the same tokens."""
    trials = evidence.quality_trials
    if trials.empty:
        return None
    rows = trials[trials["nll"].notna() & (trials["scored_tokens"].fillna(0) > 0)]
    return largest_group(rows, ["model", "task", "item_hash"], having) if not rows.empty else None


def perplexity(rows: pd.DataFrame) -> float:
    """Perplexity of the trials' texts together."""
    return pooled_perplexity(rows["nll"].astype(float).tolist(), rows["scored_tokens"].astype(int).tolist())


def sinks_of(policy_params: str) -> int | None:
    """The ``sinks`` parameter of a stored run (JSON text), or None."""
    value = json.loads(policy_params or "{}").get("sinks")
    return int(value) if value is not None else None


def _streaming_by_sinks(trials: pd.DataFrame) -> pd.DataFrame:
    """StreamingLLM trials with their sink count and their budget as a label (``keep 10%``, ``128 tokens``)."""
    rows = trials[(trials["policy"] == "streaming") & budgeted(trials)]
    budgets = [
        f"keep {percent(float(keep))}" if pd.notna(keep) else f"{int(tokens):,} tokens"
        for keep, tokens in zip(rows["keep"], rows["budget_tokens"])
    ]
    return rows.assign(sinks=rows["policy_params"].map(sinks_of), budget=budgets)


def _ablated(trials: pd.DataFrame) -> pd.Series:
    """Which trials read the text with only the first token removed."""
    return trials["policy"] == FIRST_TOKEN_ABLATION


def sinks_keep_softmax_stable(evidence: Evidence) -> Evaluation:
    """Claim 19: keeping the first 4 tokens keeps the softmax stable at any pruning depth (up to 32 may help)."""
    group = _group(evidence, lambda trials: bool(_streaming_by_sinks(trials)["sinks"].ge(ENOUGH_SINKS).any()))
    command = sink_ablation(evidence.db, model=group.model if group is not None else None)
    streaming = _streaming_by_sinks(group.trials) if group is not None else pd.DataFrame()
    parts, facts = [], []
    for budget, rows in streaming.groupby("budget") if not streaming.empty else []:
        by_sinks = {int(s): perplexity(r) for s, r in rows.groupby("sinks") if int(s) in SINK_COUNTS}
        more = [by_sinks[s] for s in SINK_COUNTS if s > ENOUGH_SINKS and s in by_sinks]
        if ENOUGH_SINKS not in by_sinks or not more:
            continue
        enough = by_sinks[ENOUGH_SINKS]
        parts.append((f"at {budget}", enough <= min(more) or about(enough, min(more))))
        shown = "/".join(f"{by_sinks[s]:.2f}" if s in by_sinks else "—" for s in SINK_COUNTS)
        facts.append(f"{budget}: {shown}")
    if group is None or not parts:
        return missing(f"StreamingLLM with {ENOUGH_SINKS} and more sinks on a quality task", evidence.db, command)
    full = group.trials[full_cache(group.trials)]
    ceiling = f"; full cache {perplexity(full):.2f}" if not full.empty else ""
    figure = (
        f"perplexity with {'/'.join(str(s) for s in SINK_COUNTS)} sinks, " + "; ".join(facts) + ceiling + " (stable: "
        f"{ENOUGH_SINKS} sinks within {ABOUT:.0%} of the best of more sinks)"
    )
    return judged(parts, figure, model=group.model, device=group.device, command=command)


def first_token_removed(evidence: Evidence) -> Evaluation:
    """Claim 20: removing only the first token raises perplexity by 400% after 1,000 generated tokens."""
    group = _group(evidence, lambda trials: bool(full_cache(trials).any() and _ablated(trials).any()))
    command = sink_ablation(evidence.db, (ABLATION_BUDGET,), model=group.model if group is not None else None)
    ablated = group.trials[_ablated(group.trials)] if group is not None else pd.DataFrame()
    full = group.trials[full_cache(group.trials)] if group is not None else pd.DataFrame()
    if group is None or ablated.empty or full.empty:
        return missing(
            f"the full cache and {FIRST_TOKEN_ABLATION} (the first token removed) on a quality task",
            evidence.db,
            command,
        )
    increase = perplexity(ablated) / perplexity(full) - 1
    scored = int(ablated["scored_tokens"].min())
    figure = (
        f"perplexity {perplexity(ablated):.2f} with the first token removed against {perplexity(full):.2f} with the "
        f"full cache: {increase:+.0%} over {scored:,} scored tokens per text (mean KL divergence from the full "
        f"cache {ablated['kl'].mean():.3f} nats)"
    )
    if scored < CLAIMED_TOKENS:
        return unmeasurable(
            f"the stored texts score {scored:,} tokens, fewer than the claim's {CLAIMED_TOKENS:,}; run: {command}",
            figure=figure,
            model=group.model,
            device=group.device,
            command=command,
        )
    held = increase >= CLAIMED_INCREASE or about(increase, CLAIMED_INCREASE)
    return Evaluation(HOLDS if held else FAILS, figure=figure, model=group.model, device=group.device, command=command)
