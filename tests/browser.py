"""What the tests that drive the dashboard in Chromium share: a ``streamlit run app.py`` server on localhost that a
test can start, kill and start again, Debian's chromium for Playwright, and waiting for a page to settle."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
CHROMIUM = Path(os.environ.get("KVLAB_CHROMIUM", "/usr/bin/chromium"))
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]

#: Skips a test module where there is no chromium to drive.
needs_chromium = pytest.mark.skipif(
    not CHROMIUM.exists(), reason=f"needs chromium at {CHROMIUM} (apt-get install chromium)"
)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Server:
    """The dashboard started with the README's command (``scripts/dashboard.sh``, which also chooses torch's
    threads) on 127.0.0.1, with ``env`` added to this process's environment."""

    def __init__(self, env: dict[str, str], *flags: str) -> None:
        self.env = {**os.environ, **env}
        self.flags = flags
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> str:
        """Start the server and wait until it answers its health check; returns its address."""
        self.process = subprocess.Popen(
            [
                "bash",
                str(REPO / "scripts" / "dashboard.sh"),
                "--server.port",
                str(self.port),
                "--server.address",
                "127.0.0.1",
                *self.flags,
            ],
            cwd=REPO,
            env=self.env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"{self.url}/_stcore/health", timeout=1) as answer:
                    if answer.status == 200:
                        return self.url
            except OSError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    error = self.process.stderr.read().decode()[-2000:] if self.process.stderr else ""
                    raise RuntimeError(f"streamlit did not start: {error}") from None
                time.sleep(0.2)

    def kill(self) -> None:
        """SIGKILL: the server dies at once, as in a crash or a pulled plug, with no chance to clean up."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(10)

    def stop(self) -> None:
        """Stop the server as an operator would (SIGTERM)."""
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(10)

    def __enter__(self) -> Server:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def launch(playwright: Any, *extra_args: str) -> Any:
    """Debian's chromium, headless, through Playwright (``playwright install`` is not used)."""
    return playwright.chromium.launch(executable_path=str(CHROMIUM), args=[*CHROMIUM_ARGS, *extra_args])


def idle(tab: Any) -> None:
    """Wait until the script run is over (Streamlit's running indicator is gone) and the page has settled."""
    tab.wait_for_function("!document.querySelector('[data-testid=stStatusWidget]')")
    tab.wait_for_timeout(300)
