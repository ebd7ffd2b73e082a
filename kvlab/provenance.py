"""Where a result came from: code version, package versions and the identity of the weights.

A stored run is only comparable with another if both say which code, which libraries and which exact weights
produced them. Everything here is best effort and never fails a run: a missing package or a checkout that is not a
git repository gives ``None``, not an error. The one exception is :func:`weights_hash`, whose input the caller chose.
"""

from __future__ import annotations

import functools
import importlib.metadata
import platform
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import kvlab
from kvlab.errors import KvlabError
from kvlab.hashing import file_sha256, text_sha256
from kvlab.paths import PACKAGE_DIR, checkout

#: Distributions whose versions can change a result or its timing; recorded with every run.
TRACKED_PACKAGES: tuple[str, ...] = ("torch", "transformers", "tokenizers", "safetensors", "numpy", "duckdb")

_GIT_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class Provenance:
    """The code and library versions behind a run.

    ``git_commit`` ends in ``-dirty`` when tracked files differ from that commit, so an edited checkout is not
    mistaken for the commit it started from.
    """

    kvlab_version: str
    git_commit: str | None
    packages: dict[str, str | None]


@functools.lru_cache(maxsize=1)
def collect_provenance() -> Provenance:
    """The provenance of this process, computed once: none of it changes while the process runs."""
    return Provenance(kvlab.__version__, git_commit(), package_versions())


def package_versions(names: Iterable[str] = TRACKED_PACKAGES) -> dict[str, str | None]:
    """Installed versions of ``names`` (``None`` where not installed) plus the Python version.

    Read from package metadata, so nothing heavy (torch) is imported to learn its version.
    """
    versions: dict[str, str | None] = {"python": platform.python_version()}
    for name in names:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def git_commit(package_dir: Path = PACKAGE_DIR) -> str | None:
    """The commit of the source checkout (:func:`kvlab.paths.checkout`) that holds ``package_dir``, or ``None``.

    ``None`` when kvlab is installed rather than run from a checkout, git is missing, the checkout is not the top
    level of a git repository (a package installed inside some other repository, a virtual environment within a
    project: that repository's commit would say nothing about this code), or it has no commit yet.
    """
    root = checkout(package_dir)
    if root is None:
        return None
    lines = _git(root, "rev-parse", "--show-toplevel", "HEAD")
    if lines is None or len(lines) != 2 or Path(lines[0]).resolve() != root:
        return None
    changes = _git(root, "status", "--porcelain", "--untracked-files=no")
    return lines[1] + ("-dirty" if changes else "")


def _git(cwd: Path, *args: str) -> list[str] | None:
    """Output lines of a git command, or ``None`` if it could not run or failed."""
    try:
        done = subprocess.run(
            ["git", "-C", str(cwd), *args], capture_output=True, text=True, timeout=_GIT_TIMEOUT_S, check=True
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.splitlines()


def weights_hash(source: str | Path | Iterable[str | Path]) -> str:
    """A sha256 identity of model weights: a model directory (its ``*.safetensors`` files) or a list of files.

    Each file is named by its base name and hashed by its bytes, so the same weights give the same identity
    wherever they are stored. A file is read once per process while its size and modification time stay the same.
    Models loaded from the Hugging Face hub without local files can use ``config._commit_hash`` instead.
    """
    files = _weight_files(source)
    return text_sha256("\n".join(f"{path.name} {file_sha256(path)}" for path in sorted(files, key=lambda p: p.name)))


def _weight_files(source: str | Path | Iterable[str | Path]) -> list[Path]:
    """The files to hash: the safetensors files of a directory, or the given files, all of which must exist."""
    if isinstance(source, (str, Path)) and Path(source).is_dir():
        files = sorted(Path(source).glob("*.safetensors"))
        if not files:
            raise KvlabError(f"There are no .safetensors files in {source} to hash.")
    else:
        files = [Path(source)] if isinstance(source, (str, Path)) else [Path(item) for item in source]
    if not files:
        raise KvlabError("No weights files were given to hash.")
    missing = [str(path) for path in files if not path.is_file()]
    if missing:
        raise KvlabError(f"The weights file {missing[0]} does not exist.")
    return files


def weights_identity(name: str, config: object) -> str | None:
    """How a stored run names the weights it measured: the hash of a local model's safetensors files, else the hub
    commit transformers resolved (``config._commit_hash``), else nothing."""
    try:
        local = Path(name).expanduser().is_dir()
    except (OSError, ValueError, RuntimeError):  # a name too long for a path, or with a NUL byte
        local = False
    if local:
        try:
            return weights_hash(Path(name).expanduser())
        except KvlabError:
            return None
    return getattr(config, "_commit_hash", None)
