"""The one position state of a run, as gpt-fast's ``input_pos``: where the next token goes, and the original
positions of the tokens the forward pass in flight appends.

The heap writes those positions into the slots it fills, attention builds its masks from them, and static decoding
advances them on the device. Survivors of an eviction keep their original positions and every new token gets its
true one (the tokens seen before it), never the cache's length.

On a model split over devices each layer reads the positions on its own device: they are copied there once per
forward pass, the first time a layer on that device asks (:meth:`Positions.on`).
"""

from __future__ import annotations

import torch


class Positions:
    """Tokens seen so far (a host count: the position the next token gets) and the positions of the forward pass in
    flight, ``(q,)`` ``int64`` on each device a layer of it runs on. ``last`` is the host's value of the pass's last
    position, or ``-1`` where only the device knows it (a captured static step)."""

    def __init__(self, seen: int = 0) -> None:
        self.seen = seen
        self.last = -1
        self._current: dict[torch.device, torch.Tensor] = {}
        self._slot_values: dict[torch.device, torch.Tensor] = {}

    def begin(self, positions: torch.Tensor, last: int) -> None:
        """Declare the positions ``(q,)`` of the tokens the next forward pass appends (consecutive from :attr:`seen`;
        a device tensor, so that a captured step can advance it) and the host's value of the last one."""
        self._current = {positions.device: positions}
        self._slot_values = {}
        self.last = last

    def end(self, count: int) -> None:
        """Count the ``count`` tokens the pass appended as seen (no device synchronisation)."""
        self.seen += count
        self._current = {}
        self._slot_values = {}

    def advance(self, count: int) -> None:
        """Count ``count`` tokens as seen without a forward pass on the host (a replayed static step appended them)."""
        self.seen += count

    def on(self, device: torch.device) -> torch.Tensor:
        """The pass's positions on ``device`` (copied there the first time a layer on it asks)."""
        assert self._current, "begin() declares the positions of every forward pass"
        return on_device(self._current, device)

    def slot_values(self, device: torch.device) -> torch.Tensor:
        """The pass's positions as the heap stores them in its slots (``int32``), on ``device``."""
        found = self._slot_values.get(device)
        if found is None:
            found = self._slot_values[device] = self.on(device).to(torch.int32)
        return found


def on_device(copies: dict[torch.device, torch.Tensor], device: torch.device) -> torch.Tensor:
    """The tensor ``copies`` holds, on ``device``: copied there (and kept in ``copies``) the first time a layer on that
    device asks, so that a forward pass of a model split over devices copies it once per device."""
    found = copies.get(device)
    if found is None:
        found = copies[device] = next(iter(copies.values())).to(device)
    return found
