"""Figures as text with their units, written the same way in every claim."""

from __future__ import annotations

from kvlab.costs.gpus import GIB

GB = 1e9
KB = 1e3


def gigabytes(size: float) -> str:
    """Bytes in decimal and binary gigabytes, since the articles' "GB" may mean either: ``42.9 GB (40.0 GiB)``."""
    return f"{size / GB:,.1f} GB ({size / GIB:,.1f} GiB)"


def percent(share: float, digits: int = 0) -> str:
    """A share as a percentage: ``0.0875`` is ``9%`` (``8.75%`` with two digits)."""
    return f"{100 * share:.{digits}f}%"


def tokens(count: int) -> str:
    """A token count with thousands separators: ``131,072 tokens``."""
    return f"{count:,} tokens"
