"""The training loop: AdamW, warm-up then cosine decay, bf16 autocast, checkpoints that a later run resumes from.

The loss is the mean next-token loss plus ``answer_loss_weight`` times the mean loss on answer tokens: answers are a
fraction of a percent of all tokens, and without their own term the retrieval skill would be learnt slowly. A run
can be given a number of steps, or a time budget: it then times its first ``calibration_steps`` steps (after the
compilation warm-up) and fixes the number of steps that fits, recording it in the checkpoint and the summary so that
the run can be repeated with ``--max-steps``.
"""

from __future__ import annotations

import json
import math
import os
import random
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from training.mix import MixBuilder, MixSettings, MixStream
from training.model import ModelShape, export, new_model, shape_dict


@dataclass(frozen=True)
class TrainSettings:
    """Optimisation and bookkeeping settings of one training run."""

    batch_size: int = 16
    lr: float = 1.5e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 200
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    answer_loss_weight: float = 1.0
    max_steps: int | None = None
    time_budget_s: float | None = None
    calibration_steps: int = 40
    checkpoint_every: int = 250
    log_every: int = 10
    eval_every: int = 250
    eval_batches: int = 4
    seed: int = 0
    compile: bool = True
    workers: int = 6


def lr_at(step: int, max_steps: int, s: TrainSettings) -> float:
    """Linear warm-up to ``lr``, then cosine decay to ``lr * min_lr_ratio`` at ``max_steps``."""
    if step < s.warmup_steps:
        return s.lr * (step + 1) / s.warmup_steps
    progress = min(1.0, (step - s.warmup_steps) / max(1, max_steps - s.warmup_steps))
    return s.lr * (s.min_lr_ratio + (1 - s.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def losses(model: Any, ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean next-token loss over all tokens, and over answer tokens only (0 when the batch has none)."""
    logits = model(input_ids=ids[:, :-1]).logits
    ce = F.cross_entropy(logits.float().flatten(0, 1), ids[:, 1:].flatten(), reduction="none").view_as(ids[:, 1:])
    answer = mask[:, 1:].float()
    return ce.mean(), (ce * answer).sum() / answer.sum().clamp(min=1.0)


def _optimizer(model: Any, s: TrainSettings, device: torch.device) -> torch.optim.Optimizer:
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": s.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=s.lr, betas=(0.9, 0.95), fused=device.type == "cuda")


def _heldout_batches(
    workdir: Path, tokenizer: Any, mix: MixSettings, s: TrainSettings
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Fixed hold-out batches (half retrieval, half plain) for the loss curve's hold-out points."""
    builder = MixBuilder(np.load(workdir / "heldout.npy", mmap_mode="r"), tokenizer, mix)
    rng = random.Random(f"heldout/{s.seed}")
    batches = []
    for b in range(s.eval_batches):
        seqs = [builder.retrieval(rng) if (b + i) % 2 == 0 else builder.plain(rng) for i in range(s.batch_size)]
        ids, masks = zip(*seqs)
        batches.append((torch.from_numpy(np.stack(ids)), torch.from_numpy(np.stack(masks))))
    return batches


def _save_checkpoint(path: Path, model: Any, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "state": state}, tmp)
    tmp.replace(path)


def train(workdir: Path, out_dir: Path, shape: ModelShape, s: TrainSettings, init_from: Path | None = None) -> Path:
    """Train (or resume from ``workdir/checkpoint.pt``) and export the result to ``out_dir``; returns the summary path.

    ``init_from`` starts from the weights of an exported model (with a fresh optimiser), for when a checkpoint with
    optimiser state has been lost but exported weights survive.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tokenizer = AutoTokenizer.from_pretrained(workdir / "tokenizer")
    shape = replace(shape, vocab_size=len(tokenizer))
    mix = MixSettings(seq_len=shape.max_positions)
    model = new_model(shape, tokenizer, s.seed)
    if init_from is not None:
        model.load_state_dict(AutoModelForCausalLM.from_pretrained(init_from, dtype=torch.float32).state_dict())
    model.to(device)
    optimizer = _optimizer(model, s, device)
    state: dict[str, Any] = {"step": 0, "max_steps": s.max_steps, "train_seconds": 0.0, "tokens": 0}
    ckpt_path = workdir / "checkpoint.pt"
    if ckpt_path.exists():
        ckpt = torch.load(ckpt_path, map_location=device, weights_only=False)
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        state = ckpt["state"]
        state["max_steps"] = s.max_steps or state["max_steps"]
        print(f"resumed from step {state['step']}", flush=True)
    run: Any = torch.compile(model) if s.compile and device.type == "cuda" else model
    loader = DataLoader(
        MixStream(workdir / "train.npy", workdir / "tokenizer", mix, s.seed, state["step"]),
        batch_size=s.batch_size,
        num_workers=s.workers,
        pin_memory=device.type == "cuda",
        prefetch_factor=4 if s.workers else None,
    )
    heldout = _heldout_batches(workdir, tokenizer, mix, s)
    log = (workdir / "train_log.jsonl").open("a")
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    started = time.perf_counter()
    first_step, clock, timed_from = state["step"], started, None
    for ids, mask in loader:
        if state["max_steps"] is not None and state["step"] >= state["max_steps"]:
            break
        step = state["step"]
        lr = lr_at(step, state["max_steps"] or 10**9, s)
        for group in optimizer.param_groups:
            group["lr"] = lr
        ids, mask = ids.to(device, non_blocking=True), mask.to(device, non_blocking=True)
        with autocast:
            lm_loss, answer_loss = losses(run, ids, mask)
        (lm_loss + s.answer_loss_weight * answer_loss).backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), s.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        state["step"] = step + 1
        state["tokens"] += ids.shape[0] * (ids.shape[1] - 1)
        now = time.perf_counter()
        state["train_seconds"] += now - clock
        clock = now
        if state["max_steps"] is None and s.time_budget_s is not None:
            if state["step"] == first_step + 10:
                timed_from = (state["step"], state["train_seconds"])
            elif timed_from is not None and state["step"] == first_step + 10 + s.calibration_steps:
                per_step = (state["train_seconds"] - timed_from[1]) / (state["step"] - timed_from[0])
                left = s.time_budget_s - state["train_seconds"]
                state["max_steps"] = state["step"] + max(0, int(left / per_step))
                print(f"calibrated: {per_step:.3f} s/step, max_steps={state['max_steps']}", flush=True)
        record: dict[str, Any] = {}
        if state["step"] % s.log_every == 0:
            record = {"lm_loss": lm_loss.item(), "answer_loss": answer_loss.item(), "grad_norm": grad_norm.item()}
        if state["step"] % s.eval_every == 0 or state["step"] == state["max_steps"]:
            run.eval()
            with torch.no_grad(), autocast:
                held = [losses(run, x.to(device), m.to(device)) for x, m in heldout]
            run.train()
            record["heldout_lm_loss"] = float(np.mean([h[0].item() for h in held]))
            record["heldout_answer_loss"] = float(np.mean([h[1].item() for h in held]))
        if record:
            record.update(
                step=state["step"],
                lr=lr,
                tokens=state["tokens"],
                train_seconds=round(state["train_seconds"], 2),
                tokens_per_s=round(state["tokens"] / max(state["train_seconds"], 1e-9)),
            )
            log.write(json.dumps(record) + "\n")
            log.flush()
            print(json.dumps(record), flush=True)
        if state["step"] % s.checkpoint_every == 0:
            _save_checkpoint(ckpt_path, model, optimizer, state)
            export(model, workdir / "tokenizer", workdir / "latest")
        clock = time.perf_counter()
    _save_checkpoint(ckpt_path, model, optimizer, state)
    export(model, workdir / "tokenizer", out_dir)
    summary = {
        "shape": shape_dict(shape),
        "parameters": sum(p.numel() for p in model.parameters()),
        "settings": asdict(s),
        "mix": asdict(mix),
        "steps": state["step"],
        "max_steps": state["max_steps"],
        "tokens": state["tokens"],
        "train_seconds": round(state["train_seconds"], 1),
        "last_run_wall_seconds": round(time.perf_counter() - started, 1),
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
    }
    path = workdir / "training.json"
    path.write_text(json.dumps(summary, indent=2))
    return path
