"""The training pipeline end to end on a toy corpus: prepare, mix, train, resume, export, load."""

from __future__ import annotations

import json
import random
import re
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from training.loop import TrainSettings, lr_at, train
from training.mix import MixBuilder, MixSettings
from training.model import TINY_SHAPE
from training.prepare import prepare

PROSE = (
    "The river runs to the sea. A small boat waits by the shore! Does the keeper know? He does.\n"
    "def function_{i}(value):\n    return value * {i}\n\n"
)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("site")
    for i in range(60):
        (root / f"mod{i}.py").write_text(PROSE.format(i=i) * 20)
    work = tmp_path_factory.mktemp("work")
    prepare(work, max_bytes=10**7, vocab_size=400, tokenizer_bytes=10**6, max_length=512, roots=[root], workers=1)
    return work


@pytest.fixture(scope="module")
def tokenizer(workdir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(workdir / "tokenizer")


def test_prepare_records_the_corpus(workdir: Path):
    manifest = json.loads((workdir / "corpus.json").read_text())
    assert manifest["train"]["files"] + manifest["heldout"]["files"] == 60
    assert manifest["train"]["tokens"] == len(np.load(workdir / "train.npy"))
    assert manifest["haystack_contamination"]["found_in_training_text"] == 0
    assert manifest["excluded_path_parts"][0] == "pydoc_data"


def test_retrieval_sequences_answer_facts_stated_before(workdir: Path, tokenizer):
    builder = MixBuilder(np.load(workdir / "train.npy", mmap_mode="r"), tokenizer, MixSettings(seq_len=1500))
    rng = random.Random(0)
    questions = 0
    for _ in range(5):
        ids, mask = builder.retrieval(rng)
        assert ids.shape == mask.shape == (1501,) and ids[0] == tokenizer.bos_token_id
        text = tokenizer.decode(ids)
        matches = list(re.finditer(r"Question: What (?:is|are all) (.+?)\?\nAnswer: (.+)\n", text))
        for match in matches:
            subject, answer = match.groups()
            stated = text[: match.start()]
            for value in answer.split(", "):
                assert (
                    f"{subject[0].upper()}{subject[1:]} is {value}." in stated
                    or f"One of {subject} is {value}." in stated
                )
            questions += 1
        assert tokenizer.decode(ids[mask]).startswith("".join(f" {m.group(2)}\n" for m in matches))
    assert questions >= 5


def test_plain_sequences_have_no_answer_tokens(workdir: Path, tokenizer):
    builder = MixBuilder(np.load(workdir / "train.npy", mmap_mode="r"), tokenizer, MixSettings(seq_len=256))
    ids, mask = builder.plain(random.Random(1))
    assert ids.shape == (257,) and ids[0] == tokenizer.bos_token_id and not mask.any()


def test_lr_schedule_warms_up_then_decays():
    s = TrainSettings(lr=1.0, warmup_steps=10, min_lr_ratio=0.1)
    assert lr_at(0, 100, s) == pytest.approx(0.1) and lr_at(9, 100, s) == pytest.approx(1.0)
    assert lr_at(100, 100, s) == pytest.approx(0.1) and lr_at(55, 100, s) < lr_at(20, 100, s)


@pytest.mark.slow
def test_train_resume_and_export(workdir: Path, tmp_path: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    settings = TrainSettings(
        batch_size=2,
        max_steps=4,
        warmup_steps=2,
        checkpoint_every=2,
        log_every=1,
        eval_every=2,
        eval_batches=1,
        workers=0,
        compile=False,
    )
    shape = replace(TINY_SHAPE, max_positions=128)
    out = tmp_path / "model"
    train(workdir, out, shape, settings)
    first = torch.load(workdir / "checkpoint.pt", weights_only=False)["state"]
    assert first["step"] == 4
    summary = json.loads(train(workdir, out, shape, replace(settings, max_steps=6)).read_text())
    assert summary["steps"] == 6 and summary["tokens"] == 6 * 2 * 128
    log = [json.loads(line) for line in (workdir / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [1, 2, 3, 4, 5, 6] and "heldout_lm_loss" in log[1]
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.num_key_value_heads < model.config.num_attention_heads
    assert next(model.parameters()).dtype == torch.bfloat16
    tokenizer = AutoTokenizer.from_pretrained(out)
    ids = tokenizer("The river", return_tensors="pt")["input_ids"]
    assert ids[0, 0] == tokenizer.bos_token_id and model(ids).logits.shape[-1] == len(tokenizer)
