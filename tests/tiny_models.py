"""Tiny random-weight models of several architectures, built from transformers config classes (nothing downloaded)."""

from __future__ import annotations

import dataclasses

import torch
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from kvlab.policies import POLICIES, Policy, make_policy

VOCAB = 97
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    attn_implementation="eager",
)

BUILDERS = {
    "llama": lambda: LlamaForCausalLM(LlamaConfig(**COMMON)),
    "mistral": lambda: MistralForCausalLM(MistralConfig(**COMMON, sliding_window=12)),
    "qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(**COMMON, attention_bias=True)),
    "gemma2": lambda: Gemma2ForCausalLM(
        Gemma2Config(
            **COMMON,
            head_dim=16,
            sliding_window=10,
            attn_logit_softcapping=20.0,
            final_logit_softcapping=30.0,
            query_pre_attn_scalar=16,
        )
    ),
}
ARCHITECTURES = tuple(BUILDERS)


def small_policy(name: str) -> Policy:
    """A registered policy made to fit the tiny budgets of these tests: a policy with an observation window
    (SnapKV, PyramidKV) gets one of 4 queries, the others their defaults."""
    has_window = any(item.name == "window" for item in dataclasses.fields(POLICIES[name]))
    return make_policy(name, **({"window": 4} if has_window else {}))


def tiny_model(arch: str, seed: int = 0) -> torch.nn.Module:
    """A random-weight model of ``arch`` with eager attention (the reference implementation)."""
    torch.manual_seed(seed)
    model = BUILDERS[arch]()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0.0, 0.3)
    return model.eval()


def prompt(batch: int = 1, length: int = 40, seed: int = 1) -> torch.Tensor:
    """Random token ids (no special meaning: the models are random too)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (batch, length), generator=generator)


def save_tiny_checkpoint(directory) -> str:
    """A tiny Llama with a byte-level BPE tokenizer saved like a hub checkpoint, for loader and CLI tests."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(["the cache keeps the tokens that matter"] * 20, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(directory)
    torch.manual_seed(0)
    config = LlamaConfig(
        **{**COMMON, "vocab_size": fast.vocab_size, "attn_implementation": "sdpa"}, bos_token_id=0, eos_token_id=1
    )
    LlamaForCausalLM(config).save_pretrained(directory)
    return str(directory)
