"""Where a policy's scores meet the cache: the scores an eviction ranks by, and one layer cut back to its budget.

The policy scores the slots it sees (:class:`~kvlab.policies.base.LayerView`); the cache adds its noise floor
(:class:`~kvlab.cache.noise.NoiseFloor`); the tokens no query can see any more (outside a sliding window) and those an
ablation removes go first. The cache then chooses the victims and frees their slots by its own rules
(:meth:`kvlab.cache.heap.KVHeap.cut`, :meth:`~kvlab.cache.heap.KVHeap.compress`), the same for every policy.
Where the layers carry their windows' log-sum-exps, the victims are taken out of them before they are freed
(:func:`kvlab.attention.observe.forget_victims`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from kvlab.attention.observe import stacked_window_attention, victims_forgotten
from kvlab.cache.heap import KVHeap
from kvlab.cache.ranking import UNHELD, by_score_then_position, eviction_count
from kvlab.policies.base import LayerView, Policy


def eviction_scores(policy: Policy, view: LayerView, heap: KVHeap) -> torch.Tensor:
    """The scores a layer's slots are ranked by (higher kept): the policy's own with the cache's noise floor, the
    tokens no query can see any more (outside a sliding window) and those an ablation removes at ``-inf``."""
    positions = view.positions
    if policy.evicts:
        raw = policy.score(view)
        scores = heap.noise.perturb(view.cache, positions, raw, view.generator, policy.heads_share_ranking())
    else:
        scores = positions.float()
    window = view.cache.sliding_window
    if window is not None:
        scores = scores.masked_fill(positions <= view.next_position - window, float("-inf"))
    removed = policy.removed(view)
    if removed is not None:
        scores = scores.masked_fill(removed, float("-inf"))
    return scores


def evict_layer(heap: KVHeap, policy: Policy, view: LayerView) -> None:
    """Cut one layer back to its budget: free the tokens no query can see any more and those an ablation removes
    first, then the lowest-scoring ones. A layer that holds no more than the uniform budget keeps everything even if
    its own (PyramidKV) share is smaller: as in PyramidKV's reference code, compression starts only once the context
    exceeds the budget. The victims are chosen among the slots :meth:`~kvlab.policies.base.Policy.candidates` names
    (all by default); the heap counts the slots ranked and, outside static steps, times the scoring and selection."""
    count = eviction_count(view.cache, view.budget, view.uniform_budget)
    if count == 0:
        return
    clock = heap.ranking_clock(view.layer_idx)
    start, stop = policy.candidates(view, count) or (0, view.span)
    scores = eviction_scores(policy, view, heap)[..., start:stop]
    heap.cut(view.layer_idx, count, scores, start, clock, victims_forgotten(view.cache))


def evict_layers(heap: KVHeap, policy: Policy, views: Sequence[LayerView]) -> None:
    """Cut every layer back to its budget: all layers at once where the heap stacks them and the policy scores them
    alike (:func:`evict_stacked`), else one after another (:func:`evict_layer`)."""
    if not evict_stacked(heap, policy, views):
        for view in views:
            evict_layer(heap, policy, view)


def evict_stacked(heap: KVHeap, policy: Policy, views: Sequence[LayerView]) -> bool:
    """Cut every layer back to its budget in one ranking over the stacked layers (:mod:`kvlab.cache.stack`), where
    that chooses the victims layer-by-layer eviction would: a static step's heap of alike layers, a policy that
    scores layers alike with no candidates or ablation, every layer giving up the same number of tokens to the same
    budget and none with a sliding window. Whether it did."""
    if not policy.scores_layers_alike or not views:
        return False
    first = views[0]
    counts = {eviction_count(view.cache, view.budget, view.uniform_budget) for view in views}
    alike = all(
        (view.budget, view.uniform_budget, view.span) == (first.budget, first.uniform_budget, first.span)
        and view.cache.sliding_window is None
        for view in views
    )
    if len(counts) != 1 or not alike:
        return False
    count = counts.pop()
    if count == 0:
        return True
    if policy.candidates(first, count) is not None or policy.removes():
        return False
    stacked = heap.stacked_layer()
    if stacked is None:
        return False
    clock = heap.ranking_clock(0)
    votes = None
    if policy.query_window():
        votes = stacked_window_attention(heap.layers, first.span, heap.stack if heap.static else None)
    view = dataclasses.replace(first, layer_idx=0, cache=stacked, window_votes=votes)
    heap.cut_every_layer(count, eviction_scores(policy, view, heap), stacked, clock, victims_forgotten(stacked))
    return True


def compress_layer(heap: KVHeap, policy: Policy, view: LayerView) -> None:
    """Prefill mode's one compression of a layer (:meth:`kvlab.cache.heap.KVHeap.compress`): evicted in place, or
    what it keeps frozen at its precision, as the cache says."""
    count = eviction_count(view.cache, view.budget, view.uniform_budget)
    candidates = policy.candidates(view, count) if count else None
    heap.compress(view.layer_idx, count, lambda: eviction_scores(policy, view, heap), candidates, view.entries)


def eviction_keys(policy: Policy, views: Sequence[LayerView], heap: KVHeap) -> list[torch.Tensor]:
    """Every layer's slots keyed as its eviction ranks them (:func:`~kvlab.cache.ranking.by_score_then_position` of
    :func:`eviction_scores`; higher kept), free slots at :data:`~kvlab.cache.ranking.UNHELD`, each on its layer's
    device. The noise floor is drawn from copies of the views' generators, so that the eviction that follows draws
    the same noise and ranks by exactly these keys (the global eviction scope, :mod:`kvlab.cache.scopes`)."""
    copies: dict[int, torch.Generator] = {}
    keys = []
    for view in views:
        if id(view.generator) not in copies:
            copy = torch.Generator(device=view.generator.device)
            copy.set_state(view.generator.get_state())
            copies[id(view.generator)] = copy
        ranked = dataclasses.replace(view, generator=copies[id(view.generator)])
        key = by_score_then_position(eviction_scores(policy, ranked, heap), ranked.positions)
        keys.append(key.masked_fill(ranked.positions < 0, UNHELD))
    return keys
