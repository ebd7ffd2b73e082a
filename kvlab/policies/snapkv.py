"""SnapKV and PyramidKV: the cache as seen by an observation window of recent queries."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import ClassVar

import torch
import torch.nn.functional as F

from kvlab.budget import PYRAMID_BETA, pyramid_shares, split_budget
from kvlab.cache.ranking import KEEP
from kvlab.errors import KvlabError
from kvlab.params import param
from kvlab.policies.base import LayerView
from kvlab.policies.scoring import ScoringPolicy


class ObservationWindow:
    """What the policies whose last ``window`` queries vote share: they remember those queries, and always keep the
    window's tokens, so a budget must hold the window and one token more."""

    window: int

    def query_window(self) -> int:
        return self.window

    def min_budget(self) -> int:
        return self.window + 1

    def describe_min_budget(self) -> str:
        return f"its observation window of {self.window} tokens plus one"


@dataclass
class SnapKV(ObservationWindow, ScoringPolicy):
    """SnapKV (Li et al., "SnapKV: LLM Knows What You are Looking for Before Generation", NeurIPS 2024,
    arXiv:2404.14469): the last ``window`` queries vote for the tokens before the window that they attend to; votes
    are summed over the window, pooled along the sequence with a ``kernel``-wide pooling (average by default) so that
    neighbours of an important token survive with it, and the top tokens are kept together with the window itself.

    As the reference code (``SnapKVCluster.update_kv``: window 32, kernel 5, average pooling) and kvpress do, only the
    votes for tokens before the window are pooled; the window's own columns (each query's strong attention to itself
    and its neighbours) never spill into the tokens just before it. Against kvpress 0.5.5's ``SnapKVPress`` the kept
    sets are then the same at equal window and kernel (kvpress defaults to a window of 64).

    Differs from the reference code: votes are summed over the query heads sharing a KV head (GQA; kvpress averages
    them, which ranks the same), and over the window in float32 (the reference casts the softmax back to the model's
    dtype first, which can tie scores it would not tie in float32); equal scores are broken by position, the older
    token going first, where the reference code's ``topk`` breaks them as the hardware does. In ``streaming`` mode,
    which the paper does not have, the window is the last ``window`` queries seen before each eviction.
    """

    name: ClassVar[str] = "snapkv"
    scores_layers_alike: ClassVar[bool] = True
    window: int = param(32, minimum=1, help="recent queries that vote (the observation window)")
    kernel: int = param(5, minimum=1, maximum=255, help="width of the pooling along the sequence (odd)")
    pooling: str = param("avg", choices=("avg", "max"), help="how votes are pooled along the sequence")

    def __post_init__(self) -> None:
        super().__post_init__()
        check_kernel(self.name, self.kernel)

    def score(self, view: LayerView) -> torch.Tensor:
        window = view.most_recent(self.window)
        votes = view.window_attention().masked_fill(window, 0.0)  # only the votes for tokens before the window
        pooled = view.in_position_order(votes, partial(pool_votes, kernel=self.kernel, pooling=self.pooling))
        return pooled.masked_fill(window, KEEP)


def check_kernel(policy: str, kernel: int) -> None:
    """Refuse an even pooling kernel: centred pooling (``padding = kernel // 2``) needs an odd width to keep the
    sequence's length."""
    if kernel % 2 == 0:
        raise KvlabError(f"The pooling kernel of {policy} must be a positive odd number, not {kernel}.")


def pool_votes(votes: torch.Tensor, kernel: int, pooling: str) -> torch.Tensor:
    """Votes pooled along the sequence (``votes`` ``(batch, kv_heads, slots)`` in position order, zero in the window
    and on free slots, as the reference code's zero padding past the tokens before the window)."""
    batch, kv_heads, slots = votes.shape
    flat = votes.reshape(batch * kv_heads, 1, slots)
    pool = F.max_pool1d if pooling == "max" else F.avg_pool1d
    return pool(flat, kernel_size=kernel, stride=1, padding=kernel // 2).reshape(votes.shape)


@dataclass
class PyramidKV(SnapKV):
    """PyramidKV (Cai et al., "PyramidKV: Dynamic KV Cache Compression based on Pyramidal Information Funneling",
    arXiv:2406.02069): SnapKV's scores with a budget that falls linearly with depth. Outside the window, the top
    layer keeps ``1/beta`` of the average and the bottom layer ``2 - 1/beta`` times it, so the total over layers is
    that of a uniform budget (exactly, after rounding).

    Differs from the paper: as SnapKV above; and where the schedule gives the lower layers more than the context
    holds (large kept fractions), the reference code lets that surplus go unused, so the total falls short of a
    uniform budget; kvlab hands the surplus to the upper layers in proportion to their shares, keeping both the
    total and the fall with depth.
    """

    name: ClassVar[str] = "pyramidkv"
    own_layer_budgets: ClassVar[bool] = True
    beta: int = param(
        PYRAMID_BETA, minimum=1, help="how steeply the budget falls with depth (top layer: 1/beta of the mean)"
    )

    def layer_budgets(self, budget: int, num_layers: int, capacity: int | None = None) -> list[int]:
        if num_layers == 1:
            return [budget]
        shares = pyramid_shares(budget - self.window, self.beta, num_layers)
        return split_budget(shares, self.window, budget * num_layers, capacity)
