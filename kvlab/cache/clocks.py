"""Device clocks: the time of a piece of device work without waiting for the device now.

The heap times its compactions and the evictions' rankings as they happen; reading a GPU clock synchronises, so the
clocks are CUDA events read later (:class:`ClockTotal` keeps at most :data:`PENDING_CLOCKS` of them unread), and the
host clock on a CPU, where work is synchronous.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class DeviceClock:
    """The time of a piece of device work: CUDA events on a GPU (read later, without waiting now), recorded on that
    GPU's own stream (a layer of a model split over GPUs works on its GPU, whichever is current), the host clock on a
    CPU (where work is synchronous)."""

    begin: Any
    end: Any = None
    stream: Any = None

    @classmethod
    def start(cls, device: torch.device) -> DeviceClock:
        if device.type == "cuda":
            stream = torch.cuda.current_stream(device)
            event = torch.cuda.Event(enable_timing=True)
            event.record(stream)
            return cls(event, stream=stream)
        return cls(time.perf_counter())

    def stop(self) -> DeviceClock:
        if isinstance(self.begin, float):
            self.end = time.perf_counter()
        else:
            self.end = torch.cuda.Event(enable_timing=True)
            self.end.record(self.stream)
        return self

    def seconds(self) -> float:
        if isinstance(self.begin, float):
            return self.end - self.begin
        self.end.synchronize()
        return self.begin.elapsed_time(self.end) / 1000.0


#: Device clocks a :class:`ClockTotal` keeps unread at most; then it reads the older half.
PENDING_CLOCKS = 1024


@dataclass
class ClockTotal:
    """The seconds of many clocked pieces of work (every eviction of a long streaming run) in bounded memory: a host
    clock is read at once; device clocks wait unread, and once :data:`PENDING_CLOCKS` of them wait the older half is
    read (finished long since, so reading rarely waits for the GPU)."""

    settled: float = 0.0
    pending: list[DeviceClock] = field(default_factory=list)

    def add(self, clock: DeviceClock) -> None:
        if isinstance(clock.begin, float):
            self.settled += clock.seconds()
            return
        self.pending.append(clock)
        if len(self.pending) >= PENDING_CLOCKS:
            half = len(self.pending) // 2
            self.settled += sum(older.seconds() for older in self.pending[:half])
            del self.pending[:half]

    def seconds(self) -> float:
        return self.settled + sum(clock.seconds() for clock in self.pending)
