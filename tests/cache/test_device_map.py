"""A model split by a device map, and the eviction scopes over its placement groups.

No GPU is needed: a tiny checkpoint is loaded with a map that puts half its decoder layers on the CPU and half on the
disk (accelerate reads those weights back at every forward), which gives two placement groups that both compute on
the CPU, so that a split run can be compared token for token with the same model in one piece."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tiny_models import prompt, save_tiny_checkpoint, tiny_model
from transformers import AutoConfig, LlamaForCausalLM

from kvlab.budget import Budget
from kvlab.cache.ranking import UNHELD
from kvlab.cache.scopes import global_budgets, local_budgets, split_counts, threshold_counts
from kvlab.cache.spec import ADAKV_SAFEGUARD, CacheOptions
from kvlab.cli import main
from kvlab.engine.events import Event
from kvlab.engine.eviction import eviction_keys
from kvlab.engine.generation import Generation, generate
from kvlab.engine.plan import spread
from kvlab.engine.spec import RunSpec
from kvlab.errors import KvlabError
from kvlab.models.loading import LoadedModel, load_model, parse_device_map, place_model, wrap_model
from kvlab.policies import configure, make_policy
from kvlab.runs.records import device_figures

LAYERS = 4
BUDGET = 12
#: Half the decoder layers (and the embedding) on the CPU, the other half (and the head) on the disk.
CPU_AND_DISK = {
    "model.embed_tokens": "cpu",
    "model.rotary_emb": "cpu",
    "model.layers.0": "cpu",
    "model.layers.1": "cpu",
    "model.layers.2": "disk",
    "model.layers.3": "disk",
    "model.norm": "disk",
    "lm_head": "disk",
}


@pytest.fixture(scope="module")
def four_layers(tmp_path_factory) -> Path:
    """A tiny Llama checkpoint of four decoder layers, with a tokenizer."""
    directory = tmp_path_factory.mktemp("four-layers")
    save_tiny_checkpoint(directory)
    config = AutoConfig.from_pretrained(directory)
    config.num_hidden_layers = LAYERS
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def whole(four_layers) -> LoadedModel:
    return load_model(str(four_layers), device="cpu")


@pytest.fixture(scope="module")
def split(four_layers, tmp_path_factory) -> LoadedModel:
    return load_model(str(four_layers), device_map=CPU_AND_DISK, offload_folder=tmp_path_factory.mktemp("offload"))


def ids(batch: int = 2, length: int = 48) -> torch.Tensor:
    return prompt(batch, length) % 250 + 3


def compressed(loaded: LoadedModel, policy_text: str, **params: object) -> tuple[Event, Generation]:
    """The compression event of a prefill-mode run of ``policy`` (window 4) at :data:`BUDGET` tokens."""
    policy = configure(policy_text, window=4, **params)
    generation = Generation(loaded, RunSpec.of(policy, Budget(tokens=BUDGET), max_new_tokens=0), ids())
    events = [event for event in generation.events() if event.kind == "compress"]
    return events[0], generation


def test_a_map_of_cpu_and_disk_places_two_groups_that_run_on_the_cpu(split, whole):
    assert split.layer_groups == ("cpu", "cpu", "disk", "disk")
    assert split.layer_devices == (torch.device("cpu"),) * LAYERS
    assert split.devices == (torch.device("cpu"),) and split.device == torch.device("cpu")
    assert split.split and not whole.split
    assert split.device_kind == "cpu: 2 layers + disk: 2 layers" and whole.device_kind == "cpu"
    assert split.placement() == split.device_kind and whole.placement() == "cpu"
    assert whole.layer_groups == ("cpu",) * LAYERS


@pytest.mark.parametrize(
    ("name", "params", "mode"),
    [
        ("full", {}, "prefill"),
        ("snapkv", {"window": 4}, "prefill"),
        ("h2o", {}, "streaming"),
        ("random", {}, "streaming"),
        ("snapkv", {"window": 4, "scope": "global", "noise": "gaussian", "noise_scale": 0.5}, "prefill"),
    ],
)
def test_a_split_model_generates_what_the_whole_model_generates(split, whole, name, params, mode):
    policy = configure(name, **params)
    spec = RunSpec.of(policy, None if name == "full" else Budget(tokens=BUDGET), mode=mode, chunk=16, max_new_tokens=6)
    on_two, on_one = generate(split, ids(), spec), generate(whole, ids(), spec)
    assert on_two.tokens == on_one.tokens
    assert on_two.kept_per_layer == on_one.kept_per_layer
    assert on_two.kv_bytes == on_one.kv_bytes


def test_a_run_reports_its_bytes_per_device(split):
    result = generate(split, ids(), RunSpec(make_policy("h2o"), Budget(tokens=BUDGET), max_new_tokens=4))
    assert result.device == "cpu"
    assert result.kv_bytes_per_device == {"cpu": result.kv_bytes}
    assert result.kv_reserved_bytes_per_device == {"cpu": result.kv_reserved_bytes}
    assert result.peak_gpu_bytes is None and result.peak_gpu_bytes_per_device is None
    figures = result.to_json()
    for key in ("kv_bytes_per_device", "kv_reserved_bytes_per_device", "peak_gpu_bytes_per_device", "scope_seconds"):
        assert key in figures


@pytest.mark.parametrize("allocation", ["preset", "cake"])
def test_each_group_keeps_its_own_total_in_the_local_scope(split, whole, allocation):
    event, generation = compressed(split, "snapkv", layer_allocation=allocation)
    kept = event.kept_per_layer
    assert sum(kept[:2]) == 2 * BUDGET and sum(kept[2:]) == 2 * BUDGET
    assert generation.scope_seconds == 0.0
    if allocation == "preset":  # each group spreads its own total: 80/20 over its two layers
        assert kept[0] > kept[1] and kept[2] > kept[3]
        whole_event, _ = compressed(whole, "snapkv", layer_allocation=allocation)
        assert sum(whole_event.kept_per_layer) == LAYERS * BUDGET
        assert whole_event.kept_per_layer != kept


def test_the_local_scope_of_one_group_is_the_allocation_itself(four_layers, whole):
    one_group = load_model(str(four_layers), device_map={"": "cpu"})
    assert one_group.layer_groups == ("cpu",) * LAYERS and not one_group.split
    spec = RunSpec.of(configure("snapkv", window=4, layer_allocation="preset"), Budget(tokens=BUDGET), max_new_tokens=5)
    on_map, plain = generate(one_group, ids(), spec), generate(whole, ids(), spec)
    assert on_map.tokens == plain.tokens and on_map.kept_per_layer == plain.kept_per_layer
    assert configure("snapkv", scope="local").params() == make_policy("snapkv").params()
    assert configure("snapkv", scope="global").params()["scope"] == "global"


def test_the_global_scope_keeps_the_total_over_all_layers(split):
    event, generation = compressed(split, "snapkv", scope="global")
    minimum = make_policy("snapkv", window=4).min_budget()
    assert sum(event.kept_per_layer) == LAYERS * BUDGET
    assert all(minimum <= kept <= 48 for kept in event.kept_per_layer)
    assert generation.scope_seconds > 0.0


def test_ranking_for_the_global_scope_leaves_the_noise_to_the_eviction(whole):
    policy = configure("snapkv", window=4, scope="global", noise="gaussian", noise_scale=1.0)
    generation = Generation(whole, RunSpec.of(policy, Budget(tokens=BUDGET), max_new_tokens=0), ids())
    for event in generation.read(generation.input_ids, 0):
        pass
    before = {device: g.get_state() for device, g in generation.generators.items()}
    first = eviction_keys(policy.policy, generation.layer_views(), generation.cache)
    again = eviction_keys(policy.policy, generation.layer_views(), generation.cache)
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert all(torch.equal(g.get_state(), before[device]) for device, g in generation.generators.items())


def test_one_threshold_over_all_layers_follows_the_scores():
    # two layers, one sequence, one KV head: layer 0's tokens all score above layer 1's
    positions = torch.arange(10, dtype=torch.int64)
    high = (1000 + positions).view(1, 1, -1) << 32 | positions
    low = positions.view(1, 1, -1) << 32 | positions
    kept = threshold_counts([high, low], keep=8, device=torch.device("cpu"))
    assert kept == [8.0, 0.0]
    budgets = split_counts(kept, budget=4, minimum=2, capacity=10)
    assert budgets == [6, 2] and sum(budgets) == 2 * 4
    assert budgets != [4, 4]  # what a uniform allocation keeps
    # free slots never count, and a layer holding fewer than the threshold reaches keeps everything it holds
    free = low.masked_fill(positions.view(1, 1, -1) >= 3, UNHELD)
    assert threshold_counts([high, free], keep=12, device=torch.device("cpu")) == [10.0, 2.0]
    # the counts are means over sequences and KV heads; the budgets sum exactly
    scattered = torch.stack([high[0, 0], low[0, 0]]).view(2, 1, 10)  # sequence 0 favours layer 0's slots, ...
    swapped = torch.stack([low[0, 0], high[0, 0]]).view(2, 1, 10)  # ... sequence 1 layer 1's
    assert threshold_counts([scattered, swapped], keep=8, device=torch.device("cpu")) == [4.0, 4.0]
    assert sum(split_counts([5.5, 3.2, 3.3], budget=4, minimum=1, capacity=30)) == 12


def test_local_budgets_split_each_group_by_its_own_measurements():
    policy = configure("snapkv", window=4, layer_allocation="cake")
    measured = [4.0, 1.0, 1.0, 1.0]
    groups = ("0", "0", "1", "1")

    def spread_for(layers: int, own) -> list[int]:
        return spread(policy.policy, policy.options, 20, layers, 100, own)

    budgets = local_budgets(spread_for, groups, measured)
    assert sum(budgets[:2]) == 40 and budgets[2:] == [20, 20]  # group 1's layers measure the same
    assert budgets[:2] == spread_for(2, measured[:2])
    whole = local_budgets(spread_for, ("0",) * 4, measured)
    assert whole == spread_for(4, measured) and whole != budgets


def test_placing_a_model_built_in_memory_goes_through_the_same_map(tmp_path):
    model = tiny_model("llama")  # three decoder layers: the first on the CPU, the others on the disk
    reference = wrap_model(tiny_model("llama"))
    layout = {name: device for name, device in CPU_AND_DISK.items() if name != "model.layers.3"}
    layout["model.layers.1"] = "disk"
    placed = wrap_model(place_model(model, layout, offload_folder=tmp_path / "offload"))
    assert placed.layer_groups == ("cpu", "disk", "disk") and placed.device == torch.device("cpu")
    spec = RunSpec(make_policy("h2o"), Budget(tokens=10), max_new_tokens=4)
    tokens = prompt(1, 30)
    assert generate(placed, tokens, spec).tokens == generate(reference, tokens, spec).tokens
    assert not wrap_model(place_model(tiny_model("llama"), "auto")).split  # no GPU: everything on the CPU


@pytest.mark.parametrize(
    ("device_map", "says"),
    [
        ("everywhere", "Unknown device map 'everywhere'"),
        ('{"model.layers.0": 7}', "on GPU 7, but this machine has"),
        ('{"model.layers.0": "tpu"}', "a device is a GPU index, cuda:N, cpu or disk"),
        ('{"model.layers.0": "cpu",', "not valid JSON"),
        ("[0, 1]", "is a JSON object mapping module names to devices"),
        ('{"model.decoder.0": "cpu"}', "Entry 1 of the device map names no module of this model"),
        ('{"model.layers.0": "cpu"}', "gives no device to 'model.embed_tokens.weight' and"),
    ],
)
def test_a_bad_device_map_is_one_sentence(four_layers, device_map, says):
    if "GPU 7" in says and torch.cuda.device_count() > 7:
        pytest.skip("this machine has a GPU 7")
    with pytest.raises(KvlabError) as error:
        load_model(str(four_layers), device_map=device_map)
    assert says in str(error.value) and "\n" not in str(error.value)


def test_a_device_map_file_is_never_echoed(four_layers, tmp_path):
    secret = tmp_path / "settings.json"
    secret.write_text('{"api_token": "sk-live-123456", "model.layers.0": "cpu"}')
    with pytest.raises(KvlabError) as error:
        load_model(str(four_layers), device_map=str(secret))
    assert "sk-live" not in str(error.value) and "api_token" not in str(error.value)
    assert "Entry 1 of the device map does not name a device" in str(error.value)


def test_a_device_map_file_and_a_device_map_on_the_command_line(four_layers, tmp_path, capsys):
    map_file = tmp_path / "map.json"
    map_file.write_text(json.dumps(CPU_AND_DISK), encoding="utf-8")
    assert parse_device_map(str(map_file)) == CPU_AND_DISK
    assert parse_device_map(" Balanced ") == "balanced"
    assert parse_device_map({"model": "cuda:0"} if torch.cuda.is_available() else {"model": "CPU"}) in (
        {"model": 0},
        {"model": "cpu"},
    )
    with pytest.raises(KvlabError, match="not both"):
        load_model(str(four_layers), device="cpu", device_map="auto")
    status = main(["generate", "--model", str(four_layers), "--device-map", "nowhere", "--prompt", "the cache"])
    error = capsys.readouterr().err.strip()
    assert status == 2 and "Unknown device map 'nowhere'" in error and len(error.splitlines()) == 1


@pytest.mark.parametrize(
    ("params", "mode", "says"),
    [
        ({"scope": "global"}, "streaming", "uses the global eviction scope, set once at prefill mode's compression"),
        ({"scope": "global", "layer_allocation": "preset"}, "prefill", "takes layer_allocation='uniform'"),
        ({"scope": "everywhere"}, "prefill", "must be one of 'local', 'global'"),
    ],
)
def test_scope_misuse_is_one_sentence(params, mode, says):
    with pytest.raises(KvlabError) as error:
        RunSpec.of(configure("snapkv", **params), Budget(tokens=BUDGET), mode=mode)
    assert says in str(error.value) and "\n" not in str(error.value)
    with pytest.raises(KvlabError, match="no budgets of its own"):
        configure("pyramidkv", scope="global")


def test_a_trial_stores_the_bytes_of_each_device_only_when_there_are_several():
    assert device_figures({"cpu": 1000}, size=2) == {}
    stored = device_figures({"cuda:0": 1000, "cuda:1": 600}, size=2)
    assert json.loads(stored["device_bytes"]) == {"cuda:0": 500, "cuda:1": 300}


def test_a_threshold_over_pooled_heads_ranks_every_heads_scores_together():
    """Two layers, two KV heads: head 0 of layer 0 scores above everything else. Per head, each head's own top
    keeps half of each layer; pooled, layer 0's strong head takes the entries and the split keeps them exactly."""
    positions = torch.arange(6, dtype=torch.int64)
    strong, weak = (1000 + positions) << 32 | positions, positions << 32 | positions
    layer_0 = torch.stack([strong, weak]).view(1, 2, 6)
    layer_1 = torch.stack([weak, weak]).view(1, 2, 6)
    cpu = torch.device("cpu")
    assert threshold_counts([layer_0, layer_1], keep=6, device=cpu) == [4.5, 1.5]
    pooled = threshold_counts([layer_0, layer_1], keep=6, device=cpu, pool_heads=True)
    assert [count * 2 for count in pooled] == [8.0, 4.0]  # head 0's six, then the weak ties at the cut
    budgets, entries = global_budgets([layer_0, layer_1], budget=3, minimum=2, capacity=6, device=cpu, pool_heads=True)
    assert entries is not None and sum(entries) == 2 * 2 * 3 and entries[0] > entries[1]
    assert budgets == [-(-count // 2) for count in entries]
    assert global_budgets([layer_0, layer_1], budget=3, minimum=2, capacity=6, device=cpu)[1] is None


def test_a_policys_published_cache_options_are_its_default_and_named_options_override_them():
    kvzip = configure("kvzip")
    assert (kvzip.options.scope, kvzip.options.head_allocation, kvzip.options.head_floor) == ("global", "adakv", 0.0)
    assert kvzip.options.head_safeguard() == 0.0
    local = configure("kvzip", scope="local")
    assert (local.options.scope, local.options.head_allocation) == ("local", "adakv")
    assert RunSpec(make_policy("kvzip"), Budget(tokens=8)).cache.options == kvzip.options
    assert RunSpec.of(make_policy("kvzip"), Budget(tokens=8)).cache.options == kvzip.options
    h2o = configure("h2o")
    assert h2o.options == CacheOptions() and h2o.options.head_safeguard() is None
    assert configure("h2o", head_allocation="adakv").options.head_safeguard() == ADAKV_SAFEGUARD
    assert "head_floor" not in configure("h2o", head_allocation="adakv").params()  # at its default: not stored
