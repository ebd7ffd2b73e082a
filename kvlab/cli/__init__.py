"""``kvlab`` (or ``python -m kvlab``): the command line.

Each command parses and checks its arguments before anything expensive happens, so that a bad budget or an unknown
policy costs no model load. A :class:`~kvlab.errors.KvlabError` is printed as one sentence on stderr with exit
status 2, Ctrl-C ends with status 130, and an unexpected exception (a bug) is one sentence too, with its traceback
written to a log file (:mod:`kvlab.guard`) and exit status 1.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Callable, NoReturn, Sequence

from kvlab.cli import advise, claims, costs, evaluation, generate, live, profile, quality, sidechannel, store
from kvlab.cli.terminal import one_line, safe_output
from kvlab.errors import INTERRUPTED, INTERRUPTED_STATUS, KvlabError
from kvlab.guard import log_to_file

Command = Callable[[argparse.Namespace], int]


class Parser(argparse.ArgumentParser):
    """argparse, with a usage error as one line (the command's ``--help`` shows the usage)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {one_line(message)} (see {self.prog} --help).\n")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with every command."""
    parser = Parser(prog="kvlab", description="KV-cache eviction lab bench.")
    commands = parser.add_subparsers(dest="command", required=True)
    generate.register(commands)
    evaluation.register(commands)
    store.register(commands)
    quality.register(commands)
    sidechannel.register(commands)
    profile.register(commands)
    claims.register(commands)
    costs.register(commands)
    advise.register(commands)
    live.register(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the exit status."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as done:  # --help, or a usage error already printed
        return done.code if isinstance(done.code, int) else 2
    func: Command = args.func
    try:
        with safe_output():
            return func(args)
    except KvlabError as error:
        print(f"error: {one_line(str(error))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(INTERRUPTED, file=sys.stderr)
        return INTERRUPTED_STATUS
    except BrokenPipeError:  # the reader of our output went away (`kvlab runs | head`)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except Exception as error:
        print(f"error: {log_to_file(error, f'kvlab {args.command}')}", file=sys.stderr)
        return 1
