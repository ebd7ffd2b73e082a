"""Claim 21, measured: "a three-tier generational cache cuts sorting overhead by 80%".

Sorting overhead is what an eviction spends ranking the cache: the slots it ranks, which every trial counts, and the
time the ranking takes (scoring and selection, timed on the device outside captured decode steps, so the runs decode
eagerly). The generational cache ranks only its middle tier at most evictions, where a layer's slots are in position
order with none free (the compact layout keeps them so); H2O ranks the whole cache at every one. Both run in
streaming mode on the same prompts and layout, so both evict as often; the cut is one minus the ratio of their
means. The needle accuracy each keeps is shown beside it: a cut that loses the needle is no saving.
"""

from __future__ import annotations

import pandas as pd

from kvlab.claims.commands import GENERATIONAL, GENERATIONAL_KEEP, GENERATIONAL_LAYOUT, heap_sweep
from kvlab.claims.evidence import Evidence, model_name
from kvlab.claims.needle import cell_of, scored, with_variants
from kvlab.claims.needle_claims import cell_text
from kvlab.claims.options import params_of
from kvlab.claims.units import percent
from kvlab.claims.verdicts import Evaluation, about, judged, missing
from kvlab.modes import STREAMING

CLAIMED_CUT = 0.8
"""Article 002: the generational cache "cuts sorting overhead by 80%"."""
GENERATIONAL_POLICY = "generational"
FULL_RANKING = "h2o"


def _ranked(evidence: Evidence) -> pd.DataFrame:
    """Streaming-mode trials of the generational cache and of H2O without cache options of their own that counted
    their ranking (stored from schema version 9 on), needles and text passes alike."""
    frames = [frame for frame in (evidence.needle_trials, evidence.quality_trials) if not frame.empty]
    if not frames:
        return pd.DataFrame()
    trials = with_variants(pd.concat(frames, ignore_index=True))
    return trials[
        trials["policy"].isin([GENERATIONAL_POLICY, FULL_RANKING])
        & (trials["variant"] == trials["policy"])
        & (trials["mode"] == STREAMING)
        & trials["ranked_slots"].notna()
        & trials["ranking_s"].notna()
    ]


def tiers_label(policy_params: str) -> str:
    """The generational cache's tiers in words: ``young 10%, middle 30%, old re-ranked every 64 tokens``."""
    params = params_of(policy_params)
    return (
        f"young {percent(float(params['young']))}, middle {percent(float(params['middle']))}, old re-ranked every "
        f"{int(params['major_every'])} tokens"
    )


def _setting(rows: pd.DataFrame) -> str:
    """What a group of trials read, and the heap's layout: ``needles at 20% kept (compact layout)``."""
    first = rows.iloc[0]
    budget = (
        f"{percent(float(first['keep']))} kept" if pd.notna(first["keep"]) else f"{int(first['budget_tokens'])} tokens"
    )
    read = "needles at" if first["task"] == "needle" else f"{str(first['task']).split(':', 1)[-1]} with"
    return f"{read} {budget} ({first['layout']} layout)"


def _per_step(rows: pd.DataFrame) -> str:
    """The mean ranking per decoded token where the steps are known (a pass that decodes every one), else per
    trial: slots and microseconds."""
    steps = rows["max_new_tokens"].astype(float) if (rows["stop_rule"] == "none").all() else None
    slots = rows["ranked_slots"].astype(float) / (steps if steps is not None else 1.0)
    seconds = rows["ranking_s"].astype(float) / (steps if steps is not None else 1.0)
    unit = "decoded token" if steps is not None else "trial"
    return f"{slots.mean():,.0f} slots (over layers and KV heads) and {1e6 * seconds.mean():,.0f} µs per {unit}"


def _change(ratio: float, fewer: str, more: str) -> str:
    """A ratio to H2O's in words: ``85% fewer`` or ``20% more``."""
    return f"{percent(1 - ratio)} {fewer}" if ratio <= 1 else f"{percent(ratio - 1)} {more}"


def _cut(ratio: float) -> bool:
    return 1 - ratio >= CLAIMED_CUT or about(1 - ratio, CLAIMED_CUT)


def sorting_overhead(evidence: Evidence) -> Evaluation:
    """Claim 21: the generational cache ranks 80% less than H2O's whole cache, in slots and in time."""
    trials = _ranked(evidence)
    model = model_name(str(trials["model"].iloc[0])) if not trials.empty else None
    command = heap_sweep(
        evidence.db,
        GENERATIONAL,
        (GENERATIONAL_KEEP,),
        model=model,
        mode=STREAMING,
        eager=True,
        layout=GENERATIONAL_LAYOUT,
    )
    parts, facts = [], []
    keys = ["model", "task", "keep", "budget_tokens", "context_length", "layout"]
    for _, rows in trials.groupby(keys, dropna=False) if not trials.empty else []:
        full = rows[rows["policy"] == FULL_RANKING]
        if full.empty:
            continue
        setting = _setting(rows)
        shown = [f"H2O {_per_step(full)}{_accuracy(full)}"]
        for params, generational in rows[rows["policy"] == GENERATIONAL_POLICY].groupby("policy_params"):
            slots = generational["ranked_slots"].astype(float).mean() / full["ranked_slots"].astype(float).mean()
            seconds = generational["ranking_s"].mean() / full["ranking_s"].mean()
            label = f"generational ({tiers_label(str(params))}) on {setting}"
            parts += [(f"{label}, in slots ranked", _cut(slots)), (f"{label}, in ranking time", _cut(seconds))]
            shown.append(
                f"generational ({tiers_label(str(params))}) {_per_step(generational)}{_accuracy(generational)}: "
                f"{_change(slots, 'fewer', 'more')} slots, {_change(seconds, 'less', 'more')} time"
            )
        if len(shown) > 1:
            facts.append(f"{setting}: " + "; ".join(shown))
    if not parts:
        return missing(
            "the generational cache and H2O in streaming mode with their ranking counted", evidence.db, command
        )
    devices = ", ".join(sorted(str(device) for device in trials["device"].dropna().unique()))
    figure = (
        " · ".join(facts) + f" (cut {percent(CLAIMED_CUT)}: one minus the ratio to H2O's, within 10% of the claim "
        "or more)"
    )
    return judged(parts, figure, model=model, device=devices or "unknown device", command=command)


def _accuracy(rows: pd.DataFrame) -> str:
    """``, needle 41% (32–51, 100 trials)`` for trials that answered a question, else nothing."""
    answered = scored(rows)
    return f", needle {cell_text(cell_of(answered))}" if not answered.empty else ""
