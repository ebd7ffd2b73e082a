"""CAKE's layer preferences measured from attention (Qin et al., ICLR 2025): the spatial dispersion and temporal shift
of an observation window's attention, which :func:`kvlab.cache.allocation.cake_budgets` turns into layer budgets."""

from __future__ import annotations

import torch

from kvlab.cache.allocation import CAKE_TAU1, CAKE_TAU2, layer_preference
from kvlab.errors import KvlabError


def cake_dispersion_and_shift(probs: torch.Tensor, keys: torch.Tensor | None = None) -> tuple[float, float]:
    """CAKE's two measures of one layer: spatial dispersion ``H`` (the entropy of the window's attention) and
    temporal shift ``V`` (how much a key's attention varies across the window's queries).

    ``probs`` is the window's attention as :func:`kvlab.attention.observe.window_probabilities` returns it, ``(batch,
    kv_heads, groups, window, span)``; ``keys`` (``(batch, kv_heads, span)``, booleans) marks the slots that count,
    the ones outside the window in CAKE's code (all slots when ``None``). As in CAKE's reference code (``H``:
    ``calculate_entropy`` over the window's rows restricted to the keys before the window, not renormalised; ``V``:
    ``torch.var`` over the window's queries, then summed), both are sums over sequences, query heads, queries and
    keys, so that they are comparable between layers of one model.
    """
    if probs.dim() != 5:
        raise ValueError(f"expected (batch, kv_heads, groups, window, span) probabilities, not {tuple(probs.shape)}")
    window = int(probs.shape[3])
    if window < 2:
        raise KvlabError(
            f"CAKE's temporal shift is a variance across the observation window's queries, which needs at least two "
            f"queries, not {window}."
        )
    if keys is not None:
        probs = probs * keys[:, :, None, None, :]
    dispersion = -probs.xlogy(probs).sum()
    shift = probs.var(dim=3).sum()
    return float(dispersion), float(shift)


def cake_preference(
    probs: torch.Tensor, tau1: float = CAKE_TAU1, tau2: float = CAKE_TAU2, keys: torch.Tensor | None = None
) -> float:
    """CAKE's preference of one layer for cache (Qin et al., "CAKE: Cascading and Adaptive KV Cache Eviction with
    Layer Preferences", ICLR 2025, openreview.net/forum?id=EQgEMAD4kv): ``P = H^(1/tau1) x V^(1/tau2)``, with
    ``H`` the spatial dispersion and ``V`` the temporal shift of the observation window's attention
    (:func:`cake_dispersion_and_shift`). Layers whose attention is spread wide and shifts from query to query need
    more cache.

    Follows the reference code (github.com/antgroup/cakekv, ``cake/model/modify_llama.py`` and ``cake/utils.py``
    at commit c4675ce): ``H`` and ``V`` as described there; ``tau1 = tau2 = 1`` unless given (its fallback; its tuned
    values per model and cache size, ``model2tau.json``, range from 0.4 to 2.3). Differs: the probabilities stay
    in float32 (the reference casts them to the model's dtype before measuring), and ``0 x log 0`` is taken as 0
    (the reference adds 1e-10 inside the logarithm).
    """
    dispersion, shift = cake_dispersion_and_shift(probs, keys)
    return layer_preference(dispersion, shift, tau1, tau2)
