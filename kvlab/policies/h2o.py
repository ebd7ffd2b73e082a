"""H2O: heavy hitters by accumulated attention, plus recent tokens."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvlab.cache.ranking import KEEP
from kvlab.params import param
from kvlab.policies.base import LayerView
from kvlab.policies.scoring import ScoringPolicy


@dataclass
class H2O(ScoringPolicy):
    """H2O (Zhang et al., "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large Language Models",
    NeurIPS 2023, arXiv:2306.14048): keep the ``recent_ratio`` share of the budget as the most recent tokens and
    fill the rest with the tokens that have accumulated the most attention from all queries so far.

    The accumulated score of a token is the sum, over every query that has attended to it (prefill and decode) and
    over the query heads sharing its KV head, of the softmax attention it received. Evicted tokens lose their score
    for good, as in the paper's greedy algorithm.

    ``accumulate="mean"`` reads H2O as kvpress's ``ObservedAttentionPress`` does: each token's accumulated attention
    divided by the number of queries that saw it (itself and every later query), which no longer favours old tokens
    for having been seen more often; ``"sum"`` (the default) is the paper's.

    Differs from the paper: with grouped-query attention the paper's per-head scores are summed over the query heads
    of each KV head, because the KV head is what is stored; and in ``prefill`` mode the whole context is scored
    before one eviction, where the paper evicts one token per step from the start. Differs from kvpress's press:
    it keeps the recent share of the budget, which the press does not, and sums the query heads of a KV head where
    the press averages them (the same ranking).
    """

    name: ClassVar[str] = "h2o"
    needs_scores: ClassVar[bool] = True
    scores_layers_alike: ClassVar[bool] = True
    recent_ratio: float = param(
        0.5,
        minimum=0.0,
        maximum=1.0,
        open_minimum=True,
        open_maximum=True,
        help="share of the budget kept as the most recent tokens",
    )
    accumulate: str = param(
        "sum", choices=("sum", "mean"), help="sum of the attention received, or its mean over the queries that saw it"
    )

    def recent(self, budget: int) -> int:
        """How many of ``budget`` slots are reserved for the most recent tokens."""
        return max(1, round(budget * self.recent_ratio))

    def min_budget(self) -> int:
        return 2

    def describe_min_budget(self) -> str:
        return "one heavy hitter plus one recent token"

    def score(self, view: LayerView) -> torch.Tensor:
        scores = view.scores
        if self.accumulate == "mean":  # every query from the token's own on saw it (evicted tokens are gone for good)
            scores = scores / (view.next_position - view.positions).clamp_min(1)
        return scores.masked_fill(view.most_recent(self.recent(view.budget)), KEEP)
