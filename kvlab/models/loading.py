"""Loading a causal language model for kvlab.

A model is loaded once (by hub id, local directory or GGUF file, see :mod:`kvlab.models.gguf`) onto CUDA when there is
one, else the CPU, in bf16 on CUDA and fp32 on CPU unless asked otherwise, with transformers' SDPA attention (the engine
switches it to kvlab's attention when a run starts, :func:`kvlab.attention.function.install_attention`). With a device
map (``auto``, ``balanced``, ``sequential``, or a JSON mapping of module names to devices) it is split over the visible
GPUs by accelerate instead, layer by layer, weights possibly offloaded to the CPU or the disk;
:func:`resolve_device_map` is the one rule that turns a map into placements, for a model loaded here and for one built
in memory (:func:`place_model`). The loaded model says where each decoder layer runs and which entry of the map placed
it (its *placement group*), so that each layer's cache lives where the layer runs and an eviction scope can decide per
group (:mod:`kvlab.cache.scopes`).

A hub id is read from the local Hugging Face cache alone when the hub does not answer within two seconds, so a machine
without network loads cached models and refuses others at once. Everything a user can get wrong here (a path that
does not exist, a model that is not a causal LM, no network for a hub id, a device map naming a GPU this machine does
not have) becomes one sentence in a :class:`~kvlab.errors.KvlabError`.
"""

from __future__ import annotations

import atexit
import functools
import inspect
import json
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Union

import torch

from kvlab import files
from kvlab.errors import KvlabError, NotAModel, not_fetched, shown_name
from kvlab.hashing import chunks_sha256, text_sha256
from kvlab.models import gguf
from kvlab.models.arch import ArchFacts, arch_from_config, dtype_name
from kvlab.models.catalog import SHIPPED_MODELS_DIR, installed_name, package_of, readme_licence
from kvlab.models.hub import hub_reachable, in_hub_cache
from kvlab.models.limits import Limits, limits_for
from kvlab.models.parts import assembled
from kvlab.models.templates import check_chat_template
from kvlab.provenance import weights_identity

_LOGGER = logging.getLogger(__name__)
#: The attention a model is loaded with; kvlab's own replaces it when a run starts.
LOADED_ATTENTION = "sdpa"
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


#: The device maps accelerate infers from the model's size and the memory of each device: ``auto`` and ``balanced``
#: spread the layers evenly over the visible GPUs, ``sequential`` fills the first GPU before the next.
DEVICE_MAP_STRATEGIES: tuple[str, ...] = ("auto", "balanced", "sequential")
#: Where a device map may put a module: a GPU by index, the CPU, or the disk (weights read back at every forward).
DeviceEntry = Union[int, str]
DeviceMap = Union[str, dict[str, DeviceEntry]]


#: The largest device map file read: a map names each module once, so a few hundred kilobytes is already huge.
DEVICE_MAP_BYTES = 1 << 20


def default_model() -> str:
    """The model kvlab uses when none is named: ``$KVLAB_DEFAULT_MODEL`` or the model shipped in
    ``kvlab/data/models``."""
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
    ``source`` where it came from and the portable name its runs are stored under.

    ``device`` is where the input ids go and the logits come back (the embedding's device). ``layer_devices`` says
    where each decoder layer runs, and ``layer_groups`` which entry of the device map placed it (``"0"``, ``"1"``,
    ``"cpu"``, ``"disk"``: a layer whose weights wait on the CPU or the disk runs on the map's first GPU, or on the
    CPU without one); a model on one device has one group, named after that device."""

    name: str
    model: Any
    tokenizer: Any
    arch: ArchFacts
    device: torch.device
    dtype: torch.dtype
    cache_kwarg: str
    source: ModelSource
    layer_devices: tuple[torch.device, ...] = ()
    layer_groups: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.layer_devices:
            self.layer_devices = (self.device,) * self.arch.num_layers
        if not self.layer_groups:
            self.layer_groups = (group_name(self.device),) * self.arch.num_layers

    @property
    def devices(self) -> tuple[torch.device, ...]:
        """Every device the model computes on, the input device first, each once."""
        return tuple(dict.fromkeys((self.device, *self.layer_devices)))

    @property
    def split(self) -> bool:
        """Whether the layers form several placement groups (a device map placed them)."""
        return len(set(self.layer_groups)) > 1

    def placement(self) -> str:
        """Where the model runs, in words: its device, or for a split model its :attr:`device_kind`."""
        return self.device_kind if self.split else device_name(self.device)

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
        name (timings and rounding differ between GPU models). A model split by a device map names each placement
        group in order with its number of layers (``GPU 0 (NVIDIA H100 80GB HBM3): 16 layers + GPU 1 (...): 16
        layers``, ``cpu: 2 layers + disk: 2 layers`` for weights waiting on the CPU and the disk), since where the
        groups split the layers changes what the local eviction scope keeps."""
        if not self.split:
            return _kind_of(self.device)
        layers = dict.fromkeys(self.layer_groups, 0)
        for group in self.layer_groups:
            layers[group] += 1
        return " + ".join(
            f"{_group_kind(group)}: {count} layer{'s' if count > 1 else ''}" for group, count in layers.items()
        )

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
    return chunks_sha256(
        part
        for name, tensor in sorted(model.state_dict().items())
        for part in (
            f"{name} {tuple(tensor.shape)} {tensor.dtype}\n".encode(),
            tensor.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes(),
        )
    )


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
    return text_sha256(core + json.dumps(extra, sort_keys=True, default=str))


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


def _kind_of(device: torch.device) -> str:
    """One device's kind as stored with runs: ``cuda (<GPU name>)`` for a GPU, else the device type."""
    if device.type == "cuda":
        return f"cuda ({torch.cuda.get_device_name(device)})"
    return device.type


def _group_kind(group: str) -> str:
    """A placement group in words: ``GPU <index> (<GPU name>)``, else its name (``cpu``, ``disk``)."""
    if not group.isdigit():
        return group
    return f"GPU {group} ({torch.cuda.get_device_name(int(group))})"


def device_name(device: torch.device) -> str:
    """A device as results name it: a GPU with its index (``cuda:0``, also for the current GPU named ``cuda``), else
    its type."""
    if device.type == "cuda" and device.index is None:
        return f"cuda:{torch.cuda.current_device()}"
    return str(device)


def group_name(device: torch.device) -> str:
    """The placement group of a model on one device, named as a device map names it: a GPU by its index, else the
    device type."""
    return device_name(device).removeprefix("cuda:")


def parse_device_map(value: str | Mapping[str, Any]) -> DeviceMap:
    """A device map as a user gives it: ``auto``, ``balanced`` or ``sequential``; a JSON object mapping module names
    to devices, inline or in a file; or such a mapping. Each device is checked here: a GPU index (or ``cuda:N``) this
    machine has, ``cpu`` or ``disk``."""
    if isinstance(value, Mapping):
        return _checked_entries(value)
    text = value.strip()
    if text.lower() in DEVICE_MAP_STRATEGIES:
        return text.lower()
    if not text.startswith(("{", "[")):
        path = local_model_path(text)
        if path is None or not path.is_file():
            raise KvlabError(
                f"Unknown device map {text[:60]!r}; use {', '.join(DEVICE_MAP_STRATEGIES)}, or a JSON file or object "
                "mapping module names to devices."
            )
        text = files.read_text(path, "device map", limit=DEVICE_MAP_BYTES)
    try:
        mapping = json.loads(text)
    except json.JSONDecodeError as error:
        raise KvlabError(f"The device map is not valid JSON ({error.msg} at character {error.pos}).") from None
    except RecursionError:
        raise KvlabError("The device map is nested too deeply to be a device map.") from None
    if not isinstance(mapping, dict) or not mapping:
        raise KvlabError(
            'A device map is a JSON object mapping module names to devices, like {"model.layers.0": 0, '
            '"model.layers.1": "cpu"}.'
        )
    return _checked_entries(mapping)


def _checked_entries(mapping: Mapping[str, Any]) -> dict[str, DeviceEntry]:
    """A mapping's entries with each device written as accelerate takes it (a GPU index, ``cpu``, ``disk``), every
    GPU one this machine has."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    checked: dict[str, DeviceEntry] = {}
    for number, (module, device) in enumerate(mapping.items(), start=1):
        entry = _device_entry(device)
        # the sentences name the entry by its number, never by its text: a map read from a file is not echoed
        if entry is None or not isinstance(module, str):
            raise KvlabError(
                f"Entry {number} of the device map does not name a device; a device is a GPU index, cuda:N, cpu or "
                "disk."
            )
        if isinstance(entry, int) and entry >= gpus:
            have = "no GPU" if gpus == 0 else f"{gpus} GPU{'s' if gpus > 1 else ''} (0 to {gpus - 1})"
            raise KvlabError(
                f"Entry {number} of the device map puts a module on GPU {entry}, but this machine has {have}."
            )
        checked[module] = entry
    return checked


def _device_entry(device: Any) -> DeviceEntry | None:
    """A device map's value as accelerate takes it, or ``None`` for one that names no device."""
    if isinstance(device, int) and not isinstance(device, bool):
        return device if device >= 0 else None
    if isinstance(device, torch.device):
        device = str(device)
    if not isinstance(device, str):
        return None
    text = device.strip().lower()
    if text in ("cpu", "disk"):
        return text
    if text.isdigit():
        return int(text)
    match = _DEVICE.match(text)
    return int(match.group(2) or 0) if match is not None and match.group(1) == "cuda" else None


def resolve_device_map(model: Any, device_map: DeviceMap) -> dict[str, DeviceEntry]:
    """Where each module of ``model`` goes: the one placement rule of :func:`load_model` (on the model's skeleton,
    before its weights are read) and :func:`place_model` (on a model built in memory).

    A strategy is inferred as transformers infers it for ``from_pretrained(device_map=...)``: accelerate's
    ``infer_auto_device_map`` over the memory of each device, balanced over the GPUs (``get_balanced_memory``) unless
    ``sequential``, decoder layers never split; without a GPU everything goes to the CPU. An explicit map must name
    modules of the model and give every weight a device."""
    from accelerate.utils import get_balanced_memory, get_max_memory, infer_auto_device_map

    if isinstance(device_map, str):
        no_split = getattr(model, "_no_split_modules", None)
        no_split = list(no_split) if no_split else None
        memory = (
            get_max_memory()
            if device_map == "sequential"
            else get_balanced_memory(model, no_split_module_classes=no_split)
        )
        inferred = infer_auto_device_map(model, max_memory=memory, no_split_module_classes=no_split)
        return {name: entry for name, device in inferred.items() if (entry := _device_entry(device)) is not None}
    modules = dict(model.named_modules())
    unknown = [number for number, name in enumerate(device_map, start=1) if name and name not in modules]
    if unknown:  # named by its number, not its text: a map read from a file is not echoed
        raise KvlabError(
            f"Entry {unknown[0]} of the device map names no module of this model (its decoder layers are named like "
            f"{_layer_names(model)[0]!r})."
        )
    uncovered = [
        tensor
        for tensor in model.state_dict()
        if not any(not name or tensor == name or tensor.startswith(name + ".") for name in device_map)
    ]
    if uncovered:
        more = f" and {len(uncovered) - 1} more" if len(uncovered) > 1 else ""
        raise KvlabError(f"The device map gives no device to {uncovered[0]!r}{more}; name a module that holds it.")
    return dict(device_map)


def place_model(model: Any, device_map: str | Mapping[str, Any], offload_folder: str | Path | None = None) -> Any:
    """Place a model built in memory by a device map (:func:`resolve_device_map`, then accelerate's
    ``dispatch_model``), as :func:`load_model` places a checkpoint; weights mapped to the disk are written to
    ``offload_folder`` (a temporary directory when none is given). Returns the model, ready for :func:`wrap_model`."""
    from accelerate import dispatch_model

    resolved = resolve_device_map(model, parse_device_map(device_map))
    try:
        return dispatch_model(
            model,
            resolved,
            offload_dir=_offload_folder(resolved, offload_folder),
            skip_keys=getattr(model, "_skip_keys_device_placement", None),
        )
    except torch.OutOfMemoryError:
        raise KvlabError("The model does not fit the memory its device map gives it; try balanced or auto.") from None


def _offload_folder(device_map: Mapping[str, DeviceEntry], folder: str | Path | None) -> str | None:
    """Where the weights a map puts on the disk are kept: ``folder``, or a temporary directory removed when the
    process ends; ``None`` when the map puts nothing there."""
    if "disk" not in device_map.values():
        return None
    if folder is not None:
        return str(folder)
    made = tempfile.mkdtemp(prefix="kvlab-offload-")
    atexit.register(shutil.rmtree, made, ignore_errors=True)
    return made


def _layer_names(model: Any) -> list[str]:
    """The module names of the decoder layers, in order: the longest ``ModuleList`` of the model whose name ends in
    ``layers`` (``model.layers``)."""
    lists = [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.ModuleList) and name.split(".")[-1] == "layers"
    ]
    if not lists:
        return []
    name, layers = max(lists, key=lambda item: len(item[1]))
    return [f"{name}.{index}" for index in range(len(layers))]


def _execution_device(module: torch.nn.Module) -> torch.device | None:
    """Where a module computes: the execution device of accelerate's hook on it or on a submodule (weights on the
    CPU or the disk are brought there for each forward), else the device of its first weight not on the meta
    device."""
    for submodule in module.modules():
        device = _hook_device(getattr(submodule, "_hf_hook", None))
        if device is not None:
            return device
    for tensor in _tensors(module):
        if tensor.device.type != "meta":
            return tensor.device
    return None


def _tensors(module: torch.nn.Module) -> Iterator[torch.Tensor]:
    yield from module.parameters()
    yield from module.buffers()


def _hook_device(hook: Any) -> torch.device | None:
    """The execution device of an accelerate hook (or of the first hook of a chain that has one)."""
    if hook is None:
        return None
    for inner in getattr(hook, "hooks", ()):
        device = _hook_device(inner)
        if device is not None:
            return device
    device = getattr(hook, "execution_device", None)
    if device is None:
        return None
    return torch.device("cuda", device) if isinstance(device, int) else torch.device(device)


def _placement(
    model: Any, num_layers: int, fallback: torch.device
) -> tuple[torch.device, tuple[torch.device, ...], tuple[str, ...]]:
    """Where a model placed by a device map (``model.hf_device_map``) runs: the input device, and each decoder
    layer's device and placement group (its entry in the map, the longest module name that contains it). A model no
    map placed runs on ``fallback`` (nothing per layer: one group, :class:`LoadedModel` fills it in)."""
    device_map = getattr(model, "hf_device_map", None)
    names = _layer_names(model)
    if not device_map or len(names) != num_layers:
        return fallback, (), ()
    embedding = model.get_input_embeddings()
    device = (_execution_device(embedding) if embedding is not None else None) or fallback
    modules = dict(model.named_modules())
    devices = tuple(_execution_device(modules[name]) or device for name in names)
    if len(set(map(str, device_map.values()))) == 1:
        return device, devices, tuple(group_name(layer_device) for layer_device in devices)
    groups = []
    for name in names:
        entry = max(
            (key for key in device_map if not key or name == key or name.startswith(key + ".")), key=len, default=""
        )
        groups.append(_group_of_entry(device_map.get(entry, device)))
    return device, devices, tuple(groups)


def _group_of_entry(device: Any) -> str:
    """A device map's value as a placement group's name: a GPU by its index (``"0"``), else ``cpu`` or ``disk``."""
    entry = _device_entry(device)
    return str(entry) if entry is not None else str(device)


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
    device_map: str | Mapping[str, Any] | None = None,
    offload_folder: str | Path | None = None,
) -> LoadedModel:
    """Load a decoder-only causal LM by hub id, local directory or GGUF file, ready for the engine.

    ``device_map`` splits it over devices instead of putting it on ``device`` (:func:`parse_device_map`,
    :func:`resolve_device_map`); weights a map puts on the disk are kept in ``offload_folder`` (a temporary
    directory when none is given; a safetensors checkpoint is read in place).

    ``gguf_file`` names a GGUF file inside the directory or hub repository ``name``; a GGUF file can also be named
    directly (``path/to/model.gguf`` or ``owner/repo/model.gguf``), and a shipped or installed model by its label
    (:func:`kvlab.models.catalog.installed_name`). It is dequantised once and cached (:mod:`kvlab.models.gguf`).
    ``trust_remote_code`` stays off unless the caller switches it on explicitly: loading a hub model must never run code
    from the hub by surprise.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    name = installed_name(gguf.with_gguf_file(default_model() if name is None else name, gguf_file))
    if not name.strip():
        raise NotAModel("No model was named; give a hub id, a local model directory or a GGUF file.")
    if device_map is not None and device is not None:
        raise KvlabError("Give a device or a device map, not both: a device map places every layer itself.")
    map_spec = parse_device_map(device_map) if device_map is not None else None
    torch_device = pick_device(device) if map_spec is None else _map_device(map_spec)
    torch_dtype = pick_dtype(torch_device, dtype)
    shown = shown_name(name)
    if gguf.is_gguf_name(name):
        gguf_path = gguf.locate(assembled(name))
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
    try:
        tokenizer = AutoTokenizer.from_pretrained(
            source_dir, trust_remote_code=trust_remote_code, local_files_only=cache_only
        )
    except Exception as error:  # tokenizers, sentencepiece and transformers raise many kinds for one cause
        _LOGGER.info("tokenizer of %s failed to load", name, exc_info=True)
        raise KvlabError(f"Could not load the tokenizer of {shown}: {_first_line(error)}") from None
    special = {key: value for key, value in tokenizer.special_tokens_map.items() if isinstance(value, str)}
    check_chat_template(getattr(tokenizer, "chat_template", None), special, shown)  # before the weights load
    placement: dict[str, Any] = {}
    if map_spec is not None:
        resolved = resolve_device_map(_skeleton(config, torch_dtype, trust_remote_code), map_spec)
        placement = {"device_map": resolved, "offload_folder": _offload_folder(resolved, offload_folder)}
    try:
        model: Any = AutoModelForCausalLM.from_pretrained(
            source_dir,
            dtype=torch_dtype,
            attn_implementation=LOADED_ATTENTION,
            trust_remote_code=trust_remote_code,
            local_files_only=cache_only,
            **placement,
        )
        if map_spec is None:
            model.to(torch_device)
    except torch.OutOfMemoryError:
        where = torch_device if map_spec is None else "the devices of its device map"
        raise KvlabError(f"{shown} does not fit in the memory of {where}; try a smaller model or dtype.") from None
    except Exception as error:  # a truncated or damaged weights file raises safetensors' own error type
        _LOGGER.info("weights of %s failed to load", name, exc_info=True)
        raise KvlabError(f"Could not load the weights of {shown}: {_first_line(error)}") from None
    model.eval()
    _check_finite(model, shown)
    input_device, layer_devices, layer_groups = _placement(model, arch.num_layers, torch_device)
    return LoadedModel(
        name=name,
        model=model,
        tokenizer=tokenizer,
        arch=arch,
        device=input_device,
        dtype=torch_dtype,
        cache_kwarg=_cache_kwarg(model),
        source=source,
        layer_devices=layer_devices,
        layer_groups=layer_groups,
    )


def _check_finite(model: Any, shown: str) -> None:
    """Refuse weights that hold NaN or infinity (a damaged or wrongly dequantised checkpoint would otherwise generate
    garbage silently). Every tensor is checked where it lies; weights a device map left on the disk are not read."""
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if parameter.device.type == "meta" or not parameter.is_floating_point():
                continue
            # in slices, so that the check never holds a mask as large as the embedding
            if not all(bool(torch.isfinite(part).all()) for part in parameter.detach().reshape(-1).split(1 << 24)):
                raise KvlabError(f"The weights of {shown} hold NaN or infinite values (in {name}); they are damaged.")


def _map_device(device_map: DeviceMap) -> torch.device:
    """The kind of device a map computes on, for the dtype's default: CUDA when it names a GPU (a strategy does
    where there is one), else the CPU."""
    if isinstance(device_map, str):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    gpu = any(isinstance(entry, int) for entry in device_map.values())
    return torch.device("cuda" if gpu else "cpu")


def _skeleton(config: Any, dtype: torch.dtype, trust_remote_code: bool) -> Any:
    """The model of ``config`` without weights (on the meta device), whose module sizes a device map is inferred
    from before anything is read; its tied weights tied, so that a map keeps them on one device, as the loaded model
    holds them."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with init_empty_weights():
        skeleton = AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=trust_remote_code)
    skeleton.tie_weights()  # outside: tying inside init_empty_weights leaves two meta tensors
    return skeleton


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
    model.eval()
    parameter = next(model.parameters())
    arch = arch_from_config(model.config)
    device, layer_devices, layer_groups = _placement(model, arch.num_layers, parameter.device)
    return LoadedModel(
        name=name,
        model=model,
        tokenizer=tokenizer,
        arch=arch,
        device=device,
        dtype=parameter.dtype,
        cache_kwarg=_cache_kwarg(model),
        source=ModelSource(label=name, origin="built in memory"),
        layer_devices=layer_devices,
        layer_groups=layer_groups,
    )
