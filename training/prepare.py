"""Corpus to token streams: gather the text, record it, check it against the haystacks, train the tokenizer, encode.

Writes into the work folder ``corpus.json`` (the manifest, with the contamination check), ``tokenizer/`` and the
``train.npy`` / ``heldout.npy`` token streams.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

from kvlab.tasks.needle import HAYSTACK_DIR
from training.corpus import contamination, installed_roots, scan
from training.tokenizer import encode_documents, save_tokenizer, train_tokenizer


def prepare(
    workdir: Path,
    *,
    max_bytes: int,
    vocab_size: int,
    tokenizer_bytes: int,
    max_length: int,
    roots: list[Path] | None = None,
    haystack_dir: Path = HAYSTACK_DIR,
    workers: int = 8,
) -> dict[str, object]:
    """Build everything training needs in ``workdir`` and return the manifest.

    The tokenizer is trained on the first ``tokenizer_bytes`` of the training documents (in corpus order), which is
    plenty for 8k merges and keeps the step short.
    """
    started = time.perf_counter()
    workdir.mkdir(parents=True, exist_ok=True)
    corpus = scan(roots or installed_roots(), max_bytes_total=max_bytes)
    manifest = corpus.manifest()
    haystacks = [p.read_text(encoding="utf-8") for p in sorted(haystack_dir.glob("*.txt"))]
    manifest["haystack_contamination"] = contamination(haystacks, corpus.train, workers=workers)
    (workdir / "files.tsv").write_text(
        "".join(f"{d.path}\t{d.sha1}\t{'heldout' if d.held_out else 'train'}\n" for d in corpus.train + corpus.heldout)
    )
    sample, size = [], 0
    for doc in corpus.train:
        if size >= tokenizer_bytes:
            break
        sample.append(doc.text)
        size += len(doc.text)
    tokenizer = train_tokenizer(sample, vocab_size)
    save_tokenizer(tokenizer, workdir / "tokenizer", max_length)
    for split, docs in (("train", corpus.train), ("heldout", corpus.heldout)):
        tokens = encode_documents(tokenizer, [d.text for d in docs])
        np.save(workdir / f"{split}.npy", tokens)
        manifest[split]["tokens"] = int(len(tokens))  # type: ignore[index]
    manifest["tokenizer"] = {"vocab_size": tokenizer.get_vocab_size(), "trained_on_bytes": size}
    manifest["prepare_seconds"] = round(time.perf_counter() - started, 1)
    (workdir / "corpus.json").write_text(json.dumps(manifest, indent=2))
    return manifest
