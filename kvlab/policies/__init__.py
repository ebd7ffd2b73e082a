"""Eviction policies by name, with their parameters settable from Python and the command line."""

from __future__ import annotations

import dataclasses
import typing

from kvlab.errors import KvlabError
from kvlab.policies.base import LayerView, Policy, check_fields, evict_layer, eviction_count
from kvlab.policies.chunkkv import ChunkKV
from kvlab.policies.drop_first import DropFirst
from kvlab.policies.drop_pillars import DropPillars
from kvlab.policies.expected_attention import ExpectedAttention
from kvlab.policies.full import Full
from kvlab.policies.generational import Generational
from kvlab.policies.h2o import H2O
from kvlab.policies.keydiff import KeyDiff
from kvlab.policies.knorm import Knorm
from kvlab.policies.kvzip import KVzip
from kvlab.policies.quest import Quest
from kvlab.policies.random import RandomPolicy
from kvlab.policies.rocketkv import RocketKV
from kvlab.policies.snapkv import PyramidKV, SnapKV
from kvlab.policies.streaming import Streaming
from kvlab.policies.tova import TOVA

POLICIES: dict[str, type[Policy]] = {
    cls.name: cls
    for cls in (
        Full,
        Streaming,
        H2O,
        Generational,
        SnapKV,
        PyramidKV,
        TOVA,
        Knorm,
        KeyDiff,
        ExpectedAttention,
        ChunkKV,
        KVzip,
        Quest,
        RocketKV,
        RandomPolicy,
        DropFirst,
        DropPillars,
    )
}

#: The policies that evict to a budget, in registry order: every method; not the full cache, nor the first-token
#: ablation, which takes no budget, nor the sparse readers, whose budget is what they read per decoded token.
EVICTING: tuple[str, ...] = tuple(name for name, cls in POLICIES.items() if cls.evicts and not cls.reads_sparsely)
#: The policies that read a selection of the held tokens for each decoded token (:mod:`kvlab.cache.sparse`).
SPARSE_READERS: tuple[str, ...] = tuple(name for name, cls in POLICIES.items() if cls.reads_sparsely)

__all__ = [
    "EVICTING",
    "POLICIES",
    "SPARSE_READERS",
    "LayerView",
    "Policy",
    "evict_layer",
    "eviction_count",
    "is_full_cache",
    "make_policy",
    "parse_params",
]


def is_full_cache(name: str) -> bool:
    """Whether runs of the policy called ``name`` keep every token (a name no longer registered, from an older
    store, counts as evicting)."""
    cls = POLICIES.get(name)
    return cls is Full


def make_policy(name: str, **params: object) -> Policy:
    """Build a policy by name with keyword parameters; unknown names and parameters raise one clear sentence."""
    cls = POLICIES.get(name.lower())
    if cls is None:
        raise KvlabError(f"Unknown policy {name!r}; choose one of: {', '.join(POLICIES)}.")
    check_fields(cls, params)
    return cls(**params)


def _coerce(policy: str, field: dataclasses.Field, text: str) -> object:
    """Turn a command-line string into the type the policy's parameter declares."""
    kind = typing.get_type_hints(POLICIES[policy])[field.name]
    try:
        if kind is bool:
            if text.lower() in ("1", "true", "yes", "on"):
                return True
            if text.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(text)
        return kind(text)
    except ValueError:
        expected = {int: "a whole number", float: "a number", bool: "true or false"}.get(kind, "a string")
        raise KvlabError(f"Parameter {field.name!r} of policy {policy!r} must be {expected}, not {text!r}.") from None


def parse_params(policy: str, pairs: list[str]) -> dict[str, object]:
    """Parse ``key=value`` strings into a policy's typed parameters."""
    cls = POLICIES.get(policy.lower())
    if cls is None:
        raise KvlabError(f"Unknown policy {policy!r}; choose one of: {', '.join(POLICIES)}.")
    by_name = {f.name: f for f in dataclasses.fields(cls)}
    params: dict[str, object] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise KvlabError(f"Policy parameters are written key=value, not {pair!r}.")
        check_fields(cls, {key: value})
        params[key] = _coerce(cls.name, by_name[key], value)
    return params
