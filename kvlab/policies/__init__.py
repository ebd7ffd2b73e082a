"""Eviction policies: one small dataclass per method (:mod:`kvlab.policies.base`), registered by name
(:mod:`kvlab.policies.registry`), and the variants a user names with the cache options they run with
(:mod:`kvlab.policies.variants`)."""

from kvlab.policies.base import LayerView, Policy
from kvlab.policies.registry import (
    POLICIES,
    configure,
    evicting,
    is_full_cache,
    make_policy,
    parse_params,
    policy_class,
    register_policy,
    sparse_readers,
)
from kvlab.policies.scoring import ScoringPolicy
from kvlab.policies.variants import Variant

__all__ = [
    "POLICIES",
    "LayerView",
    "Policy",
    "ScoringPolicy",
    "Variant",
    "configure",
    "evicting",
    "is_full_cache",
    "make_policy",
    "parse_params",
    "policy_class",
    "register_policy",
    "sparse_readers",
]
