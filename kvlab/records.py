"""How a run is filed: its configuration (its identity), its trials, and the tokens that end its answers.

The command line, ``eval``, sweeps and the dashboard all file runs through this one module, so the same settings on
the same prompts are the same run wherever they ran, and a run is found again only when nothing that can change
its results differs: model weights, tokenizer, policy and parameters, budget, mode, chunk, compression interval,
whether the question is read before compression, generation length and stop rule, the task's content, seed, dtype,
device kind and kvlab's version (:func:`kvlab.store.run_key`). Batch size is left out on purpose: sequences of one
batch have the same length and are computed independently, so it changes only floating-point rounding.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from kvlab.engine import RunSpec, eos_token_ids
from kvlab.models import LoadedModel
from kvlab.store import RunConfig, Trial
from kvlab.tasks.items import TaskItem, item_hash, stop_token_ids
from kvlab.tasks.needle import HAYSTACK_DIR, score

StopRule = Literal["eos", "eos+line"]
#: The files that generated needle prompts are made from: the haystacks, and the code that builds facts and prompts.
NEEDLE_SOURCES: tuple[Path, ...] = (
    Path(__file__).resolve().parent / "tasks" / "facts.py",
    Path(__file__).resolve().parent / "tasks" / "needle.py",
)


@dataclass(frozen=True)
class Stops:
    """Which tokens end an answer: the rule's name (stored with the run) and the token ids it gives."""

    rule: StopRule
    token_ids: tuple[int, ...]


def stops_for(loaded: LoadedModel, *, one_line_answers: bool) -> Stops:
    """The one stop rule: a base model answering a question answers one line, so a line break ends the answer
    (``eos+line``; scoring reads the first line); a chat model answers in its own turn and a continued text runs
    on, so only the end-of-sequence token ends them (``eos``)."""
    eos = eos_token_ids(loaded)
    chat = bool(getattr(loaded.tokenizer, "chat_template", None))
    if one_line_answers and not chat and loaded.tokenizer is not None:
        return Stops("eos+line", stop_token_ids(loaded.tokenizer, eos))
    return Stops("eos", eos)


def items_hash(hashes: Iterable[str]) -> str:
    """One hash for a list of prompts (each :func:`~kvlab.tasks.items.item_hash`), in order."""
    return hashlib.sha256("\n".join(hashes).encode()).hexdigest()


@functools.lru_cache(maxsize=4)
def needle_sources_hash(kind: str, generator: str, haystack_dir: Path = HAYSTACK_DIR) -> str:
    """The identity of generated needle tasks of one ``kind``: the haystack texts and the generator's code
    (``generator`` names which of kvlab's generators, e.g. the sweeps' or the live page's). Items are generated from
    these and the seed, so equal hashes and seeds give equal prompts for the same tokenizer."""
    digest = hashlib.sha256(f"{kind}\n{generator}\n".encode())
    for path in [*sorted(haystack_dir.glob("*.txt")), *NEEDLE_SOURCES]:
        digest.update(path.name.encode() + b"\n" + hashlib.sha256(path.read_bytes()).hexdigest().encode() + b"\n")
    return digest.hexdigest()


def run_config(loaded: LoadedModel, spec: RunSpec, *, task: str, task_hash: str, stop_rule: StopRule,
               query_aware: bool, context_length: int | None) -> RunConfig:
    """The stored configuration of a run of ``spec`` on ``loaded``; the model's identity, dtype and device come
    from the loaded model, everything else from the engine's settings and the task."""
    budget = spec.budget if spec.policy.evicts() else None
    return RunConfig(
        model=loaded.name, policy=spec.policy.name, mode=spec.mode, task=task,
        policy_params=spec.policy.params(), weights_hash=loaded.weights_hash, tokenizer_hash=loaded.tokenizer_hash,
        task_hash=task_hash, keep=None if budget is None else budget.keep,
        budget_tokens=None if budget is None else budget.tokens, chunk=spec.chunk,
        compression_interval=spec.compression_interval, layout=spec.layout,
        compact_at=spec.compact_at if spec.layout == "threshold" else None,
        context_length=context_length, query_aware=query_aware,
        max_new_tokens=spec.max_new_tokens, stop_rule=stop_rule, seed=spec.seed, device=loaded.device_kind,
        dtype=loaded.dtype_name,
    )


@dataclass(frozen=True)
class Measured:
    """What one sequence of a generation held and took: bytes of its KV cache in use and reserved (at the end and
    at the peak), the heap's compactions, tokens kept per layer (mean), the device's peak allocation, and seconds of
    prefill and decoding."""

    kept_tokens: int
    kv_bytes: int
    peak_kv_bytes: int
    kv_reserved_bytes: int
    peak_kv_reserved_bytes: int
    compactions: int
    peak_gpu_bytes: int | None
    prefill_s: float
    decode_s: float


def trial(key: str, task_id: str, context_ids: Sequence[int], question_ids: Sequence[int], answer: str,
          output: str, measured: Measured, depth: float | None = None) -> Trial:
    """One trial: the answer scored against the expected one, with what the generation held and took."""
    verdict = score(output, answer)
    return Trial(
        trial_key=key, task_id=task_id, context_tokens=len(context_ids) + len(question_ids),
        correct=verdict.contains, exact=verdict.exact, depth=depth, expected=answer, output=output,
        kept_tokens=measured.kept_tokens, kv_bytes=measured.kv_bytes, peak_kv_bytes=measured.peak_kv_bytes,
        peak_gpu_bytes=measured.peak_gpu_bytes, prefill_s=measured.prefill_s, decode_s=measured.decode_s,
        item_hash=item_hash(context_ids, question_ids, answer), kv_reserved_bytes=measured.kv_reserved_bytes,
        peak_kv_reserved_bytes=measured.peak_kv_reserved_bytes, compactions=measured.compactions,
    )


def batch_trials(batch: Sequence[tuple[str, TaskItem]], result: Any, prefill_s: float) -> list[Trial]:
    """Per-item trials of a batched generation (a :class:`~kvlab.engine.GenerationResult`). Bytes and seconds are
    the batch's divided by its size: every sequence of a batch holds the same number of tokens, and the batch
    decodes together."""
    size = len(batch)
    measured = Measured(
        kept_tokens=round(sum(result.kept_per_layer) / len(result.kept_per_layer)),
        kv_bytes=result.kv_bytes // size, peak_kv_bytes=result.peak_kv_bytes // size,
        kv_reserved_bytes=result.kv_reserved_bytes // size,
        peak_kv_reserved_bytes=result.peak_kv_reserved_bytes // size, compactions=result.compactions,
        peak_gpu_bytes=result.peak_gpu_bytes, prefill_s=prefill_s / size, decode_s=result.decode_seconds / size,
    )
    return [trial(key, item.task_id, item.context_ids, item.question_ids, item.answer, text, measured, item.depth)
            for (key, item), text in zip(batch, result.texts)]
