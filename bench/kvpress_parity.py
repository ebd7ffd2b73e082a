"""Which positions kvlab keeps beside kvpress 0.5.5, per layer and KV head, on the same model and prompts at equal
budgets, in prefill mode (kvpress's presses compress the prefill).

Each kvlab policy is set as close to its press's defaults as it allows (SnapKV: window 64, kernel 5, average
pooling; H2O: ``accumulate=mean``, the smallest recent share; ChunkKV: window 64, chunks of 20) and compresses a fork
of one shared prefill (``kvlab.engine.generation.prefill_once``) to the number of tokens the press keeps
(``kvpress.utils.compute_n_kept``). On the kvpress side the model is the same checkpoint loaded by transformers
alone (SDPA attention; eager for ``ObservedAttentionPress``, which reads the attention weights); a forward hook on
every attention layer hands each press the layer's inputs and its full cache, as kvpress's own hook does, calls the
press's ``compress``, and finds the kept positions by matching the keys it returns bit for bit to the cache's. The
scores each side ranked by are captured too, so that a differing kept set can be told apart as a tie at the cut
(every differing position has one exact score), a token one side keeps by rule (kvlab's infinite score, kvpress's
sinks or window), different numbers of tokens kept (ChunkKV's whole chunks), a float rounding difference (relative
gap below ``ROUNDING``), or another difference, which is listed with its layer, head, positions and both scores.
Checked on the way: the positions a ``ScorerPress`` keeps are the top-k of its scores, and the press run through
its own context manager (``with press(model)``) keeps the positions the direct call finds. KVzip's press ranks all
layers' and KV heads' scores together (``layerwise=False``, its default), as kvlab's KVzip does by default.

kvpress 0.5.5 declares transformers < 5.3; from 5.3 on, an attention layer receives its cache as ``cache`` rather
than ``past_key_values`` and no ``cache_position``, so the press's hook is handed both under kvpress's names (the one
shim, :func:`with_cache_as_past_key_values`).

Usage (kvpress outside kvlab's environment; the shipped model and, if installed, the published one):
    python -m pip install --target /tmp/kvpsite --no-deps kvpress==0.5.5 cachetools==5.5.2 "fire<0.7" six \\
        termcolor datasets dill xxhash multiprocess
    PYTHONPATH=/tmp/kvpsite python bench/kvpress_parity.py \\
        --models kvlab-tiny-llama,SmolLM2-135M-Instruct.Q4_1.gguf --out bench/results/kvpress_parity
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import shlex
import sys
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvlab.policies import POLICIES  # noqa: E402

INSTALL_HINT = (
    "kvpress 0.5.5 is not importable: install it outside kvlab's environment with `python -m pip install --target "
    "/tmp/kvpsite --no-deps kvpress==0.5.5 cachetools==5.5.2 'fire<0.7' six termcolor datasets dill xxhash "
    "multiprocess` and run this script with PYTHONPATH=/tmp/kvpsite."
)
#: Relative gap between the scores of differing positions below which the difference is float rounding (two sums of
#: the same terms in another order), not a different ranking.
ROUNDING = 1e-5
#: Differences listed in full per policy and budget.
EXAMPLES = 5
#: Differing positions shown per listed difference.
SHOWN_POSITIONS = 8


@dataclass(frozen=True)
class Pair:
    """A kvlab policy and the kvpress press it is compared with. ``inner`` is the scorer a ``ChunkKVPress`` wraps.
    ``rule_first``/``rule_last``: how many of the first and last positions the press keeps by rule (sinks, window),
    whatever their scores. ``attention``: the implementation the press needs. ``press_budget``: kvlab is given the
    number of tokens the press kept (:func:`kvlab_budget`)."""

    policy: str
    params: dict[str, Any]
    press: str
    press_params: dict[str, Any] = field(default_factory=dict)
    inner: str | None = None
    rule_first: int = 0
    rule_last: int = 0
    attention: str = "sdpa"
    note: str = ""
    press_budget: bool = False


def kvlab_budget(pair: Pair, budget: int, theirs: Kept) -> int:
    """The budget kvlab's policy gets: the press's (``kvpress.utils.compute_n_kept``), or for a press that keeps
    fewer tokens than that by design (``ChunkKVPress``'s whole chunks: ``press_budget``), the mean number it kept per
    layer and KV head, so that the kept sets compare the ranking and not the rounding."""
    if not pair.press_budget:
        return budget
    counts = [len(head) for layer in theirs.positions for head in layer]
    return round(sum(counts) / len(counts))


PAIRS: tuple[Pair, ...] = (
    Pair("streaming", {"sinks": 4}, "StreamingLLMPress", {"n_sink": 4}, rule_first=4),
    Pair("knorm", {}, "KnormPress"),
    Pair("tova", {}, "TOVAPress", rule_last=1, note="kvpress keeps the last position by rule"),
    Pair(
        "snapkv",
        {"window": 64, "kernel": 5, "pooling": "avg"},
        "SnapKVPress",
        {"window_size": 64, "kernel_size": 5},
        rule_last=64,
    ),
    Pair(
        "h2o",
        {"accumulate": "mean", "recent_ratio": 1e-6},
        "ObservedAttentionPress",
        attention="eager",
        note="kvlab keeps its recent share (here the last position) by rule",
    ),
    Pair("expected_attention", {}, "ExpectedAttentionPress", rule_first=4),
    Pair("keydiff", {}, "KeyDiffPress"),
    Pair(
        "chunkkv",
        {"window": 64, "chunk_length": 20, "kernel": 5},
        "ChunkKVPress",
        {"chunk_length": 20},
        inner="SnapKVPress",
        note="kvlab given the number of tokens the press keeps (whole chunks, fewer than its budget)",
        press_budget=True,
    ),
    Pair(
        "kvzip",
        {},
        "KVzipPress",
        rule_first=4,
        note="both rank all layers' and KV heads' scores together; kvpress's ranking taken at kvlab's total "
        "(layers x KV heads x budget, where kvpress rounds its compression ratio), the chat template's opening kept "
        "whole on both sides (kvlab's rule; kvpress scores it zero beyond its sinks)",
    ),
)


# ---------------------------------------------------------------------------------------------------------------------
# Pure parts: positions from keys, one head's comparison, the summaries and the table.


def kept_positions(full_keys: torch.Tensor, kept_keys: torch.Tensor) -> torch.Tensor:
    """The positions ``(batch, kv_heads, kept)``, increasing, of the rows of ``kept_keys`` ``(batch, kv_heads, kept,
    head_dim)`` in ``full_keys`` ``(batch, kv_heads, tokens, head_dim)``, matched bit for bit: a press gathers the
    rows it keeps, so each is an exact copy of one cached row. Raises ``ValueError`` where two cached rows are equal
    (a match would be ambiguous) or a kept row is in none."""
    batch, heads, tokens, _ = full_keys.shape
    kept = kept_keys.shape[2]
    rows = torch.cat([full_keys, kept_keys], dim=2).contiguous().view(torch.uint8)
    found = torch.empty(batch, heads, kept, dtype=torch.long)
    for b in range(batch):
        for h in range(heads):
            _, ids = torch.unique(rows[b, h], dim=0, return_inverse=True)
            cached, chosen = ids[:tokens], ids[tokens:]
            if int(cached.unique().numel()) != tokens:
                raise ValueError(f"Two cached keys of head {h} are bitwise equal, so kept keys cannot be located.")
            position_of = torch.full((int(ids.max()) + 1,), -1, dtype=torch.long)
            position_of[cached] = torch.arange(tokens)
            located = position_of[chosen]
            if bool((located < 0).any()):
                raise ValueError(f"A kept key of head {h} matches no cached key.")
            found[b, h] = located
    return found.sort(dim=-1).values


def chunk_scores_per_token(scores: torch.Tensor, chunk_length: int) -> torch.Tensor:
    """The score ``ChunkKVPress`` ranks each position's chunk by, ``(batch, tokens)`` from its inner press's scores
    ``(batch, kv_heads, tokens)``: summed over the KV heads, averaged over the chunk (the last, partial chunk over
    its own tokens)."""
    summed = scores.sum(dim=1)
    chunk = torch.arange(summed.shape[-1]) // chunk_length
    totals = torch.zeros(summed.shape[0], int(chunk[-1]) + 1, dtype=summed.dtype).index_add_(1, chunk, summed)
    sizes = torch.bincount(chunk).to(summed.dtype)
    return (totals / sizes)[:, chunk]


@dataclass(frozen=True)
class HeadComparison:
    """One layer and KV head of one prompt at one budget: the kept sets' Jaccard index, the positions only one side
    keeps, and what tells them apart (see :func:`category`)."""

    prompt: int
    layer: int
    head: int
    jaccard: float
    only_kvlab: tuple[int, ...]
    only_kvpress: tuple[int, ...]
    kvlab_scores: tuple[float, ...]
    kvpress_scores: tuple[float, ...]
    category: str
    gap: float


def relative_gap(values: Sequence[float]) -> float:
    """How far apart ``values`` are relative to their size: 0 for equal values, ``inf`` where one is infinite and
    they differ."""
    if len(set(values)) <= 1:
        return 0.0
    if any(abs(value) == float("inf") for value in values):
        return float("inf")
    top = max(abs(value) for value in values)
    return (max(values) - min(values)) / top if top else float("inf")


def compare_head(
    where: tuple[int, int, int],
    kvlab_kept: Sequence[int],
    kvpress_kept: Sequence[int],
    kvlab_scores: Sequence[float],
    kvpress_scores: Sequence[float],
    kvpress_rule: frozenset[int],
) -> HeadComparison:
    """Compare one head's kept sets; the scores are indexed by position, each side's as it ranked them
    (``where`` is ``(prompt, layer, head)``). ``kvpress_rule`` are the positions the press keeps whatever their
    scores; kvlab's are those it scores infinite."""
    ours, theirs = set(kvlab_kept), set(kvpress_kept)
    union = ours | theirs
    only_kvlab, only_kvpress = tuple(sorted(ours - theirs)), tuple(sorted(theirs - ours))
    differing = only_kvlab + only_kvpress
    lab = tuple(float(kvlab_scores[p]) for p in differing)
    press = tuple(float(kvpress_scores[p]) for p in differing)
    ruled = any(s == float("inf") for s in lab) or any(p in kvpress_rule for p in differing)
    same_size = len(only_kvlab) == len(only_kvpress)
    return HeadComparison(
        *where,
        jaccard=len(ours & theirs) / len(union) if union else 1.0,
        only_kvlab=only_kvlab,
        only_kvpress=only_kvpress,
        kvlab_scores=lab,
        kvpress_scores=press,
        category=category(lab, press, ruled, same_size),
        gap=relative_gap(press),
    )


def category(kvlab_scores: Sequence[float], kvpress_scores: Sequence[float], ruled: bool, same_size: bool) -> str:
    """Why the differing positions (their scores on each side) differ: ``identical`` (none differ), ``size`` (the
    sides keep different numbers of tokens, ChunkKV's whole chunks), ``tie`` (they share one exact finite score on
    either side: the tie-break decided), ``rule`` (one side keeps one of them by rule, whatever its score),
    ``rounding`` (kvpress's scores of them are within :data:`ROUNDING` of each other), else ``other``."""
    if not kvpress_scores:
        return "identical"
    if not same_size:
        return "size"
    for scores in (kvpress_scores, kvlab_scores):
        if len(set(scores)) == 1 and abs(scores[0]) != float("inf"):
            return "tie"
    if ruled:
        return "rule"
    return "rounding" if relative_gap(kvpress_scores) < ROUNDING else "other"


CATEGORIES = ("identical", "size", "tie", "rule", "rounding", "other")


def summarise(comparisons: Sequence[HeadComparison]) -> dict[str, Any]:
    """Mean and least Jaccard index over the compared heads, how many fall in each category, the largest relative
    gap of kvpress's scores among differences that are neither ties nor rules, and the first :data:`EXAMPLES`
    differences of each category in full."""
    counts = {name: sum(c.category == name for c in comparisons) for name in CATEGORIES}
    unexplained = [c.gap for c in comparisons if c.category in ("rounding", "other")]
    return {
        "heads": len(comparisons),
        "jaccard_mean": sum(c.jaccard for c in comparisons) / len(comparisons) if comparisons else None,
        "jaccard_min": min((c.jaccard for c in comparisons), default=None),
        "categories": counts,
        "max_gap_rounding_or_other": max(unexplained, default=None),
        "examples": {name: [shown(c) for c in comparisons if c.category == name][:EXAMPLES] for name in CATEGORIES[1:]},
    }


def shown(comparison: HeadComparison) -> dict[str, Any]:
    """A difference as the results list it: where, and the first :data:`SHOWN_POSITIONS` positions of each side with
    both sides' scores (in the order only-kvlab, then only-kvpress)."""
    n_lab = len(comparison.only_kvlab)
    lab_pos, press_pos = comparison.only_kvlab[:SHOWN_POSITIONS], comparison.only_kvpress[:SHOWN_POSITIONS]
    picked = list(range(len(lab_pos))) + [n_lab + i for i in range(len(press_pos))]
    return {
        "prompt": comparison.prompt,
        "layer": comparison.layer,
        "head": comparison.head,
        "jaccard": comparison.jaccard,
        "category": comparison.category,
        "only_kvlab": list(lab_pos),
        "only_kvpress": list(press_pos),
        "differing": len(comparison.only_kvlab) + len(comparison.only_kvpress),
        "kvlab_scores": [comparison.kvlab_scores[i] for i in picked],
        "kvpress_scores": [comparison.kvpress_scores[i] for i in picked],
        "kvpress_gap": comparison.gap,
    }


def markdown_table(results: Sequence[dict[str, Any]]) -> str:
    """One row per model, policy and kept fraction: the heads compared (layers x KV heads x prompts), the share with
    identical kept sets, the mean and least Jaccard index, and how the differing heads split."""
    lines = [
        "| model | kvlab policy | kvpress press | keep | heads | identical | mean Jaccard | min Jaccard | "
        "differing heads: size / tie / rule / rounding / other |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for result in results:
        for pair in result["pairs"]:
            for keep, summary in pair["keeps"].items():
                counts = summary["categories"]
                lines.append(
                    f"| {result['model']} | `{pair['policy']}` {describe(pair['params'])} | `{pair['press']}` | "
                    f"{keep} | {summary['heads']} | {counts['identical'] / summary['heads']:.1%} | "
                    f"{summary['jaccard_mean']:.4f} | {summary['jaccard_min']:.4f} | "
                    f"{' / '.join(str(counts[name]) for name in CATEGORIES[1:])} |"
                )
    return "\n".join(lines) + "\n"


def describe(params: dict[str, Any]) -> str:
    return " ".join(f"{name}={value}" for name, value in params.items())


# ---------------------------------------------------------------------------------------------------------------------
# The runs: prompts, kvlab's kept sets and scores, kvpress's.


@dataclass
class Prompt:
    """A context ``(1, tokens)`` both sides read, and what it is (length, needle, template, budgets) for the results."""

    ids: torch.Tensor
    facts: dict[str, Any]


def needle_prompts(loaded: Any, lengths: Sequence[int], seed: int) -> list[Prompt]:
    """One needle context per length, each with another template, haystack and depth; for a model with a chat
    template, the context as kvlab's chat prompts frame it (the user turn opened by the template)."""
    from kvlab.tasks.facts import TRAIN_TEMPLATES, make_fact
    from kvlab.tasks.items import has_chat_template, prompt_ids
    from kvlab.tasks.needle import build_needle, load_haystacks

    tokenizer = loaded.tokenizer
    haystacks = load_haystacks(tokenizer)
    prompts = []
    for index, length in enumerate(lengths):
        rng = random.Random(f"{seed}/{index}")
        depth = (0.25, 0.5, 0.75)[index % 3]
        template = TRAIN_TEMPLATES[index % len(TRAIN_TEMPLATES)]
        haystack = haystacks[index % len(haystacks)]
        item = build_needle(tokenizer, haystack, length, depth, make_fact(template, rng), rng=rng)
        chat = has_chat_template(tokenizer)
        ids = prompt_ids(tokenizer, item.context, item.question)[0] if chat else item.context_ids
        facts = {
            "requested_length": length,
            "tokens": len(ids),
            "depth": depth,
            "template": template.name,
            "haystack": haystack.name,
            "chat_template": chat,
        }
        prompts.append(Prompt(torch.tensor([ids], dtype=torch.long), facts))
    return prompts


@contextmanager
def captured(owner: Any, name: str, into: list[Any], keep: Callable[[Any, Any], Any]) -> Iterator[None]:
    """``owner.name`` (a bound method) replaced for the block by one that also appends ``keep(args, result)`` to
    ``into``: the scores a policy or press ranked by, as it computed them."""
    original = getattr(owner, name)

    def recording(*args: Any) -> Any:
        result = original(*args)
        into.append(keep(args, result))
        return result

    setattr(owner, name, recording)
    try:
        yield
    finally:
        delattr(owner, name)


@dataclass
class Kept:
    """One side's choice for one prompt at one budget, per layer: the kept positions of each KV head (a ``(kv_heads,
    kept)`` tensor, free entries negative, or one tensor per head where heads keep different numbers) and the scores
    it ranked by, indexed by position ``(kv_heads, tokens)``."""

    positions: list[Any]
    scores: list[torch.Tensor]


def kvlab_side(loaded: Any, prompt: Prompt, pairs: Sequence[Pair], budgets: dict[Any, int]) -> dict[Any, Kept]:
    """kvlab's kept positions and ranked scores for every pair and kept fraction (``budgets`` by policy and kept
    fraction), each compressing a fork of one prefill."""
    from kvlab.budget import Budget
    from kvlab.engine.generation import Generation, prefill_once
    from kvlab.engine.spec import RunSpec
    from kvlab.policies import Variant, make_policy

    policies = {pair.policy: make_policy(pair.policy, **pair.params) for pair in pairs}
    prefilled = prefill_once(loaded, prompt.ids, [Variant.published(policy) for policy in policies.values()])
    tokens = int(prompt.ids.shape[1])
    results: dict[Any, Kept] = {}
    for pair in pairs:
        for (name, keep), budget in budgets.items():
            if name != pair.policy:
                continue
            policy = policies[pair.policy]
            scores: list[torch.Tensor] = []
            spec = RunSpec(policy, Budget(tokens=budget), max_new_tokens=0)
            with captured(policy, "score", scores, lambda args, result: by_position(args[0], result, tokens)):
                events = list(Generation(loaded, spec, prefilled=prefilled).events())
            compressed = next(event for event in events if event.kind == "compress")
            results[pair.policy, keep] = Kept([held[0] for held in compressed.survivors()], scores)
    return results


def by_position(view: Any, scores: torch.Tensor, tokens: int) -> torch.Tensor:
    """A layer's scores ``(kv_heads, tokens)`` by position, from kvlab's by slot (batch 0)."""
    positions = view.positions[0].long()
    held = positions >= 0
    out = torch.full((positions.shape[0], tokens), float("nan"))
    out[held.nonzero(as_tuple=True)[0], positions[held]] = scores[0].float()[held].cpu()
    return out


def make_press(kvpress: Any, pair: Pair, ratio: float) -> Any:
    """The pair's press at ``ratio`` (kvpress's compression ratio: the share of tokens removed)."""
    if pair.inner is not None:
        inner = getattr(kvpress, pair.inner)(compression_ratio=ratio)
        return getattr(kvpress, pair.press)(press=inner, **pair.press_params)
    return getattr(kvpress, pair.press)(compression_ratio=ratio, **pair.press_params)


def scorer_of(press: Any) -> Any:
    """The press whose ``score`` ranks the tokens (a ``ChunkKVPress``'s inner press)."""
    return getattr(press, "press", press)


def with_cache_as_past_key_values(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The attention layer's keyword arguments as kvpress 0.5.5 reads them: from transformers 5.3 on the cache
    argument is ``cache`` and no ``cache_position`` is passed; kvpress reads ``past_key_values`` and tells the prefill
    by ``cache_position`` (the positions of the tokens in the pass, here the position ids)."""
    cache = kwargs.get("past_key_values", kwargs.get("cache"))
    return {
        **kwargs,
        "past_key_values": cache,
        "cache_position": kwargs.get("cache_position", kwargs["position_ids"][0]),
    }


@contextmanager
def kvpress_names(press: Any) -> Iterator[None]:
    """The press's hook handed the attention layer's arguments under kvpress's names for the block (see
    :func:`with_cache_as_past_key_values`); the press's context manager registers ``press.forward_hook``."""
    hook = press.forward_hook
    press.forward_hook = lambda module, args, kwargs, output: hook(
        module, args, with_cache_as_past_key_values(kwargs), output
    )
    try:
        yield
    finally:
        del press.forward_hook


@dataclass
class PressRecord:
    """What one press did to every layer: kept positions ``(kv_heads, kept)`` and the scores it ranked by."""

    positions: list[torch.Tensor] = field(default_factory=list)
    scores: list[torch.Tensor] = field(default_factory=list)
    top_k_agrees: bool = True


def press_pass(model: Any, ids: torch.Tensor, presses: dict[Any, tuple[Pair, Any]], attention: str) -> dict[Any, Any]:
    """One forward pass of ``model`` in which, at every attention layer, each press compresses the layer's full cache
    as its own hook would (``compress`` with the layer's inputs and output), the cache left full for the others."""
    from transformers import DynamicCache

    records = {key: PressRecord() for key in presses}
    model.set_attn_implementation(attention)
    for _, press in presses.values():  # what the press's context manager does before registering its hooks
        press.post_init_from_model(model)
    for layer in model.model.layers:
        layer.self_attn.rotary_emb = model.model.rotary_emb

    def hook(module: Any, args: Any, kwargs: dict[str, Any], output: Any) -> None:
        kwargs = with_cache_as_past_key_values(kwargs)
        layer = kwargs["past_key_values"].layers[module.layer_idx]
        keys, values = layer.keys, layer.values
        for key, (pair, press) in presses.items():
            scores: list[torch.Tensor] = []
            with captured(scorer_of(press), "score", scores, lambda args, result: result.detach().clone()):
                kept_keys, _ = press.compress(module, kwargs["hidden_states"], keys, values, output[1], kwargs)
            positions = kept_positions(keys, kept_keys)[0]
            record = records[key]
            record.positions.append(positions)
            if pair.inner is not None:
                ranked = chunk_scores_per_token(scores[0], pair.press_params["chunk_length"])
                record.scores.append(ranked.expand(keys.shape[1], -1))
            else:
                record.scores.append(scores[0][0])
                top = scores[0][0].topk(positions.shape[-1], dim=-1).indices.sort(dim=-1).values
                record.top_k_agrees &= bool(torch.equal(top, positions))

    hooks = [layer.self_attn.register_forward_hook(hook, with_kwargs=True) for layer in model.model.layers]
    try:
        with torch.inference_mode():
            model.model(input_ids=ids, past_key_values=DynamicCache(config=model.config))
    finally:
        for handle in hooks:
            handle.remove()
    return records


def hook_path_positions(model: Any, ids: torch.Tensor, press: Any, attention: str) -> list[torch.Tensor]:
    """The positions a press keeps run through its own context manager (its hook writing the cache), found by
    matching the compressed cache's keys to a copy of each layer's full keys taken just before the press's hook."""
    from transformers import DynamicCache

    model.set_attn_implementation(attention)
    full: list[torch.Tensor] = []

    def copy_full(module: Any, args: Any, kwargs: dict[str, Any], output: Any) -> None:
        full.append(with_cache_as_past_key_values(kwargs)["past_key_values"].layers[module.layer_idx].keys.clone())

    hooks = [layer.self_attn.register_forward_hook(copy_full, with_kwargs=True) for layer in model.model.layers]
    cache: Any = DynamicCache(config=model.config)
    try:
        with torch.inference_mode(), kvpress_names(press), press(model):
            model.model(input_ids=ids, past_key_values=cache)
    finally:
        for handle in hooks:
            handle.remove()
    return [kept_positions(keys, layer.keys)[0] for keys, layer in zip(full, cache.layers)]


def kvzip_scores(model: Any, ids: torch.Tensor, kvpress: Any, pair: Pair, ratio: float) -> torch.Tensor:
    """``KVzipPress``'s scores ``(layers, kv_heads, tokens)``, its sinks raised above every other score, from its own
    context manager (the prefill, then its reconstruction passes)."""
    from transformers import DynamicCache

    model.set_attn_implementation("sdpa")
    press = make_press(kvpress, pair, ratio)
    scores: list[torch.Tensor] = []
    with captured(press, "compress_post", scores, lambda args, result: press.score_val.detach().clone()):
        with torch.inference_mode(), kvpress_names(press), press(model):
            model.model(input_ids=ids, past_key_values=DynamicCache(config=model.config))
    for layer in model.model.layers:  # the press's head-wise masks, left for decoding, are not wanted here
        layer.self_attn.masked_key_indices = None
    return scores[0][:, 0].float()


def kvzip_kept(scores: torch.Tensor, budget: int, opening: int = 0) -> list[list[torch.Tensor]]:
    """The positions ``KVzipPress.compress_post`` keeps at its default (``layerwise=False``), per layer and KV head,
    when it keeps ``budget`` tokens per layer and KV head in all: the lowest of ``scores`` ``(layers, kv_heads,
    tokens)`` over all layers and heads pruned, so that each head keeps its own number. The first ``opening``
    positions (the chat template's opening, which kvlab keeps whole by design and kvpress scores zero) are raised
    above every score first, as kvpress raises its sinks, so that the comparison is of the ranking."""
    scores = scores.clone()
    scores[..., :opening] = float("inf")
    layers, heads, tokens = scores.shape
    pruned = (-scores.reshape(-1)).topk(layers * heads * (tokens - budget)).indices
    kept = torch.ones(scores.numel(), dtype=torch.bool)
    kept[pruned] = False
    return [[head.nonzero().flatten() for head in layer] for layer in kept.view(scores.shape)]


def kvpress_side(
    model: Any, prompt: Prompt, pairs: Sequence[Pair], budgets: dict[float, int], kvpress: Any
) -> tuple[dict[Any, Kept], dict[str, bool]]:
    """kvpress's kept positions and ranked scores for every pair and budget, and whether each ``ScorerPress``'s kept
    positions are the top-k of its scores."""
    results: dict[Any, Kept] = {}
    checks: dict[str, bool] = {}
    for attention in ("sdpa", "eager"):
        presses = {
            (pair.policy, keep): (pair, make_press(kvpress, pair, 1 - keep))
            for pair in pairs
            if pair.attention == attention and pair.press != "KVzipPress"
            for keep in budgets
        }
        if not presses:
            continue
        for key, record in press_pass(model, prompt.ids, presses, attention).items():
            results[key] = Kept(record.positions, record.scores)
            if presses[key][0].inner is None:
                checks[key[0]] = checks.get(key[0], True) and record.top_k_agrees
    for pair in pairs:
        if pair.press == "KVzipPress":
            scores = kvzip_scores(model, prompt.ids, kvpress, pair, 1 - min(budgets))
            opening = int(prompt.facts.get("kvzip_opening", 0))
            for keep, budget in budgets.items():
                results[pair.policy, keep] = Kept(kvzip_kept(scores, budget, opening), list(scores))
    return results, checks


def rule_positions(pair: Pair, tokens: int) -> frozenset[int]:
    return frozenset(range(min(pair.rule_first, tokens))) | frozenset(range(max(tokens - pair.rule_last, 0), tokens))


def compare(index: int, pair: Pair, tokens: int, ours: Kept, theirs: Kept) -> list[HeadComparison]:
    """Every layer and KV head of one prompt for one pair at one budget."""
    rule = rule_positions(pair, tokens)
    return [
        compare_head(
            (index, layer, head),
            [position for position in ours.positions[layer][head].tolist() if position >= 0],
            theirs.positions[layer][head].tolist(),
            ours.scores[layer][head].tolist(),
            theirs.scores[layer][head].tolist(),
            rule,
        )
        for layer in range(len(ours.positions))
        for head in range(len(ours.positions[layer]))
    ]


def run_model(
    name: str,
    lengths: Sequence[int],
    keeps: Sequence[float],
    pairs: Sequence[Pair],
    seed: int,
    kvpress: Any,
    check_hooks: bool,
) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    from kvlab.budget import kept_tokens
    from kvlab.engine.reconstruction import RepeatRequest, chunks
    from kvlab.models.loading import load_model
    from kvlab.policies.kvzip import KVzip

    loaded = load_model(name, device="cpu", dtype="float32")
    model = AutoModelForCausalLM.from_pretrained(
        loaded.model.config.name_or_path, dtype=torch.float32, attn_implementation="sdpa"
    ).eval()
    prompts = needle_prompts(loaded, lengths, seed)
    comparisons: dict[tuple[str, float], list[HeadComparison]] = {(p.policy, k): [] for p in pairs for k in keeps}
    kept_counts: dict[tuple[str, float], set[int]] = {key: set() for key in comparisons}
    top_k: dict[str, bool] = {}
    hook_checks: dict[str, bool] = {}
    started = time.perf_counter()
    for index, prompt in enumerate(prompts):
        tokens = int(prompt.ids.shape[1])
        request = RepeatRequest.for_tokenizer(loaded.tokenizer)
        prompt.facts["kvzip_opening"] = chunks(prompt.ids, request, KVzip().chunk_size)[0].start
        budgets = {keep: kvpress.utils.compute_n_kept(tokens, 1 - keep) for keep in keeps}
        prompt.facts["budgets"] = {str(keep): budget for keep, budget in budgets.items()}
        prompt.facts["kvlab_keep_budgets"] = {str(keep): kept_tokens(tokens, keep) for keep in keeps}
        theirs, checks = kvpress_side(model, prompt, pairs, budgets, kvpress)
        ours = kvlab_side(
            loaded,
            prompt,
            pairs,
            {(p.policy, k): kvlab_budget(p, b, theirs[p.policy, k]) for p in pairs for k, b in budgets.items()},
        )
        for policy, agrees in checks.items():
            top_k[policy] = top_k.get(policy, True) and agrees
        for pair in pairs:
            for keep in keeps:
                comparisons[pair.policy, keep] += compare(
                    index, pair, tokens, ours[pair.policy, keep], theirs[pair.policy, keep]
                )
                kept_counts[pair.policy, keep] |= {len(h) for p in theirs[pair.policy, keep].positions for h in p}
            if check_hooks and index == 0 and pair.press != "KVzipPress":
                press = make_press(kvpress, pair, 1 - keeps[0])
                by_hook = hook_path_positions(model, prompt.ids, press, pair.attention)
                direct = theirs[pair.policy, keeps[0]].positions
                hook_checks[pair.policy] = all(torch.equal(a, b) for a, b in zip(by_hook, direct))
        print(
            f"{loaded.source.label}: prompt {index + 1}/{len(prompts)} ({tokens} tokens) compared, "
            f"{time.perf_counter() - started:.0f} s",
            flush=True,
        )
    return {
        "model": loaded.source.label,
        "origin": loaded.source.origin,
        "weights_hash": loaded.weights_hash,
        "device": loaded.device_kind,
        "dtype": loaded.dtype_name,
        "threads": torch.get_num_threads(),
        "prompts": [prompt.facts for prompt in prompts],
        "pairs": [
            {
                "policy": pair.policy,
                "params": pair.params,
                "press": pair.press if pair.inner is None else f"{pair.press}({pair.inner}())",
                "press_params": pair.press_params,
                "attention": pair.attention,
                "note": pair.note,
                "press_keeps_top_k_of_its_scores": top_k.get(pair.policy),
                "hook_path_keeps_the_same": hook_checks.get(pair.policy),
                "keeps": {
                    str(keep): {
                        **summarise(comparisons[pair.policy, keep]),
                        "kvpress_kept_per_head": sorted(kept_counts[pair.policy, keep]),
                    }
                    for keep in keeps
                },
            }
            for pair in pairs
        ],
        "seconds": time.perf_counter() - started,
    }


def versions() -> dict[str, str]:
    import transformers

    import kvlab

    return {
        "kvlab": kvlab.__version__,
        "kvpress": metadata.version("kvpress"),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
    }


def import_kvpress() -> Any:
    """kvpress, imported before any kvlab model is loaded: its import wraps every attention function registered so
    far, and loading a kvlab model registers kvlab's own again, unwrapped."""
    try:
        import kvpress
        import kvpress.utils
    except ImportError:
        raise SystemExit(INSTALL_HINT) from None
    return kvpress


def write_table(out: Path) -> None:
    results = [json.loads(path.read_text()) for path in sorted(out.glob("*.json"))]
    header = ["# kvlab against kvpress: kept positions per layer and KV head", ""]
    for result in results:
        v = result["versions"]
        header.append(
            f"- {result['model']} ({result['origin']}): {result['device']}, {result['dtype']}, "
            f"{len(result['prompts'])} needle prompts of {', '.join(str(p['tokens']) for p in result['prompts'])} "
            f"tokens; kvlab {v['kvlab']}, kvpress {v['kvpress']}, torch {v['torch']}, transformers "
            f"{v['transformers']}; `{result['command']}`"
        )
    header += [
        "",
        "Categories of a differing head: `size` the sides keep different numbers of tokens; "
        "`tie` every differing position has one exact score on one side; "
        "`rule` one side keeps one of them by rule (kvlab's infinite score, kvpress's sinks or window); "
        f"`rounding` kvpress's scores of them within a relative {ROUNDING:g}; `other` none of these.",
        "",
    ]
    (out / "table.md").write_text("\n".join(header) + "\n" + markdown_table(results))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="kvlab-tiny-llama", help="comma-separated model names (kvlab models)")
    parser.add_argument("--lengths", default="1024,1536,2048", help="needle context lengths, one prompt each")
    parser.add_argument("--keeps", default="0.25,0.5", help="kept fractions")
    parser.add_argument(
        "--policies",
        default=",".join(pair.policy for pair in PAIRS),
        help="kvlab policies to compare (those not registered are left out)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--no-hook-check",
        action="store_true",
        help="skip running each press through its own context manager on the first prompt",
    )
    parser.add_argument("--out", default="bench/results/kvpress_parity", help="directory for <model>.json, table.md")
    args = parser.parse_args()
    kvpress = import_kvpress()
    # kvpress's KVzip reads the cache from the model's forward under its old name, which transformers still accepts
    warnings.filterwarnings("ignore", message=".*past_key_values.* is deprecated", category=FutureWarning)
    wanted = args.policies.split(",")
    pairs = [pair for pair in PAIRS if pair.policy in wanted and pair.policy in POLICIES]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name in args.models.split(","):
        result = run_model(
            name,
            [int(n) for n in args.lengths.split(",")],
            [float(k) for k in args.keeps.split(",")],
            pairs,
            args.seed,
            kvpress,
            not args.no_hook_check,
        )
        result["versions"] = versions()
        result["command"] = "PYTHONPATH=/tmp/kvpsite python " + shlex.join(["bench/kvpress_parity.py", *sys.argv[1:]])
        (out / f"{result['model']}.json").write_text(json.dumps(result, indent=1) + "\n")
        write_table(out)


if __name__ == "__main__":
    main()
