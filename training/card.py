"""The model card: ``README.md`` and ``loss_curve.png`` in the model folder, written from the recorded results only.

Every number comes from a file a command wrote: ``training.json`` and ``train_log.jsonl`` (the ``train`` command),
``corpus.json`` (``prepare``), ``eval.json`` (``evaluate`` and ``attention``) and, when present,
``bench/cpu_forward*.json`` (``bench/cpu_forward.py``). The record files are copied next to the card so that the
model folder carries its own evidence.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from kvlab.tasks.facts import HELD_OUT_TEMPLATES, TRAIN_TEMPLATES
from kvlab.units import MB

REPO_ROOT = Path(__file__).resolve().parent.parent
CPU_BENCHES = (REPO_ROOT / "bench" / "cpu_forward.json", REPO_ROOT / "bench" / "cpu_forward_eager.json")
RECORDS = ("training.json", "corpus.json", "train_log.jsonl")


def plot_loss(log: list[dict[str, Any]], png: Path) -> None:
    """Training loss (all tokens and answer tokens) and the hold-out points against tokens seen."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    train = [r for r in log if "lm_loss" in r]
    held = [r for r in log if "heldout_lm_loss" in r]
    ax.plot([r["tokens"] / 1e6 for r in train], [r["lm_loss"] for r in train], lw=0.8, label="train, all tokens")
    ax.plot(
        [r["tokens"] / 1e6 for r in train],
        [r["answer_loss"] for r in train],
        lw=0.6,
        alpha=0.6,
        label="train, answer tokens",
    )
    ax.plot(
        [r["tokens"] / 1e6 for r in held],
        [r["heldout_lm_loss"] for r in held],
        "o-",
        ms=3,
        label="hold-out, all tokens",
    )
    ax.plot(
        [r["tokens"] / 1e6 for r in held],
        [r["heldout_answer_loss"] for r in held],
        "s-",
        ms=3,
        label="hold-out, answer tokens",
    )
    ax.set_xlabel("training tokens (millions)")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png)
    plt.close(fig)


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def _accuracy_table(report: dict[str, Any], suites: list[tuple[str, str]]) -> list[str]:
    lengths = [str(n) for n in report["lengths"]]
    lines = [
        "| items | " + " | ".join(f"{n} tokens" for n in lengths) + " | all |",
        "|---|" + "---|" * (len(lengths) + 1),
    ]
    for key, label in suites:
        by = report[key]["by_length"]
        overall = next(iter(report[key]["overall"].values()))
        cells = [f"{_pct(by[n]['exact'])} (n={by[n]['n']})" for n in lengths]
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {_pct(overall['exact'])} |")
    return lines


def _depth_table(report: dict[str, Any], key: str) -> list[str]:
    depths = report[key]["by_depth"]
    return [
        "| depth | " + " | ".join(depths) + " |",
        "|---|" + "---|" * len(depths),
        "| exact match | " + " | ".join(_pct(v["exact"]) for v in depths.values()) + " |",
    ]


def write_card(model_dir: Path, workdir: Path) -> Path:
    """Write ``model_dir/README.md`` (and the loss curve, if matplotlib is installed and it is missing)."""
    for name in RECORDS:
        if (workdir / name).exists():
            shutil.copy2(workdir / name, model_dir / name)
    training = json.loads((model_dir / "training.json").read_text())
    corpus = json.loads((model_dir / "corpus.json").read_text())
    report = json.loads((model_dir / "eval.json").read_text())
    log = [json.loads(line) for line in (model_dir / "train_log.jsonl").read_text().splitlines() if line.strip()]
    png = model_dir / "loss_curve.png"
    if not png.exists():
        plot_loss(log, png)
    shape, settings = training["shape"], training["settings"]
    budget = settings["time_budget_s"]
    train_command = "python -m training train " + (
        f"--time-budget-min {budget / 60:g}" if budget else f"--max-steps {training['max_steps']}"
    )
    attention = report["attention"]
    sinks, per_head = attention["first_token_mass"], attention["first_token_mass_per_head"]
    layers_with_sink = sum(m > 0.5 for m in sinks)
    layers_bos_top = sum(b >= 0.5 for b in attention["first_token_is_top_key"])
    sink_heads = [(layer, head, m) for layer, heads in enumerate(per_head) for head, m in enumerate(heads) if m > 0.5]
    contamination = corpus["haystack_contamination"]
    size_mb = (model_dir / "model.safetensors").stat().st_size / MB
    last_held = [r for r in log if "heldout_lm_loss" in r][-1]
    lines = [
        "# kvlab-tiny-llama",
        "",
        "kvlab's default model: a small Llama trained from scratch on text that was already installed on the training",
        "machine (Python sources and package documentation), with long-context retrieval episodes mixed in, so that",
        "kvlab works offline with a model whose attention has real structure and that finds a needle with its full",
        "cache. It is a laboratory specimen, not a useful language model: it writes Python-flavoured text and answers",
        "needle questions in kvlab's format (see `docs/model.md`).",
        "",
        "## Architecture",
        "",
        f"`LlamaForCausalLM`: {shape['num_layers']} layers, hidden size {shape['hidden_size']}, "
        f"{shape['num_heads']} query heads and {shape['num_kv_heads']} key/value heads (grouped-query attention) of "
        f"dimension {shape['head_dim']}, SwiGLU MLP of width {shape['intermediate_size']}, RoPE (theta "
        f"{shape['rope_theta']:g}), RMSNorm, tied input/output embeddings, vocabulary {shape['vocab_size']} "
        f"(byte-level BPE). {training['parameters'] / 1e6:.2f}M parameters; `model.safetensors` is "
        f"{size_mb:.1f} MB (bf16; kvlab loads it as float32 on a CPU). Trained on sequences of "
        f"{shape['max_positions']} tokens, each starting with the BOS token `<s>`.",
        "",
        "## Corpus",
        "",
        f"Built by `python -m training prepare` from the `.py`, `.pyi`, `.md`, `.rst` and `.txt` files of the "
        f"Python {corpus['python']} installation and its site-packages on the training machine (nothing downloaded): "
        f"{corpus['train']['files']} training files, {corpus['train']['bytes'] / MB:.0f} MB, "
        f"{corpus['train']['tokens'] / 1e6:.1f}M tokens (file-list SHA-256 "
        f"`{corpus['train']['file_list_sha256'][:16]}…`); "
        f"hold-out split {corpus['heldout']['files']} files, {corpus['heldout']['bytes'] / MB:.1f} MB, "
        f"{corpus['heldout']['tokens'] / 1e6:.2f}M tokens (rule: `{corpus['holdout_rule']}`). Files of "
        f"{corpus['file_bytes_range'][0]} bytes to {corpus['file_bytes_range'][1]} bytes, deduplicated by content, "
        "ordered by content hash and capped; paths containing "
        f"{', '.join(f'`{p}`' for p in corpus['excluded_path_parts'])} "
        "were excluded. `pydoc_data` is the source of the needle haystacks (`kvlab/data/haystacks/`).",
        "",
        f"Contamination check: of the {contamination['haystack_ngrams']} distinct {contamination['ngram_words']}-word "
        f"sequences of the haystacks, {contamination['found_in_training_text']} "
        f"({_pct(contamination['fraction'])}) occur anywhere in the training text. The full manifest is "
        "`corpus.json`.",
        "",
        f"{_pct(1 - training['mix']['retrieval_fraction'])} of the training sequences are plain corpus windows; the "
        f"other {_pct(training['mix']['retrieval_fraction'])} carry needle-retrieval episodes "
        "(`training/mix.py`): a window of corpus text with facts inserted at sentence or line boundaries, then "
        f"a question and its answer, packed until the sequence is full. {len(TRAIN_TEMPLATES)} fact templates plus "
        "randomly composed subjects, values of three shapes (digits, words, identifiers), single-fact, multi-key "
        "and multi-value episodes, distractor facts about other subjects. The templates "
        f"{', '.join(f'`{t.name}`' for t in HELD_OUT_TEMPLATES)} never appear in training.",
        "",
        "## Training",
        "",
        f"`{train_command}` on one {training['device']}"
        f" (torch {training['torch']}): {training['steps']} steps of {settings['batch_size']} x "
        f"{shape['max_positions']} tokens ({training['tokens'] / 1e6:.0f}M tokens) in "
        f"{training['train_seconds'] / 60:.1f} minutes of training time; AdamW (lr {settings['lr']:g}, "
        f"{settings['warmup_steps']} warm-up steps, cosine to {settings['min_lr_ratio']:g} x lr, weight decay "
        f"{settings['weight_decay']:g}), bf16 autocast, seed {settings['seed']}. Loss: mean next-token cross-entropy "
        f"plus {settings['answer_loss_weight']:g} x the mean over answer tokens. Wall-clock time of the whole "
        f"pipeline on that GPU: {corpus['prepare_seconds'] / 60:.1f} min `prepare`, "
        f"{training['last_run_wall_seconds'] / 60:.1f} min `train` (compilation, checkpoints and hold-out "
        f"evaluations included), {report['eval_seconds'] / 60:.1f} min `evaluate`: "
        f"{(corpus['prepare_seconds'] + training['last_run_wall_seconds'] + report['eval_seconds']) / 60:.1f} "
        "minutes.",
        "",
        "![loss curve](loss_curve.png)",
        "",
        f"Final hold-out loss (fixed hold-out batches, half retrieval and half plain): "
        f"{last_held['heldout_lm_loss']:.3f} nats/token on all tokens, {last_held['heldout_answer_loss']:.3f} on "
        "answer tokens.",
        "",
        "## Perplexity",
        "",
    ]
    for key, label in (
        ("perplexity_heldout_corpus", "hold-out corpus files (code and docs)"),
        ("perplexity_haystacks", "haystacks (Python documentation prose, never trained on)"),
    ):
        if key in report:
            p = report[key]
            lines.append(f"- {label}: **{p['perplexity']:.2f}** over {p['tokens']} tokens in windows of {p['window']}.")
    lines += [
        "",
        "## Needle retrieval with the full cache",
        "",
        f"`python -m training evaluate` on {report['device']}: {report['decoding']} decoding of the prompt built by "
        "`kvlab.tasks.needle.build_needle` on the held-out haystacks, exact match of the first generated line. "
        f"Depths {report['depths'][0]:g} to {report['depths'][-1]:g} in steps of "
        f"{report['depths'][1] - report['depths'][0]:g}; new keys and values drawn for every item.",
        "",
        *_accuracy_table(
            report,
            [
                ("train_templates", "training templates, one fact"),
                ("held_out_templates", "held-out templates, one fact"),
                ("multi_key", "multi-key (4 keys of one template)"),
                ("multi_value", "multi-value (3 values of one key)"),
            ],
        ),
        "",
        "By depth (training templates, all lengths):",
        "",
        *_depth_table(report, "train_templates"),
        "",
        "By template:",
        "",
        "| template | exact match | n |",
        "|---|---|---|",
        *[
            f"| {name} | {_pct(v['exact'])} | {v['n']} |"
            for suite in ("train_templates", "held_out_templates")
            for name, v in report[suite]["by_template"].items()
        ],
        "",
        "## Attention profile",
        "",
        f"`python -m training attention` (on {attention['device']}): eager attention on the first "
        f"{attention['window']} tokens of each of the {len(attention['haystacks'])} haystacks (BOS first), averaged "
        "over heads, query positions 1 onwards and haystacks. *Sink*: attention mass on the first token (mean over "
        "heads, and in the strongest head). *Previous* and *last 8*: mass on the previous token and on the 8 tokens "
        "before the query. *Entropy*: of each attention row, in nats (a uniform row over the same positions averages "
        f"{attention['uniform_entropy_nats']:.2f}). *Top 1%*: share of the attention not on the first token that goes "
        "to the 1% of keys receiving most of it (heavy hitters; uniform causal attention would give "
        f"{attention['uniform_top1pct_keys_share']:.3f}, since early keys are seen by more queries). *BOS top*: "
        "fraction of haystacks in which the first token is the key that receives the most attention.",
        "",
        "| layer | sink (mean) | sink (strongest head) | previous | last 8 | entropy (nats) | top 1% keys | BOS top |",
        "|---|---|---|---|---|---|---|---|",
        *[
            f"| {i} | {s:.3f} | {max(h):.3f} | {p:.3f} | {r:.3f} | {e:.2f} | {k:.3f} | {b:.2f} |"
            for i, (s, h, p, r, e, k, b) in enumerate(
                zip(
                    sinks,
                    per_head,
                    attention["previous_token_mass"],
                    attention["recent8_mass"],
                    attention["entropy_nats"],
                    attention["top1pct_keys_share"],
                    attention["first_token_is_top_key"],
                )
            )
        ],
        "",
        f"**{layers_with_sink} of {len(sinks)} layers put more than half of their attention on the first token.** "
        f"The first token is the most attended key in {layers_bos_top} of {len(sinks)} layers (a weak signal: under "
        "causal masking every query sees it, so even uniform attention makes it the top key), and "
        f"{len(sink_heads)} of {sum(len(h) for h in per_head)} heads put more than half of their attention on it"
        + (
            " (" + ", ".join(f"layer {layer} head {h}: {m:.2f}" for layer, h, m in sink_heads) + ")"
            if sink_heads
            else ""
        )
        + ".",
        "",
    ]
    if layers_with_sink * 2 < len(sinks):
        flat = [i for i, e in enumerate(attention["entropy_nats"]) if e > 0.95 * attention["uniform_entropy_nats"]]
        local = [i for i, r in enumerate(attention["recent8_mass"]) if r > 0.5]
        lines += [
            "So this model has no attention sink on the first token in most layers, unlike the large LLMs that "
            "StreamingLLM was designed on. In those, the sink grows because most heads have nothing to do on most "
            "tokens and park that attention on a fixed, always-visible token, and studies of it report that it emerges "
            "with enough training data. This model is small and was trained for a few minutes, and its heads stay "
            "busy: "
            + (
                f"layer{'s' if len(flat) > 1 else ''} {', '.join(map(str, flat))} attend{'' if len(flat) > 1 else 's'} "
                "almost uniformly (a running average of the context), "
                if flat
                else ""
            )
            + (
                f"layer{'s' if len(local) > 1 else ''} {', '.join(map(str, local))} put most of "
                f"{'their' if len(local) > 1 else 'its'} attention on the last 8 tokens, "
                if local
                else ""
            )
            + "and the sink is carried by a few heads. What that means for eviction (does dropping the first tokens "
            "cost this model accuracy?) is for kvlab's experiments to measure, not for this card to assume.",
            "",
        ]
    benches = [json.loads(p.read_text()) for p in CPU_BENCHES if p.exists()]
    if benches:
        lines += ["## CPU speed", ""]
        lines += [
            f"- `{b['command']}`: one forward pass over {b['tokens']} tokens with {b['attention']} attention "
            f"in {b['dtype']} takes **{b['median_s']:.2f} s** (median of {len(b['seconds'])}) on {b['machine']}."
            for b in benches
        ]
        lines.append("")
    lines += [
        "## Reproduce",
        "",
        "On one GPU, from the repository root (see `docs/model.md`):",
        "",
        "```",
        "python -m training prepare",
        train_command,
        "python -m training evaluate",
        "python -m training attention",
        "python -m training card",
        "python bench/cpu_forward.py",
        "```",
        "",
        "Licence: the weights are derived from the installed packages' text; the haystacks are Python "
        "documentation under the PSF licence (`kvlab/data/haystacks/README.md`).",
        "",
    ]
    readme = model_dir / "README.md"
    readme.write_text("\n".join(lines))
    return readme
