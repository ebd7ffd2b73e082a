"""The Claims page, driven headless through Streamlit's AppTest: every claim shown with kvlab's figure or the
reason there is none, filters, and a refresh that stores the claims in the dashboard's store."""

from __future__ import annotations

import pytest
from streamlit.testing.v1 import AppTest

from kvlab.claims import BY_ID, CATALOGUE
from kvlab.claims.verdicts import FAILS
from kvlab.store import open_store

pytestmark = pytest.mark.model


def claims_page() -> AppTest:
    app = AppTest.from_file("../../app.py", default_timeout=120)
    app.run()
    app.switch_page("views/claims.py")
    app.run()
    assert not app.exception, app.exception
    assert app.title[0].value == "Claims"
    return app


def cards(app: AppTest) -> dict[str, list[str]]:
    """The Markdown of each claim's card, by claim id."""
    shown: dict[str, list[str]] = {}
    current = None
    for element in app.main.markdown:
        text = element.value
        if text.startswith("**") and "** · " in text:
            current = text[2 : text.index("** · ")]
            shown[current] = []
        if current is not None:
            shown[current].append(text)
    return shown


def test_every_claim_is_shown_with_its_figure_or_reason(db):
    app = claims_page()
    shown = cards(app)
    assert list(shown) == [claim.claim_id for claim in CATALOGUE]
    for claim_id, texts in shown.items():
        body = "\n".join(texts)
        assert "**kvlab:**" in body or "**Not measured here:**" in body, claim_id
        assert "nan" not in body.split() and "None" not in body.split(), claim_id
    assert len(app.code) == len(CATALOGUE) and app.code[0].value == "python -m kvlab claims --only 1"
    assert "not stored yet" in app.caption[1].value and not db.exists()  # showing never creates the store


def test_pages_name_the_store_not_its_place_on_the_server_unless_the_operator_asks(db, monkeypatch):
    app = claims_page()
    shown = (" ".join(caption.value for caption in app.sidebar.caption) + " ".join(app.radio[0].options)).replace(
        "\\", ""
    )  # as Markdown shows it
    assert "runs.duckdb" in shown and str(db.parent) not in shown
    monkeypatch.setenv("KVLAB_SHOW_PATHS", "1")
    app = claims_page()
    assert str(db) in " ".join(caption.value for caption in app.sidebar.caption).replace("\\", "")


@pytest.mark.slow
def test_filters_and_refresh(db):
    app = claims_page()
    failing = int(next(metric.value for metric in app.metric if metric.label.endswith(FAILS)))
    app.multiselect[0].set_value([FAILS]).run()
    assert len(cards(app)) == failing > 0
    app.multiselect[0].set_value([]).run()
    article = BY_ID["36"].article_label
    app.multiselect[1].set_value([article]).run()
    assert set(cards(app)) == {claim.claim_id for claim in CATALOGUE if claim.article_label == article}
    app.button[0].click().run()
    assert not app.exception, app.exception
    assert "as stored in" in app.caption[1].value
    with open_store(db, read_only=True) as store:
        assert len(store.claims_frame()) == len(CATALOGUE)
