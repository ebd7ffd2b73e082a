"""The sha256 helpers, and every identity computed with them staying what it was: stored runs are found by these
digests, so each is checked against the values the stored runs hold or, for fixed inputs, the digests the code gave
before the helpers were shared."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Iterable
from pathlib import Path

import duckdb
import pytest
import torch
from transformers import AutoTokenizer

import kvlab
from kvlab.experiments.sidechannel import trial_seed
from kvlab.hashing import bytes_sha256, chunks_sha256, file_sha256, sources_sha256, text_sha256
from kvlab.models.loading import parameters_hash, tokenizer_hash
from kvlab.paths import shipped
from kvlab.provenance import weights_hash
from kvlab.runs.records import NEEDLE_SOURCES, items_hash, needle_sources_hash
from kvlab.runs.sweep import ruler_sources_hash
from kvlab.store import RunConfig, open_store, run_key
from kvlab.tasks.items import item_hash
from kvlab.tasks.needle import HAYSTACK_DIR
from kvlab.tasks.ruler import RULER_SOURCES
from kvlab.tasks.texts import text_pass

SHIPPED_MODEL = shipped("models", "kvlab-tiny-llama")
SHIPPED_STORES = [shipped("runs", f"{name}.duckdb") for name in ("claims", "examples", "ruler")]


def stored_runs(path: Path, columns: Iterable[str]) -> list[dict[str, object]]:
    """The runs of a shipped store as plain values (NULL as None), read without kvlab's store."""
    with duckdb.connect(str(path), read_only=True) as connection:
        cursor = connection.execute(f"SELECT {', '.join(columns)} FROM runs")
        names = [column[0] for column in cursor.description]
        return [dict(zip(names, row)) for row in cursor.fetchall()]


def test_the_helpers_are_sha256() -> None:
    assert text_sha256("abc") == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
    assert bytes_sha256(b"") == "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
    assert chunks_sha256([b"a", b"", b"bc"]) == text_sha256("abc")


def test_a_file_is_hashed_in_chunks_and_read_again_only_when_it_changes(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr("kvlab.hashing.FILE_CHUNK_BYTES", 3)
    path = tmp_path / "weights.bin"
    path.write_bytes(b"0123456789")
    assert file_sha256(path) == hashlib.sha256(b"0123456789").hexdigest()
    path.write_bytes(b"01234567890")  # another size: read again
    assert file_sha256(path) == hashlib.sha256(b"01234567890").hexdigest()


def test_sources_are_named_by_base_name_and_bytes(tmp_path) -> None:
    for folder in ("here", "there"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "a.txt").write_bytes(b"alpha")
        (tmp_path / folder / "b.py").write_bytes(b"beta")
    here, there = ([tmp_path / folder / name for name in ("a.txt", "b.py")] for folder in ("here", "there"))
    digest = sources_sha256("needle\nsweep", here)
    assert digest == "29fae3194428745ae2cf57b13be8bb356566e4b83698b0a058bd98b79dac45b7"
    assert sources_sha256("needle\nsweep", there) == digest


def sources_before(header: bytes, paths: Iterable[Path]) -> str:
    """How needle and RULER task identities were computed before :func:`kvlab.hashing.sources_sha256`."""
    digest = hashlib.sha256(header)
    for path in paths:
        digest.update(path.name.encode() + b"\n" + hashlib.sha256(path.read_bytes()).hexdigest().encode() + b"\n")
    return digest.hexdigest()


@pytest.mark.parametrize("kind, generator", [("needle", "sweep"), ("needle", "live"), ("ruler", "sweep")])
def test_needle_task_identities_are_unchanged(kind: str, generator: str) -> None:
    sources = [*sorted(HAYSTACK_DIR.glob("*.txt")), *NEEDLE_SOURCES]
    assert needle_sources_hash(kind, generator) == sources_before(f"{kind}\n{generator}\n".encode(), sources)


@pytest.mark.parametrize("task", ["ruler", "ruler:niah_single_1,vt"])
def test_ruler_task_identities_are_unchanged(task: str) -> None:
    header = needle_sources_hash(task, "sweep").encode() + b"\n"
    assert ruler_sources_hash(task) == sources_before(header, RULER_SOURCES)


@pytest.mark.parametrize("path", SHIPPED_STORES, ids=lambda path: path.stem)
def test_every_shipped_run_is_found_by_its_stored_key(path: Path, monkeypatch) -> None:
    fields = [field.name for field in dataclasses.fields(RunConfig)]
    runs = stored_runs(path, ["*"])
    assert runs
    for run in runs:
        monkeypatch.setattr(kvlab, "__version__", run["kvlab_version"])  # the version is part of the identity
        values = {name: run.get(name) for name in fields}  # a field added since the store was written is None
        values["policy_params"] = json.loads(str(values["policy_params"]))
        assert run_key(RunConfig(**values)) == run["run_key"]  # type: ignore[arg-type]


def test_the_shipped_model_and_tokenizer_have_their_stored_identities() -> None:
    runs = stored_runs(SHIPPED_STORES[1], ["*"])  # the examples: the shipped model's runs and the published models'
    stored = {(run["weights_hash"], run["tokenizer_hash"]) for run in runs if SHIPPED_MODEL.name in str(run["model"])}
    assert len(stored) == 1 and len({run["weights_hash"] for run in runs}) == 3
    tokenizer = AutoTokenizer.from_pretrained(str(SHIPPED_MODEL))
    assert stored == {(weights_hash(SHIPPED_MODEL), tokenizer_hash(tokenizer))}


def test_the_shipped_quality_passes_have_their_stored_identities() -> None:
    tokenizer = AutoTokenizer.from_pretrained(str(SHIPPED_MODEL))
    identity = tokenizer_hash(tokenizer)
    text = shipped("haystacks", "python-docs-1.txt").read_text(encoding="utf-8")
    runs = [
        run
        for run in stored_runs(
            SHIPPED_STORES[0], ["task", "task_hash", "context_length", "max_new_tokens", "tokenizer_hash"]
        )
        if run["task"] == "quality:python-docs-1" and run["tokenizer_hash"] == identity
    ]
    assert runs
    for run in runs:
        scored = int(run["max_new_tokens"])  # type: ignore[call-overload]
        prefix = int(run["context_length"]) - scored  # type: ignore[call-overload]
        assert text_pass(tokenizer, text, "python-docs-1", prefix, scored).content_hash() == run["task_hash"]


def test_fixed_inputs_give_the_digests_they_always_gave(tmp_path) -> None:
    assert item_hash((1, 2, 3), (4, 5), "Paris") == "70bfe9e129642f437be9569132c9f431489cd8203e8efd753d2046e1403a0b90"
    assert item_hash((1,), (), None) == "2e9cff7a21de09b92de8ce4bd6a6dbb09dfa70db29d69d42bc4a3d2252fd6847"
    assert items_hash(["a", "b"]) == "7e18f737311b2dc3b2f269dd78396b0351f14fb66efa879f768cb23181883c78"
    assert (trial_seed(0, 3), trial_seed(12345, 0)) == (4105666011872646519, 7880397587402395755)
    linear = torch.nn.Linear(2, 3)
    with torch.no_grad():
        linear.weight.copy_(torch.arange(6, dtype=torch.float32).reshape(3, 2))
        linear.bias.copy_(torch.tensor([0.5, -1.0, 2.0]))
    assert parameters_hash(linear) == "eaf393ee169d4bdd66412c61dd70e621e1cef6af1dfaac8ee86c6dadecfb8238"
    (tmp_path / "model-00001.safetensors").write_bytes(b"first shard")
    (tmp_path / "model-00002.safetensors").write_bytes(b"second shard")
    assert weights_hash(tmp_path) == "37de665a37835c3c648dd7c3eebcdbfeb9b80026bdfb846716ff1b34c3e4ce78"
    with open_store(tmp_path / "runs.duckdb") as store:
        store.begin_sweep({"policies": ["h2o"], "contexts": [1024]})
        [record] = store.sweeps()
    with duckdb.connect(str(tmp_path / "runs.duckdb"), read_only=True) as connection:
        [(key,)] = connection.execute("SELECT sweep_key FROM sweeps").fetchall()
    assert record.spec == {"policies": ["h2o"], "contexts": [1024]}
    assert key == "a5615c66c44a3dfc4379eafb3d97d3124573f23a3d9ca772710a7171037c06b2"
