"""KVzip's reconstruction pass: having read a context, the model is asked to repeat it, and every cached token is
scored by the most attention any query of that repetition gives it (:class:`kvlab.policies.kvzip.KVzip`).

The repetition is teacher-forced: after the request come the context's own tokens, ``chunk_size`` of them per
forward pass, so that the cost grows with the context rather than its square. The request is kvpress 0.5.5's:
"Repeat the previous context exactly." before the first chunk; "Repeat the part of the previous context exactly,
starting with" and the previous chunk's last eight tokens before the others; then what closes the user's turn in the
model's chat template (a newline without one); then the chunk.

The passes run on a fork of the heap (:meth:`kvlab.cache.heap.KVHeap.share`), and each chunk's tokens are dropped from
the fork before the next chunk is read: every chunk sees the context alone, as in the references, and the original cache
never holds a reconstruction token. A chunk's attention is normalised as the references normalise it, over the keys
of the sinks before the chunk, of the chunk itself and of the repetition: kvlab's attention observes probabilities
over every cached key, and dividing them by their sum over those keys gives that same softmax.

Memory, while it runs: the fork's own copy of the context's K/V (written on its first forward pass; counted in the
run's peak K/V bytes beside the original) and one chunk's tokens, plus one float32 copy of each block of observed
probabilities. The scores are one float32 per slot, sequence, KV head and layer, held in each layer's ``scores``
(counted in the heap's bookkeeping bytes) until the compression drops them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kvlab.attention.context import Observer
from kvlab.cache.heap import KVHeap, Observed
from kvlab.cache.ranking import KEEP
from kvlab.cache.spec import CacheSpec
from kvlab.policies.base import Policy
from kvlab.policies.kvzip import KVzip
from kvlab.tasks.items import has_chat_template
from kvlab.tasks.needle import encode

#: A forward pass over ``ids`` at ``positions`` (last position ``last``) into a ``heap``, its attention handed to an
#: observer (:meth:`kvlab.engine.generation.Generation.model_forward`).
Forward = Callable[..., torch.Tensor]

FIRST_REQUEST = "\n\nRepeat the previous context exactly."
LATER_REQUEST = "\n\nRepeat the part of the previous context exactly, starting with"
#: Tokens of the previous chunk quoted after a later request, so the model knows where to resume.
QUOTED_TOKENS = 8
#: A user turn's text, rendered by the chat template to find what the template puts around it.
_PLACEHOLDER = "dummy context"


@dataclass(frozen=True)
class RepeatRequest:
    """The token ids around a reconstruction: ``opening``, what the chat template puts before the user's text (not
    reconstructed when the context starts with it); ``first`` and ``later``, the requests before the first chunk and
    before the others; ``closing``, what ends the user's turn and opens the assistant's. All empty without a
    tokenizer."""

    opening: tuple[int, ...] = ()
    first: tuple[int, ...] = ()
    later: tuple[int, ...] = ()
    closing: tuple[int, ...] = ()

    @classmethod
    def for_tokenizer(cls, tokenizer: Any) -> RepeatRequest:
        """The request in the tokenizer's words, framed by its chat template as kvpress frames it."""
        if tokenizer is None:
            return cls()
        first, later = tuple(encode(tokenizer, FIRST_REQUEST)), tuple(encode(tokenizer, LATER_REQUEST))
        if not has_chat_template(tokenizer):
            return cls((), first, later, tuple(encode(tokenizer, "\n")))
        separator = "\n" + "#" * len(_PLACEHOLDER)
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": _PLACEHOLDER + separator}],
            add_generation_prompt=True,
            tokenize=False,
            enable_thinking=False,
        )
        head, _, closing = rendered.partition(separator)
        opening = head.partition(_PLACEHOLDER)[0]
        return cls(tuple(encode(tokenizer, opening)), first, later, tuple(encode(tokenizer, closing)))


@dataclass(frozen=True)
class Chunk:
    """One forward pass of the reconstruction: it repeats the context positions ``[start, stop)``, and ``ids``
    ``(batch, tokens)`` are its request followed by those positions' tokens."""

    start: int
    stop: int
    ids: torch.Tensor


def chunks(context_ids: torch.Tensor, request: RepeatRequest, chunk_size: int) -> list[Chunk]:
    """The reconstruction's passes over ``context_ids`` ``(batch, context)``: ``chunk_size`` tokens each, from the
    first token after the chat template's opening (when every sequence starts with it), each after its request.

    The opening is recognised by all its tokens but the last: tokenised within the prompt, its last token can merge
    with the user's first characters (the template's newline and a context starting with a newline become one
    token), and kvpress skips the opening's length whatever that token became."""
    batch, context = context_ids.shape

    def ids(values: tuple[int, ...]) -> torch.Tensor:
        return torch.tensor(values, dtype=context_ids.dtype, device=context_ids.device).expand(batch, -1)

    opening = ids(request.opening)
    fixed = opening.shape[1] - 1
    opens = 0 < opening.shape[1] < context and bool((context_ids[:, :fixed] == opening[:, :fixed]).all())
    begin = opening.shape[1] if opens else 0
    passes = []
    for start in range(begin, context, chunk_size):
        stop = min(start + chunk_size, context)
        if start == begin:
            asked = [ids(request.first)]
        else:
            asked = [ids(request.later), context_ids[:, start - min(QUOTED_TOKENS, chunk_size) : start]]
        passes.append(Chunk(start, stop, torch.cat([*asked, ids(request.closing), context_ids[:, start:stop]], dim=1)))
    return passes


def chunk_attention(
    probs: torch.Tensor, key_positions: torch.Tensor, chunk: Chunk, context: int, sinks: int
) -> torch.Tensor:
    """The most attention each key receives from a block of a chunk's queries, ``(batch, kv_heads, keys)`` (zero for
    keys outside the chunk): the maximum over the queries and over the query heads of its KV head of ``probs``
    ``(batch, kv_heads, groups, queries, keys)``, renormalised over the keys the references' softmax spans (the
    first ``sinks`` positions when the chunk starts after them, the chunk, the repetition from ``context`` on)."""
    in_chunk = (key_positions >= chunk.start) & (key_positions < chunk.stop)
    sink = (key_positions >= 0) & (key_positions < min(sinks, chunk.start))
    spanned = in_chunk | sink | (key_positions >= context)
    total = torch.matmul(probs, spanned.to(probs.dtype).unsqueeze(2).unsqueeze(-1))  # (batch, kv_heads, g, q, 1)
    most = (probs / total.clamp_min(torch.finfo(probs.dtype).tiny)).amax(dim=(2, 3))
    return most.masked_fill_(~in_chunk, 0.0)


def _observer(scores: list[torch.Tensor], heap: KVHeap, chunk: Chunk, context: int, sinks: int) -> Observer:
    """What keeps, per layer and context slot, the most attention seen over a chunk's forward pass."""

    def observe(layer_idx: int, probs: torch.Tensor, key_positions: torch.Tensor) -> None:
        most = chunk_attention(probs, key_positions, chunk, context, sinks)
        width = min(most.shape[-1], heap.layers[layer_idx].used)  # the fork's slots past it hold the repetition
        held = scores[layer_idx][..., :width]
        torch.maximum(held, most[..., :width], out=held)

    return observe


def reconstruct(
    heap: KVHeap,
    context_ids: torch.Tensor,
    tokenizer: Any,
    policy: Policy,
    forward: Forward,
    note_peak: Callable[[int, int], None],
) -> None:
    """Score every context slot of ``heap`` (holding ``context_ids``) by the reconstruction (see the module) and leave
    the scores, ``(batch, kv_heads, capacity)`` float32 per layer, in the layers' ``scores`` for the policy; the chat
    template's opening slots score :data:`~kvlab.cache.ranking.KEEP`. ``forward`` runs the model over a chunk into the
    fork; the fork's K/V count towards the run's peak bytes through ``note_peak(kv_bytes, reserved_bytes)``."""
    assert isinstance(policy, KVzip), "only KVzip reconstructs its context"
    assert all(layer.dead == 0 for layer in heap.layers), "prefill mode evicts nothing before its compression"
    context = heap.seen_tokens
    passes = chunks(context_ids, RepeatRequest.for_tokenizer(tokenizer), policy.chunk_size)
    longest = max(int(chunk.ids.shape[1]) for chunk in passes)
    fork = KVHeap.build(
        [layer.used + longest for layer in heap.layers],
        CacheSpec(layout="bitmask"),
        observed=Observed(),
        room=0,
        keep_planned=False,
        rope=heap.rope,
        evicting=False,
    ).share(heap)
    scores = []
    for layer in heap.layers:
        assert layer.positions is not None
        scores.append(torch.zeros(layer.positions.shape, dtype=torch.float32, device=layer.device))
    for chunk in passes:
        before = fork.host_state()
        count = int(chunk.ids.shape[1])
        positions = torch.arange(context, context + count, device=chunk.ids.device)
        observe = _observer(scores, heap, chunk, context, policy.sinks)
        forward(chunk.ids, positions, context + count - 1, cache=fork, observe=observe)
        note_peak(heap.kv_bytes() + fork.kv_bytes(), heap.reserved_bytes() + fork.reserved_bytes())
        _drop_repetition(fork, heap, count)
        fork.restore(before)
    begin = passes[0].start
    for layer, layer_scores in zip(heap.layers, scores):
        assert layer.positions is not None
        layer.replace_scores(layer_scores.masked_fill_((layer.positions >= 0) & (layer.positions < begin), KEEP))


def _drop_repetition(fork: KVHeap, heap: KVHeap, count: int) -> None:
    """Free the ``count`` slots a chunk's tokens took in every layer of the fork, right after the context's."""
    for layer_idx, (layer, source) in enumerate(zip(fork.layers, heap.layers)):
        assert layer.keys is not None
        batch, kv_heads = layer.keys.shape[:2]
        slots = torch.arange(source.used, source.used + count, device=layer.device)
        fork.evict(layer_idx, slots.expand(batch, kv_heads, count))
