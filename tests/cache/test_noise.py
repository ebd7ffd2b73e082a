"""The noise floor on eviction scores (kvlab/cache/noise.py and the noise parameters of every scoring policy): scale 0
is the policy itself, the seed decides the kept set, infinite scores are left alone, draws have the scale they claim,
and the spread they are scaled by is each row's own."""

from __future__ import annotations

import math

import pytest
import torch
from tiny_models import prompt, tiny_model

from kvlab.budget import Budget
from kvlab.cache.noise import add_noise, score_spread, unit_noise
from kvlab.engine.generation import Generation
from kvlab.engine.spec import RunSpec
from kvlab.models.loading import wrap_model
from kvlab.policies import configure, make_policy
from kvlab.policies.variants import as_variant

BUDGET = 12
NEW_TOKENS = 6
#: Draws per statistical check, and how many standard errors a sample statistic may stray: a failure would need a
#: 6-sigma draw (about 1e-9 under the normal approximation), so a failure means the scale is wrong.
DRAWS = 200_000
SIGMAS = 6.0


@pytest.fixture(scope="module")
def loaded():
    return wrap_model(tiny_model("llama"))


def kept_sets(loaded, chosen, mode: str = "prefill", seed: int = 0, layout: str = "compact"):
    """Tokens and the survivors after every event of a run of a policy or variant."""
    variant = as_variant(chosen)
    spec = RunSpec(
        variant.policy,
        Budget(tokens=BUDGET),
        mode=mode,
        chunk=8 if mode == "streaming" else None,
        max_new_tokens=NEW_TOKENS,
        stop_token_ids=(),
        seed=seed,
        cache=variant.cache(layout),
    )
    generation = Generation(loaded, spec, prompt(length=40))
    survivors = [[layer.tolist() for layer in event.survivors()] for event in generation.events()]
    return generation.result().tokens, survivors


@pytest.mark.parametrize("mode", ["prefill", "streaming"])
@pytest.mark.parametrize("name", ["h2o", "tova", "knorm"])
def test_noise_of_scale_zero_is_the_policy_without_noise(loaded, mode, name):
    plain = kept_sets(loaded, make_policy(name), mode)
    for kind in ("gaussian", "laplace"):
        assert kept_sets(loaded, configure(name, noise=kind, noise_scale=0.0), mode) == plain


@pytest.mark.parametrize("kind", ["gaussian", "laplace"])
def test_the_seed_decides_the_kept_set(loaded, kind):
    policy = configure("h2o", noise=kind, noise_scale=1.0)
    first = kept_sets(loaded, policy, seed=1)[1]
    assert kept_sets(loaded, policy, seed=1)[1] == first
    assert kept_sets(loaded, policy, seed=2)[1] != first
    assert kept_sets(loaded, make_policy("h2o"))[1] != first  # the noise does change what is kept


def test_infinite_scores_are_left_alone():
    scores = torch.tensor([[[1.0, math.inf, 3.0, -math.inf, 5.0]]])
    noisy = add_noise(scores, torch.full_like(scores, 100.0), 10.0)
    assert noisy[0, 0, 1] == math.inf and noisy[0, 0, 3] == -math.inf
    assert (noisy[0, 0, [0, 2, 4]] != scores[0, 0, [0, 2, 4]]).all()


def test_a_policy_keeps_what_it_always_keeps_under_any_noise(loaded):
    """H2O's recent window scores +inf, so even overwhelming noise cannot evict it."""
    recent = make_policy("h2o").recent(BUDGET)  # type: ignore[attr-defined]
    _, survivors = kept_sets(loaded, configure("h2o", noise="laplace", noise_scale=1000.0))
    compressed = survivors[1]  # after the one compression of prefill mode
    window = set(range(40 - recent, 40))
    assert all(window <= set(head) for layer in compressed for head in layer[0])


@pytest.mark.parametrize(
    "kind,mean_abs,var_abs,variance,var_of_square",
    [
        # standard normal: E|Z| = sqrt(2/pi), Var|Z| = 1 - 2/pi; E Z^2 = 1, Var Z^2 = 2
        ("gaussian", math.sqrt(2 / math.pi), 1 - 2 / math.pi, 1.0, 2.0),
        # Laplace of unit scale: |X| is exponential of mean 1 (variance 1); E X^2 = 2, E X^4 = 24, so Var X^2 = 20
        ("laplace", 1.0, 1.0, 2.0, 20.0),
    ],
)
def test_draws_have_the_unit_scale_they_claim(kind, mean_abs, var_abs, variance, var_of_square):
    draws = unit_noise(kind, torch.Size((DRAWS,)), torch.Generator().manual_seed(0), torch.device("cpu")).double()
    assert abs(draws.abs().mean().item() - mean_abs) <= SIGMAS * math.sqrt(var_abs / DRAWS)
    assert abs((draws**2).mean().item() - variance) <= SIGMAS * math.sqrt(var_of_square / DRAWS)
    assert abs(draws.mean().item()) <= SIGMAS * math.sqrt(variance / DRAWS)


def test_noise_is_scaled_by_each_rows_own_spread():
    base = torch.arange(50, dtype=torch.float32)
    factors = torch.tensor([[0.01, 1.0, 100.0], [3.0, 0.5, 7.0]])
    scores = factors[..., None] * base
    spread = score_spread(scores)
    assert spread.shape == (2, 3, 1)
    torch.testing.assert_close(spread[..., 0], factors * base.std())
    draws = torch.randn(scores.shape, generator=torch.Generator().manual_seed(0))
    noisy = add_noise(scores, draws, 0.5)
    torch.testing.assert_close((noisy - scores) / (0.5 * spread), draws, rtol=1e-3, atol=1e-3)


def test_the_spread_counts_only_finite_scores():
    row = torch.tensor([[[2.0, math.inf, 4.0, -math.inf, 6.0]], [[1.0, math.inf, -math.inf, math.inf, -math.inf]]])
    spread = score_spread(row)
    assert spread[0, 0, 0].item() == pytest.approx(2.0)  # std of 2, 4, 6
    assert spread[1, 0, 0].item() == 0.0  # one finite score: nothing to scale by, so no noise
    assert torch.equal(add_noise(row[1:], torch.ones_like(row[1:]), 5.0), row[1:])


@pytest.mark.parametrize("name", ["h2o", "knorm"])
def test_every_layout_adds_the_same_noise_at_a_compression(loaded, name):
    """In prefill mode the one compression sees no free slot in any layout."""
    policy = configure(name, noise="gaussian", noise_scale=1.0)
    assert kept_sets(loaded, policy, layout="bitmask") == kept_sets(loaded, policy, layout="compact")


@pytest.mark.parametrize("name", ["h2o", "knorm"])
def test_every_layout_adds_the_same_noise_while_streaming(loaded, name):
    policy = configure(name, noise="gaussian", noise_scale=1.0)
    assert kept_sets(loaded, policy, "streaming", layout="bitmask") == kept_sets(loaded, policy, "streaming")


def test_tova_keeps_one_set_per_layer_under_noise(loaded):
    _, survivors = kept_sets(loaded, configure("tova", noise="gaussian", noise_scale=1.0))
    assert all(head == layer[0][0] for event in survivors for layer in event for head in layer[0])
