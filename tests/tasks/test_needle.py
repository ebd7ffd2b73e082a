"""Needle prompts: exact length, fact placement, question at the end, multi-key/value answers, scoring."""

from __future__ import annotations

import random

import numpy as np
import pytest

from kvlab.errors import KvlabError
from kvlab.tasks.facts import HELD_OUT_TEMPLATES, TRAIN_TEMPLATES, composed_template, make_fact
from kvlab.tasks.needle import (
    ANSWER_PREFIX,
    HAYSTACK_DIR,
    Haystack,
    Score,
    build_needle,
    insert_at_boundaries,
    load_haystacks,
    needle_suite,
    score,
)
from kvlab.tasks.ruler_score import recall
from training.tokenizer import save_tokenizer, train_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory):
    from transformers import AutoTokenizer

    texts = [p.read_text() for p in sorted(HAYSTACK_DIR.glob("*.txt"))]
    directory = tmp_path_factory.mktemp("tok")
    save_tokenizer(train_tokenizer(texts, 600), directory, 4608)
    return AutoTokenizer.from_pretrained(directory)


@pytest.fixture(scope="module")
def haystacks(tokenizer):
    return load_haystacks(tokenizer)


@pytest.mark.parametrize("length", [300, 1024, 2048, 4096])
@pytest.mark.parametrize("depth", [0.0, 0.37, 1.0])
def test_prompt_has_exact_length_and_fact_near_depth(tokenizer, haystacks, length, depth):
    rng = random.Random(length)
    fact = make_fact(TRAIN_TEMPLATES[0], rng)
    item = build_needle(tokenizer, haystacks[1], length, depth, fact, rng=rng)
    assert item.context_tokens == length == len(item.context_ids) + len(item.question_ids)
    assert item.context_ids[0] == tokenizer.bos_token_id
    assert fact.statements[0] in item.context
    assert item.question.endswith(ANSWER_PREFIX) and fact.question in item.question
    assert abs(item.depth - depth) < (0.1 if length >= 1024 else 0.25)  # sentences are ~30 tokens
    # The statement sits after a sentence end, not inside a word.
    before = item.context.split(fact.statements[0])[0]
    assert before == "" or before.rstrip(" ").endswith((".", "!", "?")) or before.endswith("\n") or depth == 0.0


def test_prompt_ids_match_tokenising_the_text(tokenizer, haystacks):
    rng = random.Random(7)
    for depth in (0.2, 0.5, 0.8):
        item = build_needle(tokenizer, haystacks[0], 1024, depth, make_fact(TRAIN_TEMPLATES[3], rng), rng=rng)
        retokenised = tokenizer(item.context + item.question)["input_ids"]
        assert retokenised == list(item.context_ids) + list(item.question_ids)
        context, question = item.prompt_ids()
        assert context.shape == (1, len(item.context_ids)) and question.shape == (1, len(item.question_ids))


def test_multi_value_answer_lists_values_in_order_of_appearance(tokenizer, haystacks):
    rng = random.Random(3)
    fact = make_fact(TRAIN_TEMPLATES[1], rng, num_values=3)
    item = build_needle(tokenizer, haystacks[2], 2048, 0.5, fact, rng=rng)
    positions = [item.context.index(f" is {v}.") for v in item.answer.split(", ")]
    assert sorted(item.answer.split(", ")) == sorted(fact.values) and positions == sorted(positions)
    assert item.kind == "multi-value" and "What are all" in item.question


def test_multi_key_suite_states_every_key(tokenizer, haystacks):
    items = needle_suite(
        tokenizer,
        haystacks,
        TRAIN_TEMPLATES[:2],
        lengths=[1024],
        depths=[0.5],
        per_depth=2,
        kind="multi-key",
        num_keys=3,
    )
    for item in items:
        assert item.kind == "multi-key" and item.num_facts == 3 and item.context_tokens == 1024
        assert item.context.count(" is ") >= 3


def test_too_long_a_prompt_is_a_user_error(tokenizer, haystacks):
    fact = make_fact(TRAIN_TEMPLATES[0], random.Random(0))
    with pytest.raises(KvlabError):
        build_needle(tokenizer, haystacks[0], 10**6, 0.5, fact)
    with pytest.raises(KvlabError):
        build_needle(tokenizer, haystacks[0], 1024, 1.5, fact)


def test_insert_at_boundaries_uses_nearest_boundary():
    window = np.arange(100, 120)
    out, positions = insert_at_boundaries(window, np.array([5, 12]), [([1, 2], 0.5), ([3], 0.0), ([4], 0.9)])
    assert positions == [12, 0, 12]
    assert out == [3] + list(range(100, 112)) + [1, 2, 4] + list(range(112, 120))


def test_score_exact_and_contains():
    assert score(" 4821903\nQuestion: ...", "4821903") == score(" 4821903", "4821903")
    assert score(" 4821903\n", "4821903").exact
    assert not score(" 48219030", "4821903").exact and score(" 48219030", "4821903").contains
    assert not score(" the number is 4821903", "4821903").exact
    assert not score("\n 4821903", "4821903").exact and score("\n 4821903", "4821903").contains


def test_score_ignores_case_as_ruler_does():
    assert score(" Plain glacier.\n\n", "plain glacier") == Score(contains=True, exact=False)
    assert score(" We8_hvtu\n", "we8_hvtu") == Score(contains=True, exact=True)
    assert score(" GS-1950-T1", "GS-1950-t1").exact
    assert not score(" plain glacial", "plain glacier").contains
    verdict = score(" Plain glacier.", "plain glacier")
    assert verdict.contains == (recall(" Plain glacier.", ["plain glacier"]) == 1.0)  # one rule for both tasks


def test_held_out_templates_share_no_content_word_with_training():
    function_words = {"the", "of", "for", "to", "a", "in", "by", "{key}"}
    rng = random.Random(0)
    training = {w for t in TRAIN_TEMPLATES for w in t.subject.split()}
    training |= {w for _ in range(500) for w in composed_template(rng).subject.split()}
    for template in HELD_OUT_TEMPLATES:
        assert not (set(template.subject.split()) - function_words) & training


def test_every_value_shape_is_used_for_training_and_templates_are_many():
    assert len(TRAIN_TEMPLATES) >= 10
    assert {t.value_kind for t in TRAIN_TEMPLATES} == {"digits", "words", "identifier"}
    assert all(not t.held_out for t in TRAIN_TEMPLATES) and all(t.held_out for t in HELD_OUT_TEMPLATES)


def test_haystack_boundaries_are_sentence_ends(tokenizer):
    hay = Haystack.from_text("t", "One sentence. Two words here! And a third? Yes", tokenizer)
    texts = [tokenizer.decode(hay.ids[:b].tolist()) for b in hay.boundaries]
    assert texts == ["One sentence.", "One sentence. Two words here!", "One sentence. Two words here! And a third?"]
