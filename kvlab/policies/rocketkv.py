"""RocketKV: a permanent eviction at the prompt (SnapKV++), then top-k sparse attention over what it kept."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from kvlab.cache.ranking import by_score_then_position
from kvlab.cache.sparse import (
    SparseRead,
    grouped,
    page_key_bounds,
    page_of_slots,
    pages_held,
    rocket_page_logits,
    rocket_stage_one,
    rocket_token_scores,
)
from kvlab.errors import KvlabError
from kvlab.params import param
from kvlab.policies.base import LayerView, Policy
from kvlab.policies.snapkv import SnapKV


@dataclass
class RocketKV(Policy):
    """RocketKV (Behnam et al., "RocketKV: Accelerating Long-Context LLM Inference via Two-Stage KV Cache
    Compression", arXiv:2502.14051), with the settings of its reference code. The budget is the tokens each decoded
    query reads per layer and KV head.

    Stage 1 (SnapKV++) evicts for good once the prompt is read: the last ``window`` queries vote for the tokens
    before the window, votes are summed over the window and over the query heads of each KV head (SnapKV++'s GQA
    support) and max-pooled along the sequence over ``kernel`` tokens (the reference code's 63), and the top tokens
    are kept with the window: kvlab's SnapKV scoring at those settings. Stage 2 (hybrid sparse attention) reads, for
    every decoded token, the top ``budget / 2`` tokens by an approximate attention: pages of consecutive kept tokens
    summarised by their element-wise key bounds, and only the query's components of largest magnitude (mean over
    the group) multiplied. The total is split as the reference code splits it: of the compression ratio
    ``c = S / budget`` over a run of ``S`` tokens, stage 1 takes ``c^r`` (keeping ``S / c^r`` tokens, at least the
    window and one more) with ``r = min(0.2 + 0.06 log2 c, 0.8)``, and the page size and components of stage 2
    follow from its own ratio (:func:`kvlab.cache.sparse.rocket_stage_one`, :class:`RocketRead`); ``multiple`` sets
    stage 1 to that many times the budget instead.

    Differs from the reference code: the paper adapts the pooling kernel to the sequence length where the code fixes
    it at 63, and kvlab takes the code's; stage 1's votes are summed in float32 and its ties go to the newer token,
    as kvlab's SnapKV does; stage 1 keeps ``S / c^r`` tokens of the prompt and decoding appends to
    them, where the code keeps that many less the tokens to generate; the tie between tokens of the same page at the
    top-k's edge goes to the newer one (the code's ``topk`` breaks it as the hardware does). What is counted as read
    per step: every page's bound on the components read, and the selected tokens' keys and values. In ``streaming``
    mode, which the paper does not have, stage 1 evicts after every chunk and decoded token. The selection has fixed
    shapes, so decode steps are captured in CUDA graphs.
    """

    name: ClassVar[str] = "rocketkv"
    reads_sparsely: ClassVar[bool] = True
    window: int = param(32, minimum=1, help="recent queries that vote in stage 1 (the observation window)")
    kernel: int = param(63, minimum=1, maximum=255, help="width of stage 1's max pooling along the sequence (odd)")
    multiple: float = param(
        0.0, minimum=0.0, help="tokens stage 1 keeps, as a multiple (at least 1) of the budget; 0: the paper's split"
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        self._stage_one()  # checks the kernel as SnapKV does
        if 0.0 < self.multiple < 1.0:
            raise KvlabError(
                f"Stage 1 of {self.name} keeps at least the tokens it reads, so multiple must be 0 or at least 1, "
                f"not {self.multiple}."
            )

    def _stage_one(self) -> SnapKV:
        """Stage 1's scoring: SnapKV at RocketKV's window and kernel, max pooling."""
        return SnapKV(window=self.window, kernel=self.kernel, pooling="max")

    def query_window(self) -> int:
        return self.window

    def min_budget(self) -> int:
        return 2

    def describe_min_budget(self) -> str:
        return "one token read exactly and one token's worth of approximation"

    def score(self, view: LayerView) -> torch.Tensor:
        return self._stage_one().score(view)

    def held_tokens(self, budget: int, span: int) -> int:
        """Tokens stage 1 keeps per layer and KV head for a read ``budget`` over a run of ``span`` tokens."""
        held = rocket_stage_one(budget, span) if self.multiple == 0.0 else math.ceil(self.multiple * budget)
        return max(held, self.window + 1)

    def sparse_read(self, budget: int, span: int) -> SparseRead:
        return RocketRead.over(budget, self.held_tokens(budget, span))


@dataclass(frozen=True)
class RocketRead(SparseRead):
    """RocketKV's stage 2 over the ``held`` tokens stage 1 keeps, at a read budget of ``B`` tokens, as its reference
    code sets it: the ratio ``c2 = held / B`` (at least 1) sets the page size ``ceil(sqrt(c2))`` (1 where that
    exceeds ``c2``) and the share ``page / c2`` of the head dimension the approximation reads; the top ``B / 2``
    tokens are read exactly. Half the budget goes to the approximation (pages x components), half to attention."""

    page_size: int = 1
    dims_share: float = 1.0
    top_tokens: int = 1

    @classmethod
    def over(cls, budget: int, held: int) -> RocketRead:
        ratio = max(1.0, held / budget)
        page = math.ceil(math.sqrt(ratio))
        page = page if page <= ratio else 1
        return cls(budget, held, 0, page, page / ratio, max(1, budget // 2))

    def dims(self, head_dim: int) -> int:
        """Components of the query the approximation multiplies, at least one."""
        return min(head_dim, max(1, int(head_dim * self.dims_share)))

    def select(
        self, query: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor, allowed: torch.Tensor, in_order: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        slots, head_dim = keys.shape[2], keys.shape[3]
        page, pages = page_of_slots(positions, allowed, self.page_size, in_order)
        dims = self.dims(head_dim)
        metadata = pages_held(allowed, self.page_size) * dims
        if self.top_tokens >= slots:  # every token fits: the approximation cannot change what is read
            return allowed, metadata
        low, high = page_key_bounds(keys, page, pages)
        logits, temperature = rocket_page_logits(grouped(query, keys.shape[1]), low, high, dims)
        scores = rocket_token_scores(logits, temperature, page, allowed).masked_fill(~allowed, float("-inf"))
        top = by_score_then_position(scores, positions).topk(self.top_tokens, dim=-1).indices
        return torch.zeros_like(allowed).scatter_(-1, top, True) & allowed, metadata
