"""Eviction scopes: who decides how many tokens each layer keeps when a model's layers are split over devices.

A device map puts a model's decoder layers into placement groups, one per entry of the map (a GPU, the CPU, the disk:
:attr:`kvlab.models.loading.LoadedModel.layer_groups`). A scoring policy's ``scope`` says how its total budget, ``layers
x budget`` tokens per sequence and KV head, is spread over the layers:

* ``local`` (the default): each group decides alone, from its own layers, with no communication. The group's total
  (its layers x budget) is split over its layers by the policy's layer allocation applied to those layers only, as if
  they were the whole model: uniform gives each the budget, the preset and PyramidKV their depth profile within the
  group, ``entropy`` and CAKE the group's own layers' entropies or preferences. With one group (a model on one device)
  this is the allocation itself, unchanged.
* ``global``: one decision over every layer, at prefill mode's compression. Every layer's eviction scores (the
  policy's scores with its noise floor, keyed by score then position exactly as the eviction ranks them) are gathered
  to one device, and one threshold per sequence and KV head keeps the top ``layers x budget`` of them over all
  layers. A layer's count is the number of its tokens at or above the threshold, the mean over sequences and KV heads;
  the counts become whole budgets by the splitting rule every layer allocation uses
  (:func:`kvlab.cache.allocation.allocate`): each layer at least the policy's minimum and at most the context, the total
  exactly ``layers x budget``. All KV heads of a layer keep the layer's count. Where a layer's KV heads share its
  budget (``head_allocation='adakv'``), the threshold is one per sequence over every layer *and* KV head, keeping the
  top ``layers x kv_heads x budget``, and each layer keeps exactly the entries (tokens over its KV heads) at or
  above it, at least one per KV head: what the budgets pool, the threshold pools. With ``head_floor=0`` this is
  KVzip's own ranking (the paper's default, kvpress's ``KVzipPress(layerwise=False)``).

Pooling raw scores across layers assumes that a score means the same in every layer. That holds for scores that are
attention mass, whose scale the softmax sets (H2O's accumulated attention, SnapKV's and TOVA's window attention,
KVzip's reconstruction attention); it does not for key norms or distances (``knorm``, ``keydiff``), attention weighed
by value norms (``expected_attention``), ranks (``chunkkv``) or positions (``streaming``), whose scale differs from
layer to layer, so that the global threshold then follows that scale rather than importance.

Pure functions of budgets and ranking keys: the engine calls :func:`local_budgets` when it plans the run (and for
CAKE's measured preferences) with the rule that spreads a total over some layers, and :func:`global_budgets` at the
compression with every layer's ranking keys, computed as the eviction will compute them
(:func:`kvlab.engine.eviction.eviction_keys`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from kvlab.cache.allocation import allocate
from kvlab.cache.ranking import UNHELD

#: The layer budgets of some layers: ``(number of layers, their measured weights or None) -> budgets``.
Spread = Callable[[int, Sequence[float] | None], list[int]]


def placement_groups(layer_groups: Sequence[str]) -> list[list[int]]:
    """The layers of each placement group, the groups in the order of their first layer."""
    groups: dict[str, list[int]] = {}
    for layer, group in enumerate(layer_groups):
        groups.setdefault(group, []).append(layer)
    return list(groups.values())


def local_budgets(spread: Spread, layer_groups: Sequence[str], measured: Sequence[float] | None = None) -> list[int]:
    """Each layer's budget in the local scope: ``spread`` (the policy's shape or the cache's layer allocation) over
    each placement group's layers alone, at the group's share of the total (its layers x budget). ``measured`` are
    the allocation's per-layer weights over the whole model (a stored profile's entropies, CAKE's preferences), each
    group reading its own."""
    whole = spread(len(layer_groups), measured)
    groups = placement_groups(layer_groups)
    if len(groups) == 1:
        return whole
    budgets = list(whole)
    for layers in groups:
        own = None if measured is None else [measured[layer] for layer in layers]
        for layer, layer_budget in zip(layers, spread(len(layers), own)):
            budgets[layer] = layer_budget
    return budgets


def threshold_counts(
    rankings: Sequence[torch.Tensor], keep: int, device: torch.device, pool_heads: bool = False
) -> list[float]:
    """How many tokens of each layer one threshold keeps: the layers' keys (``(batch, kv_heads, slots)`` each, free
    slots at :data:`~kvlab.cache.ranking.UNHELD`) are gathered on ``device``, the ``keep``-th highest key of each
    sequence and KV head over all layers is the threshold (with ``pool_heads``, the ``keep x kv_heads``-th of each
    sequence over all layers and KV heads), and each layer counts its held slots at or above it, the mean over
    sequences and KV heads."""
    gathered = torch.cat([ranking.to(device) for ranking in rankings], dim=-1)
    batch, kv_heads, _ = gathered.shape
    pooled = gathered.reshape(batch, 1, -1) if pool_heads else gathered
    top = min(keep * kv_heads if pool_heads else keep, pooled.shape[-1])
    threshold = pooled.topk(top, dim=-1, sorted=False).values.amin(dim=-1, keepdim=True)
    kept = (gathered >= threshold) & (gathered != UNHELD)
    per_layer = torch.stack([part.sum(dim=-1) for part in kept.split([r.shape[-1] for r in rankings], dim=-1)])
    return per_layer.float().mean(dim=(1, 2)).tolist()


def split_counts(kept: Sequence[float], budget: int, minimum: int, capacity: int | None = None) -> list[int]:
    """Whole per-layer budgets from the counts one threshold kept: the minimum for every layer, and the rest of the
    total (``layers x budget``) in proportion to what each layer kept beyond the minimum (so a layer keeps its count,
    rounded, whenever every count reaches the minimum), at most ``capacity`` each
    (:func:`kvlab.cache.allocation.allocate`)."""
    return allocate([max(count - minimum, 0.0) for count in kept], budget, minimum, capacity)


def global_budgets(
    rankings: Sequence[torch.Tensor],
    budget: int,
    minimum: int,
    capacity: int | None,
    device: torch.device,
    pool_heads: bool = False,
) -> tuple[list[int], list[int] | None]:
    """The global scope's layer budgets at prefill mode's compression: every layer's ranking keys gathered on
    ``device`` under one threshold (:func:`threshold_counts`), the counts split into whole budgets
    (:func:`split_counts`). With ``pool_heads`` the threshold is one over the KV heads too, and the split is in
    entries (tokens summed over a layer's KV heads), so that each layer keeps exactly the entries the threshold
    gives it, at least one per KV head (not the policy's ``minimum`` per head: what a policy keeps by rule, its
    sinks, ranks first anyway, and a larger floor would move entries between layers that the ranking did not); the
    budgets are then those entries per KV head, rounded up, and the entries come second (else ``None``)."""
    kept = threshold_counts(rankings, budget * len(rankings), device, pool_heads)
    if not pool_heads:
        return split_counts(kept, budget, minimum, capacity), None
    heads = int(rankings[0].shape[1])
    most = None if capacity is None else capacity * heads
    entries = split_counts([count * heads for count in kept], budget * heads, heads, most)
    return [-(-layer_entries // heads) for layer_entries in entries], entries
