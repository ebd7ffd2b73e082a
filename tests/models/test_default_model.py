"""The shipped default model loads offline and finds a needle at 1k context with its full cache."""

from __future__ import annotations

import json
import random

import pytest
import torch

from kvlab.models.loading import DEFAULT_MODEL_DIR as DEFAULT_MODEL
from kvlab.tasks.facts import TRAIN_TEMPLATES, make_fact
from kvlab.tasks.needle import build_needle, load_haystacks, score


@pytest.fixture(scope="module")
def transformers_model():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL, dtype=torch.float32, local_files_only=True)
    return model.eval(), AutoTokenizer.from_pretrained(DEFAULT_MODEL, local_files_only=True)


def test_shipped_files_and_size():
    assert (DEFAULT_MODEL / "model.safetensors").stat().st_size <= 40_000_000
    config = json.loads((DEFAULT_MODEL / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["num_key_value_heads"] < config["num_attention_heads"]
    assert config["max_position_embeddings"] >= 4608
    for name in ("tokenizer.json", "tokenizer_config.json", "README.md", "loss_curve.png", "eval.json"):
        assert (DEFAULT_MODEL / name).exists(), name


@pytest.mark.model
@pytest.mark.slow
def test_retrieves_a_needle_at_1k_with_the_full_cache(transformers_model):
    model, tokenizer = transformers_model
    haystacks = load_haystacks(tokenizer)
    rng = random.Random(2024)
    hits = 0
    for depth in (0.25, 0.75):
        fact = make_fact(TRAIN_TEMPLATES[0], rng)
        item = build_needle(tokenizer, haystacks[0], 1024, depth, fact, rng=rng)
        context, question = item.prompt_ids()
        with torch.inference_mode():
            out = model.generate(
                torch.cat([context, question], dim=1),
                max_new_tokens=12,
                do_sample=False,
                pad_token_id=tokenizer.pad_token_id,
            )
        text = tokenizer.decode(out[0, context.shape[1] + question.shape[1] :], skip_special_tokens=True)
        hits += score(text, item.answer).exact
    assert hits == 2


@pytest.mark.model
@pytest.mark.slow
@pytest.mark.long
def test_kvlab_finds_the_needle_with_the_full_cache_and_loses_it_when_the_middle_is_evicted(shipped):
    from kvlab.budget import Budget
    from kvlab.engine.generation import generate
    from kvlab.engine.spec import RunSpec
    from kvlab.policies import make_policy
    from kvlab.tasks.items import stop_token_ids

    loaded = shipped
    tokenizer = loaded.tokenizer
    rng = random.Random(7)
    item = build_needle(tokenizer, load_haystacks(tokenizer)[1], 1024, 0.5, make_fact(TRAIN_TEMPLATES[2], rng), rng=rng)
    ids = torch.tensor([item.context_ids + item.question_ids])
    stops = stop_token_ids(tokenizer, (tokenizer.eos_token_id,))
    full = generate(loaded, ids, RunSpec(make_policy("full"), max_new_tokens=16, stop_token_ids=stops))
    assert score(full.texts[0], item.answer).exact
    window = generate(
        loaded,
        ids,
        RunSpec(
            make_policy("streaming"),
            Budget(tokens=128),
            mode="streaming",
            chunk=128,
            max_new_tokens=16,
            stop_token_ids=stops,
        ),
    )
    assert not score(window.texts[0], item.answer).contains
    assert window.peak_kv_bytes < full.peak_kv_bytes / 3
