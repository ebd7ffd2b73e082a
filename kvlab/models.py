"""Loading a causal language model for kvlab.

A model is loaded once (by hub id or local directory) onto CUDA when there is one, else the CPU, in bf16 on CUDA and
fp32 on CPU unless asked otherwise, and switched to kvlab's attention function so that the engine can run it under a
budgeted cache. Everything a user can get wrong here (a path that does not exist, a model that is not a causal LM,
no network for a hub id) becomes one sentence in a :class:`~kvlab.errors.KvlabError`.
"""

from __future__ import annotations

import inspect
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvlab.arch import DTYPE_BYTES, ArchFacts, arch_from_config
from kvlab.attention import ATTN_IMPLEMENTATION, register_attention
from kvlab.errors import KvlabError

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MODEL_DIR = REPO_ROOT / "data" / "models" / "kvlab-tiny-llama"

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


@dataclass
class LoadedModel:
    """A model ready for the engine, with the facts that shape its cache."""

    name: str
    model: Any
    tokenizer: Any
    arch: ArchFacts
    device: torch.device
    dtype: torch.dtype
    cache_kwarg: str

    @property
    def kv_bytes_per_element(self) -> int:
        """Bytes of one cached K or V element in the dtype the model runs in."""
        return DTYPE_BYTES[self.dtype]


def pick_device(device: str | None = None) -> torch.device:
    """CUDA when available (or asked for), else CPU."""
    if device is not None:
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise KvlabError(f"Device {device!r} was requested but no CUDA GPU is available on this machine.")
        return torch.device(device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


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


def _load_config(name: str, trust_remote_code: bool) -> Any:
    from transformers import AutoConfig

    path = Path(name).expanduser()
    is_local = path.exists()
    if is_local and not (path / "config.json").is_file():
        raise KvlabError(f"{name!r} has no config.json, so it is not a model directory.")
    if not is_local and (name.startswith((".", "/", "~")) or os.sep in name.strip("/").replace("/", "", 1)):
        raise KvlabError(f"No model directory at {name!r}.")
    try:
        return AutoConfig.from_pretrained(str(path) if is_local else name,
                                          trust_remote_code=trust_remote_code)
    except OSError as error:
        text = str(error)
        if is_local:
            raise KvlabError(f"{name!r} is a directory without a readable config.json, so it is not a model.") from None
        if "offline" in text.lower() or "connect" in text.lower() or "resolve" in text.lower():
            raise KvlabError(
                f"Could not fetch {name!r} from the Hugging Face hub: there is no network connection and it is "
                "not in the local cache."
            ) from None
        raise KvlabError(f"There is no model called {name!r} on the Hugging Face hub or on this machine.") from None
    except ValueError as error:
        if "trust_remote_code" in str(error):
            raise KvlabError(
                f"{name!r} needs its own Python code to load; kvlab only runs such code if you pass "
                "trust_remote_code explicitly."
            ) from None
        raise KvlabError(f"{name!r} has a config transformers cannot read: {str(error).splitlines()[0]}") from None


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
    device: str | None = None,
    dtype: str | torch.dtype | None = None,
    trust_remote_code: bool = False,
) -> LoadedModel:
    """Load a decoder-only causal LM by hub id or local directory, ready for the engine.

    ``trust_remote_code`` stays off unless the caller switches it on explicitly: loading a hub model must never run
    code from the hub by surprise.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    name = name or default_model()
    config = _load_config(name, trust_remote_code)
    if getattr(config, "is_encoder_decoder", False):
        raise KvlabError(f"{name!r} is an encoder-decoder model; kvlab runs decoder-only causal language models.")
    if not _is_causal_lm(config, trust_remote_code):
        raise KvlabError(
            f"{name!r} is a {getattr(config, 'model_type', '') or 'unknown'} model without a causal language-model "
            "head, so it cannot generate text."
        )
    arch = arch_from_config(config)
    torch_device = pick_device(device)
    torch_dtype = pick_dtype(torch_device, dtype)
    source = str(Path(name).expanduser()) if Path(name).expanduser().exists() else name
    register_attention()
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=trust_remote_code)
        model = AutoModelForCausalLM.from_pretrained(
            source,
            dtype=torch_dtype,
            attn_implementation=ATTN_IMPLEMENTATION,
            trust_remote_code=trust_remote_code,
        )
    except torch.OutOfMemoryError:
        raise KvlabError(f"{name!r} does not fit in the memory of {torch_device}; try a smaller model or dtype.") from None
    except (OSError, ValueError) as error:
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise KvlabError(f"Could not load the weights or tokenizer of {name!r}: {first_line}") from None
    try:
        model.to(torch_device)
    except torch.OutOfMemoryError:
        raise KvlabError(f"{name!r} does not fit in the memory of {torch_device}; try a smaller model or dtype.") from None
    model.eval()
    return LoadedModel(
        name=name,
        model=model,
        tokenizer=tokenizer,
        arch=arch,
        device=torch_device,
        dtype=torch_dtype,
        cache_kwarg=_cache_kwarg(model),
    )


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
    )
