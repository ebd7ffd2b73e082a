"""The training corpus: Python sources and documentation files of the installed Python and its packages.

Nothing is downloaded: the text is what ``pip`` and the interpreter already put on the machine (``.py``/``.pyi``
sources with their docstrings and comments, and ``.md``/``.rst``/``.txt`` documentation). Files are deduplicated
by content, ordered by content hash (so the same installed files give the same corpus on any machine), capped in
bytes, and split into train and hold-out by hash. Paths containing an excluded part are skipped: ``pydoc_data``
is the source of kvlab's needle haystacks, which the model must never see.

The manifest records what went in (counts, bytes, a hash of the file list) and what was held out, and the
contamination check measures how many 13-word sequences of the haystacks occur anywhere in the training text.
"""

from __future__ import annotations

import hashlib
import os
import re
import sys
import sysconfig
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

EXTENSIONS: dict[str, str] = {".py": "source", ".pyi": "source", ".md": "doc", ".rst": "doc", ".txt": "doc"}
EXCLUDED_PARTS: tuple[str, ...] = ("pydoc_data", "kvlab")
MIN_BYTES = 256
MAX_BYTES = 300_000
HOLDOUT_PER_MILLE = 10
NGRAM = 13


@dataclass(frozen=True)
class Document:
    """One corpus file: where it came from, its kind (source or doc), its text and the hash of that text."""

    path: str
    kind: str
    text: str
    sha1: str

    @property
    def held_out(self) -> bool:
        """Whether the file belongs to the hold-out split (decided by its content hash, about 1 file in 100)."""
        return int(self.sha1[:8], 16) % 1000 < HOLDOUT_PER_MILLE


@dataclass
class Corpus:
    """The chosen documents in corpus order, with the counts the manifest reports."""

    train: list[Document]
    heldout: list[Document]
    roots: list[str]
    skipped: dict[str, int] = field(default_factory=dict)

    def manifest(self) -> dict[str, object]:
        """What went into training and what was held out, with a hash of each file list."""

        def describe(docs: Sequence[Document]) -> dict[str, object]:
            listing = "".join(f"{d.path}\t{d.sha1}\n" for d in docs)
            return {
                "files": len(docs),
                "bytes": sum(len(d.text.encode("utf-8")) for d in docs),
                "bytes_by_kind": {
                    k: sum(len(d.text.encode("utf-8")) for d in docs if d.kind == k)
                    for k in sorted(set(EXTENSIONS.values()))
                },
                "file_list_sha256": hashlib.sha256(listing.encode("utf-8")).hexdigest(),
            }

        return {
            "python": sys.version.split()[0],
            "roots": self.roots,
            "extensions": EXTENSIONS,
            "excluded_path_parts": list(EXCLUDED_PARTS),
            "file_bytes_range": [MIN_BYTES, MAX_BYTES],
            "holdout_rule": f"int(sha1(text)[:8], 16) % 1000 < {HOLDOUT_PER_MILLE}",
            "skipped": self.skipped,
            "train": describe(self.train),
            "heldout": describe(self.heldout),
        }


def installed_roots() -> list[Path]:
    """The standard library and site-packages folders of the running interpreter, without nested duplicates."""
    paths = sysconfig.get_paths()
    found = sorted({Path(paths[k]).resolve() for k in ("stdlib", "purelib", "platlib") if k in paths})
    return [p for p in found if p.is_dir() and not any(p != q and q in p.parents for q in found)]


def _excluded(relative: Path) -> bool:
    return any(part in EXCLUDED_PARTS for part in relative.parts)


def scan(roots: Iterable[Path], *, max_bytes_total: int) -> Corpus:
    """Read every candidate file under ``roots`` and keep up to ``max_bytes_total`` bytes of distinct text."""
    roots = list(roots)
    skipped = {"excluded": 0, "size": 0, "not_utf8": 0, "duplicate": 0, "over_cap": 0}
    seen: dict[str, Document] = {}
    for root in roots:
        for directory, subdirs, files in os.walk(root):
            subdirs.sort()
            for name in sorted(files):
                kind = EXTENSIONS.get(Path(name).suffix)
                if kind is None:
                    continue
                path = Path(directory, name)
                relative = path.relative_to(root)
                if _excluded(relative):
                    skipped["excluded"] += 1
                    continue
                try:
                    size = path.stat().st_size
                    if not MIN_BYTES <= size <= MAX_BYTES:
                        skipped["size"] += 1
                        continue
                    text = path.read_bytes().decode("utf-8")
                except (OSError, UnicodeDecodeError):
                    skipped["not_utf8"] += 1
                    continue
                if "\x00" in text:
                    skipped["not_utf8"] += 1
                    continue
                sha1 = hashlib.sha1(text.encode("utf-8")).hexdigest()
                if sha1 in seen:
                    skipped["duplicate"] += 1
                    continue
                seen[sha1] = Document(f"{root.name}/{relative.as_posix()}", kind, text, sha1)
    train: list[Document] = []
    heldout: list[Document] = []
    total = 0
    for sha1 in sorted(seen):
        doc = seen[sha1]
        size = len(doc.text.encode("utf-8"))
        if total + size > max_bytes_total:
            skipped["over_cap"] += 1
            continue
        total += size
        (heldout if doc.held_out else train).append(doc)
    return Corpus(train, heldout, [str(r) for r in roots], skipped)


def _ngrams(text: str) -> set[str]:
    words = re.findall(r"\S+", text)
    return {" ".join(words[i : i + NGRAM]) for i in range(len(words) - NGRAM + 1)}


def _hits(args: tuple[Sequence[str], frozenset[str]]) -> set[str]:
    texts, wanted = args
    found: set[str] = set()
    for text in texts:
        found |= _ngrams(text) & wanted
    return found


def contamination(haystack_texts: Sequence[str], docs: Sequence[Document], workers: int = 8) -> dict[str, object]:
    """How many of the haystacks' 13-word sequences (whitespace-separated) occur in ``docs``.

    Word sequences ignore line wrapping, so a reflowed copy of the same text is still found.
    """
    wanted = frozenset(set().union(*(_ngrams(t) for t in haystack_texts)))
    texts = [d.text for d in docs]
    chunks = [(texts[i::workers], wanted) for i in range(workers)]
    with ProcessPoolExecutor(workers) as pool:
        found = set().union(*pool.map(_hits, chunks))
    return {
        "ngram_words": NGRAM,
        "haystack_ngrams": len(wanted),
        "found_in_training_text": len(found),
        "fraction": len(found) / max(1, len(wanted)),
    }
