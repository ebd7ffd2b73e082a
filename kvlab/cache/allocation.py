"""Per-layer budgets at the same total: how ``budget x layers`` tokens are spread over a model's layers.

Every allocation here gives each layer the policy's ``minimum`` (what it cannot work without: its sinks, its
observation window) and splits the rest of the total in proportion to per-layer weights, through the one rule
PyramidKV uses too (:func:`kvlab.budget.split_budget`): whole tokens per KV head that sum exactly to
``budget x layers``, none above what a context of ``capacity`` tokens holds (what a layer cannot hold is handed to
the others in proportion to their shares). Splitting only what lies beyond the minimum follows PyramidKV's and
CAKE's reference code, which both split what lies beyond the observation window and give every layer its window.

* ``uniform``: equal weights, so every layer keeps the budget;
* ``preset``: the articles' preset, 40% to the first layers, 10% to the last, the rest to the middle
  (:func:`preset_weights`);
* ``entropy``: weights of a layer's mean attention entropy measured once on a held-out text
  (:mod:`kvlab.models.profiles`): a layer whose attention is spread over many tokens needs more of them;
* ``cake``: CAKE's per-prompt layer preferences, from the observation window's attention at compression time
  (:func:`kvlab.cache.cake.cake_preference`, :func:`cake_budgets`).

Pure functions of numbers, without torch, so that the dashboard and the cache spec draw and check an allocation
without loading a model.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from kvlab.budget import split_budget
from kvlab.errors import KvlabError

#: The articles' preset: the share of what lies beyond the minimum that goes to the first, middle and last layers.
PRESET_SHARES: tuple[float, float, float] = (0.4, 0.5, 0.1)
#: The preset names 10 first and 10 last layers of a 32-layer model; other depths scale that ratio.
PRESET_EDGE_LAYERS = 10
PRESET_REFERENCE_DEPTH = 32

#: CAKE's temperatures when its reference code has no tuned value for a model (``pred_cake.py``'s fallback).
CAKE_TAU1 = 1.0
CAKE_TAU2 = 1.0
#: CAKE's observation window in its reference code (``--window_size``).
CAKE_WINDOW = 32


def allocate(weights: Sequence[float], budget: int, minimum: int = 1, capacity: int | None = None) -> list[int]:
    """Budgets of ``len(weights)`` layers that sum to ``budget x layers``: each layer ``minimum`` tokens plus its
    weight's share of the rest, capped at ``capacity`` (the context length, when given).

    A context no longer than the budget is never compressed, so every layer then keeps the budget, as a uniform
    allocation does. Weights that are all zero (a layer preference no prompt could produce) count as equal.
    """
    num_layers = len(weights)
    if num_layers == 0:
        raise ValueError("an allocation needs at least one layer")
    if minimum > budget:
        raise KvlabError(
            f"A budget of {budget} tokens per layer cannot give each of {num_layers} layers the policy's minimum of "
            f"{minimum} tokens."
        )
    if capacity is not None and capacity <= budget:
        return [budget] * num_layers
    if any(not math.isfinite(weight) or weight < 0 for weight in weights):
        raise ValueError(f"layer weights must be finite and not negative, not {list(weights)}")
    weight_sum = math.fsum(weights)
    shares = list(weights) if weight_sum > 0 else [1.0] * num_layers
    total_weight = weight_sum if weight_sum > 0 else float(num_layers)
    spare = (budget - minimum) * num_layers
    return split_budget([spare * weight / total_weight for weight in shares], minimum, budget * num_layers, capacity)


def uniform_budgets(budget: int, num_layers: int, minimum: int = 1, capacity: int | None = None) -> list[int]:
    """Every layer the same budget."""
    return allocate([1.0] * num_layers, budget, minimum, capacity)


def preset_groups(num_layers: int) -> tuple[int, int, int]:
    """How many layers form the first, middle and last group of the preset: 10 of 32 scaled to the model's depth
    (``round(10/32 x depth)``, halves rounded up) for the first and the last, at least one each, and at least one
    middle layer from three layers on: three layers are one of each, two layers a first and a last, one layer all
    first."""
    if num_layers < 1:
        raise ValueError("a model has at least one layer")
    if num_layers <= 2:
        return (1, 0, num_layers - 1)
    edge = max(1, math.floor(PRESET_EDGE_LAYERS / PRESET_REFERENCE_DEPTH * num_layers + 0.5))
    edge = min(edge, (num_layers - 1) // 2)
    return (edge, num_layers - 2 * edge, edge)


def preset_weights(num_layers: int) -> list[float]:
    """Each layer's share of the preset: 40% to the first group, 50% to the middle one, 10% to the last, equal
    within a group (:func:`preset_groups`). A group without layers gives its share to the others in proportion to
    theirs: two layers split 80/20, one layer takes everything."""
    groups = preset_groups(num_layers)
    present = sum(share for share, size in zip(PRESET_SHARES, groups) if size)
    return [share / present / size for share, size in zip(PRESET_SHARES, groups) for _ in range(size)]


def preset_budgets(budget: int, num_layers: int, minimum: int = 1, capacity: int | None = None) -> list[int]:
    """The articles' preset: 40% of the total to the first 10 of 32 layers, 10% to the last 10, the rest to the
    middle, scaled to the model's depth (of what lies beyond the minimum every layer keeps)."""
    return allocate(preset_weights(num_layers), budget, minimum, capacity)


def entropy_budgets(
    layer_entropy: Sequence[float], budget: int, num_layers: int, minimum: int = 1, capacity: int | None = None
) -> list[int]:
    """Budgets in proportion to each layer's mean attention entropy (nats) from a model's stored profile
    (:class:`kvlab.engine.profile.Profile`): dispersed attention needs more tokens to keep what it reads."""
    if len(layer_entropy) != num_layers:
        raise KvlabError(
            f"The attention profile has {len(layer_entropy)} layers but the model has {num_layers}; measure it again "
            "with kvlab profile."
        )
    return allocate(layer_entropy, budget, minimum, capacity)


def layer_preference(dispersion: float, shift: float, tau1: float = CAKE_TAU1, tau2: float = CAKE_TAU2) -> float:
    """CAKE's layer preference ``P = H^(1/tau1) x V^(1/tau2)`` from a layer's dispersion and shift."""
    if not (tau1 > 0 and tau2 > 0):
        raise KvlabError(f"CAKE's temperatures must be more than 0, not tau1={tau1} and tau2={tau2}.")
    return dispersion ** (1 / tau1) * shift ** (1 / tau2)


def cake_budgets(preferences: Sequence[float], budget: int, minimum: int = 1, capacity: int | None = None) -> list[int]:
    """CAKE's layer budgets: what lies beyond the minimum in proportion to each layer's preference
    (:func:`cake_preference`), recomputed for every prompt at prefill mode's compression.

    The reference code (``CakeprefillKVCache``) splits ``(cache_size - window) x layers`` by preference and gives
    every layer its window; kvlab splits what lies beyond the policy's minimum (the window plus one for SnapKV).
    Differs: where a layer's share exceeds the context, the reference spreads the excess and its rounding remainder
    evenly over the other layers; kvlab hands it on in proportion to their shares and rounds by largest remainder
    (:func:`kvlab.budget.split_budget`), as for every allocation. Preferences are computed for all layers after the
    whole prompt is read and every layer is compressed at once, as the reference does without cascading; only the
    layer allocation is CAKE's, the tokens each layer keeps are chosen by the policy's own scores (CAKE's eviction
    indicator, the mean plus ``gamma`` times the variance of the window's attention, is not part of it).
    """
    return allocate(preferences, budget, minimum, capacity)
