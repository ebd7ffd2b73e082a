"""``bench/reliability.py`` stops every process it started, with whatever those started, after each part, also
when the part failed or ran out of time."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import time
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "reliability.py"


def reliability():
    spec = importlib.util.spec_from_file_location("reliability", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def alive(pid: int) -> bool:
    done = subprocess.run(["ps", "-o", "stat=", "-p", str(pid)], capture_output=True, text=True)
    return bool(done.stdout.strip()) and not done.stdout.strip().startswith("Z")


def test_a_part_that_times_out_leaves_nothing_running(tmp_path):
    module = reliability()
    child_pid = tmp_path / "child.pid"
    code = (
        "import subprocess, sys, time; "
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); "
        f"open({str(child_pid)!r}, 'w').write(str(child.pid)); time.sleep(600)"
    )
    process = subprocess.Popen([sys.executable, "-c", code], text=True, start_new_session=True)
    started = [process]
    deadline = time.monotonic() + 30
    while not child_pid.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    grandchild = int(child_pid.read_text())
    assert alive(process.pid) and alive(grandchild)
    assert module.stop_everything(started) == 1 and started == []
    time.sleep(0.5)
    assert not alive(process.pid) and not alive(grandchild)  # the sweep's own children went with it
