"""Installed packages' files read from their records as text: the names a package lists, quoted ones included, and
only the wanted ones made paths."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from kvlab.models import installed

RECORD = 'pkg/__init__.py,sha256=abc,10\n"pkg/data/a,b.gguf",sha256=def,20\npkg/data/model.gguf,,\n\n'


def distribution(record: str | None, files: list[str] | None = None) -> SimpleNamespace:
    """A distribution with a record (``None``: none) and, where it has none, its files."""
    return SimpleNamespace(
        name="pkg",
        version="1.0",
        read_text=lambda name: record if name == "RECORD" else None,
        files=files,
        locate_file=lambda item: Path("/site") / str(item),
    )


def test_a_record_is_read_as_csv():
    assert installed.listed_files(distribution(RECORD)) == [
        "pkg/__init__.py",
        "pkg/data/a,b.gguf",
        "pkg/data/model.gguf",
    ]


def test_a_package_without_a_record_lists_its_files():
    assert installed.listed_files(distribution(None, ["pkg/x.gguf"])) == ["pkg/x.gguf"]
    assert installed.listed_files(distribution(None, None)) == []


def test_only_wanted_files_become_paths(monkeypatch):
    monkeypatch.setattr(installed.importlib.metadata, "distributions", lambda: [distribution(RECORD)])
    found = installed.package_files(lambda item: item.endswith(".gguf"))
    assert [path for _, path in found] == [Path("/site/pkg/data/a,b.gguf"), Path("/site/pkg/data/model.gguf")]
