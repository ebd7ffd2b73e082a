"""Demotion at long context on one GPU: what recalling demoted pages costs per decoded token.

A Llama-3-8B-shaped model with random bf16 weights (built from a config, nothing downloaded; the shape of
``heap_gpu.py``) reads one context of ``--context`` tokens (131,072 by default) once
(:func:`kvlab.engine.generation.prefill_once`),
then SnapKV keeps 10% of it on the GPU (the GPU budget) and each configuration compresses its own fork of that read:
evicted tokens deleted (plain SnapKV), or demoted to pinned CPU memory or to the offload file and recalled page by
page, with and without promotion and prefetching. Each configuration then reads a 32-token question and decodes
``--new-tokens`` tokens (eagerly: demotion recalls from the host at every step, so no CUDA graph is replayed; plain
SnapKV decodes eagerly too here, so that the ratio compares like with like).

Per configuration the JSON records decode milliseconds per token (the median of the steady second half of the
steps, so warm-up and the first shapes are left out; the steps repeat at the same shapes), the recall's seconds per
decoded token (choosing, gathering and copying, the device synchronised), pages and bytes fetched per decoded token,
the bytes of each tier at the end, the heap's bytes and ``torch.cuda.max_memory_allocated``. A warm-up configuration
runs first and is not reported. The weights are random, so the tokens mean nothing: accuracy is measured on the
published model by ``bench/demotion_accuracy.sh``.

Usage: ``python bench/demotion_gpu.py OUT_DIR [--context N] [--new-tokens N]``; ``KVLAB_OFFLOAD_DIR`` chooses where
the file tier's file goes (the system's temporary directory by default).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from heap_gpu import LLAMA3_8B, build, steady_ms  # noqa: E402

from kvlab.budget import Budget  # noqa: E402
from kvlab.engine.generation import Generation, prefill_once  # noqa: E402
from kvlab.engine.spec import RunSpec
from kvlab.policies import configure  # noqa: E402
from kvlab.units import GIB, MIB  # noqa: E402

KEEP = 0.1
QUESTION = 32
#: Enough CPU memory and file for every demoted token of the default context (about 15.5 GB of 17.2).
TIER_MIB = 32 * GIB / MIB
CONFIGURATIONS: dict[str, dict[str, Any]] = {
    "snapkv, evicted tokens deleted": {},
    "cpu tier, promote": {"cpu_tier_mib": TIER_MIB},
    "cpu tier, promote, prefetch": {"cpu_tier_mib": TIER_MIB, "prefetch": True},
    "cpu tier, no promote": {"cpu_tier_mib": TIER_MIB, "promote": False},
    "disk tier, promote": {"disk_tier_mib": TIER_MIB},
}


def run_one(loaded, prefilled, suffix: torch.Tensor, params: dict[str, Any], new_tokens: int) -> dict[str, Any]:
    """One configuration over a fork of the shared read, drained, with its figures."""
    variant = configure("snapkv", **params)
    spec = RunSpec(
        variant.policy,
        Budget(keep=KEEP),
        max_new_tokens=new_tokens,
        static=False,
        stop_token_ids=(),
        cache=variant.cache(),
    )
    gc.collect()
    torch.cuda.empty_cache()
    started = time.perf_counter()
    generation = Generation(loaded, spec, suffix_ids=suffix, prefilled=prefilled)
    for _ in generation.events():
        pass
    result = generation.result()
    wall = time.perf_counter() - started
    report = result.demotion
    return {
        "params": params,
        "decode_ms_per_token": steady_ms(result.token_seconds),
        "decode_steps": len(result.token_seconds),
        "wall_s": wall,
        "heap_kv_bytes": result.kv_bytes,
        "heap_reserved_bytes": result.kv_reserved_bytes,
        "kv_bytes_full": result.kv_bytes_full,
        "peak_gpu_bytes": result.peak_gpu_bytes,
        "demotion": None if report is None else dataclasses.asdict(report),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--context", type=int, default=131_072)
    parser.add_argument("--new-tokens", type=int, default=32)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    model, loaded = build(LLAMA3_8B, args.context + QUESTION + args.new_tokens + 8, torch.bfloat16, "cuda", None)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(10, int(LLAMA3_8B["vocab_size"]), (1, args.context), generator=generator)
    suffix = torch.randint(10, int(LLAMA3_8B["vocab_size"]), (1, QUESTION), generator=generator).cuda()
    variants = [configure("snapkv", **params) for params in CONFIGURATIONS.values()]
    torch.cuda.synchronize()
    started = time.perf_counter()
    with torch.inference_mode():
        prefilled = prefill_once(loaded, ids.cuda(), variants)
    torch.cuda.synchronize()
    read_seconds = time.perf_counter() - started
    rows = {}
    run_one(loaded, prefilled, suffix, CONFIGURATIONS["cpu tier, promote"], args.new_tokens)  # warm-up, dropped
    for label, params in CONFIGURATIONS.items():
        rows[label] = run_one(loaded, prefilled, suffix, params, args.new_tokens)
        print(label, json.dumps(rows[label], default=str), flush=True)
    result = {
        "device": torch.cuda.get_device_name(),
        "model": "Llama-3-8B shape, random bf16 weights",
        "context_tokens": args.context,
        "question_tokens": QUESTION,
        "keep": KEEP,
        "policy": "snapkv (window 32, kernel 5, average pooling)",
        "new_tokens": args.new_tokens,
        "shared_read_s": read_seconds,
        "timing": "decode ms/token: median of the second half of the steps of one run per configuration, after a "
        "warm-up configuration that is not reported; eager decoding for every configuration",
        "configurations": rows,
    }
    (args.out / "demotion_gpu.json").write_text(json.dumps(result, indent=2, default=str) + "\n")


if __name__ == "__main__":
    main()
