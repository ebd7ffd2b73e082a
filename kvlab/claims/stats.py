"""The statistics behind measured figures: intervals for accuracies and perplexity pooled over texts."""

from __future__ import annotations

import math

Z_95 = 1.959963984540054
"""The standard normal quantile of a two-sided 95 % interval."""


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


def pooled_perplexity(nll: list[float], scored_tokens: list[int]) -> float:
    """Perplexity of several scored texts together: ``exp`` of their mean negative log-likelihoods weighted by
    the tokens each scored, i.e. the perplexity of all their tokens as one sequence."""
    total = sum(scored_tokens)
    if total <= 0:
        raise ValueError("a perplexity needs at least one scored token")
    return math.exp(sum(value * tokens for value, tokens in zip(nll, scored_tokens)) / total)
