"""The ``quality`` command: the perplexity of a held-out text read under a policy, and the KL divergence of its
next-token distributions from the full cache's, stored as a run."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kvlab.cli.options import (
    add_db_argument,
    add_heap_arguments,
    add_model_arguments,
    add_policy_arguments,
    load_model_from_args,
    policy_from_args,
    run_spec_from_args,
    whole,
)
from kvlab.modes import STREAMING
from kvlab.store import open_store
from kvlab.tasks.texts import DEFAULT_PREFIX, DEFAULT_TOKENS, MIN_PAST_BUDGET, read_text, scored_tokens
from kvlab.units import exact_bytes


def register(commands: argparse._SubParsersAction) -> None:
    """Add the ``quality`` command."""
    quality = commands.add_parser(
        "quality",
        help="perplexity and KL from the full cache of a held-out text read under a policy",
        description="Read a prefix of a text, then feed the rest one token at a time as if it had been generated "
        "(teacher forcing), the cache evicting as it does while generating (streaming mode unless --mode prefill). "
        "Prints the perplexity of the fed tokens under the policy and under the full cache, and the mean KL "
        "divergence of each step's next-token distribution from the full cache's; stores the run.",
    )
    add_model_arguments(quality)
    quality.add_argument(
        "--text",
        default=None,
        metavar="FILE",
        help="a UTF-8 text the model did not train on (default: kvlab/data/haystacks/python-docs-1.txt, held out from "
        "the shipped model's training)",
    )
    quality.add_argument(
        "--prefix",
        type=whole(1, "--prefix"),
        default=DEFAULT_PREFIX,
        help=f"tokens read before the first scored one (default {DEFAULT_PREFIX})",
    )
    quality.add_argument(
        "--tokens",
        type=whole(1, "--tokens"),
        default=None,
        help=f"tokens fed and scored after the prefix (default {DEFAULT_TOKENS}, or more so that at least "
        f"{MIN_PAST_BUDGET:,} are scored past the budget)",
    )
    add_policy_arguments(quality)
    quality.set_defaults(mode=STREAMING)
    add_heap_arguments(quality)
    add_db_argument(quality, "database file the run is stored in")
    quality.add_argument("--json", action="store_true", help="print one JSON object with the figures")
    quality.set_defaults(func=run_quality_command)


def run_quality_command(args: argparse.Namespace) -> int:
    """Measure one pass over the text, store it, and print what it measured."""
    from kvlab.runs.quality import DEFAULT_TEXT, model_pass, run_quality  # loads torch: not at import time

    variant, budget = policy_from_args(args)  # bad settings, texts and stores are refused before the model loads
    tokens = scored_tokens(budget, args.prefix, args.tokens)
    spec = run_spec_from_args(args, max_new_tokens=tokens)
    path = Path(args.text) if args.text is not None else DEFAULT_TEXT
    text = read_text(path)
    store = open_store(args.db)
    loaded = load_model_from_args(args)
    passage = model_pass(loaded, text, path.stem, args.prefix, tokens)
    quality, run_id = run_quality(loaded, spec, passage, store)
    if args.json:
        payload = {
            "model": loaded.name,
            "policy": variant.name,
            "params": variant.params(),
            "mode": spec.mode,
            "budget_tokens": quality.result.budget_tokens,
            "text": passage.name,
            "prefix": passage.prefix,
            **quality.to_json(),
            "run_id": run_id,
        }
        print(json.dumps(payload))
    else:
        result = quality.result
        print(
            f"perplexity {quality.perplexity:.4g} against {quality.full_perplexity:.4g} with the full cache "
            f"(x{quality.perplexity / quality.full_perplexity:.3f}); KL from the full cache {quality.kl:.4g} nats "
            f"per token; over {quality.scored_tokens:,} tokens of {passage.name} after a {passage.prefix:,}-token "
            "prefix"
        )
        print(
            f"[{variant.name}, {spec.mode}, budget {result.budget_tokens or 'none'}] kept {result.mean_kept_tokens:,} "
            f"tokens per layer; KV in use {exact_bytes(result.kv_bytes)} of {exact_bytes(result.kv_bytes_full)} "
            f"full, peak {exact_bytes(result.peak_kv_bytes)} (measured from the cache tensors on {result.device}); "
            "stored as run "
            f"{run_id} in {store.path}",
            file=sys.stderr,
        )
    return 0
