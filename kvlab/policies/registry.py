"""The policies by name: the one place that knows which policies exist, which evict, which read sparsely and which
is the full cache. A policy written outside kvlab joins with :func:`register_policy`."""

from __future__ import annotations

from typing import TypeVar

from kvlab.cache.spec import CacheOptions
from kvlab.errors import KvlabError
from kvlab.params import coerce, names
from kvlab.policies.base import Policy, check_fields
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
from kvlab.policies.variants import Variant, published_options

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


PolicyClass = TypeVar("PolicyClass", bound=type[Policy])


def register_policy(cls: PolicyClass) -> PolicyClass:
    """Add a policy class to the registry under its ``name`` (a class decorator), so that every command, sweep and
    page can run it by name; a name already taken by another class is one sentence."""
    if not cls.name:
        raise KvlabError(f"Policy class {cls.__name__} has no name; set name: ClassVar[str] = '...'.")
    known = POLICIES.get(cls.name)
    if known is not None and known is not cls:
        raise KvlabError(f"A policy named {cls.name!r} exists already ({known.__name__}); choose another name.")
    POLICIES[cls.name] = cls
    return cls


def evicting() -> tuple[str, ...]:
    """The policies that evict to a budget, in registry order: every method; not the full cache, nor the ablations,
    which take no budget, nor the sparse readers, whose budget is what they read per decoded token."""
    return tuple(name for name, cls in POLICIES.items() if cls.evicts and not cls.reads_sparsely)


def sparse_readers() -> tuple[str, ...]:
    """The policies that read a selection of the held tokens for each decoded token (:mod:`kvlab.cache.sparse`)."""
    return tuple(name for name, cls in POLICIES.items() if cls.reads_sparsely)


def is_full_cache(name: str) -> bool:
    """Whether runs of the policy called ``name`` keep every token (a name no longer registered, from an older
    store, counts as evicting)."""
    return POLICIES.get(name) is Full


def policy_class(name: str) -> type[Policy]:
    """The policy class called ``name`` (any case); an unknown name is one sentence listing the known ones."""
    cls = POLICIES.get(name.lower())
    if cls is None:
        raise KvlabError(f"Unknown policy {name!r}; choose one of: {', '.join(POLICIES)}.")
    return cls


def make_policy(name: str, **params: object) -> Policy:
    """Build a policy by name with its own keyword parameters; unknown names and parameters raise one clear sentence
    (a cache option names :func:`kvlab.policies.variants.configure`, which takes both)."""
    cls = policy_class(name)
    from_options = [key for key in params if cls.ranks and key in CacheOptions.names()]
    if from_options:
        raise KvlabError(
            f"{', '.join(map(repr, from_options))} of policy {cls.name!r} belong to the cache, not the policy; use "
            f"configure({cls.name!r}, ...) or RunSpec(cache=CacheSpec(options=CacheOptions(...)))."
        )
    check_fields(cls, params)
    return cls(**params)


def configure(name: str, **params: object) -> Variant:
    """A variant of the policy called ``name`` with keyword parameters, the policy's own and (for a policy that
    ranks) the cache's options; unknown names and bad values raise one clear sentence."""
    cls = policy_class(name)
    options = set(CacheOptions.names()) if cls.ranks else set()
    _check_known(cls, params, options)
    own = {key: value for key, value in params.items() if key not in options}
    cache = {key: value for key, value in params.items() if key in options}
    return Variant(cls(**own), published_options(cls, **cache))


def parse_params(policy: str, pairs: list[str]) -> dict[str, object]:
    """Parse ``key=value`` strings into a policy's typed parameters (its own, and the cache options it takes)."""
    cls = policy_class(policy)
    options = set(CacheOptions.names()) if cls.ranks else set()
    params: dict[str, object] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise KvlabError(f"Policy parameters are written key=value, not {pair!r}.")
        _check_known(cls, {key: value}, options)
        owner = CacheOptions if key in options else cls
        params[key] = coerce(owner, key, value, f"policy {cls.name!r}")
    return params


def _check_known(cls: type[Policy], params: dict[str, object], options: set[str]) -> None:
    """Reject parameter names that are neither the policy's nor (for a policy that ranks) a cache option's, naming
    the ones it takes."""
    unknown = sorted(set(params) - set(names(cls)) - options)
    if unknown:
        accepted = ", ".join(sorted([*names(cls), *options])) or "none"
        raise KvlabError(
            f"Policy {cls.name!r} has no parameter {', '.join(map(repr, unknown))}; its parameters are: {accepted}."
        )
