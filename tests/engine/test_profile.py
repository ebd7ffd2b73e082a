"""Attention profiles: measured against eager attention, stored and found again, refused in one sentence, and the
``kvlab profile`` command; the profile figure."""

import json
import math

import pytest
import torch
from tiny_models import tiny_model
from transformers import AutoModelForCausalLM

from kvlab.cache.allocation import CAKE_WINDOW
from kvlab.cli import main
from kvlab.dashboard.allocation_figures import ALLOCATION_GUIDE, allocation_figure, profile_budgets
from kvlab.engine.profile import measure_profile
from kvlab.errors import KvlabError
from kvlab.models.loading import load_model, wrap_model
from kvlab.models.profiles import (
    SHIPPED_PROFILES_DIR,
    Profile,
    load_profile,
    require_profile,
    save_profile,
    user_profiles_dir,
)

TEXT = "The cache keeps the tokens that matter, and evicts the rest when the budget is spent. " * 40


def hand_made(weights_hash: str = "ab" * 32, entropy=(1.0, 2.0, 3.0)) -> Profile:
    layers = len(entropy)
    return Profile(
        model="hand-made",
        weights_hash=weights_hash,
        tokenizer_hash=None,
        text="t",
        text_sha256="0" * 64,
        tokens=300,
        chunk=256,
        device="cpu",
        dtype="float32",
        kvlab_version="0",
        entropy=tuple(entropy),
        head_entropy=tuple((value, value) for value in entropy),
        cake_window=CAKE_WINDOW,
        cake_dispersion=(1.0,) * layers,
        cake_shift=tuple(0.1 * (layer + 1) for layer in range(layers)),
    )


def test_a_profile_is_the_mean_entropy_of_eager_attention(checkpoint):
    loaded = load_model(checkpoint, device="cpu")
    tokens, chunk = 160, 64
    profile = measure_profile(loaded, TEXT, "repeated", tokens=tokens, chunk=chunk)
    ids = torch.tensor([loaded.tokenizer(TEXT).input_ids[:tokens]])
    eager = AutoModelForCausalLM.from_pretrained(checkpoint, attn_implementation="eager").eval()
    with torch.no_grad():
        attentions = eager(ids, output_attentions=True).attentions  # (1, heads, queries, keys) per layer
    for layer, probs in enumerate(attentions):
        rows = probs[0, :, chunk:].double()  # the queries after the first chunk
        per_head = -(rows.xlogy(rows)).sum(-1).mean(-1)
        assert profile.entropy[layer] == pytest.approx(float(per_head.mean()), rel=1e-4)
        assert profile.head_entropy[layer] == pytest.approx(per_head.reshape(2, 2).mean(-1).tolist(), rel=1e-4)
        window = probs[0, :, -CAKE_WINDOW:, : tokens - CAKE_WINDOW].double()
        assert profile.cake_dispersion[layer] == pytest.approx(float(-(window.xlogy(window)).sum()), rel=1e-4)
        assert profile.cake_shift[layer] == pytest.approx(float(window.var(dim=1).sum()), rel=1e-4)
    assert profile.tokens == tokens and profile.weights_hash == loaded.weights_hash
    assert 0 < min(profile.entropy) and max(profile.entropy) < math.log(tokens)


def test_a_profile_is_found_again_by_its_weights_hash(tmp_path):
    env = {"KVLAB_PROFILES": str(tmp_path / "profiles")}
    profile = hand_made()
    assert load_profile(profile.weights_hash, env) is None
    path = save_profile(profile, user_profiles_dir(env) / profile.file_name)
    assert path.name == profile.weights_hash[:16] + ".json"
    found = load_profile(profile.weights_hash, env)
    assert found == profile and found.digest() == profile.digest()
    assert hand_made(entropy=(1.0, 2.0, 3.5)).digest() != profile.digest()


def test_a_damaged_profile_is_one_sentence(tmp_path):
    env = {"KVLAB_PROFILES": str(tmp_path)}
    profile = hand_made()
    path = tmp_path / profile.file_name
    for content in ("{", json.dumps({**profile.to_json(), "entropy": [1.0, -2.0, 3.0]})):
        path.write_text(content)
        with pytest.raises(KvlabError, match=rf"^(The attention profile|The file) {path} .*\.$"):
            load_profile(profile.weights_hash, env)


def test_the_entropy_allocation_without_a_profile_names_the_command(tmp_path):
    loaded = wrap_model(tiny_model("llama"))
    with pytest.raises(KvlabError, match=r"measure it with `kvlab profile --model in-memory`\.$"):
        require_profile(loaded, {"KVLAB_PROFILES": str(tmp_path)})


@pytest.mark.model
def test_the_shipped_model_has_a_shipped_profile(shipped, tmp_path):
    profile = load_profile(shipped.weights_hash, {"KVLAB_PROFILES": str(tmp_path)})
    assert profile is not None and profile.num_layers == shipped.arch.num_layers
    assert (SHIPPED_PROFILES_DIR / profile.file_name).is_file()
    assert all(len(heads) == shipped.arch.num_kv_heads for heads in profile.head_entropy)


@pytest.mark.model
def test_the_command_writes_a_profile_of_the_shipped_model(shipped, tmp_path, capsys):
    assert main(["profile", "--tokens", "300", "--out", f"{tmp_path}/", "--device", "cpu"]) == 0
    printed = capsys.readouterr()
    path = tmp_path / f"{shipped.weights_hash[:16]}.json"
    profile = load_profile(shipped.weights_hash, {"KVLAB_PROFILES": str(tmp_path)})
    assert profile is not None and profile.tokens == 300 and profile.model == "kvlab-tiny-llama"
    assert path.is_file() and str(path) in printed.err
    rows = printed.out.splitlines()[1:]
    assert [float(row.split()[1]) for row in rows] == pytest.approx(profile.entropy, abs=5e-4)


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["--tokens", "10"], "--tokens must be at least 257, not 10"),
        (["--text", "/nonexistent/text.txt"], "Cannot read the text file /nonexistent/text.txt"),
        (["--out", "/dev/null/profile.json"], "Cannot write the attention profile under /dev/null"),
    ],
)
def test_the_command_refuses_bad_input_in_one_sentence(arguments, message, capsys):
    assert main(["profile", *arguments]) == 2
    error = capsys.readouterr().err
    assert message in error and len(error.strip().splitlines()) == 1


def test_the_figure_draws_the_entropy_and_each_allocation():
    profile = hand_made(entropy=(1.0, 2.0, 3.0, 4.0, 0.5))
    figure = allocation_figure(profile, 100, minimum=9)
    assert [trace.name for trace in figure.data] == ["entropy", "uniform", "preset", "entropy", "cake"]
    assert list(figure.data[0].y) == list(profile.entropy)
    budgets = profile_budgets(profile, 100, minimum=9)
    assert list(figure.data[3].y) == budgets["entropy"]
    by_entropy = sorted(range(5), key=lambda layer: profile.entropy[layer])
    assert by_entropy == sorted(range(5), key=lambda layer: budgets["entropy"][layer])
    assert all(sum(values) == 500 for values in budgets.values())
    assert budgets["cake"] == sorted(budgets["cake"])  # the shift grows with depth, the dispersion does not
    assert "No attention profile" in allocation_figure(None, 100).layout.annotations[0].text
    assert ALLOCATION_GUIDE.axes and ALLOCATION_GUIDE.good and ALLOCATION_GUIDE.bad
