"""Sweeps on Ray workers: the driver stores every trial once, the same trials as one process; a unit lost with its
worker is run again; a stopped sweep resumes; and what a user can get wrong is one sentence, with or without Ray."""

from __future__ import annotations

import importlib.util
import os
import signal
import sys
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
from test_sweep import grid as sweep_grid

from kvlab.cli import main
from kvlab.errors import KvlabError
from kvlab.models.loading import LoadedModel, load_model
from kvlab.policies import make_policy
from kvlab.runs import cluster
from kvlab.runs.cluster import (
    CRASH_ONCE_ENV_VAR,
    MAX_ATTEMPTS,
    ModelRecipe,
    SweepWorkers,
    check_reachable,
    runs_in_process,
)
from kvlab.runs.sweep import PendingRun, SweepGrid, SweepRunner, needle_items, work_units
from kvlab.store import Store, open_store

needs_ray = pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="Ray is not installed")
CELLS = 5  # full once; h2o and streaming in two modes at one keep
ITEMS = 4  # two depths x two trials


def grid(**changes) -> SweepGrid:
    """The sweep tests' grid, in batches of 2 so that two workers share its units."""
    return sweep_grid(**{"batch_size": 2, **changes})


def stored(store: Store) -> list[tuple]:
    """Every stored trial by its run's identity and key, with what it answered and held."""
    runs = store.list_runs().set_index("run_id")["run_key"]
    frame = store.trials_frame()
    rows = zip(frame["run_id"], frame["trial_key"], frame["output"], frame["kv_bytes"])
    return sorted((runs[run_id], key, output, kv_bytes) for run_id, key, output, kv_bytes in rows)


@pytest.fixture(scope="module")
def loaded(checkpoint) -> LoadedModel:
    return load_model(checkpoint)


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    """A Ray instance on this machine, shared by the module's pools (each joins it); four CPUs, so that two pools of
    two workers can be held at once."""
    import ray

    environment, on_sigterm = dict(os.environ), signal.getsignal(signal.SIGTERM)
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()
    os.environ.clear()  # Ray's driver settings (its SIGTERM handler, its debugger) must not reach later tests
    os.environ.update(environment)
    signal.signal(signal.SIGTERM, on_sigterm)


@pytest.fixture(scope="module")
def pool(local_ray, checkpoint) -> Iterator[SweepWorkers]:
    with SweepWorkers(ModelRecipe(checkpoint, device="cpu"), workers=2) as workers:
        yield workers


@pytest.mark.slow
@needs_ray
def test_two_workers_store_every_trial_once_the_same_as_one_process(pool, loaded, tmp_path):
    with open_store(tmp_path / "one.duckdb") as one:
        SweepRunner(loaded, one, grid()).run()
        expected = stored(one)
    with open_store(tmp_path / "two.duckdb") as two:
        summary = SweepRunner(pool, two, grid()).run()
        assert len(pool.actors) == 2 and pool.rescheduled == 0
        assert summary.ran == CELLS * ITEMS and summary.skipped == 0
        assert set(two.list_runs()["status"]) == {"finished"}
        assert stored(two) == expected  # same runs (model, device, dtype), keys, answers and bytes
        again = SweepRunner(loaded, two, grid()).run()  # and this process resumes what they filed
        assert again.ran == 0 and again.skipped == CELLS * ITEMS


@pytest.mark.slow
@needs_ray
def test_a_stopped_sweep_resumes_on_the_workers_with_no_duplicate(pool, tmp_path):
    calls = {"n": 0}

    def stop_after_two() -> bool:
        calls["n"] += 1
        return calls["n"] > 2

    with open_store(tmp_path / "runs.duckdb") as store:
        stopped = SweepRunner(pool, store, grid(), should_stop=stop_after_two).run()
        assert stopped.stopped and 0 < stopped.ran < CELLS * ITEMS
        assert "interrupted" in set(store.list_runs()["status"])
        resumed = SweepRunner(pool, store, grid()).run()
        assert resumed.skipped == stopped.ran and resumed.ran + resumed.skipped == CELLS * ITEMS
        trials = store.trials_frame()
        assert len(trials) == CELLS * ITEMS and not trials.duplicated(["run_id", "trial_key"]).any()
        assert set(store.list_runs()["status"]) == {"finished"}


@pytest.mark.slow
@needs_ray
def test_a_worker_killed_mid_unit_loses_only_that_unit_which_runs_again(local_ray, checkpoint, tmp_path, monkeypatch):
    crashed = tmp_path / "crashed"
    monkeypatch.setenv(CRASH_ONCE_ENV_VAR, str(crashed))
    with SweepWorkers(ModelRecipe(checkpoint, device="cpu"), workers=2) as workers:
        with open_store(tmp_path / "runs.duckdb") as store:
            summary = SweepRunner(workers, store, grid()).run()
            assert crashed.exists() and workers.rescheduled == 1
            assert summary.ran == CELLS * ITEMS
            trials = store.trials_frame()
            assert len(trials) == CELLS * ITEMS and not trials.duplicated(["run_id", "trial_key"]).any()
            assert set(store.list_runs()["status"]) == {"finished"}


@pytest.mark.slow
@needs_ray
def test_a_worker_ray_cannot_restart_is_left_out_and_with_none_left_the_sweep_stops_in_a_sentence(
    local_ray, checkpoint, tmp_path
):
    import ray

    with SweepWorkers(ModelRecipe(checkpoint, device="cpu"), workers=2) as workers:
        with open_store(tmp_path / "runs.duckdb") as store:
            ray.kill(workers.actors[1], no_restart=True)  # the plan comes from the first; a unit goes to each
            summary = SweepRunner(workers, store, grid(policies=(make_policy("full"),))).run()
            assert len(workers.actors) == 1 and workers.rescheduled == 1
            assert summary.ran == ITEMS and set(store.list_runs()["status"]) == {"finished"}
            ray.kill(workers.actors[0], no_restart=True)
            with pytest.raises(KvlabError, match="Every worker has stopped.*run the same sweep again"):
                SweepRunner(workers, store, grid(policies=(make_policy("h2o"),), modes=("streaming",))).run()
            assert len(store.trials_frame()) == ITEMS


@pytest.mark.slow
@needs_ray
def test_a_workers_sentence_reaches_the_driver_as_it_is(pool, tmp_path):
    with pytest.raises(KvlabError, match="1,024"):  # the tiny model's positions, checked on a worker
        SweepRunner(pool, open_store(tmp_path / "runs.duckdb"), grid(contexts=(2048,)))


def test_units_cover_every_pending_item_once_and_prefill_cells_share_each_batchs_read(loaded):
    items = needle_items(loaded, grid(), 256)
    runs = [PendingRun(256, cell, run_id, items) for run_id, cell in enumerate(grid().cells())]
    units = work_units(grid(), runs)
    shared = [unit for unit in units if unit.shared]
    assert len(shared) == 2 and all(len(unit.batch) == 2 for unit in units)
    assert all(
        {job.cell.label for job in unit.jobs} == {"h2o keep 0.5 prefill", "streaming keep 0.5 prefill"}
        for unit in shared
    )
    assert all(len(unit.jobs) == 1 for unit in units if not unit.shared) and len(units) == 2 + 3 * 2
    answered = sorted((job.run_id, key) for unit in units for job in unit.jobs for key, _ in unit.batch)
    assert answered == sorted((run.run_id, key) for run in runs for key, _ in items)
    partly = [
        PendingRun(256, cell, run_id, items[:1] if run_id == 1 else items) for run_id, cell in enumerate(grid().cells())
    ]
    counted = {job.run_id: 0 for unit in work_units(grid(), partly) for job in unit.jobs}
    for unit in work_units(grid(), partly):
        for job in unit.jobs:
            counted[job.run_id] += job.counted
    assert counted == {run.run_id: len(run.pending) for run in partly}


def test_a_unit_that_keeps_stopping_its_workers_is_refused_in_one_sentence(loaded):
    unit = work_units(grid(), [PendingRun(256, grid().cells()[0], 7, needle_items(loaded, grid(), 256))])[0]
    workers = SweepWorkers(ModelRecipe())
    attempts = [0]
    for _ in range(MAX_ATTEMPTS - 1):
        workers._lost(unit, attempts, 0, RuntimeError("killed"))
    with pytest.raises(KvlabError, match=f"full prefill at 256 tokens.*stopped its worker {MAX_ATTEMPTS} times"):
        workers._lost(unit, attempts, 0, RuntimeError("killed"))
    assert workers.rescheduled == MAX_ATTEMPTS


def test_one_worker_or_one_gpu_runs_in_this_process_and_more_on_workers():
    assert runs_in_process(None, None, None, gpus=0) and runs_in_process(None, None, None, gpus=1)
    assert not runs_in_process(None, None, None, gpus=2)
    assert runs_in_process(None, None, None, gpus=2, ray_installed=False)  # asked for, they are refused instead
    assert runs_in_process(None, None, "cuda:1", gpus=2) and runs_in_process(1, None, None, gpus=4)
    assert not runs_in_process(2, None, "cpu", gpus=0)
    assert not runs_in_process(1, "head:6379", None, gpus=0)


def test_bad_worker_settings_are_one_sentence_before_any_model_loads(checkpoint, tmp_path, capsys):
    db = tmp_path / "runs.duckdb"
    sweep = ["sweep", "--model", checkpoint, "--policies", "full", "--contexts", "256", "--db", str(db)]
    for workers, message in (("0", "--workers must be at least 1, not 0"), ("two", "--workers must be a whole")):
        assert main([*sweep, "--workers", workers]) == 2
        assert message in capsys.readouterr().err
    assert main([*sweep, "--workers", "2", "--device", "cuda:1"]) == 2
    assert "CUDA_VISIBLE_DEVICES" in capsys.readouterr().err
    assert main([*sweep, "--workers", "2", "--device-map", "auto"]) == 2
    assert "runs in one process" in capsys.readouterr().err
    with pytest.raises(KvlabError, match="Cannot reach a Ray cluster at 127.0.0.1:1 "):
        check_reachable("127.0.0.1:1")
    for garbage in ("garbage::%%", "host", ":8265", "host:99999", "ray://"):
        with pytest.raises(KvlabError, match="is not a Ray address"):
            check_reachable(garbage)
    assert not db.exists()


@pytest.mark.slow
def test_without_ray_workers_are_refused_in_one_sentence_and_one_worker_runs_here(checkpoint, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # as if Ray were not installed
    db = tmp_path / "runs.duckdb"
    sweep = ["sweep", "--model", checkpoint, "--policies", "full", "--contexts", "256", "--quiet", "--db", str(db)]
    sweep += ["--depths", "0", "--max-new-tokens", "2"]
    with pytest.raises(KvlabError, match=r"install kvlab\[ray\]"):
        SweepWorkers(ModelRecipe(checkpoint), workers=2).__enter__()
    assert main([*sweep, "--workers", "2"]) == 2 and not db.exists()
    assert main([*sweep, "--workers", "1"]) == 0
    with open_store(db) as store:
        assert len(store.trials_frame()) == 1


def test_a_restarting_worker_is_waited_for_and_one_ray_gives_up_is_left_out(monkeypatch):
    """The wait that keeps a unit from being sent, and lost, to a worker Ray is still restarting (a worker killed with
    SIGKILL mid-unit; ``bench/reliability.py`` kills one in a real sweep)."""

    class Unavailable(Exception):
        pass

    class Died(Exception):
        pass

    answers: list[object] = []

    def get(reference):
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    fake_ray = SimpleNamespace(
        get=get, exceptions=SimpleNamespace(ActorUnavailableError=Unavailable, ActorDiedError=Died)
    )
    workers = object.__new__(cluster.SweepWorkers)
    workers._ray = fake_ray
    worker = SimpleNamespace(identity=SimpleNamespace(remote=lambda: "ref"))
    monkeypatch.setattr(cluster, "RESTART_POLL_S", 0.0)
    answers[:] = [Unavailable(), Unavailable(), "back"]
    assert workers._restarted(worker) and answers == []
    answers[:] = [Unavailable(), Died()]
    assert not workers._restarted(worker)
