"""The ``runs`` and ``export`` commands: list stored runs, and write trials or runs to CSV or Parquet.

Both only read: they open the database read-only, so they never create, migrate or change a file.
"""

from __future__ import annotations

import argparse
import itertools
from pathlib import Path
from typing import Any, Callable

from kvlab.cli.options import add_db_argument
from kvlab.store import RunFilter, export_runs, export_trials, open_store

#: The columns ``runs`` prints (``export --table runs`` writes every run column); the policy with the parameters
#: it set away from their defaults.
LIST_COLUMNS: tuple[str, ...] = (
    "run_id",
    "status",
    "model",
    "policy",
    "mode",
    "keep",
    "budget_tokens",
    "task",
    "context_length",
    "trials",
    "accuracy",
    "perplexity",
    "kl",
    "started_by",
    "started_at",
)

# (option, RunFilter field, element type, help)
_FILTER_OPTIONS: tuple[tuple[str, str, Callable[[str], Any], str], ...] = (
    ("--run-id", "run_ids", int, "run id"),
    ("--model", "models", str, "model name"),
    ("--policy", "policies", str, "eviction policy"),
    ("--mode", "modes", str, "eviction mode"),
    ("--task", "tasks", str, "task description, e.g. needle"),
    ("--context-length", "context_lengths", int, "target context length in tokens"),
)


def register(commands: argparse._SubParsersAction) -> None:
    """Add the ``runs`` and ``export`` commands."""
    runs = commands.add_parser("runs", help="list the stored runs", description="List the stored runs.")
    _add_store_options(runs)
    runs.set_defaults(func=list_runs_command)

    export = commands.add_parser(
        "export",
        help="write stored trials or runs to a CSV or Parquet file",
        description="Write one row per trial (with its run's columns), or per run, to a .csv or .parquet file. "
        "The file's directory must exist; the database itself, or any other DuckDB file, is never "
        "overwritten.",
    )
    _add_store_options(export)
    export.add_argument("--out", required=True, type=Path, metavar="FILE", help="output file: .csv or .parquet")
    export.add_argument(
        "--table", choices=("trials", "runs"), default="trials", help="what one row is (default: trials)"
    )
    export.set_defaults(func=export_command)


def _add_store_options(parser: argparse.ArgumentParser) -> None:
    """``--db`` and the run filters, shared by both commands."""
    add_db_argument(parser, "database file, opened read-only")
    for option, dest, element, what in _FILTER_OPTIONS:
        parser.add_argument(
            option,
            dest=dest,
            type=_comma_list(element),
            action="append",
            default=[],
            metavar=option.lstrip("-").upper().replace("-", "_"),
            help=f"only runs with this {what}; repeat or separate with commas for several",
        )


def _comma_list(element: Callable[[str], Any]) -> Callable[[str], list[Any]]:
    """An argparse type reading ``a,b,c`` as a list of ``element`` values."""

    def parse(text: str) -> list[Any]:
        try:
            return [element(item.strip()) for item in text.split(",") if item.strip()]
        except ValueError as exc:
            raise argparse.ArgumentTypeError(
                f"{text[:60]!r} is not a comma-separated list of {element.__name__}"
            ) from exc

    return parse


def filters_from_args(args: argparse.Namespace) -> RunFilter:
    """The :class:`RunFilter` the filter options describe (repeated options and comma lists combined)."""
    return RunFilter(
        **{dest: tuple(itertools.chain.from_iterable(getattr(args, dest))) for _, dest, _, _ in _FILTER_OPTIONS}
    )


def list_runs_command(args: argparse.Namespace) -> int:
    """``kvlab runs``: print the matching runs as a table."""
    store = open_store(args.db, read_only=True)
    frame = store.list_runs(filters_from_args(args))
    if frame.empty:
        print(f"No matching runs in {store.path}.")
    else:
        from kvlab.ui.tables import policy_name

        labels = [policy_name(policy, params) for policy, params in zip(frame["policy"], frame["policy_params"])]
        shown = frame.assign(policy=labels)[list(LIST_COLUMNS)].round({"accuracy": 3, "perplexity": 3, "kl": 4})
        print(shown.assign(started_at=shown["started_at"].dt.floor("s")).to_string(index=False))
    return 0


def export_command(args: argparse.Namespace) -> int:
    """``kvlab export``: write the matching trials (or runs) to ``--out``."""
    store = open_store(args.db, read_only=True)
    export = export_runs if args.table == "runs" else export_trials
    count = export(store, args.out, filters_from_args(args))
    print(f"Wrote {count} {args.table} to {args.out}.")
    return 0
