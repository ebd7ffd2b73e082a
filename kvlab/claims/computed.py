"""Claims whose figure kvlab computes from published model configs and GPU datasheets with :mod:`kvlab.costs`.

Every figure is computed when the claim is evaluated; the article's own numbers are the only constants here.
"""

from __future__ import annotations

from kvlab.budget import PYRAMID_BETA, pyramid_shares
from kvlab.claims.evidence import Evidence
from kvlab.claims.units import percent, tokens
from kvlab.claims.verdicts import (
    CONDITIONAL,
    FAILS,
    FORMULA,
    HOLDS,
    Evaluation,
    about,
    about_count,
    judged,
)
from kvlab.costs import (
    GPU_PRESETS,
    MODEL_PRESETS,
    bytes_per_element,
    kv_bytes_for_sequence,
    kv_bytes_per_token,
    sequences_that_fit,
    weight_bytes,
)
from kvlab.units import GB, KB, KIB, gigabytes

K128 = 128 * 1024
"""A "128k" context, as article 004 computes it (131,072 tokens)."""
ONE_M = 1024 * 1024
"""A "1M" context, in the same binary thousands as "128k"."""
FP16 = "fp16"
INT4 = "int4"
#: Quantisation group sizes of 4-bit caches (KIVI uses 32 and 128): each group carries an fp16 scale and zero-point.
QUANT_GROUPS = (32, 128)
LLAMA3_70B = MODEL_PRESETS["Llama-3-70B"]
LLAMA3_8B = MODEL_PRESETS["Llama-3-8B"]
LLAMA2_70B = MODEL_PRESETS["Llama-2-70B"]
A100 = GPU_PRESETS["A100 80GB SXM"]
GPU_FORMULA = f"{FORMULA} ({A100.name} datasheet)"


def kv_70b_at_128k(_: Evidence) -> Evaluation:
    """Claim 1: about 20 GB of KV for a 128k context of Llama-3-70B."""
    size = kv_bytes_for_sequence(LLAMA3_70B.written_arch, K128, FP16)
    return Evaluation(
        HOLDS if about(size, 20 * GB) else FAILS,
        figure=f"{gigabytes(size)} at {tokens(K128)} in 16 bits: {size / (20 * GB):.1f}x the claimed 20 GB",
        model=LLAMA3_70B.name,
        device=FORMULA,
    )


def kv_70b_at_1m(_: Evidence) -> Evaluation:
    """Claim 2: a 1M-token context pushes the KV cache (of the same Llama-3-70B) past 160 GB."""
    size = kv_bytes_for_sequence(LLAMA3_70B.written_arch, ONE_M, FP16)
    return Evaluation(
        HOLDS if size > 160 * GB else FAILS,
        figure=f"{gigabytes(size)} at {tokens(ONE_M)} in 16 bits: past 160 GB by {size / (160 * GB):.1f}x",
        model=LLAMA3_70B.name,
        device=FORMULA,
    )


def fp16_bytes(_: Evidence) -> Evaluation:
    """Claim 3: FP16 takes 4 bytes per element."""
    size = bytes_per_element(FP16)
    return Evaluation(
        HOLDS if about(size, 4) else FAILS,
        figure=f"{size:g} bytes per element (16 bits)",
        model=FORMULA,
        device=FORMULA,
    )


def heads_of_70b(_: Evidence) -> Evaluation:
    """Claim 4: each layer of a 70B model has 80 heads of dimension 128 (Llama-3-70B's and Llama-2-70B's config)."""
    parts = []
    facts: dict[str, list[str]] = {}
    for spec in (LLAMA3_70B, LLAMA2_70B):
        arch = spec.written_arch
        parts.append((f"for {spec.name}", 80 in (arch.num_q_heads, arch.num_kv_heads) and arch.head_dim == 128))
        fact = (
            f"{arch.num_q_heads} query heads and {arch.num_kv_heads} KV heads of dimension {arch.head_dim} in each "
            f"of {arch.num_layers} layers"
        )
        facts.setdefault(fact, []).append(spec.name)
    figure = "; ".join(f"{' and '.join(names)}: {fact}" for fact, names in facts.items())
    return judged(parts, figure, model=f"{LLAMA3_70B.name}, {LLAMA2_70B.name}", device=FORMULA)


def kv_per_token_70b(_: Evidence) -> Evaluation:
    """Claim 5: Llama-3-70B (80 layers, 8 KV heads) uses about 160 KB of KV per token."""
    size = kv_bytes_per_token(LLAMA3_70B.written_arch, FP16)
    return Evaluation(
        HOLDS if about(size, 160 * KB) else FAILS,
        figure=f"{size:,.0f} bytes ({size / KIB:,.0f} KiB) per token in 16 bits: {size / (160 * KB):.1f}x the "
        "claimed 160 KB",
        model=LLAMA3_70B.name,
        device=FORMULA,
    )


def kv_at_100k(_: Evidence) -> Evaluation:
    """Claim 6: 100,000 tokens use 16 GB of KV before the weights (the article's Llama-3-70B, or the Llama-3-8B of
    its laptop benchmark)."""
    count = 100_000
    sizes = {spec.name: kv_bytes_for_sequence(spec.written_arch, count, FP16) for spec in (LLAMA3_70B, LLAMA3_8B)}
    return judged(
        [(f"for {name}", about(size, 16 * GB)) for name, size in sizes.items()],
        f"{tokens(count)} in 16 bits: " + "; ".join(f"{name} {gigabytes(size)}" for name, size in sizes.items()),
        model=", ".join(sizes),
        device=FORMULA,
    )


def kv_70b_formula(_: Evidence) -> Evaluation:
    """Claim 7: a 70B model at 128K needs about 40 GB (article 004's formula: about 43 GB for Llama-2-70B)."""
    size = kv_bytes_for_sequence(LLAMA2_70B.written_arch, K128, FP16)
    return judged(
        [(f"read as about {claimed} GB", about(size, claimed * GB)) for claimed in (40, 43)],
        f"{gigabytes(size)} at {tokens(K128)} in 16 bits",
        model=LLAMA2_70B.name,
        device=FORMULA,
    )


def preset_shares() -> str:
    """Claim 12's preset as a formula sees it: 40% of the budget to the first 10 layers and 10% to the last 10 hold
    the whole budget between them, so moving budget between layers alone saves nothing; any saving is accuracy kept
    at a smaller total, which only a measurement shows."""
    shares = (0.40, 1 - 0.40 - 0.10, 0.10)
    return (
        f"shares of one budget ({' + '.join(percent(s) for s in shares)}) hold {percent(sum(shares))} of it: "
        "moving budget between layers alone saves nothing"
    )


def _hybrid_remaining(fp16_share: float, int4_share: float, group: int | None) -> float:
    """Memory of a cache holding ``fp16_share`` of the tokens in 16 bits and ``int4_share`` in 4 bits, as a share
    of the full 16-bit cache."""
    full = bytes_per_element(FP16)
    return (fp16_share * full + int4_share * bytes_per_element(INT4, group)) / full


def hybrid_readings() -> dict[str, float]:
    """Claim 16's cache (FP16 for the top 5% of tokens, 4 bits for the rest, 80% evicted) as a share of the full
    16-bit cache, read the ways the article's words allow, with and without the scales of 4-bit groups."""
    kept, top = 0.20, 0.05
    return {
        "with 5% of all tokens in 16 bits and the other kept 15% in 4 bits, scales ignored": _hybrid_remaining(
            top, kept - top, None
        ),
        **{
            f"the same with 4-bit groups of {group}": _hybrid_remaining(top, kept - top, group)
            for group in QUANT_GROUPS
        },
        "with 5% of the kept tokens in 16 bits": _hybrid_remaining(kept * top, kept * (1 - top), None),
    }


def quantised_readings() -> dict[str, float]:
    """Claim 35's cache (4 bits, 90% evicted): how many times smaller than the full 16-bit cache, with per-tensor
    scales and with the scales of 4-bit groups."""
    keep = 0.1
    full = bytes_per_element(FP16)
    readings = {"with per-tensor scales": full / (keep * bytes_per_element(INT4))}
    return readings | {
        f"with groups of {group}": full / (keep * bytes_per_element(INT4, group)) for group in QUANT_GROUPS
    }


def million_tokens_in_12gb(_: Evidence) -> Evaluation:
    """Claim 22: managed eviction reaches 1,000,000 tokens within 12 GB (Llama-3-8B with quantised weights)."""
    count, ram = 1_000_000, 12 * GB
    weights = weight_bytes(LLAMA3_8B.params, INT4)
    full = kv_bytes_for_sequence(LLAMA3_8B.written_arch, count, FP16)
    held = int((ram - weights) // kv_bytes_per_token(LLAMA3_8B.written_arch, FP16))
    figure = (
        f"{tokens(count)} of KV in 16 bits take {gigabytes(full)}; beside 4-bit weights ({gigabytes(weights)}) "
        f"12 GB hold {tokens(held)} of KV, {percent(held / count, 1)} of the context"
    )
    if weights + full <= ram:
        return Evaluation(HOLDS, figure=figure, model=LLAMA3_8B.name, device=FORMULA)
    if held <= 0:
        return Evaluation(FAILS, figure=figure, model=LLAMA3_8B.name, device=FORMULA)
    return Evaluation(
        CONDITIONAL,
        figure=figure,
        condition=f"if eviction keeps at most {tokens(held)} ({percent(held / count, 1)}) in 16 bits",
        model=LLAMA3_8B.name,
        device=FORMULA,
    )


def concurrency_a100(_: Evidence) -> Evaluation:
    """Claim 23: cutting KV memory by 80% takes an A100 80GB from 4 to 20 concurrent 32k-context users."""
    context, keep = 32 * 1024, 0.2
    parts, facts = [], []
    for spec in (LLAMA3_8B, LLAMA3_70B):
        for weights_precision in ("bf16", INT4):
            weights = weight_bytes(spec.params, weights_precision)
            full, evicted = (
                sequences_that_fit(
                    A100.memory_bytes, weights, kv_bytes_for_sequence(spec.written_arch, context, FP16, k)
                )
                for k in (1.0, keep)
            )
            label = f"for {spec.name} with {'16-bit' if weights_precision == 'bf16' else '4-bit'} weights"
            parts.append((label, about_count(full, 4) and about_count(evicted, 20)))
            facts.append(f"{spec.name}, {weights_precision} weights: {full} → {evicted}")
    return judged(
        parts,
        f"users of {tokens(context)} that fit on an {A100.name} beside the weights (10% kept in reserve), full "
        f"cache → keeping {percent(keep)}: " + "; ".join(facts),
        model=f"{LLAMA3_8B.name}, {LLAMA3_70B.name}",
        device=GPU_FORMULA,
    )


def kv_share_of_hbm(_: Evidence) -> Evaluation:
    """Claim 26: the KV cache can take up to 90% of a GPU's memory at long contexts."""
    shares = {}
    for spec in MODEL_PRESETS.values():
        per_sequence = kv_bytes_for_sequence(spec.written_arch, K128, FP16)
        fit = sequences_that_fit(A100.memory_bytes, weight_bytes(spec.params, "bf16"), per_sequence)
        shares[spec.name] = (fit * per_sequence / A100.memory_bytes, fit)
    largest = max(shares, key=lambda name: shares[name][0])
    share, fit = shares[largest]
    llama = shares[LLAMA3_8B.name][0]
    return Evaluation(
        HOLDS if share >= 0.9 or about(share, 0.9) else FAILS,
        figure=f"up to {percent(share)} of an {A100.name}'s memory ({largest}: {fit} sequences of "
        f"{tokens(K128)} beside 16-bit weights, 10% kept in reserve); {LLAMA3_8B.name}: {percent(llama)}",
        model=f"{len(shares)} model presets",
        device=GPU_FORMULA,
    )


PYRAMID_LAYERS = 64
PYRAMID_QUARTERS = (1.0, 0.7, 0.5, 0.3)
"""Article 004's PyramidKV budgets for layers 0-15, 16-31, 32-47 and 48-63."""


def _pyramid_quarters(beta: int) -> list[float]:
    """kvlab's PyramidKV budget beyond the window per quarter of a 64-layer model, relative to the first quarter."""
    shares = pyramid_shares(1.0, beta, PYRAMID_LAYERS)
    size = PYRAMID_LAYERS // len(PYRAMID_QUARTERS)
    means = [sum(shares[i * size : (i + 1) * size]) / size for i in range(len(PYRAMID_QUARTERS))]
    return [mean / means[0] for mean in means]


def _pyramid_matches(beta: int) -> bool:
    return all(about(ours, theirs) for ours, theirs in zip(_pyramid_quarters(beta), PYRAMID_QUARTERS))


def pyramid_budgets(_: Evidence) -> Evaluation:
    """Claim 33: PyramidKV's budgets are 100/70/50/30% for the four quarters of a 64-layer model."""
    quarters = "/".join(percent(share) for share in _pyramid_quarters(PYRAMID_BETA))
    figure = (
        f"kvlab's PyramidKV (beta = {PYRAMID_BETA}) over {PYRAMID_LAYERS} layers gives layers 0-15, 16-31, "
        f"32-47 and 48-63 {quarters} of the first quarter's budget beyond the window (a linear fall, not steps)"
    )
    if _pyramid_matches(PYRAMID_BETA):
        return Evaluation(HOLDS, figure=figure, model=FORMULA, device=FORMULA)
    betas = [beta for beta in range(1, 101) if _pyramid_matches(beta)]
    if not betas:
        return Evaluation(FAILS, figure=figure, model=FORMULA, device=FORMULA)
    span = f"beta = {betas[0]}" if len(betas) == 1 else f"beta from {betas[0]} to {betas[-1]}"
    return Evaluation(CONDITIONAL, figure=figure, condition=f"with {span}", model=FORMULA, device=FORMULA)
