"""The Advisor page's answer, worked out once per request and version of the store it reads: reading every stored
trial and pairing each configuration with the full cache takes about a second and a half, which a page that redraws
on every widget change should not repeat."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import streamlit as st

from kvlab.costs.measured import load_measured_decode
from kvlab.dashboard.session import open_page_store
from kvlab.runs.advisor import Advice, AdviceRequest, advise, evidence_runs
from kvlab.store import StoreVersion, store_version


@st.cache_data(show_spinner=False, max_entries=32)
def _advice(path: str, version: StoreVersion, request: AdviceRequest) -> tuple[Advice, pd.DataFrame]:
    """:func:`~kvlab.runs.advisor.advise` over the store at ``path`` as it was at ``version``, with the runs the
    advice rests on."""
    with open_page_store(Path(path)) as store:
        trials = store.trials_frame()
    advice = advise(request, trials, load_measured_decode())
    return advice, evidence_runs(advice, trials)


def stored_advice(path: Path, request: AdviceRequest) -> tuple[Advice, pd.DataFrame]:
    """The advice for ``request`` from the store at ``path`` and the runs it rests on, worked out again only when
    the store changes."""
    return _advice(str(path), store_version(path), request)
