"""SnapKV and PyramidKV: the cache as seen by an observation window of recent queries."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from kvlab.errors import KvlabError
from kvlab.policies.base import KEEP, LayerView, Policy


@dataclass
class SnapKV(Policy):
    """SnapKV (Li et al., "SnapKV: LLM Knows What You are Looking for Before Generation", NeurIPS 2024,
    arXiv:2404.14469): the last ``window`` queries vote for the tokens they attend to; votes are summed over the
    window, pooled along the sequence with a ``kernel``-wide pooling (max by default) so that neighbours of an
    important token survive with it, and the top tokens are kept together with the window itself.

    Differs from the paper: votes are summed over the query heads sharing a KV head (GQA); in ``streaming`` mode,
    which the paper does not have, the window is the last ``window`` queries seen before each eviction.
    """

    name: ClassVar[str] = "snapkv"
    window: int = 32
    kernel: int = 7
    pooling: str = "max"

    def __post_init__(self) -> None:
        if self.window < 1:
            raise KvlabError(f"The observation window of {self.name} must be at least one query, not {self.window}.")
        if self.kernel < 1 or self.kernel % 2 == 0:
            raise KvlabError(f"The pooling kernel of {self.name} must be a positive odd number, not {self.kernel}.")
        if self.pooling not in ("max", "avg"):
            raise KvlabError(f"The pooling of {self.name} is 'max' or 'avg', not {self.pooling!r}.")

    def query_window(self) -> int:
        return self.window

    def min_budget(self) -> int:
        return self.window + 1

    def describe_min_budget(self) -> str:
        return f"its observation window of {self.window} tokens plus one"

    def score(self, view: LayerView) -> torch.Tensor:
        votes = view.window_attention()
        batch, kv_heads, slots = votes.shape
        flat = votes.reshape(batch * kv_heads, 1, slots)
        pool = F.max_pool1d if self.pooling == "max" else F.avg_pool1d
        pooled = pool(flat, kernel_size=self.kernel, stride=1, padding=self.kernel // 2).reshape(votes.shape)
        return pooled.masked_fill(view.most_recent(self.window), KEEP)


@dataclass
class PyramidKV(SnapKV):
    """PyramidKV (Cai et al., "PyramidKV: Dynamic KV Cache Compression based on Pyramidal Information Funneling",
    arXiv:2406.02069): SnapKV's scores with a budget that falls linearly with depth. Outside the window, the top
    layer keeps ``1/beta`` of the average and the bottom layer ``2 - 1/beta`` times it, so the total over layers is
    that of a uniform budget (exactly, after rounding).

    Differs from the paper: as SnapKV above; and a layer whose share exceeds what it holds keeps everything, so the
    total can fall short of the uniform one on short contexts.
    """

    name: ClassVar[str] = "pyramidkv"
    beta: int = 20

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.beta < 1:
            raise KvlabError(f"PyramidKV's beta must be at least 1, not {self.beta}.")

    def layer_budgets(self, budget: int, num_layers: int) -> list[int]:
        if num_layers == 1:
            return [budget]
        spare = budget - self.window
        top = spare / self.beta
        bottom = 2 * spare - top
        shares = [bottom - (bottom - top) * layer / (num_layers - 1) for layer in range(num_layers)]
        floors = [int(share) for share in shares]
        remainder = spare * num_layers - sum(floors)
        by_fraction = sorted(range(num_layers), key=lambda layer: floors[layer] - shares[layer])
        for layer in by_fraction[:remainder]:
            floors[layer] += 1
        return [self.window + share for share in floors]
