"""The ``runs`` and ``export`` commands: list stored runs, and write trials or runs to CSV or Parquet.

Both only read: they open the database read-only, so they never create, migrate or change a file.
"""

from __future__ import annotations

import argparse
import itertools
from pathlib import Path
from typing import Any, Callable

import pandas as pd

from kvlab.cli.options import add_db_argument
from kvlab.store import RunFilter, export_runs, export_trials, open_store
from kvlab.tasks.ruler_score import ruler_scores

#: The columns ``runs`` prints (``export --table runs`` writes every run column); the policy with the parameters
#: it set away from their defaults, each share with its 95 % interval (``accuracy_ci``: Wilson's; ``recall_ci``:
#: the bootstrap's where recalls are fractions) and the mean share of eviction cuts decided by a tie.
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
    "accuracy_ci",
    "recall",
    "recall_ci",
    "ruler",
    "ruler_ci",
    "tie_share",
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
        print(runs_listing(frame, store.trials_frame(filters_from_args(args))).to_string(index=False))
    return 0


def runs_listing(runs: pd.DataFrame, trials: pd.DataFrame) -> pd.DataFrame:
    """``Store.list_runs`` rows as ``runs`` prints them (:data:`LIST_COLUMNS`): shares as fractions to three places,
    intervals as ``0.240–0.760``, ``—`` where a run has none (a text's pass answers nothing; runs stored before the
    tie share was recorded have none); a RULER run's score is the mean over its tasks of their mean recall."""
    from kvlab.runs.tables import policy_name, present, run_shares, with_shares  # loads torch: not at import time

    shares = with_shares(runs, run_shares(trials))
    scores = ruler_scores(trials)
    ruler = [scores[run].score if run in scores else None for run in shares["run_id"]]
    labels = [policy_name(policy, params) for policy, params in zip(shares["policy"], shares["policy_params"])]
    shown = shares.assign(
        policy=labels,
        tie_share=shares["tie_share"].round(3),
        ruler=[None if score is None else round(score.value, 3) for score in ruler],
        ruler_ci=["—" if score is None else f"{score.low:.3f}–{score.high:.3f}" for score in ruler],
        started_at=shares["started_at"].dt.floor("s"),
        **{
            f"{name}_ci": [
                f"{low:.3f}–{high:.3f}" if present(low) else "—"
                for low, high in zip(shares[f"{name}_low"], shares[f"{name}_high"])
            ]
            for name in ("accuracy", "recall")
        },
    )
    rounded = shown[list(LIST_COLUMNS)].round({"accuracy": 3, "recall": 3, "perplexity": 3, "kl": 4})
    return rounded.astype(object).where(rounded.notna(), "—")


def export_command(args: argparse.Namespace) -> int:
    """``kvlab export``: write the matching trials (or runs) to ``--out``."""
    store = open_store(args.db, read_only=True)
    export = export_runs if args.table == "runs" else export_trials
    count = export(store, args.out, filters_from_args(args))
    print(f"Wrote {count} {args.table} to {args.out}.")
    return 0
