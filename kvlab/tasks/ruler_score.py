"""RULER's scoring: the recall of the expected strings in an output, and a run's RULER score with its interval.

RULER's reference scorer for its synthetic tasks, ``string_match_all``, strips the output, turns control characters
into newlines, and counts, case-insensitively, the share of expected strings the output contains; a task's score is
the mean over its items and RULER's score the mean over tasks. :func:`recall` is that share for one output (RULER
reports it in percent). A run of the ``ruler`` task set stores one trial per item, its ``task_id`` naming the task
(:func:`ruler_task_id`) and its ``expected`` the answers joined by :data:`ANSWER_SEPARATOR`; :func:`ruler_scores`
turns a store's trials back into per-task recalls and the score, each with its 95 % interval.

Torch-free, so that the command line and the dashboard can score stored runs without loading a model.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd

from kvlab.answers import holds
from kvlab.errors import KvlabError
from kvlab.stats import mean_interval

#: Joins a trial's expected strings in its ``expected`` column (no generated answer contains it).
ANSWER_SEPARATOR = " | "
#: The row of :func:`scores_frame` that holds the RULER score (the mean over tasks) rather than one task's recall.
SCORE = "RULER"
#: Bootstrap resamples behind an interval.
RESAMPLES = 2000
_TASK_ID = re.compile(r"ruler-([a-z0-9_]+)-\d+-\d+")


def recall(output_text: str, answers: Sequence[str]) -> float:
    """The share of ``answers`` that ``output_text`` contains, ignoring case: RULER's ``string_match_all`` for one
    output (with its ``postprocess_pred``), as a fraction. An empty answer would be contained in every output, so
    answers must hold some text."""
    if not answers or any(not answer.strip() for answer in answers):
        raise KvlabError("RULER's recall needs at least one expected string, none of them empty.")
    return sum(holds(output_text, answer) for answer in answers) / len(answers)


def join_answers(answers: Sequence[str]) -> str:
    """A trial's expected strings as its ``expected`` column holds them."""
    return ANSWER_SEPARATOR.join(answers)


def split_answers(expected: str) -> tuple[str, ...]:
    """The expected strings of a stored trial (:func:`join_answers` read back)."""
    return tuple(expected.split(ANSWER_SEPARATOR))


def ruler_task_id(task: str, context_tokens: int, index: int) -> str:
    """The ``task_id`` of a RULER trial: ``ruler-<task>-<context tokens>-<trial>``."""
    return f"ruler-{task}-{context_tokens}-{index}"


def task_of(task_id: str) -> str | None:
    """The RULER task a trial answered (read from its ``task_id``), or None for a trial of another task."""
    match = _TASK_ID.fullmatch(task_id)
    return match.group(1) if match else None


@dataclass(frozen=True)
class Estimate:
    """A mean recall (a fraction) with its 95 % interval and the items behind it."""

    value: float
    low: float
    high: float
    items: int


@dataclass(frozen=True)
class RulerScore:
    """A run's RULER score (the mean over its tasks of each task's mean recall) and each task's mean recall."""

    score: Estimate
    tasks: dict[str, Estimate]


def ruler_score(recalls: Mapping[str, Sequence[float]], *, resamples: int = RESAMPLES, seed: int = 0) -> RulerScore:
    """The RULER score of per-task recalls, each with its 95 % interval (seeded, so that the same trials always give
    the same intervals).

    A task's interval is :func:`~kvlab.stats.mean_interval`'s: Wilson's when every recall is 0 or 1 (as for
    single-needle tasks), else the percentile bootstrap. When every task has as many items (a finished sweep), the
    score is the mean over all items and its interval is theirs, by the same rule: Wilson's stays honest at 0 %
    and 100 %, where a bootstrap collapses to a point. Otherwise (a sweep stopped part way) it is a percentile
    bootstrap that resamples items within each task, keeping each task's count: the score weighs every task
    equally whatever its number of items, as RULER's does.
    """
    if not recalls or any(len(values) == 0 for values in recalls.values()):
        raise ValueError("a RULER score needs at least one task with at least one item")
    values = {task: np.asarray(recalls[task], dtype=float) for task in sorted(recalls)}
    tasks = {
        task: Estimate(float(held.mean()), *mean_interval(held, resamples=resamples, seed=seed), len(held))
        for task, held in values.items()
    }
    value = float(np.mean([estimate.value for estimate in tasks.values()]))
    items = sum(estimate.items for estimate in tasks.values())
    if len({len(held) for held in values.values()}) == 1:
        low, high = mean_interval(np.concatenate(list(values.values())), resamples=resamples, seed=seed)
    else:
        rng = np.random.default_rng(seed)
        draws = [held[rng.integers(0, len(held), size=(resamples, len(held)))].mean(axis=1) for held in values.values()]
        low, high = (float(bound) for bound in np.quantile(np.mean(draws, axis=0), [0.025, 0.975]))
    return RulerScore(Estimate(value, low, high, items), tasks)


def ruler_scores(trials: pd.DataFrame, *, resamples: int = RESAMPLES, seed: int = 0) -> dict[int, RulerScore]:
    """The RULER score of every run among ``trials`` (``Store.trials_frame``'s rows) that holds RULER trials with
    a recall, by run id; trials of other tasks, and trials stored before recall was recorded, are left out."""
    if trials.empty:
        return {}
    frame = trials.assign(ruler_task=trials["task_id"].map(task_of)).dropna(subset=["ruler_task", "recall"])
    return {
        int(run_id): ruler_score(
            {task: group["recall"].to_numpy(dtype=float) for task, group in run.groupby("ruler_task")},
            resamples=resamples,
            seed=seed,
        )
        for run_id, run in frame.groupby("run_id")
    }


def scores_frame(scores: Mapping[int, RulerScore]) -> pd.DataFrame:
    """Scores as rows ``run_id, task, recall, low, high, items`` (fractions): one per task of each run, and one whose
    task is :data:`SCORE` for the run's RULER score."""
    rows = [
        (run_id, task, estimate.value, estimate.low, estimate.high, estimate.items)
        for run_id, score in scores.items()
        for task, estimate in [*score.tasks.items(), (SCORE, score.score)]
    ]
    return pd.DataFrame(rows, columns=["run_id", "task", "recall", "low", "high", "items"])
