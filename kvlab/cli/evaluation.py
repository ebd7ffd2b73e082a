"""The ``sweep`` and ``eval`` commands: accuracy against memory over a grid, or one policy on user tasks."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from kvlab.cli.options import (
    add_bos_argument,
    add_db_argument,
    add_generation_arguments,
    add_heap_arguments,
    add_model_arguments,
    add_policy_arguments,
    add_seed_argument,
    heap_settings,
    load_model_from_args,
    numbers,
    run_spec_from_args,
    whole,
)
from kvlab.errors import INTERRUPTED_STATUS, KvlabError
from kvlab.files import check_file
from kvlab.modes import MODES, PREFILL, modes_help
from kvlab.runs.benchmarks import NEEDLE_DEPTHS
from kvlab.store import RunFilter, Store, default_db_path, has_database, open_store
from kvlab.tasks.ruler_score import ruler_scores

if TYPE_CHECKING:  # the parser is built without loading torch
    from kvlab.models.loading import LoadedModel
    from kvlab.runs.sweep import GridKind, SweepGrid, UnitExecutor

GRID_KINDS: dict[str, GridKind] = {
    "needle": "single",
    "needle-multikey": "multi-key",
    "needle-multivalue": "multi-value",
    "ruler": "ruler",
}
NEEDLE_NEW_TOKENS = 24


def register(commands: argparse._SubParsersAction) -> None:
    """Add the ``sweep`` and ``eval`` commands."""
    sweep = commands.add_parser(
        "sweep",
        help="accuracy against memory over a grid of needle or RULER tasks",
        description="Run or resume a grid of policies x budgets x modes x context lengths "
        "x depths x trials (x RULER tasks with --task ruler); every trial is stored as it finishes.",
    )
    add_model_arguments(sweep)
    sweep.add_argument("--policies", required=True, help="comma list, e.g. h2o,streaming,random")
    sweep.add_argument(
        "--param",
        action="append",
        default=[],
        metavar="POLICY.KEY=VALUE",
        help="a parameter of one listed policy, e.g. snapkv.window=16 (repeatable)",
    )
    sweep.add_argument("--keep", default="", help="kept fractions, e.g. 0.1,0.3,0.5")
    sweep.add_argument(
        "--mode", default=PREFILL, help=f"{', '.join(MODES)}, or both: {','.join(MODES)}. {modes_help()}"
    )
    add_heap_arguments(sweep)
    add_bos_argument(sweep)
    sweep.add_argument("--contexts", required=True, help="context lengths in tokens, e.g. 1024,2048")
    sweep.add_argument(
        "--depths",
        default=None,
        help=f"needle depths in [0, 1], or 'random' (default: {NEEDLE_DEPTHS}; RULER's tasks draw their own)",
    )
    sweep.add_argument(
        "--trials",
        type=whole(1, "--trials"),
        default=1,
        help="items per depth (per cell with --depths random, per RULER task with --task ruler)",
    )
    sweep.add_argument("--task", default="needle", choices=tuple(GRID_KINDS))
    sweep.add_argument(
        "--ruler-tasks",
        default=None,
        metavar="TASKS",
        help="with --task ruler, a comma list of RULER's tasks, e.g. niah_single_1,vt,cwe (default: all 11)",
    )
    add_seed_argument(sweep)
    sweep.add_argument("--chunk", type=whole(1, "a chunk"), default=None)
    sweep.add_argument("--batch-size", type=whole(1, "--batch-size"), default=8)
    sweep.add_argument(
        "--max-new-tokens",
        type=whole(1, "--max-new-tokens"),
        default=None,
        help=f"tokens to generate at most (default: {NEEDLE_NEW_TOKENS}; with --task ruler, RULER's largest budget)",
    )
    sweep.add_argument(
        "--query-agnostic",
        action="store_true",
        help="read the question after compression (default: before, as part of the prompt)",
    )
    sweep.add_argument(
        "--no-share-prefill",
        action="store_true",
        help="let every prefill-mode policy read each context itself (for measuring the sharing)",
    )
    sweep.add_argument(
        "--workers",
        type=whole(1, "--workers"),
        default=None,
        help="Ray workers, each holding the model on a GPU of its own (default: one per visible GPU; with at most one "
        "GPU and no --ray-address, the sweep runs in this process, without Ray)",
    )
    sweep.add_argument(
        "--ray-address",
        default=None,
        metavar="ADDR",
        help="join the Ray cluster at ADDR (host:port, ray://host:port or auto) and run the workers there",
    )
    add_db_argument(sweep, "database file")
    sweep.add_argument("--quiet", action="store_true", help="no progress bar and no estimate")
    sweep.add_argument(
        "--dry-run",
        action="store_true",
        help="print the trials, those already stored and an estimate of the time the rest take, and exit",
    )
    sweep.set_defaults(func=run_sweep)

    evaluate = commands.add_parser(
        "eval",
        help="answer the tasks of a JSONL file under one policy",
        description='Each line: {"id": str, "context": str, "question": str, "answer": str}.',
    )
    add_model_arguments(evaluate)
    evaluate.add_argument("--tasks", required=True, help="a JSONL file of tasks")
    add_policy_arguments(evaluate)
    add_heap_arguments(evaluate)
    add_bos_argument(evaluate)
    add_generation_arguments(evaluate, default=32)
    evaluate.add_argument("--query-agnostic", action="store_true", help="read the question after compression")
    evaluate.add_argument("--db", default=None, metavar="FILE", help="store the run in this database")
    evaluate.add_argument("--json", action="store_true")
    evaluate.set_defaults(func=run_eval)


def _stop_on_sigterm() -> Callable[[], bool]:
    """Make SIGTERM ask the sweep to stop once the work in flight is stored, so that a killed sweep marks its runs
    interrupted on the way out and is never cut off inside a write to the store; a second SIGTERM interrupts at once,
    like Ctrl-C. Returns what the runner asks before each unit of work."""
    asked = threading.Event()

    def handler(signum, frame):
        if asked.is_set():
            raise KeyboardInterrupt
        asked.set()

    signal.signal(signal.SIGTERM, handler)
    return asked.is_set


def sweep_grid(args: argparse.Namespace):
    """The grid the ``sweep`` arguments describe, checked (no model is needed to check it)."""
    from kvlab.runs.sweep import SweepGrid, parse_policies  # loads torch: not at import time
    from kvlab.tasks.ruler import MAX_NEW_TOKENS, RULER_TASKS  # loads torch: not at import time

    ruler = args.task == "ruler"
    if args.ruler_tasks is not None and not ruler:
        raise KvlabError("--ruler-tasks chooses among RULER's tasks; use it with --task ruler.")
    depths_text = NEEDLE_DEPTHS if args.depths is None and not ruler else args.depths
    depths = None if depths_text is None or depths_text.strip() == "random" else numbers(depths_text, float, "--depths")
    listed = RULER_TASKS if args.ruler_tasks is None else args.ruler_tasks.split(",")
    chosen = tuple(task.strip() for task in listed if task.strip())
    new_tokens = MAX_NEW_TOKENS if ruler else NEEDLE_NEW_TOKENS
    return SweepGrid(
        policies=parse_policies(args.policies, args.param),
        keeps=numbers(args.keep, float, "--keep"),
        contexts=numbers(args.contexts, int, "--contexts"),
        depths=depths,
        trials=args.trials,
        modes=tuple(m.strip() for m in args.mode.split(",") if m.strip()),
        seed=args.seed,
        kind=GRID_KINDS[args.task],
        ruler_tasks=chosen,
        chunk=args.chunk,
        query_aware=not args.query_agnostic,
        max_new_tokens=new_tokens if args.max_new_tokens is None else args.max_new_tokens,
        batch_size=args.batch_size,
        share_prefill=not args.no_share_prefill,
        bos=args.bos,
        **heap_settings(args),
    )


def existing_store(path: str | None) -> Store | None:
    """The database at ``path`` (or the default one) opened read-only, or None when there is none yet: a dry run
    creates and changes nothing."""

    where = Path(path) if path else default_db_path()
    return open_store(where, read_only=True) if has_database(where) else None


def run_sweep(args: argparse.Namespace) -> int:
    """Run (or resume) a sweep, in this process or on Ray workers, and report what was run and what was already
    stored."""
    import importlib.util

    import torch

    from kvlab.runs.cluster import runs_in_process  # loads torch: not at import time

    grid = sweep_grid(args)
    gpus = 0 if args.device_map is not None else torch.cuda.device_count()  # a split model fills its GPUs itself
    ray_installed = importlib.util.find_spec("ray") is not None
    if args.dry_run or runs_in_process(args.workers, args.ray_address, args.device, gpus, ray_installed):
        return _sweep_in_process(args, grid)
    return _sweep_on_workers(args, grid)


def _sweep_in_process(args: argparse.Namespace, grid: SweepGrid) -> int:
    """The sweep with the model loaded here, estimated first (only estimated with ``--dry-run``)."""
    from kvlab.runs.estimate import measure_speed, sweep_estimate  # loads torch: not at import time

    loaded = load_model_from_args(args)
    grid.check_fits(loaded)  # before the store is opened: a grid that cannot run creates no database
    if args.dry_run:
        print(sweep_estimate(loaded, grid, existing_store(args.db), functools.partial(measure_speed, loaded, grid)))
        return 0
    store = open_store(args.db)
    if not args.quiet:
        print(sweep_estimate(loaded, grid, store, functools.partial(measure_speed, loaded, grid)), file=sys.stderr)
    return _run_and_report(loaded, store, grid, args)


def _sweep_on_workers(args: argparse.Namespace, grid: SweepGrid) -> int:
    """The sweep on Ray workers, each loading the model the options name; this process writes the store."""
    from kvlab.runs.cluster import ModelRecipe, SweepWorkers  # loads torch: not at import time

    if args.device_map is not None:
        raise KvlabError("A model split by --device-map runs in one process; leave out --workers and --ray-address.")
    recipe = ModelRecipe(args.model, args.gguf_file, args.device, args.dtype, args.trust_remote_code)
    with SweepWorkers(recipe, args.workers, args.ray_address) as workers:
        workers.check_fits(grid)  # before the store is opened: a grid that cannot run creates no database
        store = open_store(args.db)
        if not args.quiet:
            print(f"sweeping on {workers.describe()}", file=sys.stderr)
        return _run_and_report(workers, store, grid, args)


def _run_and_report(model: LoadedModel | UnitExecutor, store: Store, grid: SweepGrid, args: argparse.Namespace) -> int:
    """Run the sweep with a progress bar; report what ran, or how to resume after an interruption."""
    from tqdm import tqdm

    from kvlab.runs.sweep import SweepRunner  # loads torch: not at import time

    bar = tqdm(total=0, unit="trial", file=sys.stderr, disable=args.quiet)

    def progress(done: int, total: int, label: str) -> None:
        bar.total = total
        bar.n = done
        bar.set_description(label)
        bar.refresh()

    runner = SweepRunner(model, store, grid, progress=progress, should_stop=_stop_on_sigterm())
    try:
        summary = runner.run()
    except KeyboardInterrupt:
        summary = runner.summary
        summary.stopped = True
    bar.close()
    if summary.stopped:
        print(
            f"interrupted after {summary.ran} new trials; run the same command again to resume ({store.path}).",
            file=sys.stderr,
        )
        return INTERRUPTED_STATUS
    print(
        f"ran {summary.ran} trials, {summary.skipped} were already stored; runs "
        f"{', '.join(map(str, summary.run_ids))} in {store.path}"
    )
    if grid.kind == "ruler":
        print_ruler_scores(store, summary.run_ids)
    return 0


def print_ruler_scores(store: Store, run_ids: list[int]) -> None:
    """Each run's RULER score (the mean over its tasks of their mean recall) with its 95 % interval."""
    from kvlab.runs.tables import run_label  # loads torch: not at import time

    runs = store.list_runs(RunFilter(run_ids=tuple(run_ids))).set_index("run_id")
    for run_id, score in ruler_scores(store.trials_frame(RunFilter(run_ids=tuple(run_ids)))).items():
        run = runs.loc[run_id]
        label = run_label(run["policy"], run["mode"], run["keep"], run["budget_tokens"], run["policy_params"])
        print(
            f"run {run_id} ({label}, {run['context_length']:,} tokens): RULER {score.score.value:.1%} "
            f"(95% interval {score.score.low:.1%} to {score.score.high:.1%}) over {len(score.tasks)} tasks, "
            f"{score.score.items} items"
        )


def run_eval(args: argparse.Namespace) -> int:
    """Answer every task of a JSONL file under one policy; print accuracy and per-item results."""
    from kvlab.runs.evaluate import evaluate_items  # loads torch: not at import time
    from kvlab.runs.records import items_hash, run_config, stops_for  # loads torch: not at import time
    from kvlab.tasks.items import load_jsonl  # loads torch: not at import time

    spec = run_spec_from_args(args)  # bad settings, task files and stores are refused before the model loads
    check_file(args.tasks, "task file")
    store = open_store(args.db) if args.db else None
    loaded = load_model_from_args(args)
    items = load_jsonl(args.tasks, loaded.tokenizer, loaded.limits, args.max_new_tokens, spec.bos)
    stops = stops_for(loaded, one_line_answers=True)
    spec = dataclasses.replace(spec, stop_token_ids=stops.token_ids)
    query_aware = not args.query_agnostic
    run_id = None
    on_trial = None
    if store is not None:
        config = run_config(
            loaded,
            spec,
            task=f"jsonl:{Path(args.tasks).name}",
            task_hash=items_hash(f"{item.task_id}\t{item.content_hash}" for item in items),
            stop_rule=stops.rule,
            query_aware=query_aware,
            context_length=None,
        )
        run_id = store.begin_run(config)
        on_trial = functools.partial(store.add_trial, run_id)
    finished = False
    try:
        evaluation = evaluate_items(loaded, items, spec, query_aware=query_aware, on_trial=on_trial)
        finished = True
    finally:
        if store is not None and run_id is not None:
            store.finish_run(run_id, "finished" if finished else "interrupted")
    if args.json:
        print(
            json.dumps(
                {
                    "accuracy": evaluation.accuracy,
                    "exact_accuracy": evaluation.exact_accuracy,
                    "run_id": run_id,
                    "items": [
                        {
                            "id": t.task_id,
                            "correct": t.correct,
                            "exact": t.exact,
                            "expected": t.expected,
                            "output": t.output,
                            "context_tokens": t.context_tokens,
                            "kv_bytes": t.kv_bytes,
                            "peak_kv_bytes": t.peak_kv_bytes,
                        }
                        for t in evaluation.trials
                    ],
                }
            )
        )
    else:
        for trial in evaluation.trials:
            mark = "ok " if trial.correct else "MISS"
            print(f"{mark} {trial.task_id}: expected {trial.expected!r}, got {trial.output!r}")
        print(
            f"accuracy {evaluation.accuracy:.1%} (exact {evaluation.exact_accuracy:.1%}) over "
            f"{len(evaluation.trials)} tasks" + (f"; stored as run {run_id}" if run_id is not None else "")
        )
    return 0
