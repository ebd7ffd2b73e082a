"""The ``costs`` command: what a model costs to serve on a GPU, full cache against evicted, and the decode times
measured on a GPU.

The estimate is the Costs page's (:func:`kvlab.costs.cost_table`, from the architecture and the GPU's datasheet);
below it, the decode figures committed by ``bench/heap_gpu.py`` with the device named
(:mod:`kvlab.costs.measured`), never scaled to the chosen GPU. Neither building its parser nor running it imports
torch.
"""

from __future__ import annotations

import argparse
import json

import pandas as pd

from kvlab.costs import GPU_PRESETS, MODEL_PRESETS, MOST_GPUS, Scenario, cost_table, formatted_costs
from kvlab.costs.measured import MEASURED_METHOD, MEASURED_SHAPE, load_measured_decode, measured_summary, measured_table
from kvlab.costs.presets import preset_name

FORMATS = ("table", "json")


def register(commands: argparse._SubParsersAction) -> None:
    """Add the ``costs`` command."""
    costs = commands.add_parser(
        "costs",
        help="memory, time and money of serving a model, full cache against evicted, and measured decode times",
        description="Estimate what serving a model costs on a GPU with the full cache and with an eviction that keeps "
        "a share of the context (the Costs page's formulas), then print the decode times measured on a GPU by "
        "bench/heap_gpu.py, with the device named.",
    )
    costs.add_argument("--model", default="Llama-3-8B", help=f"model preset (one of: {', '.join(MODEL_PRESETS)})")
    costs.add_argument("--gpu", default="H100 SXM 80GB", help=f"GPU preset (one of: {', '.join(GPU_PRESETS)})")
    costs.add_argument("--prompt-tokens", type=int, default=7168, metavar="N", help="prompt tokens per query")
    costs.add_argument("--output-tokens", type=int, default=1024, metavar="M", help="generated tokens per query")
    costs.add_argument("--batch", type=int, default=1, help="sequences decoded together")
    costs.add_argument("--keep", type=float, default=0.25, help="kept share of the context, in (0, 1]")
    costs.add_argument("--gpus", type=int, default=1, help=f"GPUs the layers are split over (1 to {MOST_GPUS})")
    costs.add_argument("--format", choices=FORMATS, default="table", help="output format (default: table)")
    costs.set_defaults(func=costs_command)


def costs_command(args: argparse.Namespace) -> int:
    """``kvlab costs``: the estimate, then the measured decode times."""
    model = MODEL_PRESETS[preset_name(MODEL_PRESETS, args.model, "model")]
    gpu = GPU_PRESETS[preset_name(GPU_PRESETS, args.gpu, "GPU")]
    scenario = Scenario(
        prompt_tokens=args.prompt_tokens,
        output_tokens=args.output_tokens,
        batch=args.batch,
        keep_fraction=args.keep,
        gpu_count=args.gpus,
    )
    table = cost_table(model, gpu, scenario)
    measured = load_measured_decode()
    if args.format == "json":
        print(
            json.dumps(
                {
                    "model": args.model,
                    "gpu": args.gpu,
                    "estimate": table.to_dict(orient="records"),
                    "measured": None
                    if measured is None
                    else {
                        "device": measured.device,
                        "shape": MEASURED_SHAPE,
                        "source": measured.source,
                        "rows": measured_table(measured).to_dict(orient="records"),
                    },
                },
                indent=1,
            )
        )
        return 0
    print(f"Estimated for {args.model} on {args.gpu} (datasheet figures, formulas of kvlab.costs):")
    with pd.option_context("display.width", 200, "display.max_colwidth", 60):
        print(formatted_costs(table).to_string(index=False))
        print()
        if measured is None:
            print("No measured decode figures: they come from a kvlab checkout's bench/results.")
            return 0
        print(measured_summary(measured, scenario.context_tokens))
        print(MEASURED_METHOD)
        print(measured_table(measured).to_string(index=False))
    return 0
