"""The ``advise`` command: the cheapest stored configurations that keep an accuracy floor relative to the full cache,
priced for a model preset on a GPU (:mod:`kvlab.runs.advisor`), in a table, CSV, Markdown or JSON.

The accuracies come from the shipped evidence (``claims.duckdb`` for the needle, ``ruler.duckdb`` for RULER) unless
``--db`` names another store; the measured decode times from the committed GPU benchmark where it matches.
"""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING

import pandas as pd

from kvlab.costs import GPU_PRESETS, MODEL_PRESETS, MOST_GPUS
from kvlab.costs.measured import load_measured_decode
from kvlab.costs.presets import preset_name
from kvlab.runs.benchmarks import BENCHMARKS, SHIPPED_EVIDENCE
from kvlab.store import open_store

if TYPE_CHECKING:  # the parser is built without loading torch
    from kvlab.runs.advisor import Advice

FORMATS = ("table", "csv", "markdown", "json")
#: How many configurations below the floor the table lists after the ranked ones.
BELOW_SHOWN = 5


def register(commands: argparse._SubParsersAction) -> None:
    """Add the ``advise`` command."""
    parser = commands.add_parser(
        "advise",
        help="the cheapest stored configurations that keep an accuracy floor, priced for a model on a GPU",
        description="Rank the stored eviction configurations that keep at least FLOOR of the full cache's accuracy "
        "by their cost per query for a model preset on a GPU, with each one's 95% interval, McNemar's test against "
        "the full cache, measured bytes and decode time (measured where a GPU benchmark matches, else computed).",
    )
    parser.add_argument("--model", default="Llama-3-8B", help=f"model preset (one of: {', '.join(MODEL_PRESETS)})")
    parser.add_argument("--gpu", default="H100", help=f"GPU preset or its start (one of: {', '.join(GPU_PRESETS)})")
    parser.add_argument("--gpus", type=int, default=1, help=f"GPUs the layers are split over (1 to {MOST_GPUS})")
    parser.add_argument("--context", type=int, default=32768, help="prompt tokens per query")
    parser.add_argument("--output-tokens", type=int, default=256, metavar="M", help="generated tokens per query")
    parser.add_argument("--batch", type=int, default=1, help="sequences decoded together")
    parser.add_argument("--floor", type=float, default=0.95, help="least accuracy relative to the full cache")
    parser.add_argument("--on", choices=tuple(BENCHMARKS), default="needle", help="benchmark the floor is judged on")
    parser.add_argument("--evidence-model", default=None, help="stored model whose runs stand for the preset")
    parser.add_argument("--db", default=None, metavar="FILE", help="run store (default: the shipped evidence)")
    parser.add_argument("--format", choices=FORMATS, default="table", help="output format (default: table)")
    parser.set_defaults(func=advise_command)


def advice_json(advice: Advice) -> str:
    """The advice as JSON: the request, the evidence, the ranked and below-floor rows, the missing evidence."""
    from kvlab.runs.advisor import evidence_sentence  # loads torch: not at import time

    evidence = advice.evidence
    return json.dumps(
        {
            "request": vars(advice.request),
            "evidence": None if evidence is None else vars(evidence),
            "evidence_note": evidence_sentence(advice),
            "ranked": json.loads(advice.ranked.to_json(orient="records")),
            "below_floor": json.loads(advice.below.to_json(orient="records")),
            "missing": list(advice.missing),
        },
        indent=1,
    )


def markdown(table: pd.DataFrame) -> str:
    """A pipe table (cells' pipes escaped)."""
    lines = ["| " + " | ".join(table.columns) + " |", "|" + " --- |" * len(table.columns)]
    for row in table.itertuples(index=False):
        lines.append("| " + " | ".join(str(cell).replace("|", "\\|") for cell in row) + " |")
    return "\n".join(lines)


def advise_command(args: argparse.Namespace) -> int:
    """``kvlab advise``."""
    from kvlab.runs.advisor import (  # loads torch: not at import time
        AdviceRequest,
        advice_title,
        advise,
        evidence_sentence,
        shown_advice,
    )

    request = AdviceRequest(
        model=preset_name(MODEL_PRESETS, args.model, "model"),
        gpu=preset_name(GPU_PRESETS, args.gpu, "GPU"),
        context=args.context,
        floor=args.floor,
        benchmark=args.on,
        gpu_count=args.gpus,
        output_tokens=args.output_tokens,
        batch=args.batch,
        evidence_model=args.evidence_model,
    )
    with open_store(args.db or SHIPPED_EVIDENCE[args.on], read_only=True) as store:
        trials = store.trials_frame()
    advice = advise(request, trials, load_measured_decode())
    if args.format == "json":
        print(advice_json(advice))
        return 0
    ranked = shown_advice(advice.ranked)
    if args.format == "csv":
        print(ranked.to_csv(index=False).rstrip("\n"))
        return 0
    title = advice_title(request) + ":"
    below = shown_advice(advice.below.head(BELOW_SHOWN))
    if args.format == "markdown":
        parts = [title, "", evidence_sentence(advice), "", markdown(ranked)]
        parts += ["", f"Below the floor ({len(advice.below)}; the closest):", "", markdown(below)]
        print("\n".join(parts + [f"\n{sentence}" for sentence in advice.missing]))
        return 0
    with pd.option_context("display.width", 250, "display.max_colwidth", 70, "display.max_columns", 20):
        print(title)
        print(evidence_sentence(advice))
        print()
        print(ranked.to_string(index=False) if not ranked.empty else "(none)")
        print()
        print(f"Below the floor: {len(advice.below)} configurations; the closest:")
        print(below.to_string(index=False) if not below.empty else "(none)")
    for sentence in advice.missing:
        print()
        print(sentence)
    return 0
