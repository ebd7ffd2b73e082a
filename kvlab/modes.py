"""The two modes a cache is compressed in while a prompt is read, named and described once.

A stored run's ``mode`` column, the command line's ``--mode``, the dashboard's mode choices and the claims that
compare modes all spell them from here, so a mode cannot be misspelt in one place and found nowhere else.
"""

from __future__ import annotations

from typing import Final, Literal

from kvlab.errors import KvlabError

Mode = Literal["prefill", "streaming"]
#: The context is read (in chunks or at once), then compressed once to the budget.
PREFILL: Final = "prefill"
#: The context is read chunk by chunk and the cache compressed after every chunk and generated token.
STREAMING: Final = "streaming"
#: Every mode, in the order the command line and the dashboard list them.
MODES: tuple[Mode, ...] = (PREFILL, STREAMING)
#: What each mode does, as the dashboard's help and the command line's say it.
MODE_TEXT: dict[Mode, str] = {
    PREFILL: "the whole prompt is read, then compressed once; peak memory is the full prompt",
    STREAMING: "the budget holds all the time, evicting after every chunk and token",
}


def check_mode(name: str) -> Mode:
    """``name`` as a :data:`Mode`; any other name is one sentence."""
    for mode in MODES:
        if name == mode:
            return mode
    raise KvlabError(f"Unknown mode {name!r}; use {' or '.join(repr(mode) for mode in MODES)}.")


def modes_help(order: tuple[Mode, ...] = MODES) -> str:
    """Every mode with what it does, in ``order``: ``prefill: the whole prompt is read, ... streaming: ...``."""
    return " ".join(f"{mode}: {MODE_TEXT[mode]}." for mode in order)
