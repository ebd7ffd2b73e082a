"""Configurations that do not fit in memory get no time or price but the GPU count that would fit them, and pasted
configs of models that are not decoders are refused; checked in kvlab.costs, in the page's shaping and on the page."""

from __future__ import annotations

import json

import pytest
import transformers
from drawn_charts import drawn_charts
from test_pages import open_page, shown, widget
from transformers.models.auto.modeling_auto import (
    MODEL_FOR_MASKED_LM_MAPPING_NAMES,
    MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES,
)

from kvlab.costs import (
    DOES_NOT_FIT,
    GPU_PRESETS,
    MODEL_PRESETS,
    MOST_GPUS,
    Scenario,
    compare,
    cost_table,
    estimate,
    formatted_costs,
    gpu_shares,
    gpus_that_fit,
    sequences_per_gpu,
)
from kvlab.costs.models import ENCODER_DECODER_TYPES, ENCODER_ONLY_TYPES
from kvlab.dashboard import cost_view, inputs
from kvlab.errors import KvlabError
from kvlab.units import GIB

H100 = GPU_PRESETS["H100 SXM 80GB"]
LLAMA3_70B = MODEL_PRESETS["Llama-3-70B"]
LLAMA3_8B = MODEL_PRESETS["Llama-3-8B"]
WEIGHTS_70B = 2 * 70_553_706_496  # 141,107,412,992 bytes in bf16, 131 GiB
# 4,096 tokens of Llama-3-70B on H100s; one GPU cannot hold the weights (0.9 × 80 GiB = 77,309,411,328 bytes).
SHORT = Scenario(prompt_tokens=3_072, output_tokens=1_024, batch=8, keep_fraction=0.25)
# 128k tokens of Llama-3-70B on two H100s, 40 layers each: 6,755,704,832 bytes are left beside each GPU's half of
# the weights, which its half of one full sequence (21,474,836,480 bytes) exceeds and of one kept quarter
# (5,368,709,120 bytes) does not.
LONG_ON_TWO = Scenario(prompt_tokens=130_048, output_tokens=1_024, batch=1, keep_fraction=0.25, gpu_count=2)
TIMES_AND_PRICES = ("decode_step_seconds", "tokens_per_second", "prefill_seconds", "cost_per_query")


# --- the rule, in kvlab.costs -----------------------------------------------------------------------------------------


def test_fewest_gpus_by_hand() -> None:
    memory, arch = 80 * GIB, LLAMA3_70B.arch
    assert gpus_that_fit(arch, memory, WEIGHTS_70B, 4_096, "bf16") == 2  # 10 sequences fit on two GPUs
    # Three GPUs hold 27, 27 and 26 layers; the first: (77,309,411,328 − 141,107,412,992 × 27 / 80) / (27 × 4,096 ×
    # 4,096) = 29,685,659,443.2 / 452,984,832 = 65.5, so 11 to 65 sequences need three (pooled memory would say 67).
    assert gpus_that_fit(arch, memory, WEIGHTS_70B, 4_096, "bf16", sequences=11) == 3
    assert gpus_that_fit(arch, memory, WEIGHTS_70B, 4_096, "bf16", sequences=65) == 3
    assert gpus_that_fit(arch, memory, WEIGHTS_70B, 4_096, "bf16", sequences=66) == 4
    assert gpus_that_fit(LLAMA3_8B.arch, memory, 2 * 8_030_261_248, 8_192, "bf16") == 1
    assert gpus_that_fit(arch, memory, WEIGHTS_70B, 4_096, "bf16", most=1) is None
    assert gpus_that_fit(arch, memory, 1e15, 4_096, "bf16") is None  # a petabyte of weights: more than MOST_GPUS
    # A 24-layer model is split over 24 GPUs at most: 1e9 bytes of weights per layer exceed 0.9 GiB, which 27 GPUs'
    # pooled memory would hold.
    assert gpus_that_fit(MODEL_PRESETS["Qwen2.5-0.5B"].arch, 1 * GIB, 2.4e10, 1_024, "bf16") is None


@pytest.mark.parametrize("sequences", [1, 7, 100])
@pytest.mark.parametrize("reserve", [0.0, 0.1, 0.3])
def test_fewest_gpus_is_the_smallest_count_that_fits(sequences: int, reserve: float) -> None:
    arch = MODEL_PRESETS["Gemma-2-9B (alternating sliding window)"].arch  # 42 layers, half of them sliding

    def room(count: int, weights: float, tokens: int) -> int:
        shares = gpu_shares(arch, count, weights, tokens, "bf16")
        return min(sequences_per_gpu(24 * GIB, shares, reserve))

    for weights in (1e9, 5e10, 3e11):
        for tokens in (1_000, 20_000):
            count = gpus_that_fit(
                arch, 24 * GIB, weights, tokens, "bf16", reserve_fraction=reserve, sequences=sequences
            )
            if count is None:
                assert room(arch.num_layers, weights, tokens) < sequences
                continue
            assert room(count, weights, tokens) >= sequences
            assert count == 1 or room(count - 1, weights, tokens) < sequences


def test_llama_70b_on_one_80gb_gpu_has_no_time_or_price() -> None:
    one = estimate(LLAMA3_70B, H100, SHORT)
    assert not one.fits and one.max_sequences == 0
    assert all(getattr(one, field) is None for field in (*TIMES_AND_PRICES, "cost_per_million_tokens"))
    assert one.gpus_to_fit == 2
    on_two = estimate(LLAMA3_70B, H100, Scenario(**{**SHORT.__dict__, "gpu_count": one.gpus_to_fit}))
    assert on_two.fits and on_two.cost_per_query is not None and on_two.cost_per_query > 0
    # fp8 weights (70.6 GB) leave one GPU room for sequences; 141 GiB of H200 less its reserve do not hold bf16.
    assert estimate(LLAMA3_70B, H100, Scenario(**{**SHORT.__dict__, "weight_precision": "fp8"})).fits
    assert estimate(LLAMA3_70B, GPU_PRESETS["H200 141GB"], SHORT).gpus_to_fit == 2


def test_a_batch_may_need_more_gpus_than_one_sequence() -> None:
    result = estimate(LLAMA3_70B, H100, Scenario(**{**SHORT.__dict__, "keep_fraction": 1.0, "batch": 32}))
    assert result.gpus_to_fit == 2 and result.gpus_to_fit_batch == 3


def test_only_the_evicted_cache_fits() -> None:
    full, evicted = compare(LLAMA3_70B, H100, LONG_ON_TWO)
    assert full.kv_bytes_per_sequence == 42_949_672_960 and evicted.kv_bytes_per_sequence == 10_737_418_240
    assert not full.fits and evicted.fits and evicted.max_sequences == 1
    # Three GPUs: the first holds 27 layers, 47,623,751,884.8 bytes of weights and 27 × 131,072 × 4,096 =
    # 14,495,514,624 of the full cache, which its 77,309,411,328 bytes hold; two GPUs do not.
    assert full.gpus_to_fit == 3 and evicted.gpus_to_fit == 2
    assert full.cost_per_query is None and evicted.cost_per_query is not None


def test_bad_inputs_are_refused_even_when_nothing_fits() -> None:
    with pytest.raises(KvlabError, match="utilisation"):
        estimate(LLAMA3_70B, H100, Scenario(**{**SHORT.__dict__, "prefill_utilization": 0.0}))


def test_the_table_says_does_not_fit_instead_of_a_time_or_price() -> None:
    table = cost_table(LLAMA3_70B, H100, LONG_ON_TWO).set_index("Quantity")
    for row in ("Decode step (time per token per sequence)", "Prefill per query", "Cost per query"):
        assert table.loc[row, "Full cache"] == DOES_NOT_FIT
        assert isinstance(table.loc[row, "Evicted (keep 25%)"], float)
    assert table.loc["Fewest GPUs that hold one sequence", "Full cache"] == 3
    nothing = cost_table(LLAMA3_70B, H100, Scenario(prompt_tokens=10**7, output_tokens=1, kv_precision="fp32"))
    assert (
        nothing.set_index("Quantity").loc["Fewest GPUs that hold one sequence", "Full cache"]
        == f"more than {MOST_GPUS}"
    )


# --- what the page shows ----------------------------------------------------------------------------------------------


def test_sizes_are_written_in_binary_units() -> None:
    table = formatted_costs(cost_table(LLAMA3_70B, H100, SHORT)).set_index("Quantity")
    assert table.loc["KV per token, all layers", "Full cache"] == "320 KiB"
    assert table.loc["KV per sequence", "Full cache"] == "1.25 GiB"
    assert table.loc["KV per sequence", "Evicted (keep 25%)"] == "320 MiB"
    assert table.loc["Weights", "Full cache"] == "131 GiB"
    assert table.loc["Cost per query", "Full cache"] == DOES_NOT_FIT
    assert not any("$" in cell for cell in table.drop(columns="Unit").to_numpy().ravel())
    metrics = {metric.label: metric for metric in cost_view.cost_metrics(*compare(LLAMA3_70B, H100, SHORT))}
    assert metrics["KV per token"].value == "320 KiB"
    assert metrics["KV per sequence"].delta == "-960 MiB vs full"
    for label in ("Cost per query, computed", "Decode, computed"):
        assert metrics[label].value == cost_view.NO_VALUE and metrics[label].delta == DOES_NOT_FIT


def test_metrics_of_a_configuration_that_fits() -> None:
    full, evicted = compare(
        LLAMA3_8B, H100, Scenario(prompt_tokens=7_168, output_tokens=1_024, batch=8, keep_fraction=0.25)
    )
    metrics = {metric.label: metric for metric in cost_view.cost_metrics(full, evicted)}
    assert metrics["Sequences that fit"].value == "228" and metrics["Sequences that fit"].delta == "+171 vs full"
    assert metrics["Cost per query, computed"].value.startswith("$0.000")
    assert metrics["Cost per query, computed"].delta is not None and metrics[
        "Cost per query, computed"
    ].delta.startswith("-$")
    assert metrics["Decode, computed"].delta is not None and metrics["Decode, computed"].delta.startswith("-")


def test_the_bars_draw_no_price_for_what_does_not_fit() -> None:
    full, evicted = compare(LLAMA3_70B, H100, SHORT)
    figure = cost_view.cost_bars(full, evicted)
    assert list(figure.data[1].y) == [0, 0]  # no sequence fits
    for trace in figure.data[2:]:
        assert list(trace.y) == [None, None] and not any(trace.text)
    marks = [note.text for note in figure.layout.annotations if "does not" in note.text]
    assert len(marks) == 4  # two bars in each of the throughput and price panels
    kv_axis = figure.layout.yaxis
    assert kv_axis.ticktext and all(label.endswith(("MiB", "GiB")) for label in kv_axis.ticktext if label != "0 B")
    assert max(figure.data[0].y) == full.kv_bytes_per_sequence  # raw bytes, labelled by the axis
    assert list(figure.data[0].text) == ["1.25 GiB", "320 MiB"]


def test_only_eviction_fits_is_said_and_drawn() -> None:
    full, evicted = compare(LLAMA3_70B, H100, LONG_ON_TWO)
    notices = cost_view.fit_notices(full, evicted, LONG_ON_TWO, H100.name)
    assert [notice.level for notice in notices] == ["info"]
    assert "full cache does not fit on 2 × H100" in notices[0].text and "3 GPUs would hold it" in notices[0].text
    assert "eviction is what lets the model run" in notices[0].text
    figure = cost_view.cost_bars(full, evicted)
    assert figure.data[3].y[0] is None and figure.data[3].y[1] > 0
    price = {metric.label: metric for metric in cost_view.cost_metrics(full, evicted)}["Cost per query, computed"]
    assert price.value.startswith("$") and price.delta == f"full cache: {DOES_NOT_FIT}"


def test_notices_for_nothing_and_for_a_batch_that_does_not_fit() -> None:
    full, evicted = compare(LLAMA3_70B, H100, SHORT)
    (notice,) = cost_view.fit_notices(full, evicted, SHORT, H100.name)
    assert notice.level == "error" and notice.text.startswith("Does not fit: 1 × H100")
    assert "131 GiB of weights" in notice.text and "2 GPUs of this kind" in notice.text
    big_batch = Scenario(**{**SHORT.__dict__, "gpu_count": 2, "batch": 64})
    full, evicted = compare(LLAMA3_70B, H100, big_batch)
    levels = {notice.level: notice.text for notice in cost_view.fit_notices(full, evicted, big_batch, H100.name)}
    assert list(levels) == ["warning"]
    assert "A batch of 64 does not fit: only 40 sequences" in levels["warning"] and "3 GPUs" in levels["warning"]
    # A batch that fits only once evicted is said too.
    middle = Scenario(**{**SHORT.__dict__, "gpu_count": 2, "batch": 20})
    full, evicted = compare(LLAMA3_70B, H100, middle)
    (notice,) = cost_view.fit_notices(full, evicted, middle, H100.name)
    assert notice.level == "info" and notice.text.startswith("A batch of 20 fits only with eviction")


def test_a_pipeline_that_does_not_fit_names_the_gpu_that_runs_short() -> None:
    full_on_two = Scenario(**{**LONG_ON_TWO.__dict__, "keep_fraction": 1.0})
    full, evicted = compare(LLAMA3_70B, H100, full_on_two)
    (notice,) = cost_view.fit_notices(full, evicted, full_on_two, H100.name)
    assert notice.level == "error" and notice.text.startswith(
        "Does not fit: on 2 × H100 SXM 80GB, GPU 0 (layers 0–39 of 80) cannot hold its 65.7 GiB of weights, the 10% "
        "reserve and its 20.0 GiB part of one sequence's cache"
    )
    full, evicted = compare(LLAMA3_70B, H100, LONG_ON_TWO)
    (notice,) = cost_view.fit_notices(full, evicted, LONG_ON_TWO, H100.name)
    assert "on GPU 0 (layers 0–39 of 80), its 20.0 GiB part of one sequence's cache does not fit beside its " in (
        notice.text
    )


def test_the_split_says_which_gpus_limit_and_how_the_remainder_goes() -> None:
    uneven = Scenario(**{**SHORT.__dict__, "gpu_count": 3})
    full, evicted = compare(LLAMA3_70B, H100, uneven)
    summary = cost_view.split_summary(evicted)
    assert summary.startswith(
        "Computed, not measured: the 80 layers are split over 3 GPUs, the first 2 hold 27 consecutive layers each and "
        "the last holds 26 consecutive layers, since 3 does not divide 80."
    )
    assert f"GPUs 0 and 1 have room for the fewest sequences ({evicted.max_sequences:,} at keep 25%)" in summary
    assert evicted.slowest_stage_seconds is not None
    assert f"{evicted.slowest_stage_seconds * 1e3:,.2f} ms, on GPUs 0 and 1" in summary
    table = cost_view.gpu_split_table(full, evicted)
    assert table["Layers"].tolist() == ["0–26", "27–53", "54–79"]
    assert table["Limits"].tolist() == ["fullest, slowest", "fullest, slowest", ""]
    assert table["Sequences, full → keep 25%"].tolist()[2] == (
        f"{full.sequences_per_gpu[2]} → {evicted.sequences_per_gpu[2]}"
    )
    even = Scenario(**{**SHORT.__dict__, "gpu_count": 2})
    full, evicted = compare(LLAMA3_70B, H100, even)
    assert "Limits" not in cost_view.gpu_split_table(full, evicted).columns  # every GPU limits alike
    assert "Every GPU has room for" in cost_view.split_summary(evicted)
    assert "Every GPU's part of a step takes" in cost_view.split_summary(evicted)
    # 80 layers over 64 GPUs: the first 16 hold two layers, and are named as a range.
    wide = Scenario(**{**SHORT.__dict__, "gpu_count": 64})
    summary = cost_view.split_summary(estimate(LLAMA3_70B, H100, wide))
    assert "the first 16 hold 2 consecutive layers each and the other 48 hold 1 consecutive layer each" in summary
    assert "GPUs 0–15 have room for the fewest sequences" in summary


def test_the_scope_note_gives_the_gather_in_bytes_and_nothing_for_a_local_scope() -> None:
    on_two = Scenario(prompt_tokens=7_168, output_tokens=1_024, batch=8, keep_fraction=0.25, gpu_count=2)
    _, evicted = compare(LLAMA3_8B, H100, on_two)
    note = cost_view.scope_note(LLAMA3_8B.arch, evicted, on_two)
    assert note.startswith("Computed, not measured:")
    assert "32 layers × 8 KV heads × 7,168 prompt tokens × 8 bytes = 14.0 MiB per sequence" in note
    assert "(112 MiB for the batch of 8)" in note and "32 per-layer counts (128 B)" in note
    assert "With 2 GPUs" in note and "A local scope moves nothing" in note
    one = Scenario(**{**on_two.__dict__, "gpu_count": 1})
    assert "With one GPU the gather stays on the device" in cost_view.scope_note(
        LLAMA3_8B.arch, estimate(LLAMA3_8B, H100, one), one
    )
    full = Scenario(**{**on_two.__dict__, "keep_fraction": 1.0})
    assert "evicts nothing" in cost_view.scope_note(LLAMA3_8B.arch, estimate(LLAMA3_8B, H100, full), full)


def test_the_chart_has_a_guide() -> None:
    guide = cost_view.COST_BARS_GUIDE
    assert "does not fit" in guide.good and "does not fit" in guide.bad and "computed" in guide.axes


# --- pasted configs ---------------------------------------------------------------------------------------------------


def hub_file(config: transformers.PretrainedConfig, architectures: list[str]) -> str:
    """A config.json as ``save_pretrained`` writes it, with ``architectures`` as the hub files have them."""
    config.architectures = architectures
    return config.to_json_string()


@pytest.mark.parametrize(
    ("config", "heads"),
    [
        (transformers.LlamaConfig(num_key_value_heads=8), ["LlamaForCausalLM"]),
        (transformers.Qwen2Config(), ["Qwen2ForCausalLM"]),
        (transformers.MistralConfig(), ["MistralForCausalLM"]),
        (transformers.GPT2Config(), ["GPT2LMHeadModel"]),
        (transformers.BertConfig(is_decoder=True), ["BertLMHeadModel"]),  # BERT set up as a decoder
    ],
)
def test_decoders_are_priced(config: transformers.PretrainedConfig, heads: list[str]) -> None:
    text = hub_file(config, heads)
    assert "is_decoder" not in json.loads(text) or heads == ["BertLMHeadModel"]
    assert inputs.model_spec_from_json(text, 1.0).arch.num_layers == config.num_hidden_layers


@pytest.mark.parametrize(
    ("config", "heads", "reason"),
    [
        (transformers.BertConfig(), ["BertForMaskedLM"], "BertForMaskedLM, which reads its input in one pass"),
        (transformers.BertConfig(), [], "a bert model, an encoder"),
        (transformers.RobertaConfig(), ["RobertaForSequenceClassification"], "generates no tokens"),
        (transformers.LlamaConfig(), ["LlamaForSequenceClassification"], "has no KV cache to price"),
        (transformers.T5Config(), ["T5ForConditionalGeneration"], "encoder-decoder model \\(t5\\)"),
        (transformers.BartConfig(), ["BartForConditionalGeneration"], "encoder-decoder model \\(bart\\)"),
    ],
)
def test_models_that_are_not_decoders_are_refused(
    config: transformers.PretrainedConfig, heads: list[str], reason: str
) -> None:
    with pytest.raises(KvlabError, match=reason) as refusal:
        inputs.model_spec_from_json(hub_file(config, heads), 0.11)
    assert str(refusal.value).count(". ") == 0 and str(refusal.value).endswith(".")  # one sentence


def test_the_pasted_bert_config_of_the_finding() -> None:
    pasted = json.dumps(
        {
            "architectures": ["BertForMaskedLM"],
            "model_type": "bert",
            "is_decoder": False,
            "hidden_size": 768,
            "num_attention_heads": 12,
            "num_hidden_layers": 12,
        }
    )
    with pytest.raises(KvlabError, match="BertForMaskedLM"):
        inputs.model_spec_from_json(pasted, 0.11)


def test_refused_model_types_are_transformers_encoders_and_encoder_decoders() -> None:
    encoders = set(MODEL_FOR_MASKED_LM_MAPPING_NAMES) - set(MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES)
    assert ENCODER_ONLY_TYPES <= encoders
    assert ENCODER_DECODER_TYPES <= set(MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES)
    preset_types = {preset.config["model_type"] for preset in MODEL_PRESETS.values()}
    assert not (ENCODER_ONLY_TYPES | ENCODER_DECODER_TYPES) & preset_types


# --- the page ---------------------------------------------------------------------------------------------------------


@pytest.mark.model
@pytest.mark.slow
def test_the_page_says_70b_does_not_fit_one_gpu_and_fits_the_count_it_names(db) -> None:
    app = open_page("views/costs.py")
    widget(app.selectbox, "Preset").set_value("Llama-3-70B")  # the first "Preset" is the model's
    app.run()
    assert not app.exception, app.exception
    for label in ("Cost per query, computed", "Decode, computed"):
        assert widget(app.metric, label).value == cost_view.NO_VALUE
        assert widget(app.metric, label).delta == DOES_NOT_FIT
    error = shown(app.error[0].value)
    assert error.startswith("Does not fit: 1 × H100") and "2 GPUs of this kind" in error
    cells = app.table[0].value.drop(columns="Unit").to_numpy().ravel()
    assert DOES_NOT_FIT in cells and not any("$" in shown(str(cell)) for cell in cells)
    guides = [block.proto.popover.label for block in app.get("popover")]
    assert guides == ["How to read this"]
    assert any("**What is drawn.** Four panels" in text.value for text in app.markdown)

    assert not app.get("arrow_data_frame")  # no per-GPU table for one GPU
    assert "With one GPU the gather stays on the device" in shown(app.info[-1].value)

    widget(app.number_input, "GPUs (layers split over them)").set_value(2)
    app.run()
    assert not app.error
    assert widget(app.metric, "Cost per query, computed").value.startswith("$")
    assert widget(app.metric, "Sequences that fit").value != "0"
    assert any(header.value == "Across 2 GPUs" for header in app.subheader)
    per_gpu = app.dataframe[0].value
    assert per_gpu["GPU"].tolist() == ["0", "1"] and per_gpu["Layers"].tolist() == ["0–39", "40–79"]
    assert per_gpu["Weights"].tolist() == ["65.7 GiB", "65.7 GiB"]  # half of 131 GiB each
    assert any(
        "the 80 layers are split over 2 GPUs, 40 consecutive layers each" in shown(text.value) for text in app.caption
    )
    scope = shown(app.info[-1].value)
    assert scope.startswith("Computed, not measured: a global eviction scope") and "80 layers × 8 KV heads" in scope
    assert "A local scope moves nothing" in scope
    rows = [shown(row) for row in app.table[0].value.index]
    assert "Layers on the fullest GPU" in rows and "Slowest GPU's part of a decode step" in rows


@pytest.mark.model
def test_the_page_refuses_more_gpus_than_layers_in_one_sentence(db) -> None:
    app = open_page("views/costs.py")
    widget(app.selectbox, "Preset").set_value("Qwen2.5-0.5B")
    widget(app.number_input, "GPUs (layers split over them)").set_value(25)
    app.run()
    assert not app.exception, app.exception
    assert shown(app.error[0].value) == (
        "A pipeline gives every GPU at least one layer, so this model's 24 layers take between 1 and 24 GPUs, not 25."
    )
    assert not app.metric


@pytest.mark.model
def test_the_page_refuses_a_pasted_bert_config(db) -> None:
    app = open_page("views/costs.py")
    widget(app.radio, "From").set_value("pasted config.json")
    app.run()
    widget(app.text_area, "config.json").set_value(hub_file(transformers.BertConfig(), ["BertForMaskedLM"]))
    app.run()
    assert not app.exception, app.exception
    assert "BertForMaskedLM" in shown(app.error[0].value)
    assert not app.metric and not drawn_charts(app)
