"""A configuration's score against the full cache's on one benchmark, the way the advisor judges a floor: a share of
right answers (needle accuracy, RULER's recall) over the full cache's share, or the full cache's perplexity over the
configuration's (so that 1 is as good as the full cache and lower is worse, for every benchmark alike).

Shares carry their 95 % interval (Wilson's, or the bootstrap for fractions) over the full cache's point value, and
McNemar's test pairs the two item by item (:func:`kvlab.runs.tables.paired_test`). Perplexity pairs the texts both
scored: the interval is the bootstrap interval of the mean per-text difference in negative log-likelihood, turned
into a ratio of perplexities; one text gives no interval. Pure functions of trial frames.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pandas as pd

from kvlab.runs.benchmarks import PERPLEXITY
from kvlab.runs.tables import SHARE_COLUMNS, by_item, paired_test, share_interval, trial_values
from kvlab.stats import pair_by_item, paired_difference_interval, pooled_perplexity


@dataclass(frozen=True)
class RelativeScore:
    """One configuration against the full cache: its own ``score`` (a share, or a perplexity), the ``relative``
    score with its 95 % interval (``low``, ``high``; NaN where there is none), the ``count`` of trials it rests on,
    and the paired comparison (``p_value`` as text, ``—`` where no test applies, and its ``reading``)."""

    score: float
    relative: float
    low: float
    high: float
    count: int
    p_value: str
    reading: str


def full_score(full_trials: pd.DataFrame, metric: str) -> tuple[float, int]:
    """The full cache's score on ``metric`` (its share, or its pooled perplexity) and the trials it rests on."""
    if metric == PERPLEXITY:
        scored = _scored(full_trials)
        if scored.empty:
            return math.nan, 0
        return pooled_perplexity(scored["nll"].tolist(), scored["scored_tokens"].astype(int).tolist()), len(scored)
    values = trial_values(full_trials, SHARE_COLUMNS[metric])
    return float(values.mean()), int(values.notna().sum())


def scored_count(trials: pd.DataFrame, metric: str) -> int:
    """How many of ``trials`` hold a value of ``metric``."""
    if metric == PERPLEXITY:
        return len(_scored(trials))
    return int(trial_values(trials, SHARE_COLUMNS[metric]).notna().sum())


def relative_score(config_trials: pd.DataFrame, full_trials: pd.DataFrame, full: float, metric: str) -> RelativeScore:
    """``config_trials`` against ``full_trials``, whose score (:func:`full_score`) is ``full``, on ``metric`` (see the
    module's description)."""
    if metric == PERPLEXITY:
        return _relative_perplexity(config_trials, full_trials, full)
    values = trial_values(config_trials, SHARE_COLUMNS[metric])
    score = float(values.mean())
    low, high = share_interval(values)
    paired = paired_test(full_trials, config_trials, "full cache", "configuration", metric)
    reading = str(paired["reading"]).replace("A right", "the full cache right").replace("B right", "this one right")
    return RelativeScore(
        score,
        _ratio(score, full),
        _ratio(low, full),
        _ratio(high, full),
        len(values.dropna()),
        str(paired["McNemar p"]),
        reading,
    )


def _relative_perplexity(config_trials: pd.DataFrame, full_trials: pd.DataFrame, full: float) -> RelativeScore:
    """The full cache's perplexity over the configuration's, with the interval of the paired texts."""
    scored = _scored(config_trials)
    perplexity = pooled_perplexity(scored["nll"].tolist(), scored["scored_tokens"].astype(int).tolist())
    full_nll, config_nll = pair_by_item(by_item(_scored(full_trials), "nll"), by_item(scored, "nll"))
    low = high = math.nan
    if len(full_nll) >= 2:
        _, below, above = paired_difference_interval(full_nll, config_nll)
        low, high = math.exp(-above), math.exp(-below)
        reading = f"{len(full_nll)} texts paired: perplexity {perplexity:.2f} against the full cache's {full:.2f}"
    else:
        reading = (
            f"{len(full_nll)} text{'s' if len(full_nll) != 1 else ''} paired, too few for an interval: perplexity "
            f"{perplexity:.2f} against the full cache's {full:.2f}"
        )
    return RelativeScore(perplexity, full / perplexity, low, high, len(scored), "—", reading)


def _scored(trials: pd.DataFrame) -> pd.DataFrame:
    """The trials that scored tokens (a perplexity's texts)."""
    if "nll" not in trials or "scored_tokens" not in trials:
        return trials.iloc[0:0]
    present = trials["nll"].notna() & trials["scored_tokens"].notna()
    return trials[present & (trials["scored_tokens"].astype(float) > 0)]


def _ratio(value: float, reference: float) -> float:
    """``value`` over ``reference``, NaN where the reference is not positive."""
    return value / reference if reference > 0 and np.isfinite(reference) else math.nan
