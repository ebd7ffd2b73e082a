"""The shipped model's architecture, and its export as a plain Hugging Face model directory.

A Llama (RoPE, RMSNorm, SwiGLU) with grouped-query attention: 6 query heads share 2 key/value heads, so the KV cache
is a third of the multi-head one, as in the models kvlab is meant to study. The shape was chosen by measurement:
10 layers of width 384 with a tied 8192-entry embedding is 18.9M parameters, 38 MB in bf16 (under the 40 MB
limit), and a 4096-token forward pass takes about 2.5 s on a 2-core CPU (``bench/cpu_forward.py``).
"""

from __future__ import annotations

import copy
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


@dataclass(frozen=True)
class ModelShape:
    """The architecture hyper-parameters; ``max_positions`` is the training sequence length."""

    vocab_size: int = 8192
    hidden_size: int = 384
    num_layers: int = 10
    num_heads: int = 6
    num_kv_heads: int = 2
    head_dim: int = 64
    intermediate_size: int = 1024
    max_positions: int = 4608
    rope_theta: float = 10000.0


TINY_SHAPE = ModelShape(
    vocab_size=512,
    hidden_size=64,
    num_layers=2,
    num_heads=2,
    num_kv_heads=1,
    head_dim=32,
    intermediate_size=128,
    max_positions=512,
)


def llama_config(shape: ModelShape, tokenizer: Any) -> Any:
    """A ``LlamaConfig`` for ``shape`` whose special-token ids are the tokenizer's."""
    from transformers import LlamaConfig

    config = LlamaConfig(
        vocab_size=shape.vocab_size,
        hidden_size=shape.hidden_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
        intermediate_size=shape.intermediate_size,
        max_position_embeddings=shape.max_positions,
        rope_parameters={"rope_type": "default", "rope_theta": shape.rope_theta},
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    config._attn_implementation = "sdpa"
    return config


def new_model(shape: ModelShape, tokenizer: Any, seed: int) -> Any:
    """A freshly initialised ``LlamaForCausalLM`` (seeded) in float32."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(llama_config(shape, tokenizer))


def shape_dict(shape: ModelShape) -> dict[str, Any]:
    """The shape as a JSON-ready dict."""
    return asdict(shape)


def export(model: Any, tokenizer_dir: Path, out_dir: Path) -> Path:
    """Save a bf16 copy of ``model`` (the float32 training weights stay as they are) as one ``model.safetensors``,
    with its config and the tokenizer files."""
    out_dir.mkdir(parents=True, exist_ok=True)
    copy.deepcopy(model).to(torch.bfloat16).save_pretrained(out_dir, safe_serialization=True, max_shard_size="200MB")
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).exists():
            shutil.copy2(tokenizer_dir / name, out_dir / name)
    return out_dir / "model.safetensors"
