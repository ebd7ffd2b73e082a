"""Finding a preset by what a user typed: its full name, or the start of exactly one name (``H200`` for
``H200 141GB``), or the first of several names that start with it in the presets' order (``H100`` for
``H100 SXM 80GB``, listed before the PCIe card), so that the command line accepts the short names people use."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeVar

from kvlab.errors import KvlabError

T = TypeVar("T")


def preset_name(presets: Mapping[str, T], typed: str, kind: str) -> str:
    """The name of the preset ``typed`` means (case ignored); an unknown one is one sentence listing the names."""
    lowered = typed.strip().lower()
    exact = [name for name in presets if name.lower() == lowered]
    starting = [name for name in presets if name.lower().startswith(lowered)] if lowered else []
    if exact or starting:
        return (exact or starting)[0]
    raise KvlabError(f"Unknown {kind} preset {typed!r}; use one of {', '.join(presets)}.")
