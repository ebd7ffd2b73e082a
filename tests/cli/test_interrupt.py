"""Ctrl-C at any moment of a command ends with ``Interrupted.`` and status 130, even while kvlab's modules are still
being imported (before any command runs)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest


@pytest.mark.parametrize("delay", [0.1, 0.2, 0.4, 0.8])
def test_an_interrupt_while_starting_is_one_line_and_status_130(delay):
    process = subprocess.Popen(
        [sys.executable, "-m", "kvlab", "runs", "--db", "/nonexistent/never.duckdb"],
        stderr=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    time.sleep(delay)
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=60)
    if process.returncode != 130:  # the command had finished (or was exiting) when the interrupt came
        assert process.returncode in (2, -signal.SIGINT) and "Traceback" not in err
        return
    assert err == "Interrupted.\n"
