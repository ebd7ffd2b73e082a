"""The container image: linted, installed by the same script CI runs, non-root, healthy, persistent, configurable."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
DOCKERFILE = (REPO / "Dockerfile").read_text(encoding="utf-8")


def instructions(name: str) -> list[str]:
    """The arguments of every ``name`` instruction (continuation lines joined)."""
    joined = re.sub(r"\\\n\s*", " ", DOCKERFILE)
    return [line.split(None, 1)[1] for line in joined.splitlines() if line.upper().startswith(name + " ")]


def test_hadolint_finds_nothing():
    hadolint = shutil.which("hadolint") or str(Path(REPO / ".venv/bin/hadolint"))
    if not Path(hadolint).exists():
        pytest.fail("hadolint is not installed; scripts/install.sh installs it from requirements.txt")
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
    for name in ("KVLAB_DEFAULT_MODEL", "KVLAB_ALLOWED_MODELS", "HF_HUB_OFFLINE"):
        assert name in env


def test_compose_reserves_one_gpu_and_keeps_its_volumes():
    compose = yaml.safe_load((REPO / "compose.yaml").read_text(encoding="utf-8"))
    service = compose["services"]["kvlab"]
    devices = service["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]
    assert {"kvlab-data:/data", "kvlab-hf-cache:/cache/huggingface"} <= set(service["volumes"])
    assert set(compose["volumes"]) == {"kvlab-data", "kvlab-hf-cache"}
