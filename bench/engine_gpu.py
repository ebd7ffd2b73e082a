"""Engine benchmark on one GPU: a Llama-3-8B-shaped model with random bf16 weights (built from a config, nothing
downloaded), contexts of 8k and 32k tokens, keep 10%.

Measured side by side in one process, on one device:
* decode time per token of ``full`` against ``streaming``, ``h2o`` and ``snapkv`` (streaming mode: every policy
  evicts at every step, so the policy's whole cost is in the figure; and prefill mode: compress once, then decode);
* prefill time and peak GPU memory (``torch.cuda.max_memory_allocated``) of ``streaming`` mode against ``full``;
* the memory a streaming run should need: weights + (budget + chunk) tokens of KV + the activations of one chunk,
  each measured (weights and KV from tensor sizes, activations as the peak of one chunk's forward pass).

Usage: ``python bench/engine_gpu.py --out bench/results/engine_gpu.json`` (needs a CUDA GPU with ~40 GB free).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from heap_gpu import LLAMA3_8B  # noqa: E402  (the same model shape as the heap benchmark)

from kvlab.budget import Budget  # noqa: E402
from kvlab.engine.generation import generate
from kvlab.engine.spec import RunSpec  # noqa: E402
from kvlab.models.loading import wrap_model  # noqa: E402
from kvlab.policies import make_policy  # noqa: E402
from kvlab.units import GIB  # noqa: E402


def build_model(layers: int | None):
    from transformers import LlamaConfig, LlamaForCausalLM

    shape: dict[str, Any] = {
        **LLAMA3_8B,
        "max_position_embeddings": 32768 + 1024,
        **({"num_hidden_layers": layers} if layers else {}),
    }
    config = LlamaConfig(**shape)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model: Any = LlamaForCausalLM(config)
        model = model.to(torch.bfloat16)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0.0, 0.02)
    return wrap_model(model)


def decode_ms(loaded, ids, spec: RunSpec, repeats: int) -> dict[str, Any]:
    """Median decode time per token over ``repeats`` runs, after one untimed run at the same shapes (kernels and
    allocator warm), with the prefill and peak memory of the last one."""
    generate(loaded, ids, spec)
    per_token: list[float] = []
    prefill: list[float] = []
    peak: int | None = None
    kv = 0
    for _ in range(repeats):
        result = generate(loaded, ids, spec)
        per_token.append(1000 * result.decode_seconds / (len(result.tokens[0]) - 1))
        prefill.append(result.prefill_seconds)
        peak, kv = result.peak_gpu_bytes, result.peak_kv_bytes
    return {
        "decode_ms_per_token": statistics.median(per_token),
        "decode_ms_runs": per_token,
        "prefill_s": statistics.median(prefill),
        "peak_gpu_bytes": peak,
        "peak_kv_bytes": kv,
    }


def activation_peak(loaded, chunk: int) -> int:
    """Peak memory above the weights of one forward pass over ``chunk`` tokens with an empty cache."""
    spec = RunSpec(make_policy("full"), max_new_tokens=1)
    ids = torch.randint(0, 1000, (1, chunk), device="cuda")
    torch.cuda.synchronize()
    result = generate(loaded, ids, spec)
    kv_of_chunk = result.peak_kv_bytes
    assert result.peak_gpu_bytes is not None, "peak GPU memory is measured on a CUDA device only"
    return result.peak_gpu_bytes - weight_bytes(loaded) - kv_of_chunk


def weight_bytes(loaded) -> int:
    return sum(p.numel() * p.element_size() for p in loaded.model.parameters())


def hf_generate_ms(loaded, ids, new_tokens: int) -> float:
    """Decode ms per token of plain ``model.generate`` (transformers' own cache and SDPA, with PyTorch's default
    choice of SDPA kernels), after one untimed run at the same shapes."""

    def run(n: int) -> float:
        torch.cuda.synchronize()
        started = time.perf_counter()
        loaded.model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
        torch.cuda.synchronize()
        return time.perf_counter() - started

    run(new_tokens)
    return 1000 * (run(new_tokens) - run(1)) / (new_tokens - 1)


def configurations(context: int, chunk: int, keep: float) -> list[tuple[str, RunSpec]]:
    """What is timed at one context length (H2O in prefill mode only at 8k: it needs the exact attention of every
    context query, computed in blocks, which at 32k costs minutes rather than seconds)."""
    budget = Budget(keep=keep)
    rows = [("full/prefill", RunSpec(make_policy("full"))), ("full/chunked", RunSpec(make_policy("full"), chunk=chunk))]
    for name in ("streaming", "h2o", "snapkv"):
        rows.append((f"{name}/streaming", RunSpec(make_policy(name), budget, mode="streaming", chunk=chunk)))
        rows.append(
            (
                f"{name}/streaming-interval16",
                RunSpec(make_policy(name), budget, mode="streaming", chunk=chunk, compression_interval=16),
            )
        )
        if name != "h2o" or context <= 8192:
            rows.append((f"{name}/prefill", RunSpec(make_policy(name), budget)))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--contexts", default="8192,32768")
    parser.add_argument("--keep", type=float, default=0.1)
    parser.add_argument("--chunk", type=int, default=1024)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--layers", type=int, default=None, help="fewer layers for a quick check")
    parser.add_argument("--out", default="bench/results/engine_gpu.json")
    args = parser.parse_args()

    loaded = build_model(args.layers)
    weights = weight_bytes(loaded)
    results = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "model": "Llama-3-8B shape, random bf16 weights",
        "layers": loaded.arch.num_layers,
        "keep": args.keep,
        "chunk": args.chunk,
        "new_tokens": args.new_tokens,
        "repeats": args.repeats,
        "weight_bytes": weights,
        "contexts": {},
    }
    warm = torch.randint(0, 1000, (1, 2048), device="cuda")
    for _, spec in configurations(2048, 512, 0.1):
        generate(loaded, warm, dataclasses.replace(spec, max_new_tokens=4, stop_token_ids=()))
    act = activation_peak(loaded, args.chunk)
    results["activation_bytes_one_chunk"] = act
    for context in (int(c) for c in args.contexts.split(",")):
        ids = torch.randint(0, 100000, (1, context), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
        rows = {"hf_generate": {"decode_ms_per_token": hf_generate_ms(loaded, ids, args.new_tokens)}}
        print(context, "hf_generate", rows["hf_generate"], flush=True)
        for label, spec in configurations(context, args.chunk, args.keep):
            torch.cuda.empty_cache()
            spec = dataclasses.replace(spec, max_new_tokens=args.new_tokens, stop_token_ids=())
            rows[label] = decode_ms(loaded, ids, spec, args.repeats)
            print(context, label, {k: v for k, v in rows[label].items() if k != "decode_ms_runs"}, flush=True)
        budget_tokens = Budget(keep=args.keep).resolve(context)
        per_token_kv = 2 * loaded.arch.num_layers * loaded.arch.num_kv_heads * loaded.arch.head_dim * 2
        expected = weights + (budget_tokens + args.chunk) * per_token_kv + act
        measured = rows["streaming/streaming"]["peak_gpu_bytes"]
        rows["streaming_memory_model"] = {
            "budget_tokens": budget_tokens,
            "weights": weights,
            "kv_budget_plus_chunk": (budget_tokens + args.chunk) * per_token_kv,
            "activations_one_chunk": act,
            "expected_peak": expected,
            "measured_peak_streaming_mode": measured,
            "ratio": measured / expected,
        }
        results["contexts"][str(context)] = rows
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=2))
    for context, rows in results["contexts"].items():
        for label, row in rows.items():
            if "decode_ms_per_token" in row:
                print(
                    f"{context:>6} {label:32s} decode {row['decode_ms_per_token']:7.2f} ms/token"
                    + (
                        f"  prefill {row['prefill_s']:6.2f} s  peak {row['peak_gpu_bytes'] / GIB:6.2f} GiB"
                        if "prefill_s" in row
                        else ""
                    )
                )
        print(
            context,
            "streaming-mode peak / (weights + (budget+chunk) KV + activations):",
            f"{rows['streaming_memory_model']['ratio']:.3f}",
        )


if __name__ == "__main__":
    main()
