"""The operator's whole-number settings, read from the environment one way.

A server's operator tightens or raises kvlab's bounds with environment variables (the longest prompt, the largest
file read, the most trials a sweep may plan, the most rows an export may hold). Each is unset or empty for its
default, or a positive whole number; anything else is one sentence naming the variable, never a silent default.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from kvlab.errors import KvlabError


def positive_setting(name: str, unit: str, env: Mapping[str, str] = os.environ) -> int | None:
    """The setting ``name`` (a number of ``unit``), or None where it is unset or empty."""
    text = env.get(name, "").strip()
    if not text:
        return None
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise KvlabError(f"{name} must be a positive whole number of {unit}, not {text[:40]!r}.")
    return value
