"""The full cache of a model with sliding-window layers holds, and reports, only what its windows can see."""

from __future__ import annotations

import pytest
from tiny_models import prompt, tiny_gemma3

from kvlab.budget import Budget
from kvlab.engine.generation import Generation
from kvlab.engine.spec import RunSpec
from kvlab.models.loading import wrap_model
from kvlab.policies import make_policy

NEW_TOKENS = 6
WINDOW = 6


@pytest.fixture(scope="module")
def gemma3():
    model = tiny_gemma3()
    ids = prompt(length=30, seed=3)
    out = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)
    return wrap_model(model), ids, out[0, ids.shape[1] :].tolist()


def visible_bytes(loaded, seen: int) -> int:
    """The bytes of the tokens the model's layers can still see after ``seen`` tokens: ``window - 1`` on the sliding
    layers, all of them on the global one."""
    arch = loaded.arch
    per_token = 2 * arch.num_kv_heads * arch.head_dim * loaded.kv_bytes_per_element
    held = [min(seen, WINDOW - 1) if arch.is_sliding(layer) else seen for layer in range(arch.num_layers)]
    return per_token * sum(held)


@pytest.mark.parametrize("mode,chunk", [("prefill", None), ("prefill", 7), ("streaming", 7)])
def test_the_full_cache_holds_only_what_its_windows_see(gemma3, mode, chunk):
    loaded, ids, expected = gemma3
    spec = RunSpec(make_policy("full"), mode=mode, chunk=chunk, max_new_tokens=NEW_TOKENS, stop_token_ids=())
    generation = Generation(loaded, spec, ids)
    tokens = []
    for event in generation.events():
        assert event.kv_bytes == event.kv_bytes_full == visible_bytes(loaded, event.seen_tokens), event.kind
        assert event.kept_per_layer[0] == min(event.seen_tokens, WINDOW - 1)
        if event.kind == "decode":
            tokens.append(event.token_ids[0])
    assert tokens == expected
    result = generation.result()
    assert result.kv_bytes == result.kv_bytes_full


@pytest.mark.parametrize("mode", ["prefill", "streaming"])
def test_an_evicting_cache_never_holds_more_than_the_full_one(gemma3, mode):
    loaded, ids, _ = gemma3
    spec = RunSpec(make_policy("h2o"), Budget(tokens=20), mode=mode, chunk=8, max_new_tokens=NEW_TOKENS)
    compressed = mode == "streaming"  # prefill mode cuts the windows at its compression, as every budget
    for event in Generation(loaded, spec, ids).events():
        compressed = compressed or event.kind == "compress"
        assert not compressed or event.kv_bytes <= event.kv_bytes_full, event.kind
