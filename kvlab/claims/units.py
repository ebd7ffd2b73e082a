"""Figures as text, written the same way in every claim: shares and token counts (bytes are :mod:`kvlab.units`'s)."""

from __future__ import annotations


def percent(share: float, digits: int = 0) -> str:
    """A share as a percentage: ``0.0875`` is ``9%`` (``8.75%`` with two digits)."""
    return f"{100 * share:.{digits}f}%"


def tokens(count: int) -> str:
    """A token count with thousands separators: ``131,072 tokens``."""
    return f"{count:,} tokens"
