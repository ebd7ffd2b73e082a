"""The commands that reproduce a claim's figure, each written in one place (shell commands, run from the
repository root).

Measured figures come from ``kvlab sweep`` (needles), ``bench/sink_ablation.py`` (perplexity and KL divergence with
and without attention sinks, each pass a ``kvlab quality`` run), ``bench/heap_quality.py`` (``kvlab quality`` passes
of several cache configurations in one process), ``bench/short_context_overhead.py`` (time with and without eviction
below 4K tokens; without its results, ``kvlab quality`` passes, which decode every step),
``bench/attention_profile.py`` (attention per layer), ``bench/pillar_entropy.py`` (attention entropy with the heavy
hitters removed), ``kvlab sidechannel`` (the side-channel experiment, ``bench/side_channel.sh``) and
``bench/demotion_gpu.py`` (decode time with evicted tokens demoted to CPU memory and disk); computed figures and
unmeasurable claims are shown again by ``kvlab claims --only <id>``. ``bench/heap_claims.sh`` runs the heap
claims' commands on a GPU.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence

from kvlab.budget import kept_tokens
from kvlab.claims.needle import CLAIM_CONTEXT, PRUNING
from kvlab.modes import MODES, PREFILL, Mode

#: The policy that reads a text with only its first token evicted: the ablation of article 002's claim 20.
FIRST_TOKEN_ABLATION = "drop_first"
#: The attention-sink counts of the StreamingLLM ablation (article 002: "4 tokens ... up to 32 may be needed").
SINK_COUNTS = (0, 1, 4, 8, 32)
#: The budgets in tokens ("pruning depths") the sink ablation is measured at: a quality pass takes its budget in
#: tokens, and reads a 256-token prefix before 1,024 scored tokens.
SINK_BUDGETS = (64, 128, 256)
#: The budget of the first-token ablation's run (the ablation itself takes none; StreamingLLM's runs beside it do).
ABLATION_BUDGET = 256
#: The evicting policies timed against the full cache below 4K tokens.
TIMED_POLICIES = ("streaming", "h2o", "snapkv", "tova")
SHIPPED_MODEL = "kvlab/data/models/kvlab-tiny-llama"
#: Every policy of the needle grid that the published table is measured on.
NEEDLE_POLICIES = ("full", "h2o", "streaming", "random", "snapkv", "pyramidkv", "tova", "knorm")


def model_file_name(model: str) -> str:
    """A model's name as the benchmarks name their result files: its last path component."""
    return model.rstrip("/").rsplit("/", 1)[-1]


def keeps(pruning: tuple[float, ...]) -> str:
    """Kept fractions for pruning ratios, as ``--keep`` takes them."""
    return ",".join(f"{1 - p:.2g}" for p in pruning)


def claims_command(claim_id: str) -> str:
    """Shows one claim again (computed figures are recomputed; unmeasurable claims give their reason)."""
    return f"python -m kvlab claims --only {claim_id}"


def model_option(model: str | None) -> str:
    """``--model <model>`` for the model a figure came from; nothing for the default model."""
    return f" --model {shlex.quote(model)}" if model else ""


def needle_sweep(
    db: str,
    policies: tuple[str, ...] = NEEDLE_POLICIES,
    pruning: tuple[float, ...] = PRUNING,
    model: str | None = None,
) -> str:
    """The needle grid at the claim's 4,096 tokens, 100 random-depth trials per cell, both modes (the grid of
    ``bench/needle_claim.py``)."""
    return (
        f"python -m kvlab sweep{model_option(model)} --policies {','.join(policies)} --keep {keeps(pruning)} "
        f"--mode {','.join(MODES)} --contexts {CLAIM_CONTEXT} --depths random --trials 100 --batch-size 50 "
        f"--chunk 256 --db {shlex.quote(db)}"
    )


def timing_overhead(db: str, model: str | None = None) -> str:
    """Decode timing at 2,048 to 4,096 tokens: ``kvlab quality`` passes decode every one of their 1,024 steps (no
    stop rule), the full cache and evicting policies at a 256-token budget on the same text, model and device."""

    def one(policy: str) -> str:
        return (
            f"python -m kvlab quality{model_option(model)} --policy {policy} --prefix $prefix --tokens 1024 "
            f"--db {shlex.quote(db)}"
        )

    return (
        f"for prefix in 1024 2048 3072; do {one('full')}; "
        f"for policy in {' '.join(TIMED_POLICIES)}; do {one('$policy --budget 256')}; done; done"
    )


def sink_ablation(db: str, budgets: tuple[int, ...] = SINK_BUDGETS, model: str | None = None) -> str:
    """The full cache, the first token removed, and StreamingLLM with 0 to 32 sinks at each budget, over the
    default held-out text (``bench/sink_ablation.py``: every pass a ``kvlab quality`` run in the store)."""

    name = model_file_name(model or SHIPPED_MODEL)

    def one(budget: str) -> str:
        return (
            f"python bench/sink_ablation.py{model_option(model)} --budget {budget} --prefix 256 --tokens 1024 "
            f"--db {shlex.quote(db)} --out bench/results/sinks/{name}-budget-{budget}.json"
        )

    if len(budgets) == 1:
        return one(str(budgets[0]))
    return f"for budget in {' '.join(str(budget) for budget in budgets)}; do {one('$budget')}; done"


def overhead_benchmark(model: str = SHIPPED_MODEL) -> str:
    """Time with and without eviction at 1,024 to 4,096 tokens, side by side in one process."""
    name = model_file_name(model)
    return (
        f"python bench/short_context_overhead.py{model_option(model)} "
        f"--out {shlex.quote(f'bench/results/overhead/{name}.json')}"
    )


def demotion_timing() -> str:
    """Decode time per token at 128k tokens with evicted tokens deleted, demoted to CPU memory and to an offload
    file, on one GPU (a Llama-3-8B-shaped model with random weights)."""
    return "python bench/demotion_gpu.py bench/results/demotion --new-tokens 24"


def attention_profile(model: str = SHIPPED_MODEL) -> str:
    """The attention share of the first token and the entropy, per layer, of one model."""
    return f"python bench/attention_profile.py{model_option(model)}"


# --- the cache as a managed heap: allocations, precision tiers, a generational cache, pillars, a noise floor -------

#: The layer and head allocations compared on one policy (SnapKV: uniform as published, the articles' preset, the
#: model's entropy profile, CAKE, Ada-KV), at the kept fractions :data:`ALLOCATION_KEEPS`.
ALLOCATION_BASE = "snapkv"
ALLOCATIONS = (
    ALLOCATION_BASE,
    f"{ALLOCATION_BASE}[layer_allocation=preset]",
    f"{ALLOCATION_BASE}[layer_allocation=entropy]",
    f"{ALLOCATION_BASE}[layer_allocation=cake]",
    f"{ALLOCATION_BASE}[head_allocation=adakv]",
)
ALLOCATION_KEEPS = (0.1, 0.2, 0.3)
#: Article 002's claim 12: the preset "cuts memory by another 15%", so it runs at 85% of the uniform kept fractions.
PRESET_SAVING = 0.15
PRESET_KEEPS = tuple(round((1 - PRESET_SAVING) * keep, 4) for keep in ALLOCATION_KEEPS)
#: Key and value bits of claim 27, every token kept and quantised (hot 0): keys alone, values alone, and KIVI's K4/V2.
BIT_WIDTHS = ((8, 16), (4, 16), (2, 16), (16, 8), (16, 4), (16, 2), (4, 2))
#: Claim 16's hybrid: 80% evicted, of the kept 20% a quarter (5% of all tokens) at 16 bits, the rest at 4 bits.
HYBRID_KEEP = 0.2
HYBRID = "hot=0.25,key_bits=4,value_bits=4"
#: Claim 35: 90% evicted and every kept token at 4 bits.
QUANTISED_KEEP = 0.1
QUANTISED = "hot=0,key_bits=4,value_bits=4"
#: The policies the precision claims evict with: H2O's heavy hitters (article 002) and SnapKV (query-aware).
PRECISION_BASES = ("h2o", "snapkv")
#: Claim 21: the generational cache (its default tiers, and a middle tier of 10% of the budget) against H2O's
#: ranking of the whole cache, in streaming mode at :data:`GENERATIONAL_KEEP`, decoded eagerly so that every
#: ranking is timed, in the compact layout: the generational cache passes only its tiers' slots to the selection
#: where a layer's slots are in position order with none free, which the compact layout keeps after every eviction.
GENERATIONAL = ("generational", "generational[middle=0.1]", "h2o")
GENERATIONAL_KEEP = 0.2
GENERATIONAL_LAYOUT = "compact"
#: Claim 13: heavy hitters removed per layer and KV head at 4,096 tokens (32, and 205: the 5% article 002 calls
#: heavy hitters), the question read after the compression so that it does not make the needle a heavy hitter.
PILLAR_COUNTS = (32, 205)
PILLAR_PROMPTS = 20
#: Quality passes of the heap claims: a 3,072-token prefix and 1,024 scored tokens, 4,096 tokens in all.
QUALITY_PREFIX = 3072
QUALITY_TOKENS = 1024


def with_options(policy: str, options: str) -> str:
    """A policy with cache options as ``kvlab sweep --policies`` takes it: ``h2o[hot=0.25,key_bits=4]``."""
    return f"{policy}[{options}]"


def bits_variant(key_bits: int, value_bits: int, policy: str = ALLOCATION_BASE) -> str:
    """The policy holding every kept token at ``key_bits``/``value_bits`` (16 bits are the default, left out)."""
    widths = [f"{name}={bits}" for name, bits in (("key_bits", key_bits), ("value_bits", value_bits)) if bits != 16]
    return with_options(policy, ",".join(["hot=0", *widths]))


def quality_budget(keep: float) -> int:
    """The token budget of a quality pass that keeps ``keep`` of its prefix."""
    return kept_tokens(QUALITY_PREFIX, keep)


def heap_sweep(
    db: str,
    policies: Sequence[str],
    keeps: Sequence[float] = (),
    model: str | None = None,
    *,
    mode: Mode = PREFILL,
    eager: bool = False,
    query_agnostic: bool = False,
    layout: str | None = None,
) -> str:
    """The needle grid of the heap claims: 4,096 tokens, 100 random-depth trials per cell, as :func:`needle_sweep`
    reads its contexts (so that runs both make are one run), in one mode and (unless named) the default layout."""
    keep = f" --keep {','.join(f'{value:g}' for value in keeps)}" if keeps else ""
    flags = (" --eager" if eager else "") + (" --query-agnostic" if query_agnostic else "")
    flags += f" --layout {layout}" if layout else ""
    return (
        f"python -m kvlab sweep{model_option(model)} --policies {shlex.quote(','.join(policies))}{keep} --mode {mode} "
        f"--contexts {CLAIM_CONTEXT} --depths random --trials 100 --batch-size 50 --chunk 256{flags} "
        f"--db {shlex.quote(db)}"
    )


def heap_quality(
    db: str,
    passes: Sequence[tuple[Mode, int | None, Sequence[str]]],
    model: str | None = None,
    layout: str | None = None,
) -> str:
    """``kvlab quality`` passes over the default held-out text, several in one process: each ``(mode, budget in
    tokens or None, policies)`` (a policy that takes no budget runs without one), in the default layout unless
    one is named."""
    shown = " ".join(
        "--pass " + shlex.quote(f"{mode}:{budget if budget is not None else 'none'}:{','.join(policies)}")
        for mode, budget, policies in passes
    )
    return (
        f"python bench/heap_quality.py{model_option(model)} --prefix {QUALITY_PREFIX} --tokens {QUALITY_TOKENS} "
        f"{shown}{f' --layout {layout}' if layout else ''} --db {shlex.quote(db)}"
    )


def pillar_entropy(model: str | None = None) -> str:
    """The question's attention entropy with the full cache and with the heaviest hitters removed."""
    name = model_file_name(model or SHIPPED_MODEL)
    return (
        f"python bench/pillar_entropy.py{model_option(model)} --counts {','.join(str(c) for c in PILLAR_COUNTS)} "
        f"--trials {PILLAR_PROMPTS} --out {shlex.quote(f'bench/results/pillars/{name}.json')}"
    )


#: The side-channel experiments kvlab ships, every model and policy of them.
SIDE_CHANNEL_SCRIPT = "bash bench/side_channel.sh"


def side_channel(
    out: str,
    *,
    model: str,
    policy: str,
    params: Sequence[tuple[str, object]],
    budget: str,
    noise: Sequence[tuple[str, float]],
    extra: str,
) -> str:
    """One side-channel experiment, written to ``out``: ``budget`` is ``--keep F`` or ``--budget N``, ``noise`` the
    noisy levels (a run without noise is always part of it; the command crosses the kinds with the scales), ``extra``
    any further options."""
    kinds = dict.fromkeys(kind for kind, _ in noise)
    scales = dict.fromkeys(scale for _, scale in noise)
    options = "".join(f" --param {shlex.quote(f'{key}={value}')}" for key, value in params)
    return (
        f"python -m kvlab sidechannel{model_option(model)} --policy {policy}{options} {budget}"
        + "".join(f" --noise {kind}" for kind in kinds)
        + "".join(f" --noise-scale {scale:g}" for scale in scales)
        + extra
        + f" --out {shlex.quote(out)}"
    )
