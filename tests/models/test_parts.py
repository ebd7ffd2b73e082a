"""GGUF files carried in parts by several packages: listed once every part is installed, reassembled on first load
into the model cache and checked against the digest a package publishes, nothing left behind when that fails."""

from __future__ import annotations

import hashlib
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvlab.errors import NotAModel
from kvlab.models import catalog, parts
from kvlab.models import installed as installed_module


def fake_distribution(root: Path, name: str, files: dict[str, bytes]) -> SimpleNamespace:
    """An installed distribution as importlib.metadata shows it: its files, found under ``root``."""
    for relative, content in files.items():
        (root / relative).parent.mkdir(parents=True, exist_ok=True)
        (root / relative).write_bytes(content)
    return SimpleNamespace(
        name=name,
        version="1.0.0",
        files=list(files),
        read_text=lambda name: None,  # no RECORD: the files as importlib.metadata lists them
        locate_file=lambda item: root / str(item),
        metadata=SimpleNamespace(json={}),
    )


@pytest.fixture
def installed(tmp_path, monkeypatch):
    """Three packages carrying ``tiny.gguf`` in two parts and its digest with a model card; the model cache in the
    test's folder. Returns the whole file's bytes and a function that installs the given distributions."""
    whole = b"GGUF" + bytes(range(256)) * 40
    monkeypatch.setenv("KVLAB_MODEL_CACHE", str(tmp_path / "cache"))
    digest = hashlib.sha256(whole).hexdigest()
    packages = [
        fake_distribution(tmp_path, "tiny-part1", {"tiny_part1/data/tiny.gguf.part00": whole[:5000]}),
        fake_distribution(tmp_path, "tiny-part2", {"tiny_part2/data/tiny.gguf.part01": whole[5000:]}),
        fake_distribution(
            tmp_path,
            "tiny",
            {
                "tiny/data/SHA256SUMS": f"{digest}  tiny.gguf\n".encode(),
                "tiny/data/README.upstream.md": b"---\nlicense: gemma\n---\n# card\n",
            },
        ),
    ]

    def install(distributions):
        monkeypatch.setattr(installed_module.importlib.metadata, "distributions", lambda: list(distributions))
        parts._parted_files.cache_clear()
        catalog._package_models.cache_clear()

    yield whole, packages, install
    parts._parted_files.cache_clear()
    catalog._package_models.cache_clear()


def test_a_file_in_parts_is_listed_once_and_reassembled_on_first_load(installed):
    whole, packages, install = installed
    install(packages)
    (entry,) = [entry for entry in catalog.package_models() if entry.label == "tiny.gguf"]
    assert entry.licence == "gemma" and "tiny-part1 1.0.0, tiny-part2 1.0.0" in entry.origin
    assert not Path(entry.name).exists()  # listing copies nothing
    assert catalog.installed_name("tiny.gguf") == entry.name
    assert parts.assembled(entry.name) == entry.name
    assert Path(entry.name).read_bytes() == whole
    assert [p.name for p in Path(entry.name).parent.iterdir()] == ["tiny.gguf"]  # no temporary file left


def test_a_missing_part_lists_nothing(installed):
    _, packages, install = installed
    install([packages[1], packages[2]])
    assert not any(entry.label == "tiny.gguf" for entry in catalog.package_models())


def test_parts_that_do_not_make_the_published_file_are_one_sentence_and_leave_nothing(installed, tmp_path):
    whole, packages, install = installed
    damaged = fake_distribution(tmp_path / "other", "tiny-part2", {"tiny_part2/data/tiny.gguf.part01": b"x" * 10})
    install([packages[0], damaged, packages[2]])
    (parted,) = parts.parted_files()
    with pytest.raises(NotAModel, match="do not make the file their package publishes"):
        parts.reassemble(parted)
    assert not parted.target().exists() and list(parted.target().parent.iterdir()) == []


def test_other_names_are_left_as_they_are(installed, tmp_path):
    _, packages, install = installed
    install(packages)
    assert parts.assembled("owner/repo/model.gguf") == "owner/repo/model.gguf"
    assert parts.assembled(str(tmp_path / "elsewhere.gguf")) == str(tmp_path / "elsewhere.gguf")
    assert not (tmp_path / "elsewhere.gguf").exists()
