"""Needle grids run in the background: recorded with their grid, queued for the device, stoppable, resumable."""

from __future__ import annotations

import dataclasses
import json
import time
from datetime import datetime

import pytest
import torch

from kvlab.dashboard.grid import NeedleGridRequest, grid_policies, variant
from kvlab.dashboard.inputs import cache_option_fields
from kvlab.dashboard.sweep_jobs import SweepJobs, filling_job, filling_sentence, sweep_views
from kvlab.engine.generation import Generation
from kvlab.errors import KvlabError
from kvlab.runs.device_queue import DeviceQueue
from kvlab.store import SweepRecord


@pytest.fixture
def jobs():
    return SweepJobs(DeviceQueue(poll_seconds=0.01))


def grid_request(shipped, **changes) -> NeedleGridRequest:
    base = NeedleGridRequest(shipped.name, ("full", "h2o"), 0.5, "prefill", (256,), depths=2, trials=1, batch_size=2)
    return dataclasses.replace(base, **changes)


def until(condition, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


@pytest.mark.model
def test_a_request_round_trips_through_its_stored_spec(shipped):
    request = grid_request(shipped)
    assert NeedleGridRequest.from_spec(json.loads(json.dumps(request.spec()))) == request
    assert request.runs() == 2 and len(request.grid().depths or ()) == 2
    assert request.describe() == "full, h2o · keep 0.5 · prefill · 256 tokens · 2 depths x 1 trial"
    for spec in (
        {"kind": "other", **dataclasses.asdict(request)},
        {k: v for k, v in request.spec().items() if k != "keep"},
    ):
        with pytest.raises(KvlabError, match="not a needle grid this version of kvlab can read"):
            NeedleGridRequest.from_spec(spec)


def test_a_request_holds_policies_with_cache_options_and_reads_specs_of_plain_names():
    defaults = {field.name: field.default for field in cache_option_fields()}
    tiered = {**defaults, "hot": 0.25, "key_bits": 4, "value_bits": 4}
    assert variant("h2o", {"value_bits": 4, "hot": 0.25}) == "h2o[hot=0.25,value_bits=4]"  # declaration order
    assert grid_policies(["full", "h2o"], defaults, also_without=True) == ("full", "h2o")
    with_and_without = grid_policies(["full", "h2o", "streaming"], tiered, also_without=True)
    assert with_and_without == (
        "full",
        "h2o",
        "h2o[hot=0.25,key_bits=4,value_bits=4]",
        "streaming",
        "streaming[hot=0.25,key_bits=4,value_bits=4]",
    )
    assert grid_policies(["h2o"], tiered, also_without=False) == ("h2o[hot=0.25,key_bits=4,value_bits=4]",)

    request = NeedleGridRequest("m", with_and_without, 0.1, "prefill", (256,), depths=2, trials=1)
    stored = json.loads(json.dumps(request.spec()))
    assert stored["policies"] == list(with_and_without) and NeedleGridRequest.from_spec(stored) == request
    policies = request.grid().policies
    assert [policy.name for policy in policies] == ["full", "h2o", "h2o", "streaming", "streaming"]
    assert policies[2].params() == {**policies[1].params(), "hot": 0.25, "key_bits": 4, "value_bits": 4}
    assert request.policy_names() == ("full", "h2o", "streaming")
    assert request.describe().startswith("full, h2o, h2o[hot=0.25,key_bits=4,value_bits=4], streaming, ")
    assert request.runs() == 5

    older = {**stored, "policies": ["full", "h2o"]}  # a sweep stored before policies took options
    assert NeedleGridRequest.from_spec(older).grid().policies[1].params() == policies[1].params()
    with pytest.raises(KvlabError, match="run it in prefill mode"):
        dataclasses.replace(request, mode="streaming").grid()
    with pytest.raises(KvlabError, match="while hot is 1"):
        NeedleGridRequest("m", ("h2o[key_bits=4]",), 0.1, "prefill", (256,), 2, 1).grid()


@pytest.mark.model
@pytest.mark.slow
def test_a_sweep_runs_in_the_background_and_is_recorded_with_who_started_it(shipped, store, jobs):
    request = grid_request(shipped)
    with jobs.queue.turn("live run of h2o on 2,048 tokens"):
        job = jobs.start(request, shipped, store, "ann")
        assert jobs.start(request, shipped, store, "bob") is job  # the same grid while it waits: the same job
        until(lambda: job.waiting is not None)
        assert job.status == "queued" and job.waiting.ahead == 1
        assert "Now running: live run of h2o on 2,048 tokens" in job.waiting.sentence()
        [view] = sweep_views(store.sweeps(), jobs.jobs(store.path))
        assert (view.level, view.can_stop, view.can_resume) == ("info", True, False)
        assert view.sentence.startswith("Waiting for the device: 1 run is ahead of yours.")
        assert view.title == f"Sweep {job.sweep_id}: {request.describe()} · started by ann"
    assert job.join(60)
    assert job.status == "finished" and (job.summary.ran, job.done, job.total) == (4, 4, 4)
    [record] = store.sweeps()
    assert (record.sweep_id, record.status, record.started_by) == (job.sweep_id, "finished", "ann")
    runs = store.list_runs()
    assert len(runs) == 2 and set(runs["started_by"]) == {"ann"} and runs["trials"].sum() == 4
    assert set(runs["status"]) == {"finished"}
    [view] = sweep_views(store.sweeps(), jobs.jobs(store.path))
    assert (view.level, view.sentence) == ("success", "Ran 4 trials; 0 were already stored.")

    again = jobs.start(request, shipped, store, "bob")
    assert again is not job and again.sweep_id == job.sweep_id
    assert again.join(60) and (again.summary.ran, again.summary.skipped) == (0, 4)
    assert len(store.sweeps()) == 1 and store.list_runs()["trials"].sum() == 4


@pytest.mark.model
def test_a_waiting_sweep_stopped_gives_its_place_up_and_can_be_resumed(shipped, store, jobs):
    with jobs.queue.turn("holder"):
        job = jobs.start(grid_request(shipped), shipped, store)
        until(lambda: job.waiting is not None)
        job.stop()
        assert job.join(5)
        assert jobs.queue.waiting() == 1
    assert job.status == "stopped" and store.sweeps()[0].status == "stopped"
    assert store.list_runs().empty
    [view] = sweep_views(store.sweeps(), jobs.jobs(store.path))
    assert view.can_resume and not view.can_stop and view.sentence.startswith("Stopped before it started")


@pytest.mark.model
@pytest.mark.slow
def test_a_running_sweep_stops_after_its_batch_and_resumes_where_it_stopped(shipped, store, jobs):
    request = grid_request(shipped, trials=2, batch_size=1)  # 8 trials, one per batch
    job = jobs.start(request, shipped, store)
    until(lambda: job.done >= 1)
    job.stop()
    assert job.join(60) and job.status == "stopped"
    stored = int(store.list_runs()["trials"].sum())
    assert 0 < stored < 8 and job.summary.ran == stored
    assert set(store.list_runs()["status"]) == {"interrupted"}
    assert store.sweeps()[0].status == "stopped"

    resumed = jobs.start(request, shipped, store)
    assert resumed.join(60) and resumed.status == "finished"
    assert (resumed.summary.ran, resumed.summary.skipped) == (8 - stored, stored)
    trials = store.trials_frame()
    assert len(trials) == 8 and not trials.duplicated(["run_id", "trial_key"]).any()


@pytest.mark.model
def test_a_failing_sweep_says_why_and_can_be_resumed(shipped, store, jobs, monkeypatch):
    def exhausted(self, ids):
        raise torch.OutOfMemoryError("CUDA out of memory.")

    monkeypatch.setattr(Generation, "forward", exhausted)
    job = jobs.start(grid_request(shipped), shipped, store)
    assert job.join(60) and job.status == "failed"
    assert "ran out of memory" in job.message and job.message.endswith("resume it to go on.")
    [record] = store.sweeps()
    assert (record.status, record.message) == ("failed", job.message)
    [view] = sweep_views(store.sweeps(), jobs.jobs(store.path))
    assert (view.level, view.sentence, view.can_resume) == ("error", job.message, True)


@pytest.mark.model
def test_the_page_lists_sweeps_to_resume_and_only_the_latest_finished(shipped):
    spec = grid_request(shipped).spec()
    when = datetime(2025, 1, 1)

    def record(sweep_id: int, status: str, message: str | None = None, **changes) -> SweepRecord:
        return SweepRecord(sweep_id, {**spec, **changes}, status, message, None, when, when)  # type: ignore[arg-type]

    records = [
        record(9, "interrupted", contexts=[512]),
        record(8, "finished"),
        record(7, "failed", "No memory."),
        record(6, "finished"),
        record(5, "finished"),
        record(4, "finished"),
        record(3, "stopped"),
        record(2, "running"),
        record(1, "queued", kind="other"),
    ]
    views = {view.sweep_id: view for view in sweep_views(records, {})}
    assert sorted(views) == [1, 2, 3, 5, 6, 7, 8, 9]  # sweep 4 is the fourth finished one
    assert views[9].sentence.startswith("Interrupted when its server stopped") and views[9].can_resume
    assert "512 tokens" in views[9].title
    assert (views[7].level, views[7].sentence, views[7].can_resume) == ("error", "No memory.", True)
    assert (views[8].level, views[8].can_resume, views[8].can_stop) == ("success", False, False)
    assert views[3].can_resume and views[2].can_resume  # running, but in no job of this process: it died
    assert (views[1].level, views[1].can_resume) == ("error", False)
    assert "not a needle grid" in views[1].sentence


@pytest.mark.model
@pytest.mark.slow
def test_a_sweep_fills_the_heatmaps_of_the_settings_it_shares(shipped, store, jobs):
    request = grid_request(shipped)
    assert request.fills(dataclasses.replace(request, policies=("h2o", "random"), depths=5, trials=3, batch_size=1))
    assert not request.fills(dataclasses.replace(request, keep=0.3))
    assert not request.fills(dataclasses.replace(request, policies=("random",)))
    assert not request.fills(dataclasses.replace(request, contexts=(512,)))
    assert filling_sentence(None, stored=True) is None
    assert filling_sentence(None, stored=False).endswith("press Run grid to measure them.")
    with jobs.queue.turn("holder"):
        job = jobs.start(request, shipped, store)
        until(lambda: job.waiting is not None)
        assert filling_job(jobs.jobs(store.path), dataclasses.replace(request, depths=5)) is job
        assert filling_job(jobs.jobs(store.path), dataclasses.replace(request, mode="streaming")) is None
        assert "waits for the device" in filling_sentence(job, stored=False)
    assert job.join(60)
    assert filling_job(jobs.jobs(store.path), request) is None  # ended: it fills nothing any more
