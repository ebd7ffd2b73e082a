"""The Streamlit side every page shares: the model picker, the run store, and waiting for the device.

``app.py`` draws the picker in the sidebar on every run and leaves the loaded model (or None) in the session state;
pages read it with :func:`current_model`. Models are loaded once per server process and shared by every session.
"""

from __future__ import annotations

import contextlib
import runpy
from collections.abc import Iterator
from pathlib import Path

import streamlit as st
from streamlit.delta_generator import DeltaGenerator
from streamlit.runtime.pages_manager import PagesManager

from kvlab.errors import KvlabError
from kvlab.models import LoadedModel, default_model, load_model
from kvlab.store import Store, default_db_path, open_store
from kvlab.ui.device_queue import DEVICE_QUEUE, Ticket, Waiting
from kvlab.ui.live import warm_up

APP_SCRIPT = Path(__file__).resolve().parents[2] / "app.py"
MODEL_KEY = "kvlab_model_name"
LOADED_KEY = "kvlab_loaded_model"


def page_setup() -> None:
    """Make sure a page runs inside ``app.py``'s navigation and sidebar; every page calls it first.

    Because the page files live in a directory named ``pages/``, Streamlit starts a server in its legacy multipage
    mode, which it leaves only once ``app.py`` has declared the pages. When the very first request a server gets
    opens a page by its URL, Streamlit runs that page file on its own. Then ``app.py`` is run here, in the same
    script run (so a click that started it is not lost), and it draws the sidebar and runs the page; this run of
    the page file ends when that is done.
    """
    if PagesManager.uses_pages_directory:
        runpy.run_path(str(APP_SCRIPT), run_name="__main__")
        st.stop()


@st.cache_resource(show_spinner=False, max_entries=3)
def cached_model(name: str) -> LoadedModel:
    """Load a model once per server process, and run it once on a few tokens so that the one-time setup of its
    kernels is not charged to the first live run."""
    loaded = load_model(name)
    warm_up(loaded)
    return loaded


def model_name() -> str:
    """The model the user picked (the default model until they pick another)."""
    return str(st.session_state.get(MODEL_KEY) or default_model()).strip()


def model_sidebar() -> LoadedModel | None:
    """The sidebar's model picker: a hub id or a local directory, loaded with a spinner the first time; a model
    that cannot be loaded is one sentence in the sidebar, and the pages that need no model keep working."""
    st.session_state.setdefault(MODEL_KEY, default_model())
    sidebar = st.sidebar
    sidebar.text_input("Model", key=MODEL_KEY, help="A Hugging Face hub id (e.g. Qwen/Qwen2.5-0.5B) or a local "
                       "model directory. It is loaded once and shared by every session of this server.")
    loaded: LoadedModel | None = None
    try:
        with sidebar, st.spinner(f"Loading {model_name()}…"):
            loaded = cached_model(model_name())
    except KvlabError as error:
        sidebar.error(str(error))
    else:
        arch = loaded.arch
        sidebar.caption(
            f"{arch.model_type} · {arch.num_layers} layers · {arch.num_q_heads} query / {arch.num_kv_heads} KV "
            f"heads · head dim {arch.head_dim}  \nRunning on **{loaded.device}** in "
            f"{str(loaded.dtype).replace('torch.', '')}"
        )
    sidebar.caption(f"Runs are stored in `{default_db_path()}`")
    st.session_state[LOADED_KEY] = loaded
    return loaded


def current_model() -> LoadedModel | None:
    """The model the sidebar loaded in this run, or None if it could not be loaded."""
    loaded = st.session_state.get(LOADED_KEY)
    return loaded if isinstance(loaded, LoadedModel) else None


def run_store() -> Store | None:
    """The run database, or None with the reason on the page (locked by another process, corrupt, not kvlab's)."""
    try:
        return open_store()
    except KvlabError as error:
        st.error(str(error))
        return None


def user_name() -> str | None:
    """Who is logged in, when the server has authentication configured; stored with the runs they start."""
    email = st.user.get("email")
    return email if isinstance(email, str) else None


@contextlib.contextmanager
def device_turn(label: str, notice: DeltaGenerator) -> Iterator[Ticket]:
    """Hold the device for the block, showing in ``notice`` how many runs are ahead while waiting."""
    def show(waiting: Waiting) -> None:
        notice.info(waiting.sentence(), icon=":material/hourglass_top:")

    with DEVICE_QUEUE.turn(label, show) as ticket:
        notice.empty()
        yield ticket
