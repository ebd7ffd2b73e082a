"""Evaluating one policy on a list of task items (user tasks from JSONL files); each trial goes to ``on_trial``
(the command line stores it there)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvlab.engine.generation import generate
from kvlab.engine.spec import RunSpec
from kvlab.errors import shown_name
from kvlab.models.loading import LoadedModel
from kvlab.runs.records import batch_trials
from kvlab.runs.sweep import prompt_tensors
from kvlab.store import Trial
from kvlab.tasks.items import TaskItem


@dataclass(frozen=True)
class Evaluation:
    """Per-item trials and the accuracies over them (contains-match and exact first-line match)."""

    trials: list[Trial]

    @property
    def accuracy(self) -> float:
        return sum(bool(t.correct) for t in self.trials) / len(self.trials)

    @property
    def exact_accuracy(self) -> float:
        return sum(bool(t.exact) for t in self.trials) / len(self.trials)


def evaluate_items(
    loaded: LoadedModel, items: Sequence[TaskItem], spec: RunSpec, *, query_aware: bool = True, on_trial=None
) -> Evaluation:
    """Answer each item under ``spec`` (one at a time: user contexts have different lengths), once every item is
    known to fit the model."""
    for item in items:
        loaded.limits.check(item.context_tokens, spec.max_new_tokens, shown_name(loaded.name))
    trials: list[Trial] = []
    for item in items:
        batch = [(item.task_id, item)]
        context, question = prompt_tensors(batch, query_aware, loaded.device)
        result = generate(loaded, context, spec, suffix_ids=question)
        trial = batch_trials(batch, result)[0]
        trials.append(trial)
        if on_trial is not None:
            on_trial(trial)
    return Evaluation(trials)
