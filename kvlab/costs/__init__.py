"""The memory and cost model of a KV cache: how big it is, how many sequences fit, how fast and how dear decoding is.

:mod:`~kvlab.costs.formulas` holds the formulas, :mod:`~kvlab.costs.models` and :mod:`~kvlab.costs.gpus` the
presets, :mod:`~kvlab.costs.report` turns a scenario into outputs. Everything is a pure function of its inputs.
"""

from kvlab.costs.formulas import (
    MOST_GPUS,
    PRECISION_BYTES,
    attended_pairs,
    attention_flops_per_pair,
    bytes_per_element,
    cached_tokens,
    cost_per_million_tokens,
    cost_per_query,
    decode_step_seconds,
    decode_tokens_per_second,
    gpus_that_fit,
    kept_tokens,
    kv_bytes_for_sequence,
    kv_bytes_per_token,
    kv_elements_per_token_per_layer,
    prefill_flops,
    prefill_seconds,
    query_seconds,
    sequences_that_fit,
    weight_bytes,
)
from kvlab.costs.gpus import GPU_PRESETS, GpuSpec
from kvlab.costs.models import MODEL_PRESETS, ModelSpec
from kvlab.costs.report import DOES_NOT_FIT, FORMULAS, CostEstimate, Scenario, compare, cost_table, estimate

__all__ = [
    "DOES_NOT_FIT",
    "FORMULAS",
    "GPU_PRESETS",
    "MODEL_PRESETS",
    "MOST_GPUS",
    "PRECISION_BYTES",
    "CostEstimate",
    "GpuSpec",
    "ModelSpec",
    "Scenario",
    "attended_pairs",
    "attention_flops_per_pair",
    "bytes_per_element",
    "cached_tokens",
    "compare",
    "cost_per_million_tokens",
    "cost_per_query",
    "cost_table",
    "decode_step_seconds",
    "decode_tokens_per_second",
    "estimate",
    "gpus_that_fit",
    "kept_tokens",
    "kv_bytes_for_sequence",
    "kv_bytes_per_token",
    "kv_elements_per_token_per_layer",
    "prefill_flops",
    "prefill_seconds",
    "query_seconds",
    "sequences_that_fit",
    "weight_bytes",
]
