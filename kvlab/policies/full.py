"""The full cache: nothing is evicted. The reference every other policy is measured against."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvlab.policies.base import Policy


@dataclass
class Full(Policy):
    """Keep every token (sliding-window layers still drop what their window can no longer see, as transformers'
    own cache does)."""

    name: ClassVar[str] = "full"
    evicts: ClassVar[bool] = False
