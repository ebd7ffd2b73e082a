"""The BOS rule (kvlab/tasks/bos.py): by default a prompt is tokenised as transformers tokenises it, so that a
full-cache run gives the tokens of ``model.generate(**tokenizer(text))``; ``always`` gives the ids of kvlab's old
rule, ``never`` drops a BOS the tokenizer adds; needle and RULER prompts follow it at their exact length; a run's
identity differs only where its prompts do, and a run stored before the rule keeps its identity."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from tiny_models import COMMON, tiny_model
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import Phi3Config, Phi3ForCausalLM, PreTrainedTokenizerFast

from kvlab.engine.generation import generate
from kvlab.engine.spec import RunSpec
from kvlab.errors import KvlabError
from kvlab.models.loading import wrap_model
from kvlab.policies import make_policy
from kvlab.runs.records import run_config
from kvlab.store import run_key
from kvlab.tasks.bos import check_bos, special_ids, stored_bos
from kvlab.tasks.facts import TRAIN_TEMPLATES, make_fact
from kvlab.tasks.items import prompt_ids, text_ids
from kvlab.tasks.needle import build_needle, load_haystacks
from kvlab.tasks.ruler import ruler_item

BOS, EOS = 0, 1
WORDS = ["<s>", "</s>", "[UNK]", *(f"w{i}" for i in range(90))]
#: Shorter than the tiny Mistral's sliding window, so that a BOS before it changes what every token attends to.
TEXT = " ".join(f"w{(7 * i + 3) % 90}" for i in range(8))
NEW_TOKENS = 6


def word_tokenizer(adds_bos: bool) -> PreTrainedTokenizerFast:
    """A word-level tokenizer with a BOS token, which it puts first (a template post-processor, as Llama-2's) or
    never adds (as Qwen2's and GPT-2's)."""
    tokenizer = Tokenizer(models.WordLevel({word: i for i, word in enumerate(WORDS)}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    if adds_bos:
        tokenizer.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", BOS)]
        )
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="[UNK]")


def tiny_phi3() -> torch.nn.Module:
    """A random-weight Phi-3 (fused projections), like :func:`tiny_models.tiny_model`."""
    torch.manual_seed(0)
    model = Phi3ForCausalLM(Phi3Config(**{**COMMON, "pad_token_id": EOS}, bos_token_id=BOS, eos_token_id=EOS))
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0.0, 0.3)
    return model.eval()


def full_cache_tokens(model: torch.nn.Module, tokenizer, rule: str = "auto") -> list[int]:
    """The tokens kvlab's full cache generates from ``TEXT`` under ``rule``."""
    ids = torch.tensor([text_ids(tokenizer, TEXT, bos=rule)])  # type: ignore[arg-type]
    spec = RunSpec(make_policy("full"), max_new_tokens=NEW_TOKENS, stop_token_ids=(), bos=rule)  # type: ignore[arg-type]
    return generate(wrap_model(model, tokenizer), ids, spec).tokens[0]


def transformers_tokens(model: torch.nn.Module, tokenizer) -> list[int]:
    """The tokens transformers generates greedily from ``TEXT`` tokenised as it tokenises by default."""
    inputs = tokenizer(TEXT, return_tensors="pt")
    out = model.generate(
        **inputs, do_sample=False, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, pad_token_id=EOS
    )
    return out[0, inputs.input_ids.shape[1] :].tolist()


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "phi3"])
def test_the_full_cache_generates_what_transformers_does_from_a_tokenizer_that_adds_no_bos(arch):
    tokenizer = word_tokenizer(adds_bos=False)
    model = tiny_phi3() if arch == "phi3" else tiny_model(arch)
    expected = transformers_tokens(model, tokenizer)  # before kvlab installs its attention in the model
    assert tokenizer(TEXT).input_ids[0] != BOS  # the case of the issue: a BOS token the tokenizer never adds
    assert full_cache_tokens(model, tokenizer) == expected
    assert full_cache_tokens(model, tokenizer, "always") != expected  # the old rule's BOS changes these tokens


def test_the_full_cache_generates_what_transformers_does_from_a_tokenizer_that_adds_a_bos():
    tokenizer = word_tokenizer(adds_bos=True)
    model = tiny_model("llama")
    expected = transformers_tokens(model, tokenizer)
    assert full_cache_tokens(model, tokenizer) == expected


def test_always_gives_the_ids_of_the_old_rule_and_never_drops_the_bos_a_tokenizer_adds():
    plain = word_tokenizer(adds_bos=False)
    adding = word_tokenizer(adds_bos=True)
    words = tuple(plain.encode(TEXT, add_special_tokens=False))
    for tokenizer in (plain, adding):
        assert text_ids(tokenizer, TEXT, bos="always") == (BOS, *words)  # the BOS once, never twice
        assert text_ids(tokenizer, TEXT, bos="never") == words
    assert text_ids(plain, TEXT) == words
    assert text_ids(adding, TEXT) == (BOS, *words)
    context, question = prompt_ids(plain, "w1 w2", "w3", bos="always")
    assert context[0] == BOS and BOS not in question
    assert prompt_ids(plain, "w1 w2", "w3")[0][0] != BOS


def test_needle_and_ruler_prompts_follow_the_rule_at_their_exact_length(checkpoint):
    from kvlab.models.loading import load_model

    tokenizer = load_model(checkpoint).tokenizer  # byte-level BPE with a BOS it does not add
    assert special_ids(tokenizer, "auto") == ((), ())
    haystack = load_haystacks(tokenizer)[0]
    fact = make_fact(TRAIN_TEMPLATES[0], random.Random(0))
    for rule, first in (("auto", False), ("always", True), ("never", False)):
        needle = build_needle(tokenizer, haystack, 200, 0.5, fact, bos=rule)  # type: ignore[arg-type]
        ruler = ruler_item(tokenizer, "niah_single_1", 512, random.Random(0), rule)  # type: ignore[arg-type]
        assert (needle.context_tokens, ruler.context_tokens) == (200, 512)
        assert (needle.context_ids[0] == BOS, ruler.context_ids[0] == BOS) == (first, first)


def test_identity_differs_only_where_the_prompts_do_and_a_stored_run_keeps_its_own():
    plain, adding = word_tokenizer(adds_bos=False), word_tokenizer(adds_bos=True)
    assert [stored_bos(plain, rule) for rule in ("auto", "always", "never")] == ["auto", None, "auto"]
    assert [stored_bos(adding, rule) for rule in ("auto", "always", "never")] == [None, None, "never"]
    loaded = wrap_model(tiny_model("llama"), plain)
    configs = {rule: config_of(loaded, RunSpec(make_policy("full"), bos=rule)) for rule in ("auto", "always", "never")}
    keys = {rule: (config.bos, run_key(config)) for rule, config in configs.items()}
    old = dataclasses.replace(configs["auto"], bos=None)  # a run stored before the rule: no bos field at all
    assert keys["always"] == (None, run_key(old))
    assert keys["auto"] == keys["never"] != keys["always"]  # the same prompts under two names: one run


def config_of(loaded, spec: RunSpec):
    """The stored configuration of a run of ``spec`` on one fixed task."""
    return run_config(loaded, spec, task="t", task_hash="h", stop_rule="eos", query_aware=None, context_length=8)


def test_an_unknown_rule_is_one_sentence():
    with pytest.raises(KvlabError, match="Unknown BOS rule 'first'; use one of auto, always, never"):
        check_bos("first")
    with pytest.raises(KvlabError, match="Unknown BOS rule"):
        RunSpec(make_policy("full"), bos="first")  # type: ignore[arg-type]
