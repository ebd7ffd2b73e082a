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
an eager step (:meth:`kvlab.cache.heap.KVHeap.account_appended` and ``account_evictions``), without touching the
device.

A sparse reader's selection (:mod:`kvlab.cache.sparse`) is part of the step: fixed shapes (pages of the whole capacity,
a top-k of fixed size), its bytes read summed on the device.

On a CPU the same static steps run eagerly (``RunSpec(static=True)``), which is how the tests check that they give
exactly the tokens of eager decoding.
"""

from __future__ import annotations

import torch

from kvlab.attention.backends import FLEX
from kvlab.attention.observe import carry_window_lse
from kvlab.engine.decoding import Loop
from kvlab.modes import STREAMING

#: At most this many graphs are captured per generation; steps of further signatures run eagerly.
MAX_GRAPHS = 4
Signature = tuple[bool, tuple[int, ...], tuple[bool, ...]]


class StaticSteps:
    """Decode steps with fixed shapes, replaying captured graphs on a GPU (:class:`kvlab.engine.decoding.Steps`)."""

    def __init__(self, loop: Loop, capture: bool) -> None:
        self.loop = loop
        self.capture = capture
        self.graphs: dict[Signature, torch.cuda.CUDAGraph] = {}
        self.warmed: set[Signature] = set()
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self.ids: torch.Tensor | None = None
        self.position: torch.Tensor | None = None

    @classmethod
    def for_loop(cls, loop: Loop) -> StaticSteps | None:
        """The static steps for a generation, or ``None`` where it decodes eagerly: when asked to (``static=False``),
        with forced tokens, when statistics are observed (they are read per step), on a CPU or for an eviction while
        streaming that cannot be captured unless asked (``static=True``), when an observation window is not full yet
        (its shape would still change), where a layer of the heap cannot be captured (a frozen part materialised per
        step, pages recalled from the host), and on a model whose layers run on several devices (a CUDA graph is
        captured on one device, and accelerate's hooks move the activations between them)."""
        spec = loop.spec
        cuda = loop.loaded.device.type == "cuda"
        if loop.forced_ids is not None or spec.static is False or spec.stats is not None:
            return None
        if (spec.static is None and not cuda) or len(loop.loaded.devices) > 1 or not loop.cache.capturable():
            return None
        # only streaming mode evicts by the policy while decoding (prefill mode drops only what sliding windows no
        # longer see, by position), so only there can an eviction stop a capture
        capturable = spec.mode != STREAMING or (spec.policy.can_capture() and loop.cache.evictions_capturable())
        if spec.static is None and not capturable:
            return None  # uncaptured static steps would only be slower than eager ones
        if not loop.cache.windows_full():
            return None
        return cls(loop, capture=cuda and capturable)

    def step(self, ids: torch.Tensor, index: int) -> tuple[torch.Tensor, None, None]:
        """One token: replay the step's graph, or capture it, or run it eagerly; the next tokens stay on the device
        until the loop reads them."""
        if self.ids is None:
            self._start(ids.view(-1).tolist())
        evicting = self.loop.evicts_after(index)
        signature = self._signature(evicting)
        graph = self.graphs.get(signature)
        if graph is None and self.capture and signature in self.warmed and len(self.graphs) < MAX_GRAPHS:
            graph = self._captured(evicting)
            self.graphs[signature] = graph
            self.loop.graph_captured()
        if graph is not None:
            graph.replay()
            self._advance(signature)
        elif self.capture and len(self.graphs) < MAX_GRAPHS:  # warm-up for a capture: on a side stream, as graphs need
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                self._run(evicting)
            torch.cuda.current_stream().wait_stream(stream)
            self.warmed.add(signature)
        else:
            self._run(evicting)
            self.warmed.add(signature)
        assert self.ids is not None
        return self.ids.view(-1), None, None

    def _start(self, tokens: list[int]) -> None:
        """The device tensors the steps advance: the current token of each sequence and its position; under the
        ``flex`` backend, the log-sum-exps of a window of several queries, carried from step to step
        (:func:`kvlab.attention.observe.carry_window_lse`), where flex decodes every layer (a sparse reader's layers
        take kvlab's own kernel)."""
        loop = self.loop
        device = loop.loaded.device
        if loop.attention == FLEX and loop.cache.query_window > 1 and not loop.spec.policy.reads_sparsely:
            carry_window_lse(loop.cache.layers)  # flex gives each step's query's: the window votes in one pass
        loop.cache.make_static(received_at_once=loop.attention == FLEX)
        if self.capture:
            loop.fuse_layers()
        self.ids = torch.tensor(tokens, dtype=torch.long, device=device).unsqueeze(1)
        self.position = torch.tensor([loop.cache.seen_tokens], dtype=torch.long, device=device)

    def _signature(self, evicting: bool) -> Signature:
        """What the host decides for the next step, worked out on a copy of its counts."""
        loop = self.loop
        heap = loop.cache
        state = heap.host_state()
        heap.account_appended(1)
        counts = tuple(loop.eviction_counts()) if evicting else (0,) * len(heap.layers)
        compacts = heap.account_evictions(counts, replayed=False)
        heap.restore(state)
        return evicting, counts, compacts

    def _captured(self, evicting: bool) -> torch.cuda.CUDAGraph:
        """The step recorded in a CUDA graph. Recording runs the step's host logic but none of its device work, so
        the host's counts are put back afterwards; the replay that follows is the step."""
        heap = self.loop.cache
        state = heap.host_state()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            self._run(evicting, account=False)
        heap.restore(state)
        return graph

    def _run(self, evicting: bool, account: bool = True) -> None:
        """The step itself: the model over the current token at its position, the eviction, the next token. A step
        being recorded does not ``account`` its reads on the host: the replays do (:meth:`_advance`)."""
        loop = self.loop
        assert self.ids is not None and self.position is not None
        logits = loop.model_forward(self.ids, self.position, -1, decoding=True)
        loop.step_done(decoding=account)
        if evicting:
            loop.evict(next_position=self.position + 1)
        self.ids.copy_(logits.argmax(dim=-1, keepdim=True))
        self.position.add_(1)

    def _advance(self, signature: Signature) -> None:
        """The host's counts after a replayed step, by the rules an eager step follows."""
        loop = self.loop
        evicting, counts, _ = signature
        loop.cache.account_appended(1)
        loop.step_done(decoding=True)
        if evicting:
            loop.cache.account_evictions(counts, replayed=True)
