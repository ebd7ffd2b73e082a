"""The running moments of the queries before RoPE that Expected Attention models future queries from."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvlab.budget import Budget
from kvlab.cache.layer import MOMENTS_SKIP
from kvlab.engine.generation import Generation, generate
from kvlab.engine.spec import RunSpec
from kvlab.models.loading import wrap_model
from kvlab.models.rope import layer_ropes
from kvlab.policies import make_policy
from kvlab.policies.base import LayerView
from kvlab.policies.scoring import ScoringPolicy
from tests.tiny_models import prompt, tiny_gemma3, tiny_model


@dataclass
class MomentsProbe(ScoringPolicy):
    """Keeps the most recent tokens, and asks for the query moments so that the test can read them."""

    name: ClassVar[str] = "moments-probe"
    needs_query_moments: ClassVar[bool] = True

    def score(self, view: LayerView) -> torch.Tensor:
        return view.positions.float()


def test_rope_rotation_matches_the_model_and_undoes_itself() -> None:
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    loaded = wrap_model(tiny_model("llama"))
    ropes = layer_ropes(loaded.model)
    assert ropes is not None and len(ropes) == loaded.arch.num_layers and all(rope is ropes[0] for rope in ropes)
    rope = ropes[0]
    vectors = torch.randn(1, 2, 5, rope.rotary_dim)
    positions = torch.arange(3, 8)
    cos, sin = loaded.model.model.rotary_emb(vectors, positions.unsqueeze(0))
    expected, _ = apply_rotary_pos_emb(vectors, vectors, cos, sin)
    torch.testing.assert_close(rope.rotate(vectors, positions), expected)
    torch.testing.assert_close(rope.rotate(rope.rotate(vectors, positions), -positions), vectors)
    future = torch.arange(10, 20)
    one = torch.randn(rope.rotary_dim)
    torch.testing.assert_close(
        rope.mean_rotation(future, rope.rotary_dim) @ one, rope.rotate(one.expand(10, -1), future).mean(0)
    )


def test_each_layer_type_rotates_by_its_own_frequencies_as_the_model_does() -> None:
    from transformers.models.gemma3.modeling_gemma3 import apply_rotary_pos_emb

    model = tiny_gemma3()
    ropes = layer_ropes(model)
    types = model.config.layer_types
    assert ropes is not None and len(ropes) == len(types)
    vectors = torch.randn(1, 1, 5, ropes[0].rotary_dim)
    positions = torch.arange(3, 8)
    for layer_type in set(types):
        cos, sin = model.model.rotary_emb(vectors, positions.unsqueeze(0), layer_type)
        expected, _ = apply_rotary_pos_emb(vectors, vectors, cos, sin)
        for rope in (rope for rope, kind in zip(ropes, types, strict=True) if kind == layer_type):
            torch.testing.assert_close(rope.rotate(vectors, positions), expected)
    assert not torch.equal(
        ropes[types.index("sliding_attention")].inv_freq, ropes[types.index("full_attention")].inv_freq
    )


def test_expected_attention_runs_on_a_model_with_a_rotary_embedding_per_layer_type() -> None:
    loaded = wrap_model(tiny_gemma3())
    spec = RunSpec(make_policy("expected_attention"), Budget(tokens=10), mode="streaming", chunk=8, max_new_tokens=4)
    result = generate(loaded, prompt(length=40, seed=2), spec)
    assert len(result.tokens[0]) == 4 and max(result.kept_per_layer) <= 10 + 8


def test_query_moments_are_those_of_the_queries_before_rope() -> None:
    loaded = wrap_model(tiny_model("llama"))
    attention = loaded.model.model.layers[1].self_attn
    seen: list[torch.Tensor] = []
    hook = attention.q_proj.register_forward_hook(lambda module, args, output: seen.append(output.detach()))
    ids = prompt(length=24)
    generation = Generation(loaded, RunSpec.of(MomentsProbe(), Budget(tokens=16), max_new_tokens=3), ids)
    try:
        for _ in generation.events():
            pass
    finally:
        hook.remove()
    head_dim = attention.head_dim
    queries = torch.cat(seen, dim=1).float()  # (batch, tokens read with moments on, heads * head_dim)
    queries = queries.view(1, queries.shape[1], -1, head_dim).transpose(1, 2)[:, :, MOMENTS_SKIP:]
    views = generation.layer_views()
    # prefill mode stops observing at its one compression: the moments are those of the prompt's queries
    assert views[1].query_moments() is None
    probe = Generation(loaded, RunSpec.of(MomentsProbe(), Budget(tokens=16), max_new_tokens=0), ids)
    for _ in probe.read(probe.input_ids, 0):
        pass
    moments = probe.layer_views()[1].query_moments()
    assert moments is not None
    mean, covariance, count = moments
    prompt_queries = queries[:, :, : ids.shape[1] - MOMENTS_SKIP]
    centred = prompt_queries - prompt_queries.mean(dim=2, keepdim=True)
    torch.testing.assert_close(mean, prompt_queries.mean(dim=2), atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(covariance, centred.transpose(-1, -2) @ centred / centred.shape[2], atol=1e-5, rtol=1e-4)
    assert int(count) == ids.shape[1] - MOMENTS_SKIP
