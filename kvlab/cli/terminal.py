"""What kvlab prints to a terminal, made safe to print: one helper for every command.

Text a command prints may come from a user or a file: a model directory's name, a GGUF's licence, a task's name or
expected answer, a stored run's model, what a model generated. Any of it may hold control characters (an escape
sequence can restyle the terminal or set its title) or Unicode's bidirectional controls (which reorder what is
shown, so a line reads differently from what it holds). :func:`shown` writes every such character as a visible
escape; :func:`safe_output` puts every line a command writes through it, so no command can forget.
"""

from __future__ import annotations

import contextlib
import re
import sys
from collections.abc import Iterator
from typing import Any, TextIO

#: C0 controls but line feed, tab and carriage return (a progress bar's), DEL, C1 controls, and the bidirectional
#: controls (embeddings, overrides, isolates, marks).
_UNSAFE = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")
#: What a one-line message escapes besides: every line break.
_BREAKS = re.compile("[\n\r\t]")


def _escaped(match: re.Match[str]) -> str:
    return repr(match.group())[1:-1] if ord(match.group()) < 0x100 else f"\\u{ord(match.group()):04x}"


def shown(text: str) -> str:
    """``text`` with its control and bidirectional characters written as escapes (lines and tabs kept)."""
    return _UNSAFE.sub(_escaped, text)


def one_line(message: str) -> str:
    """A message as one terminal line: :func:`shown`, with line breaks, carriage returns and tabs escaped too, so that
    a typed value can neither split the sentence nor overwrite it."""
    return _BREAKS.sub(_escaped, shown(message))


class SafeStream:
    """A text stream that writes through :func:`shown`; everything else is the wrapped stream's."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        self._stream.write(shown(text))
        return len(text)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


@contextlib.contextmanager
def safe_output() -> Iterator[None]:
    """Standard output and error through :class:`SafeStream` while a command runs."""
    out, err = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = SafeStream(out), SafeStream(err)
    try:
        yield
    finally:
        sys.stdout, sys.stderr = out, err
