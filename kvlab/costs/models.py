"""Models the calculator can price, and presets of published models.

A preset is the relevant excerpt of the model's published ``config.json`` plus its parameter count, read through
:func:`kvlab.models.arch.arch_from_config` exactly like a pasted config or a loaded model's config, so the three sources
go through the same code. The parameter counts are those of the published checkpoints (for dense models they equal
the count derived from the config).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from kvlab.errors import KvlabError
from kvlab.models.arch import ArchFacts, arch_from_config


@dataclass(frozen=True)
class ModelSpec:
    """A model to price: its config (a ``config.json`` mapping or a transformers config) and its size.

    ``active_params`` is the number of parameters one token runs through in a mixture of experts; it sets the
    weight bytes a decode step reads and the prefill FLOPs, while ``params`` sets the memory the weights take.
    """

    name: str
    config: Any
    params: float
    active_params: float | None = None
    source: str = ""
    note: str = ""

    def __post_init__(self) -> None:
        if self.params <= 0 or (self.active_params is not None and not 0 < self.active_params <= self.params):
            raise KvlabError("The parameter count must be positive, and the active count at most the total.")

    @cached_property
    def arch(self) -> ArchFacts:
        """The architecture facts the cost formulas need, read once per spec (reading a config through transformers
        takes milliseconds, and a page prices a spec many times)."""
        return arch_from_config(self.config)

    @property
    def written_arch(self) -> ArchFacts:
        """The architecture facts of the config as written, read without transformers (so without torch): for the
        presets, which spell out every field the formulas read, the same sizes as :attr:`arch` (tested)."""
        return arch_from_config(self.config, derive=False)

    @property
    def params_per_token(self) -> float:
        """Parameters one token runs through: ``active_params`` for a mixture of experts, else ``params``."""
        return self.params if self.active_params is None else self.active_params


#: Endings of ``architectures`` entries that generate text token by token, and so decode with a KV cache.
_GENERATIVE_HEADS = ("ForCausalLM", "LMHeadModel", "ForConditionalGeneration")
#: Endings of ``architectures`` entries that read a text in one pass (masked-LM, classification, extraction heads).
_ONE_PASS_HEADS = (
    "ForMaskedLM",
    "ForPreTraining",
    "ForNextSentencePrediction",
    "ForSequenceClassification",
    "ForTokenClassification",
    "ForQuestionAnswering",
    "ForMultipleChoice",
)
#: ``model_type`` of encoder-only families (all have a masked-LM head in transformers); a config of one of these
#: types is a decoder only when it says ``"is_decoder": true``.
ENCODER_ONLY_TYPES = frozenset(
    {
        "albert",
        "bert",
        "big_bird",
        "camembert",
        "convbert",
        "data2vec-text",
        "deberta",
        "deberta-v2",
        "distilbert",
        "electra",
        "ernie",
        "esm",
        "eurobert",
        "funnel",
        "longformer",
        "megatron-bert",
        "mobilebert",
        "modernbert",
        "mpnet",
        "nomic_bert",
        "rembert",
        "roberta",
        "roformer",
        "squeezebert",
        "xlm-roberta",
        "xlm-roberta-xl",
    }
)


#: ``model_type`` of encoder-decoder families, refused even when a config.json leaves ``is_encoder_decoder`` out.
ENCODER_DECODER_TYPES = frozenset(
    {"bart", "longt5", "m2m_100", "marian", "mbart", "mt5", "nllb-moe", "pegasus", "switch_transformers", "t5", "umt5"}
)


def require_decoder(config: Mapping[str, Any]) -> None:
    """Refuse, in one sentence, a ``config.json`` that is not a decoder's: the cost model prices the cache a
    decoder-only transformer keeps while it generates, which encoders and encoder-decoders do not have in this form.

    Decided from what the published files state: ``is_encoder_decoder`` (or an encoder-decoder ``model_type``),
    then the ``architectures`` heads (a causal-LM head accepts, a masked-LM or classification head refuses), then
    the ``model_type`` of encoder-only families. A missing ``is_decoder`` is no reason to refuse: Llama, Qwen and
    Mistral files leave it out.
    """
    model_type = str(config.get("model_type", ""))
    if config.get("is_encoder_decoder") is True or model_type in ENCODER_DECODER_TYPES:
        raise KvlabError(
            f"This config describes an encoder-decoder model ({model_type or 'no model_type'}), and the calculator "
            "prices only decoder-only transformers; paste the config of a model whose architectures end in ForCausalLM."
        )
    heads = config.get("architectures")
    names = [name for name in heads if isinstance(name, str)] if isinstance(heads, list) else []
    if any(name.endswith(_GENERATIVE_HEADS) for name in names):
        return
    one_pass = next((name for name in names if name.endswith(_ONE_PASS_HEADS)), None)
    if one_pass is not None:
        raise KvlabError(
            f"This config describes {one_pass}, which reads its input in one pass and generates no tokens, so it "
            "has no KV cache to price; paste the config of a model whose architectures end in ForCausalLM."
        )
    if model_type in ENCODER_ONLY_TYPES and config.get("is_decoder") is not True:
        raise KvlabError(
            f"This config describes a {model_type} model, an encoder that reads its input in one pass and keeps no "
            "KV cache; paste the config of a model whose architectures end in ForCausalLM."
        )


def _alternating_layer_types(num_layers: int) -> list[str]:
    """Gemma-2's pattern, as ``Gemma2Config`` derives it: even layers slide, odd layers attend to everything."""
    return ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)]


_PRESETS: tuple[ModelSpec, ...] = (
    ModelSpec(
        name="Llama-2-70B",
        source="meta-llama/Llama-2-70b-hf",
        config={
            "model_type": "llama",
            "num_hidden_layers": 80,
            "num_attention_heads": 64,
            "num_key_value_heads": 8,
            "hidden_size": 8192,
            "max_position_embeddings": 4096,
            "torch_dtype": "float16",
        },
        params=68_976_648_192,
    ),
    ModelSpec(
        name="Llama-3-8B",
        source="meta-llama/Meta-Llama-3-8B",
        config={
            "model_type": "llama",
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "hidden_size": 4096,
            "max_position_embeddings": 8192,
            "torch_dtype": "bfloat16",
        },
        params=8_030_261_248,
    ),
    ModelSpec(
        name="Llama-3-70B",
        source="meta-llama/Meta-Llama-3-70B",
        config={
            "model_type": "llama",
            "num_hidden_layers": 80,
            "num_attention_heads": 64,
            "num_key_value_heads": 8,
            "hidden_size": 8192,
            "max_position_embeddings": 8192,
            "torch_dtype": "bfloat16",
        },
        params=70_553_706_496,
    ),
    ModelSpec(
        name="Llama-3.1-405B",
        source="meta-llama/Llama-3.1-405B",
        config={
            "model_type": "llama",
            "num_hidden_layers": 126,
            "num_attention_heads": 128,
            "num_key_value_heads": 8,
            "hidden_size": 16384,
            "max_position_embeddings": 131072,
            "torch_dtype": "bfloat16",
        },
        params=405_853_388_800,
    ),
    ModelSpec(
        name="Mistral-7B",
        source="mistralai/Mistral-7B-v0.3",
        config={
            "model_type": "mistral",
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "hidden_size": 4096,
            "sliding_window": None,
            "max_position_embeddings": 32768,
            "torch_dtype": "bfloat16",
        },
        params=7_248_023_552,
    ),
    ModelSpec(
        name="Mistral-7B-v0.1 (sliding window)",
        source="mistralai/Mistral-7B-v0.1",
        config={
            "model_type": "mistral",
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "hidden_size": 4096,
            "sliding_window": 4096,
            "max_position_embeddings": 32768,
            "torch_dtype": "bfloat16",
        },
        params=7_241_732_096,
        note="Every layer attends to the last 4,096 tokens, so its cache stops growing there.",
    ),
    ModelSpec(
        name="Gemma-2-9B (alternating sliding window)",
        source="google/gemma-2-9b",
        config={
            "model_type": "gemma2",
            "num_hidden_layers": 42,
            "num_attention_heads": 16,
            "num_key_value_heads": 8,
            "hidden_size": 3584,
            "head_dim": 256,
            "sliding_window": 4096,
            "max_position_embeddings": 8192,
            "layer_types": _alternating_layer_types(42),
        },
        params=9_241_705_984,
        note=(
            "Half the layers use a 4,096-token window. The published config.json leaves layer_types out and "
            "transformers derives it; it is written here so that the mapping says what the model does."
        ),
    ),
    ModelSpec(
        name="Qwen2.5-0.5B",
        source="Qwen/Qwen2.5-0.5B",
        config={
            "model_type": "qwen2",
            "num_hidden_layers": 24,
            "num_attention_heads": 14,
            "num_key_value_heads": 2,
            "hidden_size": 896,
            "use_sliding_window": False,
            "max_position_embeddings": 32768,
            "torch_dtype": "bfloat16",
        },
        params=494_032_768,
    ),
    ModelSpec(
        name="Qwen2.5-7B",
        source="Qwen/Qwen2.5-7B",
        config={
            "model_type": "qwen2",
            "num_hidden_layers": 28,
            "num_attention_heads": 28,
            "num_key_value_heads": 4,
            "hidden_size": 3584,
            "use_sliding_window": False,
            "max_position_embeddings": 131072,
            "torch_dtype": "bfloat16",
        },
        params=7_615_616_512,
    ),
    ModelSpec(
        name="Qwen2.5-72B",
        source="Qwen/Qwen2.5-72B",
        config={
            "model_type": "qwen2",
            "num_hidden_layers": 80,
            "num_attention_heads": 64,
            "num_key_value_heads": 8,
            "hidden_size": 8192,
            "use_sliding_window": False,
            "max_position_embeddings": 131072,
            "torch_dtype": "bfloat16",
        },
        params=72_706_203_648,
    ),
    ModelSpec(
        name="DeepSeek-V3 (MLA)",
        source="deepseek-ai/DeepSeek-V3",
        config={
            "model_type": "deepseek_v3",
            "num_hidden_layers": 61,
            "num_attention_heads": 128,
            "num_key_value_heads": 128,
            "hidden_size": 7168,
            "kv_lora_rank": 512,
            "q_lora_rank": 1536,
            "qk_rope_head_dim": 64,
            "qk_nope_head_dim": 128,
            "v_head_dim": 128,
            "max_position_embeddings": 163840,
            "torch_dtype": "bfloat16",
        },
        params=671e9,
        active_params=37e9,
        note=(
            "Multi-head latent attention caches one 512-element latent plus one 64-element RoPE key per token per "
            "layer (576 elements), shared by all 128 heads. 671B total and 37B active parameters as in the "
            "technical report; the checkpoint's extra 14B multi-token-prediction module is left out. Its weights "
            "are published in fp8."
        ),
    ),
)

MODEL_PRESETS: dict[str, ModelSpec] = {preset.name: preset for preset in _PRESETS}
"""Presets by display name; copy one with :func:`dataclasses.replace` to edit it."""
