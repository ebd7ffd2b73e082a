"""The commands that reproduce a claim's figure, each written in one place (shell commands, run from the
repository root).

Measured figures come from ``kvlab sweep`` (needles), ``bench/sink_ablation.py`` (perplexity and KL divergence with
and without attention sinks, each pass a ``kvlab quality`` run), ``bench/short_context_overhead.py`` (time with and
without eviction below 4K tokens; without its results, ``kvlab quality`` passes, which decode every step) and
``bench/attention_profile.py`` (attention per layer); computed figures and unmeasurable claims are shown again by
``kvlab claims --only <id>``.
"""

from __future__ import annotations

import shlex

from kvlab.claims.needle import CLAIM_CONTEXT, PRUNING

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
SHIPPED_MODEL = "data/models/kvlab-tiny-llama"
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
        f"--mode prefill,streaming --contexts {CLAIM_CONTEXT} --depths random --trials 100 --batch-size 50 "
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


def attention_profile(model: str = SHIPPED_MODEL) -> str:
    """The attention share of the first token and the entropy, per layer, of one model."""
    return f"python bench/attention_profile.py{model_option(model)}"
