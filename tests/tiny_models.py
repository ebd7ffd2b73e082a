"""Tiny random-weight models of several architectures, built from transformers config classes (nothing downloaded)."""

from __future__ import annotations

import dataclasses

import torch
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from kvlab.errors import KvlabError
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


def tiny_gemma3(seed: int = 0) -> torch.nn.Module:
    """A random-weight Gemma-3-style model: two layers with a sliding window of 6 tokens, then one global layer."""
    torch.manual_seed(seed)
    config = Gemma3TextConfig(
        **COMMON,
        head_dim=16,
        sliding_window=6,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        query_pre_attn_scalar=16,
    )
    model = Gemma3ForCausalLM(config)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0.0, 0.3)
    return model.eval()


def small_policy(name: str) -> Policy:
    """A registered policy made to fit the tiny budgets of these tests: a policy with an observation window
    (SnapKV, PyramidKV) gets one of 4 queries, the others their defaults."""
    has_window = any(item.name == "window" for item in dataclasses.fields(POLICIES[name]))
    return make_policy(name, **({"window": 4} if has_window else {}))


def runs_in(name: str) -> list[str]:
    """The modes a policy runs in (KVzip and an ablation made for one compression refuse streaming mode)."""
    accepted = []
    for mode in ("prefill", "streaming"):
        try:
            POLICIES[name]().check_mode(mode)
        except KvlabError:
            continue
        accepted.append(mode)
    return accepted


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


#: llama.cpp's names for a Llama layer's weights, by transformers' module names.
_GGUF_LAYER_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}
_GGUF_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}


def _rope_permute(weight, heads: int):
    """llama.cpp's reordering of query and key rows (interleaved rotary pairs), which transformers' GGUF loader
    undoes."""
    return (
        weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)
    )


def write_tiny_llama_gguf(path, *, seed: int = 0, licence: str = "mit") -> LlamaForCausalLM:
    """Write a random tiny Llama as a GGUF file the way llama.cpp's converter lays it out (F32 tensors, a byte-level
    BPE vocabulary of letters), and return the same weights as a transformers model to compare with."""
    import gguf
    import numpy as np

    torch.manual_seed(seed)
    tokens = ["<s>", "</s>", "<unk>", "Ġ", *[chr(code) for code in range(ord("a"), ord("z") + 1)], "ab", "cd"]
    config = LlamaConfig(
        vocab_size=len(tokens),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        bos_token_id=0,
        eos_token_id=1,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config).eval()
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("kvlab tiny test llama")
    writer.add_license(licence)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3, 3, 2] + [1] * (len(tokens) - 3))
    writer.add_token_merges(["a b", "c d"])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)
    writer.add_unk_token_id(2)
    for name, tensor in model.state_dict().items():
        weight = tensor.detach().float().numpy()
        if name == "lm_head.weight":
            gguf_name = "output.weight"
        elif name in _GGUF_NAMES:
            gguf_name = _GGUF_NAMES[name]
        else:
            layer, module = int(name.split(".")[2]), ".".join(name.split(".")[3:-1])
            gguf_name = f"blk.{layer}.{_GGUF_LAYER_NAMES[module]}.weight"
        if ".q_proj." in name:
            weight = _rope_permute(weight, config.num_attention_heads)
        elif ".k_proj." in name:
            weight = _rope_permute(weight, config.num_key_value_heads)
        writer.add_tensor(gguf_name, np.ascontiguousarray(weight))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return model
