"""Declared parameters: a value's bounds, choices and one line of help, checked the same way wherever it is set.

Policies (:mod:`kvlab.policies`) and the cache's options (:mod:`kvlab.cache.spec`) are dataclasses whose fields are
declared with :func:`param`. One declaration serves everything that touches a parameter: the check when the object
is made, the command line's ``key=value`` parsing, the error sentence naming what is allowed, and the dashboard's
widgets. Torch-free, so that the command line and the dashboard describe parameters without loading a model.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass, field, fields
from typing import Any

from kvlab.errors import KvlabError

#: How each declared type is named in a sentence.
_KINDS: dict[type, str] = {int: "a whole number", float: "a number", bool: "true or false", str: "text"}


@dataclass(frozen=True)
class ParamSpec:
    """What values one parameter takes: bounds (inclusive unless ``open_minimum``/``open_maximum``), a list of
    ``choices`` for text (or whole-number) parameters, and one line of ``help``."""

    minimum: float | None = None
    maximum: float | None = None
    open_minimum: bool = False
    open_maximum: bool = False
    choices: tuple[str | int, ...] = ()
    help: str = ""

    def describe(self) -> str:
        """The allowed values in words, for error messages."""
        if self.choices:
            return "one of " + ", ".join(repr(choice) for choice in self.choices)
        parts = []
        if self.minimum is not None:
            parts.append(f"{'more than' if self.open_minimum else 'at least'} {self.minimum:g}")
        if self.maximum is not None:
            parts.append(f"{'less than' if self.open_maximum else 'at most'} {self.maximum:g}")
        return " and ".join(parts) or "any value"

    def allows(self, value: object) -> bool:
        """Whether ``value`` lies within the bounds or among the choices."""
        if self.choices:
            return not isinstance(value, bool) and value in self.choices
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return True
        if not math.isfinite(value):
            return False
        low_ok = self.minimum is None or (value > self.minimum if self.open_minimum else value >= self.minimum)
        high_ok = self.maximum is None or (value < self.maximum if self.open_maximum else value <= self.maximum)
        return low_ok and high_ok


def param(default: Any, **spec: Any) -> Any:
    """A parameter with its default and its :class:`ParamSpec` (bounds, choices, help)."""
    return field(default=default, metadata={"param": ParamSpec(**spec)})


def param_spec(cls: type, name: str) -> ParamSpec:
    """The spec of a parameter of a dataclass (no bounds when it declared none)."""
    for item in fields(cls):
        if item.name == name:
            return item.metadata.get("param", ParamSpec())
    raise KeyError(name)


def declared_type(cls: type, name: str) -> type:
    """The type a dataclass declares for its parameter ``name`` (``int``, ``float``, ``bool`` or ``str``)."""
    return typing.get_type_hints(cls)[name]


def check_values(owner: object, what: str) -> None:
    """Refuse, in one sentence naming ``what`` (``policy 'h2o'``, ``the cache``), a field of the dataclass instance
    ``owner`` whose value has the wrong type or lies outside its declared bounds or choices."""
    hints = typing.get_type_hints(type(owner))
    for item in fields(owner):  # type: ignore[arg-type]
        value = getattr(owner, item.name)
        kind = hints[item.name]
        typed = (
            isinstance(value, bool)
            if kind is bool
            else isinstance(value, int) and not isinstance(value, bool)
            if kind is int
            else isinstance(value, (int, float)) and not isinstance(value, bool)
            if kind is float
            else isinstance(value, kind)
        )
        spec = item.metadata.get("param", ParamSpec())
        if not typed or not spec.allows(value):
            expected = _KINDS.get(kind, "text")
            allowed = (
                spec.describe() if spec.choices else expected if kind is bool else f"{expected} ({spec.describe()})"
            )
            raise KvlabError(f"Parameter {item.name!r} of {what} must be {allowed}, not {value!r}.")


def coerce(cls: type, name: str, text: str, what: str) -> object:
    """A command-line string turned into the type the dataclass ``cls`` declares for ``name``; one sentence naming
    ``what`` when it is not one."""
    kind = declared_type(cls, name)
    try:
        if kind is bool:
            if text.lower() in ("1", "true", "yes", "on"):
                return True
            if text.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(text)
        return kind(text)
    except ValueError:
        expected = _KINDS.get(kind, "a string") if kind is not str else "a string"
        raise KvlabError(f"Parameter {name!r} of {what} must be {expected}, not {text!r}.") from None


def names(cls: type) -> tuple[str, ...]:
    """The parameter names of a dataclass, in declaration order."""
    return tuple(item.name for item in fields(cls))


def defaults(cls: type) -> dict[str, Any]:
    """Each parameter of a dataclass with its default."""
    return {item.name: item.default for item in fields(cls) if item.default is not dataclasses.MISSING}
