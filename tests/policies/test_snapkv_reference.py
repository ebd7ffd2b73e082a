"""SnapKV keeps what the reference code keeps: the window's own votes are never pooled into the tokens before it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvlab.budget import Budget
from kvlab.engine.generation import Generation
from kvlab.engine.spec import RunSpec
from kvlab.models.loading import wrap_model
from kvlab.policies import make_policy
from tests.tiny_models import prompt, tiny_model

TOKENS, WINDOW, BUDGET = 12, 4, 8


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", seed=3)


@pytest.fixture(scope="module")
def eager():
    """The same weights with transformers' eager attention, whose probabilities the reference code reads."""
    return tiny_model("llama", seed=3)


def compressed(model, policy) -> tuple[Generation, list[torch.Tensor]]:
    """The generation after prefill mode's compression, and before it, each layer's scores as the policy ranks them."""
    generation = Generation(
        wrap_model(model), RunSpec.of(policy, Budget(tokens=BUDGET), max_new_tokens=0), prompt(length=TOKENS)
    )
    steps = generation.events()
    next(steps)  # the prompt read, not yet compressed
    scores = [policy.score(view) for view in generation.layer_views()]
    for _ in steps:
        pass
    return generation, scores


def reference_kept(eager, kernel: int, pooling: str) -> list[list[set[int]]]:
    """What ``SnapKVCluster.update_kv`` of the reference code keeps, per layer and KV head, from the model's eager
    attention: the window's attention summed over its queries for the tokens before it only, pooled, the top
    ``BUDGET - WINDOW`` of them with the window. Query heads of a KV head are summed (GQA)."""
    with torch.no_grad():
        attentions = eager(prompt(length=TOKENS), output_attentions=True).attentions
    kv_heads = eager.config.num_key_value_heads
    window = set(range(TOKENS - WINDOW, TOKENS))
    kept = []
    for probs in attentions:
        votes = probs[0, :, -WINDOW:, :-WINDOW].sum(dim=1)  # (q_heads, tokens before the window)
        votes = votes.view(kv_heads, -1, votes.shape[-1]).sum(dim=1)
        pool = F.avg_pool1d if pooling == "avg" else F.max_pool1d
        pooled = pool(votes.unsqueeze(1), kernel_size=kernel, padding=kernel // 2, stride=1).squeeze(1)
        # max pooling ties neighbours: among equal scores the newer token is kept, kvlab's documented tie-break
        ranked = [sorted(range(len(row)), key=lambda i, row=row: (row[i], i), reverse=True) for row in pooled.tolist()]
        kept.append([set(order[: BUDGET - WINDOW]) | window for order in ranked])
    return kept


@pytest.mark.parametrize(("kernel", "pooling"), [(5, "avg"), (3, "max")])
def test_kept_sets_equal_the_reference_code(model, eager, kernel: int, pooling: str) -> None:
    generation, _ = compressed(model, make_policy("snapkv", window=WINDOW, kernel=kernel, pooling=pooling))
    kept = []
    for layer in generation.cache.layers:
        held = layer.held_positions()[0]
        kept.append([set(row[row >= 0].tolist()) for row in held])
    assert kept == reference_kept(eager, kernel, pooling)


def test_the_window_does_not_raise_the_tokens_just_before_it(model, eager) -> None:
    """The last token before the window is scored by the pooled votes for tokens before the window only: with an
    average over 5, its own vote and those of the two tokens before it, over 5 (zero padding where the window
    begins)."""
    _, scores = compressed(model, make_policy("snapkv", window=WINDOW, kernel=5, pooling="avg"))
    with torch.no_grad():
        attentions = eager(prompt(length=TOKENS), output_attentions=True).attentions
    kv_heads = eager.config.num_key_value_heads
    for probs, layer_scores in zip(attentions, scores):
        votes = probs[0, :, -WINDOW:, :].sum(dim=1)
        votes = votes.view(kv_heads, -1, TOKENS).sum(dim=1)
        last = TOKENS - WINDOW - 1
        expected = votes[:, last - 2 : last + 1].sum(dim=-1) / 5
        torch.testing.assert_close(layer_scores[0, :, last], expected, atol=1e-5, rtol=1e-4)
        with_window = votes[:, last - 2 : last + 3].sum(dim=-1) / 5  # what pooling the window's columns gave
        assert bool((with_window > expected + 1e-3).all())
