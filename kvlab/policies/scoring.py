"""Policies that rank the cached tokens by a score, and so take the cache's options.

Every policy but the full cache, the ablations and the sparse readers ranks tokens by a score; such a policy takes
any of the cache options (:class:`~kvlab.cache.spec.CacheOptions`: layer and head allocation, scope, precision and
demotion tiers, a noise floor) beside its own parameters. The options belong to the cache, not to the policy: a
run's :class:`~kvlab.engine.spec.RunSpec` carries them in its cache spec, and :func:`kvlab.policies.variants.configure`
splits a ``key=value`` list into the two.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvlab.policies.base import Policy


@dataclass
class ScoringPolicy(Policy):
    """A policy that ranks the cached tokens by a score (see the module's description)."""

    ranks: ClassVar[bool] = True
