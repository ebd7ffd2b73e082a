"""A variant: a policy and the cache options it runs with, as a user names it.

On the command line a scoring policy takes the cache's options beside its own parameters (``--param hot=0.25``,
``h2o[hot=0.25,key_bits=4]`` in a sweep), and the dashboard draws both; a run stores them together as its policy's
parameters. They still belong to two objects: the policy scores, the cache stores (:mod:`kvlab.cache.spec`).
:func:`kvlab.policies.registry.configure` splits a list of parameters into the two; a :class:`Variant` keeps the pair,
checked together, and gives the parameters a run of it stores (:meth:`Variant.params`).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvlab.cache.layouts import DEFAULT_COMPACT_AT, DEFAULT_LAYOUT
from kvlab.cache.spec import CacheOptions, CacheSpec
from kvlab.policies.base import Policy, check_fields


def published_options(policy: Policy | type[Policy], **given: object) -> CacheOptions:
    """The cache options of ``policy`` as its paper ranks: the cache's defaults, then the policy's own
    (:attr:`~kvlab.policies.base.Policy.cache_defaults`), then ``given``, the options a user names."""
    return CacheOptions(**{**policy.cache_defaults, **given})  # type: ignore[arg-type]


@dataclass(frozen=True)
class Variant:
    """A policy with the cache options it runs with (:meth:`published`: the policy as its paper ranks)."""

    policy: Policy
    options: CacheOptions

    def __post_init__(self) -> None:
        check_options(self.policy, self.options)

    @classmethod
    def published(cls, policy: Policy) -> Variant:
        """The policy with the cache options its paper ranks with (:func:`published_options`)."""
        return cls(policy, published_options(policy))

    @property
    def name(self) -> str:
        return self.policy.name

    def params(self) -> dict[str, object]:
        """The parameters a run of the variant stores: the policy's own, and the cache options that differ from
        their defaults (a run that uses none is the run it was before the options existed)."""
        return {**self.options.stored(), **self.policy.params()}

    def cache(self, layout: str = DEFAULT_LAYOUT, compact_at: float = DEFAULT_COMPACT_AT) -> CacheSpec:
        """The cache spec of a run of the variant in ``layout``."""
        return CacheSpec(layout, compact_at, self.options)

    def check_mode(self, mode: str) -> None:
        """Refuse, in one sentence, a mode the policy or its cache options cannot run in."""
        self.policy.check_mode(mode)
        self.options.check_mode(self.policy.name, mode)


def as_variant(chosen: Policy | Variant) -> Variant:
    """A variant as given, or a policy alone as its published variant (:meth:`Variant.published`)."""
    return chosen if isinstance(chosen, Variant) else Variant.published(chosen)


def check_options(policy: Policy, options: CacheOptions) -> None:
    """Refuse, in one sentence, cache options that the policy cannot take: any, for a policy that does not rank
    tokens by a score; values out of bounds or that cannot go together; an allocation beside one of the policy's own
    or against its need for equal layer budgets."""
    if options.stored() and not policy.ranks:
        check_fields(type(policy), options.stored())
    options.check(
        policy.name, own_layer_budgets=policy.own_layer_budgets, equal_layer_budgets=policy.equal_layer_budgets()
    )
