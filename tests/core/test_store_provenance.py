"""Provenance recorded with every run: versions, the git commit and the identity of the weights."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

import duckdb
import pytest

import kvlab
from kvlab.errors import KvlabError
from kvlab.provenance import collect_provenance, git_commit, package_versions, weights_hash


def test_package_versions_name_python_and_missing_packages() -> None:
    versions = package_versions(("duckdb", "no-such-distribution-kvlab"))
    assert versions["duckdb"] == duckdb.__version__
    assert versions["no-such-distribution-kvlab"] is None
    assert versions["python"].count(".") == 2


def test_collected_provenance_names_this_kvlab() -> None:
    provenance = collect_provenance()
    assert provenance.kvlab_version == kvlab.__version__
    assert {"python", "torch", "transformers", "duckdb"} <= set(provenance.packages)


needs_git = pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")


def git(cwd: Path, *args: str) -> None:
    subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@example.com", *args], cwd=cwd, check=True, capture_output=True
    )


@pytest.fixture
def checkout(tmp_path: Path) -> Path:
    """A source checkout (``pyproject.toml`` and ``bench/``) with a package ``pkg`` at its top level and one commit."""
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pyproject.toml").write_text("")
    (tmp_path / "bench").mkdir()
    (tmp_path / "venv" / "lib" / "pkg").mkdir(parents=True)
    git(tmp_path, "init", "-q")
    git(tmp_path, "add", "pkg/__init__.py")
    git(tmp_path, "commit", "-q", "-m", "first")
    return tmp_path


@needs_git
def test_git_commit_of_a_checkout_and_of_an_edited_one(checkout: Path) -> None:
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=checkout, capture_output=True, text=True).stdout.strip()
    assert git_commit(checkout / "pkg") == head
    (checkout / "pkg" / "__init__.py").write_text("x = 1\n")
    assert git_commit(checkout / "pkg") == head + "-dirty"


@needs_git
def test_git_commit_is_none_outside_a_checkout_or_inside_another_one(checkout: Path, tmp_path_factory) -> None:
    nested = checkout / "venv" / "lib"
    assert git_commit(nested / "pkg") is None
    (nested / "pyproject.toml").write_text("")
    (nested / "bench").mkdir()
    assert git_commit(nested / "pkg") is None  # a checkout's layout, but the commit would be the outer repository's
    outside = tmp_path_factory.mktemp("plain") / "pkg"
    outside.mkdir()
    assert git_commit(outside) is None


def write(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def test_weights_hash_depends_on_names_and_bytes_not_location(tmp_path: Path) -> None:
    shards = {"model-00001.safetensors": b"first shard", "model-00002.safetensors": b"second shard"}
    for name, data in shards.items():
        write(tmp_path / "a" / name, data)
        write(tmp_path / "b" / name, data)
    write(tmp_path / "a" / "config.json", b"{}")

    listing = "\n".join(f"{name} {hashlib.sha256(data).hexdigest()}" for name, data in sorted(shards.items()))
    expected = hashlib.sha256(listing.encode()).hexdigest()
    assert weights_hash(tmp_path / "a") == weights_hash(str(tmp_path / "b")) == expected
    assert weights_hash(sorted((tmp_path / "a").glob("*.safetensors"), reverse=True)) == expected

    write(tmp_path / "b" / "model-00002.safetensors", b"other shard!")
    assert weights_hash(tmp_path / "b") != expected


def test_weights_hash_reads_a_file_again_only_when_size_or_time_change(tmp_path: Path) -> None:
    shard = write(tmp_path / "model.safetensors", b"A" * 64)
    first = weights_hash(shard)
    stat = shard.stat()
    write(shard, b"B" * 64)
    os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert weights_hash(shard) == first
    os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    assert weights_hash(shard) != first


def test_weights_hash_needs_files(tmp_path: Path) -> None:
    with pytest.raises(KvlabError, match=r"There are no \.safetensors files in"):
        weights_hash(tmp_path)
    with pytest.raises(KvlabError, match="does not exist"):
        weights_hash([tmp_path / "missing.safetensors"])
