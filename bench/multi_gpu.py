"""A model over several GPUs: the cost of splitting it, and the two eviction scopes side by side.

Parts (each fits one call of ten minutes on a machine with two GPUs):

* ``decode``: a Llama-3-8B-shaped model with random bf16 weights (``bench/heap_gpu.py``'s ``LLAMA3_8B`` and its
  ``build``), placed over the GPUs by :func:`kvlab.models.loading.place_model` (``--device-map``, default ``balanced``:
  the placement ``load_model(device_map=...)`` uses), batch 1, ``--context`` tokens (default 32,768), prefill mode, keep
  10%: ``full``, SnapKV in the local scope and SnapKV in the global scope. Per configuration: decode ms per token (the
  median of the steady half of the per-token times; decoding on several devices is always eager), the compression
  event's seconds and, for the global scope, the gather of every layer's scores and the decision
  (``scope_seconds``), the tokens each layer kept, the heap's bytes per device and each GPU's peak allocation
  (``torch.cuda.max_memory_allocated``, reset at the start of each run), and the weights per device. Each
  configuration runs ``--repeats`` times at the same shapes; the first run is discarded as warm-up and the last one
  reported (the JSON says so). Before splitting, the same configurations run on the first GPU alone (eagerly, as a
  split model decodes) for comparison, unless ``--no-baseline``.
* ``needle``: a needle grid on the published SmolLM2 (``--model``, default ``SmolLM2-135M-Instruct.Q4_1.gguf``; see
  ``kvlab models``) loaded with ``device_map="balanced"`` over the GPUs, through :class:`kvlab.runs.sweep.SweepRunner`
  as ``kvlab sweep`` runs it: ``full``, SnapKV and H2O each in the local scope and in the global one
  (``snapkv[scope=global]``), prefill mode; accuracy per run with its Wilson interval, and local against global on
  the same items by McNemar's test. The runs are kept in ``needle.duckdb`` beside the JSON.

Results go to ``<out>/decode.json`` and ``<out>/needle.json``, with the GPUs' names. Usage::

    python bench/multi_gpu.py --part decode --out bench/results/multi_gpu
    python bench/multi_gpu.py --part needle --out bench/results/multi_gpu

``--cpu --layers 2 --context 512`` (with ``--device-map`` a JSON file putting layers on ``cpu`` and ``disk``) runs the
same code on a CPU, to check the script.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from heap_gpu import LLAMA3_8B, build, steady_ms  # noqa: E402

from kvlab.budget import Budget  # noqa: E402
from kvlab.engine.events import GenerationResult
from kvlab.engine.generation import Generation  # noqa: E402
from kvlab.engine.spec import RunSpec
from kvlab.models.loading import LoadedModel, load_model, place_model, wrap_model  # noqa: E402
from kvlab.modes import PREFILL  # noqa: E402
from kvlab.policies import make_policy  # noqa: E402

KEEP = 0.1
NEW_TOKENS = 64
PUBLISHED = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: The needle grid's policies: each method in both scopes (the local scope is the default, so left unsaid).
NEEDLE_POLICIES = "full,snapkv,snapkv[scope=global],h2o,h2o[scope=global]"


def gpu_names() -> list[str]:
    return [torch.cuda.get_device_name(index) for index in range(torch.cuda.device_count())]


def configurations(static: bool | None) -> list[tuple[str, RunSpec]]:
    """``full``, SnapKV local and SnapKV global, prefill mode at keep 10%."""
    specs = [
        ("full", make_policy("full"), None),
        ("snapkv local", make_policy("snapkv"), Budget(keep=KEEP)),
        ("snapkv global", make_policy("snapkv", scope="global"), Budget(keep=KEEP)),
    ]
    return [
        (label, RunSpec(policy, budget, mode="prefill", max_new_tokens=NEW_TOKENS, static=static))
        for label, policy, budget in specs
    ]


def timed_run(loaded: LoadedModel, ids: torch.Tensor, spec: RunSpec) -> tuple[GenerationResult, float]:
    """One generation, and the seconds of its compression event (0 for the full cache)."""
    run = Generation(loaded, spec, ids)
    compress_seconds = 0.0
    for event in run.events():
        if event.kind == "compress":
            compress_seconds = event.seconds
    return run.result(), compress_seconds


def per_group(loaded: LoadedModel, values: Sequence[int]) -> dict[str, int]:
    """Per-layer values summed per placement group."""
    totals: dict[str, int] = {}
    for group, value in zip(loaded.layer_groups, values):
        totals[group] = totals.get(group, 0) + value
    return totals


def weights_per_device(model: torch.nn.Module) -> dict[str, int]:
    """Bytes of the parameters on each device (those accelerate keeps on the CPU or the disk show as ``meta``)."""
    totals: dict[str, int] = {}
    for parameter in model.parameters():
        device = str(parameter.device)
        totals[device] = totals.get(device, 0) + parameter.numel() * parameter.element_size()
    return totals


def decode_rows(loaded: LoadedModel, ids: torch.Tensor, placement: str, repeats: int) -> list[dict[str, Any]]:
    """Every configuration run ``repeats`` times at the same shapes; the first is discarded, the last reported."""
    rows = []
    for label, spec in configurations(static=False):
        decode_ms_per_repeat = []
        for _ in range(repeats):
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            result, compress_seconds = timed_run(loaded, ids, spec)
            decode_ms_per_repeat.append(round(steady_ms(result.token_seconds), 3))
        row = {
            "config": label,
            "placement": placement,
            "device": result.device,
            "device_kind": loaded.device_kind,
            "policy_params": spec.policy.params(),
            "decode_ms": decode_ms_per_repeat[-1],
            "decode_ms_per_repeat": decode_ms_per_repeat,
            "prefill_s": round(result.prefill_seconds, 4),
            "compress_s": round(compress_seconds, 4),
            "scope_s": round(result.scope_seconds, 6),
            "ranking_s": round(result.ranking_seconds, 4),
            "kept_per_layer": result.kept_per_layer,
            "kept_per_group": per_group(loaded, result.kept_per_layer),
            "kv_bytes": result.kv_bytes,
            "kv_bytes_per_device": result.kv_bytes_per_device,
            "kv_reserved_bytes_per_device": result.kv_reserved_bytes_per_device,
            "peak_gpu_bytes": result.peak_gpu_bytes,
            "peak_gpu_bytes_per_device": result.peak_gpu_bytes_per_device,
            "decode_graphs": result.decode_graphs,
            "tokens": len(result.tokens[0]),
        }
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def part_decode(
    device: str, context: int, layers: int | None, device_map: str, repeats: int, baseline: bool
) -> dict[str, Any]:
    """The split model's decode, compression and bytes per GPU, and (``baseline``) the same on one device first."""
    model, loaded = build(LLAMA3_8B, context + NEW_TOKENS + 64, torch.bfloat16, device, layers)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(10, int(LLAMA3_8B["vocab_size"]), (1, context), generator=generator)
    rows = []
    if baseline:
        rows += decode_rows(loaded, ids, "one device", repeats)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    placed = wrap_model(place_model(model, device_map))
    print(json.dumps({"placement": placed.placement(), "layer_groups": placed.layer_groups}), flush=True)
    rows += decode_rows(placed, ids, device_map, repeats)
    return {
        "model": "Llama-3-8B shape, random bf16 weights" + (f", {layers} layers" if layers else ""),
        "context": context,
        "keep": KEEP,
        "mode": "prefill",
        "new_tokens": NEW_TOKENS,
        "repeats": repeats,
        "reported": "the last of the repeats at the same shapes; the first run is a discarded warm-up",
        "decode": "eager on every row (a model on several devices always decodes eagerly; the one-device rows too, "
        "for a like-for-like comparison); decode_ms is the median of the steady half of the per-token times",
        "placement": placed.placement(),
        "layer_groups": list(placed.layer_groups),
        "layer_devices": [str(layer_device) for layer_device in placed.layer_devices],
        "weights_bytes_per_device": weights_per_device(model),
        "rows": rows,
    }


def part_needle(
    model_name: str,
    device_map: str,
    contexts: tuple[int, ...],
    keeps: tuple[float, ...],
    depths: tuple[float, ...],
    trials: int,
    out: Path,
) -> dict[str, Any]:
    """A needle grid of each method in both scopes on a model split by ``device_map``; accuracy per run and local
    against global on the same items."""
    import pandas as pd

    from kvlab.runs.sweep import SweepGrid, SweepRunner, parse_policies
    from kvlab.stats import mcnemar, pair_by_item, wilson_interval
    from kvlab.store import RunFilter, open_store

    loaded = load_model(model_name, device_map=device_map)
    print(json.dumps({"placement": loaded.placement(), "layer_groups": loaded.layer_groups}), flush=True)
    grid = SweepGrid(
        policies=parse_policies(NEEDLE_POLICIES),
        keeps=keeps,
        contexts=contexts,
        depths=depths,
        trials=trials,
        modes=(PREFILL,),
    )
    with open_store(out / "needle.duckdb") as store:
        summary = SweepRunner(loaded, store, grid).run()
        frame = store.trials_frame(RunFilter(run_ids=tuple(summary.run_ids)))
    frame["scope"] = [json.loads(params or "{}").get("scope", "local") for params in frame["policy_params"]]
    frame["keep"] = frame["keep"].fillna(1.0)  # the full cache keeps everything
    runs = []
    for (policy, scope, keep, context), trials_of_run in frame.groupby(
        ["policy", "scope", "keep", "context_length"], sort=True
    ):
        correct = int(trials_of_run["correct"].sum())
        low, high = wilson_interval(correct, len(trials_of_run))
        runs.append(
            {
                "policy": policy,
                "scope": scope,
                "keep": keep,
                "context": int(context),
                "items": len(trials_of_run),
                "accuracy": round(correct / len(trials_of_run), 4),
                "interval_95": [round(low, 4), round(high, 4)],
                "kept_tokens_mean": float(trials_of_run["kept_tokens"].mean()),
            }
        )
    comparisons = []
    evicting = frame[frame["policy"] != "full"]
    for (policy, keep, context), cell in evicting.groupby(["policy", "keep", "context_length"], sort=True):
        by_scope = {
            scope: pd.Series(part["correct"].to_numpy(), index=part["item_hash"].to_numpy())
            for scope, part in cell.groupby("scope")
        }
        local, global_ = pair_by_item(by_scope["local"], by_scope["global"])
        test = mcnemar(local.astype(bool), global_.astype(bool))
        comparisons.append(
            {
                "policy": policy,
                "keep": keep,
                "context": int(context),
                "paired_items": test.pairs,
                "local_accuracy": round(float(local.mean()), 4),
                "global_accuracy": round(float(global_.mean()), 4),
                "only_global_right": test.b01,
                "only_local_right": test.b10,
                "p_value": test.p_value,
                "test": test.method,
            }
        )
    for row in runs + comparisons:
        print(json.dumps(row), flush=True)
    return {
        "model": loaded.source.label,
        "device_map": device_map,
        "placement": loaded.placement(),
        "layer_groups": list(loaded.layer_groups),
        "policies": NEEDLE_POLICIES,
        "contexts": list(contexts),
        "keeps": list(keeps),
        "depths": list(depths),
        "trials_per_depth": trials,
        "store": str(out / "needle.duckdb"),
        "runs": runs,
        "local_vs_global": comparisons,
    }


def numbers(text: str, kind: type) -> tuple[Any, ...]:
    return tuple(kind(part) for part in text.split(",") if part.strip())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=("decode", "needle"), required=True)
    parser.add_argument("--out", type=Path, required=True, help="directory for the JSON results")
    parser.add_argument("--device-map", default="balanced", help="auto, balanced, sequential or a JSON file")
    parser.add_argument("--context", type=int, default=32768, help="context tokens of --part decode")
    parser.add_argument("--layers", type=int, default=None, help="fewer layers (for checking the script)")
    parser.add_argument("--repeats", type=int, default=2, help="runs per configuration at the same shapes")
    parser.add_argument("--no-baseline", action="store_true", help="skip the one-device rows of --part decode")
    parser.add_argument("--model", default=PUBLISHED, help="the model of --part needle")
    parser.add_argument("--contexts", default="2048,4096", help="context lengths of --part needle")
    parser.add_argument("--keeps", default="0.1,0.25", help="kept fractions of --part needle")
    parser.add_argument("--depths", default="0.1,0.3,0.5,0.7,0.9", help="needle depths of --part needle")
    parser.add_argument("--trials", type=int, default=8, help="items per depth and context of --part needle")
    parser.add_argument("--cpu", action="store_true")
    args = parser.parse_args()
    if args.repeats < 2:
        parser.error("--repeats must be at least 2: the first run is discarded")
    args.out.mkdir(parents=True, exist_ok=True)
    import transformers

    header = {
        "gpus": gpu_names() if torch.cuda.is_available() and not args.cpu else [],
        "host": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
    }
    print(json.dumps(header), flush=True)
    if args.part == "decode":
        device = "cpu" if args.cpu else "cuda"
        body = part_decode(device, args.context, args.layers, args.device_map, args.repeats, not args.no_baseline)
    else:
        body = part_needle(
            args.model,
            args.device_map,
            numbers(args.contexts, int),
            numbers(args.keeps, float),
            numbers(args.depths, float),
            args.trials,
            args.out,
        )
    (args.out / f"{args.part}.json").write_text(json.dumps({**header, "part": args.part, **body}, indent=1) + "\n")


if __name__ == "__main__":
    main()
