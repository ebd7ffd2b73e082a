"""KVzip: the context reconstructed on a fork of the heap, every cached token scored by the most attention the
reconstruction gives it, the budget held, the cost counted, the original heap untouched."""

from __future__ import annotations

import pytest
import torch
from tiny_models import prompt, tiny_model

from kvlab.budget import Budget
from kvlab.cache.ranking import KEEP
from kvlab.engine.events import GenerationResult
from kvlab.engine.generation import Generation, generate, prefill_once
from kvlab.engine.reconstruction import QUOTED_TOKENS, RepeatRequest, chunks
from kvlab.engine.spec import RunSpec
from kvlab.errors import KvlabError
from kvlab.models.loading import wrap_model
from kvlab.policies import configure, make_policy

CONTEXT, CHUNK, SINKS = 20, 8, 4


class CharTokenizer:
    """One id per character; with ``chat`` a template that renders a user turn as ``<u>text</u><a>``."""

    def __init__(self, chat: bool = False) -> None:
        self.chat_template = "<u>{text}</u><a>" if chat else None

    def encode(self, text: str, add_special_tokens: bool = False, **_: object) -> list[int]:
        return [3 + ord(character) % 94 for character in text]

    def apply_chat_template(self, messages: list[dict[str, str]], **_: object) -> str:
        return f"<u>{messages[0]['content']}</u><a>"

    def decode(self, ids: list[int], **_: object) -> str:
        return "".join(chr(identifier) for identifier in ids)


@pytest.fixture(scope="module")
def llama():
    return wrap_model(tiny_model("llama"), tokenizer=CharTokenizer())


def read(loaded, policy, ids: torch.Tensor, budget: int = 10) -> Generation:
    """A generation that has read ``ids`` and not yet compressed them."""
    generation = Generation(loaded, RunSpec.of(policy, Budget(tokens=budget), max_new_tokens=3), ids)
    with torch.inference_mode():
        list(generation.read(generation.input_ids, 0))
    return generation


def run(loaded, spec: RunSpec, ids: torch.Tensor | None, **changes) -> tuple[list[list], GenerationResult]:
    """The survivors of the compression, and the result."""
    generation = Generation(loaded, spec, ids, **changes)
    kept = [[s.tolist() for s in event.survivors()] for event in generation.events() if event.kind == "compress"]
    return kept, generation.result()


def test_requests_follow_kvpress():
    tokenizer = CharTokenizer()
    ids = prompt(batch=2, length=CONTEXT)
    request = RepeatRequest.for_tokenizer(tokenizer)
    passes = chunks(ids, request, CHUNK)
    assert [(c.start, c.stop) for c in passes] == [(0, 8), (8, 16), (16, 20)]
    newline = tokenizer.encode("\n")
    first = tokenizer.encode("\n\nRepeat the previous context exactly.")
    later = tokenizer.encode("\n\nRepeat the part of the previous context exactly, starting with")
    assert passes[0].ids[1].tolist() == first + newline + ids[1, :8].tolist()
    assert passes[2].ids[0].tolist() == later + ids[0, 8:16].tolist() + newline + ids[0, 16:].tolist()
    assert QUOTED_TOKENS == 8
    chat = RepeatRequest.for_tokenizer(CharTokenizer(chat=True))
    assert (chat.opening, chat.closing) == (tuple(tokenizer.encode("<u>")), tuple(tokenizer.encode("</u><a>")))
    framed = torch.cat([torch.tensor([chat.opening] * 2), ids], dim=1)
    assert chunks(framed, chat, CHUNK)[0].start == 3  # the template's opening is not reconstructed
    assert chunks(ids, chat, CHUNK)[0].start == 0  # a context without it is reconstructed whole
    merged = framed.clone()
    merged[:, 2] = 90  # the opening's last token merged with the user's first characters (a newline and a newline)
    assert chunks(merged, chat, CHUNK)[0].start == 3


def test_scores_are_the_most_attention_each_token_gets_from_the_reconstruction(llama):
    """Against the eager model run over [context + request + chunk] for each chunk, with the attention rows of the
    reconstruction renormalised over the sinks, the chunk and the reconstruction's own tokens (kvpress's keys)."""
    ids = prompt(batch=2, length=CONTEXT, seed=2)
    generation = read(llama, make_policy("kvzip", chunk_size=CHUNK, sinks=SINKS), ids)
    with torch.inference_mode():
        generation.reconstruct()
    reference = tiny_model("llama")
    arch = llama.arch
    groups = arch.num_q_heads // arch.num_kv_heads
    expected = torch.zeros(arch.num_layers, 2, arch.num_kv_heads, CONTEXT)
    for chunk in chunks(ids, RepeatRequest.for_tokenizer(llama.tokenizer), CHUNK):
        whole = torch.cat([ids, chunk.ids], dim=1)
        keys = torch.arange(whole.shape[1])
        spanned = ((keys >= chunk.start) & (keys < chunk.stop)) | (keys < min(SINKS, chunk.start)) | (keys >= CONTEXT)
        with torch.no_grad():
            attentions = reference(input_ids=whole, output_attentions=True).attentions
        for layer, attention in enumerate(attentions):
            rows = attention[:, :, CONTEXT:].reshape(2, arch.num_kv_heads, groups, -1, whole.shape[1]) * spanned
            rows = rows / rows.sum(-1, keepdim=True)
            expected[layer, ..., chunk.start : chunk.stop] = rows[..., chunk.start : chunk.stop].amax(dim=(2, 3))
    for layer_idx, layer in enumerate(generation.cache.layers):
        assert layer.scores.shape == (2, arch.num_kv_heads, layer.capacity)
        torch.testing.assert_close(layer.scores[..., :CONTEXT], expected[layer_idx], atol=1e-5, rtol=1e-4)
        assert (layer.scores[..., CONTEXT:] == 0).all()
    view = generation.layer_views()[0]
    scored = generation.spec.policy.score(view)
    assert (scored[..., :SINKS] == KEEP).all() and torch.isfinite(scored[..., SINKS:]).all()


def test_by_default_one_ranking_over_every_layer_and_kv_head_keeps_what_kvpress_keeps(llama):
    """The published options rank all layers' and KV heads' scores together, as ``KVzipPress(layerwise=False)``:
    the kept set is the top ``layers x kv_heads x budget`` of every score (sinks first), layers and heads keeping
    different numbers."""
    ids, budget = prompt(length=40, seed=3), 10
    generation = read(llama, make_policy("kvzip", chunk_size=16), ids, budget)
    with torch.inference_mode():
        generation.reconstruct()
    scores = torch.stack([generation.spec.policy.score(view)[0, :, :40] for view in generation.layer_views()])
    arch = llama.arch
    top = scores.reshape(-1).topk(arch.num_layers * arch.num_kv_heads * budget).indices
    theirs = torch.zeros(scores.numel(), dtype=torch.bool)
    theirs[top] = True
    spec = RunSpec(make_policy("kvzip", chunk_size=16), Budget(tokens=budget), max_new_tokens=1, stop_token_ids=())
    assert spec.cache.options.stored() == {"scope": "global", "head_allocation": "adakv", "head_floor": 0.0}
    kept, _ = run(llama, spec, ids)
    ours = torch.zeros(arch.num_layers, arch.num_kv_heads, 40, dtype=torch.bool)
    for layer, positions in enumerate(kept[0]):
        for head, held in enumerate(positions[0]):
            ours[layer, head, [p for p in held if p >= 0]] = True
    assert ours[..., :SINKS].all()
    assert ours.sum() == arch.num_layers * arch.num_kv_heads * budget
    per_layer = ours.sum(dim=(1, 2))
    per_head = ours.sum(dim=2)
    assert len(set(per_layer.tolist())) > 1 and len(set(per_head.flatten().tolist())) > 1  # shares differ
    assert torch.equal(ours.reshape(-1), theirs)


def test_local_uniform_options_keep_the_budget_in_every_layer_and_kv_head_sinks_included(llama):
    variant = configure("kvzip", chunk_size=16, scope="local", head_allocation="uniform")
    spec = RunSpec.of(variant, Budget(tokens=10), max_new_tokens=3, stop_token_ids=())
    events = Generation(llama, spec, prompt(batch=2, length=40, seed=3)).events()
    compress = next(event for event in events if event.kind == "compress")
    assert compress.kept_per_layer == [10] * llama.arch.num_layers
    for positions in compress.survivors():
        assert positions.shape == (2, llama.arch.num_kv_heads, 10)
        assert (positions[..., :SINKS] == torch.arange(SINKS, dtype=positions.dtype)).all()


def test_a_budget_covering_the_context_equals_full_and_reconstructs_nothing(llama):
    ids = prompt(length=40, seed=4)
    full = generate(llama, ids, RunSpec(make_policy("full"), max_new_tokens=6, stop_token_ids=()))
    for budget in (40, 64):
        result = generate(llama, ids, RunSpec(make_policy("kvzip"), Budget(tokens=budget), max_new_tokens=6))
        assert result.tokens == full.tokens
        assert result.reconstruction_seconds == 0.0


def test_the_reconstruction_is_timed_and_part_of_the_prefill(llama):
    spec = RunSpec(make_policy("kvzip", chunk_size=16), Budget(tokens=10), max_new_tokens=3)
    generation = Generation(llama, spec, prompt(length=40, seed=5))
    compress = [event for event in generation.events() if event.kind == "compress"][0]
    result = generation.result()
    assert 0.0 < result.reconstruction_seconds <= compress.seconds <= result.prefill_seconds
    assert result.to_json()["reconstruction_seconds"] == result.reconstruction_seconds
    per_token = 2 * llama.arch.num_layers * llama.arch.num_kv_heads * llama.arch.head_dim * 4
    request = 1 + len(RepeatRequest.for_tokenizer(llama.tokenizer).later) + QUOTED_TOKENS + 16  # the longest pass
    assert result.peak_kv_bytes == (40 + 40 + request) * per_token  # the fork's copy and the repetition counted


def test_the_original_heap_is_untouched_by_the_reconstruction(llama):
    generation = read(llama, make_policy("kvzip", chunk_size=CHUNK), prompt(batch=2, length=CONTEXT, seed=6))
    heap = generation.cache
    before = [(layer.keys.clone(), layer.values.clone(), layer.positions.clone()) for layer in heap.layers]
    pointers = [layer.keys.data_ptr() for layer in heap.layers]
    counts = heap.host_state()
    with torch.inference_mode():
        generation.reconstruct()
    assert heap.host_state() == counts and heap.seen_tokens == CONTEXT
    for layer, (keys, values, positions), pointer in zip(heap.layers, before, pointers):
        assert torch.equal(layer.keys, keys) and torch.equal(layer.values, values)
        assert torch.equal(layer.positions, positions) and layer.keys.data_ptr() == pointer
        assert layer.scores is not None and (layer.scores[..., :CONTEXT] > 0).all()


def test_a_fork_of_a_shared_prefill_keeps_what_a_run_alone_keeps(llama):
    ids, question = prompt(batch=2, length=40, seed=7), prompt(batch=2, length=4, seed=8)
    policy = make_policy("kvzip", chunk_size=16)
    shared = prefill_once(llama, ids, [policy, make_policy("h2o")])
    spec = RunSpec.of(policy, Budget(tokens=12), max_new_tokens=5, stop_token_ids=())
    alone, alone_result = run(llama, spec, ids, suffix_ids=question)
    forked, forked_result = run(llama, spec, None, suffix_ids=question, prefilled=shared)
    assert forked == alone and len(alone) == 1
    assert forked_result.tokens == alone_result.tokens
    assert forked_result.reconstruction_seconds > 0.0


def test_streaming_mode_is_refused():
    with pytest.raises(KvlabError, match="prefill mode only"):
        RunSpec(make_policy("kvzip"), Budget(tokens=10), mode="streaming")
