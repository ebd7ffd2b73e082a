"""The decode loop: tokens chosen one at a time until the generation length or every sequence's stop token.

One loop (:func:`decode`) checks the stop rule (:mod:`kvlab.engine.stopping`) and yields an event per token; a step
feeds the latest token and gives the next one, either eagerly (:class:`EagerSteps`: one forward pass, the eviction,
the greedy choice or the forced token) or in static steps captured in CUDA graphs
(:class:`~kvlab.engine.static.StaticSteps`), which give the same tokens. The loop and the steps use only the public
methods of the generation (:class:`Loop`) and of its heap.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Literal, Protocol

import torch

from kvlab.attention.backends import AttentionBackend
from kvlab.cache.heap import KVHeap
from kvlab.engine.events import Event
from kvlab.engine.spec import RunSpec
from kvlab.engine.stopping import StopTokens
from kvlab.models.loading import LoadedModel


class Loop(Protocol):
    """What decoding needs of a generation (:class:`kvlab.engine.generation.Generation`)."""

    spec: RunSpec
    loaded: LoadedModel
    cache: KVHeap
    attention: AttentionBackend
    forced_ids: torch.Tensor | None
    stops: StopTokens

    def forward(
        self, ids: torch.Tensor, decoding: bool = False
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor] | None]: ...

    def model_forward(
        self, ids: torch.Tensor, positions: torch.Tensor, last_position: int, *, decoding: bool = False
    ) -> torch.Tensor: ...

    def step_done(self, decoding: bool) -> None: ...

    def evict(self, next_position: int | torch.Tensor | None = None) -> None: ...

    def evicts_after(self, index: int) -> bool: ...

    def eviction_counts(self, to_budget: bool | None = None) -> list[int]: ...

    def graph_captured(self) -> None: ...

    def fuse_layers(self) -> None: ...

    def event(self, kind: Literal["prefill", "compress", "decode"], step: int, **extra: Any) -> Event: ...


class Steps(Protocol):
    """How one decode step runs: feed ``ids`` (``(batch,)``, the tokens just chosen, the ``index``-th of the run) and
    give the next tokens, the logits the step computed where the host has them, and the requested statistics."""

    def step(
        self, ids: torch.Tensor, index: int
    ) -> tuple[torch.Tensor, torch.Tensor | None, dict[str, torch.Tensor] | None]: ...


class EagerSteps:
    """Decode steps of one eager forward pass each (the forced token in place of the greedy choice where given)."""

    def __init__(self, loop: Loop) -> None:
        self.loop = loop

    def step(
        self, ids: torch.Tensor, index: int
    ) -> tuple[torch.Tensor, torch.Tensor | None, dict[str, torch.Tensor] | None]:
        loop = self.loop
        logits, stats = loop.forward(ids.unsqueeze(1), decoding=True)
        if loop.evicts_after(index):
            loop.evict()
        forced = loop.forced_ids
        return (logits.argmax(dim=-1) if forced is None else forced[:, index + 1]), logits, stats


def decode(loop: Loop, logits: torch.Tensor, step: int, steps: Steps) -> Iterator[Event]:
    """Greedy decoding (or the forced tokens) from the prompt's last ``logits``, one event per token numbered from
    ``step``. A decode event carries the logits its step computed where the host has them (eager steps; the last
    event, which runs no step, the latest ones); stop tokens end a sequence, and the run once all have ended."""
    total = loop.spec.max_new_tokens
    ids = logits.argmax(dim=-1) if loop.forced_ids is None else loop.forced_ids[:, 0]
    latest: torch.Tensor | None = logits
    for index in range(total):
        tokens = ids.view(-1).tolist()
        if loop.stops.all_finished(tokens) or index == total - 1:
            yield loop.event("decode", step + index, token_ids=tokens, logits=latest)
            return
        ids, latest, stats = steps.step(ids, index)
        yield loop.event("decode", step + index, token_ids=tokens, logits=latest, stats=stats)
