"""The ``live`` command: one live run as the dashboard's live page makes it (a needle prompt or a text, every pass
observed), printed and stored with its replay, so a run made on a GPU server can be watched anywhere."""

from __future__ import annotations

import argparse
import sys

from kvlab.cli.options import (
    add_db_argument,
    add_generation_arguments,
    add_heap_arguments,
    add_model_arguments,
    add_policy_arguments,
    fraction,
    load_model_from_args,
    policy_from_args,
    whole,
)
from kvlab.modes import STREAMING
from kvlab.store import open_store
from kvlab.tasks.texts import read_text
from kvlab.units import exact_bytes

DEFAULT_CONTEXT = 2048
DEFAULT_CHUNK = 256


def register(commands: argparse._SubParsersAction) -> None:
    """Add the ``live`` command."""
    live = commands.add_parser(
        "live",
        help="one observed run (needle or text), stored with its replay for the dashboard",
        description="Run one prompt the way the dashboard's live page does, observing attention at every pass, "
        "and store the run with its replay (the dashboard's live page replays it without a model). The prompt is "
        "a generated needle prompt, or --text-file with --question and --answer.",
    )
    add_model_arguments(live)
    live.add_argument(
        "--context",
        type=whole(64, "--context"),
        default=DEFAULT_CONTEXT,
        help=f"tokens of the needle prompt (default {DEFAULT_CONTEXT})",
    )
    live.add_argument("--depth", type=fraction, default=0.5, help="where the needle sits, 0 to 1 (default 0.5)")
    live.add_argument("--template", default="magic-number", help="the needle's fact template (default magic-number)")
    live.add_argument("--text-file", default=None, metavar="FILE", help="read this UTF-8 text instead of a needle")
    live.add_argument("--question", default="", help="a question about --text-file")
    live.add_argument("--answer", default="", help="the expected answer (a text run is stored only with one)")
    live.add_argument(
        "--raw-prompt", action="store_true", help="give a chat model the text as it is, not in its chat template"
    )
    add_policy_arguments(live)
    live.set_defaults(mode=STREAMING)
    add_heap_arguments(live, eager=False)
    add_generation_arguments(live, default=24)
    add_db_argument(live, "database file the run and its replay are stored in")
    live.set_defaults(func=run_live)


def run_live(args: argparse.Namespace) -> int:
    """Run, print the output and where it was stored."""
    from kvlab.runs.live import (  # loads torch: not at import time
        LiveRun,
        LiveSettings,
        NeedleTask,
        TextTask,
        build_prompt,
    )
    from kvlab.runs.live_store import store_live_run  # loads torch: not at import time

    variant, budget = policy_from_args(args)
    task = (
        NeedleTask(args.context, args.depth, args.template, args.seed)
        if args.text_file is None
        else TextTask(read_text(args.text_file, "text file"), args.question, args.answer, not args.raw_prompt)
    )
    store = open_store(args.db)  # a locked or damaged database is refused before the model loads
    loaded = load_model_from_args(args)
    prompt = build_prompt(loaded, task)
    settings = LiveSettings(
        variant.name,
        variant.params(),
        budget,
        args.mode,
        args.chunk or DEFAULT_CHUNK,
        args.max_new_tokens,
        layout=args.layout,
        compact_at=args.compact_at,
    )
    live = LiveRun(loaded, prompt, settings)
    for _ in live.events():
        pass
    outcome = live.outcome()
    run_id = store_live_run(store, live, outcome)
    store.close()
    print(outcome.text)
    result = outcome.result
    verdict = "not scored" if outcome.contains is None else ("found" if outcome.contains else "not found")
    print(
        f"[{variant.name}, {args.mode}] {prompt.context_tokens:,} prompt tokens, {verdict}; KV in use "
        f"{exact_bytes(result.kv_bytes)} of {exact_bytes(result.kv_bytes_full)} full (measured on "
        f"{loaded.device_kind}); "
        + ("not stored: give --answer to score and store a text run" if run_id is None else f"stored as run {run_id}")
        + ("" if run_id is None else " with its replay"),
        file=sys.stderr,
    )
    return 0
