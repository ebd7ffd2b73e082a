"""How to run one generation: the policy and its budget, the mode, the cache spec, and what to observe."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from kvlab.attention.backends import DEFAULT_ATTENTION, SDPA, AttentionBackend, check_attention, resolve_attention
from kvlab.attention.flex import flex_compiles
from kvlab.attention.stats import StatsRequest
from kvlab.budget import Budget
from kvlab.cache.layouts import DEFAULT_COMPACT_AT, DEFAULT_LAYOUT
from kvlab.cache.spec import CacheSpec
from kvlab.errors import KvlabError
from kvlab.modes import PREFILL, STREAMING, Mode, check_mode
from kvlab.policies.base import Policy
from kvlab.policies.variants import Variant, as_variant, check_options, published_options
from kvlab.tasks.bos import DEFAULT_BOS, BosRule, check_bos

#: Context tokens per forward pass in streaming mode unless a chunk is given.
DEFAULT_STREAMING_CHUNK = 256
#: A spec's cache when none is given: the heap's default layout and the policy's published cache options
#: (:func:`kvlab.policies.variants.published_options`), put in place when the spec is made.
PUBLISHED_CACHE = CacheSpec()


@dataclass
class RunSpec:
    """One generation's settings: the ``policy`` (what to keep), its ``budget``, the ``mode``, and the ``cache`` spec
    (how the cache stores what it keeps: layout, precision and demotion tiers, allocation, scope, noise;
    :mod:`kvlab.cache.spec`; none given: the default layout with the policy's published options).

    ``chunk`` is the number of context tokens read per forward pass; ``None`` reads the whole context at once in
    ``prefill`` mode and :data:`DEFAULT_STREAMING_CHUNK` tokens in ``streaming`` mode. ``compression_interval``
    (``streaming`` mode) evicts during decoding once every that many tokens instead of at every token, as kvpress's
    ``DecodingPress`` does: the heap then holds up to budget + interval tokens, which must stay within the chunk so
    that the budget + chunk bound holds. ``static`` chooses how decoding runs: ``None`` in static steps captured in
    CUDA graphs where the run allows it on a GPU, else eagerly; ``True`` in static steps always (eagerly on a CPU: the
    same computation a graph replays); ``False`` eagerly. ``attention`` is the backend static steps attend with
    (:mod:`kvlab.attention.backends`; ``auto`` picks it for the device). ``bos`` is the rule the run's prompts were
    tokenised by (:mod:`kvlab.tasks.bos`; ``auto``: the tokenizer's own), part of its identity. Decoding is greedy.
    """

    policy: Policy
    budget: Budget | None = None
    mode: Mode = PREFILL
    chunk: int | None = None
    max_new_tokens: int = 32
    stop_token_ids: tuple[int, ...] | None = None
    seed: int = 0
    stats: StatsRequest | None = None
    compression_interval: int = 1
    cache: CacheSpec = field(default=PUBLISHED_CACHE)
    static: bool | None = None
    attention: AttentionBackend = DEFAULT_ATTENTION
    bos: BosRule = DEFAULT_BOS

    def __post_init__(self) -> None:
        if self.cache is PUBLISHED_CACHE:
            self.cache = CacheSpec(options=published_options(self.policy))
        check_mode(self.mode)
        check_attention(self.attention)
        check_bos(self.bos)
        if self.chunk is not None and self.chunk <= 0:
            raise KvlabError(f"A chunk of {self.chunk} tokens is not possible; it must be a positive number.")
        if self.max_new_tokens < 0:
            raise KvlabError(f"max_new_tokens must be zero or more, not {self.max_new_tokens}.")
        if self.compression_interval < 1:
            raise KvlabError(f"The compression interval must be at least one token, not {self.compression_interval}.")
        check_options(self.policy, self.cache.options)
        self.policy.check_mode(self.mode)
        self.cache.options.check_mode(self.policy.name, self.mode)
        if self.mode == STREAMING and self.compression_interval > self.chunk_size(self.compression_interval):
            raise KvlabError(
                f"A compression interval of {self.compression_interval} tokens is larger than the chunk of "
                f"{self.chunk_size(self.compression_interval)}; the cache would exceed budget + chunk."
            )

    @classmethod
    def of(
        cls,
        chosen: Variant | Policy,
        budget: Budget | None = None,
        *,
        layout: str = DEFAULT_LAYOUT,
        compact_at: float = DEFAULT_COMPACT_AT,
        **settings: Any,
    ) -> RunSpec:
        """The spec of a run of a variant (a policy with its cache options: ``configure("h2o", hot=0.25)``, or a
        policy alone) at ``budget`` in the heap ``layout``; ``settings`` are the other fields."""
        variant = as_variant(chosen)
        return cls(variant.policy, budget, cache=variant.cache(layout, compact_at), **settings)

    def chunk_size(self, context_tokens: int) -> int:
        """Tokens per prefill forward pass."""
        if self.chunk is not None:
            return self.chunk
        return context_tokens if self.mode == PREFILL else DEFAULT_STREAMING_CHUNK

    def attention_on(self, device: torch.device) -> AttentionBackend:
        """The attention backend the run's static steps use on ``device`` (``auto`` resolved); kvlab's own kernels
        for a run that decodes eagerly (``static=False``), which has no static steps, so that its identity does not
        depend on a backend it never used."""
        if self.static is False:
            return SDPA
        return resolve_attention(self.attention, device.type, flex_compiles())

    def stored_params(self) -> dict[str, object]:
        """The policy's parameters as a run stores them: its own, and the cache options that differ from their
        defaults."""
        return {**self.cache.options.stored(), **self.policy.params()}
