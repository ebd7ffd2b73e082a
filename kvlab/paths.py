"""Where kvlab's files are: the files it ships inside its package, the source checkout it may run from, the
benchmark results that checkout keeps, and a user's files when no path is given.

Everything kvlab ships (the default model, the haystacks, RULER's word lists, attention profiles, the example and
evidence runs) lies in ``kvlab/data/`` and is installed with the package, so a wheel works like a checkout;
:func:`shipped` is the one way to find it. What only a checkout has (the benchmarks' results, the dashboard's
``app.py``, the git history) is found through :func:`checkout`, which is None for an installed package. A user's
files follow the XDG base directories, with an override each.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

#: The folder of the ``kvlab`` package, wherever it is installed or checked out.
PACKAGE_DIR = Path(__file__).resolve().parent
#: The folder of the files kvlab ships, inside the installed package.
SHIPPED_DIR = PACKAGE_DIR / "data"
#: Names the folder of the benchmark results the claims read, for an installed kvlab or another copy of them.
BENCH_RESULTS_ENV = "KVLAB_BENCH_RESULTS"


def shipped(*parts: str) -> Path:
    """A file or folder kvlab ships: ``shipped("models", "kvlab-tiny-llama")``, ``shipped("haystacks")``."""
    return SHIPPED_DIR.joinpath(*parts)


def checkout(package_dir: Path = PACKAGE_DIR) -> Path | None:
    """The source checkout kvlab runs from: the folder above the package when it holds ``pyproject.toml`` and
    ``bench/``; None when kvlab is installed (above an installed package lies ``site-packages``)."""
    root = package_dir.resolve().parent
    return root if (root / "pyproject.toml").is_file() and (root / "bench").is_dir() else None


def bench_results(env: Mapping[str, str] = os.environ) -> Path | None:
    """The folder of the benchmarks' JSON results: ``$KVLAB_BENCH_RESULTS`` when set, else ``bench/results`` of
    the checkout kvlab runs from; None for an installed kvlab, whose wheel holds no benchmark results."""
    explicit = env.get(BENCH_RESULTS_ENV)
    if explicit:
        return Path(explicit).expanduser()
    root = checkout()
    return root / "bench" / "results" if root is not None else None


def installed_read_only(path: Path) -> bool:
    """Whether ``path`` is a file kvlab ships and kvlab runs installed, not from a checkout: such a file is part of
    the installed package, which kvlab reads but never writes (a checkout's shipped files are its to refresh)."""
    return checkout() is None and path.expanduser().resolve().is_relative_to(SHIPPED_DIR)


def user_file(env: Mapping[str, str], override: str, xdg_variable: str, fallback: str, *parts: str) -> Path:
    """``$override`` when set; else ``parts`` under ``$xdg_variable`` when that is an absolute path (relative ones
    are ignored, as the XDG specification says); else ``parts`` under ``~/<fallback>``."""
    explicit = env.get(override)
    if explicit:
        return Path(explicit).expanduser()
    base_text = env.get(xdg_variable)
    base = Path(base_text) if base_text and Path(base_text).is_absolute() else Path.home() / fallback
    return base.joinpath(*parts)
