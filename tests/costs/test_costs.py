"""The cost model against hand arithmetic and published architecture numbers."""

from __future__ import annotations

import dataclasses

import pytest
import transformers

from kvlab.costs import (
    FORMULAS,
    GPU_PRESETS,
    MODEL_PRESETS,
    NO_EVICTION,
    ModelSpec,
    Scenario,
    attended_pairs,
    bytes_per_element,
    cached_tokens,
    compare,
    cost_table,
    decode_step_seconds,
    estimate,
    global_scope_count_bytes,
    global_scope_gather_bytes,
    kept_tokens,
    kv_bytes_for_sequence,
    kv_bytes_per_token,
    layer_split,
    prefill_flops,
    prefill_seconds,
    query_seconds,
    sequences_that_fit,
)
from kvlab.errors import KvlabError
from kvlab.models.arch import arch_from_config
from kvlab.units import GIB

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
    # The eight GPUs take turns on each step, so it reads what one GPU would; the first holds 8 of the 61 layers.
    assert result.decode_step_seconds == pytest.approx((37e9 + 1_024 * 70_272) / 4.8e12)
    assert result.slowest_stage_seconds == pytest.approx((37e9 * 8 / 61 + 8 * 1_024 * 1_152) / 4.8e12)


def test_weights_that_do_not_fit_leave_no_room() -> None:
    llama70 = MODEL_PRESETS["Llama-3-70B"]
    one = estimate(llama70, H100, Scenario(prompt_tokens=3_072, output_tokens=1_024))
    assert one.max_sequences == 0 and not one.batch_fits
    # Two GPUs of 40 layers: (0.9 × 80 GiB − 70,553,706,496) / (40 × 4,096 × 4,096) = 6,755,704,832 / 671,088,640
    # = 10.07.
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
        {"gpu_count": 65},
        {"gpu_count": 33},  # more GPUs than Llama-3-8B's 32 layers
        {"kv_precision": "fp4"},
        {"weight_precision": "q4_k_m"},
        {"keep_fraction": 0.0},
        {"memory_reserve": 1.0},
        {"prefill_utilization": 0.0},
        {"kv_precision": "int2", "quant_group_size": 0},
    ],
)
def test_bad_scenarios_raise_user_errors(fields: dict) -> None:
    with pytest.raises(KvlabError) as refusal:
        estimate(LLAMA3_8B, H100, Scenario(**{"prompt_tokens": 100, "output_tokens": 10, **fields}))
    assert str(refusal.value).count(". ") == 0 and str(refusal.value).endswith(".")  # one sentence


def test_bad_gpu_counts_say_the_bounds() -> None:
    with pytest.raises(KvlabError, match="from 1 to 64"):
        Scenario(prompt_tokens=100, output_tokens=10, gpu_count=65)
    with pytest.raises(KvlabError, match="24 layers take between 1 and 24 GPUs, not 25"):
        estimate(MODEL_PRESETS["Qwen2.5-0.5B"], H100, Scenario(prompt_tokens=100, output_tokens=10, gpu_count=25))


# --- several GPUs: the layers split as a pipeline ---------------------------------------------------------------------


@pytest.mark.parametrize("layers", [1, 7, 32, 42, 61, 80, 126])
def test_layers_are_split_as_evenly_as_possible_with_the_remainder_first(layers: int) -> None:
    for gpus in range(1, min(layers, 64) + 1):
        split = layer_split(layers, gpus)
        assert [layer for part in split for layer in part] == list(range(layers))  # consecutive, each layer once
        sizes = [len(part) for part in split]
        assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)  # the first GPUs take more
        assert sizes.count(max(sizes)) == (layers % gpus or gpus)
    assert [len(part) for part in layer_split(80, 3)] == [27, 27, 26]
    for gpus in (0, layers + 1):
        with pytest.raises(KvlabError, match=f"{layers} layers take between 1 and {layers} GPUs"):
            layer_split(layers, gpus)


SPLIT_SCENARIO = Scenario(prompt_tokens=7_168, output_tokens=1_024, batch=8, keep_fraction=0.25)


def test_one_gpu_gives_exactly_the_single_gpu_formulas() -> None:
    """One GPU holds everything: every figure is the whole-model formula's, to the last bit."""
    for model in (LLAMA3_8B, MODEL_PRESETS["Gemma-2-9B (alternating sliding window)"], MODEL_PRESETS["Qwen2.5-7B"]):
        for keep in (1.0, 0.25):
            scenario = dataclasses.replace(SPLIT_SCENARIO, keep_fraction=keep)
            result = estimate(model, H100, scenario)
            kv = kv_bytes_for_sequence(model.arch, 8_192, "bf16", keep)
            weights = 2 * model.params
            fit = sequences_that_fit(H100.memory_bytes, weights, kv, 0.10)
            step = decode_step_seconds(2 * model.params, kv, 8, H100.bandwidth_bytes_per_s)
            prefill = prefill_seconds(prefill_flops(model.arch, model.params, 7_168), H100.peak_flops, 0.5)
            price = query_seconds(prefill, step, 8, 1_024) * H100.price_per_hour / 3600
            assert (result.kv_bytes_per_sequence, result.weight_bytes, result.max_sequences) == (kv, weights, fit)
            assert (result.decode_step_seconds, result.prefill_seconds) == (step, prefill)
            assert result.cost_per_query == price and result.stage_seconds == (step,)
            assert result.fullest_weight_bytes == weights and result.fullest_kv_bytes_per_sequence == kv
    rows = cost_table(LLAMA3_8B, H100, SPLIT_SCENARIO)["Quantity"].tolist()
    assert not any("fullest" in row or "Slowest" in row for row in rows)


def test_two_gpus_halve_the_weights_and_cache_per_gpu_and_double_the_hourly_price() -> None:
    one = estimate(LLAMA3_8B, H100, SPLIT_SCENARIO)
    two = estimate(LLAMA3_8B, H100, dataclasses.replace(SPLIT_SCENARIO, gpu_count=2))
    assert [share.layers for share in two.gpu_shares] == [range(0, 16), range(16, 32)]
    for share in two.gpu_shares:
        assert share.weight_bytes == one.weight_bytes / 2
        assert share.kv_bytes_per_sequence == one.kv_bytes_per_sequence / 2
    # Each GPU: (77,309,411,328 − 8,030,261,248) / 134,217,728 = 516.2 kept-quarter sequences, against 228 on one.
    assert two.sequences_per_gpu == (516, 516) and two.max_sequences == 516 and one.max_sequences == 228
    assert two.max_sequences == sequences_that_fit(
        H100.memory_bytes, one.weight_bytes / 2, one.kv_bytes_per_sequence / 2
    )
    # The GPUs take turns: a step and a prefill take as long as on one GPU, and both GPUs are paid for.
    assert two.decode_step_seconds == pytest.approx(one.decode_step_seconds, rel=1e-12)
    assert two.prefill_seconds == one.prefill_seconds
    assert two.cost_per_query == pytest.approx(2 * one.cost_per_query, rel=1e-12)
    assert two.slowest_stage_seconds == pytest.approx(one.decode_step_seconds / 2, rel=1e-12)
    # The batch two GPUs hold and one does not: priced only where it fits.
    crowded = dataclasses.replace(SPLIT_SCENARIO, batch=300)
    assert not estimate(LLAMA3_8B, H100, crowded).batch_fits
    assert estimate(LLAMA3_8B, H100, dataclasses.replace(crowded, gpu_count=2)).batch_fits


def test_the_fullest_gpu_limits_an_uneven_split() -> None:
    llama70 = MODEL_PRESETS["Llama-3-70B"]
    three = estimate(llama70, H100, dataclasses.replace(SPLIT_SCENARIO, gpu_count=3))
    weights = 2 * 70_553_706_496
    assert [len(share.layers) for share in three.gpu_shares] == [27, 27, 26]
    assert three.fullest_gpus == (0, 1) and three.fullest_gpu == 0 and three.fullest_layers == 27
    assert three.fullest_weight_bytes == pytest.approx(weights * 27 / 80)
    per_layer = 2_048 * 4_096  # a kept quarter of 8,192 tokens, 4,096 bytes per token and layer
    assert three.fullest_kv_bytes_per_sequence == 27 * per_layer
    assert three.max_sequences == sequences_that_fit(H100.memory_bytes, weights * 27 / 80, 27 * per_layer)
    assert three.sequences_per_gpu[2] > three.max_sequences  # the last GPU has a layer less, so more room
    assert three.slowest_gpus == (0, 1) and three.stage_seconds is not None
    assert three.stage_seconds[2] < three.stage_seconds[0]
    assert three.decode_step_seconds == pytest.approx(sum(three.stage_seconds))
    # Sliding layers make the cache uneven: Gemma-2's GPU 1 (layers 11 to 21) holds six full layers, GPU 0 five.
    gemma = MODEL_PRESETS["Gemma-2-9B (alternating sliding window)"]
    four = estimate(gemma, H100, Scenario(prompt_tokens=32_000, output_tokens=768, gpu_count=4))
    per_token = 2 * 8 * 256 * 2
    assert [share.kv_bytes_per_sequence for share in four.gpu_shares] == [
        (6 * 4_096 + 5 * 32_768) * per_token,
        (5 * 4_096 + 6 * 32_768) * per_token,
        (5 * 4_096 + 5 * 32_768) * per_token,
        (5 * 4_096 + 5 * 32_768) * per_token,
    ]
    assert four.fullest_gpu == 1 and four.max_sequences == four.sequences_per_gpu[1] < four.sequences_per_gpu[0]
    assert sum(share.kv_bytes_per_sequence for share in four.gpu_shares) == four.kv_bytes_per_sequence


def test_a_global_eviction_scope_gathers_every_layers_scores() -> None:
    # Each held slot's int64 ranking key (float32 score and position) of every layer and KV head, per sequence.
    assert global_scope_gather_bytes(LLAMA3_8B.arch, 7_168) == 32 * 8 * 7_168 * 8  # 14,680,064 bytes
    assert global_scope_count_bytes(LLAMA3_8B.arch) == 32 * 4  # a float32 count per layer
    # kvlab's heap holds every token on a sliding layer too, so the window does not shorten the gather.
    assert global_scope_gather_bytes(arch("Gemma-2-9B (alternating sliding window)"), 10_000) == 42 * 8 * 10_000 * 8
    assert global_scope_gather_bytes(arch("Llama-3-70B"), 1_000) == 10 * global_scope_gather_bytes(
        arch("Llama-3-70B"), 100
    )
    full, evicted = compare(LLAMA3_8B, H100, dataclasses.replace(SPLIT_SCENARIO, gpu_count=2))
    assert full.global_scope_gather_bytes is None and full.global_scope_count_bytes is None
    assert evicted.global_scope_gather_bytes == 14_680_064 and evicted.global_scope_count_bytes == 128
    rows = cost_table(LLAMA3_8B, H100, SPLIT_SCENARIO).set_index("Quantity")
    gathered = rows.loc["Global scope: scores gathered per compression, per sequence"]
    assert gathered["Full cache"] == NO_EVICTION and gathered["Evicted (keep 25%)"] == 14_680_064


def test_the_gather_counts_the_keys_the_global_scope_ranks_by() -> None:
    """The formula's bytes are those of the tensor :mod:`kvlab.cache.scopes` gathers: every layer's ranking keys."""
    import torch

    from kvlab.cache.ranking import by_score_then_position

    facts, tokens = LLAMA3_8B.arch, 100
    positions = torch.arange(tokens).expand(1, facts.num_kv_heads, tokens)
    keys = [
        by_score_then_position(torch.rand(1, facts.num_kv_heads, tokens), positions) for _ in range(facts.num_layers)
    ]
    gathered = torch.cat(keys, dim=-1)
    assert gathered.numel() * gathered.element_size() == global_scope_gather_bytes(facts, tokens)


def test_the_table_of_a_split_names_the_fullest_and_slowest_gpu() -> None:
    table = cost_table(LLAMA3_8B, H100, dataclasses.replace(SPLIT_SCENARIO, gpu_count=3)).set_index("Quantity")
    assert table.loc["Layers on the fullest GPU", "Full cache"] == 11  # 32 layers: 11, 11 and 10
    assert table.loc["Weights on the fullest GPU", "Full cache"] == pytest.approx(2 * 8_030_261_248 * 11 / 32)
    assert table.loc["KV per sequence on the fullest GPU", "Evicted (keep 25%)"] == 11 * 2_048 * 4_096
    step = table.loc["Decode step (time per token per sequence)", "Evicted (keep 25%)"]
    assert 0 < table.loc["Slowest GPU's part of a decode step", "Evicted (keep 25%)"] < step


def test_the_cost_calculator_prices_without_loading_torch():
    """Pricing a config needs no model: importing the calculator must not pull in torch (seconds of start-up)."""
    import subprocess
    import sys

    code = "import sys, kvlab.costs; print('torch' in sys.modules)"
    shown = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert shown == "False"
