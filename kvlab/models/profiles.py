"""A model's attention profile: its mean attention entropy per layer (and per KV head) over a held-out text read
with the full cache, measured once and stored, so that the ``entropy`` layer allocation (:mod:`kvlab.cache.allocation`)
spreads a budget by it without measuring anything at run time.

The entropy comes from the engine's own statistics (the live page's), read in chunks: each chunk's queries are
averaged, and the first chunk is left out, since queries near the start of a text see only a few keys and their
entropy is low whatever the layer. The profile also keeps CAKE's dispersion and shift of each layer for the text's
last observation window, to show what CAKE's per-prompt allocation gives on that text.

A profile is JSON named by the first 16 hex digits of the weights' hash: the shipped models' profiles are kept in
``kvlab/data/profiles/`` (written with ``--out kvlab/data/profiles``), a user's in ``$KVLAB_PROFILES``, else
``$XDG_DATA_HOME/kvlab/profiles``, else ``~/.local/share/kvlab/profiles``. A user's profile of a model is used before
a shipped one. Measuring one is the engine's (:mod:`kvlab.engine.profile`).
"""

from __future__ import annotations

import json
import os
import shlex
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

from kvlab.errors import KvlabError
from kvlab.hashing import text_sha256
from kvlab.models.catalog import installed_name
from kvlab.paths import shipped, user_file

PROFILE_ENV_VAR = "KVLAB_PROFILES"
#: The profiles of the models kvlab ships, committed with it.
SHIPPED_PROFILES_DIR = shipped("profiles")
#: The held-out text a profile reads unless told otherwise: Python documentation the shipped model never trained on,
#: not the text the quality pass scores (``python-docs-1.txt``), so budgets are not fitted to what measures them.
DEFAULT_PROFILE_TEXT = shipped("haystacks", "python-docs-4.txt")
DEFAULT_PROFILE_TOKENS = 2048
#: Tokens per forward pass; the first chunk's queries are left out of the means.
PROFILE_CHUNK = 256
PROFILE_FORMAT = 1


@dataclass(frozen=True)
class Profile:
    """One model's attention profile and what it was measured on.

    ``entropy`` is each layer's mean attention entropy in nats (over its query heads and the queries after the first
    chunk), ``head_entropy`` the same per KV head (the mean over the query heads sharing it). ``cake_dispersion``
    and ``cake_shift`` are CAKE's ``H`` and ``V`` of each layer for the text's last ``cake_window`` queries
    (:func:`kvlab.cache.allocation.cake_dispersion_and_shift`). ``tokens`` were read, in chunks of ``chunk``, from the
    text named ``text`` (its UTF-8 content's sha256 in ``text_sha256``) by the tokenizer of hash ``tokenizer_hash``.
    """

    model: str
    weights_hash: str
    tokenizer_hash: str | None
    text: str
    text_sha256: str
    tokens: int
    chunk: int
    device: str
    dtype: str
    kvlab_version: str
    entropy: tuple[float, ...]
    head_entropy: tuple[tuple[float, ...], ...]
    cake_window: int
    cake_dispersion: tuple[float, ...]
    cake_shift: tuple[float, ...]

    @property
    def num_layers(self) -> int:
        return len(self.entropy)

    @property
    def file_name(self) -> str:
        return profile_file_name(self.weights_hash)

    def to_json(self) -> dict[str, Any]:
        """The profile as one JSON object (lists for tuples), with its format."""
        return {"format": PROFILE_FORMAT, **json.loads(json.dumps(asdict(self)))}

    def digest(self) -> str:
        """sha256 of the profile's canonical JSON: what a run allocated by it can record as its identity."""
        return text_sha256(json.dumps(self.to_json(), sort_keys=True))

    @classmethod
    def from_json(cls, data: Any, source: str) -> Profile:
        """A profile from its JSON object; one sentence naming ``source`` when it is not one."""
        try:
            if data.get("format") != PROFILE_FORMAT:
                raise ValueError
            profile = cls(
                model=str(data["model"]),
                weights_hash=str(data["weights_hash"]),
                tokenizer_hash=None if data["tokenizer_hash"] is None else str(data["tokenizer_hash"]),
                text=str(data["text"]),
                text_sha256=str(data["text_sha256"]),
                tokens=int(data["tokens"]),
                chunk=int(data["chunk"]),
                device=str(data["device"]),
                dtype=str(data["dtype"]),
                kvlab_version=str(data["kvlab_version"]),
                entropy=_numbers(data["entropy"]),
                head_entropy=tuple(_numbers(row) for row in data["head_entropy"]),
                cake_window=int(data["cake_window"]),
                cake_dispersion=_numbers(data["cake_dispersion"]),
                cake_shift=_numbers(data["cake_shift"]),
            )
        except (AttributeError, KeyError, TypeError, ValueError):
            raise KvlabError(f"{source} is not a kvlab attention profile of format {PROFILE_FORMAT}.") from None
        layers = profile.num_layers
        if layers == 0 or not (len(profile.head_entropy) == len(profile.cake_dispersion) == len(profile.cake_shift)):
            raise KvlabError(f"{source} does not hold one entry per layer in each of its per-layer lists.")
        return profile


def _numbers(values: Any) -> tuple[float, ...]:
    """Non-negative finite numbers from a JSON list (``ValueError`` otherwise)."""
    numbers = tuple(float(value) for value in values)
    if any(not 0 <= number < float("inf") for number in numbers):
        raise ValueError("negative or non-finite")
    return numbers


def profile_file_name(weights_hash: str) -> str:
    """The file a model's profile is stored in: the first 16 hex digits of its weights' hash."""
    return f"{weights_hash[:16]}.json"


def user_profiles_dir(env: Mapping[str, str] = os.environ) -> Path:
    """Where a user's profiles go: ``$KVLAB_PROFILES``, else under the XDG data directory."""
    return user_file(env, PROFILE_ENV_VAR, "XDG_DATA_HOME", ".local/share", "kvlab", "profiles")


def read_profile(path: Path) -> Profile:
    """The profile in ``path``; one sentence when it cannot be read or is not a profile."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as error:
        raise KvlabError(f"Cannot read the attention profile {path}: {error.strerror or error}.") from None
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise KvlabError(f"The attention profile {path} is not JSON.") from None
    return Profile.from_json(data, f"The file {path}")


def load_profile(weights_hash: str, env: Mapping[str, str] = os.environ) -> Profile | None:
    """The stored profile of the weights with this hash: the user's, else the shipped one, else ``None``."""
    for directory in (user_profiles_dir(env), SHIPPED_PROFILES_DIR):
        path = directory / profile_file_name(weights_hash)
        if path.is_file():
            profile = read_profile(path)
            if profile.weights_hash == weights_hash:
                return profile
    return None


class _Labelled(Protocol):
    @property
    def label(self) -> str: ...


class ProfiledModel(Protocol):
    """What finds a loaded model's stored profile (:class:`kvlab.models.loading.LoadedModel` is one): the name it was
    loaded as, its weights' hash, and the label of where it came from. Structural, so that reading profiles needs no
    torch."""

    @property
    def name(self) -> str: ...

    @property
    def weights_hash(self) -> str | None: ...

    @property
    def source(self) -> _Labelled: ...


def profile_command(loaded: ProfiledModel) -> str:
    """The command that measures and stores a loaded model's profile: the model named by its label where the label
    loads it (a shipped or installed model, a hub id), else as it was loaded."""
    label = loaded.source.label
    name = label if installed_name(label) != label or label == loaded.name else loaded.name
    return f"kvlab profile --model {shlex.quote(name)}"


def require_profile(loaded: ProfiledModel, env: Mapping[str, str] = os.environ) -> Profile:
    """The stored profile of a loaded model, for the ``entropy`` allocation; one sentence naming the command to run
    when there is none."""
    weights_hash = loaded.weights_hash
    profile = load_profile(weights_hash, env) if weights_hash is not None else None
    if profile is None:
        raise KvlabError(
            f"The entropy allocation needs the attention profile of {loaded.source.label}, which has none yet; "
            f"measure it with `{profile_command(loaded)}`."
        )
    return profile


def output_path(out: str | None, weights_hash: str, env: Mapping[str, str] = os.environ) -> Path:
    """Where a measured profile is written: ``out`` if it names a file, the profile's file in ``out`` if it is a
    directory (an existing one, or a path ending in a separator), else in the user's profile directory."""
    if out is None:
        return user_profiles_dir(env) / profile_file_name(weights_hash)
    path = Path(out).expanduser()
    if path.is_dir() or out.endswith(("/", os.sep)):
        return path / profile_file_name(weights_hash)
    return path


def check_output(out: str | None, env: Mapping[str, str] = os.environ) -> None:
    """Refuse, before any measuring, an output whose nearest existing ancestor is not a writable directory."""
    target = Path(out).expanduser() if out is not None else user_profiles_dir(env)
    existing = target
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if existing == target and target.is_file():
        existing = target.parent
    if not existing.is_dir() or not os.access(existing, os.W_OK):
        raise KvlabError(f"Cannot write the attention profile under {existing}: it is not a writable directory.")


def save_profile(profile: Profile, path: Path) -> Path:
    """Write the profile as JSON to ``path`` (its directories made as needed); one sentence if that fails."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(profile.to_json(), indent=1) + "\n", encoding="utf-8")
    except OSError as error:
        raise KvlabError(f"Cannot write the attention profile to {path}: {error.strerror or error}.") from None
    return path
