"""Where kvlab keeps a user's files when no path is given: the XDG base directories, with an override each."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path


def user_file(env: Mapping[str, str], override: str, xdg_variable: str, fallback: str, *parts: str) -> Path:
    """``$override`` when set; else ``parts`` under ``$xdg_variable`` when that is an absolute path (relative ones
    are ignored, as the XDG specification says); else ``parts`` under ``~/<fallback>``."""
    explicit = env.get(override)
    if explicit:
        return Path(explicit).expanduser()
    base_text = env.get(xdg_variable)
    base = Path(base_text) if base_text and Path(base_text).is_absolute() else Path.home() / fallback
    return base.joinpath(*parts)
