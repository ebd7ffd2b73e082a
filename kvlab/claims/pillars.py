"""Claim 13, measured: "removing heavy-hitter pillars raises attention entropy and lowers retrieval accuracy".

The ablation (:class:`kvlab.policies.drop_pillars.DropPillars`) removes, at prefill mode's compression, the tokens
with the most accumulated attention in every layer and KV head, sparing the first few (the sink ablation is claim
20's), and keeps everything else. Accuracy comes from needle runs at 4,096 tokens whose question is read after the
compression (so the question's own attention does not make the needle a heavy hitter), against the full cache's;
entropy from ``bench/pillar_entropy.py``: the attention entropy of the question's queries over the same prompts,
with the full cache and with the pillars removed.
"""

from __future__ import annotations

import pandas as pd

from kvlab.claims.commands import PILLAR_COUNTS, heap_sweep, pillar_entropy
from kvlab.claims.evidence import Evidence, PillarEntropy, model_name
from kvlab.claims.needle import CLAIM_CONTEXT, FULL_CACHE, cell_of, full_cache_cell, scored
from kvlab.claims.needle_claims import NEEDLE_TASK, cell_text
from kvlab.claims.options import params_of
from kvlab.claims.verdicts import Evaluation, judged, missing, per_model

#: The heavy-hitter ablation (:class:`kvlab.policies.drop_pillars.DropPillars`), named here so that reading a store
#: needs no torch.
ABLATION = "drop_pillars"


def ablation_sweep(db: str, model: str | None) -> str:
    """The needle runs of the ablation and of the full cache, the question read after compression."""
    policies = [FULL_CACHE, *(f"{ABLATION}[count={count}]" for count in PILLAR_COUNTS)]
    return heap_sweep(db, policies, model=model, query_agnostic=True)


def _entropy_facts(profile: PillarEntropy) -> tuple[list[tuple[str, bool]], list[str]]:
    """Parts and facts of one model's entropy ablation: each removal against the full cache's entropy."""
    full = next((row for row in profile.configurations if row.policy == FULL_CACHE), None)
    if full is None:
        return [], []
    parts, facts = [], [f"the question's attention entropy with the full cache {full.mean:.3f} nats"]
    for row in profile.configurations:
        if row.policy != ABLATION:
            continue
        higher = sum(ours > theirs for ours, theirs in zip(row.entropy, full.entropy))
        count = row.params.get("count")
        parts.append((f"removing {count} per KV head, in entropy", row.mean > full.mean))
        facts.append(
            f"removing {count}: {row.mean:.3f} nats (higher in {higher} of {len(row.entropy)} layers; "
            f"{profile.prompts} prompts)"
        )
    return parts, facts


def _accuracy_facts(trials: pd.DataFrame) -> tuple[list[tuple[str, bool]], list[str]]:
    """Parts and facts of one model's needle runs: each removal's accuracy against the full cache's."""
    if trials.empty:
        return [], []
    rows = scored(trials[trials["context_length"] == CLAIM_CONTEXT])
    full = full_cache_cell(rows)
    ablated = rows[rows["policy"] == ABLATION]
    if full is None or ablated.empty:
        return [], []
    parts, facts = [], [f"needle accuracy with the full cache {cell_text(full)}"]
    for params, group in ablated.groupby("policy_params"):
        cell = cell_of(group)
        count = params_of(params).get("count")
        parts.append((f"removing {count} per KV head, in accuracy", bool(cell["high"] < full["low"])))
        facts.append(f"removing {count}: {cell_text(cell)}")
    return parts, facts


def pillars_removed(evidence: Evidence) -> Evaluation:
    """Claim 13: with the pillars removed, entropy rises above the full cache's and accuracy falls below it (its
    95% interval above the ablation's), on each model that has both halves measured."""
    profiles, problems = evidence.pillar_entropies
    by_model = {model_name(profile.model): profile for profile in profiles}
    stored = {model_name(model): model for model in evidence.models}
    results, partial = [], []
    for model in sorted(set(by_model) | set(stored)):
        trials = evidence.of_model(stored[model]).needle_trials if model in stored else pd.DataFrame()
        profile = by_model.get(model)
        accuracy_parts, accuracy_facts = _accuracy_facts(trials)
        entropy_parts, entropy_facts = _entropy_facts(profile) if profile is not None else ([], [])
        if not (accuracy_parts and entropy_parts):  # half the claim is no verdict: say what there is
            partial += (
                [f"{model}: {'; '.join(accuracy_facts + entropy_facts)}"] if accuracy_facts + entropy_facts else []
            )
            continue
        parts = accuracy_parts + entropy_parts
        devices = sorted({str(device) for device in trials["device"].dropna().unique()} if not trials.empty else set())
        devices += [profile.device] if profile is not None and profile.device not in devices else []
        command = "; ".join(
            [ablation_sweep(evidence.db, model), profile.command if profile is not None else pillar_entropy(model)]
        )
        figure = "; ".join(accuracy_facts + entropy_facts) + (
            " (raises entropy: its mean over layers above the full cache's; lowers accuracy: the full cache's 95% "
            "interval above the ablation's)"
        )
        results.append((model, judged(parts, figure, model=model, device=", ".join(devices), command=command)))
    if not results:
        command = "; ".join((ablation_sweep(evidence.db, None), pillar_entropy()))
        where = f"{evidence.db} or {evidence.results_place('pillars')}"
        found = f" ({'; '.join(problems)})" if problems else ""
        shown = " · ".join(partial) or None
        return missing(f"{ABLATION} beside the full cache on {NEEDLE_TASK}{found}", where, command, shown)
    return per_model(results) if len(results) > 1 else results[0][1]
