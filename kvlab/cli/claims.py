"""The ``claims`` command: every quantitative claim of the source articles, checked against a store.

It evaluates the catalogue (:mod:`kvlab.claims`) and prints it, reading the store only. With ``--refresh`` it also
makes the store's claims table that evaluation; a store that lies inside an installed kvlab (the shipped evidence,
when kvlab runs from a wheel) is never written. Neither building its parser nor evaluating imports torch.
"""

from __future__ import annotations

import argparse
import itertools
import shutil
import sys
from pathlib import Path

from kvlab.claims import check_ids, default_claims_db, evaluate_file, refresh, select
from kvlab.claims.evidence import EVIDENCE_DB, shown_path
from kvlab.claims.report import FORMATS, render
from kvlab.errors import KvlabError
from kvlab.paths import installed_read_only
from kvlab.store import DB_ENV_VAR, open_store


def register(commands: argparse._SubParsersAction) -> None:
    """Add the ``claims`` command."""
    claims = commands.add_parser(
        "claims",
        help="check every quantitative claim of the source articles",
        description="Evaluate every claim of the articles kvlab grew from (computed from published configs, "
        "measured from the store's runs, or not measurable here, with the reason) and print them, reading the "
        "store only; with --refresh also write them to the store's claims table.",
    )
    claims.add_argument(
        "--db",
        type=Path,
        default=None,
        metavar="FILE",
        help=f"store to evaluate (default: {shown_path(EVIDENCE_DB)} when it exists, else "
        f"${DB_ENV_VAR}, else $XDG_DATA_HOME/kvlab/runs.duckdb, else ~/.local/share/kvlab/runs.duckdb); a store "
        "inside an installed kvlab is never written",
    )
    claims.add_argument(
        "--refresh",
        action="store_true",
        help="also make the store's claims table this evaluation (the command reads the store only without it)",
    )
    claims.add_argument(
        "--only",
        action="append",
        default=[],
        metavar="ID",
        help="print only these claims, e.g. --only 5 or --only 5,9 (repeatable); --refresh still stores every claim",
    )
    claims.add_argument("--format", choices=FORMATS, default="table", help="output format (default: table)")
    claims.set_defaults(func=claims_command)


def claims_command(args: argparse.Namespace) -> int:
    """``kvlab claims``: evaluate and print; with ``--refresh``, also store the evaluation."""
    ids = [part.strip() for part in itertools.chain.from_iterable(o.split(",") for o in args.only) if part.strip()]
    path = args.db if args.db is not None else default_claims_db()
    check_ids(ids)  # an unknown id is refused before the store is opened
    if args.refresh and installed_read_only(path):
        raise KvlabError(
            f"{path} is installed with kvlab and is not written; run without --refresh to evaluate it, or give "
            "--db FILE to refresh another store."
        )
    if not args.refresh:
        records = evaluate_file(path)
        done = f"{len(records)} claims evaluated against {path}, read only (--refresh stores them)."
    else:
        with open_store(path) as store:
            records = refresh(store)
        done = f"{len(records)} claims evaluated against {store.path}; its claims table refreshed."
    print(render(select(records, ids), args.format, width=min(shutil.get_terminal_size((120, 24)).columns, 160)))
    print(done, file=sys.stderr)
    return 0
