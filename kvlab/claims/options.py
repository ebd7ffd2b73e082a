"""The cache options of a stored run (read from its policy parameters) or of a benchmark's configuration, without torch.

Every scoring policy takes the same cache options (:class:`kvlab.cache.spec.CacheOptions`: layer and head
allocations, precision tiers, a noise floor, demotion) and a run stores only those that differ from their defaults
beside its policy's own parameters, so a run of the policy as published stores none. The options and their defaults
are declared once, torch-free, in :mod:`kvlab.cache.spec`.
"""

from __future__ import annotations

import json
from typing import Any

from kvlab.cache.spec import CacheOptions


def params_of(policy_params: object) -> dict[str, Any]:
    """A run's stored parameters (JSON text; anything else, a missing value, is none) as a mapping."""
    value = json.loads(policy_params) if isinstance(policy_params, str) and policy_params else {}
    return value if isinstance(value, dict) else {}


def cache_options(policy_params: object) -> dict[str, Any]:
    """Every cache option of a run, its defaults filled in."""
    stored = params_of(policy_params)
    return {name: stored.get(name, default) for name, default in CacheOptions.defaults().items()}


def variant(policy: str, policy_params: object) -> str:
    """A run's policy as ``kvlab sweep --policies`` names it: ``h2o`` as published, ``h2o[hot=0.25,key_bits=4]``
    with the cache options it changed. The policy's own parameters are left out, as the needle table always has."""
    stored = params_of(policy_params)
    changed = [f"{name}={_shown(stored[name])}" for name in CacheOptions.names() if name in stored]
    return f"{policy}[{','.join(changed)}]" if changed else policy


def _shown(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def demotes_to_disk(stored: dict[str, Any]) -> bool:
    """Whether a configuration with these options (as a benchmark stores them) demotes evicted tokens to an offload
    file."""
    return CacheOptions.from_stored(stored).disk_tier_mib > 0.0


def precision_tier(policy_params: object) -> str:
    """A run's cache precision as readers name it: ``bf16``, or ``K int4 · V int2`` for a quantised tier, with the
    share of kept tokens its ``hot`` tier holds at full precision when that is neither none nor all."""
    options = cache_options(policy_params)
    key, value, hot = options["key_bits"], options["value_bits"], options["hot"]
    if key == 16 and value == 16 or hot >= 1.0:
        return "bf16"
    text = f"K int{key} · V int{value}".replace("int16", "bf16")
    return f"{text} (hot {hot:.0%} bf16)" if hot > 0 else text
