"""The published needle claim, measured: 4096-token needle prompts with the needle at a random depth, pruning
10/30/50/70/90% (keep 0.9 ... 0.1), for H2O, StreamingLLM, random, SnapKV, PyramidKV, TOVA and Knorm in both modes,
plus the full cache, on the shipped model. Writes the trials database, a JSON summary and the side-by-side table.

Usage (the grid of the claim; ~7,100 trials):
    python bench/needle_claim.py --trials 100 --out-dir bench/results/needle_claim
Reduced grid on a CPU, also measuring what sharing the prefill saves (on fewer trials):
    python bench/needle_claim.py --context 2048 --trials 20 --batch-size 10 --measure-sharing --sharing-trials 5 \
        --out-dir bench/results/needle_cpu
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvlab.claims import PRUNING, side_by_side  # noqa: E402
from kvlab.models.loading import load_model  # noqa: E402
from kvlab.modes import MODES, PREFILL  # noqa: E402
from kvlab.runs.sweep import SweepGrid, SweepRunner, parse_policies  # noqa: E402
from kvlab.store import open_store  # noqa: E402

POLICIES = "full,h2o,streaming,random,snapkv,pyramidkv,tova,knorm"


def timed_sweep(loaded, db: Path, grid: SweepGrid) -> tuple[float, int]:
    """Run ``grid`` into a fresh database; wall seconds and trials run."""
    db.unlink(missing_ok=True)
    store = open_store(db)
    started = time.perf_counter()
    summary = SweepRunner(loaded, store, grid).run()
    seconds = time.perf_counter() - started
    store.close()
    return seconds, summary.ran


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--trials", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=25)
    parser.add_argument("--chunk", type=int, default=256, help="streaming-mode chunk")
    parser.add_argument("--policies", default=POLICIES)
    parser.add_argument(
        "--measure-sharing",
        action="store_true",
        help="also time the prefill-mode cells with and without one shared prefill, side by side",
    )
    parser.add_argument(
        "--sharing-trials",
        type=int,
        default=None,
        help="trials per cell for the sharing measurement (default: --trials)",
    )
    parser.add_argument("--out-dir", default="bench/results/needle_claim")
    args = parser.parse_args()
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    loaded = load_model(args.model)
    keeps = tuple(round(1 - p, 2) for p in PRUNING)
    grid = SweepGrid(
        policies=parse_policies(args.policies),
        keeps=keeps,
        contexts=(args.context,),
        depths=None,
        trials=args.trials,
        modes=MODES,
        chunk=args.chunk,
        batch_size=args.batch_size,
    )
    report: dict = {
        "device": torch.cuda.get_device_name() if loaded.device.type == "cuda" else platform.processor() or "cpu",
        "torch_threads": torch.get_num_threads(),
        "model": loaded.source.label,
        "context": args.context,
        "trials_per_cell": args.trials,
        "batch_size": args.batch_size,
        "chunk": args.chunk,
        "keeps": keeps,
        "policies": args.policies,
    }
    seconds, ran = timed_sweep(loaded, out / "trials.duckdb", grid)
    report["grid_seconds"], report["grid_trials"] = seconds, ran
    print(f"grid: {ran} trials in {seconds:.1f} s on {report['device']}", flush=True)
    if args.measure_sharing:
        evicting = tuple(v for v in grid.variants if v.policy.evicts)
        for share in (True, False):
            shared_grid = dataclasses.replace(
                grid,
                modes=(PREFILL,),
                policies=evicting,
                share_prefill=share,
                trials=args.sharing_trials or args.trials,
            )
            seconds_share, ran_share = timed_sweep(loaded, out / f"sharing-{share}.duckdb", shared_grid)
            report[f"prefill_cells_seconds_{'shared' if share else 'separate'}"] = seconds_share
            print(
                f"prefill-mode cells, shared prefill {share}: {ran_share} trials in {seconds_share:.1f} s", flush=True
            )
            (out / f"sharing-{share}.duckdb").unlink()
        report["sharing_trials_per_cell"] = args.sharing_trials or args.trials
        report["sharing_speedup"] = report["prefill_cells_seconds_separate"] / report["prefill_cells_seconds_shared"]
    with open_store(out / "trials.duckdb") as store:
        trials = store.trials_frame()
    table = side_by_side(trials, args.context)
    report["table"] = json.loads(table.to_json(orient="index"))
    (out / "summary.json").write_text(json.dumps(report, indent=2))
    (out / "table.md").write_text(table.round(1).to_markdown())
    print(table.round(1).to_string())


if __name__ == "__main__":
    main()
