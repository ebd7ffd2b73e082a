"""Every quantitative claim of the source articles, with how kvlab gets its figure.

Three articles, identified by their numbers (002, 003, 004) and titles; their words are quoted short. Claims keep
stable numbers: 1 to 36 in the order they were first listed, 37 and up for figures found later. A claim is
*computed* (from published configs and datasheets, :mod:`~kvlab.claims.computed`), *measured* (from stored runs or
committed profiles), or *not measurable here*: such a claim lists what it needs from kvlab
(:class:`~kvlab.claims.capabilities.Requirements`) and its reason is computed from what kvlab has when it is
evaluated, so that it never says kvlab lacks what it has.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from kvlab.cache.layouts import DEFAULT_COMPACT_AT, LAYOUTS
from kvlab.claims import (
    attention,
    budgets,
    computed,
    generational,
    needle_claims,
    offload,
    pillars,
    precision,
    side_channel,
    sinks,
    timing,
)
from kvlab.claims.capabilities import Capability, Requirements
from kvlab.claims.evidence import Evidence
from kvlab.claims.verdicts import Evaluation, per_model

Source = Literal["computed", "measured", "not measurable"]

ARTICLES: dict[str, str] = {
    "002": "The KV cache as a managed heap",
    "003": "The Goldfish Problem",
    "004": "When 90% of Your KV Cache Doesn't Matter",
}


@dataclass(frozen=True)
class Claim:
    """One claim: its id, the article it is from, what it says, and how kvlab evaluates it."""

    claim_id: str
    article: str
    text: str
    source: Source
    evaluate: Callable[[Evidence], Evaluation]
    requirements: Requirements | None = None

    @property
    def article_label(self) -> str:
        """The article as the table shows it: ``004 · When 90% of Your KV Cache Doesn't Matter``."""
        return f"{self.article} · {ARTICLES[self.article]}"


def _computed(claim_id: str, article: str, text: str, evaluate: Callable[[Evidence], Evaluation]) -> Claim:
    return Claim(claim_id, article, text, "computed", evaluate)


def _measured(claim_id: str, article: str, text: str, evaluate: Callable[[Evidence], Evaluation]) -> Claim:
    return Claim(claim_id, article, text, "measured", evaluate)


def _per_model(evaluate: Callable[[Evidence], Evaluation]) -> Callable[[Evidence], Evaluation]:
    """A claim measured from stored runs, checked on each model of the store separately (:func:`per_model`)."""

    def each(evidence: Evidence) -> Evaluation:
        models = evidence.models
        if len(models) <= 1:
            return evaluate(evidence)
        return per_model([(model, evaluate(evidence.of_model(model))) for model in models])

    return each


def _needing(
    claim_id: str,
    article: str,
    text: str,
    requirements: Requirements,
    source: Source = "not measurable",
    figure: str | None = None,
) -> Claim:
    """A claim whose figure needs what kvlab may lack: its reason is computed from ``requirements`` against what
    kvlab has when it is evaluated (with ``figure``, what can be said without a measurement)."""

    def evaluate(evidence: Evidence) -> Evaluation:
        return requirements.evaluate(evidence, figure=figure)

    return Claim(claim_id, article, text, source, evaluate, requirements)


CATALOGUE: tuple[Claim, ...] = (
    _computed("1", "002", "A 128k context of Llama 3 70B needs about 20 GB of KV cache", computed.kv_70b_at_128k),
    _computed("2", "002", "A 1M-token context pushes the KV cache past 160 GB", computed.kv_70b_at_1m),
    _computed("3", "002", "FP16 uses 4 bytes per element", computed.fp16_bytes),
    _computed("4", "002", "Each layer of a 70B model has 80 heads of dimension 128", computed.heads_of_70b),
    _computed(
        "5", "002", "Llama 3 70B (80 layers, 8 KV heads) uses about 160 KB of KV per token", computed.kv_per_token_70b
    ),
    _computed("6", "002", "100,000 tokens use 16 GB of KV before weights", computed.kv_at_100k),
    _computed(
        "7", "004", "A 70B model at 128K needs about 40 GB (formula: about 43 GB at FP16)", computed.kv_70b_formula
    ),
    _measured(
        "8",
        "002",
        "H2O keeps 100% retrieval accuracy while pruning 80% of the KV cache",
        _per_model(needle_claims.h2o_at_80),
    ),
    _measured(
        "9",
        "002",
        "Needle at 4,096 tokens, pruning 10/30/50/70/90%: H2O 100% throughout; StreamingLLM 90/62/51/40/14%; "
        "random 91/76/52/34/5%",
        _per_model(needle_claims.published_table_claim),
    ),
    _measured(
        "10",
        "002",
        "Heavy hitters are about 5% of the sequence; keeping them plus 4 initial tokens and a small window gives "
        "perfect recall",
        _per_model(needle_claims.heavy_hitters_5pct),
    ),
    _measured(
        "11", "002", "Early layers have high attention entropy, deep layers low", attention.entropy_falls_with_depth
    ),
    _measured(
        "12",
        "002",
        "Layer-wise budgets (40% of the budget to the first 10 layers, 10% to the last 10) cut memory by another 15%",
        _per_model(budgets.preset_saves_memory),
    ),
    _measured(
        "13",
        "002",
        "Removing heavy-hitter pillars raises attention entropy and lowers retrieval accuracy",
        pillars.pillars_removed,
    ),
    _needing(
        "14",
        "002",
        "Bitmasking is cheap but frees no memory until compaction; compaction frees memory at a copy cost growing "
        "with layers; compact at 50% sparsity",
        Requirements(
            needs=tuple(Capability.layout(layout) for layout in LAYOUTS),
            beyond="a design trade-off without a figure to check; bench/heap_gpu.py times the layouts (threshold "
            f"compacts at a dead share of {DEFAULT_COMPACT_AT:g} by default)",
        ),
    ),
    _needing(
        "15",
        "002",
        "An indirection-table kernel is 20% slower than FlashAttention and allows 10x longer contexts",
        Requirements(
            needs=(Capability.backend("indirection-table"),),
            beyond="the article's Triton kernel is not published",
        ),
    ),
    _measured(
        "16",
        "002",
        "FP16 for the top 5% of tokens, 4-bit for the rest, with 80% eviction: total KV memory -92%, LongBench "
        "within 1%",
        _per_model(precision.hybrid_precision),
    ),
    _needing(
        "17",
        "002",
        "Llama 3 has more distinct pillars than Mistral; Llama 3 70B survives a 90% prune, Mistral 7B loses "
        "coherence past 70%",
        Requirements(
            needs=(Capability.model("Llama-3-70B"), Capability.model("Mistral-7B")),
            beyond="the article defines no coherence measure",
        ),
    ),
    _measured(
        "18",
        "002",
        "Adding noise to H2O's ranking prevents identifying cached tokens by timing, at a small accuracy cost",
        side_channel.noise_hides_timing,
    ),
    _measured(
        "19",
        "002",
        "Keeping the first 4 tokens keeps softmax stable at any pruning depth; up to 32 may be needed",
        _per_model(sinks.sinks_keep_softmax_stable),
    ),
    _measured(
        "20",
        "002",
        "Removing only the first token raises perplexity by 400% after 1,000 generated tokens",
        _per_model(sinks.first_token_removed),
    ),
    _measured(
        "21",
        "002",
        "A three-tier generational cache cuts sorting overhead by 80%",
        _per_model(generational.sorting_overhead),
    ),
    _computed(
        "22",
        "002",
        "Managed eviction reaches 1,000,000 tokens within 12 GB of system RAM (Llama 3 8B quantised, 16 GB laptop)",
        computed.million_tokens_in_12gb,
    ),
    _computed(
        "23",
        "002",
        "Cutting KV memory by 80% takes an A100 80GB from 4 to 20 concurrent 32k-context users",
        computed.concurrency_a100,
    ),
    _measured(
        "24",
        "002",
        "Pruned caches can outperform full caches by removing distracting history",
        _per_model(needle_claims.pruned_beats_full),
    ),
    _needing(
        "25",
        "002",
        'vLLM 0.8.0 ships "HeapContext", H2O-style pruning in PagedAttention',
        Requirements(needs=(Capability.package("vllm"),), beyond="a statement about vLLM's releases"),
    ),
    _computed("26", "003", "The KV cache can take up to 90% of a GPU's HBM at long contexts", computed.kv_share_of_hbm),
    _measured("27", "003", "Keys need 4 bits; values survive 2 bits", _per_model(precision.keys_and_values_bits)),
    _measured(
        "28",
        "004",
        "Intelligently evicting 90% of cached tokens often gives negligible accuracy loss",
        _per_model(needle_claims.negligible_loss_at_90),
    ),
    _measured(
        "29",
        "004",
        "Over 50% of attention weight often concentrates on the first few tokens",
        attention.first_token_share,
    ),
    _needing(
        "30",
        "004",
        "H2O: 29x throughput on OPT-6.7B with 20% of the cache",
        Requirements(
            needs=(Capability.model("OPT-6.7B"), Capability.device("A100")),
            beyond="a throughput against the H2O paper's serving systems (DeepSpeed, Accelerate, FlexGen)",
        ),
    ),
    _needing(
        "31",
        "004",
        "SnapKV: 3.6x faster generation and 8.2x memory efficiency at 16K; 380K tokens on one A100-80GB",
        Requirements(
            needs=(Capability.model("LWM-Text-Chat-1M"), Capability.device("A100")),
            beyond="timed in SnapKV's own benchmark setup",
        ),
    ),
    _needing(
        "32",
        "004",
        "RocketKV: 400x compression, 3.7x end-to-end speed-up, 32.6% lower peak memory",
        Requirements(
            needs=(Capability.policy("rocketkv"), Capability.model("Llama-3.1-8B")),
            beyond="the paper's speed-up and peak memory are its end-to-end decoding of long contexts at 400x "
            "compression against the full cache",
        ),
    ),
    _computed(
        "33",
        "004",
        "PyramidKV budgets: layers 0-15 100%, 16-31 70%, 32-47 50%, 48-63 30%",
        computed.pyramid_budgets,
    ),
    _measured("34", "004", "Under 4K tokens, eviction overhead often exceeds its benefit", timing.eviction_overhead),
    _measured(
        "35",
        "004",
        "4-bit KV quantisation plus 90% eviction cuts memory 40x with under 2% accuracy loss",
        _per_model(precision.quantised_and_evicted),
    ),
    _measured(
        "36",
        "004",
        "Use at least 30% budget for reasoning; prefer attention-based eviction over heuristics",
        _per_model(needle_claims.attention_beats_heuristics),
    ),
    _needing(
        "37",
        "002",
        "Disk-based offloading introduces a 100x latency penalty",
        Requirements(needs=(Capability.option("disk_tier_mib"),), pending=offload.disk_penalty),
        source="measured",
    ),
    _needing(
        "38",
        "002",
        "Thermal throttling from 3.5 GHz to 2.8 GHz increased per-token latency by 22%",
        Requirements(needs=(Capability.device("Apple M2"),), beyond="the article's MacBook Air under sustained load"),
        figure=f"were per-token time proportional to the clock, 3.5 → 2.8 GHz would add {3.5 / 2.8 - 1:.0%}",
    ),
)

BY_ID: dict[str, Claim] = {claim.claim_id: claim for claim in CATALOGUE}
