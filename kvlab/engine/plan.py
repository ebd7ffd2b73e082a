"""A run's plan, made before the first token is read: the budget in tokens, how it is spread over layers, how many
slots each layer's heap allocates, what attention must observe for the policy, and which measurements decide the
layer budgets at prefill mode's compression.

Planning once is what lets the heap allocate once and write in place: in streaming mode a layer holds at most its
budget (or, on sliding-window layers, the window) plus one chunk; in prefill mode everything until the one
compression, which then leaves room for the question and the tokens to generate. This module is where the engine
reads the cache's options (:class:`~kvlab.cache.spec.CacheOptions`): the rest of the engine follows the plan and
asks the heap, whose layers the options built.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from kvlab.cache.allocation import CAKE_WINDOW
from kvlab.cache.heap import Observed
from kvlab.cache.scopes import local_budgets
from kvlab.cache.sparse import SparseRead
from kvlab.cache.spec import CacheOptions, CacheSpec
from kvlab.engine.spec import RunSpec
from kvlab.models.arch import ArchFacts
from kvlab.models.loading import LoadedModel
from kvlab.models.profiles import Profile, ProfiledModel, require_profile
from kvlab.modes import PREFILL, STREAMING
from kvlab.policies.base import Policy, check_budget
from kvlab.policies.variants import Variant

#: A layer budget that never cuts anything.
NO_BUDGET = 1 << 62


@dataclass(frozen=True)
class Plan:
    """What a run decides before reading: ``budget_tokens`` (``None``: nothing to evict), the sparse ``reader`` and
    the tokens each layer holds per KV head (``held_tokens``; a sparse reader's own, else the budget), whether it
    evicts to a budget, whether evictions can free anything at all (``prunes``: a budget, sliding-window layers, or
    tokens the policy never keeps), whether the model has sliding-window layers (``windows``: what they no longer
    see is dropped after every forward pass in every mode, the full cache included), the layer budgets, each layer's
    planned slots and the room a compaction leaves, what attention observes, and what decides the layer budgets anew
    at the compression (``rebudget``: ``prompt`` for CAKE's preferences measured from the prompt, ``global`` for one
    threshold over every layer, ``None``), whether that threshold is one over the KV heads too (``pools_heads``:
    Ada-KV's heads share their layer's budget), and whether the scores split the kept tokens into precision tiers
    (``tiered``: the compression then ranks even where it evicts nothing)."""

    budget_tokens: int | None
    reader: SparseRead | None
    held_tokens: int | None
    evicting: bool
    prunes: bool
    windows: bool
    layer_budgets: tuple[int, ...]
    capacities: tuple[int, ...]
    room: int
    span: int
    observed: Observed
    rebudget: Literal["prompt", "global"] | None
    pools_heads: bool
    tiered: bool


def plan_run(
    spec: RunSpec,
    loaded: LoadedModel,
    context_tokens: int,
    suffix_tokens: int,
    observe_for: Sequence[Variant] = (),
) -> Plan:
    """The plan of a run of ``spec`` over ``context_tokens`` (and a question of ``suffix_tokens``) on ``loaded``
    (its layers, their placement groups, and the stored attention profile an ``entropy`` allocation follows, refused
    in one sentence when there is none); ``observe_for`` are further variants whose needs the heap must also observe
    (a context read once for several, :func:`kvlab.engine.generation.prefill_once`)."""
    policy, options, arch = spec.policy, spec.cache.options, loaded.arch
    profile = layer_profile(loaded, spec.cache)
    span = context_tokens + suffix_tokens + spec.max_new_tokens
    budget_tokens = check_budget(policy, spec.budget, context_tokens)
    reader = policy.sparse_read(budget_tokens, span) if budget_tokens is not None else None
    held_tokens = budget_tokens if reader is None else reader.held
    evicting = held_tokens is not None
    if held_tokens is None:
        layer_budgets = [NO_BUDGET] * arch.num_layers
    else:
        measured = None if profile is None else profile.entropy
        layer_budgets = local_budgets(
            lambda layers, own: spread(policy, options, held_tokens, layers, context_tokens, own),
            loaded.layer_groups,
            measured,
        )
    capacities, room = _capacities(spec, arch, layer_budgets, held_tokens, context_tokens, span)
    compresses = evicting or options.freezes or policy.removes() > 0
    observed = [*([Variant(policy, options)] if compresses else []), *observe_for]
    return Plan(
        budget_tokens=budget_tokens,
        reader=reader,
        held_tokens=held_tokens,
        evicting=evicting,
        prunes=evicting or bool(arch.sliding_layers) or policy.removes() > 0,
        windows=bool(arch.sliding_layers),
        layer_budgets=tuple(layer_budgets),
        capacities=tuple(capacities),
        room=room,
        span=span,
        observed=Observed(
            scores=any(variant.policy.needs_scores for variant in observed),
            query_window=max((observed_window(variant) for variant in observed), default=0),
            query_moments=any(variant.policy.needs_query_moments for variant in observed),
        ),
        rebudget=(
            None
            if not evicting
            else "prompt"
            if options.measures_layers == "prompt"
            else "global"
            if options.global_scope
            else None
        ),
        pools_heads=options.pools_heads,
        tiered=options.tiered,
    )


def layer_profile(loaded: ProfiledModel, cache: CacheSpec) -> Profile | None:
    """The stored attention profile the cache's layer allocation follows (``entropy``), else ``None``; a model without
    one is refused in one sentence naming the command that measures it, before anything runs."""
    return require_profile(loaded) if cache.options.measures_layers == "profile" else None


def observed_window(variant: Variant) -> int:
    """How many recent queries a run must remember for ``variant``: its policy's own observation window, and CAKE's
    when its layer budgets follow the prompt's attention."""
    cake = CAKE_WINDOW if variant.options.measures_layers == "prompt" else 0
    return max(variant.policy.query_window(), cake)


def spread(
    policy: Policy,
    options: CacheOptions,
    budget: int,
    num_layers: int,
    capacity: int | None,
    measured: Sequence[float] | None,
) -> list[int]:
    """``num_layers`` layer budgets at the same total as ``budget`` each: the policy's own shape (PyramidKV) or the
    cache's layer allocation (``measured``: its per-layer weights, a profile's entropies or CAKE's preferences)."""
    if policy.own_layer_budgets:
        return policy.layer_budgets(budget, num_layers, capacity)
    return options.layer_budgets(
        budget, num_layers, policy.min_budget(), capacity, None if measured is None else list(measured)
    )


def _capacities(
    spec: RunSpec,
    arch: ArchFacts,
    layer_budgets: Sequence[int],
    held_tokens: int | None,
    context_tokens: int,
    span: int,
) -> tuple[list[int], int]:
    """Slots per layer, and the room a compaction leaves for the tokens still to come between evictions. A layer of
    PyramidKV that holds no more than the uniform budget keeps everything, so its capacity covers the uniform budget
    too."""
    chunk = spec.chunk_size(context_tokens)
    uniform = held_tokens if held_tokens is not None else NO_BUDGET
    capacities = []
    for layer, budget in enumerate(layer_budgets):
        keep = max(budget, uniform)
        if arch.is_sliding(layer) and arch.sliding_window is not None:
            keep = min(keep, arch.sliding_window - 1)
        capacities.append(span if spec.mode == PREFILL else min(span, keep + chunk))
    room = chunk if spec.mode == STREAMING else span - context_tokens
    return capacities, room
