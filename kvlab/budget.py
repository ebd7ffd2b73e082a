"""The one budget meaning shared by every policy.

A budget is the number of tokens each layer's cache holds per KV head after eviction, sinks and windows included; or
a kept fraction of the context, turned into tokens as ``ceil(keep * context_tokens)``. Frontiers compare like with
like only because every policy obeys the same meaning. A sparse reader (Quest, RocketKV, :mod:`kvlab.cache.sparse`)
holds more than it reads: its budget counts the same tokens per layer and KV head, read for each decoded token.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from kvlab.errors import KvlabError

KEEP_DECIMALS = 9


#: The largest budget in tokens: far beyond any model's positions, far below what the run store's integers hold.
MOST_TOKENS = 1 << 40


def kept_tokens(tokens: int, keep_fraction: float = 1.0) -> int:
    """Tokens kept per layer out of ``tokens`` at a kept fraction: ``ceil(keep_fraction x tokens)``.

    The product is rounded to 9 decimals first, so that floating point does not turn 0.1 x 30 (3.0000000000000004)
    into 4 tokens. The cost calculator and the engine share this function, so priced and measured runs agree.
    """
    if not 0.0 < keep_fraction <= 1.0:
        raise KvlabError(f"A kept fraction of {keep_fraction} is not possible; it must be more than 0 and at most 1.")
    if tokens < 0:
        raise KvlabError("The number of tokens cannot be negative.")
    return math.ceil(round(keep_fraction * tokens, KEEP_DECIMALS))


@dataclass(frozen=True)
class Budget:
    """Either ``tokens`` per layer per KV head, or ``keep``, a fraction of the context in (0, 1]."""

    tokens: int | None = None
    keep: float | None = None

    def __post_init__(self) -> None:
        if (self.tokens is None) == (self.keep is None):
            raise KvlabError("Give a budget either in tokens or as a kept fraction, not both and not neither.")
        if self.tokens is not None and not 0 < self.tokens <= MOST_TOKENS:
            raise KvlabError(
                f"A budget of {self.tokens} tokens is not possible; it must be a positive number of tokens, at most "
                f"{MOST_TOKENS:,}."
            )
        if self.keep is not None and not 0.0 < self.keep <= 1.0:
            raise KvlabError(f"A kept fraction of {self.keep} is not possible; it must be more than 0 and at most 1.")

    def resolve(self, context_tokens: int) -> int:
        """Tokens kept per layer per KV head for a context of ``context_tokens``."""
        if self.tokens is not None:
            return self.tokens
        assert self.keep is not None
        return max(1, kept_tokens(context_tokens, self.keep))


PYRAMID_BETA = 20
"""PyramidKV's default steepness (the paper's beta): the top layer keeps ``1/beta`` of the mean budget."""


def pyramid_shares(spare: float, beta: float, num_layers: int) -> list[float]:
    """PyramidKV's budget per layer beyond its observation window, falling linearly with depth from ``2 - 1/beta``
    times the mean ``spare`` at the bottom layer to ``1/beta`` times it at the top, so that the layers hold what a
    uniform budget holds. Torch-free, so that the claims about layer budgets are computed by the policy's own rule.
    """
    top = spare / beta
    bottom = 2 * spare - top
    return [bottom - (bottom - top) * layer / (num_layers - 1) for layer in range(num_layers)]


def split_budget(shares: Sequence[float], base: int, total: int, capacity: int | None = None) -> list[int]:
    """Whole per-layer budgets: ``base`` tokens for every layer plus its share of the rest of ``total``. The one rule
    that PyramidKV and the layer allocations (:mod:`kvlab.cache.allocation`) share, so that they differ only in their
    shares: a share is capped at what a context of ``capacity`` tokens lets the layer hold and the surplus handed on
    (:func:`fill_up_to`); shares are rounded down and the tokens left over go to the largest fractional parts (the
    lower layer first on ties), so the budgets sum to ``total``, or less only when every layer holds the context.
    """
    if capacity is not None:
        shares = fill_up_to(shares, capacity - base)
    floors = [int(share) for share in shares]
    remainder = min(round(sum(shares)), total - base * len(shares)) - sum(floors)
    by_fraction = sorted(range(len(shares)), key=lambda layer: floors[layer] - shares[layer])
    for layer in by_fraction[:remainder]:
        floors[layer] += 1
    return [base + share for share in floors]


def fill_up_to(shares: Sequence[float], limit: float) -> list[float]:
    """Cap shares at ``limit`` and hand what the capped layers cannot hold to the others in proportion to their
    shares (evenly when theirs are all zero), until none is over (water filling), so the total stays the same while
    any layer has room."""
    shares = list(shares)
    while True:
        excess = sum(max(0.0, share - limit) for share in shares)
        room = [i for i, share in enumerate(shares) if share < limit]
        if excess <= 1e-9 or not room:
            return [min(share, limit) for share in shares]
        weight = sum(shares[i] for i in room)
        shares = [min(share, limit) for share in shares]
        for i in room:  # in proportion to their shares, or evenly where all of them are nothing
            shares[i] += excess * (shares[i] / weight if weight > 0 else 1 / len(room))
