"""A config can only lower kvlab's bounds, never lift them: position limits, structural counts and normalisation
epsilons outside sane ranges are one sentence, before anything is allocated from them; weights holding NaN are
refused once loaded."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_models import save_tiny_checkpoint

from kvlab.costs import MODEL_PRESETS
from kvlab.errors import KvlabError
from kvlab.models.arch import MOST_POSITIONS, arch_from_config
from kvlab.models.loading import load_model

LLAMA = {**MODEL_PRESETS["Llama-3-8B"].config, "rms_norm_eps": 1e-5}


def test_a_sane_config_reads_as_it_is():
    arch = arch_from_config(LLAMA, derive=False)
    assert (arch.num_layers, arch.num_kv_heads, arch.head_dim, arch.max_positions) == (32, 8, 128, 8192)
    assert arch_from_config({**LLAMA, "max_position_embeddings": None}, derive=False).max_positions is None


@pytest.mark.parametrize(
    ("field", "value", "sentence"),
    [
        ("max_position_embeddings", 0, "position limit \\(0\\)"),
        ("max_position_embeddings", -5, "position limit \\(-5\\)"),
        ("max_position_embeddings", 2**62, "not a whole number from 1 to"),
        ("max_position_embeddings", MOST_POSITIONS + 1, "not a whole number from 1 to"),
        ("max_position_embeddings", 4096.5, "position limit"),
        ("num_hidden_layers", 0, "num_layers \\(0\\)"),
        ("num_hidden_layers", 100_000, "num_layers \\(100000\\) is not a whole number from 1 to 1,024"),
        ("num_attention_heads", -1, "num_attention_heads"),
        ("num_key_value_heads", 0, "num_key_value_heads"),
        ("hidden_size", "4096", "hidden_size"),
        ("vocab_size", 10**12, "vocab_size \\(1000000000000\\) is not a whole number from 1 to 4,194,304"),
        ("rms_norm_eps", math.nan, "epsilon \\(nan\\) is not a finite positive number"),
        ("rms_norm_eps", 0.0, "epsilon"),
    ],
)
def test_a_config_outside_sane_ranges_is_one_sentence(field, value, sentence):
    with pytest.raises(KvlabError, match=sentence):
        arch_from_config({**LLAMA, field: value}, derive=False)


def test_a_checkpoint_whose_config_lifts_the_position_bound_is_refused_before_its_weights_load(tmp_path):
    directory = save_tiny_checkpoint(tmp_path / "model")
    config_path = tmp_path / "model" / "config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "max_position_embeddings": 0}))
    (tmp_path / "model" / "model.safetensors").write_bytes(b"not weights: never read")
    with pytest.raises(KvlabError, match="position limit"):
        load_model(directory)


def test_weights_holding_nan_are_refused_in_one_sentence(tmp_path):
    directory = save_tiny_checkpoint(tmp_path / "model")
    weights_path = tmp_path / "model" / "model.safetensors"
    weights = load_file(weights_path)
    name = sorted(weights)[-1]
    weights[name] = torch.full_like(weights[name], float("nan"))
    save_file(weights, weights_path, metadata={"format": "pt"})
    with pytest.raises(KvlabError, match=f"hold NaN or infinite values \\(in {name}\\); they are damaged"):
        load_model(directory)
