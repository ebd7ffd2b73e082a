"""Measuring a trained model: needle retrieval with the full cache, perplexity, and its attention profile.

Retrieval is plain greedy decoding with Hugging Face ``generate`` (full cache, no eviction) on the held-out
haystacks, scored by exact match of the first generated line. Items of one length share a length, so they are batched
without padding. Perplexity is measured on the corpus's hold-out files and on the haystacks. The attention profile
runs the eager attention on haystack windows and reports, per layer, the attention mass on the first token (the
sink), on the previous token, the entropy of the attention rows, and how concentrated the rest is on a few keys
(heavy hitters); ``python -m training attention`` re-measures it alone.
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from kvlab.tasks.facts import HELD_OUT_TEMPLATES, TRAIN_TEMPLATES
from kvlab.tasks.needle import Haystack, Kind, NeedleItem, load_haystacks, needle_suite, score

LENGTHS = (1024, 2048, 4096)
DEPTHS = tuple(round(float(d), 2) for d in np.linspace(0.0, 1.0, 11))


def load(model_dir: Path, device: torch.device, attn: str = "sdpa") -> tuple[Any, Any]:
    """The model in float32 (as kvlab runs it on a CPU) and its tokenizer, offline."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation=attn)
    return model.to(device).eval(), AutoTokenizer.from_pretrained(model_dir)


@torch.no_grad()
def answer(model: Any, tokenizer: Any, items: Sequence[NeedleItem], max_new_tokens: int = 32) -> list[str]:
    """Greedy continuations of items that all have the same prompt length, in one batch."""
    ids = torch.tensor([list(i.context_ids) + list(i.question_ids) for i in items], device=model.device)
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=tokenizer.pad_token_id,
    )
    return tokenizer.batch_decode(out[:, ids.shape[1] :], skip_special_tokens=True)


def run_needles(model: Any, tokenizer: Any, items: Sequence[NeedleItem], batch: int) -> list[dict[str, Any]]:
    """Every item answered and scored, as JSON-ready rows (batches hold items of one length)."""
    by_length: dict[int, list[NeedleItem]] = defaultdict(list)
    for item in items:
        by_length[item.context_tokens].append(item)
    chunks = [group[i : i + batch] for group in by_length.values() for i in range(0, len(group), batch)]
    rows = []
    for chunk in chunks:
        for item, text in zip(chunk, answer(model, tokenizer, chunk)):
            s = score(text, item.answer)
            rows.append(
                {
                    "length": item.context_tokens,
                    "depth": item.requested_depth,
                    "actual_depth": item.depth,
                    "template": item.template,
                    "kind": item.kind,
                    "haystack": item.haystack,
                    "answer": item.answer,
                    "output": text.split("\n", 1)[0],
                    "exact": s.exact,
                    "contains": s.contains,
                }
            )
    return rows


def table(rows: Sequence[dict[str, Any]], by: str) -> dict[str, dict[str, float]]:
    """Exact-match and contains accuracy with item counts, grouped by one column."""
    groups: dict[Any, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        groups[r[by]].append(r)
    return {
        str(k): {
            "n": len(v),
            "exact": float(np.mean([r["exact"] for r in v])),
            "contains": float(np.mean([r["contains"] for r in v])),
        }
        for k, v in sorted(groups.items())
    }


@torch.no_grad()
def perplexity(model: Any, tokens: np.ndarray, bos: int, window: int, windows: int) -> dict[str, float]:
    """Token-level perplexity over ``windows`` evenly spaced windows of ``window`` tokens (BOS first)."""
    starts = np.linspace(0, len(tokens) - window, windows).astype(int)
    nll, count = 0.0, 0
    for s in starts:
        ids = torch.tensor([[bos, *tokens[s : s + window - 1].tolist()]], device=model.device)
        logits = model(input_ids=ids).logits[0, :-1].float()
        nll += torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="sum").item()
        count += ids.shape[1] - 1
    return {"perplexity": float(np.exp(nll / count)), "tokens": count, "window": window}


@torch.no_grad()
def attention_profile(model: Any, haystacks: Sequence[Haystack], bos: int, window: int) -> dict[str, Any]:
    """Where attention goes, on one window per haystack, with the model's eager attention.

    Per layer, averaged over heads, query positions 1 onwards and windows: the mass on the first token (the sink),
    on the previous token and on the 8 tokens before the query, the row entropy in nats, the share of the mass not on
    the first token that the top 1% of keys (by total attention received) take (heavy hitters; compare the share
    under uniform causal attention, which is not 1% because early keys are seen by more queries), and the fraction
    of windows in which the first token is the key that receives the most attention. Per head: the first-token mass.
    """
    rows: dict[str, list[list[float]]] = defaultdict(list)
    for hay in haystacks:
        ids = torch.tensor([[bos, *hay.ids[: window - 1].tolist()]], device=model.device)
        layers: dict[str, list[Any]] = defaultdict(list)
        for att in model(input_ids=ids, output_attentions=True).attentions:
            a = att[0, :, 1:, :].float()
            queries = torch.arange(a.shape[1], device=a.device)
            layers["first_token_mass_per_head"].append(a[:, :, 0].mean(dim=1).tolist())
            layers["first_token_mass"].append(a[:, :, 0].mean().item())
            layers["previous_token_mass"].append(a[:, queries, queries].mean().item())
            offsets = queries[:, None] + 1 - torch.arange(a.shape[2], device=a.device)[None, :]
            layers["recent8_mass"].append((a * ((offsets >= 1) & (offsets <= 8))).sum(-1).mean().item())
            layers["entropy_nats"].append((-(a * a.clamp_min(1e-12).log()).sum(-1)).mean().item())
            received = a.sum(dim=1)
            rest = received[:, 1:]
            top = rest.topk(max(1, rest.shape[-1] // 100), dim=-1).values.sum(-1) / rest.sum(-1).clamp_min(1e-12)
            layers["top1pct_keys_share"].append(top.mean().item())
            layers["first_token_is_top_key"].append(float(received.mean(0).argmax().item() == 0))
        for name, values in layers.items():
            rows[name].append(values)
    uniform = torch.tril(torch.ones(window, window)) / torch.arange(1, window + 1)[:, None]
    received = uniform[1:, 1:].sum(0)
    profile: dict[str, Any] = {
        "window": window,
        "haystacks": [h.name for h in haystacks],
        "uniform_entropy_nats": float(np.mean(np.log(np.arange(2, window + 1)))),
        "uniform_top1pct_keys_share": float(received.topk(max(1, len(received) // 100)).values.sum() / received.sum()),
    }
    profile.update({name: np.mean(values, axis=0).tolist() for name, values in rows.items()})
    return profile


def measure_attention(model_dir: Path) -> dict[str, Any]:
    """The attention profile alone (cheap enough for a CPU), written into ``model_dir/eval.json``."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model, tokenizer = load(model_dir, device, attn="eager")
    profile = attention_profile(model, load_haystacks(tokenizer), tokenizer.bos_token_id, 1024)
    profile["device"] = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    path = model_dir / "eval.json"
    report = json.loads(path.read_text()) if path.exists() else {}
    report["attention"] = profile
    path.write_text(json.dumps(report, indent=2))
    return profile


def evaluate(
    model_dir: Path, workdir: Path | None, *, per_depth: int, variant_per_depth: int, batch: int, seed: int = 1234
) -> dict[str, Any]:
    """Run every measurement and return the JSON-ready report (also written to ``model_dir/eval.json``)."""
    started = time.perf_counter()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model, tokenizer = load(model_dir, device)
    haystacks = load_haystacks(tokenizer)
    bos = tokenizer.bos_token_id
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "lengths": list(LENGTHS),
        "depths": list(DEPTHS),
        "decoding": "greedy, full cache",
    }
    suites: dict[str, tuple[Sequence[Any], Kind, int]] = {
        "train_templates": (TRAIN_TEMPLATES, "single", per_depth),
        "held_out_templates": (HELD_OUT_TEMPLATES, "single", per_depth),
        "multi_key": (TRAIN_TEMPLATES, "multi-key", variant_per_depth),
        "multi_value": (TRAIN_TEMPLATES, "multi-value", variant_per_depth),
    }
    for offset, (name, (templates, kind, n)) in enumerate(suites.items()):
        items = needle_suite(
            tokenizer, haystacks, templates, lengths=LENGTHS, depths=DEPTHS, per_depth=n, seed=seed + offset, kind=kind
        )
        assert all(i.context_tokens in LENGTHS for i in items)
        rows = run_needles(model, tokenizer, items, batch)
        report[name] = {
            "by_length": table(rows, "length"),
            "by_depth": table(rows, "depth"),
            "by_template": table(rows, "template"),
            "overall": table(rows, "kind"),
            "failures": [r for r in rows if not r["exact"]][:20],
        }
        print(name, json.dumps(report[name]["by_length"]), flush=True)
    hay_tokens = np.concatenate([h.ids for h in haystacks])
    report["perplexity_haystacks"] = perplexity(model, hay_tokens, bos, 4096, 8)
    if workdir is not None and (workdir / "heldout.npy").exists():
        report["perplexity_heldout_corpus"] = perplexity(model, np.load(workdir / "heldout.npy"), bos, 4096, 32)
    report["eval_seconds"] = round(time.perf_counter() - started, 1)
    (model_dir / "eval.json").write_text(json.dumps(report, indent=2))
    report["attention"] = measure_attention(model_dir)
    return report
