"""Quest: the pages a decoded query may attend to most, read; the rest of the cache held but not read."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvlab.cache.ranking import by_score_then_position
from kvlab.cache.sparse import SparseRead, grouped, page_key_bounds, page_of_slots, pages_held, quest_bounds
from kvlab.params import param
from kvlab.policies.base import LayerView, Policy


@dataclass
class Quest(Policy):
    """Quest (Tang et al., "Quest: Query-Aware Sparsity for Efficient Long-Context LLM Inference", ICML 2024,
    arXiv:2406.10774): the cache is cut into pages of ``page_size`` consecutive tokens, each described by the
    element-wise minimum and maximum of its keys; a decoded query bounds ``q . k`` over every page by
    ``sum_i max(q_i min_i, q_i max_i)`` and reads the pages with the highest bounds, as many as the budget holds
    whole (``budget // page_size``, counting the page holding the newest tokens, which is always read, as in Quest's
    kernel). Nothing is evicted: the heap holds the whole cache, and the budget is what each step reads per layer and
    KV head. The prompt is read densely, and so are the first ``dense_layers`` layers while decoding (the paper's
    two).

    Differs from the paper: with grouped-query attention, where Quest selects pages per query head, kvlab reads per
    KV head, and a page's bound is the largest of its query heads' bounds (so it bounds what any of them can give
    the page); a budget below one page reads the newest page only. The page bounds are computed anew at every step
    from the held keys (layout-independent) where Quest's kernel keeps them; what is counted as read is the
    kernel's: every page's minimum and maximum key when the pages do not all fit the budget, then the selected
    tokens' keys and values. In ``streaming`` mode, which the paper does not have, the pages are those of what the
    heap holds. The selection has fixed shapes, so decode steps are captured in CUDA graphs.
    """

    name: ClassVar[str] = "quest"
    reads_sparsely: ClassVar[bool] = True
    page_size: int = param(16, minimum=1, maximum=4096, help="tokens per page")
    dense_layers: int = param(2, minimum=0, help="first layers read densely while decoding (the paper skips two)")

    def score(self, view: LayerView) -> torch.Tensor:
        """Only what a sliding window can no longer see ever leaves, the oldest first (as for the full cache)."""
        return view.positions.float()

    def sparse_read(self, budget: int, span: int) -> SparseRead:
        return QuestRead(budget, None, self.dense_layers, self.page_size)


@dataclass(frozen=True)
class QuestRead(SparseRead):
    """Quest's selection: the newest page and the pages of highest bound, ``budget // page_size`` pages in all (at
    least one)."""

    page_size: int = 16

    def select(
        self, query: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor, allowed: torch.Tensor, in_order: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        batch, kv_heads, slots, head_dim = keys.shape
        page, pages = page_of_slots(positions, allowed, self.page_size, in_order)
        reading = max(1, self.budget // self.page_size)
        if reading >= pages:  # every page there can be fits: nothing to estimate
            return allowed, allowed.new_zeros((batch, kv_heads), dtype=torch.int64)
        held = pages_held(allowed, self.page_size).unsqueeze(-1)
        low, high = page_key_bounds(keys, page, pages)
        bounds = quest_bounds(grouped(query, kv_heads), low, high).amax(dim=2)
        index = torch.arange(pages, device=keys.device).expand(batch, kv_heads, pages)
        bounds = bounds.masked_fill(index >= held, float("-inf")).masked_fill(index == held - 1, float("inf"))
        top = by_score_then_position(bounds, index).topk(reading, dim=-1).indices
        chosen = torch.zeros(batch, kv_heads, pages + 1, dtype=torch.bool, device=keys.device)
        chosen[..., :pages].scatter_(-1, top, True)
        estimated = held.squeeze(-1) > reading
        metadata = torch.where(estimated, held.squeeze(-1) * 2 * head_dim, 0)
        return chosen.gather(-1, page) & allowed, metadata
