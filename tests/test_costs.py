"""The cost model against hand arithmetic and published architecture numbers."""

from __future__ import annotations

import dataclasses

import pytest
import transformers

from kvlab.arch import arch_from_config
from kvlab.costs import (
    FORMULAS,
    GPU_PRESETS,
    MODEL_PRESETS,
    ModelSpec,
    Scenario,
    attended_pairs,
    bytes_per_element,
    cached_tokens,
    compare,
    cost_table,
    decode_step_seconds,
    estimate,
    kept_tokens,
    kv_bytes_for_sequence,
    kv_bytes_per_token,
    prefill_flops,
    sequences_that_fit,
)
from kvlab.costs.gpus import GIB
from kvlab.errors import KvlabError

H100 = GPU_PRESETS["H100 SXM 80GB"]
LLAMA3_8B = MODEL_PRESETS["Llama-3-8B"]


def arch(name: str):
    return MODEL_PRESETS[name].arch


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("Llama-3-8B", 32 * 8 * 128 * 2 * 2),  # 131,072
        ("Llama-3-70B", 80 * 8 * 128 * 2 * 2),  # 327,680
        ("Llama-2-70B", 80 * 8 * 128 * 2 * 2),  # 327,680
        ("Llama-3.1-405B", 126 * 8 * 128 * 2 * 2),  # 516,096
        ("Mistral-7B", 32 * 8 * 128 * 2 * 2),  # 131,072
        ("Mistral-7B-v0.1 (sliding window)", 32 * 8 * 128 * 2 * 2),
        ("Gemma-2-9B (alternating sliding window)", 42 * 8 * 256 * 2 * 2),  # 344,064
        ("Qwen2.5-0.5B", 24 * 2 * 64 * 2 * 2),  # 12,288
        ("Qwen2.5-7B", 28 * 4 * 128 * 2 * 2),  # 57,344
        ("Qwen2.5-72B", 80 * 8 * 128 * 2 * 2),  # 327,680
        ("DeepSeek-V3 (MLA)", 61 * (512 + 64) * 2),  # 70,272: one latent per layer, not per head
    ],
)
def test_kv_bytes_per_token_at_16_bit(name: str, expected: int) -> None:
    assert kv_bytes_per_token(arch(name), "bf16") == expected


def test_known_values_from_the_issue() -> None:
    assert kv_bytes_per_token(arch("Llama-3-8B"), "fp16") == 131_072
    assert kv_bytes_per_token(arch("Llama-3-70B"), "fp16") == 327_680
    assert kv_bytes_per_token(arch("Qwen2.5-0.5B"), "fp16") == 12_288
    assert kv_bytes_per_token(arch("DeepSeek-V3 (MLA)"), "bf16") == 70_272


def test_misstatements_in_kv_cache_write_ups() -> None:
    # "FP16 uses 4 bytes per element": it uses 2.
    assert bytes_per_element("fp16") == 2
    # "Llama 3 70B needs about 160 KB per token": it needs 320 KiB, twice that.
    per_token = kv_bytes_per_token(arch("Llama-3-70B"), "fp16")
    assert per_token == 320 * 1024
    assert per_token / 160_000 > 2
    # Counting query heads instead of KV heads (ignoring GQA) would give 2.5 MiB for Llama-3-70B.
    assert per_token * 8 == 80 * 64 * 128 * 2 * 2


def test_precisions() -> None:
    a = arch("Llama-3-8B")
    assert kv_bytes_per_token(a, "fp8") == kv_bytes_per_token(a, "bf16") / 2
    assert kv_bytes_per_token(a, "int4") == kv_bytes_per_token(a, "fp8") / 2
    assert kv_bytes_per_token(a, "int2") == kv_bytes_per_token(a, "int4") / 2
    # 2-bit with one fp16 scale and zero-point per 32 numbers: 0.25 + 4 / 32 bytes.
    assert bytes_per_element("int2", group_size=32) == 0.375
    assert bytes_per_element("bf16", group_size=32) == 2
    with pytest.raises(KvlabError):
        bytes_per_element("fp4")


def test_transformers_config_and_dict_agree() -> None:
    as_dict = {
        "model_type": "llama",
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "hidden_size": 4096,
    }
    as_object = transformers.LlamaConfig(**as_dict)
    assert kv_bytes_per_token(arch_from_config(as_object), "bf16") == kv_bytes_per_token(
        arch_from_config(as_dict), "bf16"
    )
    assert kv_bytes_per_token(arch_from_config(as_object), "bf16") == kv_bytes_per_token(LLAMA3_8B.arch, "bf16")


@pytest.mark.parametrize(
    ("name", "config_class"),
    [
        ("Gemma-2-9B (alternating sliding window)", transformers.Gemma2Config),
        ("Mistral-7B-v0.1 (sliding window)", transformers.MistralConfig),
        ("Qwen2.5-7B", transformers.Qwen2Config),
        ("DeepSeek-V3 (MLA)", transformers.DeepseekV3Config),
    ],
)
def test_presets_match_transformers_configs(name: str, config_class: type) -> None:
    preset = MODEL_PRESETS[name]
    # transformers derives layer_types itself; the preset writes it out.
    fields = {key: value for key, value in preset.config.items() if key not in {"layer_types", "torch_dtype"}}
    from_object = arch_from_config(config_class(**fields))
    for tokens in (1_000, 100_000):
        assert kv_bytes_for_sequence(from_object, tokens, "bf16") == kv_bytes_for_sequence(preset.arch, tokens, "bf16")


def test_sliding_window_caps_the_cache_at_long_contexts() -> None:
    mistral = arch("Mistral-7B-v0.1 (sliding window)")
    per_token = 131_072
    assert kv_bytes_for_sequence(mistral, 4_000, "bf16") == 4_000 * per_token
    # A sliding layer holds the window: window - 1 past tokens plus the current one.
    assert kv_bytes_for_sequence(mistral, 4_096, "bf16") == 4_096 * per_token
    assert kv_bytes_for_sequence(mistral, 32_768, "bf16") == 4_096 * per_token
    assert kv_bytes_for_sequence(mistral, 1_000_000, "bf16") == 4_096 * per_token

    gemma = arch("Gemma-2-9B (alternating sliding window)")
    per_layer_token = 2 * 8 * 256 * 2  # 8,192 bytes
    assert gemma.sliding_layers == tuple(range(0, 42, 2))
    assert kv_bytes_for_sequence(gemma, 8_192, "bf16") == (21 * 8_192 + 21 * 4_096) * per_layer_token


def test_kept_fraction() -> None:
    assert kept_tokens(1_000, 0.3) == 300
    assert kept_tokens(10, 0.25) == 3  # ceil(2.5)
    assert kept_tokens(30, 0.1) == 3  # 0.1 × 30 is 3.0000000000000004 in floating point
    for bad in (0.0, 1.5, -0.1):
        with pytest.raises(KvlabError):
            kept_tokens(100, bad)
    llama = arch("Llama-3-8B")
    assert kv_bytes_for_sequence(llama, 8_192, "bf16", keep_fraction=0.25) == 2_048 * 131_072
    # On a sliding layer the window caps the kept tokens too, so eviction saves nothing past it.
    mistral = arch("Mistral-7B-v0.1 (sliding window)")
    assert cached_tokens(mistral, 0, 32_768, keep_fraction=0.5) == 4_096
    assert cached_tokens(mistral, 0, 4_096, keep_fraction=0.5) == 2_048


def test_attended_pairs_by_brute_force() -> None:
    tiny = arch_from_config(
        {
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "hidden_size": 8,
            "sliding_window": 3,
            "layer_types": ["sliding_attention", "full_attention"],
        }
    )
    for tokens in range(8):
        assert attended_pairs(tiny, 0, tokens) == sum(min(t, 3) for t in range(1, tokens + 1))
        assert attended_pairs(tiny, 1, tokens) == sum(range(1, tokens + 1))


def test_prefill_flops_by_hand() -> None:
    qwen = MODEL_PRESETS["Qwen2.5-0.5B"]
    weights = 2 * 494_032_768 * 1_000  # a multiply-add per weight per token
    attention = 24 * (4 * 14 * 64) * (1_000 * 1_001 // 2)  # layers × FLOPs per pair × causal pairs
    assert prefill_flops(qwen.arch, qwen.params, 1_000) == weights + attention == 1_031_116_544_000


def test_concurrency_by_hand() -> None:
    # Llama-3-8B, bf16, H100 80 GiB with a 10 % reserve, 8,192-token sequences (1 GiB of cache each).
    memory = 80 * 2**30  # 85,899,345,920
    weights = 2 * 8_030_261_248  # 16,060,522,496
    per_sequence = 131_072 * 8_192  # 1,073,741,824
    # (0.9 × 85,899,345,920 − 16,060,522,496) / 1,073,741,824 = 61,248,888,832 / 1,073,741,824 = 57.04
    assert sequences_that_fit(memory, weights, per_sequence, 0.10) == 57
    assert sequences_that_fit(memory, weights, per_sequence / 4, 0.10) == 228
    assert sequences_that_fit(memory, 100 * 2**30, per_sequence) == 0


def test_decode_time_by_hand() -> None:
    # Batch of 8 at 8,192 tokens: (16,060,522,496 + 8 × 1,073,741,824) bytes / 3.35e12 bytes/s = 7.358 ms.
    step = decode_step_seconds(16_060_522_496, 1_073_741_824, 8, 3.35e12)
    assert step == pytest.approx(24_650_457_088 / 3.35e12)
    assert step == pytest.approx(7.3583e-3, rel=1e-4)


def test_estimate_by_hand() -> None:
    scenario = Scenario(prompt_tokens=7_168, output_tokens=1_024, batch=8, prefill_utilization=None)
    result = estimate(LLAMA3_8B, H100, scenario)
    step = 24_650_457_088 / 3.35e12
    assert result.kv_bytes_per_sequence == 2**30
    assert result.max_sequences == 57 and result.batch_fits
    assert result.decode_step_seconds == pytest.approx(step)
    assert result.tokens_per_second == pytest.approx(8 / step)  # about 1,087 tokens/s
    # Each query pays 1,024 steps shared by 8 queries, at $2.99 an hour.
    query_cost = 1_024 * step / 8 * 2.99 / 3600
    assert result.cost_per_query == pytest.approx(query_cost)  # about $0.00078
    assert result.cost_per_million_tokens == pytest.approx(query_cost / 1_024 * 1e6)  # about $0.76

    with_prefill = estimate(LLAMA3_8B, H100, dataclasses.replace(scenario, prefill_utilization=0.5))
    prefill = prefill_flops(LLAMA3_8B.arch, LLAMA3_8B.params, 7_168) / (989e12 * 0.5)
    assert with_prefill.prefill_seconds == pytest.approx(prefill)
    assert with_prefill.cost_per_query == pytest.approx((prefill + 1_024 * step / 8) * 2.99 / 3600)


def test_mixture_of_experts_reads_only_active_weights() -> None:
    deepseek = MODEL_PRESETS["DeepSeek-V3 (MLA)"]
    h200 = GPU_PRESETS["H200 141GB"]
    scenario = Scenario(prompt_tokens=1_000, output_tokens=24, weight_precision="fp8", gpu_count=8)
    result = estimate(deepseek, h200, scenario)
    assert result.weight_bytes == 671e9
    assert result.decode_step_seconds == pytest.approx((37e9 + 1_024 * 70_272) / (8 * 4.8e12))


def test_weights_that_do_not_fit_leave_no_room() -> None:
    llama70 = MODEL_PRESETS["Llama-3-70B"]
    one = estimate(llama70, H100, Scenario(prompt_tokens=3_072, output_tokens=1_024))
    assert one.max_sequences == 0 and not one.batch_fits
    # Two GPUs: (2 × 0.9 × 80 GiB − 141,107,412,992) / (327,680 × 4,096) = 13,511,409,664 / 1,342,177,280 = 10.07.
    two = estimate(llama70, H100, Scenario(prompt_tokens=3_072, output_tokens=1_024, gpu_count=2))
    assert two.max_sequences == 10


def test_compare_full_against_evicted() -> None:
    full, evicted = compare(LLAMA3_8B, H100, Scenario(prompt_tokens=7_168, output_tokens=1_024, keep_fraction=0.25))
    assert full.keep_fraction == 1.0 and evicted.keep_fraction == 0.25
    assert evicted.kv_bytes_per_sequence == full.kv_bytes_per_sequence / 4
    assert evicted.max_sequences > full.max_sequences
    assert evicted.decode_step_seconds < full.decode_step_seconds
    assert evicted.prefill_seconds == full.prefill_seconds  # the prompt is read in full either way


def test_cost_table_rows_and_units() -> None:
    table = cost_table(LLAMA3_8B, H100, Scenario(prompt_tokens=7_168, output_tokens=1_024, keep_fraction=0.25))
    assert list(table.columns) == ["Quantity", "Unit", "Full cache", "Evicted (keep 25%)"]
    rows = table.set_index("Quantity")
    assert rows.loc["KV per token, all layers", "Full cache"] == 131_072
    assert rows.loc["KV per sequence", "Unit"] == "bytes"
    assert rows.loc["KV per sequence", "Full cache"] == GIB
    assert rows.loc["KV per sequence", "Evicted (keep 25%)"] == GIB / 4
    assert rows.loc["Batch fits in memory", "Full cache"] == "yes"
    assert rows.loc["Weights", "Full cache"] == 2 * 8_030_261_248
    assert rows.loc["Fewest GPUs that hold one sequence", "Full cache"] == 1
    assert table["Unit"].str.len().gt(0).all()


def test_formulas_are_short_strings() -> None:
    assert {"KV per token", "Sequences that fit", "Decode step", "Cost per query"} <= FORMULAS.keys()
    assert all(0 < len(text) <= 120 for text in FORMULAS.values())


def test_presets_are_complete_and_editable() -> None:
    assert all(preset.source for preset in MODEL_PRESETS.values())
    assert all(gpu.memory_bytes > 0 and gpu.bandwidth_bytes_per_s > 0 for gpu in GPU_PRESETS.values())
    cheaper = dataclasses.replace(H100, price_per_hour=1.0)
    assert cheaper.memory_bytes == H100.memory_bytes and cheaper.price_per_hour == 1.0
    with pytest.raises(KvlabError):
        dataclasses.replace(H100, bandwidth_bytes_per_s=0)
    with pytest.raises(KvlabError):
        ModelSpec(name="x", config={}, params=10, active_params=20)


@pytest.mark.parametrize(
    "fields",
    [
        {"batch": 0},
        {"output_tokens": 0},
        {"gpu_count": 0},
        {"kv_precision": "fp4"},
        {"weight_precision": "q4_k_m"},
        {"keep_fraction": 0.0},
        {"memory_reserve": 1.0},
        {"prefill_utilization": 0.0},
        {"kv_precision": "int2", "quant_group_size": 0},
    ],
)
def test_bad_scenarios_raise_user_errors(fields: dict) -> None:
    with pytest.raises(KvlabError):
        estimate(LLAMA3_8B, H100, Scenario(**{"prompt_tokens": 100, "output_tokens": 10, **fields}))


def test_the_cost_calculator_prices_without_loading_torch():
    """Pricing a config needs no model: importing the calculator must not pull in torch (seconds of start-up)."""
    import subprocess
    import sys

    code = "import sys, kvlab.costs; print('torch' in sys.modules)"
    shown = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert shown == "False"
