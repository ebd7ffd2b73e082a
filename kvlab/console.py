"""The ``kvlab`` console command, where Ctrl-C ends cleanly at any moment.

Importing the command line takes a second or two (pandas, DuckDB); an interrupt then, or while the arguments are
parsed, would otherwise end in a traceback, or in an ``ImportError`` where a library wraps the interrupt that hit its
import. Here an interrupt during the import is noted as it arrives, whatever the import turns it into, and every
interrupt ends with ``Interrupted.`` on stderr and exit status 130, as one during a command does
(:func:`kvlab.cli.main`).
"""

from __future__ import annotations

import signal
import sys
from types import FrameType

from kvlab.errors import INTERRUPTED, INTERRUPTED_STATUS

_interrupts: list[int] = []


def _note_interrupt(signum: int, frame: FrameType | None) -> None:
    _interrupts.append(signum)
    raise KeyboardInterrupt


signal.signal(signal.SIGINT, _note_interrupt)
try:
    from kvlab.cli import main
except BaseException:
    if not _interrupts:
        raise
    print(INTERRUPTED, file=sys.stderr)
    sys.exit(INTERRUPTED_STATUS)
finally:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def run() -> None:
    """:func:`kvlab.cli.main` with its status as the process's exit status; Ctrl-C at any moment is status 130."""
    try:
        status = main()
    except KeyboardInterrupt:
        print(INTERRUPTED, file=sys.stderr)
        status = INTERRUPTED_STATUS
    sys.exit(status)
