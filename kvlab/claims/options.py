"""The cache options of a stored run, read from its policy parameters without torch.

Every scoring policy takes the same cache options (:class:`kvlab.policies.scoring.ScoringPolicy`: layer and head
allocations, precision tiers, a noise floor) and stores only those that differ from their defaults, so a run of the
policy as published stores none. The defaults are written here so that reading a store needs no torch; the tests
check them against the policies'.
"""

from __future__ import annotations

import json
from typing import Any

#: Every cache option with its default, in the policies' order.
CACHE_DEFAULTS: dict[str, Any] = {
    "layer_allocation": "uniform",
    "scope": "local",
    "head_allocation": "uniform",
    "hot": 1.0,
    "key_bits": 16,
    "value_bits": 16,
    "quant_group": 32,
    "noise": "none",
    "noise_scale": 0.0,
    "cpu_tier_mib": 0.0,
    "disk_tier_mib": 0.0,
    "page_tokens": 16,
    "recall_pages": 8,
    "page_summary": "minmax",
    "promote": True,
    "prefetch": False,
}


def params_of(policy_params: object) -> dict[str, Any]:
    """A run's stored parameters (JSON text; anything else, a missing value, is none) as a mapping."""
    value = json.loads(policy_params) if isinstance(policy_params, str) and policy_params else {}
    return value if isinstance(value, dict) else {}


def cache_options(policy_params: object) -> dict[str, Any]:
    """Every cache option of a run, its defaults filled in."""
    stored = params_of(policy_params)
    return {name: stored.get(name, default) for name, default in CACHE_DEFAULTS.items()}


def variant(policy: str, policy_params: object) -> str:
    """A run's policy as ``kvlab sweep --policies`` names it: ``h2o`` as published, ``h2o[hot=0.25,key_bits=4]``
    with the cache options it changed. The policy's own parameters are left out, as the needle table always has."""
    stored = params_of(policy_params)
    changed = [f"{name}={_shown(stored[name])}" for name in CACHE_DEFAULTS if name in stored]
    return f"{policy}[{','.join(changed)}]" if changed else policy


def _shown(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)
