"""Loading a causal language model for kvlab.

A model is loaded once (by hub id, local directory or GGUF file, see :mod:`kvlab.gguf`) onto CUDA when there is one,
else the CPU, in bf16 on CUDA and fp32 on CPU unless asked otherwise, and switched to kvlab's attention function so that
the engine can run it under a budgeted cache. A hub id is read from the local Hugging Face cache alone when the hub
does not answer within two seconds, so a machine without network loads cached models and refuses others at once.
Everything a user can get wrong here (a path that does not exist, a model that is not a causal LM, no network for a
hub id) becomes one sentence in a :class:`~kvlab.errors.KvlabError`.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvlab import gguf
from kvlab.arch import ArchFacts, arch_from_config, dtype_name
from kvlab.attention import ATTN_IMPLEMENTATION, register_attention
from kvlab.catalog import SHIPPED_MODELS_DIR, hub_reachable, in_hub_cache, installed_name, package_of, readme_licence
from kvlab.errors import KvlabError, NotAModel, not_fetched, shown_name
from kvlab.limits import Limits, limits_for
from kvlab.provenance import weights_identity

_LOGGER = logging.getLogger(__name__)
#: A hub id: an optional owner and a name, of the characters the hub allows.
_HUB_ID = re.compile(r"^(?:[A-Za-z0-9][A-Za-z0-9._-]{0,95}/)?[A-Za-z0-9][A-Za-z0-9._-]{0,95}$")
_DEVICE = re.compile(r"^(cpu|cuda)(?::(\d+))?$")

DEFAULT_MODEL_DIR = SHIPPED_MODELS_DIR / "kvlab-tiny-llama"

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def default_model() -> str:
    """The model kvlab uses when none is named: ``$KVLAB_DEFAULT_MODEL`` or the model shipped in ``data/models``."""
    return os.environ.get("KVLAB_DEFAULT_MODEL", str(DEFAULT_MODEL_DIR))


@dataclass(frozen=True)
class ModelSource:
    """Where a model came from, as shown beside it and stored with its runs.

    ``label`` is the portable name runs and exports carry (a hub id as it is, a local directory or GGUF file by its
    last component, never the path it was typed as); ``origin`` says where the files came from; ``quantisation`` is
    a GGUF file's type (``Q4_1``), ``None`` for floating-point checkpoints; ``weights_hash`` is the identity of the
    weights when it is known before loading (a GGUF file's sha256).
    """

    label: str
    origin: str
    licence: str | None = None
    quantisation: str | None = None
    weights_hash: str | None = None

    def describe(self) -> str:
        """One line for a person: origin, quantisation and licence."""
        parts = [self.origin]
        if self.quantisation:
            parts.append(f"GGUF {self.quantisation}, dequantised to floating point")
        parts.append(f"licence {self.licence}" if self.licence else "licence not stated in its files")
        return " · ".join(parts)


@dataclass
class LoadedModel:
    """A model ready for the engine, with the facts that shape its cache. ``name`` is what it was loaded by;
    ``source`` where it came from and the portable name its runs are stored under."""

    name: str
    model: Any
    tokenizer: Any
    arch: ArchFacts
    device: torch.device
    dtype: torch.dtype
    cache_kwarg: str
    source: ModelSource

    @property
    def kv_bytes_per_element(self) -> int:
        """Bytes of one cached K or V element in the dtype the model runs in."""
        return self.dtype.itemsize

    @property
    def dtype_name(self) -> str:
        """The dtype the model runs in, as stored with its runs (``bfloat16``, ``float32``)."""
        return dtype_name(self.dtype)

    @property
    def device_kind(self) -> str:
        """The kind of device the model runs on, as stored with its runs: ``cpu``, or ``cuda`` with the GPU's
        name (timings and rounding differ between GPU models)."""
        if self.device.type == "cuda":
            return f"cuda ({torch.cuda.get_device_name(self.device)})"
        return self.device.type

    @property
    def limits(self) -> Limits:
        """How long prompts and generations may be on this model (its positions and the operator's limits)."""
        return limits_for(self.arch)

    @functools.cached_property
    def weights_hash(self) -> str | None:
        """The identity of the weights: a GGUF file's sha256, else the hash of a local model's safetensors files,
        else the hub commit, else (a model built in memory) the hash of its parameters."""
        if self.source.weights_hash is not None:
            return self.source.weights_hash
        identity = weights_identity(self.name, self.model.config)
        return identity if identity is not None else parameters_hash(self.model)

    @functools.cached_property
    def tokenizer_hash(self) -> str | None:
        """The identity of the tokenizer: its vocabulary, merges, normalisation, special tokens and chat template."""
        return tokenizer_hash(self.tokenizer)


def parameters_hash(model: Any) -> str:
    """sha256 over every parameter and buffer of a model, by name, shape, dtype and bytes."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(f"{name} {tuple(tensor.shape)} {tensor.dtype}\n".encode())
        digest.update(tensor.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def tokenizer_hash(tokenizer: Any) -> str | None:
    """sha256 of what makes a tokenizer turn text into ids and ids into text; ``None`` without a tokenizer.

    A fast tokenizer's truncation and padding settings are left out: a call that asks for truncation changes them
    for every later call, and they say how one call is cut or padded, not how text becomes tokens."""
    if tokenizer is None:
        return None
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        # as the tokenizer writes itself out with neither set, so that identities stored before stay the same
        settings = {**json.loads(backend.to_str()), "truncation": None, "padding": None}
        core = json.dumps(settings, separators=(",", ":"), ensure_ascii=False)
    else:
        core = json.dumps(sorted(tokenizer.get_vocab().items()))
    extra = {
        "chat_template": getattr(tokenizer, "chat_template", None),
        "special": {key: str(value) for key, value in sorted(tokenizer.special_tokens_map.items())},
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
    }
    return hashlib.sha256((core + json.dumps(extra, sort_keys=True, default=str)).encode()).hexdigest()


def pick_device(device: str | None = None) -> torch.device:
    """CUDA when available, else CPU; or the device asked for (``cpu``, ``cuda`` or ``cuda:N``), which must exist."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    match = _DEVICE.match(device.strip().lower())
    if match is None:
        raise KvlabError(f"Unknown device {device[:40]!r}; use cpu, cuda or cuda:N.")
    kind, index = match.groups()
    if kind == "cpu":
        if index not in (None, "0"):
            raise KvlabError(f"There is no device {device!r}: the CPU is one device, so use cpu.")
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise KvlabError(f"Device {device!r} was requested but no CUDA GPU is available on this machine.")
    count = torch.cuda.device_count()
    if index is not None and int(index) >= count:
        raise KvlabError(f"There is no GPU {device!r}: this machine has {count} (cuda:0 to cuda:{count - 1}).")
    return torch.device("cuda" if index is None else f"cuda:{int(index)}")


def pick_dtype(device: torch.device, dtype: str | torch.dtype | None = None) -> torch.dtype:
    """bf16 on CUDA and fp32 on CPU unless a dtype is given by name or value."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    try:
        return DTYPES[dtype.lower()]
    except KeyError:
        raise KvlabError(f"Unknown dtype {dtype!r}; use one of {', '.join(sorted(DTYPES))}.") from None


def _cache_kwarg(model: Any) -> str:
    """The name the model's forward uses for the KV cache (``cache`` in newer transformers, else
    ``past_key_values``), so the engine passes it without tripping deprecation shims."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def local_model_path(name: str) -> Path | None:
    """The local path ``name`` names, if something exists there (a name no file system accepts, too long or with
    a NUL byte, names nothing)."""
    try:
        path = Path(name).expanduser()
        return path if path.exists() else None
    except (OSError, ValueError, RuntimeError):
        return None


def _cache_only(name: str, shown: str) -> bool:
    """Whether the model ``name`` must be read from the local Hugging Face cache alone: it is a hub id and the hub
    does not answer (no network, ``HF_HUB_OFFLINE``), where asking the hub for each file would cost
    huggingface_hub's retries, 23 s a file. A hub model the cache does not hold is then refused at once, and a name
    that is neither a local path nor a hub id at all."""
    if local_model_path(name) is not None:
        return False
    if not _HUB_ID.match(name):
        raise NotAModel(f"No model directory at {shown}, and it is not a hub id (owner/name) either.")
    if hub_reachable():
        return False
    if not in_hub_cache(name):
        raise not_fetched(shown)
    return True


def _load_config(name: str, trust_remote_code: bool, shown: str, cache_only: bool) -> Any:
    """The config of a model directory or hub id (from the local cache alone when ``cache_only``); ``shown`` is
    how the model is named in a refusal."""
    from transformers import AutoConfig

    path = local_model_path(name)
    if path is not None and not (path / "config.json").is_file():
        raise NotAModel(f"{shown} has no config.json, so it is not a model directory.")
    try:
        return AutoConfig.from_pretrained(
            str(path) if path is not None else name, trust_remote_code=trust_remote_code, local_files_only=cache_only
        )
    except OSError as error:
        text = str(error)
        if path is not None:
            raise NotAModel(f"{shown} is a directory without a readable config.json, so it is not a model.") from None
        if "offline" in text.lower() or "connect" in text.lower() or "resolve" in text.lower():
            raise not_fetched(shown) from None
        raise NotAModel(f"There is no model called {shown} on the Hugging Face hub or on this machine.") from None
    except ValueError as error:
        if "trust_remote_code" in str(error):
            raise NotAModel(
                f"{shown} needs its own Python code to load; kvlab only runs such code if you pass "
                "trust_remote_code explicitly."
            ) from None
        raise NotAModel(f"{shown} has a config transformers cannot read: {_first_line(error)}") from None
    except Exception as error:  # a config.json that is not JSON, or JSON of the wrong shape
        raise NotAModel(f"{shown} has a config.json transformers cannot read: {_first_line(error)}") from None


def _first_line(error: BaseException) -> str:
    """An error's message as one line: its first line, or, when that line ends in a colon (it introduces a list),
    the whole message joined, so that the sentence does not stop mid-way; at most 400 characters."""
    text = str(error).strip()
    if not text:
        return type(error).__name__
    first = text.splitlines()[0].strip()
    line = " ".join(text.split()) if first.endswith(":") else first
    return line if len(line) <= 400 else line[:399] + "…"


CAUSAL_HEAD_SUFFIXES = ("ForCausalLM", "LMHeadModel", "ForConditionalGeneration")


def _is_causal_lm(config: Any, trust_remote_code: bool) -> bool:
    """Whether the config describes a model transformers can load with a causal LM head.

    The declared ``architectures`` decide when present (a BERT checkpoint is declared ``BertForMaskedLM`` even
    though transformers has a BERT causal head); otherwise the model type must have a causal LM class.
    """
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    architectures = getattr(config, "architectures", None) or []
    if architectures:
        return any(arch.endswith(CAUSAL_HEAD_SUFFIXES) for arch in architectures)
    return trust_remote_code or getattr(config, "model_type", "") in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES


def load_model(
    name: str | None = None,
    *,
    gguf_file: str | None = None,
    device: str | None = None,
    dtype: str | torch.dtype | None = None,
    trust_remote_code: bool = False,
) -> LoadedModel:
    """Load a decoder-only causal LM by hub id, local directory or GGUF file, ready for the engine.

    ``gguf_file`` names a GGUF file inside the directory or hub repository ``name``; a GGUF file can also be named
    directly (``path/to/model.gguf`` or ``owner/repo/model.gguf``), and a shipped or installed model by its label
    (:func:`kvlab.catalog.installed_name`). It is dequantised once and cached (:mod:`kvlab.gguf`). ``trust_remote_code``
    stays off unless the caller switches it on explicitly: loading a hub model must never run code from the hub by
    surprise.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    name = installed_name(gguf.with_gguf_file(default_model() if name is None else name, gguf_file))
    if not name.strip():
        raise NotAModel("No model was named; give a hub id, a local model directory or a GGUF file.")
    torch_device = pick_device(device)
    torch_dtype = pick_dtype(torch_device, dtype)
    shown = shown_name(name)
    if gguf.is_gguf_name(name):
        gguf_path = gguf.locate(name)
        facts = gguf.read_facts(gguf_path)
        source_dir: str = str(gguf.converted_dir(gguf_path, facts))
        source = _gguf_source(name, gguf_path, facts)
    else:
        path = local_model_path(name)
        source_dir = str(path) if path is not None else name
        source = _source_of(name, path)
    cache_only = _cache_only(source_dir, shown)
    config = _load_config(source_dir, trust_remote_code, shown, cache_only)
    if getattr(config, "is_encoder_decoder", False):
        raise NotAModel(f"{shown} is an encoder-decoder model; kvlab runs decoder-only causal language models.")
    if not _is_causal_lm(config, trust_remote_code):
        raise NotAModel(
            f"{shown} is a {getattr(config, 'model_type', '') or 'unknown'} model without a causal language-model "
            "head, so it cannot generate text."
        )
    try:
        arch = arch_from_config(config)
    except KvlabError as error:
        raise NotAModel(f"{shown}: {error}") from None
    register_attention()
    try:
        tokenizer = AutoTokenizer.from_pretrained(
            source_dir, trust_remote_code=trust_remote_code, local_files_only=cache_only
        )
    except Exception as error:  # tokenizers, sentencepiece and transformers raise many kinds for one cause
        _LOGGER.info("tokenizer of %s failed to load", name, exc_info=True)
        raise KvlabError(f"Could not load the tokenizer of {shown}: {_first_line(error)}") from None
    try:
        model: Any = AutoModelForCausalLM.from_pretrained(
            source_dir,
            dtype=torch_dtype,
            attn_implementation=ATTN_IMPLEMENTATION,
            trust_remote_code=trust_remote_code,
            local_files_only=cache_only,
        )
        model.to(torch_device)
    except torch.OutOfMemoryError:
        raise KvlabError(
            f"{shown} does not fit in the memory of {torch_device}; try a smaller model or dtype."
        ) from None
    except Exception as error:  # a truncated or damaged weights file raises safetensors' own error type
        _LOGGER.info("weights of %s failed to load", name, exc_info=True)
        raise KvlabError(f"Could not load the weights of {shown}: {_first_line(error)}") from None
    model.eval()
    return LoadedModel(
        name=name,
        model=model,
        tokenizer=tokenizer,
        arch=arch,
        device=torch_device,
        dtype=torch_dtype,
        cache_kwarg=_cache_kwarg(model),
        source=source,
    )


def _source_of(name: str, path: Path | None) -> ModelSource:
    """Where a model directory or hub id comes from, and its licence where its model card says."""
    if path is None:
        return ModelSource(label=name.strip(), origin="Hugging Face hub", licence=_hub_licence(name.strip()))
    resolved = path.resolve()
    package = package_of(resolved)
    if package is not None:
        origin = package.origin
    elif resolved.parent == SHIPPED_MODELS_DIR.resolve():
        origin = "shipped with kvlab"
    else:
        origin = "local directory"
    return ModelSource(label=resolved.name, origin=origin, licence=readme_licence(resolved))


def _gguf_source(name: str, path: Path, facts: gguf.GgufFacts) -> ModelSource:
    """Where a GGUF model comes from: an installed package, the hub or a local file; its licence as the file (or
    else its package) declares it."""
    package = package_of(path)
    local = local_model_path(name) is not None
    if package is not None:
        origin = package.origin
    else:
        origin = "GGUF file" if local else "Hugging Face hub (GGUF)"
    return ModelSource(
        label=path.name if local else name.strip(),
        origin=origin,
        licence=facts.licence or (package.licence if package is not None else None),
        quantisation=facts.quantisation,
        weights_hash=facts.sha256,
    )


def _hub_licence(repo_id: str) -> str | None:
    """The licence in a hub model's card, when the card is in the local cache (nothing is downloaded for it)."""
    try:
        from huggingface_hub import try_to_load_from_cache

        card = try_to_load_from_cache(repo_id, "README.md")
    except Exception:  # a name the hub's validator refuses
        return None
    return readme_licence(Path(card).parent) if isinstance(card, str) else None


def wrap_model(model: Any, tokenizer: Any = None, name: str = "in-memory") -> LoadedModel:
    """Prepare a model that is already in memory (for example a random-weight model built from a config)."""
    register_attention()
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    model.eval()
    parameter = next(model.parameters())
    return LoadedModel(
        name=name,
        model=model,
        tokenizer=tokenizer,
        arch=arch_from_config(model.config),
        device=parameter.device,
        dtype=parameter.dtype,
        cache_kwarg=_cache_kwarg(model),
        source=ModelSource(label=name, origin="built in memory"),
    )
