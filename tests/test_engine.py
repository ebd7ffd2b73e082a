"""The engine against transformers' own generation, on four architectures of tiny random-weight models."""

from __future__ import annotations

import pytest
import torch

from kvlab.budget import Budget
from kvlab.engine import Generation, RunSpec, generate
from kvlab.models import wrap_model
from kvlab.policies import POLICIES, make_policy
from tiny_models import ARCHITECTURES, prompt, tiny_model

NEW_TOKENS = 8
SMALL_WINDOW = {"snapkv": {"window": 4}, "pyramidkv": {"window": 4}}


def reference(model: torch.nn.Module, ids: torch.Tensor) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens and per-step logits of plain ``model.generate`` with the model's eager attention."""
    out = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, output_logits=True,
                         return_dict_in_generate=True, eos_token_id=None, pad_token_id=0)
    return out.sequences[0, ids.shape[1]:].tolist(), torch.stack(out.logits, dim=1)[0]


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


@pytest.mark.parametrize("policy", sorted(set(POLICIES) - {"full"}))
def test_budget_at_least_length_matches_generate(arch_case, policy):
    _, loaded, ids, ref_tokens, ref_logits = arch_case
    budget = Budget(tokens=ids.shape[1] + NEW_TOKENS)
    for mode in ("prefill", "streaming"):
        spec = RunSpec(make_policy(policy, **SMALL_WINDOW.get(policy, {})), budget, mode=mode, chunk=8,
                       max_new_tokens=NEW_TOKENS, stop_token_ids=())
        tokens, logits = decode_logits(loaded, ids, spec)
        assert tokens == ref_tokens, (policy, mode)
        torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=1e-4)


def test_full_matches_generate_on_a_batch():
    model = tiny_model("llama")
    ids = prompt(batch=3, length=30, seed=5)
    expected = [reference(model, ids[i:i + 1])[0] for i in range(3)]
    loaded = wrap_model(model)
    result = generate(loaded, ids, RunSpec(make_policy("full"), max_new_tokens=NEW_TOKENS, stop_token_ids=()))
    assert result.tokens == expected
