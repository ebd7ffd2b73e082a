"""Layer allocations at the same total: exact sums and bounds, the articles' preset, entropy and CAKE, and
PyramidKV's budgets through the shared surplus rule."""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvlab.budget import PYRAMID_BETA, pyramid_shares, split_budget
from kvlab.cache.allocation import (
    allocate,
    cake_budgets,
    entropy_budgets,
    preset_budgets,
    preset_groups,
    preset_weights,
    uniform_budgets,
)
from kvlab.cache.cake import cake_dispersion_and_shift, cake_preference
from kvlab.errors import KvlabError
from kvlab.policies.snapkv import PyramidKV


@st.composite
def allocation_cases(draw):
    layers = draw(st.integers(1, 40))
    minimum = draw(st.integers(1, 40))
    budget = draw(st.integers(minimum, 600))
    capacity = draw(st.none() | st.integers(1, 800))
    weights = draw(st.lists(st.floats(0, 50, allow_nan=False), min_size=layers, max_size=layers))
    return weights, budget, minimum, capacity


@given(allocation_cases())
def test_every_allocation_sums_to_the_uniform_total_within_its_bounds(case):
    weights, budget, minimum, capacity = case
    layers = len(weights)
    for budgets in (
        allocate(weights, budget, minimum, capacity),
        uniform_budgets(budget, layers, minimum, capacity),
        preset_budgets(budget, layers, minimum, capacity),
        entropy_budgets(weights, budget, layers, minimum, capacity),
        cake_budgets(weights, budget, minimum, capacity),
    ):
        assert len(budgets) == layers
        assert sum(budgets) == budget * layers
        assert all(isinstance(tokens, int) and tokens >= minimum for tokens in budgets)
        if capacity is not None and capacity <= budget:
            assert budgets == [budget] * layers  # nothing is compressed: what uniform gives
        elif capacity is not None:
            assert max(budgets) <= capacity


def test_uniform_keeps_the_budget_in_every_layer():
    assert uniform_budgets(100, 7, minimum=33, capacity=4096) == [100] * 7


def test_a_minimum_above_the_budget_is_one_sentence():
    with pytest.raises(KvlabError, match=r"^A budget of 10 tokens per layer cannot give each of 4 layers .*\.$"):
        allocate([1.0] * 4, 10, minimum=11)


def test_what_a_full_layer_cannot_hold_goes_to_the_others_in_proportion():
    # shares of the 399 spare tokens: 319.2, 39.9, 39.9; the first is capped at 200 - 1, the 120.2 over go 1:1 on
    assert allocate([8.0, 1.0, 1.0], 134, minimum=1, capacity=200) == [200, 101, 101]


def test_preset_gives_40_and_10_percent_on_32_layers():
    assert preset_groups(32) == (10, 12, 10)
    budget, minimum = 1000, 1
    budgets = preset_budgets(budget, 32, minimum)
    spare = (budget - minimum) * 32
    first, middle, last = budgets[:10], budgets[10:22], budgets[22:]
    assert abs(sum(first) - 10 * minimum - 0.4 * spare) < 10  # at most one token of rounding per layer
    assert abs(sum(last) - 10 * minimum - 0.1 * spare) < 10
    assert sum(first) / sum(budgets) == pytest.approx(0.4, abs=1e-3)
    assert sum(last) / sum(budgets) == pytest.approx(0.1, abs=1e-3)
    assert max(first) - min(first) <= 1 and max(middle) - min(middle) <= 1 and max(last) - min(last) <= 1


def test_preset_scales_to_the_depth():
    assert [preset_groups(depth) for depth in (1, 2, 3, 4, 10, 12, 30)] == [
        (1, 0, 0),
        (1, 0, 1),
        (1, 1, 1),
        (1, 2, 1),
        (3, 4, 3),
        (4, 4, 4),
        (9, 12, 9),
    ]
    assert preset_weights(2) == pytest.approx([0.8, 0.2])  # no middle layer: 40:10 between the two
    assert preset_budgets(100, 2) == [159, 41]
    assert preset_budgets(100, 1) == [100]
    twelve = preset_budgets(100, 12, minimum=8)
    assert sum(twelve[:4]) - 32 == pytest.approx(0.4 * 92 * 12, abs=4)
    assert sum(twelve[8:]) - 32 == pytest.approx(0.1 * 92 * 12, abs=4)
    assert max(twelve[8:]) < min(twelve[:4]) < min(twelve[4:8])  # 10% over 4 layers, 40% over 4, 50% over 4


def test_entropy_follows_the_profile():
    assert entropy_budgets([1.0, 2.0, 3.0, 4.0], 101, 4, minimum=1) == [41, 81, 121, 161]
    assert entropy_budgets([0.5, 0.5, 0.5], 64, 3, minimum=33) == [64, 64, 64]
    with pytest.raises(KvlabError, match="has 3 layers but the model has 4"):
        entropy_budgets([1.0, 2.0, 3.0], 100, 4)


def _direct_dispersion_and_shift(probs, keys):
    """CAKE's H and V element by element, as its reference code defines them."""
    batch, kv_heads, groups, window, span = probs.shape
    dispersion = shift = 0.0
    for b in range(batch):
        for h in range(kv_heads):
            for g in range(groups):
                for k in range(span):
                    column = [float(probs[b, h, g, q, k]) if keys[b, h, k] else 0.0 for q in range(window)]
                    dispersion -= sum(p * math.log(p) for p in column if p > 0)
                    mean = sum(column) / window
                    shift += sum((p - mean) ** 2 for p in column) / (window - 1)
    return dispersion, shift


def test_cake_preference_is_its_definition():
    generator = torch.Generator().manual_seed(3)
    probs = torch.softmax(torch.randn(2, 2, 3, 4, 9, generator=generator), dim=-1)
    probs[..., -1] = 0.0  # a slot no query may see
    keys = torch.ones(2, 2, 9, dtype=torch.bool)
    keys[:, :, 5:] = False  # the window's own keys
    dispersion, shift = _direct_dispersion_and_shift(probs, keys)
    assert cake_dispersion_and_shift(probs, keys) == pytest.approx((dispersion, shift), rel=1e-5)
    assert cake_preference(probs, tau1=0.5, tau2=2.0, keys=keys) == pytest.approx(dispersion**2 * shift**0.5, rel=1e-5)
    all_keys = torch.ones(2, 2, 9, dtype=torch.bool)
    assert cake_preference(probs) == pytest.approx(math.prod(_direct_dispersion_and_shift(probs, all_keys)), rel=1e-5)


def test_cake_gives_a_dispersed_layer_more_than_a_focused_one():
    generator = torch.Generator().manual_seed(5)
    window, span = 8, 64
    dispersed = torch.rand((1, 2, 2, window, span), generator=generator)
    dispersed /= dispersed.sum(-1, keepdim=True)
    focused = torch.full((1, 2, 2, window, span), 0.01 / (span - 1))
    focused[..., 0] = 0.99  # every query on one sink-like token
    focused += torch.rand(focused.shape, generator=generator) * 1e-4
    focused /= focused.sum(-1, keepdim=True)
    preferences = [cake_preference(dispersed), cake_preference(focused)]
    budgets = cake_budgets(preferences, 100, minimum=10)
    assert budgets[0] > 100 > budgets[1] >= 10
    assert sum(budgets) == 200


def test_cake_needs_two_queries_in_its_window():
    with pytest.raises(KvlabError, match="at least two queries, not 1"):
        cake_preference(torch.full((1, 1, 1, 1, 4), 0.25))
    with pytest.raises(KvlabError, match="must be more than 0"):
        cake_preference(torch.full((1, 1, 1, 2, 4), 0.25), tau1=0.0)


@given(
    layers=st.integers(2, 40),
    window=st.integers(1, 64),
    extra=st.integers(1, 5000),
    beta=st.integers(1, 40),
    capacity=st.none() | st.integers(1, 6000),
)
def test_pyramid_budgets_are_the_shared_rule_over_its_shares(layers, window, extra, beta, capacity):
    budget = window + extra
    shares = pyramid_shares(budget - window, beta, layers)
    expected = split_budget(shares, window, budget * layers, capacity)
    assert PyramidKV(window=window, beta=beta).layer_budgets(budget, layers, capacity) == expected


def test_pyramid_budgets_are_unchanged():
    assert PyramidKV(window=8).layer_budgets(40, 4) == [70, 50, 30, 10]
    assert PyramidKV(window=4, beta=3).layer_budgets(50, 5, capacity=60) == [60, 60, 60, 45, 25]
    assert PyramidKV(beta=PYRAMID_BETA).layer_budgets(3687, 10, capacity=4096) == [4096] * 8 + [3421, 681]


def test_what_a_full_layer_cannot_hold_goes_evenly_to_layers_that_wanted_nothing():
    # 3 spare tokens all wanted by the last layer, which holds at most 2 of them: the one over is split 1:1
    assert sorted(allocate([0.0, 0.0, 1.0], 2, minimum=1, capacity=3)[:2]) == [1, 2]
    assert allocate([0.0, 0.0, 1.0], 2, minimum=1, capacity=3)[2] == 3
