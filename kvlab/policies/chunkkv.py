"""ChunkKV: keep whole chunks of consecutive tokens, chosen by an observation window, and reuse the choice across
layers."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import ClassVar

import torch

from kvlab.cache.layer import position_order
from kvlab.cache.ranking import KEEP, by_score_then_position
from kvlab.params import param
from kvlab.policies.base import LayerView
from kvlab.policies.scoring import ScoringPolicy
from kvlab.policies.snapkv import ObservationWindow, check_kernel, pool_votes


@dataclass
class ChunkKV(ObservationWindow, ScoringPolicy):
    """ChunkKV (Liu et al., "ChunkKV: Semantic-Preserving KV Cache Compression for Efficient Long-Context LLM
    Inference", NeurIPS 2025, arXiv:2502.00299): a token alone is a poor unit of meaning, so the cache keeps whole
    chunks of ``chunk_length`` consecutive tokens. The last ``window`` queries vote for the tokens before the window
    that they attend to, as in SnapKV: summed over the window and the query heads, and average-pooled along the
    sequence over ``kernel`` tokens (the window's own votes never spill into the tokens before it). A chunk scores
    the sum of its tokens' votes, and the best chunks are kept together with the window and with every chunk the
    window reaches into (kept whole, as kvpress's ``ChunkKVPress`` keeps them by giving the window the highest
    score). Every KV head of a layer keeps the same chunks (the votes are summed over the KV heads too, as kvpress
    does). Layer-wise index reuse: the layers form groups of ``reuse_layers``, and every layer after the first of its
    group keeps exactly the positions that first layer kept, without scoring (the paper's way to save the
    selection's cost; ``reuse_layers=1``, the default, reuses nothing).

    Budgets are exact: the paper keeps ``floor((budget - window) / chunk_length)`` whole chunks, and kvpress
    ``int(chunks x (1 - compression))`` of them, so both may keep up to a chunk fewer tokens than asked; kvlab keeps
    whole chunks while they fit, then the tokens of the next best chunk with the most votes. Given the number of
    tokens kvpress 0.5.5's ``ChunkKVPress(SnapKVPress())`` keeps, kvlab keeps the same positions (Jaccard 1.000 on
    the shipped model and SmolLM2-135M, ``bench/kvpress_parity.py``); before the pooling and the window's chunks
    were added, 0.90-0.94. Both came with the ``kernel`` parameter, so a stored run without it is a run of the
    former rule (unpooled votes, the window's chunk ranked like any other) and never taken for a new one.

    Differs from the paper and kvpress: chunks are aligned to original positions (``position // chunk_length``), so
    that in ``streaming`` mode, which neither has (there the window is the last ``window`` queries before each
    eviction), a chunk stays the same span of text from one eviction to the next; a chunk is what the cache still
    holds of it, and votes are pooled over the held tokens in position order. kvpress ranks chunks by their mean
    score, which differs from the sum only for partial chunks. The scores are ranks: chunks by their sum (ties to
    the later chunk), tokens within a chunk by their own votes, equal votes sharing a rank so that the eviction's
    tie-break by position decides and counts the tie. ``chunk_length`` defaults to the paper's 10 (kvpress: 20),
    ``window`` to kvlab's SnapKV's 32 (kvpress: 64). A reused layer whose first layer kept fewer tokens than its own
    budget (a sliding-window layer in a model that alternates them) fills the rest with its most recent tokens.
    """

    name: ClassVar[str] = "chunkkv"
    window: int = param(32, minimum=1, help="recent queries that vote (the observation window), always kept")
    chunk_length: int = param(10, minimum=1, help="tokens per chunk, the unit kept or evicted")
    reuse_layers: int = param(1, minimum=1, help="layers per group that keep the positions its first layer kept")
    kernel: int = param(5, minimum=1, maximum=255, help="width of the average pooling of the votes (odd; 1: none)")

    def __post_init__(self) -> None:
        super().__post_init__()
        check_kernel(self.name, self.kernel)

    def equal_layer_budgets(self) -> bool:
        return self.reuse_layers > 1

    def heads_share_ranking(self) -> bool:
        return True

    def score(self, view: LayerView) -> torch.Tensor:
        first = view.layer_idx - view.layer_idx % self.reuse_layers
        if first != view.layer_idx:
            assert view.heap is not None, "a reused layer reads the positions its group's first layer kept"
            return held_in(view.positions, view.heap.layers[first].held_positions().to(view.positions.device)).float()
        recent = view.most_recent(self.window)
        candidates = (view.positions >= 0) & ~recent
        votes = view.window_attention().masked_fill(~candidates, 0.0)
        votes = votes.sum(dim=1, keepdim=True).expand_as(votes)
        pooled = view.in_position_order(votes, partial(pool_votes, kernel=self.kernel, pooling="avg"))
        votes = pooled.masked_fill(~candidates, 0.0)
        chunks = view.in_position_order(view.positions.long(), partial(chunk_ids, chunk_length=self.chunk_length))
        ranks = chunk_ranks(votes, chunks, in_chunks_of(recent, chunks), view.positions, self.chunk_length)
        return ranks.masked_fill(recent, KEEP)


def chunk_ids(ordered_positions: torch.Tensor, chunk_length: int) -> torch.Tensor:
    """For positions in increasing order along the last dimension (free ones, negative, last), the index of each
    one's chunk (``position // chunk_length``) among the chunks present, counted from 0: dense, so that a chunk's
    votes can be summed in a tensor no longer than the slots."""
    chunk = ordered_positions.div(chunk_length, rounding_mode="floor")
    starts = chunk[..., 1:] != chunk[..., :-1]
    return torch.cat([torch.zeros_like(chunk[..., :1]), starts.cumsum(dim=-1)], dim=-1)


def chunk_ranks(
    votes: torch.Tensor, chunks: torch.Tensor, first: torch.Tensor, positions: torch.Tensor, chunk_length: int
) -> torch.Tensor:
    """Each slot's rank (0 lowest, as float) when slots are ordered by their chunk's summed ``votes`` (ties: the later
    chunk higher) and, within a chunk, by their own votes: the highest ranks are whole chunks, best first, each
    chunk's tokens in one run. The chunks of the ``first`` slots rank above every other (the window's, which kvpress
    keeps by scoring the window highest), within what the budget holds. Tokens of one chunk with equal votes share
    a rank, so that the eviction's tie-break by position decides between them and counts the tie. ``chunks`` are
    dense chunk indices per slot (of ``chunk_length`` ``positions``), summed by :func:`chunk_sums`."""
    totals = chunk_sums(votes, chunks, positions, chunk_length).masked_fill(first, KEEP)
    chunk_keys = by_score_then_position(totals, chunks)
    by_vote = votes.argsort(dim=-1)
    order = by_vote.gather(2, chunk_keys.gather(2, by_vote).argsort(dim=-1, stable=True))
    ordered_keys, ordered_votes = chunk_keys.gather(2, order), votes.gather(2, order)
    steps = (ordered_keys[..., 1:] != ordered_keys[..., :-1]) | (ordered_votes[..., 1:] != ordered_votes[..., :-1])
    ranks = torch.cat([torch.zeros_like(steps[..., :1]), steps], dim=-1).cumsum(dim=-1).float()
    return torch.empty_like(votes).scatter_(2, order, ranks)


def chunk_sums(votes: torch.Tensor, chunks: torch.Tensor, positions: torch.Tensor, chunk_length: int) -> torch.Tensor:
    """Each slot's chunk's summed ``votes`` (``chunks``: dense chunk indices per slot, of ``chunk_length`` positions
    at most; free slots, negative ``positions``, vote zero), the same on every device and in every layout. A GPU adds
    floats scattered to one chunk in no fixed order, and sums a rounding apart decided which chunk stayed: two runs
    of the same input kept different chunks. So each chunk is summed as kvpress sums it: its tokens in position
    order, as one row of ``chunk_length`` values (zeros where the chunk holds fewer tokens) summed along the row."""
    order = position_order(positions)  # chunks are numbered along positions: by position is by chunk, then position
    ordered_votes, ordered_chunks = votes.gather(2, order), chunks.gather(2, order)
    padding = (0, chunk_length - 1)
    rows = torch.nn.functional.pad(ordered_votes, padding).unfold(-1, chunk_length, 1)
    in_chunk = torch.nn.functional.pad(ordered_chunks, padding, value=-1).unfold(-1, chunk_length, 1)
    from_each_start = rows.masked_fill(in_chunk != ordered_chunks.unsqueeze(-1), 0.0).sum(dim=-1)
    index = torch.arange(order.shape[-1], device=order.device).expand_as(order)
    starts = torch.cat(
        [
            torch.ones_like(ordered_chunks[..., :1], dtype=torch.bool),
            ordered_chunks[..., 1:] != ordered_chunks[..., :-1],
        ],
        dim=-1,
    )
    chunk_start = index.masked_fill(~starts, 0).cummax(dim=-1).values
    return torch.empty_like(votes).scatter_(2, order, from_each_start.gather(2, chunk_start))


def in_chunks_of(slots: torch.Tensor, chunks: torch.Tensor) -> torch.Tensor:
    """Whether each slot's chunk (``chunks``: dense chunk indices per slot) holds one of the marked ``slots``."""
    marked = torch.zeros(chunks.shape, dtype=torch.float32, device=chunks.device).scatter_add_(2, chunks, slots.float())
    return marked.gather(2, chunks) > 0


def held_in(positions: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """Whether each slot's position is among the ``reference`` positions of the same sequence and KV head
    (``(batch, kv_heads, slots)`` and ``(batch, kv_heads, n)``): a sorted search, no slots x n comparison."""
    ordered = reference.sort(dim=-1).values
    found = torch.searchsorted(ordered, positions.contiguous().to(ordered.dtype)).clamp_max(ordered.shape[-1] - 1)
    return ordered.gather(-1, found) == positions
