"""The scripts of ``bench/`` imported as modules, so that tests can check their pure parts without running them."""

from __future__ import annotations

import contextlib
import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parents[1] / "bench"


@contextlib.contextmanager
def bench_script(name: str) -> Iterator[ModuleType]:
    """``bench/<name>.py`` as a module, registered in ``sys.modules`` while in use (dataclasses resolve their
    module's annotations through it)."""
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules[name]
