"""Corpus building: exclusions, deduplication, cap, split, manifest hash, contamination check, token stream."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from training.corpus import contamination, scan
from training.tokenizer import EOS, encode_documents, train_tokenizer

SENTENCE = "The quick brown fox jumps over the lazy dog while the cat sleeps on the warm mat all day long. "


def _tree(root: Path) -> None:
    (root / "pkg").mkdir(parents=True)
    (root / "pydoc_data").mkdir()
    for i in range(30):
        (root / "pkg" / f"m{i}.py").write_text(f'"""Module {i}."""\n' + f"x_{i} = {i}\n" * 40)
    (root / "pkg" / "copy.py").write_text((root / "pkg" / "m0.py").read_text())
    (root / "pkg" / "tiny.py").write_text("x = 1\n")
    (root / "pkg" / "notes.md").write_text(SENTENCE * 10)
    (root / "pkg" / "data.bin").write_bytes(b"\x00" * 1000)
    (root / "pydoc_data" / "topics.py").write_text(SENTENCE * 10)


def test_scan_excludes_dedupes_and_records(tmp_path):
    _tree(tmp_path)
    corpus = scan([tmp_path], max_bytes_total=10**9)
    paths = [d.path for d in corpus.train + corpus.heldout]
    assert not any("pydoc_data" in p for p in paths)
    assert len(paths) == 31 and corpus.skipped["duplicate"] == 1 and corpus.skipped["size"] == 1
    assert corpus.skipped["excluded"] == 1
    manifest = corpus.manifest()
    assert manifest["train"]["files"] + manifest["heldout"]["files"] == 31
    assert manifest["train"]["bytes_by_kind"]["doc"] == len(SENTENCE * 10)
    again = scan([tmp_path], max_bytes_total=10**9).manifest()
    assert again["train"]["file_list_sha256"] == manifest["train"]["file_list_sha256"]
    assert all(d.held_out for d in corpus.heldout) and not any(d.held_out for d in corpus.train)


def test_scan_respects_the_byte_cap(tmp_path):
    _tree(tmp_path)
    corpus = scan([tmp_path], max_bytes_total=3000)
    assert sum(len(d.text) for d in corpus.train + corpus.heldout) <= 3000
    assert corpus.skipped["over_cap"] > 0


def test_contamination_finds_reflowed_text(tmp_path):
    _tree(tmp_path)
    docs = scan([tmp_path], max_bytes_total=10**9).train
    haystack = (SENTENCE * 3).replace(" over ", "\nover ")
    found = contamination([haystack], docs, workers=1)
    assert found["fraction"] == 1.0
    clean = contamination(["An entirely different text " * 5], docs, workers=1)
    assert clean["found_in_training_text"] == 0


def test_token_stream_separates_documents_with_eos():
    tokenizer = train_tokenizer([SENTENCE * 20, "def f(x):\n    return x\n" * 20], 300)
    stream = encode_documents(tokenizer, ["hello world", "def f"])
    eos = tokenizer.token_to_id(EOS)
    assert stream.dtype == np.uint16 and (stream == eos).sum() == 2 and stream[-1] == eos
    assert tokenizer.encode("hello").ids[0] == tokenizer.token_to_id("<s>")
