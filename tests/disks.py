"""A small disk to fill up, for the tests and the reliability benchmark: a tmpfs (mounting one needs root)."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def small_disk(directory: Path, megabytes: int) -> Iterator[Path]:
    """A tmpfs of ``megabytes`` MB mounted below ``directory``; OSError where this process may not mount one."""
    mount = directory / "disk"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={megabytes}m", "tmpfs", str(mount)], capture_output=True, text=True
    )
    if done.returncode != 0:
        raise OSError(f"cannot mount a tmpfs here: {done.stderr.strip() or done.returncode}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def fill(directory: Path) -> Path:
    """Fill a file system to its last byte; returns the file that fills it."""
    filler = directory / "filler"
    descriptor = os.open(filler, os.O_WRONLY | os.O_CREAT)
    try:
        for size in (1 << 16, 1):
            with contextlib.suppress(OSError):
                while True:
                    os.write(descriptor, b"\0" * size)
    finally:
        os.close(descriptor)
    return filler
