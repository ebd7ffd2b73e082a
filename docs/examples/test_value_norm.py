"""Tests of the guide's example policy, on a tiny random-weight Llama built from its config: nothing is downloaded,
and the tests run on a CPU in seconds."""

# --8<-- [start:setup]
from __future__ import annotations

import importlib

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kvlab.budget import Budget
from kvlab.engine.generation import Generation, generate
from kvlab.engine.spec import RunSpec
from kvlab.errors import KvlabError
from kvlab.models.loading import wrap_model
from kvlab.policies import POLICIES, make_policy

# --8<-- [end:setup]

# --8<-- [start:fixtures]
BUDGET, SINKS, LENGTH = 12, 2, 40


@pytest.fixture(scope="module")
def policy_module():
    """The example module, imported (and so its policy registered) only when these tests run."""
    return importlib.import_module("value_norm")


@pytest.fixture(scope="module")
def tiny():
    """A random 3-layer Llama with grouped-query attention (4 query and 2 KV heads), the value norms of a random
    prompt per layer, ``(batch, kv_heads, length)``, read from its value projections, and the model wrapped by kvlab."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        attn_implementation="eager",
    )
    model = LlamaForCausalLM(config).eval()
    ids = torch.randint(3, config.vocab_size, (2, LENGTH), generator=torch.Generator().manual_seed(1))
    norms: list[torch.Tensor] = []

    def keep_norms(module, inputs, output):  # (batch, length, kv_heads * head_dim) -> (batch, kv_heads, length)
        norms.append(output.view(*output.shape[:2], config.num_key_value_heads, -1).norm(dim=-1).transpose(1, 2))

    hooks = [layer.self_attn.v_proj.register_forward_hook(keep_norms) for layer in model.model.layers]
    with torch.no_grad():
        model(input_ids=ids)
    for hook in hooks:
        hook.remove()
    return wrap_model(model), ids, norms


# --8<-- [end:fixtures]


# --8<-- [start:tests]
def test_the_policy_is_registered_and_checks_its_parameters(policy_module):
    assert POLICIES["value_norm"] is policy_module.ValueNorm
    assert make_policy("value_norm", sinks=SINKS).sinks == SINKS
    with pytest.raises(KvlabError, match="sinks"):
        make_policy("value_norm", sinks=-1)


def test_prefill_keeps_the_sinks_and_the_largest_values(policy_module, tiny):
    loaded, ids, norms = tiny
    spec = RunSpec(make_policy("value_norm", sinks=SINKS), Budget(tokens=BUDGET), mode="prefill", max_new_tokens=1)
    compressed = next(event for event in Generation(loaded, spec, ids).events() if event.kind == "compress")
    for layer, kept in enumerate(compressed.survivors()):  # (batch, kv_heads, BUDGET) original positions
        ranked = norms[layer][..., SINKS:].topk(BUDGET - SINKS, dim=-1).indices + SINKS
        expected = torch.cat([torch.arange(SINKS).expand(*ranked.shape[:2], SINKS), ranked], dim=-1)
        assert torch.equal(kept.long(), expected.sort(dim=-1).values)


@pytest.mark.parametrize("mode", ["prefill", "streaming"])
def test_every_layer_holds_its_budget_and_a_covering_budget_is_the_full_cache(policy_module, tiny, mode):
    loaded, ids, _ = tiny
    policy = make_policy("value_norm", sinks=SINKS)
    spec = RunSpec.of(policy, Budget(tokens=BUDGET), mode=mode, chunk=8, max_new_tokens=4, stop_token_ids=())
    for event in Generation(loaded, spec, ids).events():
        if event.kind == "compress" or (mode == "streaming" and event.seen_tokens >= BUDGET):
            assert all(((kept >= 0).sum(dim=-1) == BUDGET).all() for kept in event.survivors())
    covering = RunSpec.of(policy, Budget(tokens=LENGTH + 8), mode=mode, chunk=8, max_new_tokens=4, stop_token_ids=())
    full = RunSpec(make_policy("full"), mode=mode, chunk=8, max_new_tokens=4, stop_token_ids=())
    assert generate(loaded, ids, covering).tokens == generate(loaded, ids, full).tokens


# --8<-- [end:tests]
