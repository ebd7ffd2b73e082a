"""The statistics behind every shown accuracy: Wilson and bootstrap intervals, McNemar's paired test and pairing by
item, against values published or derived by hand."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from kvlab.stats import (
    EXACT_BELOW,
    bootstrap_interval,
    mcnemar,
    mean_interval,
    pair_by_item,
    paired_difference_interval,
    wilson_interval,
)


def outcomes(both: int, only_a: int, only_b: int, neither: int) -> tuple[list[bool], list[bool]]:
    """Paired outcomes with the four cells of McNemar's 2x2 table."""
    a = [True] * both + [True] * only_a + [False] * only_b + [False] * neither
    b = [True] * both + [False] * only_a + [True] * only_b + [False] * neither
    return a, b


def test_wilson_intervals_of_known_cases():
    assert wilson_interval(1, 1) == pytest.approx((0.2065, 1.0), abs=1e-4)  # one right answer is not 100 % certain
    assert wilson_interval(50, 100) == pytest.approx((0.4038, 0.5962), abs=1e-4)
    assert wilson_interval(0, 1) == pytest.approx((0.0, 0.7935), abs=1e-4)


def test_mcnemar_matches_the_textbook_chi_square_examples():
    # Wikipedia's example (a=101, b=121, c=59, d=33): continuity-corrected chi-square 20.67, p = 5.45e-6
    result = mcnemar(*outcomes(101, 121, 59, 33))
    assert (result.pairs, result.b10, result.b01, result.method) == (314, 121, 59, "chi-square")
    assert result.p_value == pytest.approx(5.450e-6, rel=1e-3)
    # Agresti's presidential approval (794, 150, 86, 570): corrected chi-square 16.82, p = 4.11e-5
    assert mcnemar(*outcomes(794, 150, 86, 570)).p_value == pytest.approx(4.115e-5, rel=1e-3)


def test_mcnemar_is_exact_below_25_discordant_pairs():
    result = mcnemar(*outcomes(30, 10, 2, 5))  # R: binom.test(2, 12)$p.value = 0.03857
    assert (result.method, result.discordant) == ("exact", 12)
    assert result.p_value == pytest.approx(0.0385742, abs=1e-6)
    assert mcnemar(*outcomes(3, 5, 0, 0)).p_value == pytest.approx(0.0625)  # 2 * (1/2)^5
    assert mcnemar(*outcomes(10, 0, 0, 10)).p_value == 1.0  # no disagreement: no evidence either way
    assert mcnemar(*outcomes(0, 3, 3, 0)).p_value == 1.0  # a two-sided p never exceeds 1
    assert mcnemar(*outcomes(0, EXACT_BELOW - 1, 0, 0)).method == "exact"
    assert mcnemar(*outcomes(0, EXACT_BELOW, 0, 0)).method == "chi-square"
    swapped = mcnemar(*outcomes(30, 2, 10, 5))
    assert (swapped.b01, swapped.b10, swapped.p_value) == (10, 2, result.p_value)
    with pytest.raises(ValueError):
        mcnemar([True, False], [True])


def test_bootstrap_is_reproducible_by_seed_and_covers_the_mean():
    values = np.random.default_rng(1).uniform(size=40)
    interval = bootstrap_interval(values)
    assert interval == bootstrap_interval(values, seed=0) and interval != bootstrap_interval(values, seed=1)
    assert interval[0] < values.mean() < interval[1]
    assert bootstrap_interval(np.tile(values, 4))[1] - bootstrap_interval(np.tile(values, 4))[0] < (
        interval[1] - interval[0]
    )  # four times the items: about half the width
    assert bootstrap_interval([0.25, 0.25, 0.25]) == (0.25, 0.25)
    low, high = bootstrap_interval(values, statistic=np.median, level=0.5)
    assert low < np.median(values) < high
    with pytest.raises(ValueError):
        bootstrap_interval([])


def test_bootstrap_intervals_cover_the_true_mean_about_95_times_in_100():
    truth = 0.6  # fractions in [0, 1] with mean 0.6, like recalls of several strings per item
    draws = np.random.default_rng(7).beta(3, 2, size=(200, 60))
    covered = [low <= truth <= high for low, high in (bootstrap_interval(row, resamples=500) for row in draws)]
    assert 0.88 <= np.mean(covered) <= 0.99


def test_a_mean_of_right_and_wrong_answers_gets_wilson_and_fractions_the_bootstrap():
    assert mean_interval([1, 1, 0, 1]) == wilson_interval(3, 4)
    recalls = [1.0, 0.5, 0.75, 1.0, 0.25]
    assert mean_interval(recalls) == bootstrap_interval(recalls)


def test_paired_difference_resamples_items_as_pairs():
    a, b = outcomes(40, 2, 12, 6)
    difference, low, high = paired_difference_interval(np.array(a, float), np.array(b, float))
    assert difference == pytest.approx(10 / 60)
    assert 0 < low < difference < high
    assert paired_difference_interval([1.0, 0.0], [1.0, 0.0]) == (0.0, 0.0, 0.0)


def test_items_pair_by_hash_once_each():
    a = pd.Series([1.0, 0.0, 1.0, 0.0, 1.0, 1.0, 0.0, math.nan], index=[*"xyzzuu", None, "w"], dtype=float)
    b = pd.Series([0.0, 1.0, 1.0, 1.0, 0.0], index=[*"yxzvu"], dtype=float)
    a_values, b_values = pair_by_item(a, b)
    # z's two answers differ (which would count?), u's agree; the unhashed and the unanswered items never pair
    assert a_values.tolist() == [1.0, 0.0, 1.0] and b_values.tolist() == [1.0, 0.0, 0.0]
