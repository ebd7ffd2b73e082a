"""What a generation yields and gives back: an :class:`Event` per step for the dashboard, and one
:class:`GenerationResult` that the command line, ``eval``, sweeps and the live page all store the same way."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from kvlab.cache.demotion import DemotionReport
from kvlab.cache.layer import survivors


@dataclass
class Event:
    """One step of a generation as the dashboard sees it.

    ``kind`` is ``prefill`` (a chunk of context was read), ``compress`` (prefill mode's one eviction) or ``decode``
    (a token was chosen; ``token_ids`` holds it for each sequence). ``kv_bytes`` are the K/V bytes of the slots
    holding a token after the step (live slots times the bytes one slot takes in the heap's tensors) and
    ``kv_reserved_bytes`` those of the heap's tensors (their sizes as allocated); ``kv_bytes_full`` is what a full
    cache of the same dtype and shapes would hold after the same tokens (computed, since no full cache exists).
    ``dead_share`` is the share of free slots among those in use, ``compactions`` the compactions so far. ``stats``
    holds the requested attention statistics of the step's forward pass, as CPU tensors. ``positions`` are the
    heap's position tensors, valid until the generation goes on. ``demoted_bytes`` are the bytes demotion holds in
    each tier (:data:`kvlab.cache.demotion.TIERS`; ``None`` where the run deletes what it evicts). ``seconds`` is the
    wall time the engine took to produce the event, the device synchronised.
    """

    kind: Literal["prefill", "compress", "decode"]
    step: int
    seen_tokens: int
    kept_per_layer: list[int]
    kv_bytes: int
    kv_bytes_full: int
    kv_reserved_bytes: int = 0
    dead_share: float = 0.0
    compactions: int = 0
    token_ids: list[int] | None = None
    stats: dict[str, torch.Tensor] | None = None
    logits: torch.Tensor | None = None
    positions: list[torch.Tensor] = field(default_factory=list, repr=False)
    demoted_bytes: dict[str, int] | None = None
    seconds: float = 0.0

    def survivors(self) -> list[torch.Tensor]:
        """Original positions of the tokens held after this step, per layer, ``(batch, kv_heads, kept)`` in
        increasing order on CPU; where KV heads hold different numbers of tokens (Ada-KV), ``kept`` is the most any
        holds and the others end in free (negative) entries."""
        held = [positions.cpu() for positions in self.positions]
        return [survivors(positions, int((positions >= 0).sum(-1).max())) for positions in held]


@dataclass
class GenerationResult:
    """What one generation produced and held, with figures read from the tensors and clocks.

    ``kv_bytes`` and ``peak_kv_bytes`` are the bytes of slots holding a token (at the end; at the most, after a
    forward pass and before eviction); ``kv_reserved_bytes`` and ``peak_kv_reserved_bytes`` those of the heap's
    tensors. ``compactions`` counts the heap's compactions and ``compaction_seconds`` times those outside static
    decode steps (inside one, a compaction is part of the step's time); ``decode_graphs`` is the number of CUDA
    graphs the decode steps were captured in (0: eager). ``ranked_slots`` counts the slots the evictions ranked
    (over sequences, KV heads and layers) and ``ranking_seconds`` times their scoring and selection outside static
    steps; ``tie_share`` is the share of their cuts (per layer, KV head and eviction) that fell on tied scores, so
    that the position tie-break decided (``None``: nothing was evicted). ``read_bytes_per_token`` is the mean K/V
    bytes attention read per decoded token over the batch (``None`` without decoding). ``prefill_seconds`` and
    ``decode_seconds`` are the engine's
    own time reading (and compressing) the prompt and decoding, summed over its events; a generation continuing a
    context read once for several policies counts that read's seconds and peak GPU allocation too, as a separate run
    would. ``reconstruction_seconds`` is the part of ``prefill_seconds`` that KVzip's reconstruction of the context
    took (0 for every other policy). ``demotion`` reports a demoting run's tiers and what moved between them
    (:class:`kvlab.cache.demotion.DemotionReport`; ``None`` where evicted tokens are deleted). ``token_seconds`` is the
    time of each decode step (so the first steps carry a graph's warm-up and capture, and the steady rate is read
    from the later ones). ``peak_gpu_bytes`` is
    ``torch.cuda.max_memory_allocated`` over the generation (None on a CPU); on a model split over several GPUs it is
    the sum of each GPU's own peak (``peak_gpu_bytes_per_device``, by device name), which bounds the peak of their sum
    from above since the GPUs need not peak at the same moment. ``kv_bytes_per_device`` and
    ``kv_reserved_bytes_per_device`` are ``kv_bytes`` and ``kv_reserved_bytes`` by the device the heap's tensors live
    on, each layer's where the layer runs. ``device`` names every device the model computed on (``cuda:0+cuda:1``).
    ``scope_seconds`` is the part of ``prefill_seconds`` the global eviction scope took to gather every layer's scores
    to one device and decide the layer budgets (0 in the local scope, :mod:`kvlab.cache.scopes`).
    """

    tokens: list[list[int]]
    texts: list[str]
    context_tokens: int
    budget_tokens: int | None
    kept_per_layer: list[int]
    kv_bytes: int
    kv_bytes_full: int
    peak_kv_bytes: int
    kv_reserved_bytes: int
    peak_kv_reserved_bytes: int
    dead_share: float
    compactions: int
    compaction_seconds: float
    aux_bytes: int
    prefill_seconds: float
    decode_seconds: float
    peak_gpu_bytes: int | None
    device: str
    dtype: str
    layout: str
    decode_graphs: int
    ranked_slots: int = 0
    ranking_seconds: float = 0.0
    tie_share: float | None = None
    reconstruction_seconds: float = 0.0
    kv_bytes_per_device: dict[str, int] = field(default_factory=dict)
    kv_reserved_bytes_per_device: dict[str, int] = field(default_factory=dict)
    peak_gpu_bytes_per_device: dict[str, int] | None = None
    scope_seconds: float = 0.0
    read_bytes_per_token: float | None = None
    demotion: DemotionReport | None = None
    token_seconds: list[float] = field(default_factory=list)

    @property
    def mean_kept_tokens(self) -> int:
        """Tokens held per layer and KV head at the end, the mean over layers."""
        return round(sum(self.kept_per_layer) / len(self.kept_per_layer)) if self.kept_per_layer else 0

    def to_json(self) -> dict[str, Any]:
        """The CLI's ``--json`` object (first sequence's text and tokens at top level)."""
        return {
            "text": self.texts[0],
            "tokens": self.tokens[0],
            "texts": self.texts,
            "batch_tokens": self.tokens,
            **{
                name: getattr(self, name)
                for name in (
                    "context_tokens",
                    "budget_tokens",
                    "kv_bytes",
                    "kv_bytes_full",
                    "peak_kv_bytes",
                    "kv_reserved_bytes",
                    "peak_kv_reserved_bytes",
                    "dead_share",
                    "compactions",
                    "compaction_seconds",
                    "aux_bytes",
                    "kept_per_layer",
                    "prefill_seconds",
                    "decode_seconds",
                    "peak_gpu_bytes",
                    "device",
                    "dtype",
                    "layout",
                    "decode_graphs",
                    "ranked_slots",
                    "ranking_seconds",
                    "tie_share",
                    "reconstruction_seconds",
                    "kv_bytes_per_device",
                    "kv_reserved_bytes_per_device",
                    "peak_gpu_bytes_per_device",
                    "scope_seconds",
                    "read_bytes_per_token",
                    "token_seconds",
                )
            },
            "demotion": None if self.demotion is None else dataclasses.asdict(self.demotion),
        }
