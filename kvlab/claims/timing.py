"""Claim 34, measured: whether evicting costs more time than it saves under 4K tokens.

Eviction's benefit in time is reading fewer cached bytes per step; its overhead is scoring, compressing and moving
tokens. Both are in the engine's own seconds, so the claim holds for a policy that is no faster than the full cache
on the same prompt, model and device. The figure comes from the dedicated timing benchmark when its results are in
the repository (``bench/short_context_overhead.py``: the total of reading and decoding, medians of repeats after a
warm-up); without them, from the store's runs that decode every step (decode time only).
"""

from __future__ import annotations

import pandas as pd

from kvlab.claims.commands import overhead_benchmark, timing_overhead
from kvlab.claims.evidence import Evidence, Overhead, Timing, largest_group, model_name
from kvlab.claims.needle import budgeted, full_cache
from kvlab.claims.verdicts import Evaluation, judged, missing, unmeasurable


def decode_steps(trials: pd.DataFrame) -> pd.Series:
    """Decode steps behind each trial's ``decode_s`` where they are known: the run's ``max_new_tokens`` when it has
    no stop rule (every step decoded, as in a quality pass, whose steps are its scored tokens), else NaN: a run
    that stops at the end of an answer decodes a number of steps the store does not keep."""
    return trials["max_new_tokens"].where(trials["stop_rule"] == "none").astype(float)


def seconds_per_step(trials: pd.DataFrame) -> float:
    """Decode seconds per step, pooled over trials."""
    return float(trials["decode_s"].sum() / decode_steps(trials).sum())


def _compared(trials: pd.DataFrame) -> bool:
    """Whether a (model, device) has both the full cache and an evicting policy to compare."""
    return bool(full_cache(trials).any() and budgeted(trials).any())


def eviction_overhead(evidence: Evidence) -> Evaluation:
    """Claim 34: under 4K tokens, eviction's overhead often exceeds its benefit."""
    timed, problems = evidence.overheads
    if timed:
        return _benchmarked(timed)
    if problems:
        command = overhead_benchmark()
        return unmeasurable(f"{'; '.join(problems)}; run: {command}", command=command)
    return _from_runs(evidence)


def _benchmarked(timed: list[Overhead]) -> Evaluation:
    """The verdict from the timing benchmark's results: per policy (and model), the mean over context lengths of
    its total time against the full cache's."""
    parts, facts = [], []
    for result in timed:
        name = model_name(result.model)
        policies: dict[str, list[Timing]] = {}
        for timing in result.timings:
            policies.setdefault(timing.policy, []).append(timing)
        shown = []
        for policy, timings in policies.items():
            total = sum(t.total_vs_full for t in timings) / len(timings)
            decode = sum(t.decode_vs_full for t in timings) / len(timings)
            parts.append((f"for {policy} on {name}" if len(timed) > 1 else f"for {policy}", total >= 1.0))
            shown.append(f"{policy} {total:.2f}x (decoding {decode:.2f}x)")
        lengths = sorted({t.context for t in result.timings})
        facts.append(f"{name}, {result.mode} mode, {lengths[0]:,} to {lengths[-1]:,} tokens: " + ", ".join(shown))
    figure = (
        "time to read the prompt and decode against the full cache's: " + "; ".join(facts) + " (1x or more: "
        "eviction costs more than it saves)"
    )
    return judged(
        parts,
        figure,
        model=", ".join(model_name(result.model) for result in timed),
        device=", ".join(sorted({result.device for result in timed})),
        command="; ".join(result.command for result in timed),
    )


def _from_runs(evidence: Evidence) -> Evaluation:
    """The verdict from the store's runs that decode every step, when the benchmark has no results here."""
    trials = evidence.short_context_trials
    group = None
    if not trials.empty:
        trials = trials[(full_cache(trials) | budgeted(trials)) & decode_steps(trials).notna()]
        group = largest_group(trials, ["model", "device"], _compared)
    if group is None:
        command = overhead_benchmark()
        return unmeasurable(
            f"no short-context timing in {evidence.results_place('overhead')} and no runs of the full cache "
            f"and evicting policies at 1,024 to 4,096 tokens that decode every step in {evidence.db}; run: {command}",
            command=command,
        )
    command = timing_overhead(evidence.db, model=group.model)
    rows = group.trials
    full = {key: seconds_per_step(r) for key, r in rows[full_cache(rows)].groupby(["task", "context_length"])}
    parts, facts = [], []
    for (policy, mode), evicting in rows[budgeted(rows)].groupby(["policy", "mode"]):
        ratios = [
            seconds_per_step(r) / full[key] for key, r in evicting.groupby(["task", "context_length"]) if key in full
        ]
        if not ratios:
            continue
        ratio = sum(ratios) / len(ratios)
        parts.append((f"for {policy} in {mode} mode", ratio >= 1.0))
        facts.append(f"{policy} {mode} {ratio:.2f}x")
    if not parts:
        return missing("evicting policies on the full cache's texts and lengths", evidence.db, command)
    lengths = ", ".join(f"{int(length):,}" for length in sorted({length for _, length in full}))
    figure = (
        f"decode time per step against the full cache's ({1e3 * seconds_per_step(rows[full_cache(rows)]):.2f} ms) "
        f"on the same text at {lengths} tokens: " + "; ".join(facts) + " (above 1x: eviction costs more than it saves)"
    )
    return judged(parts, figure, model=group.model, device=group.device, command=command)
