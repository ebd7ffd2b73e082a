"""One device, many sessions: a first-come, first-served queue that lets one session at a time run on it.

Every Streamlit session runs its script in its own thread of one server process, and all of them share the loaded
models (one copy per process). Two runs on one GPU at once would compete for its memory and make each other's
timings meaningless, so runs take a :class:`Ticket` and wait their turn; while waiting, the session is told how many
runs are ahead of it and what the one in progress is doing. A session that goes away while waiting or running (the
user stops it, reloads or leaves) gives its place up, because the ticket is released in a ``finally``.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from itertools import count

_ticket_numbers = count(1)


@dataclass
class Ticket:
    """A place in the queue. ``label`` says what the run is; its holder updates ``progress`` (0 to 1) so that
    waiting sessions can see how far the run ahead of them is."""

    label: str
    number: int = field(default_factory=lambda: next(_ticket_numbers))
    progress: float = 0.0
    started_at: float | None = None


@dataclass(frozen=True)
class Waiting:
    """What a waiting session is told: runs ahead of it, and the run in progress."""

    ahead: int
    running: Ticket

    def sentence(self) -> str:
        runs = "1 run is" if self.ahead == 1 else f"{self.ahead} runs are"
        started = self.running.started_at
        elapsed = "" if started is None else f", running for {time.monotonic() - started:.0f} s"
        return (
            f"Waiting for the device: {runs} ahead of yours. Now running: {self.running.label} "
            f"({self.running.progress:.0%} done{elapsed})."
        )


class DeviceQueue:
    """First come, first served; :meth:`turn` blocks until the caller's ticket is at the front."""

    def __init__(self, poll_seconds: float = 0.5) -> None:
        self._condition = threading.Condition()
        self._tickets: list[Ticket] = []
        self.poll_seconds = poll_seconds

    def waiting(self) -> int:
        """Tickets in the queue, the running one included."""
        with self._condition:
            return len(self._tickets)

    @contextlib.contextmanager
    def turn(self, label: str, on_wait: Callable[[Waiting], None] | None = None) -> Iterator[Ticket]:
        """Wait for the device, calling ``on_wait`` every ``poll_seconds`` while others are ahead, then hold it for
        the ``with`` block. ``on_wait`` may raise (a session being stopped) and the ticket is given up all the same."""
        ticket = Ticket(label)
        with self._condition:
            self._tickets.append(ticket)
        try:
            while True:
                with self._condition:
                    position = self._tickets.index(ticket)
                    if position == 0:
                        break
                    status = Waiting(position, self._tickets[0])
                if on_wait is not None:
                    on_wait(status)
                with self._condition:
                    if self._tickets[0] is not ticket:
                        self._condition.wait(self.poll_seconds)
            ticket.started_at = time.monotonic()
            yield ticket
        finally:
            with self._condition:
                self._tickets.remove(ticket)
                self._condition.notify_all()


#: The queue of this server process's device (one process drives one GPU, or the CPU).
DEVICE_QUEUE = DeviceQueue()
