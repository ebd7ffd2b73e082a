"""What measured claims are evaluated against: the runs of one kvlab store, and the benchmark results a source
checkout keeps in ``bench/results/`` (attention profiles, short-context timings, attention entropy with the heavy
hitters removed, side-channel experiments, demotion timings), which a wheel does not install
(:func:`kvlab.paths.bench_results`).

Only reads: the frames a claim needs are fetched once per evaluation, and nothing here imports torch, so the
command line and the dashboard evaluate every claim in a fraction of a second.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, TypeVar

import pandas as pd

from kvlab.claims.needle import CLAIM_CONTEXT
from kvlab.paths import BENCH_RESULTS_ENV, bench_results, checkout, shipped
from kvlab.store import RunFilter, Store, default_db_path

#: The store of GPU-measured evidence shipped with kvlab; ``kvlab claims`` reads it when it exists.
EVIDENCE_DB = shipped("runs", "claims.duckdb")
#: What a side-channel result says it is (:data:`kvlab.experiments.sidechannel.RESULT_FORMAT`, named here so that
#: reading one needs no torch; the tests check that the two agree).
SIDE_CHANNEL_FORMAT = "kvlab-side-channel/1"
QUALITY_PREFIX = "quality:"
#: The context lengths (tokens) of the short-context overhead claim: "under 4K tokens".
SHORT_CONTEXTS = (1024, 4096)


def default_claims_db(env: Mapping[str, str] = os.environ) -> Path:
    """The store ``kvlab claims`` and the Claims page evaluate by default: the shipped evidence store when there
    is one, else the user's default store (``$KVLAB_DB`` and so on)."""
    return EVIDENCE_DB if EVIDENCE_DB.is_file() else default_db_path(env)


def model_name(stored: str) -> str:
    """A stored model name as a reader knows it: a local directory inside the checkout relative to it (the shipped
    model is ``kvlab/data/models/kvlab-tiny-llama`` wherever the checkout lies), anything else as stored."""
    path = Path(stored)
    return shown_path(path) if path.is_absolute() else stored


def shown_path(path: Path) -> str:
    """A path as a command line shows it: relative to the source checkout (where the commands are run) when it lies
    inside one, else absolute."""
    resolved = path.expanduser().resolve()
    root = checkout()
    return str(resolved.relative_to(root)) if root is not None and resolved.is_relative_to(root) else str(resolved)


@dataclass(frozen=True)
class LayerProfile:
    """One layer of an attention profile: the attention share on the first token and the attention entropy
    (nats), each averaged over heads and queries."""

    layer: int
    first_token_share: float
    entropy: float


@dataclass(frozen=True)
class AttentionProfile:
    """A model's attention profile as ``bench/attention_profile.py`` writes it, with the command that wrote it."""

    model: str
    device: str
    command: str
    layers: tuple[LayerProfile, ...]


def _object(data: Any, keys: Sequence[str]) -> dict[str, Any]:
    """``data`` if it is a JSON object with ``keys``; ``ValueError`` saying what is missing."""
    if not isinstance(data, dict):
        raise ValueError("it is not a JSON object")
    missing = [key for key in keys if key not in data]
    if missing:
        raise ValueError(f"it has no {', '.join(missing)}")
    return data


def parse_profile(data: Any) -> AttentionProfile:
    """An :class:`AttentionProfile` from a profile's JSON object; ``ValueError`` saying what is wrong."""
    data = _object(data, ("model", "device", "command", "layers"))
    try:
        layers = tuple(
            LayerProfile(int(row["layer"]), float(row["first_token_share"]), float(row["entropy"]))
            for row in data["layers"]
        )
    except (KeyError, TypeError, ValueError):
        raise ValueError("its layers are not {layer, first_token_share, entropy} objects") from None
    if not layers:
        raise ValueError("it has no layers")
    return AttentionProfile(str(data["model"]), str(data["device"]), str(data["command"]).strip(), layers)


@dataclass(frozen=True)
class Timing:
    """One evicting configuration timed against the full cache at one context length: the ratios of its total
    time (reading the prompt with its compression, then decoding) and of its decoding alone to the full cache's."""

    context: int
    policy: str
    total_vs_full: float
    decode_vs_full: float


@dataclass(frozen=True)
class Overhead:
    """A model's short-context timings as ``bench/short_context_overhead.py`` writes them."""

    model: str
    device: str
    command: str
    mode: str
    timings: tuple[Timing, ...]


def parse_overhead(data: Any) -> Overhead:
    """An :class:`Overhead` from the benchmark's JSON object (the full cache's own rows, which have no ratios,
    left out); ``ValueError`` saying what is wrong."""
    data = _object(data, ("model", "device", "command", "mode", "rows"))
    try:
        timings = tuple(
            Timing(int(row["context"]), str(row["policy"]), float(row["total_vs_full"]), float(row["decode_vs_full"]))
            for row in data["rows"]
            if "total_vs_full" in row
        )
    except (KeyError, TypeError, ValueError):
        raise ValueError("its rows are not {context, policy, total_vs_full, decode_vs_full} objects") from None
    if not timings:
        raise ValueError("it times no evicting policy")
    return Overhead(str(data["model"]), str(data["device"]), str(data["command"]).strip(), str(data["mode"]), timings)


@dataclass(frozen=True)
class EntropyConfiguration:
    """One cache read under ``policy`` with ``params``: the mean attention entropy (nats) of the question's queries
    per layer, over heads and prompts."""

    policy: str
    params: dict[str, Any]
    entropy: tuple[float, ...]

    @property
    def mean(self) -> float:
        """The mean over layers."""
        return sum(self.entropy) / len(self.entropy)


@dataclass(frozen=True)
class PillarEntropy:
    """A model's heavy-hitter ablation as ``bench/pillar_entropy.py`` writes it: the question's attention entropy
    per layer with the full cache and with the heaviest hitters removed, on the same needle prompts."""

    model: str
    device: str
    command: str
    prompts: int
    configurations: tuple[EntropyConfiguration, ...]


def parse_pillars(data: Any) -> PillarEntropy:
    """A :class:`PillarEntropy` from the benchmark's JSON object; ``ValueError`` saying what is wrong."""
    data = _object(data, ("model", "device", "command", "trials", "configurations"))
    try:
        configurations = tuple(
            EntropyConfiguration(
                str(row["policy"]), dict(row["params"]), tuple(float(value) for value in row["entropy"])
            )
            for row in data["configurations"]
        )
    except (KeyError, TypeError, ValueError):
        raise ValueError("its configurations are not {policy, params, entropy} objects") from None
    if not configurations or any(not row.entropy for row in configurations):
        raise ValueError("it has no entropy per layer")
    return PillarEntropy(
        str(data["model"]), str(data["device"]), str(data["command"]).strip(), int(data["trials"]), configurations
    )


@dataclass(frozen=True)
class ChannelFigure:
    """How well the attacker told a cached canary from an evicted one by one observable: ``accuracy`` on the test
    half with its 95% interval ``low``..``high`` (fractions; None when a class had too few trials) and the
    observable's ``spread`` over the trials (0: it never changed)."""

    accuracy: float | None
    low: float | None
    high: float | None
    spread: float


@dataclass(frozen=True)
class NoiseFigures:
    """One noise level of a side-channel experiment: its label (``no noise``, ``gaussian 0.5``), kind and scale, the
    retrieval accuracy it left with its 95% interval (fractions), the median decode seconds per token (None in a
    result that did not record them), and each channel's figure by name."""

    noise: str
    kind: str
    scale: float
    trials: int
    retrieval: float
    retrieval_low: float
    retrieval_high: float
    decode_seconds: float | None
    channels: dict[str, ChannelFigure]


@dataclass(frozen=True)
class SideChannel:
    """What a side-channel experiment (``kvlab sidechannel --out``) measured, as the claims read it."""

    model: str
    device: str
    policy: str
    params: dict[str, Any]
    mode: str
    keep: float | None
    budget_tokens: int
    context_tokens: int
    new_tokens: int
    trials: int
    seed: int
    depths: tuple[float, float]
    levels: tuple[NoiseFigures, ...]


@dataclass(frozen=True)
class DemotionConfiguration:
    """One cache configuration of a demotion timing: its label, the cache options it set (none: evicted tokens
    deleted) and its decode milliseconds per token."""

    label: str
    params: dict[str, Any]
    decode_ms: float


@dataclass(frozen=True)
class Demotion:
    """A demotion timing as ``bench/demotion_gpu.py`` writes it: one context read once, then decoded by each
    configuration, on one device."""

    model: str
    device: str
    context_tokens: int
    configurations: tuple[DemotionConfiguration, ...]


def parse_demotion(data: Any) -> Demotion:
    """A :class:`Demotion` from the benchmark's JSON object; ``ValueError`` saying what is wrong."""
    data = _object(data, ("model", "device", "context_tokens", "configurations"))
    try:
        configurations = tuple(
            DemotionConfiguration(str(label), dict(row["params"]), float(row["decode_ms_per_token"]))
            for label, row in dict(data["configurations"]).items()
        )
    except (KeyError, TypeError, ValueError):
        raise ValueError("its configurations are not {params, decode_ms_per_token} objects") from None
    if not configurations:
        raise ValueError("it times no configuration")
    return Demotion(str(data["model"]), str(data["device"]), int(data["context_tokens"]), configurations)


def _optional(value: Any) -> float | None:
    return None if value is None else float(value)


def parse_side_channel(data: Any) -> SideChannel:
    """A :class:`SideChannel` from the experiment's JSON object; ``ValueError`` saying what is wrong."""
    keys = ("model", "device", "policy", "params", "mode", "keep", "budget_tokens", "context_tokens", "new_tokens")
    data = _object(data, ("format", *keys, "trials", "seed", "depths", "levels"))
    if data["format"] != SIDE_CHANNEL_FORMAT:
        raise ValueError(f"its format is not {SIDE_CHANNEL_FORMAT}")
    try:
        levels = tuple(
            NoiseFigures(
                str(level["noise"]),
                str(level["kind"]),
                float(level["scale"]),
                int(level["trials"]),
                float(level["retrieval"]),
                float(level["retrieval_low"]),
                float(level["retrieval_high"]),
                _optional(level.get("decode_seconds")),
                {
                    str(score["channel"]): ChannelFigure(
                        _optional(score["accuracy"]),
                        _optional(score["low"]),
                        _optional(score["high"]),
                        float(score["spread"]),
                    )
                    for score in level["channels"]
                },
            )
            for level in data["levels"]
        )
        low, high = (float(depth) for depth in data["depths"])
        result = SideChannel(
            str(data["model"]),
            str(data["device"]),
            str(data["policy"]),
            dict(data["params"]),
            str(data["mode"]),
            _optional(data["keep"]),
            int(data["budget_tokens"]),
            int(data["context_tokens"]),
            int(data["new_tokens"]),
            int(data["trials"]),
            int(data["seed"]),
            (low, high),
            levels,
        )
    except (KeyError, TypeError, ValueError):
        raise ValueError("its levels are not noise levels with retrieval and channel scores") from None
    if not levels:
        raise ValueError("it has no noise levels")
    return result


T = TypeVar("T")


def read_results(directory: Path | None, parse: Callable[[Any], T], what: str) -> tuple[list[T], list[str]]:
    """Every JSON result in ``directory`` (none without one) read by ``parse``, and one sentence per file that is
    not one."""
    found: list[T] = []
    problems: list[str] = []
    for path in sorted(directory.glob("*.json")) if directory is not None and directory.is_dir() else []:
        try:
            found.append(parse(json.loads(path.read_text(encoding="utf-8"))))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, ValueError) as error:
            problems.append(f"{shown_path(path)} is not {what} ({error})")
    return found, problems


@dataclass(frozen=True)
class Group:
    """The trials of one model (and device, where timing is compared), with the names the claim reports."""

    trials: pd.DataFrame
    model: str
    device: str


def largest_group(
    trials: pd.DataFrame, keys: Sequence[str], having: Callable[[pd.DataFrame], bool] | None = None
) -> Group | None:
    """The trials of the ``keys`` group with the most trials among those ``having`` what a claim compares (a store
    may hold several models and texts; comparing across them would mix unlike things), with its model and devices;
    None when no group has it."""
    groups = [
        group for _, group in trials.groupby(list(keys), dropna=False, sort=True) if having is None or having(group)
    ]
    if not groups:
        return None
    group = max(groups, key=len)
    devices = sorted(str(device) for device in group["device"].dropna().unique())
    return Group(group, model_name(str(group["model"].iloc[0])), ", ".join(devices) or "unknown device")


class Evidence:
    """The store ``path`` (``store`` is None when there is no file there yet) and the benchmark results under
    ``results`` (by default :func:`kvlab.paths.bench_results`; None for an installed kvlab, which has none), each
    read lazily and once. ``runs``, when given, are the store's runs already read (one model's, for
    :meth:`of_model`)."""

    def __init__(
        self,
        store: Store | None,
        path: Path,
        results: Path | None = None,
        *,
        runs: pd.DataFrame | None = None,
    ) -> None:
        self.store = store
        self.path = path
        self.results = results if results is not None else bench_results()
        self._given_runs = runs
        self._by_model: dict[str, Evidence] = {}

    @property
    def models(self) -> list[str]:
        """The models the store holds runs of, by name."""
        return sorted(str(name) for name in self.runs["model"].dropna().unique()) if not self.runs.empty else []

    def of_model(self, model: str) -> Evidence:
        """The same evidence, with only the runs of ``model``: figures of different models are never pooled. Made
        once per model, from the runs already read, so every claim checked per model shares its reads."""
        if model not in self._by_model:
            runs = self.runs[self.runs["model"] == model] if not self.runs.empty else self.runs
            self._by_model[model] = Evidence(self.store, self.path, self.results, runs=runs)
        return self._by_model[model]

    def results_in(self, kind: str) -> Path | None:
        """The folder of one kind of benchmark result (``attention``, ``overhead``, ``pillars``, ``side_channel``),
        or None where there are no benchmark results."""
        return self.results / kind if self.results is not None else None

    def results_place(self, kind: str) -> str:
        """Where a claim says it looked for one kind of benchmark result: the folder as commands name it, or, for
        an installed kvlab, that the benchmark results are not installed and how to point at a copy."""
        folder = self.results_in(kind)
        if folder is not None:
            return shown_path(folder)
        return (
            f"bench/results/{kind} (the benchmark results are not installed when kvlab runs from a wheel: they are "
            f"in a source checkout, and {BENCH_RESULTS_ENV} names a copy of them)"
        )

    @property
    def db(self) -> str:
        """The store as commands name it."""
        return shown_path(self.path)

    @cached_property
    def runs(self) -> pd.DataFrame:
        """Every run with its trial count (those given, when given; empty without a store)."""
        if self._given_runs is not None:
            return self._given_runs
        return self.store.list_runs() if self.store is not None else pd.DataFrame()

    def _trials_of(self, chosen: pd.Series) -> pd.DataFrame:
        """The trials of the chosen runs (with their run columns), or an empty frame."""
        ids = tuple(int(run_id) for run_id in self.runs.loc[chosen & (self.runs["trials"] > 0), "run_id"])
        if self.store is None or not ids:
            return pd.DataFrame()
        return self.store.trials_frame(RunFilter(run_ids=ids))

    @cached_property
    def needle_trials(self) -> pd.DataFrame:
        """Trials of single-needle runs at the claim's context length."""
        if self.runs.empty:
            return pd.DataFrame()
        return self._trials_of((self.runs["task"] == "needle") & (self.runs["context_length"] == CLAIM_CONTEXT))

    @cached_property
    def quality_trials(self) -> pd.DataFrame:
        """Trials of runs that score texts by likelihood (tasks ``quality:<text>``)."""
        if self.runs.empty:
            return pd.DataFrame()
        return self._trials_of(self.runs["task"].fillna("").str.startswith(QUALITY_PREFIX))

    @cached_property
    def short_context_trials(self) -> pd.DataFrame:
        """Trials of runs at context lengths from 1,024 to 4,096 tokens that timed their decoding."""
        if self.runs.empty:
            return pd.DataFrame()
        lengths = self.runs["context_length"]
        trials = self._trials_of(lengths.between(*SHORT_CONTEXTS))
        return trials[trials["decode_s"].notna()] if not trials.empty else trials

    @cached_property
    def profiles(self) -> tuple[list[AttentionProfile], list[str]]:
        """The attention profiles in ``results/attention``, and one sentence per file that is not one."""
        return read_results(self.results_in("attention"), parse_profile, "an attention profile")

    @cached_property
    def overheads(self) -> tuple[list[Overhead], list[str]]:
        """The short-context timings in ``results/overhead``, and one sentence per file that is not one."""
        return read_results(self.results_in("overhead"), parse_overhead, "a short-context timing")

    @cached_property
    def pillar_entropies(self) -> tuple[list[PillarEntropy], list[str]]:
        """The heavy-hitter ablations in ``results/pillars``, and one sentence per file that is not one."""
        return read_results(self.results_in("pillars"), parse_pillars, "an attention-entropy ablation")

    @cached_property
    def demotions(self) -> tuple[list[Demotion], list[str]]:
        """The demotion timings in ``results/demotion``, and one sentence per file that is not one."""
        return read_results(self.results_in("demotion"), parse_demotion, "a demotion timing")

    @cached_property
    def side_channels(self) -> tuple[list[SideChannel], list[str]]:
        """The side-channel experiments in ``results/side_channel``, and one sentence per file that is not one."""
        return read_results(self.results_in("side_channel"), parse_side_channel, "a side-channel result")
