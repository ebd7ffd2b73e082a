"""GGUF checkpoints: what a file says about itself, and the safetensors directory kvlab loads it from.

Practitioners keep models as GGUF files (llama.cpp, Ollama). kvlab runs models through transformers in floating
point, so a GGUF file is dequantised by transformers' GGUF loader once, and the result is cached as an ordinary
model directory (config, tokenizer with its chat template, ``model.safetensors`` in float32: the dequantised values
exactly) under ``$KVLAB_MODEL_CACHE``, keyed by the file's sha256. The next load of the same bytes, under any path
or name, reads that directory and is fast, as long as the transformers that converted it is the one installed: the
conversion is transformers' (its GGUF tokenizer for Gemma 3 merged words wrongly and added no BOS before 5.23, so a
model converted then reads other tokens), so another version converts the file again. A model is named by the file's
path, or by ``owner/repo/file.gguf`` for a file in a hub repository.

Nothing here imports torch or transformers until a file is converted, so listing models stays cheap.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from importlib.metadata import version
from pathlib import Path
from typing import Any

from kvlab.errors import KvlabError, NotAModel, not_fetched, shown_name
from kvlab.hashing import file_sha256
from kvlab.models.hub import hub_reachable, in_hub_cache
from kvlab.paths import user_file

GGUF_SUFFIX = ".gguf"
#: Where dequantised GGUF models are kept (default ``~/.cache/kvlab/models/loading``).
CACHE_ENV_VAR = "KVLAB_MODEL_CACHE"
#: The file in a converted directory that says which GGUF file it came from; written last, so its presence means
#: the conversion finished.
FACTS_FILE = "kvlab-gguf.json"
#: The key in :data:`FACTS_FILE` naming the transformers version that converted the directory.
CONVERTED_BY = "converted_by_transformers"
#: Held while ``gguf.GGUFReader`` is replaced by :func:`one_reader`.
_READER_LOCK = threading.Lock()


@dataclass(frozen=True)
class GgufFacts:
    """What a GGUF file says about the model in it: its ``architecture`` (llama.cpp's name), the quantisation type
    of most of its weights, the title, organisation and licence its author wrote into it, and the sha256 of its
    bytes (the model's identity wherever the file lies)."""

    file_name: str
    sha256: str
    architecture: str | None
    quantisation: str
    title: str | None
    organization: str | None
    licence: str | None


def is_gguf_name(name: str) -> bool:
    """Whether a model name names a GGUF file (a local path or ``owner/repo/file.gguf``)."""
    return name.strip().lower().endswith(GGUF_SUFFIX)


def with_gguf_file(model: str, gguf_file: str | None) -> str:
    """One model name for a directory or hub id and a GGUF file named inside it: ``dir/file.gguf`` or
    ``owner/repo/file.gguf``; the name alone without a file."""
    if not gguf_file:
        return model
    if not is_gguf_name(gguf_file):
        raise KvlabError(f"The GGUF file to load must end in .gguf, not {shown_name(gguf_file)}.")
    return f"{model.rstrip('/')}/{gguf_file.lstrip('/')}"


def model_cache_dir(env: Mapping[str, str] = os.environ) -> Path:
    """Where dequantised GGUF models are cached: ``$KVLAB_MODEL_CACHE``, else ``kvlab/models/loading`` under the XDG
    cache directory."""
    return user_file(env, CACHE_ENV_VAR, "XDG_CACHE_HOME", ".cache", "kvlab", "models")


def locate(name: str) -> Path:
    """The local GGUF file ``name`` names: the file itself, or, for ``owner/repo/file.gguf``, the file fetched
    from the hub (or found in its local cache)."""
    path = Path(name).expanduser()
    if path.is_file():
        return path
    parts = name.strip().split("/")
    if path.is_absolute() or name.startswith(".") or len(parts) < 3:
        raise NotAModel(f"There is no GGUF file at {shown_name(name)}.")
    repo, file_name = "/".join(parts[:2]), "/".join(parts[2:])
    cached = in_hub_cache(repo, file_name)  # a cached file is read without asking the hub
    if not cached and not hub_reachable():
        raise not_fetched(shown_name(name))
    try:
        from huggingface_hub import hf_hub_download

        return Path(hf_hub_download(repo, file_name, local_files_only=cached))
    except Exception as error:  # offline, no such repo or file: huggingface_hub raises many kinds
        text = str(error).lower()
        if "offline" in text or "connect" in text or "resolve" in text or "network" in text:
            raise not_fetched(shown_name(name)) from None
        raise NotAModel(f"There is no GGUF file {shown_name(file_name)} in the hub repository {repo}.") from None


def read_facts(path: Path, cache_root: Path | None = None) -> GgufFacts:
    """The facts a GGUF file holds about itself; a file that is not GGUF, truncated or damaged is one sentence.
    Where the same bytes were converted before, the facts recorded beside the conversion are read instead of the
    file's header: ``gguf``'s reader takes some 19 s over the 262,144-token vocabulary of Gemma 3 on two cores."""
    recorded = _recorded_facts(path, cache_root)
    if recorded is not None:
        return recorded
    import gguf

    shown = shown_name(str(path))
    try:
        reader = gguf.GGUFReader(str(path))
        fields = {key: _field_value(field) for key, field in reader.fields.items()}
        tensor_types = [tensor.tensor_type.name for tensor in reader.tensors]
    except Exception:  # gguf raises ValueError, IndexError or struct errors for bytes it cannot parse
        raise NotAModel(f"{shown} is not a readable GGUF file: it is truncated, damaged or not GGUF.") from None
    if not tensor_types:
        raise NotAModel(f"{shown} is a GGUF file without any tensors, so it holds no model.")
    return GgufFacts(
        file_name=path.name,
        sha256=file_sha256(path),
        architecture=_text(fields.get("general.architecture")),
        quantisation=_quantisation(fields.get("general.file_type"), tensor_types),
        title=_text(fields.get("general.name")),
        organization=_text(fields.get("general.organization")),
        licence=_text(fields.get("general.license")),
    )


def _recorded_facts(path: Path, cache_root: Path | None) -> GgufFacts | None:
    """The facts recorded beside a finished conversion of the bytes at ``path`` (named as ``path`` names them), or
    ``None`` where there is none, or its record is not one kvlab wrote."""
    digest = file_sha256(path)
    try:
        recorded = json.loads((_converted_target(digest, cache_root) / FACTS_FILE).read_text())
        facts = GgufFacts(**{name: recorded[name] for name in GgufFacts.__dataclass_fields__})
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return replace(facts, file_name=path.name) if facts.sha256 == digest else None


def _converted_target(sha256: str, cache_root: Path | None = None) -> Path:
    """Where the conversion of the GGUF bytes whose sha256 is ``sha256`` lies, finished or not."""
    root = cache_root if cache_root is not None else model_cache_dir()
    return root / f"gguf-{sha256[:24]}"


def _field_value(field: Any) -> Any:
    """A reader field's value, or None for a kind this version of ``gguf`` cannot decode."""
    try:
        return field.contents()
    except Exception:  # an array of arrays, or a type newer than the reader
        return None


def _text(value: Any) -> str | None:
    return value.strip() or None if isinstance(value, str) else None


def _quantisation(file_type: Any, tensor_types: list[str]) -> str:
    """The file's quantisation as llama.cpp names it (``Q4_1``, ``Q4_K_M``, ``F16``): from ``general.file_type``
    when the file says, else the most common type among its tensors."""
    import gguf

    if isinstance(file_type, int):
        try:
            name = gguf.LlamaFileType(file_type).name
        except ValueError:
            name = ""
        if name:
            return name.removeprefix("MOSTLY_").removeprefix("ALL_")
    return max(set(tensor_types), key=tensor_types.count)


def converted_dir(path: Path, facts: GgufFacts, cache_root: Path | None = None) -> Path:
    """The model directory dequantised from the GGUF file at ``path``, converting it on first use and again when the
    installed transformers is not the one that converted it.

    The conversion is written to a temporary directory beside its place and moved into place when complete, so
    a conversion that is interrupted, or two that race, never leave a half-written model behind.
    """
    root = cache_root if cache_root is not None else model_cache_dir()
    target = _converted_target(facts.sha256, root)
    converter = version("transformers")
    if _converted_by(target) == converter:
        return target
    try:
        root.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(prefix=".converting-", dir=root))
    except OSError as error:
        raise KvlabError(f"Cannot write the dequantised model under {root}: {error.strerror}.") from None
    try:
        _convert(path, work)
        (work / FACTS_FILE).write_text(json.dumps({**asdict(facts), CONVERTED_BY: converter}, indent=2) + "\n")
        _replace(target, work, converter)
    except OSError as error:
        raise KvlabError(f"Cannot write the dequantised model under {root}: {error.strerror or error}.") from None
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return target


def _converted_by(directory: Path) -> str | None:
    """The transformers version that converted ``directory`` (``""`` for a conversion that did not record it);
    ``None`` where no finished conversion lies there."""
    try:
        recorded = json.loads((directory / FACTS_FILE).read_text())
    except (OSError, ValueError):
        return None
    return str(recorded.get(CONVERTED_BY, "")) if isinstance(recorded, dict) else None


def _replace(target: Path, work: Path, converter: str) -> None:
    """Move the finished conversion ``work`` to ``target``, the conversion of another transformers there first
    moved aside and deleted; a twin finished by a concurrent conversion under the same version is kept."""
    if target.exists():
        if _converted_by(target) == converter:
            return
        stale = Path(tempfile.mkdtemp(prefix=".stale-", dir=target.parent))
        target.rename(stale / target.name)
        shutil.rmtree(stale, ignore_errors=True)
    try:
        work.rename(target)
    except OSError:
        if _converted_by(target) != converter:  # not a finished twin from a concurrent conversion
            raise


def _convert(path: Path, out: Path) -> None:
    """Dequantise with transformers' GGUF loader and save config, tokenizer and weights as a plain model directory.

    transformers refuses to save a model it loaded from GGUF (its quantiser is marked unserialisable), but the
    loaded parameters are ordinary float tensors: they are saved with safetensors directly, and the config without
    its GGUF quantisation entry, so the directory loads like any other.
    """
    import transformers
    from safetensors.torch import save_model
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    shown = shown_name(str(path))
    folder, file_name = str(path.parent), path.name
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # its per-tensor progress bars would drown the one line that matters
    try:
        with one_reader(path):
            try:
                AutoConfig.from_pretrained(folder, gguf_file=file_name)
            except Exception as error:
                raise NotAModel(f"{shown} cannot be loaded: {_gguf_refusal(error)}") from None
            try:
                tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=file_name)
                model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=file_name)
            except Exception as error:
                raise NotAModel(f"{shown} could not be dequantised: {_gguf_refusal(error)}") from None
    finally:
        transformers.logging.set_verbosity(verbosity)
    save_model(model, str(out / "model.safetensors"))
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["architectures"] = [type(model).__name__]
    (out / "config.json").write_text(json.dumps(config, indent=2, default=str) + "\n")
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))


@contextmanager
def one_reader(path: Path) -> Iterator[None]:
    """Within the block, every ``gguf.GGUFReader`` of ``path`` is one reader, read once. transformers reads the
    file's header afresh for the config, the tokenizer and the model (four times), each read some 19 s for Gemma 3's
    vocabulary on two cores; it imports the reader from ``gguf`` at each call, so the shared one is put there for the
    block's length (under a lock, so that conversions in two threads never restore each other's)."""
    import gguf

    with _READER_LOCK:
        plain = gguf.GGUFReader
        shared: dict[str, Any] = {}

        def reader(name: Any, *args: Any, **kwargs: Any) -> Any:
            if Path(name) != path or args or kwargs:
                return plain(name, *args, **kwargs)
            if "reader" not in shared:
                shared["reader"] = plain(name)
            return shared["reader"]

        setattr(gguf, "GGUFReader", reader)  # noqa: B010 (replaced for the block, restored below)
        try:
            yield
        finally:
            setattr(gguf, "GGUFReader", plain)  # noqa: B010


def _gguf_refusal(error: BaseException) -> str:
    """transformers' reason for refusing a GGUF file, as the end of one sentence."""
    text = " ".join(str(error).split()) or type(error).__name__
    if "not supported" in text.lower() and "architecture" in text.lower():
        return f"{text.rstrip('.')} by transformers' GGUF loader."
    return text if len(text) <= 300 else text[:299] + "…"
