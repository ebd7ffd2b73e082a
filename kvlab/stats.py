"""The statistics behind measured figures: intervals for accuracies (Wilson's for right-or-wrong answers, the
percentile bootstrap for fractions), McNemar's paired test of two policies on the same items, and perplexity pooled
over texts."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

Z_95 = 1.959963984540054
"""The standard normal quantile of a two-sided 95 % interval."""
_BOOTSTRAP_BLOCK = 1 << 21
"""Values drawn per block of bootstrap resamples (16 MiB of float64 indices and values each)."""


def wilson_interval(successes: int, trials: int, z: float = Z_95) -> tuple[float, float]:
    """The Wilson score interval of a proportion (95 % by default), as fractions.

    Chosen over the normal approximation because needle accuracies sit at 0 % and 100 % as often as in between,
    where ``p ± z·sqrt(p(1-p)/n)`` collapses to a point; Wilson's interval stays honest there (1 of 1 correct is
    21 % to 100 %, not 100 % to 100 %).
    """
    if trials <= 0:
        raise ValueError("an interval needs at least one trial")
    if not 0 <= successes <= trials:
        raise ValueError("successes must be between 0 and the number of trials")
    p = successes / trials
    denominator = 1 + z * z / trials
    centre = (p + z * z / (2 * trials)) / denominator
    half = z * math.sqrt(p * (1 - p) / trials + z * z / (4 * trials * trials)) / denominator
    return max(0.0, centre - half), min(1.0, centre + half)


def bootstrap_interval(
    values: Sequence[float] | np.ndarray,
    *,
    statistic: Callable[..., Any] = np.mean,
    resamples: int = 2000,
    seed: int = 0,
    level: float = 0.95,
) -> tuple[float, float]:
    """The percentile bootstrap interval of ``statistic`` over ``values`` (95 % by default): the statistic of
    ``resamples`` samples drawn with replacement, cut at its ``(1 - level) / 2`` and ``(1 + level) / 2`` quantiles.

    For means of fractions (RULER's recall of several expected strings per item), where no closed form like
    Wilson's fits. Seeded, so that a table drawn twice shows the same interval. ``statistic`` is a numpy reduction
    that takes ``axis`` (``np.mean``, ``np.median``); the samples are drawn in blocks so that memory stays bounded.
    """
    data = np.asarray(values, dtype=float)
    if data.ndim != 1 or data.size == 0:
        raise ValueError("a bootstrap needs a one-dimensional sequence of at least one value")
    if not 0 < level < 1:
        raise ValueError("the level must lie strictly between 0 and 1")
    if resamples < 1:
        raise ValueError("a bootstrap needs at least one resample")
    rng = np.random.default_rng(seed)
    block = max(1, _BOOTSTRAP_BLOCK // data.size)
    estimates = np.concatenate(
        [
            statistic(data[rng.integers(0, data.size, size=(min(block, resamples - start), data.size))], axis=1)
            for start in range(0, resamples, block)
        ]
    )
    low, high = np.quantile(estimates, [(1 - level) / 2, (1 + level) / 2])
    return float(low), float(high)


def mean_interval(values: Sequence[float] | np.ndarray, **bootstrap: Any) -> tuple[float, float]:
    """The 95 % interval of a mean share: Wilson's when every value is 0 or 1 (right or wrong: a proportion, whose
    interval has a closed form that stays honest at 0 % and 100 %), the percentile bootstrap otherwise (fractions
    such as RULER's recall). ``bootstrap`` passes on to :func:`bootstrap_interval`."""
    data = np.asarray(values, dtype=float)
    if np.isin(data, (0.0, 1.0)).all():
        return wilson_interval(int(data.sum()), int(data.size))
    return bootstrap_interval(data, **bootstrap)


@dataclass(frozen=True)
class McNemar:
    """McNemar's paired test of two policies answering the same items: ``b01`` items only B answered right (A
    wrong), ``b10`` items only A answered right, out of ``pairs`` paired items; ``p_value`` two-sided, from the
    ``method`` named: ``exact`` (binomial) below :data:`EXACT_BELOW` discordant pairs, else ``chi-square``
    (one degree of freedom, continuity-corrected)."""

    pairs: int
    b01: int
    b10: int
    p_value: float
    method: str

    @property
    def discordant(self) -> int:
        """Items on which the two disagree: the only ones the test reads."""
        return self.b01 + self.b10


EXACT_BELOW = 25
"""Discordant pairs below which McNemar's p-value is the exact binomial one: the chi-square approximation is poor
for few pairs, and the exact sum is cheap there."""
MIN_PAIRED_ITEMS = 10
"""The fewest items two policies must both have answered for their paired test to be shown: below it a p-value
says nothing a reader could act on, and the two are reported as not comparable."""


def pair_by_item(a: pd.Series, b: pd.Series) -> tuple[np.ndarray, np.ndarray]:
    """Two policies' values (outcomes or fractions) indexed by the item each answered (its prompt's hash), paired on
    the items both answered. Items without a hash or a value are left out. An item one side answered more than once
    (runs of one setting pooled into one cell) counts when its answers agree, as replicates of greedy decoding do,
    and is left out when they differ: which of them would be paired is not defined."""

    def once(values: pd.Series) -> pd.Series:
        known = values[values.index.notna() & values.notna().to_numpy()].astype(float)
        by_item = known.groupby(level=0, sort=False)
        agreed = by_item.nunique() == 1
        return by_item.first()[agreed]

    joined = pd.concat([once(a), once(b)], axis=1, join="inner")
    return joined.iloc[:, 0].to_numpy(), joined.iloc[:, 1].to_numpy()


def mcnemar(a_correct: Sequence[bool] | np.ndarray, b_correct: Sequence[bool] | np.ndarray) -> McNemar:
    """McNemar's test on paired outcomes (``a_correct[i]`` and ``b_correct[i]`` answer the same item ``i``).

    Only the items where the two disagree count: under the hypothesis that neither is better, each such item is
    a fair coin between "only A right" and "only B right". With fewer than :data:`EXACT_BELOW` of them the p-value
    is the exact two-sided binomial one, ``min(1, 2 P(X <= min(b01, b10)))`` for ``X ~ Bin(b01 + b10, 1/2)``;
    otherwise ``(|b01 - b10| - 1)^2 / (b01 + b10)`` against a chi-square of one degree of freedom. No disagreement
    at all gives ``p = 1``.
    """
    a = np.asarray(a_correct, dtype=bool)
    b = np.asarray(b_correct, dtype=bool)
    if a.shape != b.shape or a.ndim != 1:
        raise ValueError("paired outcomes must be two sequences of the same length")
    b01, b10 = int((~a & b).sum()), int((a & ~b).sum())
    discordant = b01 + b10
    if discordant < EXACT_BELOW:
        tail = sum(math.comb(discordant, i) for i in range(min(b01, b10) + 1)) / 2**discordant
        return McNemar(int(a.size), b01, b10, min(1.0, 2 * tail), "exact")
    chi_square = (abs(b01 - b10) - 1) ** 2 / discordant
    return McNemar(int(a.size), b01, b10, math.erfc(math.sqrt(chi_square / 2)), "chi-square")


def paired_difference_interval(
    a_values: Sequence[float] | np.ndarray, b_values: Sequence[float] | np.ndarray, **bootstrap: Any
) -> tuple[float, float, float]:
    """The mean difference ``b - a`` over paired items and its percentile bootstrap interval (items resampled
    as pairs, so the interval is narrower than two separate intervals suggest when A and B fail the same items).
    Values are outcomes (0 or 1) or fractions; ``bootstrap`` passes on to :func:`bootstrap_interval`."""
    a = np.asarray(a_values, dtype=float)
    b = np.asarray(b_values, dtype=float)
    if a.shape != b.shape:
        raise ValueError("paired values must be two sequences of the same length")
    differences = b - a
    low, high = bootstrap_interval(differences, **bootstrap)
    return float(differences.mean()), low, high


def pooled_perplexity(nll: list[float], scored_tokens: list[int]) -> float:
    """Perplexity of several scored texts together: ``exp`` of their mean negative log-likelihoods weighted by
    the tokens each scored, i.e. the perplexity of all their tokens as one sequence."""
    total = sum(scored_tokens)
    if total <= 0:
        raise ValueError("a perplexity needs at least one scored token")
    return math.exp(sum(value * tokens for value, tokens in zip(nll, scored_tokens)) / total)
