"""Static decode steps, captured in CUDA graphs on a GPU.

Decoding one token runs every layer's modules, the attention over the heap and the policy's eviction: hundreds of
small kernels, so an eager decode step is bound by launching them, not by reading the weights and the cache. A
*static* step fixes every shape and decides nothing from device values: attention spans the heap's whole capacity
with a mask of its live slots, the new token's slot is found on the device, the position and the token live in
device tensors that the step advances itself, and nothing is allocated beyond the step's own temporaries. Such a
step can be captured once in a CUDA graph and replayed for every token: one launch per token, and no host
synchronisation but reading the generated ids.

What the host decides for a step (whether it evicts, how many tokens each layer gives up, whether the layout
compacts a layer) is the step's *signature*. A steady streaming run has one; a run that fills its budget while
decoding has a few. The first step of a signature runs eagerly (warming the kernels up); the next one is captured
and replayed from then on. The host's counts (tokens seen, live slots, slots in use) advance by the same rules as in
an eager step (:meth:`kvlab.cache.heap.KVHeap.account_write` and ``account_evict``), without touching the device.

A sparse reader's selection (:mod:`kvlab.cache.sparse`) is part of the step: fixed shapes (pages of the whole capacity,
a top-k of fixed size), its bytes read summed on the device.

On a CPU the same static steps run eagerly (``RunSpec(static=True)``), which is how the tests check that they give
exactly the tokens of eager decoding.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from kvlab.engine.generation import Event, Generation

#: At most this many graphs are captured per generation; steps of further signatures run eagerly.
MAX_GRAPHS = 4
Signature = tuple[bool, tuple[int, ...], tuple[bool, ...]]


class StaticDecoder:
    """Decodes a generation in static steps, replaying captured graphs on a GPU."""

    def __init__(self, generation: Generation, capture: bool) -> None:
        self.generation = generation
        self.capture = capture
        self.graphs: dict[Signature, torch.cuda.CUDAGraph] = {}
        self.warmed: set[Signature] = set()
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self.ids: torch.Tensor | None = None
        self.position: torch.Tensor | None = None

    @classmethod
    def for_generation(cls, generation: Generation) -> StaticDecoder | None:
        """The static decoder for a generation, or ``None`` where it decodes eagerly: when asked to
        (``static=False``), when statistics are observed (they are read per step), on a CPU or for a policy whose
        evictions while streaming cannot be captured unless asked (``static=True``), when an observation window is
        not full yet (its shape would still change), after a compression into frozen layers, while evicted tokens
        are demoted (pages are recalled from the host), and on a model whose layers run on several devices (a CUDA
        graph is captured on one device, and accelerate's hooks move the activations between them)."""
        spec = generation.spec
        cuda = generation.loaded.device.type == "cuda"
        if spec.static is False or spec.stats is not None or (spec.static is None and not cuda):
            return None
        if len(generation.loaded.devices) > 1:
            return None
        if any(layer.frozen is not None for layer in generation.cache.layers):
            return None  # a frozen layer is materialised per step, with shapes of its own
        if generation.cache.demotion is not None:
            return None  # a recall's pages are chosen and copied from the host at every step
        # only streaming mode evicts while decoding, so only there can a policy's eviction stop a capture
        capturable = spec.mode != "streaming" or spec.policy.can_capture()
        if spec.static is None and not capturable:
            return None  # uncaptured static steps would only be slower than eager ones
        heap = generation.cache
        if heap.query_window and any(
            layer.recent_queries is None or layer.recent_queries.shape[2] < heap.query_window for layer in heap.layers
        ):
            return None
        return cls(generation, capture=cuda and capturable)

    def decode(self, logits: torch.Tensor, step: int) -> Iterator[Event]:
        """Greedy decoding in static steps: the same tokens and events as eager decoding (only the first event
        carries logits: the steps keep theirs on the device)."""
        generation = self.generation
        spec = generation.spec
        tokens = logits.argmax(dim=-1).tolist()
        finished = torch.zeros(generation.batch_size, dtype=torch.bool)
        for index in range(spec.max_new_tokens):
            finished |= torch.tensor([token in generation.stops for token in tokens])
            if index == spec.max_new_tokens - 1 or bool(finished.all()):
                yield generation.make_event(
                    "decode", step + index, token_ids=tokens, logits=logits if index == 0 else None
                )
                return
            if self.ids is None:
                self._start(tokens)
            self._step(spec.mode == "streaming" and (index + 1) % spec.compression_interval == 0)
            yield generation.make_event("decode", step + index, token_ids=tokens)
            assert self.ids is not None
            tokens = self.ids.view(-1).tolist()

    def _start(self, tokens: list[int]) -> None:
        """The device tensors the steps advance: the current token of each sequence and its position."""
        generation = self.generation
        device = generation.loaded.device
        generation.cache.make_static()
        self.ids = torch.tensor(tokens, dtype=torch.long, device=device).unsqueeze(1)
        self.position = torch.tensor([generation.cache.seen_tokens], dtype=torch.long, device=device)

    def _signature(self, evicting: bool) -> Signature:
        """What the host decides for the next step, worked out on a copy of its counts."""
        generation = self.generation
        heap = generation.cache
        state = heap.host_state()
        heap.seen_tokens += 1
        for layer in heap.layers:
            heap.account_write(layer, 1)
        counts = tuple(generation.eviction_counts()) if evicting else (0,) * len(heap.layers)
        compacts = tuple(bool(count) and heap.account_evict(layer, count) for layer, count in zip(heap.layers, counts))
        heap.restore(state)
        return evicting, counts, compacts

    def _step(self, evicting: bool) -> None:
        """One token: replay the step's graph, or capture it, or run it eagerly."""
        signature = self._signature(evicting)
        graph = self.graphs.get(signature)
        if graph is None and self.capture and signature in self.warmed and len(self.graphs) < MAX_GRAPHS:
            graph = self._captured(evicting)
            self.graphs[signature] = graph
            self.generation.decode_graphs += 1
        if graph is not None:
            graph.replay()
            self._advance(signature)
            return
        if self.capture and len(self.graphs) < MAX_GRAPHS:  # warm-up for a capture: on a side stream, as graphs need
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                self._run(evicting)
            torch.cuda.current_stream().wait_stream(stream)
        else:
            self._run(evicting)
        self.warmed.add(signature)

    def _captured(self, evicting: bool) -> torch.cuda.CUDAGraph:
        """The step recorded in a CUDA graph. Recording runs the step's host logic but none of its device work, so
        the host's counts are put back afterwards; the replay that follows is the step."""
        heap = self.generation.cache
        state = heap.host_state()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            self._run(evicting, account=False)
        heap.restore(state)
        return graph

    def _run(self, evicting: bool, account: bool = True) -> None:
        """The step itself: the model over the current token at its position, the eviction, the next token. A step
        being recorded does not ``account`` its reads on the host: the replays do (:meth:`_advance`)."""
        generation = self.generation
        assert self.ids is not None and self.position is not None
        logits = generation.model_forward(self.ids, self.position, last_position=-1, decoding=True)
        generation.record_peak()
        if account:
            generation.account_read()
        if evicting:
            generation.evict(next_position=self.position + 1)
        self.ids.copy_(logits.argmax(dim=-1, keepdim=True))
        self.position.add_(1)

    def _advance(self, signature: Signature) -> None:
        """The host's counts after a replayed step, by the rules an eager step follows."""
        generation = self.generation
        heap = generation.cache
        evicting, counts, _ = signature
        heap.seen_tokens += 1
        for layer in heap.layers:
            heap.account_write(layer, 1)
        generation.record_peak()
        generation.account_read()
        if evicting:
            for layer, count in zip(heap.layers, counts):
                if count:
                    heap.account_ranking(layer, layer.span(static=True))
                    heap.account_cut(layer)
                    heap.account_evict(layer, count)
