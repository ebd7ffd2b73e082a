"""The KV heap on one GPU: decode speed against the memory roofline, the three layouts side by side, prefill cost of
H2O's observation, peak memory, and a fixed-budget stream over millions of tokens.

A Llama-3-8B-shaped model with random bf16 weights (built from a config, nothing downloaded), batch 1, keep 10%.
Everything is measured in one process on one device, through ``kvlab.engine.generation.generate`` as users run it,
beside transformers' own ``generate`` (dynamic cache, SDPA without cuDNN) and its static cache compiled with
``torch.compile`` (``cache_implementation="static"``), and the device's copy bandwidth measured with a large copy.

Parts (each fits one call of ten minutes):

* ``check``: on a small float32 model, decoding in captured CUDA graphs gives the tokens of eager decoding, for
  every policy, layout and mode;
* ``decode``: per context length (``--contexts``), kvlab ``full`` and every evicting policy in streaming mode, the
  three layouts, SnapKV in prefill mode and eager decoding for comparison, each with the attention backends of
  ``--attention`` side by side (``auto``, what users get, by default), and the transformers baselines (``--hf``;
  ``--only none`` runs them alone);
  each configuration runs twice at the same shapes and the second run is reported (decode: the median of the
  steady half of its per-token times);
* ``backends``: one layer's decode attention in a captured step by each attention backend, with and without H2O's
  accumulated scores;
* ``flex-configs``: one layer's flex decode attention in a captured step under each option of flex_attention's
  decoding kernel tried (tile, pipeline stages, warps, splits), against flex's own defaults;
* ``chunk-configs``: one layer's flex attention over a prefill chunk of the fixed-budget stream under each option
  of flex_attention's main kernel tried, with and without H2O's second pass;
* ``long``: StreamingLLM in streaming mode with a fixed budget of 4,096 tokens over ``--long-contexts`` tokens, in
  chunks of each of ``--long-chunks`` tokens (4,096 by default), each size warmed first: prefill rate and peak memory.

Usage: ``python bench/heap_gpu.py --part decode --contexts 8192,32768 --hf --out $OUT/decode.json``
(``--layers 2 --cpu`` runs the same code on a CPU with a two-layer model, to check the script).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvlab.attention.backends import check_attention  # noqa: E402
from kvlab.budget import Budget  # noqa: E402
from kvlab.cache.layouts import LAYOUTS  # noqa: E402
from kvlab.cache.spec import CacheSpec
from kvlab.engine.generation import generate
from kvlab.engine.spec import RunSpec
from kvlab.errors import KvlabError  # noqa: E402
from kvlab.models.loading import wrap_model  # noqa: E402
from kvlab.modes import MODES  # noqa: E402
from kvlab.policies import POLICIES, make_policy  # noqa: E402
from kvlab.units import GB, GIB  # noqa: E402

LLAMA3_8B = dict(
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    rope_theta=500000.0,
    tie_word_embeddings=False,
)
SMALL = dict(
    vocab_size=4096,
    hidden_size=512,
    intermediate_size=1024,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=2,
)
EVICTING = ("streaming", "h2o", "snapkv", "tova")
NEW_TOKENS = 64
KEEP = 0.1


def build(shape: dict[str, Any], positions: int, dtype: torch.dtype, device: str, layers: int | None):
    """A random-weight Llama of ``shape`` (normal 0.02), wrapped for kvlab."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        **{**shape, **({"num_hidden_layers": layers} if layers else {})}, max_position_embeddings=positions
    )
    torch.manual_seed(0)
    with torch.device(device):
        model: Any = LlamaForCausalLM(config)
        model = model.to(dtype)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0.0, 0.02)
    model.generation_config.eos_token_id = None
    return model, wrap_model(model)


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def copy_bandwidth(device: str) -> float:
    """Bytes per second of a large device-to-device copy (read + write), the median of 10."""
    if device != "cuda":
        return float("nan")
    size = 2 * GIB
    source = torch.randn(size // 2, device="cuda", dtype=torch.float16)
    target = torch.empty_like(source)
    times = []
    for _ in range(12):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        target.copy_(source)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    del source, target
    return 2 * size / statistics.median(times[2:])


def weight_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def steady_ms(token_seconds: list[float]) -> float:
    """Milliseconds per token over the steady half of a decode (after warm-up and graph capture)."""
    steady = token_seconds[len(token_seconds) // 2 :] or token_seconds
    return 1000 * statistics.median(steady)


REPEATS = 2


def kvlab_row(
    loaded, ids: torch.Tensor, label: str, spec: RunSpec, roofline_base: int, bandwidth: float
) -> dict[str, Any]:
    """A configuration run :data:`REPEATS` times at the same shapes; the last run reported."""
    for _ in range(REPEATS):
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        result = generate(loaded, ids, spec)
    decode_ms = steady_ms(result.token_seconds)
    kept_kv = result.kv_bytes
    roofline_ms = 1000 * (roofline_base + kept_kv) / bandwidth
    row = {
        "config": label,
        "policy": spec.policy.name,
        "mode": spec.mode,
        "layout": spec.cache.layout,
        "static": spec.static,
        "attention": spec.attention_on(ids.device),
        "decode_ms": round(decode_ms, 3),
        "decode_ms_all_tokens": round(1000 * result.decode_seconds / max(1, len(result.tokens[0]) - 1), 3),
        "roofline_ms": round(roofline_ms, 3),
        "vs_roofline": round(decode_ms / roofline_ms, 3),
        "prefill_s": round(result.prefill_seconds, 3),
        "peak_gpu_gib": _gib(result.peak_gpu_bytes),
        "kv_live_gib": _gib(result.kv_bytes),
        "kv_reserved_gib": _gib(result.kv_reserved_bytes),
        "peak_kv_reserved_gib": _gib(result.peak_kv_reserved_bytes),
        "dead_share": round(result.dead_share, 4),
        "compactions": result.compactions,
        "compaction_s": round(result.compaction_seconds, 4),
        "decode_graphs": result.decode_graphs,
        "tokens": len(result.tokens[0]),
    }
    print(json.dumps(row), flush=True)
    return row


def _gib(value: int | None) -> float | None:
    return None if value is None else round(value / GIB, 3)


class TokenClock:
    """A logits processor that notes when each token's logits are ready (after a device synchronisation): the
    seconds each decoded token took, as kvlab's own generate reports them."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        synchronize()
        self.times.append(time.perf_counter())
        return scores

    def token_seconds(self) -> list[float]:
        return [later - earlier for earlier, later in zip(self.times, self.times[1:], strict=False)]


def hf_rows(
    model, ids: torch.Tensor, compiled: bool, bandwidth: float, roofline_base: int, kv_per_token: int
) -> list[dict[str, Any]]:
    """transformers' generate: dynamic cache with SDPA (cuDNN off), and, with ``compiled``, its static cache with
    torch.compile; each run :data:`REPEATS` times at the same shapes (the first compiles) and the last reported,
    its decode the median of the steady half of its per-token times (as kvlab's), its prefill the time to the first
    token."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from transformers import LogitsProcessorList

    own_attention = model.config._attn_implementation
    model.set_attn_implementation("sdpa")
    rows = []
    variants: list[tuple[str, dict[str, Any]]] = [("transformers generate (dynamic cache)", {})]
    if compiled:
        variants.append(("transformers generate (static cache, torch.compile)", {"cache_implementation": "static"}))
    try:
        for label, extra in variants:
            for _ in range(max(2, REPEATS)):
                gc.collect()
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
                    torch.cuda.reset_peak_memory_stats()
                clock = TokenClock()
                synchronize()
                started = time.perf_counter()
                with (
                    torch.inference_mode(),
                    sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]),
                ):
                    model.generate(
                        ids,
                        max_new_tokens=1 + NEW_TOKENS,
                        min_new_tokens=1 + NEW_TOKENS,
                        do_sample=False,
                        pad_token_id=0,
                        logits_processor=LogitsProcessorList([clock]),
                        **extra,
                    )
                peak = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None
            decode_ms = steady_ms(clock.token_seconds())
            roofline_ms = 1000 * (roofline_base + kv_per_token * ids.shape[1]) / bandwidth
            row = {
                "config": label,
                "decode_ms": round(decode_ms, 3),
                "decode_ms_all_tokens": round(1000 * statistics.mean(clock.token_seconds()), 3),
                "roofline_ms": round(roofline_ms, 3),
                "vs_roofline": round(decode_ms / roofline_ms, 3),
                "prefill_s": round(clock.times[0] - started, 3),
                "peak_gpu_gib": _gib(peak),
            }
            print(json.dumps(row), flush=True)
            rows.append(row)
    finally:
        model.set_attn_implementation(own_attention)
    return rows


def part_check(device: str, policies: list[str] | None, backends: list[str]) -> dict[str, Any]:
    """Graph decoding gives the tokens of eager decoding (float32, small model), every policy (or ``policies``),
    layout and mode, the graphs attending with each of ``backends``."""
    _, loaded = build(SMALL, 8192, torch.float32, device, None)
    ids = torch.randint(10, SMALL["vocab_size"], (2, 700), device=device, generator=None)
    results = []
    for policy_name in policies or list(POLICIES):
        params = {"window": 16} if policy_name in ("snapkv", "pyramidkv") else {}
        policy = make_policy(policy_name, **params)
        budget = Budget(keep=0.2) if policy.evicts else None
        for mode in MODES:
            try:
                policy.check_mode(mode)
            except KvlabError:
                continue  # a policy that runs in one mode only (KVzip)
            for layout in LAYOUTS:
                spec = RunSpec(
                    policy,
                    budget,
                    mode=mode,
                    chunk=128,
                    max_new_tokens=24,
                    stop_token_ids=(),
                    cache=CacheSpec(layout=layout),
                    static=False,
                )
                eager = generate(loaded, ids, spec)
                for backend in backends:
                    graphed_spec = dataclasses.replace(spec, static=None, attention=check_attention(backend))
                    graphed = generate(loaded, ids, graphed_spec)
                    same = eager.tokens == graphed.tokens and eager.kept_per_layer == graphed.kept_per_layer
                    results.append(
                        {
                            "policy": policy_name,
                            "mode": mode,
                            "layout": layout,
                            "attention": graphed_spec.attention_on(ids.device),
                            "same_tokens": same,
                            "graphs": graphed.decode_graphs,
                            "eager_ms": round(steady_ms(eager.token_seconds), 3),
                            "graph_ms": round(steady_ms(graphed.token_seconds), 3),
                        }
                    )
                    print(json.dumps(results[-1]), flush=True)
    return {"rows": results, "all_same": all(row["same_tokens"] for row in results)}


def decode_configs() -> list[tuple[str, RunSpec]]:
    """The kvlab configurations of the decode part, by label."""
    budget = Budget(keep=KEEP)
    configs = [
        ("full", RunSpec(make_policy("full"), max_new_tokens=NEW_TOKENS, stop_token_ids=())),
        (
            "full (eager decode)",
            RunSpec(make_policy("full"), max_new_tokens=NEW_TOKENS, stop_token_ids=(), static=False),
        ),
    ]
    for name in EVICTING:
        params = {"window": 32} if name == "snapkv" else {}
        configs.append(
            (
                f"{name} streaming",
                RunSpec(
                    make_policy(name, **params),
                    budget,
                    mode="streaming",
                    chunk=1024,
                    max_new_tokens=NEW_TOKENS,
                    stop_token_ids=(),
                ),
            )
        )
    for layout in ("compact", "bitmask"):
        configs.append(
            (
                f"streaming streaming {layout}",
                RunSpec(
                    make_policy("streaming"),
                    budget,
                    mode="streaming",
                    chunk=1024,
                    max_new_tokens=NEW_TOKENS,
                    stop_token_ids=(),
                    cache=CacheSpec(layout=layout),
                ),
            )
        )
    configs.append(
        (
            "h2o streaming (eager decode)",
            RunSpec(
                make_policy("h2o"),
                budget,
                mode="streaming",
                chunk=1024,
                max_new_tokens=NEW_TOKENS,
                stop_token_ids=(),
                static=False,
            ),
        )
    )
    for layout in LAYOUTS:
        configs.append(
            (
                f"snapkv prefill {layout}",
                RunSpec(
                    make_policy("snapkv", window=32),
                    budget,
                    mode="prefill",
                    max_new_tokens=NEW_TOKENS,
                    stop_token_ids=(),
                    cache=CacheSpec(layout=layout),
                ),
            )
        )
    return configs


def part_decode(
    device: str,
    contexts: list[int],
    layers: int | None,
    hf: bool,
    compiled: bool,
    only: list[str] | None,
    backends: list[str],
) -> dict[str, Any]:
    model, loaded = build(LLAMA3_8B, max(contexts) + 1024, torch.bfloat16, device, layers)
    bandwidth = copy_bandwidth(device)
    weights = weight_bytes(model)
    arch = loaded.arch
    kv_per_token = 2 * arch.num_layers * arch.num_kv_heads * arch.head_dim * 2
    print(json.dumps({"bandwidth_gb_s": round(bandwidth / GB, 1), "weight_gib": _gib(weights)}), flush=True)
    table: dict[str, Any] = {"bandwidth_bytes_per_s": bandwidth, "weight_bytes": weights, "contexts": {}}
    configs = [(label, spec) for label, spec in decode_configs() if only is None or label in only]
    for context in contexts:
        ids = torch.randint(10, 1000, (1, context), device=device)
        rows = [
            kvlab_row(
                loaded, ids, label, dataclasses.replace(spec, attention=check_attention(backend)), weights, bandwidth
            )
            for label, spec in configs
            for backend in backends
        ]
        if hf:
            rows += hf_rows(model, ids, compiled, bandwidth, weights, kv_per_token)
        table["contexts"][str(context)] = rows
        del ids
    return table


def long_spec(chunk: int = 4096) -> RunSpec:
    """StreamingLLM in streaming mode with a fixed budget of 4,096 tokens, chunks of ``chunk`` (4,096 unless asked):
    a stream of any length."""
    return RunSpec(
        make_policy("streaming"),
        Budget(tokens=4096),
        mode="streaming",
        chunk=chunk,
        max_new_tokens=8,
        stop_token_ids=(),
    )


def part_long(
    device: str, contexts: list[int], layers: int | None, chunks: list[int], options: dict[str, Any] | None = None
) -> dict[str, Any]:
    """StreamingLLM, streaming mode, a fixed budget of 4,096 tokens, for each chunk size of ``chunks``: prefill rate
    and peak memory over each of ``contexts``, after a warming stream of eight chunks at that size (which compiles
    the chunks' attention kernels, so that no compilation is timed); the chunks' flex kernel under ``options`` where
    given (:func:`chunk_options`), else as kvlab chooses."""
    model, loaded = build(LLAMA3_8B, max(contexts) + 1024, torch.bfloat16, device, layers)
    rows = []
    with chunk_options(options):
        for chunk in chunks:
            spec = long_spec(chunk)
            warming = min(8 * chunk + 4096, max(contexts))
            generate(loaded, torch.randint(10, 1000, (1, warming), device=device), spec)
            for context in contexts:
                ids = torch.randint(10, 1000, (1, context), device=device)
                gc.collect()
                result = generate(loaded, ids, spec)
                row = {
                    "context": context,
                    "chunk": chunk,
                    "prefill_s": round(result.prefill_seconds, 2),
                    "prefill_tokens_per_s": round(context / result.prefill_seconds),
                    "peak_gpu_gib": _gib(result.peak_gpu_bytes),
                    "kv_reserved_gib": _gib(result.kv_reserved_bytes),
                    "weight_gib": _gib(weight_bytes(model)),
                }
                print(json.dumps(row), flush=True)
                rows.append(row)
                del ids, result
    return {"rows": rows, "chunk_options": "kvlab's" if options is None else options}


def prefill_configs() -> list[tuple[str, RunSpec]]:
    """The configurations of the prefill part: StreamingLLM and H2O in streaming mode with keep 10% and chunks of
    1,024 (H2O observes every chunk's attention), and the fixed-budget stream of ``long``."""
    configs = [
        (
            f"{name} keep 10%",
            RunSpec(
                make_policy(name),
                Budget(keep=KEEP),
                mode="streaming",
                chunk=1024,
                max_new_tokens=2,
                stop_token_ids=(),
            ),
        )
        for name in ("streaming", "h2o")
    ]
    configs.append(("streaming 4096 tokens", long_spec()))
    return configs


def kernel_table(prof: Any) -> list[dict[str, Any]]:
    """The profiler's kernels by total device time, largest first."""
    rows = [
        {"name": item.key, "count": item.count, "cuda_us": round(item.device_time_total, 1)}
        for item in prof.key_averages()
        if item.device_time_total > 0
    ]
    return sorted(rows, key=lambda r: -r["cuda_us"])


#: The steps of a generation marked in a profile (method of :class:`~kvlab.engine.generation.Generation`, label), so
#: that the device's idle time can be put down to what the host was doing.
GENERATION_MARKS = {"forward": "kvlab: forward", "evict": "kvlab: eviction", "event": "kvlab: event"}


@contextlib.contextmanager
def marked(marks: dict[str, str]) -> Iterator[None]:
    """Run with the generation's methods named in ``marks`` wrapped in the profiler's ``record_function``."""
    from torch.profiler import record_function

    from kvlab.engine.generation import Generation

    originals = {name: getattr(Generation, name) for name in marks}

    def wrapped(name: str) -> Callable[..., Any]:
        def method(*args: Any, **kwargs: Any) -> Any:
            with record_function(marks[name]):
                return originals[name](*args, **kwargs)

        return method

    for name in marks:
        setattr(Generation, name, wrapped(name))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(Generation, name, original)


#: Idle stretches of the device, by length (microseconds), for :func:`idle_table`.
IDLE_BUCKETS = (10, 100, 1000, 10000)


def idle_table(prof: Any) -> dict[str, Any]:
    """Where the device waited during a profiled run: its kernels' span and busy time (their union), its idle
    stretches by length, the host step (a :data:`GENERATION_MARKS` label, the innermost running just before the
    stretch ended, when the host launched the kernel that ended it) each stretch is put down to, and the CUDA
    runtime calls by total host time (a synchronisation shows there)."""
    from torch.autograd import DeviceType

    events = prof.events()
    kernels = sorted((e.time_range.start, e.time_range.end) for e in events if e.device_type == DeviceType.CUDA)
    if not kernels:  # a CPU run
        return {}
    marks = [
        (e.time_range.start, e.time_range.end, e.name)
        for e in events
        if e.device_type == DeviceType.CPU and e.name.startswith("kvlab: ")
    ]
    runtime: dict[str, list[float]] = {}
    for e in events:
        if e.device_type == DeviceType.CPU and e.name.startswith("cuda"):
            runtime.setdefault(e.name, []).append(e.time_range.end - e.time_range.start)
    busy, reach, stretches = 0.0, kernels[0][0], []
    for start, end in kernels:
        if start > reach:
            stretches.append((reach, start))
        busy += max(0.0, end - max(start, reach))
        reach = max(reach, end)
    by_length = {f"<{bound} us": 0.0 for bound in IDLE_BUCKETS} | {f">={IDLE_BUCKETS[-1]} us": 0.0}
    by_step: dict[str, float] = {}
    for start, end in stretches:
        length = end - start
        bucket = next((f"<{b} us" for b in IDLE_BUCKETS if length < b), f">={IDLE_BUCKETS[-1]} us")
        by_length[bucket] += length
        launched = end - 5.0
        running = [m for m in marks if m[0] <= launched <= m[1]]
        step = min(running, key=lambda m: m[1] - m[0])[2] if running else "between steps"
        by_step[step] = by_step.get(step, 0.0) + length
    return {
        "span_ms": round((reach - kernels[0][0]) / 1000, 1),
        "busy_ms": round(busy / 1000, 1),
        "idle_ms_by_stretch": {k: round(v / 1000, 1) for k, v in by_length.items()},
        "idle_ms_by_host_step": {k: round(v / 1000, 1) for k, v in sorted(by_step.items(), key=lambda kv: -kv[1])},
        "runtime_calls": [
            {"name": name, "count": len(times), "host_ms": round(sum(times) / 1000, 1)}
            for name, times in sorted(runtime.items(), key=lambda item: -sum(item[1]))[:12]
        ],
    }


def part_prefill(
    device: str, contexts: list[int], layers: int | None, only: list[str] | None, profiled: bool
) -> dict[str, Any]:
    """Prefill time per configuration (:func:`prefill_configs`), each run :data:`REPEATS` times at the same shapes
    and the last reported; with ``profiled``, one more run of each at the first context under the profiler (its
    kernels by device time)."""
    from torch.profiler import ProfilerActivity, profile

    model, loaded = build(LLAMA3_8B, max(contexts) + 1024, torch.bfloat16, device, layers)
    configs = [(label, spec) for label, spec in prefill_configs() if only is None or label in only]
    table: dict[str, Any] = {"contexts": {}, "profiles": {}}
    for context in contexts:
        ids = torch.randint(10, 1000, (1, context), device=device)
        rows = []
        for label, spec in configs:
            for _ in range(REPEATS):
                gc.collect()
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
                result = generate(loaded, ids, spec)
            row = {
                "config": label,
                "prefill_s": round(result.prefill_seconds, 3),
                "tokens_per_s": round(context / result.prefill_seconds),
                "peak_gpu_gib": _gib(result.peak_gpu_bytes),
            }
            print(json.dumps({"context": context, **row}), flush=True)
            rows.append(row)
            if profiled and context == contexts[0]:
                activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
                with marked(GENERATION_MARKS), profile(activities=activities) as prof:
                    generate(loaded, ids, spec)
                    synchronize()
                print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=20), flush=True)
                table["profiles"][label] = {
                    "context": context,
                    "kernels": kernel_table(prof)[:40],
                    "device_idle": idle_table(prof),
                }
                print(json.dumps(table["profiles"][label]["device_idle"]), flush=True)
        table["contexts"][str(context)] = rows
        del ids
    return table


def part_profile(device: str, context: int, layers: int | None, policy_name: str) -> dict[str, Any]:
    """Where the time of a static decode step goes: the step's kernels run eagerly (not captured), under the
    profiler, with the model's forward and the eviction marked, for ``policy_name`` in streaming mode."""
    from torch.profiler import ProfilerActivity, profile, record_function

    from kvlab.engine.generation import Generation
    from kvlab.policies import POLICIES as REGISTRY

    model, loaded = build(LLAMA3_8B, context + 1024, torch.bfloat16, device, layers)
    uncaptured = type(f"Uncaptured{policy_name}", (REGISTRY[policy_name],), {"capturable": False})
    budget = None if policy_name == "full" else Budget(keep=KEEP)
    spec = RunSpec(
        uncaptured(),
        budget,
        mode="prefill" if budget is None else "streaming",
        chunk=1024,
        max_new_tokens=24,
        stop_token_ids=(),
        static=True,
    )
    generation = Generation(loaded, spec, torch.randint(10, 1000, (1, context), device=device))
    generation.fuse_layers()  # as a captured run would: its steps are profiled uncaptured, so nothing else does
    forward, evict = generation.model_forward, generation.evict

    def marked_forward(*args, **kwargs):
        with record_function("kvlab: model forward"):
            return forward(*args, **kwargs)

    def marked_evict(*args, **kwargs):
        with record_function("kvlab: eviction"):
            return evict(*args, **kwargs)

    setattr(generation, "model_forward", marked_forward)  # noqa: B010 (a method replaced on one instance)
    setattr(generation, "evict", marked_evict)  # noqa: B010
    events = generation.events()
    decoded = 0
    for event in events:
        decoded += event.kind == "decode"
        if decoded == 8:
            break
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(8):
            next(events)
        synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=30), flush=True)
    return {"policy": policy_name, "context": context, "steps": 8, "kernels": kernel_table(prof)}


def transposed_product(probs: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """P . V computed as (V^T . P^T)^T, the form kvlab's decode attention uses."""
    return torch.matmul(values.transpose(-1, -2), probs.transpose(-1, -2)).transpose(-1, -2)


def part_attention(device: str) -> dict[str, Any]:
    """One decode query's output P . V over S slots (8 KV heads, 4 query heads each, head dim 128, bf16), written
    two ways, against SDPA without a mask: microseconds per call, median of 50 after warm-up."""
    rows = []
    for slots in (4301, 14117, 32832, 131136):
        probs = torch.softmax(torch.randn(1, 8, 4, slots, device=device), -1).to(torch.bfloat16)
        values = torch.randn(1, 8, slots, 128, device=device, dtype=torch.bfloat16)
        query = torch.randn(1, 32, 1, 128, device=device, dtype=torch.bfloat16)
        keys = torch.randn(1, 8, slots, 128, device=device, dtype=torch.bfloat16)
        ways: dict[str, Callable[[], torch.Tensor]] = {
            "P.V": partial(torch.matmul, probs, values),
            "(V^T.P^T)^T": partial(transposed_product, probs, values),
            "sdpa (no mask)": partial(
                torch.nn.functional.scaled_dot_product_attention, query, keys, values, enable_gqa=True
            ),
        }
        row: dict[str, Any] = {"slots": slots}
        for name, way in ways.items():
            row[name] = round(event_us(way, warmups=5, repeats=50), 1)
        print(json.dumps(row), flush=True)
        rows.append(row)
    return {"rows": rows}


def event_us(run: Callable[[], object], warmups: int, repeats: int) -> float:
    """Microseconds per call of ``run`` launched from the host (its launches included), the median of ``repeats``
    calls timed by CUDA events after ``warmups`` untimed ones."""
    for _ in range(warmups):
        run()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000)
    return statistics.median(times)


def graph_us(step: Callable[[], object], replays: int = 50) -> float:
    """Microseconds per run of ``step`` replayed from a captured CUDA graph (after eager warm-up runs, which also
    compile what is compiled): the cost inside a static decode step, launch latency excluded."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return 1000 * start.elapsed_time(end) / replays


def decode_by_backend(backend: str, query: torch.Tensor, layer: Any, query_position: torch.Tensor) -> torch.Tensor:
    """One layer's decode attention as a static step runs it under ``backend``, the visibility mask built from the
    slots' positions first."""
    from kvlab.attention.flex import flex_decode_attention
    from kvlab.attention.kernels import decode_attention
    from kvlab.attention.masks import allowed_keys

    if backend == "flex":
        return flex_decode_attention(query, layer, layer.keys, layer.values, layer.positions, query_position)
    visible = allowed_keys(layer.positions, query_position, None)
    context = SimpleNamespace(cache=SimpleNamespace(static=True), stats=None, observe=None)
    return decode_attention(query, layer, layer.slots(layer.capacity), visible, context, 0)  # type: ignore[arg-type]


#: Heaps of one layer's decode attention: slots, and the share of them holding tokens (streaming at keep 10%:
#: budget + chunk, three quarters held; the full cache at 32k and 128k).
DECODE_CASES = ((4301, 0.76), (32832, 1.0), (131136, 1.0))


def decode_case(slots: int, held: float, device: str) -> tuple[torch.Tensor, ...]:
    """Random keys, values (8 KV heads of 128, bf16) and one query (32 heads) over ``slots`` slots whose first
    ``held`` share holds tokens (the rest free), and the slots' positions."""
    keys, values = (torch.randn(1, 8, slots, 128, device=device, dtype=torch.bfloat16) for _ in range(2))
    query = torch.randn(1, 32, 1, 128, device=device, dtype=torch.bfloat16)
    positions = torch.arange(slots, device=device, dtype=torch.int32).expand(1, 8, slots).clone()
    positions[..., int(held * slots) :] = -1
    return keys, values, query, positions


def decode_layer(keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, scored: bool) -> Any:
    """A heap layer over a :func:`decode_case`, accumulating H2O's scores where ``scored``."""
    from kvlab.cache.layer import AttentionShape, HeapLayer

    layer = HeapLayer(keys=keys, values=values, positions=positions)
    layer.scores = torch.zeros(positions.shape, device=positions.device) if scored else None
    layer.shape = AttentionShape(None, keys.shape[-1] ** -0.5, None)
    return layer


def part_backends(device: str) -> dict[str, Any]:
    """One layer's decode attention in a static step (8 KV heads, 4 query heads each, head dim 128, bf16) by each
    backend, with and without H2O's accumulated scores, over heaps of ``slots`` whose first three quarters hold
    tokens (streaming at keep 10%: budget + chunk) or all of them (the full cache): microseconds per layer inside a
    captured graph, the mask built from the slots' positions included."""

    rows = []
    for slots, held in DECODE_CASES:
        keys, values, query, positions = decode_case(slots, held, device)
        query_position = torch.tensor([slots], device=device)
        row: dict[str, Any] = {"slots": slots, "held": held}
        for scored in (False, True):
            layer = decode_layer(keys, values, positions, scored)
            for backend in ("sdpa", "flex"):
                step = partial(decode_by_backend, backend, query, layer, query_position)
                row[backend + (" + h2o scores" if scored else "")] = round(graph_us(step), 1)
        print(json.dumps(row), flush=True)
        rows.append(row)
    return {"rows": rows}


#: Every layer's slots at keep 10% in streaming mode (budget + chunk room, ``bench`` contexts 8k, 32k, 128k): what
#: the stacked scoring of a static decode step reads.
SUMS_SLOTS = (1843, 4301, 14131)


def sums_case(slots: int, window: int, device: str) -> tuple[Any, ...]:
    """Stacked operands of a decode step's scoring over 32 layers (8 KV heads, 4 query heads each, head dim 128,
    bf16): queries of a ``window``, keys and positions over ``slots`` slots (the last quarter free), each row's
    log-sum-exp over the slots the last query sees (the decoding kernel's, for a window of one; for a longer window
    only a stand-in of the right shape, for timing the summing pass alone), and H2O's accumulated scores."""
    from kvlab.attention.masks import allowed_keys

    keys = torch.randn(32, 8, slots, 128, device=device, dtype=torch.bfloat16)
    queries = torch.randn(32, 32, window, 128, device=device, dtype=torch.bfloat16)
    positions = torch.arange(slots, device=device, dtype=torch.int32).expand(32, 8, slots).clone()
    positions[..., int(0.75 * slots) :] = -1
    query_positions = torch.arange(slots, slots + window, device=device)
    logits = torch.matmul(queries.view(32, 8, 4 * window, 128), keys.transpose(-1, -2)).float() * 128**-0.5
    visible = allowed_keys(positions, query_positions[-1:], None)
    lse = logits.masked_fill(~visible, float("-inf")).logsumexp(dim=-1).view(32, 32, window)
    scores = torch.zeros(32, 8, slots, device=device)
    return queries, query_positions, keys, positions, lse, scores


def agreement(found: torch.Tensor, expected: torch.Tensor) -> dict[str, float]:
    """How near two scorings are: the largest difference relative to the largest score, and the share of the
    slots each ranks in its top 10% (per KV head) that the other ranks there too."""
    top = max(1, found.shape[-1] // 10)
    picked = torch.zeros_like(found, dtype=torch.bool).scatter_(-1, found.topk(top).indices, True)
    wanted = torch.zeros_like(found, dtype=torch.bool).scatter_(-1, expected.topk(top).indices, True)
    return {
        "largest difference / largest score": float((found - expected).abs().max() / expected.abs().max()),
        "top 10% in common": round(float((picked & wanted).sum() / wanted.sum()), 4),
    }


def part_sums(device: str) -> dict[str, Any]:
    """What each slot received, for 32 stacked layers in a captured step, by PyTorch's fused product and by
    kvlab's Triton kernels (:mod:`kvlab.attention.slot_sums`): H2O's one query with the decoding kernel's
    log-sum-exp, added to its scores, and SnapKV's window of 32 queries without one; microseconds per step, and how
    near the two scorings are."""
    from kvlab.attention.flex import accumulated_attention
    from kvlab.attention.observe import votes
    from kvlab.attention.slot_sums import slot_sums
    from kvlab.cache.layer import AttentionShape
    from kvlab.fusion import fused

    shape = AttentionShape(None, 128**-0.5, None)
    rows = []
    for slots in SUMS_SLOTS:
        row: dict[str, Any] = {"slots": slots}
        queries, query_positions, keys, positions, lse, scores = sums_case(slots, 1, device)
        position = query_positions[-1:]
        accumulated = fused(device, accumulated_attention)
        torch_h2o = partial(accumulated, queries, position, keys, positions, lse, shape, scores)
        kernel_h2o = partial(slot_sums, queries, position, keys, positions, shape, lse, scores)
        row["h2o: pytorch us"] = round(graph_us(torch_h2o), 1)
        row["h2o: kernel us"] = round(graph_us(kernel_h2o), 1)
        row["h2o: agreement"] = agreement(kernel_h2o(), torch_h2o())
        queries, query_positions, keys, positions, lse, scores = sums_case(slots, 32, device)
        torch_votes = partial(fused(device, votes), queries, query_positions, keys, positions, shape)
        kernel_votes = partial(slot_sums, queries, query_positions, keys, positions, shape)
        row["snapkv window 32: pytorch us"] = round(graph_us(torch_votes), 1)
        row["snapkv window 32: kernel us"] = round(graph_us(kernel_votes), 1)
        summing = partial(slot_sums, queries, query_positions, keys, positions, shape, lse)
        row["snapkv window 32: kernel's summing pass alone us"] = round(graph_us(summing), 1)
        row["snapkv window 32: agreement"] = agreement(kernel_votes(), torch_votes())
        print(json.dumps(row), flush=True)
        rows.append(row)
    return {"rows": rows}


SUMS_TILES = [
    {"sum_slots": sum_slots, "sum_split": sum_split, "sum_stages": sum_stages, "warps": warps}
    for sum_slots in (32, 64)
    for sum_split in (512, 2048)
    for sum_stages in (2, 3)
    for warps in (4, 8)
]


def part_sums_tiles(device: str) -> dict[str, Any]:
    """:func:`part_sums`' kernels under each of :data:`SUMS_TILES` (:class:`kvlab.attention.slot_sums.Tiles`), for
    the window of 32 (both passes, and the summing pass alone) and H2O's one query: microseconds per step of 32
    stacked layers in a captured graph, or why a tiling could not run."""
    from kvlab.attention import slot_sums
    from kvlab.cache.layer import AttentionShape

    shape = AttentionShape(None, 128**-0.5, None)
    rows = []
    for slots in SUMS_SLOTS[1:]:
        window = sums_case(slots, 32, device)
        one = sums_case(slots, 1, device)
        try:
            for options in SUMS_TILES:
                row: dict[str, Any] = {"slots": slots, **options}
                slot_sums.TILES = dataclasses.replace(slot_sums.Tiles(), **options)
                queries, query_positions, keys, positions, lse, scores = window
                steps = {
                    "window 32 us": partial(slot_sums.slot_sums, queries, query_positions, keys, positions, shape),
                    "window 32 summing alone us": partial(
                        slot_sums.slot_sums, queries, query_positions, keys, positions, shape, lse
                    ),
                    "h2o us": partial(slot_sums.slot_sums, one[0], one[1][-1:], one[2], one[3], shape, one[4], one[5]),
                }
                for name, step in steps.items():
                    try:
                        row[name] = round(graph_us(step), 1)
                    except Exception as error:  # a tiling the chip cannot hold: recorded, the others go on
                        row[name] = f"{type(error).__name__}: {str(error)[:120]}"
                print(json.dumps(row), flush=True)
                rows.append(row)
        finally:
            slot_sums.TILES = slot_sums.Tiles()
    return {"rows": rows}


FLEX_GRID = [
    {"BLOCK_N": block_n, "num_stages": stages, "num_warps": warps}
    for block_n in (64, 128)
    for stages in (1, 2, 3, 4)
    for warps in (2, 4, 8)
]
SPLITS = (8, 16, 32, 64, 128)


def flex_option_row(case: dict[str, Any], layer: Any, query: torch.Tensor, options: dict[str, int]):
    """One layer's flex decode attention under ``options`` (``{}``: flex's own defaults) in a captured step:
    microseconds, and its largest difference from flex's own defaults' output (or why the kernel could not take the
    options)."""
    from kvlab.attention.flex import flex_decode_attention

    query_position = torch.tensor([layer.keys.shape[2]], device=query.device)
    arguments = (query, layer, layer.keys, layer.values, layer.positions, query_position, None)
    step = partial(flex_decode_attention, *arguments, options)
    reference = flex_decode_attention(*arguments, {})
    row: dict[str, Any] = {**case, "options": options}
    try:
        row["us"] = round(graph_us(step, replays=100), 2)
        row["max_diff"] = (step().float() - reference.float()).abs().max().item()
    except Exception as failure:  # an option the kernel cannot take: recorded, not fatal
        row["failed"] = str(failure)[:200]
    print(json.dumps(row), flush=True)
    return row


def part_flex_configs(device: str) -> dict[str, Any]:
    """flex_attention's decoding kernel under each of :data:`FLEX_GRID`'s options (its tile of slots, pipeline
    stages and warps), then the best of them under each of :data:`SPLITS` splits of the slots, for one layer's
    decode attention in a captured step (8 KV heads, 4 query heads each, head dim 128, bf16) over heaps of
    ``slots`` whose first ``held`` share holds tokens, and the best found with the log-sum-exp H2O and TOVA ask
    for: microseconds per layer, the mask's tables included, each option's output against flex's own defaults'."""

    torch._dynamo.config.recompile_limit = 4096
    rows = []
    for slots, held in DECODE_CASES:
        keys, values, query, positions = decode_case(slots, held, device)
        for scored in (False, True):
            layer = decode_layer(keys, values, positions, scored)
            case = {"slots": slots, "held": held, "scored": scored}
            if not scored:
                found = [flex_option_row(case, layer, query, options) for options in ({}, *FLEX_GRID)]
                best = min((row for row in found[1:] if "us" in row), key=lambda row: row["us"])
                found += [flex_option_row(case, layer, query, {**best["options"], "SPLIT_KV": n}) for n in SPLITS]
                best = min((row for row in found[1:] if "us" in row), key=lambda row: row["us"])
            else:  # the best options without the log-sum-exp, with it
                defaults: dict[str, int] = {}
                found = [flex_option_row(case, layer, query, options) for options in (defaults, best["options"])]
            rows += found
    return {"rows": rows}


#: Options of flex_attention's main kernel tried for a prefill chunk (``{}``: flex's own defaults for the device).
CHUNK_GRID: list[dict[str, Any]] = [
    {},
    {"USE_TMA": True},
    {"BLOCK_N": 128},
    {"BLOCK_N": 128, "num_stages": 2},
    {"BLOCK_N": 128, "num_stages": 2, "USE_TMA": True},
    {"num_stages": 2},
    {"num_stages": 4},
    {"num_warps": 4},
    {"BLOCK_M": 64},
]


def chunk_layer(budget: int, chunk: int, device: str, scored: bool) -> tuple[Any, torch.Tensor, torch.Tensor]:
    """A heap layer as a fixed-budget stream holds it when a chunk is read: its first ``budget`` slots the kept
    tokens (four sinks and the most recent), the next ``chunk`` the chunk's own, 8 KV heads of 128, bf16; the chunk's
    queries (32 heads) and their positions. H2O's scores accumulate where ``scored``."""
    start = 1 << 20
    kept = torch.cat((torch.arange(4), torch.arange(start - budget + 4, start)))
    positions = torch.cat((kept, torch.arange(start, start + chunk))).to(device=device, dtype=torch.int32)
    slots = budget + chunk
    keys, values = (torch.randn(1, 8, slots, 128, device=device, dtype=torch.bfloat16) for _ in range(2))
    layer = decode_layer(keys, values, positions.expand(1, 8, slots).clone(), scored)
    query = torch.randn(1, 32, chunk, 128, device=device, dtype=torch.bfloat16)
    return layer, query, torch.arange(start, start + chunk, device=device)


@contextlib.contextmanager
def chunk_options(options: dict[str, Any] | None) -> Iterator[None]:
    """Run prefill chunks' flex kernels under ``options`` added to kvlab's
    (:data:`~kvlab.attention.flex_chunks.CHUNK_KERNEL`; ``{}``: as kvlab runs them, with flex's own tiles and
    stages), or as kvlab runs them where ``None``."""
    from kvlab.attention import flex_chunks

    chosen = flex_chunks.CHUNK_KERNEL
    if options is not None:
        flex_chunks.CHUNK_KERNEL = {**chosen, **options}  # type: ignore[typeddict-item]
    try:
        yield
    finally:
        flex_chunks.CHUNK_KERNEL = chosen


def chunk_option_row(
    layer: Any, query: torch.Tensor, query_positions: torch.Tensor, options: dict[str, Any], reference: Any
) -> dict[str, Any]:
    """One layer's chunk attention under ``options`` of flex_attention's main kernel (:func:`chunk_options`):
    microseconds (the median of 20 after warm-up, the block mask built each time as in a run) and its output's
    largest difference from ``reference`` (or why the kernel could not take the options)."""
    from kvlab.attention import flex_chunks

    row: dict[str, Any] = {"scored": layer.scores is not None, "options": options}
    try:
        with chunk_options(options):
            run = partial(flex_chunks.flex_chunk_attention, query, layer, query_positions)
            output = run()
            row["max_diff"] = 0.0 if reference is None else (output.float() - reference.float()).abs().max().item()
            row["us"] = round(event_us(run, warmups=3, repeats=20), 1)
        row["output"] = output
    except Exception as failure:  # an option the kernel cannot take: recorded, not fatal
        row["failed"] = str(failure)[:200]
    print(json.dumps({k: v for k, v in row.items() if k != "output"}), flush=True)
    return row


def part_chunk_configs(device: str) -> dict[str, Any]:
    """One layer's attention over a prefill chunk of 4,096 queries (32 heads) and a kept budget of 4,096 slots, as
    the fixed-budget stream reads it (:func:`chunk_layer`), under each of :data:`CHUNK_GRID`'s options of
    flex_attention's main kernel; then flex's defaults and the fastest options with H2O's second pass."""
    torch._dynamo.config.recompile_limit = 4096
    layer, query, query_positions = chunk_layer(4096, 4096, device, scored=False)
    rows = [chunk_option_row(layer, query, query_positions, {}, None)]
    rows += [chunk_option_row(layer, query, query_positions, o, rows[0].get("output")) for o in CHUNK_GRID[1:]]
    best = min((row for row in rows if "us" in row), key=lambda row: row["us"])
    layer, query, query_positions = chunk_layer(4096, 4096, device, scored=True)
    scored = [chunk_option_row(layer, query, query_positions, {}, None)]
    if best["options"]:
        scored.append(chunk_option_row(layer, query, query_positions, best["options"], scored[0].get("output")))
    return {"rows": [{k: v for k, v in row.items() if k != "output"} for row in rows + scored]}


#: The parts that time kernels alone, each taking only the device.
KERNEL_PARTS: dict[str, Callable[[str], dict[str, Any]]] = {
    "attention": part_attention,
    "backends": part_backends,
    "flex-configs": part_flex_configs,
    "chunk-configs": part_chunk_configs,
    "sums": part_sums,
    "sums-tiles": part_sums_tiles,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parts = ("check", "decode", "prefill", "long", "profile", *KERNEL_PARTS)
    parser.add_argument("--part", choices=parts, required=True)
    parser.add_argument("--policy", default="streaming", help="the policy --part profile profiles")
    parser.add_argument("--contexts", default="8192,32768")
    parser.add_argument("--long-contexts", default="131072,4194304")
    parser.add_argument("--long-chunks", default="4096", help="--part long: the chunk sizes to stream with")
    parser.add_argument("--layers", type=int, default=None, help="fewer layers (for checking the script)")
    parser.add_argument("--hf", action="store_true", help="also time transformers' own generate")
    parser.add_argument("--compiled", action="store_true", help="also transformers' static cache with torch.compile")
    parser.add_argument(
        "--only",
        default=None,
        help="run only these kvlab configurations (labels, '|'-separated; policy names for --part check)",
    )
    parser.add_argument(
        "--attention",
        default="auto",
        help="attention backends to run each kvlab configuration with, side by side (comma-separated: auto, flex, "
        "sdpa; auto is what users get)",
    )
    parser.add_argument("--repeats", type=int, default=2, help="runs per configuration at the same shapes")
    parser.add_argument("--profiled", action="store_true", help="--part prefill: also profile each configuration")
    parser.add_argument(
        "--chunk-options",
        type=json.loads,
        default=None,
        help="--part long: options added to the chunks' flex kernel's, as JSON (as chunk-configs tries them)",
    )
    parser.add_argument("--cpu", action="store_true")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    global REPEATS
    REPEATS = args.repeats
    device = "cpu" if args.cpu else "cuda"
    header = {
        "device": torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "repeats": args.repeats,
    }
    import transformers

    header["transformers"] = transformers.__version__
    print(json.dumps(header), flush=True)
    if args.part == "check":
        policies = args.only.split("|") if args.only is not None else None
        body = part_check(device, policies, args.attention.split(","))
    elif args.part == "decode":
        only = args.only.split("|") if args.only is not None else None
        body = part_decode(
            device,
            [int(c) for c in args.contexts.split(",")],
            args.layers,
            args.hf,
            args.compiled,
            only,
            args.attention.split(","),
        )
    elif args.part in KERNEL_PARTS:
        body = KERNEL_PARTS[args.part](device)
    elif args.part == "prefill":
        only = args.only.split("|") if args.only is not None else None
        body = part_prefill(device, [int(c) for c in args.contexts.split(",")], args.layers, only, args.profiled)
    elif args.part == "profile":
        body = part_profile(device, int(args.contexts.split(",")[0]), args.layers, args.policy)
    else:
        contexts = [int(c) for c in args.long_contexts.split(",")]
        chunks = [int(c) for c in args.long_chunks.split(",")]
        body = part_long(device, contexts, args.layers, chunks, args.chunk_options)
    if args.out is not None:
        args.out.write_text(json.dumps({**header, "part": args.part, **body}, indent=1) + "\n")


if __name__ == "__main__":
    main()
