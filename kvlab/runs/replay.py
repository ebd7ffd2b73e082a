"""A live run kept for replaying: its trace packed into a few hundred KiB and unpacked again, without a model.

A live run's :class:`~kvlab.runs.live.LiveTrace` holds everything its charts draw, event by event. :func:`pack`
writes it as one compressed ``.npz`` payload: the observed passes' statistics stacked into arrays (float32, as
measured), the heap's bytes after every event, which positions each KV head held after every event (bit masks,
each XOR'd with the previous event's so that a run that changes little costs little), and the generated text after
each token (so a replay needs no tokenizer). A run that demoted what it evicted also keeps its tiers' bytes after
every event and what moved between them (its :class:`~kvlab.cache.demotion.DemotionReport`); a payload written before
runs could demote has neither, and replays as a run that deleted what it evicted. :func:`unpack` gives back an equal
trace; :class:`Replay` picks the event a scrubber points at. The store keeps one payload per stored live run
(``Store.add_replay``).
"""

from __future__ import annotations

import dataclasses
import io
import json
import zipfile
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from kvlab.cache.demotion import TIERS, DemotionReport
from kvlab.errors import KvlabError
from kvlab.paths import shipped
from kvlab.policies import evicting
from kvlab.runs.live import EventMark, LiveTrace, MemoryPoint, ObservedStep
from kvlab.runs.tables import run_label

#: Live runs shipped with kvlab for replaying, recorded on a GPU by ``bench/example_replays.sh`` (``kvlab live``).
EXAMPLES_DB = shipped("runs", "examples.duckdb")
#: How the page names that store.
EXAMPLES_LABEL = "kvlab's shipped examples"
#: The payload's format; a newer payload than this code reads is refused with a sentence.
FORMAT = 1
_STEP_ARRAYS = ("pooled", "held", "sinks_held", "entropy", "sink_mass")
_MEMORY_FIELDS = ("seen_tokens", "kv_bytes", "kv_bytes_full", "kv_reserved_bytes", "dead_share", "compactions")


@dataclass(frozen=True)
class Replay:
    """A stored live run: its trace, the generated text after each token (``texts[n]`` after ``n`` tokens), a few
    words about it (``about``: model, policy, device, question, answer, verdict) for the page to show, and, for a run
    that demoted, what moved between its tiers by its end (``demotion``)."""

    trace: LiveTrace
    texts: list[str]
    about: dict[str, str] = field(default_factory=dict)
    demotion: DemotionReport | None = None

    @property
    def positions(self) -> list[int]:
        """Tokens read or generated after each event: what a scrubber moves along."""
        return [point.seen_tokens for point in self.trace.memory]

    def event_at(self, position: int) -> int:
        """The last event whose tokens read or generated do not pass ``position`` (the first event before any);
        two runs of one prompt scrubbed to one position show the same moment of reading even with other chunks."""
        reached = [index for index, seen in enumerate(self.positions) if seen <= position]
        return reached[-1] if reached else 0

    @property
    def where_from(self) -> str:
        """Where the run was made and what it read: ``model on device · N prompt tokens · question · expected``."""
        about = self.about
        return (
            f"{about.get('model', '?')} on {about.get('device', '?')} · {about.get('prompt_tokens', '?')} prompt "
            f"tokens · question: {about.get('question') or '(none)'} · expected: {about.get('answer') or '(none)'}"
        )

    @property
    def headline(self) -> str:
        """The policy and how the answer scored: ``h2o · prefill · keep 10% · found``."""
        return " · ".join(part for part in (self.about.get("policy", ""), self.about.get("verdict", "")) if part)

    def at(self, position: int) -> tuple[LiveTrace, str]:
        """The trace and the generated text as they stood at ``position``."""
        trace = self.trace.at(self.event_at(position))
        return trace, self.texts[len(trace.token_ids)]


def _tier_row(point: MemoryPoint) -> list[int]:
    """An event's bytes in each of :data:`~kvlab.cache.demotion.TIERS` as the payload keeps them: -1 for an event
    that carried none."""
    held = point.demoted_bytes
    return [-1] * len(TIERS) if held is None else [held[tier] for tier in TIERS]


def pack(trace: LiveTrace, texts: list[str], about: dict[str, str], demotion: DemotionReport | None = None) -> bytes:
    """``trace`` as one compressed payload, with the text after each generated token, the words ``about`` it and,
    for a run that demoted, what moved between its tiers (``demotion``, the result's)."""
    if len(texts) != len(trace.token_ids) + 1:
        raise ValueError("texts must give the output after 0, 1, ... every generated token")
    steps = trace.observed
    arrays: dict[str, Any] = {
        f"step_{name}": np.stack([getattr(step, name) for step in steps]) if steps else np.zeros(0)
        for name in _STEP_ARRAYS
    }
    arrays["step_positions"] = np.asarray([[s.first_position, s.end_position] for s in steps], dtype=np.int64)
    arrays["memory"] = np.asarray(
        [[getattr(point, name) for name in _MEMORY_FIELDS] for point in trace.memory], dtype=np.float64
    )
    if trace.demotes:
        arrays["demoted"] = np.asarray([_tier_row(point) for point in trace.memory], dtype=np.int64)
    arrays["marks"] = np.asarray([[mark.observed, mark.tokens] for mark in trace.history], dtype=np.int64)
    held = np.stack([mark.held for mark in trace.history]) if trace.history else np.zeros((0, 0, 0, 0), np.uint8)
    arrays["held_delta"] = np.concatenate([held[:1], held[1:] ^ held[:-1]]) if len(held) else held
    arrays["token_ids"] = np.asarray(trace.token_ids, dtype=np.int64)
    meta = {
        "format": FORMAT,
        "num_layers": trace.num_layers,
        "prompt_tokens": trace.prompt_tokens,
        "max_new_tokens": trace.max_new_tokens,
        "n_bins": trace.n_bins,
        "n_sink": trace.n_sink,
        "needle": list(trace.needle) if trace.needle else None,
        "step_kinds": [step.kind for step in steps],
        "memory_kinds": [point.kind for point in trace.memory],
        "texts": texts,
        "about": about,
        "demotion": None if demotion is None else dataclasses.asdict(demotion),
    }
    arrays["meta"] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
    buffer = io.BytesIO()
    np.savez_compressed(buffer, **arrays)
    return buffer.getvalue()


def unpack(payload: bytes) -> Replay:
    """The replay a payload holds; a damaged or newer payload is one sentence."""
    try:
        with np.load(io.BytesIO(payload), allow_pickle=False) as data:
            arrays = {name: data[name] for name in data.files}
        meta = json.loads(arrays["meta"].tobytes())
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as error:
        raise KvlabError(f"This run's replay cannot be read ({error}); it may be damaged.") from None
    if meta.get("format") != FORMAT:
        raise KvlabError(f"This run's replay has format {meta.get('format')}; this kvlab reads format {FORMAT}.")
    trace = LiveTrace(
        num_layers=meta["num_layers"],
        prompt_tokens=meta["prompt_tokens"],
        max_new_tokens=meta["max_new_tokens"],
        n_bins=meta["n_bins"],
        n_sink=meta["n_sink"],
        needle=tuple(meta["needle"]) if meta["needle"] else None,
    )
    for index, kind in enumerate(meta["step_kinds"]):
        first, end = arrays["step_positions"][index]
        values = {name: arrays[f"step_{name}"][index] for name in _STEP_ARRAYS}
        trace.observed.append(ObservedStep(kind=kind, first_position=int(first), end_position=int(end), **values))
    none = np.full((len(arrays["memory"]), len(TIERS)), -1, dtype=np.int64)  # a run that demoted nothing
    demoted = arrays.get("demoted", none)
    for kind, row, tiers in zip(meta["memory_kinds"], arrays["memory"], demoted):
        seen, kv, full, reserved, dead, compactions = row.tolist()
        demoted_bytes = None if (tiers < 0).all() else dict(zip(TIERS, map(int, tiers)))
        trace.memory.append(
            MemoryPoint(kind, int(seen), int(kv), int(full), int(reserved), dead, int(compactions), demoted_bytes)
        )
    held = np.bitwise_xor.accumulate(arrays["held_delta"], axis=0)
    trace.history = [EventMark(int(o), int(t), bits) for (o, t), bits in zip(arrays["marks"], held)]
    trace.token_ids = arrays["token_ids"].tolist()
    if trace.history:
        last = trace.at(-1)
        trace.survivors, trace.seen_tokens = last.survivors, last.seen_tokens
    report = meta.get("demotion")
    return Replay(trace, meta["texts"], meta["about"], None if report is None else DemotionReport(**report))


def replay_choices(replays: pd.DataFrame) -> dict[tuple[int, str], str]:
    """The stored replays (``Store.replays``) by (run, trial), each named by what tells it apart: the run, policy
    and budget, the model, the prompt's length and whether it found the answer."""
    choices: dict[tuple[int, str], str] = {}
    for row in replays.itertuples(index=False):
        verdict = "not scored" if pd.isna(row.correct) else ("found" if row.correct else "not found")
        label = run_label(row.policy, row.mode, row.keep, row.budget_tokens, row.policy_params)
        choices[(int(row.run_id), str(row.trial_key))] = (
            f"run {row.run_id}: {label} · {row.model} · {int(row.context_length or 0):,} tokens · {verdict}"
        )
    return choices


def showcase(replays: pd.DataFrame, without_sinks: Collection[str] = ()) -> int:
    """Which of ``replays`` (``Store.replays``, in its order) to show first: a run of a model with attention sinks
    (not in ``without_sinks``, the shipped model's labels: a demo is about sinks) before the others, and among them
    the first whose policy evicts and still found the answer (eviction at work, and working), else the first that
    evicts, else the first."""
    rows = list(enumerate(replays.itertuples(index=False)))
    with_sinks = [(index, row) for index, row in rows if row.model not in without_sinks] or rows
    for index, row in with_sinks:
        if row.policy in evicting() and not pd.isna(row.correct) and bool(row.correct):
            return index
    for index, row in with_sinks:
        if row.policy in evicting():
            return index
    return with_sinks[0][0] if with_sinks else 0


def replay_stores(server_db: Path, examples_db: Path) -> dict[str, Path]:
    """Where replays can come from: this server's store, when it exists, and the examples shipped with kvlab."""
    stores = {}
    if server_db.is_file() and server_db.stat().st_size:
        stores[f"this server's runs ({server_db.name})"] = server_db
    if examples_db.is_file() and examples_db.resolve() != server_db.resolve():
        stores[EXAMPLES_LABEL] = examples_db
    return stores
