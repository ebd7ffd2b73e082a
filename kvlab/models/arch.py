"""Architecture facts of a decoder-only transformer, read from its Hugging Face config.

The engine needs them to shape the cache, the cost calculator to price it, and the dashboard to label it. They are
read from the config alone (no weights), so a pasted ``config.json`` or a hub config is enough.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping

from kvlab.errors import KvlabError

#: Bytes per element of the dtypes models run in, by name (the cost calculator prices configs without torch).
DTYPE_BYTES: dict[str, int] = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}


def dtype_name(dtype: object) -> str:
    """A dtype as stored with runs and written in configs: ``bfloat16`` for ``torch.bfloat16`` or ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


#: The most positions a config may state: 128M tokens, far beyond any released model, far below an overflow.
MOST_POSITIONS = 1 << 27
#: The largest structural counts a config may state, far beyond any released model.
MOST = {
    "num_layers": 1024,
    "num_attention_heads": 1024,
    "num_key_value_heads": 1024,
    "hidden_size": 1 << 17,
    "head_dim": 4096,
    "vocab_size": 1 << 22,
}


@dataclass(frozen=True)
class ArchFacts:
    """What shapes the KV cache of one model.

    ``sliding_layers`` lists the layers whose attention only looks back ``sliding_window`` tokens; a full cache keeps
    at most ``sliding_window - 1`` past tokens there. ``kv_lora_rank`` is set for multi-head latent attention
    (DeepSeek-V2/V3), whose cache holds one compressed latent plus a shared RoPE key per token instead of per-head
    K and V. ``max_positions`` is the longest sequence the model was made for (``max_position_embeddings``), when
    its config states one.
    """

    model_type: str
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    dtype_bytes: int
    sliding_window: int | None = None
    sliding_layers: tuple[int, ...] = field(default_factory=tuple)
    kv_lora_rank: int | None = None
    qk_rope_head_dim: int | None = None
    max_positions: int | None = None

    @property
    def uses_mla(self) -> bool:
        """Whether the cache is a multi-head latent attention cache (one latent per token, not per head)."""
        return self.kv_lora_rank is not None

    def is_sliding(self, layer: int) -> bool:
        """Whether ``layer`` uses sliding-window attention."""
        return layer in self.sliding_layers


def _text_config(config: Any) -> Any:
    """Multimodal configs keep the language model's facts in a nested text config."""
    get_text_config = getattr(config, "get_text_config", None)
    if callable(get_text_config):
        return get_text_config()
    return config


def _get(config: Any, *names: str, default: Any = None) -> Any:
    """The first of ``names`` that the config (an object or a mapping) defines and that is not None."""
    for name in names:
        value = config.get(name) if isinstance(config, Mapping) else getattr(config, name, None)
        if value is not None:
            return value
    return default


def _dtype_bytes(config: Any) -> int:
    names = ("dtype", "torch_dtype") if isinstance(config, Mapping) else ("dtype",)
    return DTYPE_BYTES.get(dtype_name(_get(config, *names, default="float32")), 2)


def _sliding_layers(config: Any, num_layers: int) -> tuple[int | None, tuple[int, ...]]:
    window = _get(config, "sliding_window")
    if window is None or _get(config, "use_sliding_window") is False:
        return None, ()
    layer_types = _get(config, "layer_types")
    if layer_types:
        layers = tuple(i for i, kind in enumerate(layer_types) if kind == "sliding_attention")
        return (int(window), layers) if layers else (None, ())
    max_window_layers = _get(config, "max_window_layers")
    if max_window_layers is not None and _get(config, "model_type") in {"qwen2", "qwen2_moe", "qwen3"}:
        layers = tuple(range(int(max_window_layers), num_layers))
        return (int(window), layers) if layers else (None, ())
    return int(window), tuple(range(num_layers))


def _config_object(mapping: Mapping[str, Any]) -> Any:
    """A ``config.json`` mapping as transformers' own config class when it knows the model type, so that derived
    fields (Gemma's alternating ``layer_types``, a multimodal model's nested text config) come out exactly as the
    model would see them; the raw mapping otherwise."""
    from transformers import AutoConfig

    model_type = mapping.get("model_type")
    if not model_type:
        return mapping
    try:
        return AutoConfig.for_model(model_type, **{k: v for k, v in mapping.items() if k != "model_type"})
    except (ValueError, TypeError, KeyError):
        return mapping


def arch_from_config(config: Any, *, derive: bool = True) -> ArchFacts:
    """Read the architecture facts from a transformers config object or a ``config.json`` mapping.

    ``derive=False`` reads a mapping exactly as written, without transformers' derived fields and so without
    importing transformers (which imports torch): for mappings that spell out every field, such as the cost
    presets the claims are computed from.
    """
    if isinstance(config, Mapping) and derive:
        config = _config_object(config)
    text = config if isinstance(config, Mapping) else _text_config(config)
    num_layers = _get(text, "num_hidden_layers", "n_layer", "num_layers")
    num_q_heads = _get(text, "num_attention_heads", "n_head", "num_heads")
    hidden = _get(text, "hidden_size", "n_embd", "d_model")
    if num_layers is None or num_q_heads is None or hidden is None:
        raise KvlabError(
            "The config does not describe a decoder-only transformer: it lacks the number of layers, "
            "attention heads or hidden size."
        )
    num_kv_heads = _get(text, "num_key_value_heads", "num_kv_heads", "n_head_kv", default=num_q_heads)
    _check_counts(num_layers=num_layers, num_attention_heads=num_q_heads, hidden_size=hidden)
    vocabulary = _get(text, "vocab_size", "n_vocab")
    if vocabulary is not None:
        _check_counts(vocab_size=vocabulary)
    _check_counts(num_key_value_heads=num_kv_heads)
    head_dim = _get(text, "head_dim", default=int(hidden) // int(num_q_heads))
    _check_counts(head_dim=head_dim)
    _check_norm(text)
    window, sliding = _sliding_layers(text, int(num_layers))
    return ArchFacts(
        model_type=str(_get(text, "model_type", default="unknown")),
        num_layers=int(num_layers),
        num_q_heads=int(num_q_heads),
        num_kv_heads=int(num_kv_heads),
        head_dim=int(head_dim),
        dtype_bytes=_dtype_bytes(text),
        sliding_window=window,
        sliding_layers=sliding,
        kv_lora_rank=_get(text, "kv_lora_rank"),
        qk_rope_head_dim=_get(text, "qk_rope_head_dim"),
        max_positions=_positions(text),
    )


def _positions(config: Any) -> int | None:
    """The model's position limit where its config states one. A config can only lower kvlab's bounds, never lift
    them: a stated limit that is not a whole number from 1 to :data:`MOST_POSITIONS` is one sentence, not "no
    limit"."""
    value = _get(config, "max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MOST_POSITIONS:
        raise KvlabError(
            f"The config's position limit ({str(value)[:40]}) is not a whole number from 1 to {MOST_POSITIONS:,}; "
            "kvlab does not run a model without a sane position limit."
        )
    return value


def _check_counts(**counts: Any) -> None:
    """Each of the config's structural counts is a whole number within :data:`MOST`, checked before anything is
    allocated from it (a config of 100,000 layers would load for minutes first)."""
    for name, value in counts.items():
        most = MOST[name]
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= most:
            raise KvlabError(f"The config's {name} ({str(value)[:40]}) is not a whole number from 1 to {most:,}.")


def _check_norm(config: Any) -> None:
    """A normalisation epsilon, where the config states one, is a finite positive number (NaN would make every
    output NaN, silently)."""
    eps = _get(config, "rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon")
    if eps is None:
        return
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps <= 0:
        raise KvlabError(f"The config's normalisation epsilon ({str(eps)[:40]}) is not a finite positive number.")
