"""The one way kvlab reads a file a user names: bounded before a byte is read.

A prompt file, a task file, a text to score, a device map or a profile may be anything a path can name: a device
(``/dev/zero`` never ends), a FIFO (reading blocks until a writer comes), a sparse file of gigabytes. Each is
refused from ``stat`` alone, before it is opened: only regular files are read, and only up to
:func:`most_file_bytes` (``KVLAB_MAX_FILE_MIB``, 512 MiB by default), with one sentence naming the limit and how to
raise it. A file that grows while it is read is cut at the limit and refused the same way.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping
from pathlib import Path

from kvlab.errors import KvlabError
from kvlab.settings import positive_setting
from kvlab.units import MIB, format_bytes

#: Raises (or lowers) the largest file kvlab reads, in MiB.
MAX_FILE_ENV = "KVLAB_MAX_FILE_MIB"
DEFAULT_MAX_FILE_MIB = 512


def most_file_bytes(env: Mapping[str, str] = os.environ) -> int:
    """The largest file kvlab reads: ``KVLAB_MAX_FILE_MIB`` MiB, or 512 MiB."""
    return (positive_setting(MAX_FILE_ENV, "MiB", env) or DEFAULT_MAX_FILE_MIB) * MIB


def check_file(path: str | Path, what: str, limit: int | None = None) -> tuple[int, int]:
    """Refuse, from ``stat`` alone, what :func:`read_bytes` would refuse (so that a command can say so before any
    expensive work); the limit in bytes that applies, and the file's size."""
    path = Path(path)
    most = most_file_bytes() if limit is None else limit
    try:
        status = path.stat()
    except OSError as error:
        raise KvlabError(f"Cannot read the {what} {path}: {error.strerror or error}.") from None
    if not stat.S_ISREG(status.st_mode):
        kind = "a directory" if stat.S_ISDIR(status.st_mode) else "a device, pipe or socket, not a regular file"
        raise KvlabError(f"Cannot read the {what} {path}: it is {kind}.")
    if status.st_size > most:
        raise _too_large(path, what, most)
    return most, status.st_size


def read_bytes(path: str | Path, what: str, limit: int | None = None) -> bytes:
    """The bytes of the regular file at ``path`` (called ``what`` in sentences), at most ``limit`` (default
    :func:`most_file_bytes`): a device, a FIFO, a directory, a missing file or one larger than the limit is one
    sentence, decided by ``stat`` before the file is opened. Memory is the file's size, not the limit."""
    path = Path(path)
    most, size = check_file(path, what, limit)
    try:
        with path.open("rb") as handle:
            data = handle.read(size + 1)
            if len(data) > size:  # it grew since stat: read on, but never past the limit
                data += handle.read(most + 1 - len(data))
    except OSError as error:
        raise KvlabError(f"Cannot read the {what} {path}: {error.strerror or error}.") from None
    if len(data) > most:
        raise _too_large(path, what, most)
    return data


def read_text(path: str | Path, what: str, limit: int | None = None) -> str:
    """The UTF-8 text of the file at ``path``, read by :func:`read_bytes`; text that is not UTF-8 is one
    sentence."""
    data = read_bytes(path, what, limit)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise KvlabError(f"The {what} {path} is not UTF-8 text.") from None


def _too_large(path: Path, what: str, most: int) -> KvlabError:
    return KvlabError(
        f"The {what} {path} is larger than the {format_bytes(most)} kvlab reads from a file; set {MAX_FILE_ENV} "
        "(in MiB) to raise the limit."
    )
