"""Claims: every quantitative claim of the source articles next to kvlab's own figure, with a verdict."""

from __future__ import annotations

import streamlit as st

from kvlab.claims import ARTICLES, EVIDENCE_DB, VERDICTS, refresh
from kvlab.dashboard.claims import MARKS, claims_of, claims_view, verdict_badge, verdict_counts
from kvlab.dashboard.session import open_page_store, page_store, shown_store, without_paths
from kvlab.dashboard.text import plain
from kvlab.errors import KvlabError
from kvlab.store import default_db_path, has_database

st.title("Claims")
st.caption(
    "Every quantitative claim of the articles kvlab grew from, beside kvlab's own figure: computed from the "
    "models' published configs and GPU datasheets (kvlab.costs), measured from the runs in a store, or marked as "
    "not measurable here with the reason. Each verdict follows from kvlab's figure by a rule written per claim; "
    "the command under it reproduces the figure. The same evaluation as `python -m kvlab claims`."
)

stores = {f"the dashboard's store ({shown_store(default_db_path())})": default_db_path()}
if EVIDENCE_DB.is_file() and EVIDENCE_DB.resolve() != default_db_path().resolve():
    stores[f"the shipped evidence ({shown_store(EVIDENCE_DB)})"] = EVIDENCE_DB
chosen = st.radio("Evaluated against", list(stores), horizontal=True, format_func=plain)
path = stores[chosen]

try:
    claims, stored = claims_of(open_page_store(path) if has_database(path) else None, path)
except KvlabError as error:
    st.error(plain(without_paths(str(error), path)))
    st.stop()

counts = verdict_counts(claims)
for column, (verdict, count) in zip(st.columns(len(counts)), counts.items()):
    column.metric(f"{MARKS[verdict]} {verdict}", count)

left, right = st.columns(2)
verdicts = left.multiselect("Verdict", list(VERDICTS), placeholder="every verdict")
articles = right.multiselect(
    "Article", sorted(claims["article"].unique()), placeholder=f"all {len(ARTICLES)} articles", format_func=plain
)
view = claims_view(claims, verdicts, articles)
store_name = plain(shown_store(path))
if stored:
    refreshed = claims["refreshed_at"].max()
    st.caption(f"{len(view)} of {len(claims)} claims, as stored in {store_name} on {refreshed:%Y-%m-%d %H:%M} UTC.")
else:
    st.caption(f"{len(view)} of {len(claims)} claims, evaluated now against {store_name}; not stored yet.")

if path == default_db_path():
    if st.button("Refresh from the store", help="Evaluate every claim again and keep the result in the store."):
        store = page_store(write=True)
        if store is not None:
            try:
                refresh(store)
            except KvlabError as error:
                st.error(plain(str(error)))
            else:
                st.rerun()
else:
    st.caption("The shipped evidence is refreshed from the command line: `python -m kvlab claims --refresh`.")

for row in view.itertuples(index=False):
    with st.container(border=True, key=f"claim-{row.number}"):
        text, side = st.columns([3, 2])
        text.markdown(f"**{plain(row.number)}** · {plain(row.claim)}  \n:gray[article {plain(row.article)}]")
        if row.figure:
            text.markdown(f"**kvlab:** {plain(row.figure)}")
        if row.reason:
            text.markdown(f"**Not measured here:** {plain(row.reason)}")
        side.markdown(verdict_badge(row.verdict))
        if row.source:
            side.caption(f"from {plain(row.source)}")
        side.code(row.command, language="bash", wrap_lines=True)
