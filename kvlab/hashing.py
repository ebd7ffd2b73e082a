"""sha256, the one way kvlab names content: of bytes, of text, of a file, and of the source files behind a task.

Stored runs are found again by these digests (a run by its configuration's, a task by its sources', weights by
their files'), so each is computed here once and in one way: a change to how one is computed would orphan every
run stored before it.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Iterable
from pathlib import Path

from kvlab.units import MIB

#: How much of a file is read at a time: weights files are gigabytes, and never held in memory whole.
FILE_CHUNK_BYTES = 8 * MIB


def chunks_sha256(chunks: Iterable[bytes]) -> str:
    """sha256 (hex) of the concatenation of ``chunks``, fed one at a time (a model's tensors, a file's blocks)."""
    digest = hashlib.sha256()
    for chunk in chunks:
        digest.update(chunk)
    return digest.hexdigest()


def bytes_sha256(data: bytes) -> str:
    """sha256 (hex) of ``data``."""
    return hashlib.sha256(data).hexdigest()


def text_sha256(text: str) -> str:
    """sha256 (hex) of ``text`` in UTF-8: the identity of a canonical JSON, a listing or a prompt."""
    return bytes_sha256(text.encode())


_file_digests: dict[tuple[str, int, int], str] = {}
_file_digests_lock = threading.Lock()


def file_sha256(path: Path) -> str:
    """sha256 (hex) of one file's bytes, read in chunks and cached by (resolved path, size, modification time), so
    a weights file is read once per process while it stays the same."""
    stat = path.stat()
    key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns)
    with _file_digests_lock:
        cached = _file_digests.get(key)
    if cached is not None:
        return cached
    with path.open("rb") as handle:
        hexdigest = chunks_sha256(iter(lambda: handle.read(FILE_CHUNK_BYTES), b""))
    with _file_digests_lock:
        _file_digests[key] = hexdigest
    return hexdigest


def sources_sha256(header: str, paths: Iterable[Path]) -> str:
    """The identity of what a task's items are generated from: ``header`` (its kind, its generator, or the identity
    it extends) and then, per file in the given order, its base name and the sha256 of its bytes, one line each.
    Base names, so the same sources give the same identity wherever they are installed."""
    lines = [header.encode() + b"\n"]
    lines += [path.name.encode() + b"\n" + file_sha256(path).encode() + b"\n" for path in paths]
    return chunks_sha256(lines)
