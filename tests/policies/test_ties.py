"""The share of eviction cuts that fell on tied scores, and the deterministic tie-break that decides them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch

from kvlab.budget import Budget
from kvlab.cache.ranking import by_score_then_position, tied_cut, victims
from kvlab.engine.generation import generate
from kvlab.engine.spec import RunSpec
from kvlab.models.loading import wrap_model
from kvlab.policies import make_policy
from kvlab.policies.base import LayerView
from kvlab.policies.scoring import ScoringPolicy
from tests.tiny_models import prompt, tiny_model


@dataclass
class Flat(ScoringPolicy):
    """Every token scores the same: each cut falls on a tie, and the position alone decides."""

    name: ClassVar[str] = "flat"

    def score(self, view: LayerView) -> torch.Tensor:
        return torch.zeros_like(view.positions, dtype=torch.float32)


@pytest.fixture(scope="module")
def loaded():
    return wrap_model(tiny_model("llama"))


def test_a_cut_is_tied_when_the_best_victim_scores_as_the_worst_survivor() -> None:
    scores = torch.tensor([[[1.0, 2.0, 2.0, float("inf")]]])
    keys = by_score_then_position(scores, torch.arange(4).view(1, 1, 4))
    assert tied_cut(keys[..., 1], keys[..., 2]).tolist() == [[True]]
    assert tied_cut(keys[..., 0], keys[..., 1]).tolist() == [[False]]
    assert tied_cut(keys[..., 3], keys[..., 3]).tolist() == [[False]]  # kept by rule, not a measured tie
    assert bool(keys[..., 1] < keys[..., 2])  # among equal scores the older token goes first


def test_one_victim_by_a_reduction_is_the_top_ks_with_the_same_tie() -> None:
    generator = torch.Generator().manual_seed(3)
    for trial in range(40):
        scores = torch.randint(0, 4, (2, 3, 50), generator=generator).float()  # many ties
        scores[0, 0, :10] = float("inf")  # tokens kept by rule
        scores[1, 2] = float("inf") if trial % 2 else scores[1, 2]  # a head where only rule-kept tokens are left
        positions = torch.randperm(60, generator=generator)[:50].expand(2, 3, 50).clone()
        positions[:, 1, 5:9] = -1  # free slots
        one = victims(scores, positions, 1)
        order = by_score_then_position(scores.masked_fill(positions < 0, float("inf")), positions)
        lowest = order.topk(2, dim=-1, largest=False, sorted=True)
        assert torch.equal(one.slots, lowest.indices[..., :1])
        assert one.tied is not None and torch.equal(one.tied, tied_cut(lowest.values[..., 0], lowest.values[..., 1]))


@pytest.mark.parametrize("mode", ["prefill", "streaming"])
def test_every_cut_of_flat_scores_is_tied_and_none_of_recency(loaded, mode: str) -> None:
    def share(policy) -> float | None:
        budget = Budget(tokens=12) if policy.evicts else None
        spec = RunSpec.of(policy, budget, mode=mode, chunk=8, max_new_tokens=4, stop_token_ids=())
        return generate(loaded, prompt(length=30), spec).tie_share

    assert share(Flat()) == 1.0
    assert share(make_policy("streaming", sinks=2)) == 0.0
    assert share(make_policy("full")) is None


def test_flat_scores_keep_the_newest_tokens(loaded) -> None:
    """The documented tie-break: among equal scores the older token is evicted first."""
    spec = RunSpec.of(Flat(), Budget(tokens=12), max_new_tokens=1, stop_token_ids=())
    from kvlab.engine.generation import Generation

    generation = Generation(loaded, spec, prompt(length=30))
    for _ in generation.events():
        pass
    held = generation.cache.layers[0].held_positions()
    assert sorted(held[0, 0][held[0, 0] >= 0].tolist()) == list(range(18, 30))
