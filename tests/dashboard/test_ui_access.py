"""Who may use a dashboard server and which models it may load: the pure rules behind the login and the picker."""

from __future__ import annotations

import pytest

from kvlab.dashboard.access import (
    allowed_models,
    check_model_allowed,
    exposure,
    initial_model,
    is_loopback,
    login_providers,
    user_label,
)
from kvlab.errors import KvlabError
from kvlab.models.loading import DEFAULT_MODEL_DIR

PROVIDER = {"client_id": "id", "client_secret": "secret", "server_metadata_url": "https://idp/.well-known"}


def test_the_allow_list_is_a_comma_separated_environment_variable():
    assert allowed_models({}) == ()
    assert allowed_models({"KVLAB_ALLOWED_MODELS": " , "}) == ()
    assert allowed_models({"KVLAB_ALLOWED_MODELS": "Qwen/Qwen2.5-0.5B, /models/tiny ,"}) == (
        "Qwen/Qwen2.5-0.5B",
        "/models/tiny",
    )


def test_a_model_outside_the_allow_list_is_refused_naming_what_is_allowed(tmp_path, monkeypatch):
    check_model_allowed("anything/at-all", ())  # no list: any model
    allowed = ("Qwen/Qwen2.5-0.5B", str(DEFAULT_MODEL_DIR))
    check_model_allowed("Qwen/Qwen2.5-0.5B", allowed)
    with pytest.raises(
        KvlabError,
        match=r"'meta-llama/Llama-3.2-1B' is not a model this server may load; it "
        r"allows Qwen/Qwen2.5-0.5B, .*kvlab-tiny-llama\.",
    ):
        check_model_allowed("meta-llama/Llama-3.2-1B", allowed)
    with pytest.raises(KvlabError):
        check_model_allowed("qwen/qwen2.5-0.5b", allowed)  # hub ids are compared as written


def test_model_directories_are_compared_by_the_directory_they_name(tmp_path, monkeypatch):
    allowed_dir = tmp_path / "models" / "tiny"
    other_dir = tmp_path / "models" / "other"
    allowed_dir.mkdir(parents=True)
    other_dir.mkdir()
    monkeypatch.chdir(tmp_path)
    allowed = (str(allowed_dir),)
    for spelling in ("models/tiny", "./models/tiny/", f"{tmp_path}/models/other/../tiny"):
        check_model_allowed(spelling, allowed)
    for escape in ("models/other", "models/tiny/../other", str(other_dir)):
        with pytest.raises(KvlabError, match="not a model this server may load"):
            check_model_allowed(escape, allowed)


def test_the_picker_starts_with_an_allowed_model():
    assert initial_model("default/model", ()) == "default/model"
    assert initial_model("default/model", ("a/b", "default/model")) == "default/model"
    assert initial_model("default/model", ("a/b", "c/d")) == "a/b"


def test_login_providers_come_from_the_auth_section():
    assert login_providers({}) == []
    shared = {"redirect_uri": "http://localhost:8501/oauth2callback", "cookie_secret": "s" * 32}
    assert login_providers({**shared, "client_id": "id"}) == []  # incomplete: nobody can log in
    assert login_providers({**shared, **PROVIDER}) == [None]
    assert login_providers({**shared, "google": PROVIDER, "okta": {"client_id": "x"}}) == ["google"]


def test_runs_are_recorded_by_the_users_email_or_another_name_claim():
    assert user_label({}) is None
    assert user_label({"is_logged_in": False}) is None
    assert user_label({"is_logged_in": True, "email": "ann@example.com", "name": "Ann"}) == "ann@example.com"
    assert user_label({"is_logged_in": True, "email": " ", "name": "Ann"}) == "Ann"
    assert user_label({"sub": "1234"}) == "1234"


@pytest.mark.parametrize(
    "address, loopback",
    [
        ("localhost", True),
        ("127.0.0.1", True),
        ("127.0.1.1", True),
        ("::1", True),
        ("[::1]", True),
        (None, False),
        ("", False),
        ("0.0.0.0", False),
        ("::", False),
        ("10.1.2.3", False),
        ("gpu-box.lan", False),
    ],
)
def test_which_addresses_serve_this_machine_only(address, loopback):
    assert is_loopback(address) is loopback


def test_the_sidebar_warns_when_a_server_without_login_listens_beyond_this_machine():
    assert exposure("localhost", login=False) == exposure("localhost", login=False)
    local = exposure("localhost", login=False)
    assert (local.level, local.sentence) == ("caption", "No login configured: serving this machine only (localhost).")
    wide = exposure("0.0.0.0", login=False)
    assert wide.level == "warning" and "listens on 0.0.0.0" in wide.sentence and "anyone" in wide.sentence
    assert "every interface" in exposure(None, login=False).sentence
    assert exposure("0.0.0.0", login=True).level == "caption"
    assert "Login required" in exposure("0.0.0.0", login=True).sentence
