"""Loading models and reading their architecture facts: clear sentences for everything a user can get wrong."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import Gemma2Config, LlamaConfig, MistralConfig, Qwen2Config

from kvlab.engine.generation import generate
from kvlab.engine.spec import RunSpec
from kvlab.errors import KvlabError
from kvlab.models.arch import arch_from_config
from kvlab.models.loading import load_model
from kvlab.policies import make_policy


def test_loads_a_local_checkpoint_on_cpu_in_fp32_without_remote_code(checkpoint):
    loaded = load_model(checkpoint)
    assert loaded.device.type == "cpu"
    assert loaded.dtype == torch.float32
    assert next(loaded.model.parameters()).dtype == torch.float32
    assert loaded.model.config._attn_implementation == "sdpa"  # a run switches it to kvlab's attention
    generate(loaded, torch.tensor([[5, 6, 7]]), RunSpec(make_policy("full"), max_new_tokens=1))
    assert loaded.model.config._attn_implementation == "kvlab"
    assert loaded.arch.num_layers == 3 and loaded.arch.num_kv_heads == 2 and loaded.arch.head_dim == 16


def test_dtype_can_be_asked_for(checkpoint):
    assert load_model(checkpoint, dtype="bf16").dtype == torch.bfloat16
    with pytest.raises(KvlabError, match="Unknown dtype"):
        load_model(checkpoint, dtype="float8")


def write_config(directory: Path, config: dict) -> str:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config), encoding="utf-8")
    return str(directory)


@pytest.mark.parametrize(
    "config,message",
    [
        (
            {
                "model_type": "bert",
                "architectures": ["BertForMaskedLM"],
                "hidden_size": 32,
                "num_hidden_layers": 2,
                "num_attention_heads": 2,
                "intermediate_size": 37,
                "vocab_size": 99,
            },
            "without a causal language-model head",
        ),
        (
            {
                "model_type": "t5",
                "is_encoder_decoder": True,
                "d_model": 32,
                "num_layers": 2,
                "num_heads": 2,
                "vocab_size": 99,
            },
            "encoder-decoder",
        ),
        ({"model_type": "mysterious", "auto_map": {"AutoConfig": "cfg.MyConfig"}}, "trust_remote_code"),
    ],
)
def test_models_that_cannot_run_are_refused_in_one_sentence(tmp_path, config, message):
    with pytest.raises(KvlabError, match=message):
        load_model(write_config(tmp_path / "model", config))


def test_missing_paths_are_named(tmp_path):
    with pytest.raises(KvlabError, match="No model directory"):
        load_model(str(tmp_path / "does" / "not" / "exist"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(KvlabError, match="has no config.json"):
        load_model(str(tmp_path / "empty"))


COMMON = dict(
    hidden_size=256,
    num_hidden_layers=6,
    num_attention_heads=8,
    num_key_value_heads=2,
    intermediate_size=64,
    vocab_size=10,
)


@pytest.mark.parametrize(
    "config,sliding_window,sliding_layers",
    [
        (LlamaConfig(**COMMON), None, ()),
        (MistralConfig(**COMMON, sliding_window=4096), 4096, tuple(range(6))),
        (MistralConfig(**COMMON, sliding_window=None), None, ()),
        (Qwen2Config(**COMMON, use_sliding_window=True, sliding_window=1024, max_window_layers=4), 1024, (4, 5)),
        (Qwen2Config(**COMMON, use_sliding_window=False, sliding_window=1024), None, ()),
        (Gemma2Config(**COMMON, head_dim=32, sliding_window=512), 512, (0, 2, 4)),
    ],
)
def test_architecture_facts_come_from_the_config(config, sliding_window, sliding_layers):
    arch = arch_from_config(config)
    assert (arch.num_layers, arch.num_q_heads, arch.num_kv_heads) == (6, 8, 2)
    assert arch.head_dim == 32
    assert arch.sliding_window == sliding_window
    assert arch.sliding_layers == sliding_layers
    assert arch_from_config(config.to_dict()) == arch


def test_a_config_that_is_not_a_transformer_is_refused():
    with pytest.raises(KvlabError, match="decoder-only transformer"):
        arch_from_config({"model_type": "resnet", "num_channels": 3})


def test_tokenizer_identity_ignores_a_calls_truncation_settings(checkpoint):
    from transformers import AutoTokenizer

    from kvlab.models.loading import tokenizer_hash

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    before = tokenizer_hash(tokenizer)
    tokenizer("some text to cut short", truncation=True, max_length=2)  # sets the backend's truncation for good
    assert tokenizer.backend_tokenizer.truncation is not None
    assert tokenizer_hash(tokenizer) == before
