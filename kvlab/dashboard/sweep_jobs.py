"""Needle (and RULER) grids started from the dashboard run in the server, not in the browser tab that started them.

A Streamlit session runs its script in a thread that ends when the tab is closed or the page reruns, which would
stop a long sweep half way. So a sweep runs in a thread of its own, registered in a process-wide :class:`SweepJobs`
that every session reads: any session opening the needle grid page sees each sweep of the server with its place in
the device queue or its progress, and can stop it. The sweep takes its turn on the device like a live run
(:mod:`kvlab.runs.device_queue`), and is recorded in the store (:meth:`kvlab.store.Store.begin_sweep`) with its
grid, so that a sweep whose server died (marked interrupted when the store is next opened) can be resumed: its runs are
found again by their configuration and the stored trials are skipped.

Nothing here imports Streamlit; :func:`sweep_views` turns stored sweeps and running jobs into what the page shows.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from kvlab.dashboard.grid import NeedleGridRequest, run_needle_grid
from kvlab.errors import KvlabError
from kvlab.models.loading import LoadedModel
from kvlab.runs.device_queue import DEVICE_QUEUE, DeviceQueue, Waiting
from kvlab.runs.sweep import SweepSummary
from kvlab.store import Store, SweepRecord, SweepStatus

_LOGGER = logging.getLogger(__name__)


class _StoppedWhileWaiting(Exception):
    """Raised from the device queue's wait callback to give the place up when a waiting sweep is stopped."""


@dataclass
class SweepJob:
    """One sweep running (or waiting for the device) in this process, and how far it got.

    The worker thread writes the fields; sessions only read them, and :meth:`stop` asks the worker to stop after
    the batch in flight.
    """

    sweep_id: int
    request: NeedleGridRequest
    store_path: Path
    started_by: str | None
    status: SweepStatus = "queued"
    waiting: Waiting | None = None
    done: int = 0
    total: int = 0
    label: str = ""
    summary: SweepSummary | None = None
    message: str | None = None
    _stop: threading.Event = field(default_factory=threading.Event, repr=False)
    _thread: threading.Thread | None = field(default=None, repr=False)

    @property
    def active(self) -> bool:
        """Whether the sweep is still waiting or running."""
        return self.status in ("queued", "running")

    @property
    def stopping(self) -> bool:
        """Whether a stop was asked for and the sweep has not ended yet."""
        return self._stop.is_set() and self.active

    def stop(self) -> None:
        """Ask the sweep to stop: at once while it waits, after the batch in flight while it runs."""
        self._stop.set()

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the worker thread to end; whether it did within ``timeout`` seconds."""
        if self._thread is not None:
            self._thread.join(timeout)
        return not self.active


class SweepJobs:
    """The sweeps of this server process, keyed by database and sweep id, each run in a daemon thread.

    Daemon threads, because a server that stops must not wait for a sweep: what the sweep stored stays stored, and
    the store marks it interrupted when it is next opened.
    """

    def __init__(self, queue: DeviceQueue = DEVICE_QUEUE) -> None:
        self.queue = queue
        self._lock = threading.Lock()
        self._jobs: dict[tuple[Path, int], SweepJob] = {}

    def start(
        self, request: NeedleGridRequest, loaded: LoadedModel, store: Store, started_by: str | None = None
    ) -> SweepJob:
        """Start (or resume) the sweep of ``request`` in the background and return its job; when the same grid is
        already waiting or running in this process, its job is returned and nothing new starts."""
        if loaded.name != request.model:
            raise ValueError(f"the sweep is for {request.model!r}, not the loaded {loaded.name!r}")
        request.check_runs_on(loaded)  # refuses, in one sentence, a grid that cannot run, before anything is stored
        with self._lock:
            for job in self._jobs.values():
                if job.active and job.store_path == store.path and job.request == request:
                    return job
            sweep_id = store.begin_sweep(request.spec(), started_by=started_by)
            job = SweepJob(sweep_id, request, store.path, started_by)
            job._thread = threading.Thread(
                target=self._work, args=(job, loaded, store), daemon=True, name=f"kvlab-sweep-{sweep_id}"
            )
            self._jobs[(store.path, sweep_id)] = job
            job._thread.start()
        return job

    def jobs(self, store_path: Path) -> dict[int, SweepJob]:
        """The jobs of one database that this process started, by sweep id."""
        with self._lock:
            return {sweep_id: job for (path, sweep_id), job in self._jobs.items() if path == store_path}

    def _work(self, job: SweepJob, loaded: LoadedModel, store: Store) -> None:
        """The worker: wait for the device, run the grid, and record how it ended in the job and the store."""

        def wait(waiting: Waiting) -> None:
            job.waiting = waiting
            if job._stop.is_set():
                raise _StoppedWhileWaiting

        def progress(done: int, total: int, label: str) -> None:
            job.done, job.total, job.label = done, total, label
            ticket.progress = done / max(total, 1)

        status: SweepStatus = "failed"
        try:
            with self.queue.turn(
                f"{job.request.name} of {job.request.runs()} runs (sweep {job.sweep_id})", wait
            ) as ticket:
                job.waiting = None
                job.status = "running"
                store.set_sweep_status(job.sweep_id, "running")
                job.summary = run_needle_grid(
                    loaded, store, job.request.grid(), progress, job.started_by, should_stop=job._stop.is_set
                )
            status = "stopped" if job.summary.stopped else "finished"
        except _StoppedWhileWaiting:
            status = "stopped"
        except KvlabError as error:
            job.message = str(error)
        except Exception as error:  # a bug: the thread must still record that the sweep ended
            _LOGGER.exception("sweep %s failed", job.sweep_id)
            job.message = f"The sweep failed unexpectedly ({type(error).__name__}: {error}); see the server log."
        finally:
            try:
                store.set_sweep_status(job.sweep_id, status, job.message)
            except Exception:
                _LOGGER.exception("could not record how sweep %s ended", job.sweep_id)
            job.status = status


#: The sweeps of this server process.
SWEEP_JOBS = SweepJobs()


Level = Literal["progress", "info", "success", "warning", "error"]


@dataclass(frozen=True)
class SweepView:
    """One sweep as the page shows it: a title line, a status sentence drawn at ``level`` (``progress`` draws a
    bar at ``fraction``), and which button it offers."""

    sweep_id: int
    title: str
    sentence: str
    level: Level
    fraction: float = 0.0
    can_stop: bool = False
    can_resume: bool = False


def sweep_views(records: list[SweepRecord], jobs: dict[int, SweepJob], finished: int = 3) -> list[SweepView]:
    """The sweeps the page lists, most recently changed first: every one waiting, running or resumable, and the
    ``finished`` most recent that finished. A sweep this process runs is described by its job (its place in the
    queue, its progress); any other by its stored status."""
    views: list[SweepView] = []
    shown_finished = 0
    for record in records:
        job = jobs.get(record.sweep_id)
        status = job.status if job is not None else record.status
        if status == "finished":
            shown_finished += 1
            if shown_finished > finished:
                continue
        views.append(_view(record, job))
    return views


def _view(record: SweepRecord, job: SweepJob | None) -> SweepView:
    """One sweep's view, from its job when this process runs it."""
    try:
        title = f"Sweep {record.sweep_id}: {NeedleGridRequest.from_spec(record.spec).describe()}"
    except KvlabError as error:
        return SweepView(record.sweep_id, f"Sweep {record.sweep_id}", str(error), "error")
    if record.started_by:
        title += f" · started by {record.started_by}"
    return _record_view(record.sweep_id, title, record) if job is None else _job_view(record.sweep_id, title, job)


def _job_view(sweep_id: int, title: str, job: SweepJob) -> SweepView:
    """A sweep this process runs or ran: its place in the queue, its progress, or how it ended."""
    if job.status == "queued":
        sentence = job.waiting.sentence() if job.waiting is not None else "Waiting for the device."
        return SweepView(
            sweep_id, title, ("Stopping… " if job.stopping else "") + sentence, "info", can_stop=not job.stopping
        )
    if job.status == "running":
        prefix = "Stopping after the batch in flight · " if job.stopping else ""
        return SweepView(
            sweep_id,
            title,
            f"{prefix}{job.done} of {job.total} trials · {job.label}",
            "progress",
            fraction=job.done / max(job.total, 1),
            can_stop=not job.stopping,
        )
    if job.status == "finished" and job.summary is not None:
        return SweepView(
            sweep_id, title, f"Ran {job.summary.ran} trials; {job.summary.skipped} were already stored.", "success"
        )
    if job.status == "stopped":
        ran = f"after {job.summary.ran} trials" if job.summary is not None else "before it started"
        return SweepView(
            sweep_id,
            title,
            f"Stopped {ran}; the finished trials are stored. Resume to go on.",
            "warning",
            can_resume=True,
        )
    return SweepView(sweep_id, title, job.message or "Failed.", "error", can_resume=True)


def _record_view(sweep_id: int, title: str, record: SweepRecord) -> SweepView:
    """A sweep of an earlier server process, by its stored status (one left queued or running was interrupted)."""
    sentences: dict[str, tuple[str, Level]] = {
        "finished": ("Finished.", "success"),
        "stopped": ("Stopped; the finished trials are stored. Resume to go on.", "warning"),
        "interrupted": (
            "Interrupted when its server stopped; the finished trials are stored. Resume to go on.",
            "warning",
        ),
        "failed": (record.message or "Failed.", "error"),
    }
    sentence, level = sentences.get(record.status, ("Interrupted; resume to go on.", "warning"))
    return SweepView(sweep_id, title, sentence, level, can_resume=record.status != "finished")


def filling_job(jobs: dict[int, SweepJob], request: NeedleGridRequest) -> SweepJob | None:
    """The most recent sweep of this process, waiting or running, whose trials show on ``request``'s heatmap."""
    filling = [job for job in jobs.values() if job.active and job.request.fills(request)]
    return max(filling, key=lambda job: job.sweep_id, default=None)


def filling_sentence(job: SweepJob | None, stored: bool, ruler: bool = False) -> str | None:
    """What the page says about a sweep filling its heatmap (its RULER table with ``ruler``): that it waits or
    measures and the cells fill in as its trials are stored (``stored``: some already are), or, with no sweep and
    nothing stored, how to start one."""
    trials, shown = ("RULER", "the RULER table") if ruler else ("needle", "the heatmap")
    if job is None:
        return None if stored else f"No stored {trials} trials for these settings yet: press Run grid to measure them."
    if job.status == "queued":
        return f"Sweep {job.sweep_id} for these settings waits for the device; {shown} fills in as it measures."
    if not stored:
        return f"Sweep {job.sweep_id} is measuring these settings; {shown} fills in as its trials are stored."
    return f"Sweep {job.sweep_id} is measuring: {job.done} of {job.total} trials so far, drawn as they are stored."
