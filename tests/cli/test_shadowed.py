"""``python -m kvlab`` from the folder that holds a clone named ``kvlab``: one sentence, not a traceback."""

from __future__ import annotations

import runpy
import sys
import types
from pathlib import Path

import pytest

import kvlab


def test_a_clone_folder_hiding_the_package_is_refused_in_one_sentence(tmp_path, monkeypatch):
    """The clone's folder, imported as a namespace package (no ``__file__``), stands in for kvlab as it does when
    Python finds it before an editable install's package."""
    clone = tmp_path / "kvlab"
    clone.mkdir()
    shadow = types.ModuleType("kvlab")
    shadow.__path__ = [str(clone)]
    monkeypatch.setitem(sys.modules, "kvlab", shadow)
    with pytest.raises(SystemExit) as exited:
        runpy.run_path(str(Path(kvlab.__file__).with_name("__main__.py")), run_name="__main__")
    message = str(exited.value.code)
    assert message.startswith(f"error: the folder {clone} hides the kvlab package")
    assert "\n" not in message and message.endswith("from any other folder.")
