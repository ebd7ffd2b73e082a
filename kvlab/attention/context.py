"""What the attention function knows during one forward pass of a kvlab run: the heap it reads and writes, and what
the run observes of the pass (statistics, an observer of the probabilities, a sparse reader's selection)."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from kvlab.attention.backends import SDPA, AttentionBackend
from kvlab.attention.stats import StatsAccumulator
from kvlab.cache.heap import KVHeap
from kvlab.cache.layer import HeapLayer
from kvlab.cache.sparse import ReadCount, SparseRead

#: What observes a forward's attention probabilities block by block (see :attr:`ForwardContext.observe`).
Observer = Callable[[int, torch.Tensor, torch.Tensor], None]


@dataclass(frozen=True)
class PendingReceived:
    """One layer's decoded query and its kernel's log-sum-exp, whose received attention (H2O's scores, TOVA's votes)
    is computed, and which join the layer's remembered window (SnapKV, TOVA), for every layer at once after the pass
    (:func:`kvlab.attention.flex.settle_received`)."""

    layer: HeapLayer
    query: torch.Tensor
    lse: torch.Tensor


@dataclass
class ForwardContext:
    """What the attention function needs to know during one forward pass of a kvlab run (the positions of the pass
    are the heap's :attr:`~kvlab.cache.heap.KVHeap.positions`)."""

    cache: KVHeap
    stats: StatsAccumulator | None = None
    #: Called with every block of attention probabilities the pass computes: ``(layer_idx, probs, key_positions)``,
    #: ``probs`` ``(batch, kv_heads, groups, queries, keys)`` in float32 and the keys' original positions
    #: ``(batch, kv_heads, keys)``, keys in slot order (KVzip's reconstruction, :mod:`kvlab.engine.reconstruction`).
    observe: Observer | None = None
    #: While decoding under a sparse reader (Quest, RocketKV): its selection, applied to every layer it reads
    #: sparsely, and the count of the bytes attention read (:mod:`kvlab.cache.sparse`).
    reader: SparseRead | None = None
    reads: ReadCount | None = None
    #: Whether the pass decodes a token (what demoted pages it recalls is then counted per decoded token).
    decoding: bool = False
    #: The backend static decode steps attend with, resolved for the device (:mod:`kvlab.attention.backends`).
    attention: AttentionBackend = SDPA
    #: The ``flex`` backend's block tables of every layer, built once per pass where the heap placed the pass's token
    #: in every layer at its start (:func:`kvlab.attention.flex.stacked_block_tables`).
    block_tables: tuple[torch.Tensor, ...] | None = None
    #: The ``flex`` backend's decoded queries whose received attention every layer put off to the end of the pass, to
    #: be computed for all layers at once (:func:`kvlab.attention.function.finish_pass`); ``None`` until the pass's
    #: first layer decides whether its layers do.
    received_later: list[PendingReceived] | None = None


_CONTEXT: contextvars.ContextVar[ForwardContext | None] = contextvars.ContextVar("kvlab_forward", default=None)


@contextlib.contextmanager
def forward_context(context: ForwardContext) -> Iterator[None]:
    """Make ``context`` visible to the attention function for the duration of one forward pass."""
    token = _CONTEXT.set(context)
    try:
        yield
    finally:
        _CONTEXT.reset(token)


def current() -> ForwardContext | None:
    """The forward pass's context, or ``None`` outside a kvlab run."""
    return _CONTEXT.get()
