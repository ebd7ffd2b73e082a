"""Where kvlab's files are: the files it ships inside its package, and a user's files when no path is given.

Everything kvlab ships (the default model, the haystacks, RULER's word lists, attention profiles, the example and
evidence runs) lies in ``kvlab/data/`` and is installed with the package, so a wheel works like a checkout;
:func:`shipped` is the one way to find it. A user's files follow the XDG base directories, with an override each.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

#: The folder of the files kvlab ships, inside the installed package.
SHIPPED_DIR = Path(__file__).resolve().parent / "data"


def shipped(*parts: str) -> Path:
    """A file or folder kvlab ships: ``shipped("models", "kvlab-tiny-llama")``, ``shipped("haystacks")``."""
    return SHIPPED_DIR.joinpath(*parts)


def user_file(env: Mapping[str, str], override: str, xdg_variable: str, fallback: str, *parts: str) -> Path:
    """``$override`` when set; else ``parts`` under ``$xdg_variable`` when that is an absolute path (relative ones
    are ignored, as the XDG specification says); else ``parts`` under ``~/<fallback>``."""
    explicit = env.get(override)
    if explicit:
        return Path(explicit).expanduser()
    base_text = env.get(xdg_variable)
    base = Path(base_text) if base_text and Path(base_text).is_absolute() else Path.home() / fallback
    return base.joinpath(*parts)
