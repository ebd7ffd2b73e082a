"""Reliability under the accidents that happen to a lab bench: a sweep killed with SIGKILL at random moments and run
again, eight dashboard sessions running live runs at once in one server, and a disk that fills up in the middle of a
sweep. For each it prints the trials expected, stored, duplicated and lost, and writes them as JSON.

Usage (on the 2-core CPU machine; about five minutes; the disk part needs root to mount a tmpfs):
    python bench/reliability.py --kills 8 --sessions 8 --out bench/results/reliability.json

Everything runs the product as users run it: ``python -m kvlab sweep`` in a subprocess, ``streamlit run app.py``
driven by Chromium through Playwright (Debian's chromium), on the shipped model.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import cast

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "tests" / "store"))

from disks import fill, small_disk  # noqa: E402

from kvlab.store import open_store  # noqa: E402

#: The sweep every part runs: 3 policies x 2 contexts x 3 depths x 4 trials, both modes for the evicting ones.
SWEEP = [
    "--policies",
    "full,h2o,streaming",
    "--keep",
    "0.5",
    "--mode",
    "prefill,streaming",
    "--contexts",
    "512,1024",
    "--depths",
    "0,0.5,1",
    "--trials",
    "4",
    "--batch-size",
    "2",
    "--max-new-tokens",
    "8",
    "--quiet",
]
EXPECTED_TRIALS = (1 + 2 * 2) * 2 * 3 * 4


#: Every process a part started, so that a part that fails or times out leaves none of them running.
STARTED: list[subprocess.Popen[str]] = []


def sweep(db: Path, *extra: str, **popen: object) -> subprocess.Popen[str]:
    """``python -m kvlab sweep`` into ``db`` (with ``extra`` arguments) in a subprocess of its own process group (so
    that whatever it starts is stopped with it), remembered in :data:`STARTED`."""
    process = subprocess.Popen(
        [sys.executable, "-m", "kvlab", "sweep", *SWEEP, *extra, "--db", str(db)],
        cwd=REPO,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
        **popen,
    )  # type: ignore[call-overload]
    STARTED.append(process)
    return process


def stop_everything(processes: list[subprocess.Popen[str]]) -> int:
    """Kill every process of ``processes`` still running, with its process group, and wait for it; how many were
    still running. Run after every part, also when it failed or ran out of time."""
    running = [process for process in processes if process.poll() is None]
    for process in running:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
    for process in processes:
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=30)
    processes.clear()
    return len(running)


def counts(db: Path, expected: int) -> dict[str, int]:
    """Trials expected, stored, duplicated (the same trial of a run more than once) and lost."""
    with open_store(db, read_only=True) as store:
        trials = store.trials_frame()
    distinct = len(trials.drop_duplicates(["run_id", "trial_key"]))
    return {
        "expected": expected,
        "stored": len(trials),
        "duplicated": len(trials) - distinct,
        "lost": expected - distinct,
    }


def killed_sweeps(kills: int, seed: int, directory: Path) -> dict[str, object]:
    """Kill a sweep with SIGKILL ``kills`` times at random moments, then let it finish."""
    db = directory / "killed.duckdb"
    rng = random.Random(seed)
    moments, stored_after = [], []
    for _ in range(kills):
        process = sweep(db)
        moment = rng.uniform(3.0, 7.0)  # model loading takes a few seconds; some kills land before any trial
        time.sleep(moment)
        process.send_signal(signal.SIGKILL)
        process.wait(30)
        moments.append(round(moment, 2))
        stored_after.append(counts(db, EXPECTED_TRIALS)["stored"] if db.exists() else 0)
    finished = sweep(db)
    out, err = finished.communicate(timeout=900)
    if finished.returncode != 0:
        raise RuntimeError(f"the final sweep failed: {err[-500:]}")
    return {
        "kills": kills,
        "kill_moments_s": moments,
        "stored_after_each_kill": stored_after,
        "final": out.strip(),
        **counts(db, EXPECTED_TRIALS),
    }


def concurrent_sessions(sessions: int, directory: Path) -> dict[str, object]:
    """``sessions`` browser tabs run a short live run each, all at once, against one dashboard server."""
    from browser import Server, idle, launch
    from playwright import sync_api

    db = directory / "sessions.duckdb"
    errors: list[str] = []
    with Server({"KVLAB_DB": str(db)}) as server, sync_api.sync_playwright() as playwright:
        browser = launch(playwright)
        tabs = []
        for seed in range(sessions):
            tab = browser.new_context(viewport={"width": 1400, "height": 1000}).new_page()
            tab.set_default_timeout(600_000)
            tab.goto(server.url)
            tab.get_by_text("Running on").wait_for()
            tab.get_by_role("spinbutton", name="Context length (tokens)").fill("256")
            tab.get_by_role("spinbutton", name="Seed (key, value and haystack)").fill(str(seed + 1))
            tab.get_by_role("spinbutton", name="Tokens to generate (at most)").fill("4")
            tab.get_by_role("spinbutton", name="Tokens to generate (at most)").press("Enter")
            idle(tab)
            tabs.append(tab)
        started = time.perf_counter()
        for tab in tabs:
            tab.get_by_role("button", name="Run", exact=True).click()
        for tab in tabs:
            try:
                tab.get_by_text("stored as run").wait_for()
            except Exception as error:  # counted as lost below; the message says why
                errors.append(str(error).splitlines()[0])
        seconds = time.perf_counter() - started
        browser.close()
    return {
        "sessions": sessions,
        "seconds_until_all_stored": round(seconds, 1),
        "errors": errors,
        **counts(db, sessions),
    }


def full_disk(megabytes: int, directory: Path) -> dict[str, object]:
    """Fill the disk under a running sweep's database; then free it and run the sweep again."""
    with small_disk(directory, megabytes) as disk:
        db = disk / "full.duckdb"
        process = sweep(db)
        deadline = time.monotonic() + 300
        while not db.exists() or db.stat().st_size < 12288:  # wait until trials are being stored
            if time.monotonic() > deadline or process.poll() is not None:
                raise RuntimeError("the sweep never started storing")
            time.sleep(0.1)
        time.sleep(3.0)
        filler = fill(disk)
        out, err = process.communicate(timeout=900)
        said = [line for line in err.splitlines() if line.startswith("error:")]
        during = {
            "exit_status": process.returncode,
            "sentence": said[-1] if said else None,
            "traceback": "Traceback" in err,
            **counts(db, EXPECTED_TRIALS),
        }
        filler.unlink()
        again = sweep(db)
        out, err = again.communicate(timeout=900)
        return {
            "disk_mb": megabytes,
            "while_full": during,
            "after_freeing": {"exit_status": again.returncode, "final": out.strip(), **counts(db, EXPECTED_TRIALS)},
        }


def kvlab(*args: str, env: dict[str, str] | None = None, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    """One ``python -m kvlab`` command, run to its end."""
    return subprocess.run(
        [sys.executable, "-m", "kvlab", *args],
        cwd=REPO,
        text=True,
        capture_output=True,
        env={**os.environ, **(env or {})},
        timeout=timeout,
    )


def _sentence(done: subprocess.CompletedProcess[str]) -> dict[str, object]:
    said = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    return {
        "exit_status": done.returncode,
        "sentence": said[-1] if said else None,
        "traceback": "Traceback" in done.stderr,
    }


def _offload_files(folder: Path) -> list[str]:
    return sorted(path.name for path in folder.glob("**/*.kv"))


#: A demoting run of the shipped model: StreamingLLM mode, a small budget, evicted tokens demoted to the file tier.
DEMOTING = ["generate", "--policy", "h2o", "--budget", "64", "--mode", "streaming", "--chunk", "256"]


def offload_on_a_full_disk(directory: Path) -> dict[str, object]:
    """A file tier larger than the disk under the offload directory, then one that fits: a sentence before any work,
    no file left behind either way."""
    prompt = " ".join(f"word{i}" for i in range(1500))
    with small_disk(directory, 8) as disk:
        env = {"KVLAB_OFFLOAD_DIR": str(disk)}
        too_large = kvlab(
            *DEMOTING, "--cache", "disk_tier_mib=64", "--prompt", prompt, "--max-new-tokens", "8", env=env
        )
        left_after_refusal = _offload_files(disk)
        fits = kvlab(*DEMOTING, "--cache", "disk_tier_mib=2", "--prompt", prompt, "--max-new-tokens", "8", env=env)
        return {
            "disk_mb": 8,
            "tier_larger_than_disk": {**_sentence(too_large), "offload_files_left": left_after_refusal},
            "tier_that_fits": {**_sentence(fits), "offload_files_left": _offload_files(disk)},
        }


def killed_demoting_run(directory: Path) -> dict[str, object]:
    """A demoting run killed with SIGKILL while its offload file exists; the next demoting run removes that file."""
    folder = directory / "offload"
    folder.mkdir()
    env = {"KVLAB_OFFLOAD_DIR": str(folder)}
    prompt = " ".join(f"word{i}" for i in range(1200))  # about 3,500 tokens: room for 1,000 more in 4,608 positions
    process = subprocess.Popen(
        [sys.executable, "-m", "kvlab", *DEMOTING, "--cache", "disk_tier_mib=2", "--prompt", prompt,
         "--max-new-tokens", "1000"],
        cwd=REPO, text=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        env={**os.environ, **env}, start_new_session=True,
    )  # fmt: skip
    STARTED.append(process)
    deadline = time.monotonic() + 300
    while not _offload_files(folder):
        if time.monotonic() > deadline or process.poll() is not None:
            raise RuntimeError("the demoting run never made its offload file")
        time.sleep(0.05)
    left = _offload_files(folder)
    modes = sorted({oct(path.stat().st_mode & 0o777) for path in folder.glob("**/*.kv")})
    process.send_signal(signal.SIGKILL)
    process.wait(30)
    after_kill = _offload_files(folder)
    next_run = kvlab(
        *DEMOTING, "--cache", "disk_tier_mib=2", "--prompt", "a short prompt", "--max-new-tokens", "2", env=env
    )
    return {
        "offload_file_while_running": left,
        "file_modes": modes,
        "left_after_kill_9": after_kill,
        "next_run": {**_sentence(next_run), "offload_files_left": _offload_files(folder)},
    }


def damaged_store_to_every_writer(directory: Path) -> dict[str, object]:
    """A store one of whose data blocks is damaged, offered to every command that writes a store: each refuses it
    in one sentence, and its bytes stay as they were."""
    from test_store_safety import damaged_database

    damaged = damaged_database(directory)
    before = damaged.read_bytes()
    tasks = directory / "tasks.jsonl"
    tasks.write_text(json.dumps({"id": "a", "context": "The code is 7.", "question": "Code?", "answer": "7"}) + "\n")
    writers = {
        "sweep": ["sweep", *SWEEP, "--db", str(damaged)],
        "eval": ["eval", "--tasks", str(tasks), "--policy", "full", "--db", str(damaged)],
        "claims --refresh": ["claims", "--refresh", "--db", str(damaged)],
        "live": ["live", "--context", "256", "--max-new-tokens", "2", "--db", str(damaged)],
    }
    results: dict[str, object] = {}
    for name, args in writers.items():
        done = kvlab(*args)
        results[name] = {**_sentence(done), "bytes_unchanged": damaged.read_bytes() == before}
    return results


def killed_ray_worker(directory: Path) -> dict[str, object]:
    """A sweep on two local Ray workers, one of them killed with SIGKILL while it runs a unit: the unit runs again
    and the sweep ends complete."""
    db = directory / "ray.duckdb"
    process = sweep(db, "--workers", "2")
    deadline = time.monotonic() + 600
    victim = None
    while victim is None:
        if time.monotonic() > deadline or process.poll() is not None:
            raise RuntimeError("no Ray worker was seen running a unit")
        listing = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
        running = [line.split(None, 1) for line in listing.splitlines() if "ray::_Worker.run_unit" in line]
        victim = int(running[0][0]) if running else None
        time.sleep(0.2)
    os.kill(victim, signal.SIGKILL)
    out, err = process.communicate(timeout=900)
    said = [line for line in err.splitlines() if line.startswith("error:")]
    finals = [line for line in out.splitlines() if line.startswith("ran ")]
    return {
        "killed_worker_pid": victim,
        "exit_status": process.returncode,
        "sentence": said[-1] if said else None,
        "final": finals[-1] if finals else None,
        "traceback": "Traceback" in err,
        **counts(db, EXPECTED_TRIALS),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kills", type=int, default=8)
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--disk-mb", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--parts", default=None, help="run only these parts (comma-separated names)")
    args = parser.parse_args()
    results: dict[str, object] = {
        "machine": f"{platform.node()} ({os.cpu_count()} CPUs)",
        "date": time.strftime("%Y-%m-%d"),
    }
    with tempfile.TemporaryDirectory(prefix="kvlab-reliability-") as scratch:
        directory = Path(scratch)
        parts = (
            ("killed_sweeps", lambda: killed_sweeps(args.kills, args.seed, directory)),
            ("concurrent_sessions", lambda: concurrent_sessions(args.sessions, directory)),
            ("full_disk", lambda: full_disk(args.disk_mb, directory)),
            ("offload_on_a_full_disk", lambda: offload_on_a_full_disk(directory / "offload_on_a_full_disk")),
            ("killed_demoting_run", lambda: killed_demoting_run(directory / "killed_demoting_run")),
            (
                "damaged_store_to_every_writer",
                lambda: damaged_store_to_every_writer(directory / "damaged_store_to_every_writer"),
            ),
            ("killed_ray_worker", lambda: killed_ray_worker(directory / "killed_ray_worker")),
        )
        chosen = None if args.parts is None else set(args.parts.split(","))
        for name, part in parts:
            if chosen is not None and name not in chosen:
                continue
            (directory / name).mkdir(exist_ok=True)
            started = time.perf_counter()
            try:
                results[name] = {**part(), "wall_s": round(time.perf_counter() - started, 1)}
            except (OSError, RuntimeError, subprocess.SubprocessError) as error:
                results[name] = {"skipped": str(error).splitlines()[0]}
            finally:
                left = stop_everything(STARTED)
            if left:
                results[name] = {**cast(dict[str, object], results[name]), "processes_stopped_after": left}
            print(name, json.dumps(results[name]), flush=True)
    if args.out is not None:
        args.out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
