"""What the store holds, as Python values: a run's configuration and its identity, trials, sweeps and filters.

A *run* is one configuration; :func:`run_key` hashes everything in :class:`RunConfig` that can change a result, so a
re-run finds its run again only when nothing that matters differs. A *trial* is one prompt answered under that run,
unique within it by ``trial_key``; its ``item_hash`` says which prompt it answered, so a stored trial is never
mistaken for the answer to a different prompt.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Literal

import kvlab
from kvlab.hashing import text_sha256

EndStatus = Literal["finished", "interrupted"]
#: Where a dashboard sweep stands: waiting for the device, running, or ended (``interrupted``: its process died).
SweepStatus = Literal["queued", "running", "finished", "stopped", "failed", "interrupted"]

#: Bumped when the meaning of a run's identity changes, so that keys of the new meaning never equal older ones:
#: version 1 (schema 2 to 4) left out generation settings, the tokenizer and the task's content; version 2 counted
#: the model's name as typed even when the weights' hash was known.
IDENTITY_VERSION = 3


@dataclass(frozen=True)
class RunConfig:
    """Everything that can change a run's results; :func:`run_key` hashes exactly these fields and kvlab's version.

    ``model`` is the model's portable name (a hub id, or a directory's or GGUF file's last component, never a local
    path), which identifies the run only when ``weights_hash`` is unknown. ``keep`` is the kept fraction of the context
    and ``budget_tokens`` a fixed token budget; a run sets one of them (or neither, for the full cache). ``task`` names
    the prompts for people (``needle``, ``jsonl:<file>``, ``text``); ``task_hash`` identifies their content (the items
    themselves, or for generated needles everything they are generated from), so a changed file or haystack is a
    different run. ``context_length`` is the target length when the run has one. ``stop_rule`` says which tokens end an
    answer (``eos``, or ``eos+line`` for one-line answers). ``layout`` is the KV heap's layout and ``compact_at``
    the threshold layout's dead share (``None`` otherwise). ``profile_hash`` identifies the stored attention profile
    the layer budgets followed (the ``entropy`` allocation; ``None`` otherwise). ``attention`` is the backend static
    decode steps attended with (``flex``; ``None`` for kvlab's own kernels, which every older run used). ``bos`` is the
    rule its prompts were tokenised by (:mod:`kvlab.tasks.bos`; ``None`` where it gave the ids of ``always``, the
    rule of every older run). Build them with
    :mod:`kvlab.runs.records`, which fills every field from the loaded model and the engine's settings.
    """

    model: str
    policy: str
    mode: str
    task: str
    policy_params: dict[str, Any] = field(default_factory=dict)
    weights_hash: str | None = None
    tokenizer_hash: str | None = None
    task_hash: str | None = None
    keep: float | None = None
    budget_tokens: int | None = None
    chunk: int | None = None
    compression_interval: int | None = None
    layout: str | None = None
    compact_at: float | None = None
    context_length: int | None = None
    query_aware: bool | None = None
    max_new_tokens: int | None = None
    stop_rule: str | None = None
    seed: int | None = None
    device: str | None = None
    dtype: str | None = None
    profile_hash: str | None = None
    attention: str | None = None
    bos: str | None = None


@dataclass(frozen=True)
class Trial:
    """One answered prompt of a run. ``trial_key`` identifies it within the run, so a resumed sweep can skip it;
    ``item_hash`` is the hash of the prompt and answer it was measured on.

    Byte counts are of the KV cache as physically held: ``kv_bytes`` of the slots holding a token at the end of the
    trial and ``peak_kv_bytes`` at the most; ``kv_reserved_bytes`` and ``peak_kv_reserved_bytes`` of the heap's
    tensors; ``compactions`` counts the heap's compactions. ``peak_gpu_bytes`` is the device's peak allocation during
    the trial's batch, where there is a GPU. A trial that reads a text instead of answering a question
    (:mod:`kvlab.runs.quality`) has no ``correct`` answer; it records the ``scored_tokens`` it predicted, their
    mean negative log-likelihood ``nll`` and mean KL divergence ``kl`` from the full cache's predictions.
    ``ranked_slots`` counts the slots its evictions ranked and ``ranking_s`` the seconds they took outside static
    decode steps, per sequence. ``tie_share`` is the share of its eviction cuts (over layers, KV heads and
    evictions) where the best victim's score equalled the worst survivor's, so that the position tie-break decided;
    ``recall`` the fraction of the expected strings its output contains (RULER's score; 1 or 0 for one answer);
    ``read_bytes`` the K/V bytes attention read per decoded token, per sequence (the bytes held, except for policies
    that read a subset of the cache); ``reconstruction_s`` the seconds of KVzip's reconstruction of the context, per
    sequence, which ``prefill_s`` includes (0 for every other policy). A run that demotes evicted tokens
    (:mod:`kvlab.cache.demotion`) records the bytes of its tiers at the end (``gpu_tier_bytes`` beside the heap,
    ``cpu_tier_bytes``, ``disk_tier_bytes``) and per decoded token the pages and bytes it fetched back and the seconds
    its recalls took (``recalled_pages``, ``recalled_bytes``, ``recall_s``), per sequence; a model split over several
    devices records the K/V bytes each held (``device_bytes``, JSON: device to bytes).
    """

    trial_key: str
    task_id: str
    context_tokens: int
    correct: bool | None
    exact: bool | None = None
    depth: float | None = None
    expected: str | None = None
    output: str | None = None
    kept_tokens: int | None = None
    kv_bytes: int | None = None
    peak_kv_bytes: int | None = None
    peak_gpu_bytes: int | None = None
    prefill_s: float | None = None
    decode_s: float | None = None
    item_hash: str | None = None
    kv_reserved_bytes: int | None = None
    peak_kv_reserved_bytes: int | None = None
    compactions: int | None = None
    scored_tokens: int | None = None
    nll: float | None = None
    kl: float | None = None
    ranked_slots: int | None = None
    ranking_s: float | None = None
    tie_share: float | None = None
    recall: float | None = None
    read_bytes: float | None = None
    reconstruction_s: float | None = None
    gpu_tier_bytes: int | None = None
    cpu_tier_bytes: int | None = None
    disk_tier_bytes: int | None = None
    recalled_pages: float | None = None
    recalled_bytes: float | None = None
    recall_s: float | None = None
    device_bytes: str | None = None


@dataclass(frozen=True)
class RunFilter:
    """Which runs a query covers: each non-empty field keeps runs whose column is one of its values."""

    run_ids: tuple[int, ...] = ()
    models: tuple[str, ...] = ()
    policies: tuple[str, ...] = ()
    modes: tuple[str, ...] = ()
    tasks: tuple[str, ...] = ()
    context_lengths: tuple[int, ...] = ()


#: The runs column each :class:`RunFilter` field filters on.
FILTER_COLUMNS: dict[str, str] = {
    "run_ids": "run_id",
    "models": "model",
    "policies": "policy",
    "modes": "mode",
    "tasks": "task",
    "context_lengths": "context_length",
}


@dataclass(frozen=True)
class ClaimRecord:
    """One quantitative claim of the source articles as kvlab last evaluated it: the claim, kvlab's ``figure`` (or
    the ``reason`` there is none), the ``verdict``, the ``model`` and ``device`` the figure came from, and the
    ``command`` that reproduces it. Built by :mod:`kvlab.claims`; the store only keeps the latest evaluation."""

    claim_id: str
    article: str
    claim: str
    figure: str | None
    verdict: str
    reason: str | None
    model: str | None
    device: str | None
    command: str
    refreshed_at: datetime


@dataclass(frozen=True)
class SweepRecord:
    """A stored sweep: its grid (``spec``, the JSON object it was started with), where it stands, why it failed
    (``message``), who started it first, and when it was created and last changed (UTC)."""

    sweep_id: int
    spec: dict[str, Any]
    status: SweepStatus
    message: str | None
    started_by: str | None
    created_at: datetime
    updated_at: datetime


def run_key(config: RunConfig) -> str:
    """The stable identity of a run configuration: sha256 of its fields, kvlab's version and the identity version
    as canonical JSON.

    Fields that are ``None`` are left out, so that a setting a run does not have (no budget for the full cache) does
    not count. The model's name counts only when the weights' hash is unknown: the same weights under another
    path or name are the same model. kvlab's version is part of it because the code is part of the experiment.
    """
    identity = {name: value for name, value in dataclasses.asdict(config).items() if value is not None}
    if config.weights_hash is not None:
        del identity["model"]
    identity["identity_version"] = IDENTITY_VERSION
    identity["kvlab_version"] = kvlab.__version__
    return text_sha256(canonical_json(identity))


def canonical_json(value: Any) -> str:
    """Canonical JSON (sorted keys, no spaces), so equal values give equal text."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def utcnow() -> datetime:
    """The current UTC time without a zone: timestamps are stored as UTC ``TIMESTAMP``."""
    return datetime.now(timezone.utc).replace(tzinfo=None)
