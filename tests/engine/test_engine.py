"""The engine against transformers' own generation, on four architectures of tiny random-weight models."""

from __future__ import annotations

import time

import pytest
import torch
from tiny_models import ARCHITECTURES, prompt, runs_in, small_policy, tiny_model

from kvlab.budget import Budget
from kvlab.engine.generation import Generation, generate, prefill_once
from kvlab.engine.spec import RunSpec
from kvlab.models.loading import wrap_model
from kvlab.policies import evicting, make_policy

NEW_TOKENS = 8


def reference(model: torch.nn.Module, ids: torch.Tensor) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens and per-step logits of plain ``model.generate`` with the model's eager attention."""
    out = model.generate(
        ids,
        max_new_tokens=NEW_TOKENS,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        eos_token_id=None,
        pad_token_id=0,
    )
    return out.sequences[0, ids.shape[1] :].tolist(), torch.stack(out.logits, dim=1)[0]


@pytest.fixture(scope="module", params=ARCHITECTURES)
def arch_case(request):
    model = tiny_model(request.param)
    ids = prompt(length=40)
    tokens, logits = reference(model, ids)
    return request.param, wrap_model(model), ids, tokens, logits


def decode_logits(loaded, ids, spec) -> tuple[list[int], torch.Tensor]:
    """Tokens and the logits each one was chosen from."""
    generation = Generation(loaded, spec, ids)
    tokens, logits, last = [], [], None
    for event in generation.events():
        if event.kind == "decode":
            tokens.append(event.token_ids[0])
            logits.append(last[0])
        if event.logits is not None:
            last = event.logits
    return tokens, torch.stack(logits)


@pytest.mark.parametrize("mode,chunk", [("prefill", None), ("prefill", 9), ("streaming", 7)])
def test_full_matches_generate(arch_case, mode, chunk):
    _, loaded, ids, ref_tokens, ref_logits = arch_case
    spec = RunSpec(make_policy("full"), mode=mode, chunk=chunk, max_new_tokens=NEW_TOKENS, stop_token_ids=())
    tokens, logits = decode_logits(loaded, ids, spec)
    assert tokens == ref_tokens
    torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("policy", evicting())
def test_budget_at_least_length_matches_generate(arch_case, policy):
    _, loaded, ids, ref_tokens, ref_logits = arch_case
    budget = Budget(tokens=ids.shape[1] + NEW_TOKENS)
    for mode in runs_in(policy):
        spec = RunSpec(
            small_policy(policy),
            budget,
            mode=mode,
            chunk=8,
            max_new_tokens=NEW_TOKENS,
            stop_token_ids=(),
        )
        tokens, logits = decode_logits(loaded, ids, spec)
        assert tokens == ref_tokens, (policy, mode)
        torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=1e-4)


def test_full_matches_generate_on_a_batch():
    model = tiny_model("llama")
    ids = prompt(batch=3, length=30, seed=5)
    expected = [reference(model, ids[i : i + 1])[0] for i in range(3)]
    loaded = wrap_model(model)
    result = generate(loaded, ids, RunSpec(make_policy("full"), max_new_tokens=NEW_TOKENS, stop_token_ids=()))
    assert result.tokens == expected


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["prefill", "streaming"])
def test_the_engine_times_itself_and_not_its_consumer(mode):
    """Seconds are summed over the engine's events; a consumer that takes its time between events (a page
    drawing) does not add to them, and the result is the same whoever drains the events."""
    loaded = wrap_model(tiny_model("llama"))
    spec = RunSpec(small_policy("h2o"), Budget(tokens=12), mode=mode, chunk=8, max_new_tokens=5, stop_token_ids=())
    drained = generate(loaded, prompt(length=40), spec)  # also pays the process's first-eviction set-up
    generation = Generation(loaded, spec, prompt(length=40))
    pause, events = 0.2, []
    for event in generation.events():
        events.append(event)
        time.sleep(pause)
    result = generation.result()
    assert result.prefill_seconds == pytest.approx(sum(e.seconds for e in events if e.kind != "decode"))
    assert result.decode_seconds == pytest.approx(sum(e.seconds for e in events if e.kind == "decode"))
    assert all(e.seconds > 0 for e in events)
    assert result.prefill_seconds + result.decode_seconds < pause * len(events) / 2
    assert len(result.token_seconds) == len([e for e in events if e.kind == "decode"]) - 1
    assert result.tokens == drained.tokens
    assert result.tokens[0] == [token for e in events if e.kind == "decode" for token in e.token_ids]


def test_a_fork_of_a_shared_read_counts_the_read_as_a_separate_run_would():
    loaded = wrap_model(tiny_model("llama"))
    ids = prompt(length=40)
    policy = small_policy("snapkv")
    shared = prefill_once(loaded, ids, [policy], chunk=8)
    spec = RunSpec.of(policy, Budget(tokens=12), chunk=8, max_new_tokens=3, stop_token_ids=())
    forked = Generation(loaded, spec, prefilled=shared)
    events = list(forked.events())
    assert forked.result().prefill_seconds == pytest.approx(
        shared.seconds + sum(e.seconds for e in events if e.kind != "decode")
    )
    assert shared.seconds > 0 and [e.kind for e in events][0] == "compress"
