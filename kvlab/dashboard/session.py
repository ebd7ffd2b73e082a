"""The Streamlit side every page shares: the login, the model picker, the run store, and waiting for the device.

``app.py`` asks :func:`logged_in` first and shows only :func:`login_page` until it is true; then it draws the picker
in the sidebar on every run and leaves the loaded model (or None) in the session state; pages read it with
:func:`current_model`. Models are loaded once per server process and shared by every session.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import streamlit as st
import torch
from streamlit.delta_generator import DeltaGenerator

from kvlab.claims import EVIDENCE_DB
from kvlab.dashboard.access import (
    allowed_hosts,
    allowed_models,
    check_model_allowed,
    exposure,
    host_allowed,
    initial_model,
    login_providers,
    model_refusal,
    pickable_models,
    same_model,
    user_label,
)
from kvlab.dashboard.claims import NeedleEvidence, needle_evidence
from kvlab.dashboard.text import plain
from kvlab.errors import KvlabError, NotAModel
from kvlab.guard import log_to_server
from kvlab.models.catalog import ModelEntry, available_models
from kvlab.models.loading import LoadedModel, default_model, load_model
from kvlab.runs.device_queue import Waiting
from kvlab.runs.live import warm_up
from kvlab.runs.replay import Replay, unpack
from kvlab.runs.tables import short_model_name
from kvlab.store import Store, StoreVersion, default_db_path, has_database, open_store, store_version

_LOGGER = logging.getLogger(__name__)

MODEL_KEY = "kvlab_model_name"
PICK_KEY = "kvlab_model_pick"
LOADED_KEY = "kvlab_loaded_model"
DEVICE_MAP_KEY = "kvlab_device_map"
#: How the picker may place a model on a machine with several GPUs: on one GPU, or split by a device map
#: (:func:`kvlab.models.loading.resolve_device_map`).
DEVICE_MAP_CHOICES: dict[str | None, str] = {
    None: "one GPU",
    "balanced": "balanced over the GPUs",
    "sequential": "sequential (fill the first GPU first)",
}

#: The operator's setting under which pages show a store's path on the server (else its file name).
SHOW_PATHS_ENV = "KVLAB_SHOW_PATHS"


def auth_settings() -> Mapping[str, Any]:
    """The ``[auth]`` section of the server's secrets (empty when there is none): present means login required."""
    if not st.secrets.load_if_toml_exists():
        return {}
    auth = st.secrets.get("auth")
    return auth if isinstance(auth, Mapping) else {}


def right_host() -> bool:
    """Whether the browser reached this server by one of its own names (``Host`` header); a page that another
    site's DNS points here is told so and nothing else runs for it."""
    if host_allowed(st.context.headers.get("Host"), allowed_hosts()):
        return True
    st.error(
        "This kvlab server does not answer to the name this page used. Open it by one of its own names; its "
        "operator lists them in KVLAB_ALLOWED_HOSTS."
    )
    return False


def show_details() -> bool:
    """Whether the server is in development mode (``client.showErrorDetails`` set to show them), where a bug's
    traceback may reach the browser; otherwise it goes to the server log only."""
    return st.get_option("client.showErrorDetails") in ("full", "stacktrace", True)


def guarded(work: Callable[[], object], where: str) -> None:
    """Run a page: a sentence a user caused is shown as it is; a bug becomes one sentence with a reference, its
    traceback in the server log (outside development mode)."""
    try:
        work()
    except KvlabError as error:
        st.error(plain(str(error)))
    except Exception as error:
        if show_details():
            raise  # development mode: Streamlit shows the traceback
        st.error(plain(log_to_server(error, where)))


def logged_in() -> bool:
    """Whether this session may use the dashboard: always without an ``[auth]`` section, else once logged in."""
    return not auth_settings() or bool(st.user.get("is_logged_in"))


def login_page() -> None:
    """All that a session which is not logged in sees: one button per configured OIDC provider."""
    st.title("kvlab")
    st.write("This kvlab server is for its team only: log in to use it.")
    providers = login_providers(auth_settings())
    if not providers:
        st.error(
            "The server's [auth] settings name no OIDC provider (client_id, client_secret and "
            "server_metadata_url), so nobody can log in; ask its operator."
        )
    for provider in providers:
        label = "Log in" if provider is None else f"Log in with {provider}"
        if st.button(label, type="primary", icon=":material/login:", key=f"login-{provider or 'default'}"):
            st.login(provider)


def current_user() -> str | None:
    """Who is logged in (their email), when the server has a login; stored with the runs they start."""
    return user_label(st.user)


def access_sidebar() -> None:
    """Who the sidebar says can reach this server, and, when logged in, who is and how to log out."""
    login = bool(auth_settings())
    notice = exposure(st.get_option("server.address"), login)
    if notice.level == "warning":
        st.sidebar.warning(notice.sentence, icon=":material/public:")
    else:
        st.sidebar.caption(notice.sentence)
    user = current_user()
    if login and user is not None:
        name, logout = st.sidebar.columns([3, 1], vertical_alignment="center")
        name.caption(f"Logged in as **{plain(user)}**")
        if logout.button("Log out", key="logout"):
            st.logout()


@st.cache_resource(show_spinner=False, max_entries=3)
def cached_model(name: str, device_map: str | None = None) -> LoadedModel:
    """Load a model once per server process (once per device map), and run it once on a few tokens so that the
    one-time setup of its kernels is not charged to the first live run.

    Never with ``trust_remote_code``: a browser must not be able to make the server run code from the hub.
    """
    loaded = load_model(name, trust_remote_code=False, device_map=device_map)
    warm_up(loaded)
    return loaded


def allowed_model(name: str) -> LoadedModel:
    """The model ``name`` if this server may load it (``$KVLAB_ALLOWED_MODELS``), loaded once per process and
    placed as the picker's device map says."""
    check_model_allowed(name, allowed_models())
    return cached_model(name.strip(), picked_device_map())


def several_gpus() -> bool:
    """Whether this server sees more than one GPU, so that a model can be split over them."""
    return torch.cuda.is_available() and torch.cuda.device_count() > 1


def picked_device_map() -> str | None:
    """The device map picked in the sidebar (``None``: one device); none where the server has fewer than two
    GPUs."""
    picked = st.session_state.get(DEVICE_MAP_KEY)
    return picked if picked in DEVICE_MAP_CHOICES and several_gpus() else None


def device_map_picker(sidebar: DeltaGenerator) -> None:
    """The device-map choice, drawn only on a server with several GPUs: one GPU, or the model's layers split over
    all of them (each layer's cache then lives on its layer's GPU)."""
    if not several_gpus():
        return
    sidebar.selectbox(
        "Placement",
        list(DEVICE_MAP_CHOICES),
        format_func=lambda choice: DEVICE_MAP_CHOICES[choice],
        key=DEVICE_MAP_KEY,
        help="Split the model's decoder layers over this server's GPUs by accelerate's device map; each GPU holds "
        "the cache of its own layers. A model is loaded once per placement.",
    )


def model_name() -> str:
    """The model the user picked (the default model, or the first allowed one, until they pick another)."""
    picked = st.session_state.get(MODEL_KEY)
    return str(picked if picked is not None else initial_model(default_model(), allowed_models())).strip()


def model_sidebar() -> LoadedModel | None:
    """The sidebar's model picker: the models found on this machine (shipped, installed from the package registry,
    in the Hugging Face cache) in a list, and a box for any hub id, directory or GGUF file; the model is loaded with
    a spinner the first time. A model that cannot be loaded, or that the server does not allow, is one sentence in
    the sidebar, and the pages that need no model keep working."""
    allowed = allowed_models()
    st.session_state.setdefault(MODEL_KEY, initial_model(default_model(), allowed))
    sidebar = st.sidebar
    found = {entry.name: entry for entry in pickable_models(found_models(), allowed)}
    st.session_state.setdefault(PICK_KEY, _found_name(st.session_state[MODEL_KEY], found))
    sidebar.selectbox(
        "Models on this machine",
        list(found),
        format_func=lambda name: f"{found[name].label} ({found[name].where})",
        key=PICK_KEY,
        placeholder="another model, typed below",
        on_change=_copy_pick,
        help="Shipped with kvlab, installed published models, and models in the local Hugging Face cache.",
    )
    only = f" This server loads only: {', '.join(allowed)}." if allowed else ""
    sidebar.text_input(
        "Model",
        key=MODEL_KEY,
        on_change=_match_pick,
        args=(found,),
        help="A Hugging Face hub id (e.g. Qwen/Qwen2.5-0.5B), a local model directory, or a GGUF file (a path, or "
        "owner/repo/file.gguf). It is loaded once and shared by every session of this server." + only,
    )
    device_map_picker(sidebar)
    loaded: LoadedModel | None = None
    name = model_name()
    try:
        if not name:
            raise KvlabError(
                "The model box is empty, so no model is loaded and the pages that run one are off: pick a model "
                f"in the list above, or type a hub id, a directory or a GGUF file (the default is "
                f"{short_model_name(initial_model(default_model(), allowed))})."
            )
        with sidebar, st.spinner(f"Loading {plain(name[:80])}…"):
            loaded = allowed_model(name)
    except NotAModel as error:
        _LOGGER.info("model %r refused: %s", name[:200], error)
        sidebar.error(plain(model_refusal(name)))
    except KvlabError as error:
        sidebar.error(plain(str(error)))
    except Exception as error:  # a bug while loading must not take every page down with it
        sidebar.error(plain(log_to_server(error, "loading a model")))
    else:
        arch = loaded.arch
        sidebar.caption(
            plain(
                f"{arch.model_type} · {arch.num_layers} layers · {arch.num_q_heads} query / {arch.num_kv_heads} KV "
                f"heads · head dim {arch.head_dim}"
            )
            + f"  \n{plain(loaded.source.label)}: {plain(loaded.source.describe())}"
            + f"  \nRunning on **{plain(loaded.placement())}** in {loaded.dtype_name}"
        )
    sidebar.caption(f"Runs are stored in {plain(shown_store(default_db_path()))}")
    st.session_state[LOADED_KEY] = loaded
    return loaded


@st.cache_data(ttl=60, show_spinner=False)
def found_models() -> list[ModelEntry]:
    """The models on this machine, looked for at most once a minute (the Hugging Face cache may grow)."""
    return available_models()


def _found_name(name: str, found: Mapping[str, ModelEntry]) -> str | None:
    """The list entry for a typed model name, if the list has it (by what it loads, not how it is spelt)."""
    return next((entry for entry in found if same_model(entry, name)), None)


def _copy_pick() -> None:
    """A model picked from the list becomes the typed name."""
    picked = st.session_state.get(PICK_KEY)
    if picked is not None:
        st.session_state[MODEL_KEY] = picked


def _match_pick(found: Mapping[str, ModelEntry]) -> None:
    """A typed name selects its list entry, or none, so the list never shows another model than the box."""
    st.session_state[PICK_KEY] = _found_name(str(st.session_state.get(MODEL_KEY, "")), found)


def current_model() -> LoadedModel | None:
    """The model the sidebar loaded in this run, or None if it could not be loaded."""
    loaded = st.session_state.get(LOADED_KEY)
    return loaded if isinstance(loaded, LoadedModel) else None


def shown_store(path: Path) -> str:
    """A store as pages name it: its file name, not where it lies on the server, unless the operator sets
    ``KVLAB_SHOW_PATHS=1`` (a dashboard for one person on their own machine)."""
    return str(path) if os.environ.get(SHOW_PATHS_ENV) == "1" else path.name


def without_paths(text: str, path: Path) -> str:
    """A sentence about the store at ``path`` with its place on the server replaced by :func:`shown_store`."""
    for spelling in {str(path.expanduser().resolve()), str(path)}:
        text = text.replace(spelling, shown_store(path))
    return text


def open_page_store(path: Path | None = None, *, write: bool = False) -> Store:
    """The one way the dashboard opens a run store: the store at ``path``, else the dashboard's own
    (:func:`~kvlab.store.default_db_path`), read-only unless the page writes into it (a run, a sweep, a refresh of
    the claims), so that showing a store never creates, migrates or changes it. A store that cannot be opened
    (missing, for reading; locked, corrupt, not kvlab's, a full disk) is one sentence, raised."""
    return open_store(path if path is not None else default_db_path(), read_only=not write)


def page_store(path: Path | None = None, *, write: bool = False, slot: DeltaGenerator | None = None) -> Store | None:
    """:func:`open_page_store` for a page that goes on without the store: None when there is nothing to read yet
    (no file: the page says so), or with the reason it cannot be opened shown in ``slot``."""
    target = path if path is not None else default_db_path()
    if not write and not has_database(target):
        return None
    try:
        return open_page_store(target, write=write)
    except KvlabError as error:
        (slot or st).error(plain(without_paths(str(error), target)))
        return None


def browsed_store() -> Store | None:
    """The store a page that browses runs reads: a switch between
    this dashboard's own store and the shipped evidence (:data:`~kvlab.claims.EVIDENCE_DB`, GPU needle sweeps on two
    models, opened read-only), on the shipped runs at first when the own store holds none, so that the page shows
    measured content cold, before any run. Where no evidence is shipped, the own store alone."""
    own = page_store()
    own_has_runs = own is not None and not own.list_runs().empty
    if not EVIDENCE_DB.is_file():
        return own
    shipped = st.toggle(
        "Shipped runs",
        value=not own_has_runs,
        help=f"On: the runs shipped with kvlab ({shown_store(EVIDENCE_DB)}), measured with bench/claims_evidence.sh. "
        f"Off: this dashboard's own store ({shown_store(default_db_path())}).",
    )
    if not shipped:
        return own
    st.caption(
        f"Showing **shipped runs** ({plain(shown_store(EVIDENCE_DB))}), not this dashboard's own store"
        + ("" if own_has_runs else ", which holds no runs yet")
        + ". Switch *Shipped runs* off to see your own."
    )
    return open_page_store(EVIDENCE_DB)


def waiting_notice(notice: DeltaGenerator) -> Callable[[Waiting], None]:
    """What a run waiting for the device shows in ``notice``: how many runs are ahead and what is running."""

    def show(waiting: Waiting) -> None:
        notice.info(plain(waiting.sentence()), icon=":material/hourglass_top:")

    return show


@st.cache_resource(show_spinner=False, max_entries=16)
def _unpacked(payload: bytes) -> Replay:
    """A replay unpacked once per server process (scrubbing redraws the page at every step); keyed by its bytes,
    so a run recorded again is unpacked again."""
    return unpack(payload)


def stored_replay(path: Path, run_id: int, trial_key: str) -> Replay:
    """The replay of one stored run, from the store at ``path`` opened read-only."""
    with open_page_store(path) as store:
        payload = store.replay_payload(run_id, trial_key)
    return _unpacked(payload)


@st.cache_data(show_spinner=False, max_entries=4)
def _needle_evidence(path: str, version: StoreVersion) -> NeedleEvidence:
    """:func:`~kvlab.dashboard.claims.needle_evidence`, read again only when the store changes."""
    with open_page_store(Path(path)) as store:
        return needle_evidence(store)


def shipped_needle_evidence(path: Path) -> NeedleEvidence:
    """A store's needle evidence, read once per server process and version of the file."""
    return _needle_evidence(str(path), store_version(path))
