"""How long a needle sweep will take, said before it starts: its trials, those already stored (a sweep skips them),
and an estimate of the time the rest will take, from speeds measured on this machine with this model.

The speeds come from the seconds the engine stored with earlier needle trials of the same model on the same device
in the same dtype (:func:`stored_speed`), or, when there are none, from one short timed pass at the grid's batch and
chunk shape (:func:`measure_speed`). The arithmetic is pure (:func:`estimated_seconds`, :func:`estimate_sentence`):
the time is taken to grow with the context tokens read and the answers decoded, nothing else, so it is an estimate
and every sentence says so and says what it was based on.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass

import pandas as pd
import torch

from kvlab.engine.generation import Generation, prefill_once
from kvlab.engine.spec import RunSpec
from kvlab.models.loading import LoadedModel
from kvlab.modes import check_mode
from kvlab.policies.full import Full
from kvlab.runs.sweep import SweepGrid, SweepRunner, trial_slots
from kvlab.store import RunFilter, Store, run_key

#: The most recent stored runs whose trials give the speeds: recent enough to reflect this machine as it is now.
RECENT_RUNS = 20
#: Context tokens the timed pass reads at most (fewer when the grid's shortest context is shorter).
MEASURED_TOKENS = 512
#: Decode steps the timed pass takes after reading.
MEASURED_STEPS = 8


@dataclass(frozen=True)
class Speed:
    """Seconds per prompt of a batch: to read one context token, and to decode one answer. ``basis`` says what they
    were measured from, in words that finish the sentence "from ..."."""

    read_s_per_token: float
    decode_s_per_answer: float
    basis: str


@dataclass(frozen=True)
class SweepWork:
    """A sweep's size: its ``trials``, those already ``stored``, and the context tokens its remaining trials read (a
    context read once for several policies counts once)."""

    trials: int
    stored: int
    read_tokens: int

    @property
    def pending(self) -> int:
        """Trials still to run."""
        return self.trials - self.stored


def estimated_seconds(work: SweepWork, speed: Speed) -> float:
    """Seconds for the trials still to run: their reading, token by token, and their answers."""
    return work.read_tokens * speed.read_s_per_token + work.pending * speed.decode_s_per_answer


def duration_text(seconds: float) -> str:
    """A duration rounded as an estimate should be: ``about 40 s``, ``about 14 min``, ``about 2.5 h``."""
    if seconds < 1:
        return "under a second"
    if seconds < 90:
        return f"about {math.ceil(seconds)} s"
    if seconds < 90 * 60:
        return f"about {round(seconds / 60)} min"
    return f"about {seconds / 3600:.1f} h"


def estimate_sentence(work: SweepWork, speed: Speed | None, device: str) -> str:
    """What a sweep will do, in one sentence: ``960 trials (0 stored); about 14 min on cpu for the 960 to run,
    from ... (an estimate).``; without a ``speed``, the counts alone."""
    counts = f"{work.trials:,} {'trial' if work.trials == 1 else 'trials'} ({work.stored:,} stored)"
    if work.pending == 0:
        return f"{counts}: nothing left to run."
    if speed is None:
        return f"{counts}; {work.pending:,} to run."
    return (
        f"{counts}; {duration_text(estimated_seconds(work, speed))} on {device} for the {work.pending:,} to run, "
        f"from {speed.basis} (an estimate)."
    )


def speed_from_trials(trials: pd.DataFrame, what: str) -> Speed | None:
    """The median speed of stored trials (``prefill_s``, ``decode_s``, ``context_tokens``: a batch's seconds are
    stored divided by its size, so these are already per prompt); None when none has its seconds. ``what`` names
    the trials in the basis."""
    timed = trials.dropna(subset=["prefill_s", "decode_s", "context_tokens"])
    timed = timed[timed["context_tokens"] > 0]
    if timed.empty:
        return None
    read = float((timed["prefill_s"] / timed["context_tokens"]).median())
    decode = float(timed["decode_s"].median())
    return Speed(read, decode, f"the median speed of {len(timed):,} stored {what}")


def sweep_work(loaded: LoadedModel, grid: SweepGrid, store: Store | None) -> SweepWork:
    """The grid's trials, those ``store`` already holds (found as the sweep finds them: each run by its
    configuration, each trial by its key), and the context tokens the rest will read. Reads the store only."""
    runner = None if store is None else SweepRunner(loaded, store, grid)
    stored_runs = _stored_runs(loaded, grid, store)
    trials = stored = read_tokens = 0
    for context in grid.contexts:
        keys = {key for key, _ in trial_slots(grid, context)}
        shared: set[str] = set()
        for cell in grid.cells():
            run_id = None if runner is None else stored_runs.get(run_key(runner.config(cell, context)))
            held = keys & set(store.stored_trials(run_id)) if store is not None and run_id is not None else set()
            pending = keys - held
            trials += len(keys)
            stored += len(held)
            if grid.shares_read(cell):
                shared |= pending
            else:
                read_tokens += context * len(pending)
        read_tokens += context * len(shared)
    return SweepWork(trials, stored, read_tokens)


def _stored_runs(loaded: LoadedModel, grid: SweepGrid, store: Store | None) -> dict[str, int]:
    """The stored runs that could be cells of the grid, by run key."""
    if store is None:
        return {}
    runs = store.list_runs(RunFilter(models=(loaded.source.label,), tasks=(grid.task,), context_lengths=grid.contexts))
    return dict(zip(runs["run_key"], runs["run_id"].astype(int)))


def stored_speed(loaded: LoadedModel, grid: SweepGrid, store: Store | None) -> Speed | None:
    """The speed of the trials of the :data:`RECENT_RUNS` most recent runs of the grid's task and modes on this
    model, device and dtype; None when there are none with seconds."""
    if store is None:
        return None
    runs = store.list_runs(RunFilter(models=(loaded.source.label,), tasks=(grid.task,), modes=grid.modes))
    same = runs[(runs["device"] == loaded.device_kind) & (runs["dtype"] == loaded.dtype_name) & (runs["trials"] > 0)]
    if same.empty:
        return None
    recent = tuple(int(run_id) for run_id in same["run_id"].tail(RECENT_RUNS))
    return speed_from_trials(
        store.trials_frame(RunFilter(run_ids=recent)), f"{grid.task} trials of this model on {loaded.device_kind}"
    )


def measure_speed(loaded: LoadedModel, grid: SweepGrid) -> Speed:
    """Time one read of a batch of the grid's size and chunk (remembering what its evicting policies need, as a
    sweep's shared read does) of up to :data:`MEASURED_TOKENS` tokens, then :data:`MEASURED_STEPS` decode steps; an
    untimed read of one short prompt first pays the one-time setup. Answers are counted at the grid's
    ``max_new_tokens`` (an answer that stops early takes less)."""
    tokens = min(min(grid.contexts), MEASURED_TOKENS)
    observed = [cell.variant for cell in grid.cells() if cell.variant.policy.evicts]
    chunk = RunSpec(Full(), mode=check_mode(grid.modes[0]), chunk=grid.chunk).chunk_size(tokens)
    prefill_once(loaded, _prompt_ids(loaded, 1, min(tokens, 32)), observed, chunk=min(chunk, 32))
    read = prefill_once(loaded, _prompt_ids(loaded, grid.batch_size, tokens), observed, chunk=chunk)
    forced = torch.zeros((grid.batch_size, MEASURED_STEPS), dtype=torch.long)
    decoding = Generation(loaded, RunSpec(Full(), max_new_tokens=MEASURED_STEPS), prefilled=read, forced_ids=forced)
    for _ in decoding.events():
        pass
    step = statistics.median(decoding.result().token_seconds)
    return Speed(
        read_s_per_token=read.seconds / (grid.batch_size * tokens),
        decode_s_per_answer=step * grid.max_new_tokens / grid.batch_size,
        basis=(
            f"one timed read of {grid.batch_size} x {tokens:,} tokens and {MEASURED_STEPS} decode steps on "
            f"{loaded.device_kind} just now"
        ),
    )


def _prompt_ids(loaded: LoadedModel, batch: int, tokens: int) -> torch.Tensor:
    """A ``(batch, tokens)`` prompt of the model's token ids (what they say does not change the time)."""
    vocabulary = max(len(loaded.tokenizer), 1)
    return torch.arange(batch * tokens, dtype=torch.long).remainder(vocabulary).reshape(batch, tokens)


def sweep_estimate(
    loaded: LoadedModel, grid: SweepGrid, store: Store | None, measure: Callable[[], Speed | None]
) -> str:
    """The sentence said before a sweep starts (:func:`estimate_sentence`), its speed from the stored trials when
    there are some, else from ``measure`` (one timed pass: :func:`measure_speed`, or None when the device is busy
    and the time cannot be measured now); nothing is measured when nothing is left to run."""
    work = sweep_work(loaded, grid, store)
    if work.pending == 0:
        return estimate_sentence(work, None, loaded.device_kind)
    speed = stored_speed(loaded, grid, store) or measure()
    sentence = estimate_sentence(work, speed, loaded.device_kind)
    return sentence if speed is not None else f"{sentence} The time is estimated once the device is free."
