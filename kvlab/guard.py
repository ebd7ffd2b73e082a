"""The last line of defence: an exception nobody expected becomes one sentence for the user and a traceback in a log.

Every failure a user can cause is a :class:`~kvlab.errors.KvlabError` with its own sentence. Anything else is a bug;
the user still gets one sentence (with a short reference to quote), never a traceback, and the traceback goes where
the operator looks: the server log for the dashboard, a log file for the command line.
"""

from __future__ import annotations

import logging
import os
import secrets
import traceback
from collections.abc import Mapping
from datetime import datetime, timezone
from pathlib import Path

from kvlab.paths import user_file

LOG_ENV_VAR = "KVLAB_LOG"
_LOGGER = logging.getLogger("kvlab")


def log_file(env: Mapping[str, str] = os.environ) -> Path:
    """Where the command line writes tracebacks: ``$KVLAB_LOG``, else ``$XDG_STATE_HOME/kvlab/kvlab.log``, else
    ``~/.local/state/kvlab/kvlab.log``."""
    return user_file(env, LOG_ENV_VAR, "XDG_STATE_HOME", ".local/state", "kvlab", "kvlab.log")


def new_reference() -> str:
    """A short random reference that ties the sentence a user saw to the traceback in the log."""
    return secrets.token_hex(4)


def log_to_server(error: BaseException, where: str) -> str:
    """Log ``error``'s traceback through Python's logging (the dashboard's server log); returns the sentence for
    the page."""
    reference = new_reference()
    _LOGGER.error("unexpected error %s in %s", reference, where, exc_info=error)
    return (
        f"Something went wrong on the server ({type(error).__name__}, reference {reference}); the details are in "
        "the server log."
    )


def log_to_file(error: BaseException, where: str, env: Mapping[str, str] = os.environ) -> str:
    """Append ``error``'s traceback to :func:`log_file` (or, when that cannot be written, to the logging system);
    returns the sentence for the terminal."""
    reference = new_reference()
    text = "".join(traceback.format_exception(error))
    stamp = datetime.now(timezone.utc).isoformat(timespec="seconds")
    path = log_file(env)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a", encoding="utf-8") as handle:
            handle.write(f"--- {stamp} reference {reference} in {where}\n{text}\n")
    except OSError:
        _LOGGER.error("unexpected error %s in %s", reference, where, exc_info=error)
        return f"kvlab failed unexpectedly ({type(error).__name__}, reference {reference})."
    return (
        f"kvlab failed unexpectedly ({type(error).__name__}); the traceback is in {path} under reference {reference}."
    )
