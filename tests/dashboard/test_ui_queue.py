"""The device queue: one run at a time, first come first served, and a waiting session is told its place."""

from __future__ import annotations

import threading
import time

import pytest

from kvlab.runs.device_queue import DeviceQueue, Waiting


def test_runs_take_turns_in_arrival_order_and_waiters_see_their_place():
    queue = DeviceQueue(poll_seconds=0.01)
    order: list[str] = []
    seen: dict[str, list[int]] = {"second": [], "third": []}
    release_first = threading.Event()
    first_holds = threading.Event()

    def first() -> None:
        with queue.turn("first") as ticket:
            ticket.progress = 0.5
            first_holds.set()
            order.append("first")
            release_first.wait(5)

    def later(name: str) -> None:
        with queue.turn(name, on_wait=lambda waiting: seen[name].append(waiting.ahead)):
            order.append(name)

    threads = [threading.Thread(target=first)]
    threads[0].start()
    assert first_holds.wait(5)
    for name in ("second", "third"):
        threads.append(threading.Thread(target=later, args=(name,)))
        threads[-1].start()
        while queue.waiting() < len(threads):
            time.sleep(0.005)
    time.sleep(0.05)
    release_first.set()
    for thread in threads:
        thread.join(5)
    assert order == ["first", "second", "third"]
    assert seen["second"][0] == 1 and seen["third"][0] == 2
    assert queue.waiting() == 0


def test_a_session_that_stops_while_waiting_gives_its_place_up():
    queue = DeviceQueue(poll_seconds=0.01)

    def stop(waiting: Waiting) -> None:
        raise KeyboardInterrupt  # what a stopped Streamlit script raises is not an Exception either

    with queue.turn("holder"):
        with pytest.raises(KeyboardInterrupt), queue.turn("impatient", on_wait=stop):
            pass
        assert queue.waiting() == 1
    assert queue.waiting() == 0
    with queue.turn("next"):
        assert queue.waiting() == 1


def test_the_waiting_sentence_names_the_run_ahead():
    queue = DeviceQueue(poll_seconds=0.01)
    notices: list[str] = []

    def waiter() -> None:
        with queue.turn("live run", on_wait=lambda waiting: notices.append(waiting.sentence())):
            pass

    with queue.turn("needle grid of 8 runs") as holder:
        holder.progress = 0.25
        thread = threading.Thread(target=waiter)
        thread.start()
        while not notices:
            time.sleep(0.005)
    thread.join(5)
    assert notices[0].startswith(
        "Waiting for the device: 1 run is ahead of yours. Now running: needle grid of 8 runs (25% done"
    )
