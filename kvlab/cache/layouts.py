"""The KV heap's layouts: what becomes of the slots that eviction frees (:mod:`kvlab.cache.heap` implements them).

Kept apart from the heap so that the command line, the dashboard's widgets and stored runs name and describe the
layouts without loading torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from kvlab.errors import KvlabError

Layout = Literal["compact", "bitmask", "threshold"]
LAYOUTS: tuple[str, ...] = get_args(Layout)
DEFAULT_LAYOUT: Layout = "threshold"
DEFAULT_COMPACT_AT = 0.5
#: The layouts in one sentence each, for the command line's and the dashboard's help.
LAYOUT_HELP = (
    "What becomes of evicted slots. compact: survivors gathered to the front after each eviction, memory returned, "
    "at the cost of a copy. bitmask: slots marked free and refilled in place, no copy, memory held. threshold: "
    "bitmask until the dead share (free slots among those in use) reaches the threshold, then compact."
)


@dataclass(frozen=True)
class HeapLayout:
    """How freed slots are handled (see the module's docstring); ``compact_at`` is the threshold layout's dead
    share."""

    kind: Layout = DEFAULT_LAYOUT
    compact_at: float = DEFAULT_COMPACT_AT

    def __post_init__(self) -> None:
        if self.kind not in LAYOUTS:
            raise KvlabError(f"Unknown layout {self.kind!r}; use one of {', '.join(LAYOUTS)}.")
        if not 0.0 < self.compact_at <= 1.0:
            raise KvlabError(f"The threshold layout compacts at a dead share in (0, 1], not {self.compact_at}.")

    def compacts(self, dead: int, used: int) -> bool:
        """Whether a layer with ``dead`` free slots among ``used`` is compacted now."""
        if dead == 0 or self.kind == "bitmask":
            return False
        return self.kind == "compact" or dead / used >= self.compact_at
