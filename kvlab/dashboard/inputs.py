"""Widget values turned into kvlab objects. Every mistake a user can make here is one sentence
(:class:`~kvlab.errors.KvlabError`) that the page shows next to the widget; nothing here imports Streamlit."""

from __future__ import annotations

import dataclasses
import json
import math
import typing
from dataclasses import dataclass
from typing import Any

from kvlab.cache.spec import CacheOptions
from kvlab.costs import GpuSpec, ModelSpec
from kvlab.costs.gpus import NOT_FINITE
from kvlab.costs.models import require_decoder
from kvlab.errors import KvlabError
from kvlab.models.arch import arch_from_config
from kvlab.models.loading import LoadedModel
from kvlab.params import ParamSpec, param_spec
from kvlab.policies import POLICIES
from kvlab.policies.variants import published_options
from kvlab.units import GB, GIB

#: Cache precisions the calculator offers, by display name.
KV_PRECISIONS: dict[str, str] = {"fp16 / bf16": "bf16", "fp8 / int8": "fp8", "int4": "int4", "2-bit": "int2"}
#: Weight precisions the calculator offers, by display name.
WEIGHT_PRECISIONS: dict[str, str] = {"bf16 / fp16": "bf16", "fp8 / int8": "fp8", "int4": "int4", "fp32": "fp32"}


@dataclass(frozen=True)
class ParamField:
    """One parameter of a policy, enough to draw its widget: name, Python type, default and what it allows (the
    policy's own :class:`~kvlab.policies.base.ParamSpec`)."""

    name: str
    kind: type
    default: Any
    spec: ParamSpec

    @property
    def choices(self) -> tuple[Any, ...]:
        """The values a widget offers for the parameter: its declared choices, or none for a free value."""
        return self.spec.choices


#: The longest context a page offers when no model is loaded, or when neither the model nor the operator sets one.
FALLBACK_LONGEST_CONTEXT = 4096


def longest_context(loaded: LoadedModel | None) -> int:
    """The longest context a page offers: the model's positions and the operator's prompt limit
    (``KVLAB_MAX_PROMPT_TOKENS``), whichever is smaller."""
    most = loaded.limits.most_prompt_tokens() if loaded is not None else None
    return most if most is not None else FALLBACK_LONGEST_CONTEXT


def _fields(cls: type) -> list[ParamField]:
    """A dataclass's declared parameters (a policy's, or the cache options), in declaration order."""
    hints = typing.get_type_hints(cls)
    return [ParamField(f.name, hints[f.name], f.default, param_spec(cls, f.name)) for f in dataclasses.fields(cls)]


def policy_fields(policy: str) -> list[ParamField]:
    """A policy's own parameters as the page draws them, from its declaration: not the cache options every scoring
    policy takes (:func:`cache_option_fields`), which pages draw apart."""
    return _fields(POLICIES[policy])


#: The title of the expander where pages draw the cache options (:func:`cache_option_fields`).
CACHE_OPTIONS_TITLE = "Cache options: layer and head budgets, eviction scope, precision tiers, noise, demotion"


def cache_option_fields(policy: str | None = None) -> list[ParamField]:
    """The cache options (:class:`~kvlab.cache.spec.CacheOptions`) as the page draws them: those ``policy`` takes,
    at its published values (none for a policy that ranks no tokens), or with no policy named, those every scoring
    policy takes, at the cache's defaults."""
    if policy is None:
        return _fields(CacheOptions)
    if not POLICIES[policy].ranks:
        return []
    published = published_options(POLICIES[policy])
    return [dataclasses.replace(field, default=getattr(published, field.name)) for field in _fields(CacheOptions)]


def policy_summary(policy: str) -> str:
    """The first sentence of a policy's docstring (the paper it follows and what it keeps), in Markdown."""
    text = " ".join((POLICIES[policy].__doc__ or "").split()).replace("``", "`")
    paper, colon, rest = text.partition("): ")
    head, body = (paper + colon, rest) if colon else ("", text)
    return head + body.split(". ", 1)[0].rstrip(".") + "."


def read_upload(name: str, data: bytes) -> str:
    """The text of an uploaded file; anything that is not non-empty UTF-8 text is refused in one sentence."""
    if b"\x00" in data:
        raise KvlabError(f"The file {name} is binary, not text; upload a plain UTF-8 text file.")
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError:
        raise KvlabError(f"The file {name} is not UTF-8 text; upload a plain UTF-8 text file.") from None
    if not text.strip():
        raise KvlabError(f"The file {name} is empty.")
    return text


def model_spec_from_json(text: str, params_billions: float, name: str = "pasted config.json") -> ModelSpec:
    """A model to price from a pasted ``config.json`` and its parameter count (which a config does not state);
    encoders and encoder-decoders are refused (:func:`~kvlab.costs.models.require_decoder`)."""
    try:
        config = json.loads(text)
    except json.JSONDecodeError as error:
        raise KvlabError(f"The pasted config is not valid JSON ({error.msg} at line {error.lineno}).") from None
    if not isinstance(config, dict):
        raise KvlabError("The pasted config must be a JSON object, like a model's config.json.")
    require_decoder(config)
    if params_billions <= 0:
        raise KvlabError("Give the model's parameter count; a config.json does not state it.")
    arch_from_config(config)  # refuses, in one sentence, a config without layers, heads or hidden size
    return ModelSpec(name, config, params_billions * 1e9)


def model_spec_from_loaded(loaded: LoadedModel) -> ModelSpec:
    """The loaded model, priced by its own config and its counted parameters."""
    params = sum(parameter.numel() for parameter in loaded.model.parameters())
    return ModelSpec(loaded.source.label, loaded.model.config, float(params), source="loaded model")


def gpu_spec(name: str, memory_gib: float, bandwidth_gb_s: float, tflops: float, price_per_hour: float) -> GpuSpec:
    """A GPU from the calculator's editable fields (GiB, GB/s, dense BF16 TFLOP/s, $ per hour); a figure out of
    range is one sentence (:class:`~kvlab.costs.GpuSpec`)."""
    memory = memory_gib * GIB
    if not math.isfinite(memory):
        raise KvlabError(NOT_FINITE)
    return GpuSpec(name, int(memory), bandwidth_gb_s * GB, tflops * 1e12, price_per_hour)
