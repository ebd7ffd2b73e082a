"""A generational cache: young tokens are never ranked, old ones rarely, so each eviction ranks a small middle."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvlab.cache.ranking import KEEP, eviction_count
from kvlab.errors import KvlabError
from kvlab.params import param
from kvlab.policies.base import LayerView
from kvlab.policies.scoring import ScoringPolicy


@dataclass
class Generational(ScoringPolicy):
    """A generational KV heap, as the articles describe it by analogy with a garbage collector (not from a paper):
    tokens are ranked by H2O's accumulated attention, but an eviction ranks only part of the cache. The ``young``
    share of the budget (the most recent tokens) is never ranked; the ``middle`` share, the tokens just older than
    the young ones, is ranked at every eviction; the rest of the budget is the old generation, the oldest surviving
    tokens, which got there by surviving every ranking on their way through the middle and are ranked only by a
    major collection, once every ``major_every`` tokens read, together with the middle.

    The tiers are slices of the cache by age, so in a layer whose slots are in position order (the ``compact``
    layout, and the others until their first eviction leaves a free slot or right after they compact) an eviction
    passes just the slots of its tiers to the selection: the heap counts the slots ranked, against H2O's whole
    cache. Where the slots are out of order, and inside a static (captured) decode step, the selection runs over
    every slot with the protected tiers marked as kept, so every layout keeps the same tokens; the counts then show
    the whole cache ranked. So does a sliding-window layer, whose tokens outside the window go first whatever their
    tier.
    """

    name: ClassVar[str] = "generational"
    needs_scores: ClassVar[bool] = True
    young: float = param(
        0.1, minimum=0.0, maximum=1.0, open_minimum=True, help="share of the budget kept as the newest tokens, unranked"
    )
    middle: float = param(
        0.3, minimum=0.0, maximum=1.0, open_minimum=True, help="share of the budget ranked at every eviction"
    )
    major_every: int = param(64, minimum=1, help="tokens read between rankings of the old generation")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.young + self.middle > 1.0:
            raise KvlabError(
                f"The young ({self.young:g}) and middle ({self.middle:g}) shares of policy 'generational' add up "
                "to more than the whole budget."
            )

    def tiers(self, budget: int) -> tuple[int, int, int]:
        """Tokens of the young, middle and old generations in a layer holding ``budget`` tokens."""
        young = max(1, round(budget * self.young))
        middle = max(1, min(budget - young, round(budget * self.middle)))
        return young, middle, max(0, budget - young - middle)

    def min_budget(self) -> int:
        return 2

    def describe_min_budget(self) -> str:
        return "one young token plus one to rank"

    def major(self, view: LayerView) -> bool | torch.Tensor:
        """Whether this eviction is a major collection: a multiple of ``major_every`` tokens was read since the
        last one (decided on the device inside a static step, where the position is a device tensor)."""
        count = eviction_count(view.cache, view.budget, view.uniform_budget)
        return (view.next_position - count) // self.major_every != view.next_position // self.major_every

    def score(self, view: LayerView) -> torch.Tensor:
        young, _, old = self.tiers(view.budget)
        protected = view.most_recent(young)
        oldest = view.in_position_order(
            view.positions.float(),
            lambda ordered: (torch.arange(ordered.shape[-1], device=ordered.device) < old).float().expand_as(ordered),
        ).bool()
        protected = protected | (oldest & ~torch.as_tensor(self.major(view), device=protected.device))
        return view.scores.masked_fill(protected, KEEP)

    def candidates(self, view: LayerView, count: int) -> tuple[int, int] | None:
        layer = view.cache
        if not (layer.ordered and layer.dead == 0) or layer.sliding_window is not None:
            return None  # out of order, or a sliding window that must drop its oldest tokens first
        if not isinstance(view.next_position, int):
            return None
        young, _, old = self.tiers(view.budget)
        stop = layer.live - young
        return (0, stop) if self.major(view) else (min(old, stop - count), stop)
