"""How a run is filed: its configuration (its identity), its trials, and the tokens that end its answers.

The command line, ``eval``, sweeps and the dashboard all file runs through this one module, so the same settings on
the same prompts are the same run wherever they ran, and a run is found again only when nothing that can change
its results differs: model weights, tokenizer, policy and parameters, budget, mode, chunk, compression interval,
whether the question is read before compression, generation length and stop rule, the KV heap's layout and its
threshold, the attention profile a layer allocation follows, the task's content, seed, dtype, device kind and
kvlab's version (:func:`kvlab.store.run_key`). Batch size is left out on purpose: sequences of one batch have the
same length and are computed independently, so it changes no token beyond floating-point rounding; it does change
the seconds and the peak GPU memory a trial records, which are its batch's (:func:`batch_trials`).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from kvlab.attention.backends import stored_attention
from kvlab.cache.demotion import DemotionReport
from kvlab.engine.events import GenerationResult
from kvlab.engine.plan import layer_profile
from kvlab.engine.spec import RunSpec
from kvlab.engine.stopping import eos_token_ids
from kvlab.hashing import sources_sha256, text_sha256
from kvlab.models.loading import LoadedModel
from kvlab.store import RunConfig, Trial
from kvlab.tasks import facts, needle
from kvlab.tasks.bos import stored_bos
from kvlab.tasks.items import TaskItem, has_chat_template, stop_token_ids
from kvlab.tasks.needle import HAYSTACK_DIR, score
from kvlab.tasks.ruler_score import recall

#: Which tokens end an answer: ``none`` for a text fed to its end (:mod:`kvlab.runs.quality`).
StopRule = Literal["eos", "eos+line", "none"]
#: The files that generated needle prompts are made from: the haystacks, and the code that builds facts and prompts.
NEEDLE_SOURCES: tuple[Path, ...] = (Path(facts.__file__), Path(needle.__file__))


@dataclass(frozen=True)
class Stops:
    """Which tokens end an answer: the rule's name (stored with the run) and the token ids it gives."""

    rule: StopRule
    token_ids: tuple[int, ...]


def stops_for(loaded: LoadedModel, *, one_line_answers: bool, chat: bool = True) -> Stops:
    """The one stop rule: a base model answering a question answers one line, so a line break ends the answer
    (``eos+line``; scoring reads the first line); a chat model answering in its own turn (``chat``, when it has a
    chat template) and a continued text run on, so only the end-of-sequence token ends them (``eos``)."""
    eos = eos_token_ids(loaded)
    in_turn = chat and has_chat_template(loaded.tokenizer)
    if one_line_answers and not in_turn and loaded.tokenizer is not None:
        return Stops("eos+line", stop_token_ids(loaded.tokenizer, eos))
    return Stops("eos", eos)


def items_hash(hashes: Iterable[str]) -> str:
    """One hash for a list of prompts, in order: each described by a line (``eval`` gives its id and
    :func:`~kvlab.tasks.items.item_hash`)."""
    return text_sha256("\n".join(hashes))


@functools.lru_cache(maxsize=4)
def needle_sources_hash(kind: str, generator: str) -> str:
    """The identity of generated needle tasks of one ``kind``: the haystack texts and the files that make facts and
    prompts from them (:data:`NEEDLE_SOURCES`), with the name of the generator that draws the items (``sweep`` or
    ``live``). The drawing code itself is not hashed: a change to it that gives other prompts for the same keys is
    caught trial by trial, since every trial records the hash of its prompt and a sweep refuses to resume over
    different ones."""
    return sources_sha256(f"{kind}\n{generator}", [*sorted(HAYSTACK_DIR.glob("*.txt")), *NEEDLE_SOURCES])


def run_config(
    loaded: LoadedModel,
    spec: RunSpec,
    *,
    task: str,
    task_hash: str,
    stop_rule: StopRule,
    query_aware: bool | None,
    context_length: int | None,
) -> RunConfig:
    """The stored configuration of a run of ``spec`` on ``loaded``; the model's identity, dtype and device come
    from the loaded model, everything else from the engine's settings and the task (``query_aware`` is ``None``
    for a task that asks no question)."""
    budget = spec.budget if spec.policy.evicts else None
    return RunConfig(
        model=loaded.source.label,
        policy=spec.policy.name,
        mode=spec.mode,
        task=task,
        policy_params=spec.stored_params(),
        weights_hash=loaded.weights_hash,
        tokenizer_hash=loaded.tokenizer_hash,
        task_hash=task_hash,
        keep=None if budget is None else budget.keep,
        budget_tokens=None if budget is None else budget.tokens,
        chunk=spec.chunk,
        compression_interval=spec.compression_interval,
        layout=spec.cache.stored_layout()[0],
        compact_at=spec.cache.stored_layout()[1],
        context_length=context_length,
        query_aware=query_aware,
        max_new_tokens=spec.max_new_tokens,
        stop_rule=stop_rule,
        seed=spec.seed,
        device=loaded.device_kind,
        dtype=loaded.dtype_name,
        profile_hash=None if (profile := layer_profile(loaded, spec.cache)) is None else profile.digest(),
        attention=stored_attention(spec.attention_on(loaded.device)),
        bos=stored_bos(loaded.tokenizer, spec.bos),
    )


def batch_trials(batch: Sequence[tuple[str, TaskItem]], result: GenerationResult) -> list[Trial]:
    """The trials of one generation over a batch of items, each answer scored against the item's expected one.
    KV bytes and seconds are the batch's divided by its size: every sequence of a batch holds the same number of
    tokens, and the batch decodes together. The peak GPU allocation is the device's during the batch (weights and
    activations included), which cannot be divided among its sequences: it is recorded as it is.

    Every trial records RULER's ``recall`` of its expected strings (:func:`~kvlab.tasks.ruler_score.recall`). An
    item with a list of ``answers`` (RULER's) is ``correct`` when its output contains all of them (recall 1) and has
    no ``exact`` verdict, its ``expected`` holding them joined by
    :data:`~kvlab.tasks.ruler_score.ANSWER_SEPARATOR`; any other item is ``correct`` when its output contains its
    one answer, as it always was."""
    size = len(batch)
    trials = []
    for (key, item), output in zip(batch, result.texts):
        verdict = score(output, item.answer)
        found = recall(output, item.expected_answers)
        listed = bool(item.answers)
        trials.append(
            Trial(
                trial_key=key,
                task_id=item.task_id,
                context_tokens=item.context_tokens,
                correct=found == 1.0 if listed else verdict.contains,
                exact=None if listed else verdict.exact,
                recall=found,
                depth=item.depth,
                expected=item.answer,
                output=output,
                peak_gpu_bytes=result.peak_gpu_bytes,
                item_hash=item.content_hash,
                **held_and_timed(result, size),
            )
        )
    return trials


def held_and_timed(result: GenerationResult, size: int = 1) -> dict[str, Any]:
    """What a trial records of its generation's cache and clock, per sequence of a batch of ``size``: kept tokens,
    KV bytes in use and reserved (at the end and at the most), compactions, the share of cuts on tied scores (the
    batch's: its sequences are cut together), the bytes read per decoded token and the seconds reading and
    decoding."""
    read = result.read_bytes_per_token
    return {
        **demotion_figures(result.demotion, size),
        **device_figures(result.kv_bytes_per_device, size),
        "kept_tokens": result.mean_kept_tokens,
        "kv_bytes": result.kv_bytes // size,
        "peak_kv_bytes": result.peak_kv_bytes // size,
        "kv_reserved_bytes": result.kv_reserved_bytes // size,
        "peak_kv_reserved_bytes": result.peak_kv_reserved_bytes // size,
        "compactions": result.compactions,
        "ranked_slots": result.ranked_slots // size,
        "ranking_s": result.ranking_seconds / size,
        "tie_share": result.tie_share,
        "read_bytes": None if read is None else read / size,
        "prefill_s": result.prefill_seconds / size,
        "reconstruction_s": result.reconstruction_seconds / size,
        "decode_s": result.decode_seconds / size,
    }


def demotion_figures(report: DemotionReport | None, size: int) -> dict[str, Any]:
    """A trial's tier bytes and recalls per decoded token, per sequence (nothing where nothing was demoted)."""
    if report is None:
        return {}

    def per_sequence(value: float | None) -> float | None:
        return None if value is None else value / size

    return {
        "gpu_tier_bytes": report.gpu_bytes // size,
        "cpu_tier_bytes": report.cpu_bytes // size,
        "disk_tier_bytes": report.disk_bytes // size,
        "recalled_pages": per_sequence(report.pages_per_token),
        "recalled_bytes": per_sequence(report.bytes_per_token),
        "recall_s": per_sequence(report.recall_seconds_per_token),
    }


def device_figures(kv_bytes_per_device: dict[str, int], size: int) -> dict[str, Any]:
    """The K/V bytes each device held at the end, per sequence, as JSON (nothing on one device)."""
    if len(kv_bytes_per_device) < 2:
        return {}
    return {"device_bytes": json.dumps({device: held // size for device, held in kv_bytes_per_device.items()})}
