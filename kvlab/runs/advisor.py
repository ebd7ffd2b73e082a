"""The policy advisor: the cheapest stored configurations whose accuracy stays above a floor relative to the full
cache, priced for a model preset on a GPU.

What transfers, and how each figure is labelled:

- **Accuracy** comes from the stored runs of one stored model (the *evidence*): the model with runs of the chosen
  benchmark at the context nearest the one asked for. A preset such as Llama-3-8B has no runs of its own, so its
  accuracy is that evidence's, at that evidence's context, and the advice says which model and context it is.
  Each configuration's accuracy over the full cache's (same model, task and context) is its *relative accuracy*;
  its 95 % interval is the configuration's interval over the full cache's point value, and McNemar's test pairs it
  with the full cache item by item (:func:`kvlab.runs.tables.paired_test`).
- **Bytes** are measured on the evidence (mean KV bytes held at the end of a trial); the configuration's share of the
  full cache's measured bytes is taken as the kept share of the preset, whose bytes are then computed by the cost
  model (:func:`kvlab.costs.estimate`), labelled computed.
- **Decode and prefill times** are measured where a GPU benchmark measured this preset's shape, this configuration
  and this context on the chosen GPU (:mod:`kvlab.costs.measured`, with the device named); otherwise computed by
  the cost model and labelled so. Prices follow from whichever times are shown.

When the evidence is not at the asked context, or there is none, the advice says so with the ``kvlab sweep``
command that would produce it and that sweep's estimated time.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace

import pandas as pd

from kvlab.claims.options import params_of, precision_tier
from kvlab.costs import GPU_PRESETS, MODEL_PRESETS, Scenario, estimate
from kvlab.costs.measured import BENCHMARK_LABELS, COMPUTED, MeasuredDecode, measured_times, with_measured_times
from kvlab.errors import KvlabError
from kvlab.models.arch import arch_from_config
from kvlab.models.catalog import SHIPPED_MODELS_DIR
from kvlab.policies import POLICIES, is_full_cache
from kvlab.runs.benchmarks import BENCHMARKS, NEEDLE_DEPTHS, PERPLEXITY, Benchmark
from kvlab.runs.estimate import Speed, SweepWork, estimate_sentence, speed_from_trials
from kvlab.runs.relative_scores import full_score, relative_score, scored_count
from kvlab.runs.tables import budget_label, present, run_label
from kvlab.tasks.ruler import RULER_TASKS
from kvlab.units import format_bytes

#: Items per needle depth (per RULER task; texts for perplexity) a suggested sweep asks for.
SWEEP_TRIALS = {"needle": 20, "ruler": 10, "perplexity": 1}
#: The trial and run columns the advice reads (a stored frame has some sixty; copying the others slows it down).
TRIAL_COLUMNS = [
    "run_id",
    "model",
    "task",
    "context_length",
    "device",
    "policy",
    "policy_params",
    "mode",
    "keep",
    "budget_tokens",
    "layout",
    "item_hash",
    "correct",
    "recall",
    "kv_bytes",
    "context_tokens",
    "prefill_s",
    "decode_s",
    "nll",
    "scored_tokens",
]
#: The columns that tell one stored configuration from another.
CONFIG_KEYS = ["policy", "policy_params", "mode", "keep", "budget_tokens", "layout"]


@dataclass(frozen=True)
class AdviceRequest:
    """What the advice is for: a cost preset ``model`` on ``gpu_count`` GPUs of the preset ``gpu``, prompts of
    ``context`` tokens answered in ``output_tokens``, ``batch`` at a time, and the least relative accuracy
    (``floor``, in (0, 1]) on ``benchmark``; ``evidence_model`` picks the stored model whose runs stand for it
    (None: :func:`choose_evidence` picks)."""

    model: str
    gpu: str
    context: int
    floor: float
    benchmark: Benchmark = "needle"
    gpu_count: int = 1
    output_tokens: int = 256
    batch: int = 1
    evidence_model: str | None = None

    def __post_init__(self) -> None:
        if self.model not in MODEL_PRESETS:
            raise KvlabError(f"Unknown model preset {self.model!r}; use one of {', '.join(MODEL_PRESETS)}.")
        if self.gpu not in GPU_PRESETS:
            raise KvlabError(f"Unknown GPU preset {self.gpu!r}; use one of {', '.join(GPU_PRESETS)}.")
        if self.benchmark not in BENCHMARKS:
            raise KvlabError(f"The floor is judged on one of {', '.join(BENCHMARKS)}, not {self.benchmark!r}.")
        if not (math.isfinite(self.floor) and 0.0 < self.floor <= 1.0):
            raise KvlabError("The accuracy floor is a share of the full cache's accuracy, above 0 and at most 1.")
        if self.context < 1:
            raise KvlabError("The context must be at least one token.")


@dataclass(frozen=True)
class Evidence:
    """The stored runs the accuracy comes from: one model, one task, one context, on the device they ran on, and the
    full cache's score there (its share of right answers, or its perplexity) over ``full_trials`` trials."""

    model: str
    task: str
    context: int
    device: str
    full_score: float
    full_trials: int


@dataclass(frozen=True)
class Advice:
    """The advice: the configurations that meet the floor, cheapest first (``ranked``), those below it
    (``below``), the ``evidence`` they rest on (None when the store holds none), and sentences on what is missing."""

    request: AdviceRequest
    evidence: Evidence | None
    ranked: pd.DataFrame
    below: pd.DataFrame
    missing: tuple[str, ...]


#: The columns of :attr:`Advice.ranked` and :attr:`Advice.below`.
COLUMNS = [
    "rank",
    "policy",
    "parameters",
    "budget",
    "layout",
    "precision",
    "relative accuracy",
    "relative 95% CI low",
    "relative 95% CI high",
    "accuracy",
    "trials",
    "vs full cache (McNemar p)",
    "paired reading",
    "KV bytes measured (evidence)",
    "KV bytes per sequence (model, computed)",
    "decode ms per token",
    "decode source",
    "prefill s",
    "cost per query ($)",
    "cost per query, computed ($)",
    "fits",
]


def of_task(trials: pd.DataFrame, task: str) -> pd.Series:
    """Which trials are of ``task``: its own name, or its family before a ``:`` (``quality:<text>``), as a boolean
    mask."""
    return trials["task"].astype(str).str.split(":").str[0] == task


def _full_cache(frame: pd.DataFrame) -> pd.Series:
    """Which rows are of the full cache, as a boolean mask (also of an empty frame)."""
    return frame["policy"].map(is_full_cache).astype(bool)


def _default_params(policy: str, params: dict) -> bool:
    cls = POLICIES.get(policy)
    return cls is not None and all(cls().params().get(key) == value for key, value in params.items())


def _budget(config: pd.Series) -> str:
    """:func:`~kvlab.runs.tables.budget_label`, except that an evicting run with neither a kept share nor a token
    budget (ablations that drop what their parameters name) says so instead of "full cache"."""
    if not is_full_cache(config["policy"]) and not (present(config["keep"]) or present(config["budget_tokens"])):
        return "set by its parameters"
    return budget_label(config["keep"], config["budget_tokens"])


def choose_evidence(
    trials: pd.DataFrame, benchmark: Benchmark, context: int, model: str | None = None
) -> tuple[str, int] | None:
    """The (model, context) whose stored runs of ``benchmark`` stand for the advice: among those with a full-cache
    run (of ``model`` only, when given), the context nearest ``context`` (the longer on a tie), then the model with
    the most trials. None when the store holds no such runs."""
    task, _ = BENCHMARKS[benchmark]
    runs = trials[of_task(trials, task)]
    if model is not None:
        runs = runs[runs["model"] == model]
    with_full = runs[_full_cache(runs)][["model", "context_length"]].drop_duplicates()
    if with_full.empty:
        return None
    counts = runs.groupby(["model", "context_length"]).size()
    best = min(
        with_full.itertuples(index=False),
        key=lambda row: (abs(int(row.context_length) - context), -int(row.context_length), -counts[tuple(row)]),
    )
    return str(best.model), int(best.context_length)


def benchmark_configuration(config: pd.Series) -> str | None:
    """The GPU benchmark's label for a stored configuration it measured (:data:`kvlab.costs.measured.SHOWN`): the
    full cache, or a policy and mode it ran with the policy's default parameters in bf16; None for any other."""
    if is_full_cache(config["policy"]):
        return "full"
    if not _default_params(config["policy"], params_of(config["policy_params"])):
        return None
    return BENCHMARK_LABELS.get((config["policy"], config["mode"]))


def _config_row(
    request: AdviceRequest,
    config: pd.Series,
    config_trials: pd.DataFrame,
    full_trials: pd.DataFrame,
    evidence: Evidence,
    metric: str,
    measured: MeasuredDecode | None,
) -> dict:
    score = relative_score(config_trials, full_trials, evidence.full_score, metric)
    full_bytes = float(full_trials["kv_bytes"].mean())
    kv_bytes = float(config_trials["kv_bytes"].mean())
    share = kv_bytes / full_bytes if full_bytes > 0 else 1.0
    model, gpu = MODEL_PRESETS[request.model], GPU_PRESETS[request.gpu]
    scenario = Scenario(
        prompt_tokens=request.context,
        output_tokens=request.output_tokens,
        batch=request.batch,
        keep_fraction=min(max(share, 1e-6), 1.0),
        gpu_count=request.gpu_count,
    )
    priced = estimate(model, gpu, scenario)
    label = benchmark_configuration(config)
    stored_keep = 1.0 if not present(config["keep"]) else float(config["keep"])
    times = None
    if label is not None:
        times = measured_times(
            measured, request.model, request.gpu, replace(scenario, keep_fraction=stored_keep), label
        )
    source, computed_cost = COMPUTED, priced.cost_per_query
    if times is not None and priced.fits:
        priced = with_measured_times(priced, times, scenario, gpu.price_per_hour)
        source = times.label + ("" if times.prefill_s is not None else "; prefill computed")
    decode_s, prefill_s, query_cost = priced.decode_step_seconds, priced.prefill_seconds, priced.cost_per_query
    p_value, reading = (score.p_value, score.reading) if not is_full_cache(config["policy"]) else ("—", "the reference")
    return {
        "policy": config["policy"],
        "parameters": run_label(config["policy"], config["mode"], params=config["policy_params"] or None).replace(
            " · full cache", ""
        ),
        "budget": _budget(config),
        "layout": config["layout"] if pd.notna(config["layout"]) else "compact",
        "precision": precision_tier(config["policy_params"]),
        "relative accuracy": score.relative,
        "relative 95% CI low": score.low,
        "relative 95% CI high": score.high,
        "accuracy": score.score,
        "trials": score.count,
        "vs full cache (McNemar p)": p_value,
        "paired reading": reading,
        "KV bytes measured (evidence)": kv_bytes,
        "KV bytes per sequence (model, computed)": priced.kv_bytes_per_sequence,
        "decode ms per token": None if decode_s is None else 1000.0 * decode_s,
        "decode source": source if priced.fits else "does not fit",
        "prefill s": prefill_s,
        "cost per query ($)": query_cost,
        "cost per query, computed ($)": computed_cost,
        "fits": priced.fits,
    }


def sweep_command(request: AdviceRequest, evidence_model: str, policies: list[str], keeps: list[float]) -> str:
    """The ``kvlab sweep`` that would measure the benchmark at the asked context on the evidence model: the full
    cache (which a sweep runs once) and ``policies`` (evicting ones) at every kept fraction of ``keeps``; for
    perplexity, which ``kvlab quality`` measures one configuration at a time, the full cache's command and the
    first configuration's."""
    task, metric = BENCHMARKS[request.benchmark]
    if metric == PERPLEXITY:
        quality = f"kvlab quality --model {evidence_model} --tokens {request.context}"
        return f"{quality} --policy full` and `{quality} --policy {policies[0]} --keep {keeps[0]:g}` (and so on)"
    parts = [
        "kvlab sweep",
        f"--model {evidence_model}",
        f"--task {task}",
        f"--policies {','.join(['full', *policies])}",
        f"--keep {','.join(f'{keep:g}' for keep in keeps)}",
        f"--contexts {request.context}",
        f"--trials {SWEEP_TRIALS[request.benchmark]}",
    ]
    return " ".join(parts)


def sweep_work(request: AdviceRequest, policies: list[str], keeps: list[float]) -> SweepWork:
    """The size of :func:`sweep_command`'s sweep in a fresh store: every policy at every kept fraction plus the
    full cache once, over the trial slots of one context; prefill-mode policies share each context's reading."""
    slots = {"needle": len(NEEDLE_DEPTHS.split(",")), "ruler": len(RULER_TASKS)}.get(request.benchmark, 1)
    per_cell = SWEEP_TRIALS[request.benchmark] * slots
    cells = len(policies) * len(keeps) + 1
    return SweepWork(trials=cells * per_cell, stored=0, read_tokens=request.context * per_cell)


def shipped_positions(model: str) -> int | None:
    """The positions a model kvlab ships was made for (its ``config.json``'s ``max_position_embeddings``); None for
    any other model, whose reach the store does not record (a sweep checks it when it starts)."""
    config = SHIPPED_MODELS_DIR / model / "config.json"
    if not config.is_file():
        return None
    return arch_from_config(json.loads(config.read_text(encoding="utf-8")), derive=False).max_positions


def missing_sentence(request: AdviceRequest, command: str, work: SweepWork, speed: Speed | None, device: str) -> str:
    """What the store lacks to judge the floor at the asked context, the sweep that would add it and its time (not
    estimated for perplexity, which no sweep measures)."""
    task, metric = BENCHMARKS[request.benchmark]
    time = "its time is not estimated here." if metric == PERPLEXITY else estimate_sentence(work, speed, device)
    return (
        f"The store holds no {task} runs at {request.context:,} tokens, so the floor cannot be judged there; "
        f"`{command}` would measure it: {time}"
    )


def advise(request: AdviceRequest, trials: pd.DataFrame, measured: MeasuredDecode | None = None) -> Advice:
    """The advice for ``request`` from stored ``trials`` (``Store.trials_frame``: trials with their runs' columns)
    and the GPU benchmark's ``measured`` decode figures (None: every time is computed)."""
    task, metric = BENCHMARKS[request.benchmark]
    stored_models = sorted(trials.loc[of_task(trials, task), "model"].unique().tolist())
    if request.evidence_model is not None and stored_models and request.evidence_model not in stored_models:
        raise KvlabError(
            f"The store holds no {task} runs of {request.evidence_model!r}; it holds runs of "
            f"{', '.join(stored_models)}."
        )
    chosen = choose_evidence(trials, request.benchmark, request.context, request.evidence_model)
    empty = pd.DataFrame(columns=COLUMNS)
    if chosen is None:
        policies, keeps = ["streaming", "h2o", "snapkv"], [0.1, 0.25, 0.5]
        command = sweep_command(request, request.evidence_model or "<model>", policies, keeps)
        sentence = missing_sentence(request, command, sweep_work(request, policies, keeps), None, "the device")
        return Advice(request, None, empty, empty, (sentence,))
    model, context = chosen
    here = trials[of_task(trials, task) & (trials["model"] == model) & (trials["context_length"] == context)]
    here = here[[column for column in TRIAL_COLUMNS if column in here]]
    full_trials = here[_full_cache(here)]
    devices = here["device"].dropna()
    device = str(devices.mode().iloc[0]) if not devices.empty else "an unrecorded device"
    evidence = Evidence(model, task, context, device, *full_score(full_trials, metric))
    rows = []
    keyed = here.assign(policy_params=here["policy_params"].fillna(""), layout=here["layout"].fillna("compact"))
    for key, config_trials in keyed.groupby(CONFIG_KEYS, dropna=False, sort=False):
        config = pd.Series(dict(zip(CONFIG_KEYS, key)))
        if scored_count(config_trials, metric) == 0:
            continue
        rows.append(_config_row(request, config, config_trials, full_trials, evidence, metric, measured))
    table = pd.DataFrame(rows, columns=COLUMNS[1:])
    meets = table["fits"] & (table["relative accuracy"] >= request.floor)
    ranked = table[meets].sort_values(["cost per query, computed ($)", "KV bytes measured (evidence)"], kind="stable")
    ranked.insert(0, "rank", range(1, len(ranked) + 1))
    below = table[~meets].sort_values("relative accuracy", ascending=False, kind="stable")
    below.insert(0, "rank", None)
    missing: list[str] = []
    if context != request.context:
        evicting = here[~_full_cache(here) & here["keep"].notna()]
        policies = sorted(evicting["policy"].unique().tolist()) or ["streaming"]
        keeps = sorted(float(keep) for keep in evicting["keep"].unique() if float(keep) < 1.0) or [0.1]
        work = sweep_work(request, policies, keeps)
        speed = speed_from_trials(here, f"{task} trials of {model} on {device}")
        reach = shipped_positions(model)
        if reach is not None and reach < request.context:  # the sweep would be refused on this model
            command = sweep_command(request, f"<a model reaching {request.context:,} tokens>", policies, keeps)
            missing.append(
                f"{missing_sentence(request, command, work, speed, device)} {model} reaches only {reach:,} "
                f"positions, so another model must run it, and a model that reaches that far is larger and slower "
                f"than this estimate."
            )
        else:
            command = sweep_command(request, model, policies, keeps)
            missing.append(missing_sentence(request, command, work, speed, device))
    if ranked.empty:
        missing.append(
            f"No stored configuration of {model} at {context:,} tokens keeps {request.floor:.0%} of the full cache's "
            f"{task} score on a configuration that fits {request.gpu_count} × {request.gpu}."
        )
    return Advice(request, evidence, ranked.reset_index(drop=True), below.reset_index(drop=True), tuple(missing))


def evidence_sentence(advice: Advice) -> str:
    """Where the accuracies come from and what was transferred, in one paragraph."""
    evidence, request = advice.evidence, advice.request
    if evidence is None:
        return "The store holds no runs to judge the floor on."
    at = "the asked context" if evidence.context == request.context else f"not at {request.context:,}"
    if BENCHMARKS[request.benchmark][1] == PERPLEXITY:
        texts = f"{evidence.full_trials:,} text{'s' if evidence.full_trials != 1 else ''}"
        full = f"perplexity {evidence.full_score:.2f} over {texts}; relative is its perplexity over the configuration's"
    else:
        full = f"{evidence.full_score:.1%} over {evidence.full_trials:,} trials"
    return (
        f"Accuracy: stored {evidence.task} runs of {evidence.model} at {evidence.context:,} tokens ({at}) on "
        f"{evidence.device}, relative to its full cache ({full}); {request.model} has no runs of its own, so its "
        f"accuracy is taken to be this model's. Bytes: "
        f"measured on {evidence.model}; each configuration's share of its full cache is applied to {request.model} "
        f"by the cost model (computed). Decode time and price: measured where a GPU benchmark of {request.model}'s "
        f"shape ran this configuration at {request.context:,} tokens on {request.gpu}, computed from the datasheet "
        f"otherwise; the decode source column says which. The ranking is by the computed cost per query, so that "
        f"every configuration is priced alike; the cost shown follows the decode time shown."
    )


def _percent(value: float) -> str:
    return "—" if not present(value) or math.isnan(value) else f"{100 * value:.0f}%"


def shown_advice(table: pd.DataFrame) -> pd.DataFrame:
    """:attr:`Advice.ranked` (or :attr:`Advice.below`) as text for reading: relative accuracy with its interval,
    bytes in binary units, the decode time with its source (measured, with the device, or computed), dollars."""
    rows = [
        {
            "rank": "" if not present(row["rank"]) else str(int(row["rank"])),
            "configuration": row["parameters"]
            if row["budget"] == "full cache"
            else f"{row['parameters']} · {row['budget']}",
            "layout": row["layout"],
            "precision": row["precision"],
            "relative accuracy (95% CI)": f"{_percent(row['relative accuracy'])} "
            f"({_percent(row['relative 95% CI low'])}–{_percent(row['relative 95% CI high'])})",
            "trials": str(int(row["trials"])),
            "vs full cache": row["paired reading"]
            if row["vs full cache (McNemar p)"] == "—"
            else f"McNemar p {row['vs full cache (McNemar p)']}: {row['paired reading']}",
            "KV measured (evidence)": format_bytes(row["KV bytes measured (evidence)"]),
            "KV per sequence (computed)": format_bytes(row["KV bytes per sequence (model, computed)"]),
            "decode ms/token": "—" if not present(row["decode ms per token"]) else f"{row['decode ms per token']:.2f}",
            "decode source": row["decode source"],
            "cost per query": "—" if not present(row["cost per query ($)"]) else f"${row['cost per query ($)']:.4g}",
        }
        for _, row in table.iterrows()
    ]
    return pd.DataFrame(rows, columns=SHOWN_COLUMNS)


#: The columns of :func:`shown_advice`: what decides first (accuracy against the floor, price, time and where it
#: came from), then the bytes, the paired test and what the configuration holds.
SHOWN_COLUMNS = [
    "rank",
    "configuration",
    "relative accuracy (95% CI)",
    "cost per query",
    "decode ms/token",
    "decode source",
    "KV per sequence (computed)",
    "KV measured (evidence)",
    "vs full cache",
    "trials",
    "precision",
    "layout",
]


def advice_title(request: AdviceRequest) -> str:
    """What the advice answers, in one line."""
    return (
        f"Cheapest configurations keeping {request.floor:.0%} of the full cache's {request.benchmark} score, for "
        f"{request.model} on {request.gpu_count} × {request.gpu} at {request.context:,} + {request.output_tokens:,} "
        f"tokens, batch {request.batch}"
    )


def evidence_runs(advice: Advice, trials: pd.DataFrame) -> pd.DataFrame:
    """The runs the advice rests on, one row each (for where they came from)."""
    evidence = advice.evidence
    if evidence is None:
        return trials.iloc[0:0].drop_duplicates("run_id")
    here = trials[
        of_task(trials, evidence.task)
        & (trials["model"] == evidence.model)
        & (trials["context_length"] == evidence.context)
    ]
    return here.drop_duplicates("run_id")
