"""The heavy-hitter ablation: the full cache with only its heaviest hitters (the attention "pillars") removed."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvlab.cache.ranking import by_score_then_position
from kvlab.errors import KvlabError
from kvlab.modes import PREFILL
from kvlab.params import param
from kvlab.policies.base import LayerView, Policy


@dataclass
class DropPillars(Policy):
    """An ablation, not a method: the full cache with only the ``count`` tokens that accumulated the most attention
    removed, in every layer and KV head, to measure what the "pillars" (the columns of an attention map that every
    query attends to, H2O's heavy hitters, Zhang et al., arXiv:2306.14048) are worth on their own. The first
    ``sinks`` tokens are spared: removing those is the attention-sink ablation (:mod:`kvlab.policies.drop_first`).
    It takes no budget: it keeps every other token, as the full cache does.

    Accumulated attention is H2O's (the sum over the queries read so far, and over the query heads sharing the KV
    head), so the pillars are chosen per layer and KV head at prefill mode's one compression, after the whole
    context was read (with the question too, unless it is read after compression). Ties go to the later token, the
    same in every layout. A context of no more than ``sinks + count`` tokens has fewer pillars to give than
    ``count``; the ablation is meant for contexts far longer than that.
    """

    name: ClassVar[str] = "drop_pillars"
    evicts: ClassVar[bool] = False
    needs_scores: ClassVar[bool] = True
    count: int = param(32, minimum=1, help="tokens removed per layer and KV head: those with the most attention")
    sinks: int = param(4, minimum=0, help="first tokens never removed, however much attention they hold")

    def removes(self) -> int:
        """How many tokens the compression removes, whatever the budget (it takes none)."""
        return self.count

    def removed(self, view: LayerView) -> torch.Tensor:
        """The ``count`` held slots past the sinks with the most accumulated attention, per sequence and KV head,
        ``(batch, kv_heads, span)``; on a sliding-window layer only among the tokens its window still sees (those
        outside it go anyway)."""
        candidates = view.positions >= self.sinks  # free slots hold a negative position
        window = view.cache.sliding_window
        if window is not None:
            candidates &= view.positions > view.next_position - window
        ranking = by_score_then_position(view.scores, view.positions)
        ranking = ranking.masked_fill(~candidates, torch.iinfo(torch.int64).min)
        top = ranking.topk(min(self.count, view.span), dim=-1).indices
        return torch.zeros_like(candidates).scatter_(-1, top, True) & candidates

    def check_mode(self, mode: str) -> None:
        if mode != PREFILL:
            raise KvlabError(
                "Policy 'drop_pillars' removes the heaviest hitters once, at prefill mode's compression; run it in "
                "prefill mode."
            )
