"""Sweeps on several workers: every GPU of this machine, or of a Ray cluster.

Each worker is a Ray actor holding one loaded model, on a GPU of its own when the cluster has GPUs. The process that
runs the sweep (the driver) stays the one writer of the store: it asks a worker for the grid's plan (the items, and
each run's configuration as the workers' model, device and dtype file it), skips the trials already stored, keeps
every worker busy with one work unit at a time (:class:`kvlab.runs.sweep.WorkUnit`) and stores each unit that comes
back, once. A worker computes a unit with the same code as a sweep in one process
(:meth:`kvlab.runs.sweep.InProcess.unit_trials`).

A worker that dies (its process killed, the machine gone) loses only the unit it was computing: Ray restarts it (it
loads its model again) and the unit is sent again, to it or to another worker; a unit that stops
:data:`MAX_ATTEMPTS` workers is refused in one sentence. A sweep stopped as a whole resumes like any other, from the
trials its store holds.

Ray is optional (``kvlab[ray]``): it is imported here only, and only when workers are asked for.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from types import ModuleType, TracebackType
from typing import Any

from kvlab.errors import KvlabError, shown_name
from kvlab.models.loading import LoadedModel, load_model
from kvlab.runs.sweep import Cell, InProcess, SweepGrid, SweepPlan, UnitJob, UnitResult, WorkUnit
from kvlab.store import RunConfig, Trial

#: Times a unit may be lost with its worker before the sweep gives up on it.
MAX_ATTEMPTS = 3
#: Times Ray restarts a dead worker (each restart loads the model again).
MAX_RESTARTS = 3
#: Seconds between asking a restarting worker whether it is back.
RESTART_POLL_S = 0.5
#: Seconds to wait for a cluster's address to answer before saying it cannot be reached.
CONNECT_TIMEOUT_S = 5.0
#: Environment variables a worker takes from the driver: kvlab's own settings (limits, model cache, default model),
#: so that every worker runs under the driver's settings wherever it runs.
FORWARDED_PREFIX = "KVLAB_"
#: A file path: the first worker to start a unit while no file is there creates it and exits at once, as a killed
#: worker would. The tests use it to lose a unit in flight; it has no other use.
CRASH_ONCE_ENV_VAR = "KVLAB_SWEEP_CRASH_ONCE"


@dataclass(frozen=True)
class ModelRecipe:
    """How every worker loads the sweep's model: the arguments of :func:`kvlab.models.loading.load_model`, resolved on
    the worker's own machine (its GPU, its copy of the files). ``device`` is None (the worker's GPU when it has one,
    else its CPU), ``cuda`` or ``cpu``: a worker is given one GPU and sees it as its only one."""

    name: str | None = None
    gguf_file: str | None = None
    device: str | None = None
    dtype: str | None = None
    trust_remote_code: bool = False

    def __post_init__(self) -> None:
        if self.device is not None and self.device.strip().lower() not in ("cpu", "cuda"):
            raise KvlabError(
                f"Each worker runs on a GPU of its own, so --device {self.device[:40]} cannot be used with workers; "
                "leave it out (CUDA_VISIBLE_DEVICES chooses the GPUs) or use cpu."
            )

    @property
    def on_cpu(self) -> bool:
        """Whether the workers are asked to run on their CPUs even where there are GPUs."""
        return self.device is not None and self.device.strip().lower() == "cpu"

    def load(self) -> LoadedModel:
        """The model, loaded in this process."""
        return load_model(
            self.name,
            gguf_file=self.gguf_file,
            device=self.device,
            dtype=self.dtype,
            trust_remote_code=self.trust_remote_code,
        )


@dataclass(frozen=True)
class WorkerModel:
    """What a worker runs, in the terms its runs are filed under: the model's label and identity, the kind of
    device and the dtype. Every worker of a sweep must run the same, or their trials could not be one run."""

    label: str
    weights_hash: str | None
    tokenizer_hash: str | None
    device: str
    dtype: str

    @classmethod
    def of(cls, loaded: LoadedModel) -> WorkerModel:
        return cls(
            loaded.source.label, loaded.weights_hash, loaded.tokenizer_hash, loaded.device_kind, loaded.dtype_name
        )

    def describe(self) -> str:
        return f"{shown_name(self.label)} on {self.device} in {self.dtype}"


def default_workers(device: str | None, gpus: int) -> int:
    """Workers when none are asked for: one per visible GPU, unless a device is named (then the one asked for)."""
    return gpus if device is None or device.strip().lower() == "cuda" else 1


def runs_in_process(
    workers: int | None, ray_address: str | None, device: str | None, gpus: int, ray_installed: bool = True
) -> bool:
    """Whether a sweep runs in this process as it always did, with no Ray: no cluster is named, and one worker is
    asked for, or none is and this machine has at most one GPU to fill (``gpus`` visible ones) or no Ray to fill
    more with (asked-for workers without Ray are refused instead, by :func:`import_ray`)."""
    if ray_address is not None:
        return False
    if workers is None:
        return not ray_installed or default_workers(device, gpus) <= 1
    return workers <= 1


class _Worker:
    """A worker: one loaded model (loaded when Ray starts the actor), computing what the driver sends. A model that
    cannot load is kept as its one sentence, said to the driver at its first call."""

    def __init__(self, recipe: ModelRecipe) -> None:
        self.model: InProcess | KvlabError
        try:
            self.model = InProcess(recipe.load())
        except KvlabError as error:
            self.model = error

    def _ready(self) -> InProcess:
        if isinstance(self.model, KvlabError):
            raise self.model
        return self.model

    def identity(self) -> WorkerModel:
        return WorkerModel.of(self._ready().loaded)

    def check_fits(self, grid: SweepGrid) -> None:
        self._ready().check_fits(grid)

    def config(self, grid: SweepGrid, cell: Cell, context: int) -> RunConfig:
        return self._ready().config(grid, cell, context)

    def prepare(self, grid: SweepGrid) -> SweepPlan:
        return self._ready().prepare(grid)

    def run_unit(self, grid: SweepGrid, unit: WorkUnit) -> list[tuple[UnitJob, list[Trial]]]:
        _crash_once()
        return list(self._ready().unit_trials(grid, unit))


def _crash_once() -> None:
    """Exit at once, as a killed worker would, if :data:`CRASH_ONCE_ENV_VAR` names a file this worker creates first."""
    path = os.environ.get(CRASH_ONCE_ENV_VAR)
    if not path:
        return
    try:
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return
    os._exit(1)


def import_ray() -> ModuleType:
    """Ray, or one sentence saying how to install it."""
    try:
        import ray
    except ImportError:
        raise KvlabError(
            "Sweeping on several workers needs Ray: install kvlab[ray] (pip install 'kvlab[ray]'), or run the sweep "
            "in this process with --workers 1."
        ) from None
    return ray


def check_reachable(address: str, timeout: float = CONNECT_TIMEOUT_S) -> None:
    """Refuse at once an address that is not one (``host:port``, ``ray://host:port``, or Ray's own ``auto`` and
    ``local``), and a ``host:port`` that does not answer: Ray itself would keep trying for minutes."""
    if address in ("auto", "local"):
        return
    host, colon, port = address.removeprefix("ray://").rpartition(":")
    if not colon or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise KvlabError(
            f"{address[:80]!r} is not a Ray address; give host:port or ray://host:port (what `ray status` prints "
            "on the head node), or auto."
        )
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()
    except OSError as error:
        raise KvlabError(
            f"Cannot reach a Ray cluster at {address[:80]} ({error.strerror or error}); start one there with "
            "`ray start --head` or give the address `ray status` prints on its head node."
        ) from None


def _remote_error(error: BaseException) -> BaseException:
    """What a worker raised, unwrapped from Ray's wrapper: a worker's sentence is the user's sentence."""
    cause = getattr(error, "cause", None)
    return cause if isinstance(cause, KvlabError) else error


class SweepWorkers:
    """``workers`` Ray actors each holding the model of ``recipe`` (None: one per GPU of the cluster, or one on a
    cluster without GPUs), on the cluster at ``ray_address`` or on a Ray instance started on this machine (or the one
    this process already joined). Used as a context manager: entering connects, starts the workers and waits until
    each has loaded its model and all run the same (:class:`WorkerModel`); leaving stops them, and the Ray instance
    if it started one. Hand it to :class:`kvlab.runs.sweep.SweepRunner` in place of a loaded model."""

    def __init__(self, recipe: ModelRecipe, workers: int | None = None, ray_address: str | None = None) -> None:
        if workers is not None and workers < 1:
            raise KvlabError(f"A sweep needs at least one worker, not {workers}.")
        self.recipe, self.requested, self.ray_address = recipe, workers, ray_address
        self.actors: list[Any] = []
        self.model: WorkerModel | None = None
        #: Units sent again after their worker died.
        self.rescheduled = 0
        self._ray: ModuleType | None = None
        self._started_ray = False

    @property
    def ray(self) -> ModuleType:
        if self._ray is None:
            raise RuntimeError("the workers are used inside `with SweepWorkers(...)`")
        return self._ray

    def __enter__(self) -> SweepWorkers:
        self._ray = import_ray()
        try:
            self._connect()
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.close()

    def _connect(self) -> None:
        """Join the cluster at the address (checked first, even when this process has joined one already), or the
        one this process has joined, or start one on this machine."""
        if self.ray_address is not None:
            check_reachable(self.ray_address)
        if self.ray.is_initialized():
            return
        quiet: dict[str, Any] = {"log_to_driver": False, "logging_level": logging.ERROR}
        if self.ray_address is None:
            self.ray.init(include_dashboard=False, **quiet)
        else:
            try:
                self.ray.init(address=self.ray_address, **quiet)
            except ConnectionError as error:
                raise KvlabError(f"Cannot join a Ray cluster at {self.ray_address[:80]}: {error}") from None
        self._started_ray = True

    def _start(self) -> None:
        resources = self.ray.cluster_resources()
        gpus, cpus = int(resources.get("GPU", 0)), int(resources.get("CPU", 0))
        on_gpus = gpus > 0 and not self.recipe.on_cpu
        have = gpus if on_gpus else cpus
        count = self.requested if self.requested is not None else (gpus if on_gpus else 1)
        if count > have:
            kind = "GPU" if on_gpus else "CPU"
            raise KvlabError(
                f"{count} workers need a {kind} each and the Ray cluster has {have} {kind}{'' if have == 1 else 's'}; "
                f"ask for at most {have} with --workers."
            )
        forwarded = {name: value for name, value in os.environ.items() if name.startswith(FORWARDED_PREFIX)}
        actor = self.ray.remote(_Worker).options(
            num_gpus=1 if on_gpus else 0,
            num_cpus=1,
            max_restarts=MAX_RESTARTS,
            max_task_retries=0,
            runtime_env={"env_vars": forwarded} if forwarded else None,
        )
        self.actors = [actor.remote(self.recipe) for _ in range(count)]
        models = set(self._loaded_models())
        if len(models) > 1:
            raise KvlabError(
                "The workers do not run the same model on the same kind of device ("
                + "; ".join(sorted(model.describe() for model in models))
                + "), so their trials cannot be filed as one run; give every worker the same files and kind of GPU."
            )
        [self.model] = models

    def _loaded_models(self) -> list[WorkerModel]:
        """What every worker runs, once each has loaded its model; a worker's own sentence (a model that cannot
        load) said as it is."""
        exceptions = self.ray.exceptions
        try:
            return self.ray.get([worker.identity.remote() for worker in self.actors])
        except exceptions.RayActorError as error:
            raise KvlabError(f"A worker stopped while loading the model: {str(error).splitlines()[0]}") from None
        except exceptions.RayTaskError as error:
            raise _remote_error(error) from None

    def close(self) -> None:
        """Stop the workers, and the Ray instance this object started."""
        if self._ray is None:
            return
        for worker in self.actors:
            self._ray.kill(worker)
        self.actors = []
        if self._started_ray:
            self._ray.shutdown()
            self._started_ray = False

    def describe(self) -> str:
        """The workers in words: how many, and what each runs."""
        model = "" if self.model is None else f", each with {self.model.describe()}"
        return f"{len(self.actors)} workers{model}"

    def _ask(self, call: Callable[[Any], Any]) -> Any:
        """What the first worker that answers says to ``call`` (a question about the grid, answered alike by every
        worker); a worker Ray cannot restart is left out on the way."""
        exceptions = self.ray.exceptions
        for worker in list(self.actors):
            try:
                return self.ray.get(call(worker))
            except exceptions.ActorDiedError as error:
                self._drop(worker, error)
            except exceptions.RayActorError:  # stopped while answering; Ray restarts it
                continue
            except exceptions.RayTaskError as error:
                raise _remote_error(error) from None
        raise KvlabError("No worker answered (each stopped while asked); run the same sweep again to resume.")

    def check_fits(self, grid: SweepGrid) -> None:
        self._ask(lambda worker: worker.check_fits.remote(grid))

    def config(self, grid: SweepGrid, cell: Cell, context: int) -> RunConfig:
        return self._ask(lambda worker: worker.config.remote(grid, cell, context))

    def prepare(self, grid: SweepGrid) -> SweepPlan:
        return self._ask(lambda worker: worker.prepare.remote(grid))

    def results(
        self, grid: SweepGrid, units: Sequence[WorkUnit], should_stop: Callable[[], bool]
    ) -> Iterator[UnitResult]:
        """Each unit sent to an idle worker in order, its trials yielded as it comes back; a unit lost with its
        worker is sent again first, up to :data:`MAX_ATTEMPTS` times; a worker Ray could not restart is left out."""
        exceptions = self.ray.exceptions
        grid_ref = self.ray.put(grid)
        waiting = deque(range(len(units)))
        attempts = [0] * len(units)
        idle = list(self.actors)
        in_flight: dict[Any, tuple[Any, int]] = {}
        stopping = False
        while in_flight or (waiting and not stopping):
            while idle and waiting and not stopping:
                if should_stop():
                    stopping = True
                    break
                worker, index = idle.pop(0), waiting.popleft()
                in_flight[worker.run_unit.remote(grid_ref, units[index])] = (worker, index)
            if not in_flight:
                break
            [ref], _ = self.ray.wait(list(in_flight), num_returns=1)
            worker, index = in_flight.pop(ref)
            try:
                done = self.ray.get(ref)
            except exceptions.RayActorError as error:
                self._lost(units[index], attempts, index, error)
                waiting.appendleft(index)
                if isinstance(error, exceptions.ActorUnavailableError) and self._restarted(worker):
                    idle.append(worker)  # back, its model loaded again: the unit is not charged for the restart
                else:
                    self._drop(worker, error)
                continue
            except exceptions.RayTaskError as error:
                raise _remote_error(error) from None
            idle.append(worker)
            for job, trials in done:
                yield units[index], job, trials

    def _restarted(self, worker: Any) -> bool:
        """Wait until a worker Ray is restarting answers again (so that no unit is sent to it, and lost, while it
        loads its model); False where Ray gives it up."""
        exceptions = self.ray.exceptions
        while True:
            try:
                self.ray.get(worker.identity.remote())
                return True
            except exceptions.ActorDiedError:
                return False
            except exceptions.ActorUnavailableError:
                time.sleep(RESTART_POLL_S)

    def _lost(self, unit: WorkUnit, attempts: list[int], index: int, error: BaseException) -> None:
        """Count a unit lost with its worker; refuse it once it has stopped :data:`MAX_ATTEMPTS` workers."""
        attempts[index] += 1
        self.rescheduled += 1
        if attempts[index] >= MAX_ATTEMPTS:
            raise KvlabError(
                f"The unit {unit.label} stopped its worker {MAX_ATTEMPTS} times (last: {str(error).splitlines()[0]}); "
                "the trials stored so far are kept, so resume after freeing memory or with a smaller --batch-size."
            )

    def _drop(self, worker: Any, error: BaseException) -> None:
        """Leave out a worker that cannot be restarted; with none left, the sweep cannot go on."""
        self.actors.remove(worker)
        if not self.actors:
            raise KvlabError(
                f"Every worker has stopped (last: {str(error).splitlines()[0]}); the trials stored so far are kept, "
                "so run the same sweep again to resume."
            )
