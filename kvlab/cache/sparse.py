"""Sparse reads: decoding that attends to a selection of the held cache instead of all of it.

A sparse reader (Quest, RocketKV) holds the cache, or what its own eviction leaves of it, and for every decoded
token, layer and KV head chooses which held tokens the query reads; attention masks out the rest for that step
(:func:`kvlab.attention.function.kvlab_attention` applies the selection, prefill stays dense). Nothing leaves the heap
because of a selection, so a run has two byte counts: the bytes held (the heap's, as for every policy) and the bytes
read per decoded token (:class:`ReadCount`): the selected tokens' keys and values plus the page metadata the
selection itself read. For every other policy the two are the same: attention reads what is held.

The maths here are pure functions over one layer's slots in any layout (the slots need not be in position order):
pages of consecutive held tokens in position order, the element-wise bounds of each page's keys, Quest's upper bound
of q.k per page and RocketKV's approximate attention. Every shape follows the slots, never a device value, so a
selection can be captured in a CUDA graph (:mod:`kvlab.engine.static`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

#: The rank given to slots outside every page when slots are sorted by position.
_LAST = torch.iinfo(torch.int32).max


@dataclass(frozen=True)
class SparseRead:
    """How a sparse reader reads the cache while decoding, fixed for one run: ``budget`` tokens read per step, layer
    and KV head, ``held`` tokens each layer keeps per KV head (``None``: every token; an eviction to it is the
    policy's own) and the first ``dense_layers`` layers read in full. Subclasses choose the tokens
    (:meth:`select`)."""

    budget: int
    held: int | None
    dense_layers: int = 0

    def reads_sparsely(self, layer_idx: int) -> bool:
        """Whether the layer's decoded queries read a selection (the first ``dense_layers`` read everything)."""
        return layer_idx >= self.dense_layers

    def select(
        self, query: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor, allowed: torch.Tensor, in_order: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The slots one decoded ``query`` (``(batch, q_heads, 1, head_dim)``, after RoPE) reads among those it is
        ``allowed`` to see (``(batch, kv_heads, slots)``), as a mask of the same shape, and the elements of page
        metadata the selection read per sequence and KV head (``(batch, kv_heads)``). ``in_order``: the slots are
        known to hold their tokens in position order, so pages need no sort."""
        raise NotImplementedError


def grouped(query: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """One decoded query ``(batch, q_heads, 1, head_dim)`` as ``(batch, kv_heads, group, head_dim)`` in float32: the
    query heads that read each KV head, side by side."""
    batch, q_heads, _, head_dim = query.shape
    return query.reshape(batch, kv_heads, q_heads // kv_heads, head_dim).float()


def page_of_slots(
    positions: torch.Tensor, allowed: torch.Tensor, page_size: int, in_order: bool
) -> tuple[torch.Tensor, int]:
    """The page of every slot, ``(batch, kv_heads, slots)``, and the number of pages there can be (``ceil(slots /
    page_size)``). Pages are ``page_size`` consecutive allowed tokens in position order, numbered from the oldest;
    a slot that is not allowed (free, in the query's future, outside a sliding window) gets the number of pages,
    one past the last. Over a full cache read in order these are Quest's pages of consecutive positions; after an
    eviction, RocketKV's chunks of consecutive kept tokens. ``in_order`` counts ranks along the slots instead of
    sorting them by position (the same ranks when the slots are in position order)."""
    slots = positions.shape[-1]
    pages = -(-slots // page_size)
    if in_order:
        ranks = allowed.long().cumsum(-1) - 1
    else:
        order = positions.masked_fill(~allowed, _LAST).argsort(dim=-1)
        counting = torch.arange(slots, device=positions.device).expand_as(order)
        ranks = torch.empty_like(order).scatter_(-1, order, counting)
    return torch.where(allowed, torch.div(ranks, page_size, rounding_mode="floor"), pages), pages


def pages_held(allowed: torch.Tensor, page_size: int) -> torch.Tensor:
    """How many pages the allowed tokens fill, per sequence and KV head (the last may be partly filled)."""
    return torch.div(allowed.sum(-1) + page_size - 1, page_size, rounding_mode="floor")


def page_key_bounds(keys: torch.Tensor, page: torch.Tensor, pages: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The element-wise minimum and maximum of each page's keys, ``(batch, kv_heads, pages, head_dim)`` in float32
    (zero for a page holding nothing): the page metadata of Quest and RocketKV. ``page`` is :func:`page_of_slots`'s
    numbering; slots outside every page are left out."""
    batch, kv_heads, slots, head_dim = keys.shape
    index = page.unsqueeze(-1).expand(batch, kv_heads, slots, head_dim)
    empty = keys.new_zeros(batch, kv_heads, pages + 1, head_dim)
    low = empty.scatter_reduce(2, index, keys, "amin", include_self=False)[:, :, :pages]
    high = empty.scatter_reduce(2, index, keys, "amax", include_self=False)[:, :, :pages]
    return low.float(), high.float()


def quest_bounds(query: torch.Tensor, low: torch.Tensor, high: torch.Tensor) -> torch.Tensor:
    """Quest's upper bound of ``q . k`` over every key of a page: ``sum_i max(q_i min_i, q_i max_i)``, which takes
    the maximum where ``q_i`` is positive and the minimum where it is negative. ``query`` is
    ``(batch, kv_heads, group, head_dim)``, the bounds ``(batch, kv_heads, pages, head_dim)``; the result is
    ``(batch, kv_heads, group, pages)``, one bound per query head, computed as two products as Quest's kernel
    does."""
    positive, negative = query.clamp(min=0.0), query.clamp(max=0.0)
    return positive @ high.transpose(-1, -2) + negative @ low.transpose(-1, -2)


def rocket_page_logits(
    query: torch.Tensor, low: torch.Tensor, high: torch.Tensor, dims: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """RocketKV's approximate attention logits per page and query head, ``(batch, kv_heads, group, pages)``, and the
    temperature of their softmax, ``(batch, kv_heads, group)``.

    As in the reference code's hybrid sparse attention: each component's sign is that of its sum over the query
    heads of the KV head; a page's key is its element-wise maximum of ``k_i * sign_i`` (the maximum key where the
    sign is positive, the negated minimum where it is negative); only the ``dims`` components with the largest mean
    magnitude over the group are multiplied; the temperature is ``sqrt(head_dim * |q_hat|_1 / |q|_1)``, with
    ``q_hat`` the query on those components.
    """
    batch, kv_heads, group, head_dim = query.shape
    pages = low.shape[2]
    sign = torch.where(query.sum(dim=2, keepdim=True) > 0, 1.0, -1.0)
    largest = query.abs().mean(dim=2, keepdim=True).topk(dims, dim=-1).indices
    q_hat = (query * sign).gather(-1, largest.expand(batch, kv_heads, group, dims))
    extreme = torch.where(sign > 0, high, -low)
    k_hat = extreme.gather(-1, largest.expand(batch, kv_heads, pages, dims))
    temperature = (head_dim * q_hat.abs().sum(-1) / query.abs().sum(-1).clamp_min(1e-30)).sqrt()
    return q_hat @ k_hat.transpose(-1, -2), temperature


def rocket_token_scores(
    logits: torch.Tensor, temperature: torch.Tensor, page: torch.Tensor, allowed: torch.Tensor
) -> torch.Tensor:
    """Every slot's approximate attention, ``(batch, kv_heads, slots)``: its page's logit for each query head (each
    token of a page shares it), a softmax over the allowed tokens at the head's temperature, averaged over the
    query heads of the KV head (the reference code's mean over the group)."""
    batch, kv_heads, group, _ = logits.shape
    per_token = logits.gather(-1, page.clamp(max=logits.shape[-1] - 1).unsqueeze(2).expand(-1, -1, group, -1))
    per_token = per_token.masked_fill(~allowed.unsqueeze(2), float("-inf"))
    return torch.softmax(per_token / temperature.unsqueeze(-1), dim=-1).mean(dim=2)


def rocket_stage_one(budget: int, span: int) -> int:
    """Tokens RocketKV's first stage keeps per layer and KV head for a read ``budget`` of ``B`` tokens over a run of
    ``S`` tokens (prompt and generation), as its reference code splits the work: the compression ratio
    ``c = S / B`` (at least 1) is shared as ``c^r`` by stage 1, which keeps ``S / c^r`` tokens, and ``c^(1 - r)`` by
    stage 2, with ``r = min(0.2 + 0.06 log2 c, 0.8)``."""
    ratio = max(1.0, span / budget)
    share = min(0.2 + 0.06 * math.log2(ratio), 0.8)
    return int(span / ratio**share)


@dataclass
class ReadCount:
    """The K/V bytes attention read while decoding, per step: the layers read in full count the bytes they hold
    (host counts, no device work), a sparse reader's layers the bytes their selections read, summed on the device
    (the selected tokens' keys and values and the page metadata, at the heap's element size), so that counting
    never waits for the device; :meth:`per_step` reads the sum once."""

    device: torch.device
    steps: int = 0
    held_bytes: int = 0
    selected_bytes: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        # allocated before any step, so that a captured step adds to it in place
        self.selected_bytes = torch.zeros((), dtype=torch.int64, device=self.device)

    def add_step(self, held_bytes: int) -> None:
        """Count one decode step whose densely read layers hold ``held_bytes``."""
        self.steps += 1
        self.held_bytes += held_bytes

    def add_selection(self, selected: torch.Tensor, metadata_elements: torch.Tensor, keys: torch.Tensor) -> None:
        """Add one layer's selection: ``selected`` slots (keys and values read) and ``metadata_elements`` elements of
        page metadata, over the batch and KV heads, at the element size of ``keys``."""
        elements = selected.sum() * (2 * keys.shape[-1]) + metadata_elements.sum()
        self.selected_bytes += (elements * keys.element_size()).to(self.selected_bytes.device)

    def per_step(self) -> float | None:
        """Mean bytes read per decode step over the batch (``None`` before any step)."""
        if not self.steps:
            return None
        return (self.held_bytes + int(self.selected_bytes)) / self.steps
