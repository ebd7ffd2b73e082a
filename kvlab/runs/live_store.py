"""Where a finished live run goes: the store, as a run with its one trial and its replay, or, when the store cannot
take it, a CSV record the page offers for download. One place for both the dashboard and ``kvlab live``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvlab.errors import KvlabError
from kvlab.runs.live import LiveOutcome, LivePrompt, LiveRun, LiveTrace
from kvlab.runs.records import batch_trials, run_config
from kvlab.runs.replay import pack
from kvlab.runs.tables import run_label
from kvlab.store import RunConfig, Store, Trial
from kvlab.store.export import frame_bytes, record_frame


@dataclass(frozen=True)
class Filed:
    """Where a finished live run went: its ``run_id`` once stored; otherwise why it could not be stored
    (``problem``) and its run and trial as a CSV file (``record``) for the user to keep. An unscored run (no
    expected answer) is neither stored nor kept."""

    run_id: int | None = None
    problem: str | None = None
    record: bytes | None = None


@dataclass(frozen=True)
class LiveResult:
    """A finished live run as the page keeps it between reruns: redrawn from here when a view setting changes.
    ``ran_with`` is what it ran with (the task and the settings), so a page can tell when its widgets no longer
    match the result drawn under them."""

    trace: LiveTrace
    outcome: LiveOutcome
    prompt: LivePrompt
    filed: Filed = Filed()
    ran_with: tuple[object, ...] = ()


def live_config(live: LiveRun) -> RunConfig:
    """The stored configuration of a live run; the same settings on the same prompt find the same run."""
    return run_config(
        live.loaded,
        live.spec,
        task=live.prompt.task,
        task_hash=live.prompt.task_hash,
        stop_rule=live.stops.rule,
        query_aware=live.settings.query_aware,
        context_length=live.prompt.context_tokens,
    )


def live_trial(live: LiveRun, outcome: LiveOutcome) -> Trial | None:
    """The one trial of a finished live run; None when there is no answer to score it by."""
    item = live.prompt.item()
    if item is None:
        return None
    return batch_trials([(live.prompt.trial_key, item)], outcome.result)[0]


def generated_texts(live: LiveRun) -> list[str]:
    """The output after 0, 1, ... every generated token, decoded once here so a replay needs no tokenizer."""
    ids = live.trace.token_ids
    return [live.loaded.tokenizer.decode(ids[:count]) for count in range(len(ids) + 1)]


def replay_about(live: LiveRun, outcome: LiveOutcome) -> dict[str, str]:
    """A live run in a few words, kept with its replay: the model, device, policy and budget, the prompt and how
    the answer scored."""
    spec, prompt = live.spec, live.prompt
    budget = spec.budget
    verdict = {None: "not scored", True: "found"}.get(outcome.contains, "not found")
    if outcome.exact:
        verdict = "found (exact)"
    return {
        "model": live.loaded.source.label,
        "device": live.loaded.device_kind,
        "policy": run_label(
            spec.policy.name,
            spec.mode,
            None if budget is None else budget.keep,
            None if budget is None else budget.tokens,
            spec.stored_params(),
        ),
        "task": prompt.task_id,
        "prompt_tokens": f"{prompt.context_tokens:,}",
        "question": prompt.question,
        "answer": prompt.answer or "",
        "verdict": verdict,
    }


def store_live_run(store: Store, live: LiveRun, outcome: LiveOutcome, started_by: str | None = None) -> int | None:
    """File a finished live run, its one trial and its replay; None (nothing stored) when there is no answer to
    score it by."""
    scored = live_trial(live, outcome)
    if scored is None:
        return None
    run_id = store.begin_run(live_config(live), started_by=started_by)
    store.add_trial(run_id, scored)
    payload = pack(live.trace, generated_texts(live), replay_about(live, outcome), outcome.result.demotion)
    store.add_replay(run_id, live.prompt.trial_key, payload)
    store.finish_run(run_id)
    return run_id


def file_live_run(
    opener: Callable[[], Store], live: LiveRun, outcome: LiveOutcome, started_by: str | None = None
) -> Filed:
    """Store a finished live run in the store ``opener`` opens; a store that cannot be opened or written (locked,
    damaged, a full disk) loses nothing: the run comes back as a CSV record with the reason."""
    scored = live_trial(live, outcome)
    if scored is None:
        return Filed()
    try:
        run_id = store_live_run(opener(), live, outcome, started_by)
    except KvlabError as error:
        return Filed(problem=str(error), record=frame_bytes(record_frame(live_config(live), scored), ".csv"))
    return Filed(run_id=run_id)
