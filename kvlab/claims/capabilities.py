"""What a claim needs from kvlab, and the reason it cannot be measured computed from what kvlab has now.

A claim kvlab cannot measure used to say why in free text, and the text went stale as kvlab grew ("kvlab has no
offloading" after demotion to CPU and disk existed). Now such a claim lists its needs as :class:`Capability`
values (a policy, a cache option, an attention backend, a model, a device, a package), and its reason is written
from them against the live registries (:func:`inventory`): the needs kvlab lacks, then those it has. Only what no
kvlab capability could give (the article's own testbed, a vendor's release) is stated in words, in ``beyond``.
A claim whose needs are all met is measured (or says which measurement is still missing) from the evidence.

The registries are read without torch: the cache options, attention backends and installed models are declared
torch-free; the policy registry is read live where :mod:`kvlab.policies` is loaded (a policy registered from
outside counts), and otherwise from its source, which is what the registry holds in a process that loaded no
policy of its own.
"""

from __future__ import annotations

import ast
import importlib.util
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Literal

from kvlab.attention.backends import ATTENTION_BACKENDS
from kvlab.cache.layouts import LAYOUTS
from kvlab.cache.spec import CacheOptions
from kvlab.claims.evidence import Evidence
from kvlab.claims.verdicts import Evaluation, unmeasurable
from kvlab.models.catalog import available_models

Kind = Literal["policy", "option", "layout", "backend", "model", "device", "package"]
#: How each kind is named in a reason, singular and plural.
_NOUNS: dict[Kind, tuple[str, str]] = {
    "policy": ("the policy", "the policies"),
    "option": ("the cache option", "the cache options"),
    "layout": ("the heap layout", "the heap layouts"),
    "backend": ("the attention backend", "the attention backends"),
    "model": ("the model", "the models"),
    "device": ("runs on", "runs on"),
    "package": ("the package", "the packages"),
}
_REGISTRY = "kvlab.policies.registry"
#: The kvlab package's folder: the registry's source is found there, since finding a module by name would import
#: its package (and so torch).
_KVLAB = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Capability:
    """One thing a claim needs from kvlab: its ``kind`` and ``name`` as kvlab spells it (a policy's registry name,
    a :class:`~kvlab.cache.spec.CacheOptions` field, a model's name or part of it, part of a device's name)."""

    kind: Kind
    name: str

    @classmethod
    def policy(cls, name: str) -> Capability:
        """A policy of the registry (:data:`kvlab.policies.POLICIES`)."""
        return cls("policy", name)

    @classmethod
    def option(cls, name: str) -> Capability:
        """A cache option (:class:`kvlab.cache.spec.CacheOptions`)."""
        return cls("option", name)

    @classmethod
    def layout(cls, name: str) -> Capability:
        """A layout of the heap's slots (:data:`kvlab.cache.layouts.LAYOUTS`)."""
        return cls("layout", name)

    @classmethod
    def backend(cls, name: str) -> Capability:
        """An attention backend (:data:`kvlab.attention.backends.ATTENTION_BACKENDS`)."""
        return cls("backend", name)

    @classmethod
    def model(cls, name: str) -> Capability:
        """A model installed here (``kvlab models``), matched by part of its name."""
        return cls("model", name)

    @classmethod
    def device(cls, name: str) -> Capability:
        """A device the evidence store's runs were measured on, matched by part of its name (``A100``, ``cuda``)."""
        return cls("device", name)

    @classmethod
    def package(cls, name: str) -> Capability:
        """A Python package importable here (``vllm``)."""
        return cls("package", name)


@dataclass(frozen=True)
class Inventory:
    """What kvlab has, kind by kind, when a claim is evaluated."""

    policies: frozenset[str]
    options: frozenset[str]
    layouts: frozenset[str]
    backends: frozenset[str]
    models: frozenset[str]
    devices: frozenset[str]

    def has(self, need: Capability) -> bool:
        """Whether kvlab has ``need``: registry names exactly, models and devices by part of their names (any case),
        packages by whether they import."""
        if need.kind == "package":
            return importlib.util.find_spec(need.name) is not None
        exact = {"policy": self.policies, "option": self.options, "layout": self.layouts, "backend": self.backends}
        if need.kind in exact:
            return need.name in exact[need.kind]
        named = self.models if need.kind == "model" else self.devices
        return any(need.name.lower() in name.lower() for name in named)


def registered_policies() -> frozenset[str]:
    """The policy registry's names: the live registry where it is loaded, else read from its source (no torch)."""
    registry = sys.modules.get(_REGISTRY)
    if registry is not None:
        return frozenset(registry.POLICIES)
    return _source_policies()


@cache
def _source_policies() -> frozenset[str]:
    """The ``name`` of every class the registry's source lists in ``POLICIES``, read from the modules it imports
    them from."""
    origin = _KVLAB / "policies" / "registry.py"
    tree = ast.parse(origin.read_text())
    modules = {
        alias.name: node.module
        for node in tree.body
        if isinstance(node, ast.ImportFrom) and node.module
        for alias in node.names
    }
    listed = next(
        node.value
        for node in tree.body
        if isinstance(node, ast.AnnAssign)
        and isinstance(node.target, ast.Name)
        and node.target.id == "POLICIES"
        and node.value is not None
    )
    classes = [name.id for name in ast.walk(listed) if isinstance(name, ast.Name) and name.id in modules]
    return frozenset(_class_name(origin.parent / f"{modules[cls].rsplit('.', 1)[-1]}.py", cls) for cls in classes)


def _class_name(module: Path, cls: str) -> str:
    """The ``name`` a policy class declares in its module's source."""
    body = next(n for n in ast.parse(module.read_text()).body if isinstance(n, ast.ClassDef) and n.name == cls).body
    for node in body:
        if isinstance(node, ast.AnnAssign | ast.Assign) and isinstance(node.value, ast.Constant):
            targets = [node.target] if isinstance(node, ast.AnnAssign) else node.targets
            if any(isinstance(target, ast.Name) and target.id == "name" for target in targets):
                return str(node.value.value)
    raise ValueError(f"policy class {cls} in {module} declares no name")


def inventory(evidence: Evidence) -> Inventory:
    """What kvlab has now: the registries, the models installed here and the devices of the evidence's runs."""
    runs = evidence.runs
    devices = runs["device"].dropna().astype(str) if "device" in runs else ()
    return Inventory(
        policies=registered_policies(),
        options=frozenset(CacheOptions.names()),
        layouts=frozenset(LAYOUTS),
        backends=frozenset(ATTENTION_BACKENDS),
        models=frozenset(entry.label for entry in available_models()),
        devices=frozenset(devices),
    )


def named(needs: Iterable[Capability]) -> str:
    """Needs as a reason names them, grouped by kind in first-seen order: ``the policy rocketkv, the cache options
    cpu_tier_mib and disk_tier_mib and runs on A100``."""
    kinds: dict[Kind, list[str]] = {}
    for need in needs:
        kinds.setdefault(need.kind, []).append(need.name)
    return _and([f"{_NOUNS[kind][len(names) > 1]} {_and(names)}" for kind, names in kinds.items()])


def _and(names: list[str]) -> str:
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"


@dataclass(frozen=True)
class Requirements:
    """What a claim needs: kvlab's ``needs``, what no kvlab capability gives (``beyond``: the article's testbed, a
    vendor's release; said in words, and checked by the tests not to deny a capability kvlab has) and, once every
    need is met, the measurement that evaluates it (``pending``: a verdict, or why there is none yet and the
    command that measures it; none for a claim with no figure to check)."""

    needs: tuple[Capability, ...] = ()
    beyond: str | None = None
    pending: Callable[[Evidence], Evaluation] | None = None

    def lacking(self, have: Inventory) -> list[Capability]:
        """The needs kvlab does not have."""
        return [need for need in self.needs if not have.has(need)]

    def evaluate(self, evidence: Evidence, figure: str | None = None) -> Evaluation:
        """The claim evaluated: while a need is missing, the reason names what is missing and what kvlab has;
        once none is, the pending measurement decides (without one, the reason is ``beyond`` and what kvlab has)."""
        have = inventory(evidence)
        lacking = self.lacking(have)
        if not lacking and self.pending is not None:
            return self.pending(evidence)
        met = [need for need in self.needs if need not in lacking]
        parts = [
            self.beyond,
            f"needs {named(lacking)}" if lacking else None,
            f"kvlab has {named(met)}" if met else None,
        ]
        return unmeasurable("; ".join(part for part in parts if part), figure=figure)
