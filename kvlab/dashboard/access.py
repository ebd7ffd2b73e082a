"""Who may use a dashboard server, and which models it may load. Nothing here imports Streamlit.

A server shared by a team either asks for an OIDC login (Streamlit's ``st.login``, configured by an ``[auth]``
section in ``.streamlit/secrets.toml``), or serves only the machine it runs on unless its operator binds it wider;
the page says which, so nobody serves a GPU to a network by accident. ``KVLAB_ALLOWED_MODELS`` limits what the
model picker may load: a browser must not make the server download or run arbitrary models. Models are never
loaded with ``trust_remote_code`` from the dashboard (see :func:`kvlab.dashboard.session.cached_model`).
"""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from kvlab.errors import KvlabError, shown_name
from kvlab.models.catalog import ModelEntry

#: Environment variable with the comma-separated hub ids or model directories the server may load (empty: any).
ALLOWED_MODELS_ENV = "KVLAB_ALLOWED_MODELS"
#: The settings an OIDC provider needs besides the shared ``redirect_uri`` and ``cookie_secret``.
PROVIDER_KEYS = ("client_id", "client_secret", "server_metadata_url")
#: Environment variable with the comma-separated host names (as browsers send them) the server answers to.
ALLOWED_HOSTS_ENV = "KVLAB_ALLOWED_HOSTS"
#: Names of this machine that are always allowed.
LOCAL_HOSTS = ("localhost", "127.0.0.1", "::1")
#: What the model box answers for any name that leads to no loadable model, whether or not a file is there.
NOT_A_MODEL = (
    "{name} is not a model this server can load: give a hub id, a GGUF file, or the directory of a "
    "decoder-only causal language model with its config.json, tokenizer and weights."
)


def allowed_models(env: Mapping[str, str] = os.environ) -> tuple[str, ...]:
    """The models this server may load, from ``$KVLAB_ALLOWED_MODELS``; empty when any model is allowed."""
    return tuple(name.strip() for name in env.get(ALLOWED_MODELS_ENV, "").split(",") if name.strip())


def _identity(name: str) -> str:
    """A model name compared by what it loads: an existing directory by its resolved path (so ``./x``, ``x/`` and
    ``/abs/x`` are one model, and ``..`` cannot step out of an allowed directory), a hub id as written."""
    try:
        path = Path(name.strip()).expanduser()
        return str(path.resolve()) if path.exists() else name.strip()
    except (OSError, ValueError, RuntimeError):  # a name no file system accepts names no path
        return name.strip()


def same_model(first: str, second: str) -> bool:
    """Whether two model names load the same thing (``./x``, ``x/`` and ``/abs/x`` are one directory)."""
    return _identity(first) == _identity(second)


def check_model_allowed(name: str, allowed: Sequence[str]) -> None:
    """Refuse, in one sentence naming what is allowed, a model outside a non-empty allow-list."""
    if allowed and _identity(name) not in {_identity(entry) for entry in allowed}:
        raise KvlabError(f"{name.strip()!r} is not a model this server may load; it allows {', '.join(allowed)}.")


def model_refusal(name: str) -> str:
    """The one sentence for a model name that leads to no loadable model (see :data:`NOT_A_MODEL`)."""
    return NOT_A_MODEL.format(name=shown_name(name.strip()))


def allowed_hosts(env: Mapping[str, str] = os.environ) -> tuple[str, ...]:
    """The host names the server answers to: this machine's names and those in ``$KVLAB_ALLOWED_HOSTS``."""
    extra = tuple(name.strip().lower() for name in env.get(ALLOWED_HOSTS_ENV, "").split(",") if name.strip())
    return LOCAL_HOSTS + extra


def host_name(header: str) -> str:
    """The host part of a ``Host`` header (``name:port``, ``[v6]:port``), lower-cased."""
    text = header.strip().lower()
    if text.startswith("["):
        return text[1:].split("]", 1)[0]
    return text.rsplit(":", 1)[0] if text.count(":") == 1 else text


def host_allowed(header: str | None, allowed: Sequence[str]) -> bool:
    """Whether a request's ``Host`` header names this server. A browser always sends one; a page that another
    site's DNS points at this machine (DNS rebinding) arrives with that site's name and is refused. No header at
    all is a request from inside the process (a test), not a browser."""
    return header is None or host_name(header) in allowed


def pickable_models(entries: Sequence[ModelEntry], allowed: Sequence[str]) -> list[ModelEntry]:
    """The models found on this machine that this server may load (all of them without an allow-list)."""
    return [entry for entry in entries if not allowed or _is_allowed(entry.name, allowed)]


def _is_allowed(name: str, allowed: Sequence[str]) -> bool:
    try:
        check_model_allowed(name, allowed)
    except KvlabError:
        return False
    return True


def initial_model(default: str, allowed: Sequence[str]) -> str:
    """The model the picker starts with: the default model, or the first allowed one when the default is not."""
    return default if _is_allowed(default, allowed) else allowed[0]


def login_providers(auth: Mapping[str, Any]) -> list[str | None]:
    """The OIDC providers an ``[auth]`` section configures: ``None`` for settings written in ``[auth]`` itself
    (``st.login()``), else the names of its ``[auth.<name>]`` tables (``st.login(name)``)."""
    providers: list[str | None] = [None] if all(key in auth for key in PROVIDER_KEYS) else []
    providers += [
        name
        for name, value in auth.items()
        if isinstance(value, Mapping) and all(key in value for key in PROVIDER_KEYS)
    ]
    return providers


def user_label(user: Mapping[str, Any]) -> str | None:
    """Who a logged-in user is, as stored with the runs they start: their email, else another claim that names
    them; None when nobody is logged in."""
    for claim in ("email", "preferred_username", "name", "sub"):
        value = user.get(claim)
        if isinstance(value, str) and value.strip():
            return value.strip()
    return None


def is_loopback(address: str | None) -> bool:
    """Whether a server bound to ``address`` is reachable from this machine only (unset binds every interface)."""
    if not address:
        return False
    if address.strip("[]").lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(address.strip("[]")).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class Exposure:
    """What the sidebar says about who can reach the server: ``level`` ``caption`` for a safe setup, ``warning``
    for a server without login that listens beyond this machine."""

    level: Literal["caption", "warning"]
    sentence: str


def exposure(address: str | None, login: bool) -> Exposure:
    """Who can reach a server bound to ``address``, with or without a login."""
    where = "this machine only" if is_loopback(address) else f"{address or 'every interface'}"
    if login:
        return Exposure("caption", f"Login required (OIDC); listening on {where}.")
    if is_loopback(address):
        return Exposure("caption", f"No login configured: serving this machine only ({address}).")
    return Exposure(
        "warning",
        f"No login configured, and the server listens on {where}: anyone who can reach its "
        "port can run models here. Configure an OIDC login, or publish the port on localhost "
        "only (docs/deployment.md).",
    )
