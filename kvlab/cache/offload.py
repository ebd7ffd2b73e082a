"""Where demoted pages are kept off the GPU: pinned CPU memory, and a memory-mapped file (an NVMe drive, where
``KVLAB_OFFLOAD_DIR`` points to one).

A page is ``page_tokens`` demoted tokens of every sequence and KV head of one layer, stored as rows
``(batch, kv_heads)`` of keys and values ``(page_tokens, head_dim)`` and their original positions. Both stores hold a
fixed number of page slots, written and read by slot; which page sits in which slot is the caller's
(:mod:`kvlab.cache.demotion`). Reads gather rows, one ``(slot, sequence, KV head)`` each, because a recall fetches
different pages for different KV heads. Elements are stored bit for bit (16-bit floats as 16-bit integers in the
file), so a page read back equals the page written.
"""

from __future__ import annotations

import os
import stat
import tempfile
import weakref
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from kvlab.errors import KvlabError
from kvlab.units import format_bytes

#: Where the file tier's files are created, when set (else the system's temporary directory).
OFFLOAD_DIR_VARIABLE = "KVLAB_OFFLOAD_DIR"
#: The start of an offload file's name, followed by the pid of the process that made it.
FILE_PREFIX = "kvlab-demoted-"


@dataclass(frozen=True)
class PageShape:
    """The shape of one layer's pages: ``batch`` x ``kv_heads`` rows of ``tokens`` x ``head_dim`` at ``dtype``."""

    batch: int
    kv_heads: int
    tokens: int
    head_dim: int
    dtype: torch.dtype

    @property
    def rows(self) -> int:
        """Rows per page (one per sequence and KV head)."""
        return self.batch * self.kv_heads

    def page_bytes(self) -> int:
        """Bytes one page takes in a store: its keys, values and int32 positions."""
        element = torch.empty((), dtype=self.dtype).element_size()
        return self.rows * self.tokens * (2 * self.head_dim * element + 4)


def _integer_view(dtype: torch.dtype) -> torch.dtype:
    """The integer type of the same width, to store floats bit for bit where numpy has no such float (bfloat16)."""
    width = torch.empty((), dtype=dtype).element_size()
    return {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[width]


class HostStore:
    """Page slots in CPU memory, pinned where a GPU can copy from it directly (allocated as slots are first used,
    doubling up to ``capacity``, so a generous budget costs nothing until it is used)."""

    def __init__(self, shape: PageShape, capacity: int, pinned: bool) -> None:
        self.shape, self.capacity, self.pinned = shape, capacity, pinned
        self.keys = self._empty(0, shape.head_dim, shape.dtype)
        self.values = self._empty(0, shape.head_dim, shape.dtype)
        self.positions = self._empty(0, None, torch.int32)

    def _empty(self, slots: int, head_dim: int | None, dtype: torch.dtype) -> torch.Tensor:
        shape = self.shape
        size = (slots * shape.rows, shape.tokens) + ((head_dim,) if head_dim is not None else ())
        return torch.empty(size, dtype=dtype, pin_memory=self.pinned)

    @property
    def allocated(self) -> int:
        """Slots allocated so far."""
        return self.positions.shape[0] // self.shape.rows

    def _reserve(self, slots: int) -> None:
        if slots <= self.allocated:
            return
        size = min(self.capacity, max(slots, 2 * self.allocated))
        for name, head_dim in (("keys", self.shape.head_dim), ("values", self.shape.head_dim), ("positions", None)):
            old = getattr(self, name)
            new = self._empty(size, head_dim, old.dtype)
            new[: old.shape[0]] = old
            setattr(self, name, new)

    def write(self, slots: np.ndarray, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor) -> None:
        """Store pages ``(n, batch, kv_heads, tokens, head_dim)`` (positions without the last dimension) in
        ``slots``."""
        if len(slots) == 0:
            return
        self._reserve(int(slots.max()) + 1)
        rows = _rows(slots, self.shape.rows)
        self.keys.index_copy_(0, rows, keys.reshape(-1, *self.keys.shape[1:]).cpu())
        self.values.index_copy_(0, rows, values.reshape(-1, *self.values.shape[1:]).cpu())
        self.positions.index_copy_(0, rows, positions.reshape(-1, self.shape.tokens).cpu())

    def read_rows(self, rows: torch.Tensor, out: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> None:
        """Gather ``rows`` (``slot x rows_per_page + sequence x kv_heads + head``) into ``out`` (keys, values,
        positions, as many rows)."""
        torch.index_select(self.keys, 0, rows, out=out[0])
        torch.index_select(self.values, 0, rows, out=out[1])
        torch.index_select(self.positions, 0, rows, out=out[2])

    def read_pages(self, slots: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Whole pages, shaped as :meth:`write` takes them."""
        rows = _rows(slots, self.shape.rows)
        shape = self.shape
        page = (len(slots), shape.batch, shape.kv_heads, shape.tokens)
        return (
            self.keys[rows].view(*page, shape.head_dim),
            self.values[rows].view(*page, shape.head_dim),
            self.positions[rows].view(*page),
        )

    def nbytes(self) -> int:
        """Bytes allocated, read from the tensors."""
        return sum(t.numel() * t.element_size() for t in (self.keys, self.values, self.positions))


class OffloadFile:
    """One memory-mapped file for a whole run, ``size`` bytes reserved when the run starts; once the pages' shape is
    known (:meth:`map`), a region of page slots per layer.

    The file lies in a directory only its user can enter (:func:`private_directory`), is readable by its user alone
    (0600), and is named after the process, so that files a killed run left behind are removed by the next run
    (:func:`remove_stale`). Its blocks are reserved before anything is mapped (``posix_fallocate``): a disk without
    the room is one sentence before the run does any work, rather than a SIGBUS when a page is written into a hole
    the disk cannot fill. It is removed when the run closes it, or when it is collected."""

    def __init__(self, size: int, directory: str | None = None) -> None:
        folder = private_directory(Path(directory or os.environ.get(OFFLOAD_DIR_VARIABLE) or tempfile.gettempdir()))
        remove_stale(folder)
        self.size = size
        self.regions: list[FileRegion] = []
        try:
            handle, name = tempfile.mkstemp(prefix=f"{FILE_PREFIX}{os.getpid()}-", suffix=".kv", dir=folder)
        except OSError as error:
            raise KvlabError(f"Could not create the offload file in {folder}: {error.strerror}.") from None
        self.path = Path(name)
        self._finalizer = weakref.finalize(self, _remove, self.path)
        try:
            os.posix_fallocate(handle, 0, max(size, 1))
        except OSError as error:
            self.close()
            raise KvlabError(
                f"Could not reserve {format_bytes(size)} for the offload file in {folder} ({error.strerror}); "
                f"free some space or lower disk_tier_mib."
            ) from None
        finally:
            os.close(handle)

    def map(self, shapes: list[PageShape], capacity: int) -> list[FileRegion]:
        """The regions of ``capacity`` page slots of each shape, one after another in the reserved bytes."""
        offsets, total = [], 0
        for shape in shapes:
            offsets.append(total)
            total += capacity * shape.page_bytes()
        if total > self.size:
            raise ValueError(f"{total} bytes of pages do not fit the {self.size} reserved")
        self.regions = [FileRegion(self.path, shape, capacity, offset) for shape, offset in zip(shapes, offsets)]
        return self.regions

    def close(self) -> None:
        """Remove the file (the regions' maps are dropped with it)."""
        self.regions = []
        self._finalizer()


def private_directory(folder: Path) -> Path:
    """``folder``'s subdirectory of this user's offload files, made 0700 and checked to be a real directory that this
    user owns (not a link another user planted), or one sentence."""
    private = folder / f"kvlab-offload-{os.getuid()}"
    try:
        private.mkdir(mode=0o700, exist_ok=True)
        status = private.lstat()
    except OSError as error:
        raise KvlabError(f"Could not create the offload directory {private}: {error.strerror}.") from None
    if not stat.S_ISDIR(status.st_mode) or status.st_uid != os.getuid():
        raise KvlabError(
            f"The offload directory {private} is not a directory of this user; remove it or set "
            f"{OFFLOAD_DIR_VARIABLE} elsewhere."
        )
    if status.st_mode & 0o077:
        private.chmod(0o700)
    return private


def remove_stale(folder: Path) -> list[Path]:
    """Remove the offload files in ``folder`` whose process is gone (a run killed with -9 cannot remove its own);
    the removed paths."""
    removed = []
    for path in folder.glob(f"{FILE_PREFIX}*-*.kv"):
        pid_text = path.name.removeprefix(FILE_PREFIX).split("-", 1)[0]
        if pid_text.isdigit() and not _alive(int(pid_text)):
            path.unlink(missing_ok=True)
            removed.append(path)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove(path: Path) -> None:
    path.unlink(missing_ok=True)


class FileRegion:
    """One layer's page slots in the run's file: keys, values and positions as three arrays side by side."""

    def __init__(self, path: Path, shape: PageShape, capacity: int, offset: int) -> None:
        self.shape = shape
        rows = capacity * shape.rows
        code = np.dtype(str(_integer_view(shape.dtype)).removeprefix("torch."))
        keys_bytes = rows * shape.tokens * shape.head_dim * code.itemsize
        self.keys = np.memmap(path, code, "r+", offset, (rows, shape.tokens, shape.head_dim))
        self.values = np.memmap(path, code, "r+", offset + keys_bytes, (rows, shape.tokens, shape.head_dim))
        self.positions = np.memmap(path, np.int32, "r+", offset + 2 * keys_bytes, (rows, shape.tokens))

    def write(self, slots: np.ndarray, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor) -> None:
        """Store pages in ``slots`` (shaped as :meth:`HostStore.write` takes them)."""
        if len(slots) == 0:
            return
        rows = _rows(slots, self.shape.rows).numpy()
        integer = _integer_view(self.shape.dtype)
        self.keys[rows] = keys.cpu().view(integer).reshape(-1, *self.keys.shape[1:]).numpy()
        self.values[rows] = values.cpu().view(integer).reshape(-1, *self.values.shape[1:]).numpy()
        self.positions[rows] = positions.cpu().reshape(-1, self.shape.tokens).numpy()

    def read_rows(self, rows: torch.Tensor, out: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> None:
        """Gather rows into ``out`` (see :meth:`HostStore.read_rows`)."""
        index = rows.numpy()
        dtype = self.shape.dtype
        out[0].copy_(torch.from_numpy(self.keys[index]).view(dtype))
        out[1].copy_(torch.from_numpy(self.values[index]).view(dtype))
        out[2].copy_(torch.from_numpy(self.positions[index]))


def _rows(slots: np.ndarray, rows_per_page: int) -> torch.Tensor:
    """The rows of whole pages in ``slots``, page after page."""
    index = torch.from_numpy(np.asarray(slots, dtype=np.int64))
    return (index.unsqueeze(1) * rows_per_page + torch.arange(rows_per_page)).reshape(-1)
