"""How scores become an eviction: the one ranking every policy's scores go through.

A policy gives one score per slot and KV head (higher kept); the cache turns scores into victims the same way for
all of them, so that they differ only where their papers differ. Ties are broken by position, the older token going
first, the same in every layout: each slot's ranking key is one int64 holding the score's bits in its high half and
the position in its low half (:func:`by_score_then_position`), so no sort is needed. Every cut (layer x KV head x
eviction) is counted, and on the device those where the best victim tied the worst survivor (:func:`tied_cut`), so
that a run can report how often the tie-break decided.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from kvlab.cache.layer import HeapLayer

#: The score of a token always kept (sinks, windows): never a victim, never perturbed.
KEEP = float("inf")
#: The score half of :func:`by_score_then_position`'s key for an infinite score.
_INFINITE_KEY = torch.tensor(KEEP).view(torch.int32).item()
#: The ranking key of a slot that holds no token: below every key :func:`by_score_then_position` gives.
UNHELD = torch.iinfo(torch.int64).min


class Victims(NamedTuple):
    """The slots an eviction frees, ``(batch, kv_heads, count)``, and per sequence and KV head whether the cut fell
    on tied scores (``None`` where nothing was left to compare with)."""

    slots: torch.Tensor
    tied: torch.Tensor | None


def by_score_then_position(scores: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """One int64 per slot that orders slots by score and, among equal scores, by position: the float32 score's
    bits made monotonic (negative floats have their magnitude bits flipped) in the high half, the position in the
    low half. Ties (equal key norms of a repeated token, say) are then broken the same way whatever order the slots
    are in, so every layout evicts the same tokens; no sort is needed."""
    bits = scores.float().contiguous().view(torch.int32).to(torch.int64)
    monotonic = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    return monotonic * (1 << 32) + positions.to(torch.int64)


def tied_cut(best_victim: torch.Tensor, worst_survivor: torch.Tensor) -> torch.Tensor:
    """Whether each cut (keys of :func:`by_score_then_position`) fell on a tie: the best victim's score equals the
    worst survivor's, so the position decided which of them stayed (an infinite score is a token kept by rule, not
    a tie of measured scores)."""
    victim_score, survivor_score = best_victim >> 32, worst_survivor >> 32
    return (victim_score == survivor_score) & (victim_score != _INFINITE_KEY)


def eviction_count(layer: HeapLayer, budget: int, uniform_budget: int) -> int:
    """How many tokens a layer gives up to get back to its budget: none while it holds no more than the uniform
    budget (PyramidKV), and on sliding-window layers at least what its window can no longer see."""
    keep = budget if layer.live > uniform_budget else layer.live
    if layer.sliding_window is not None:
        keep = min(keep, layer.sliding_window - 1)
    return max(0, layer.live - keep)


def victims(scores: torch.Tensor, positions: torch.Tensor, count: int) -> Victims:
    """The ``count`` lowest-ranked slots among ``scores`` (``(batch, kv_heads, slots)``; free slots, at a negative
    position, are never chosen) and whether each cut tied."""
    order = by_score_then_position(scores.masked_fill(positions < 0, float("inf")), positions)
    if count == 1 and order.shape[-1] > 1:  # a decode step's one victim: a reduction, where a top-k is a radix select
        least, slot = order.min(dim=-1, keepdim=True)
        victim_score = least.squeeze(-1) >> 32
        others_equal = ((order >> 32) == victim_score.unsqueeze(-1)).sum(dim=-1) > 1
        return Victims(slot, others_equal & (victim_score != _INFINITE_KEY))
    if count < order.shape[-1]:  # the lowest count + 1 in order: the victims and the best survivor, to see a tie
        lowest = order.topk(count + 1, dim=-1, largest=False, sorted=True)
        return Victims(lowest.indices[..., :count], tied_cut(lowest.values[..., count - 1], lowest.values[..., count]))
    return Victims(order.topk(count, dim=-1, largest=False, sorted=False).indices, None)


def kept(
    scores: torch.Tensor,
    positions: torch.Tensor,
    keep: int,
    live: int,
    safeguard: float | None,
    entries: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Which held slots a compression keeps, ``(batch, kv_heads, span)``, and the ranking key they were chosen by
    (higher kept): the same key and tie-break as :func:`victims`, each KV head keeping ``keep`` of its ``live``, or with
    ``safeguard`` set the layer's heads sharing theirs (Ada-KV, :func:`adakv_kept`; ``entries`` of them in all where
    given, else ``keep`` per head); and per KV head whether the cut fell on tied scores (``None`` when nothing is cut,
    or for Ada-KV's one cut over the layer's heads, whose ties are not counted)."""
    held = positions >= 0
    ranking = by_score_then_position(scores, positions)
    span = positions.shape[-1]
    if safeguard is not None:
        return adakv_kept(ranking, held, keep, safeguard, entries), ranking, None
    highest = ranking.masked_fill(~held, UNHELD).topk(min(keep + 1, span), dim=-1)
    top = highest.indices[..., :keep]
    tied = tied_cut(highest.values[..., keep], highest.values[..., keep - 1]) if keep < live else None
    return torch.zeros_like(held).scatter_(-1, top, True) & held, ranking, tied


def adakv_kept(
    ranking: torch.Tensor, held: torch.Tensor, budget: int, safeguard: float, entries: int | None = None
) -> torch.Tensor:
    """Ada-KV's head-adaptive selection over one layer: ``budget x kv_heads`` slots per sequence (or ``entries``)
    chosen by one top-k over all of its KV heads, each head first guaranteed its ``int(safeguard x budget)`` best
    slots (as kvpress's ``AdaKVPress`` does with ``alpha_safeguard``). ``ranking`` is an int64 ranking key per slot
    (higher kept first), ``held`` the held slots."""
    batch, kv_heads, slots = ranking.shape
    floor = min(int(safeguard * budget), budget)
    ranked = ranking.masked_fill(~held, UNHELD)
    per_head_rank = ranked.argsort(dim=-1, descending=True, stable=True).argsort(dim=-1)
    guaranteed = held & (per_head_rank < floor)
    boosted = torch.where(guaranteed, torch.iinfo(torch.int64).max, ranked).flatten(1)
    total = min(budget * kv_heads if entries is None else entries, int(held.sum(dim=(1, 2)).min()))
    chosen = boosted.topk(total, dim=-1).indices
    chosen_mask = torch.zeros_like(boosted, dtype=torch.bool).scatter_(1, chosen, True)
    return chosen_mask.view(batch, kv_heads, slots) & held


def hot_and_cold(scores: torch.Tensor, kept: torch.Tensor, hot_share: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Split each (sequence, KV head)'s kept slots: the ``ceil(hot_share x kept)`` best-ranked stay hot, the rest go
    cold. ``scores`` orders the slots (higher kept first, ties already broken: an int64 ranking key)."""
    counts = kept.sum(-1, keepdim=True)
    hot_counts = torch.ceil(counts.double() * hot_share - 1e-9).long()
    ranked = scores.masked_fill(~kept, UNHELD)
    rank = ranked.argsort(dim=-1, descending=True, stable=True).argsort(dim=-1)
    hot = kept & (rank < hot_counts)
    return hot, kept & ~hot
