"""kvlab installed as a wheel, not run from a checkout: the wheel holds everything kvlab ships, and ``kvlab models``,
``kvlab generate`` and ``kvlab claims`` work from any directory with nothing read from the checkout and nothing
written into the installed package.

The wheel is built from a copy of the sources (a build writes ``build/`` and ``*.egg-info`` beside them) and
installed without its dependencies into a fresh virtual environment, which finds them through a ``.pth`` file naming
this environment's ``site-packages``: kvlab itself comes only from the wheel, and torch is not installed again.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import re
import shutil
import site
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

from kvlab.claims import CATALOGUE

REPO = Path(__file__).resolve().parents[2]
#: What a build of the wheel reads: the package metadata and the package, shipped files included.
BUILD_INPUTS = ("pyproject.toml", "README.md", "LICENSE", "kvlab")
NOT_BUILT = shutil.ignore_patterns("__pycache__", "*.pyc", "*.wal")

pytestmark = [pytest.mark.slow, pytest.mark.long]


def outside_env(work: Path) -> dict[str, str]:
    """The environment of a process that knows nothing of this checkout: no ``PYTHONPATH`` (through which pip would
    see an editable install's ``kvlab.egg-info`` and take kvlab for installed), no kvlab settings, a home of its own
    and no network for the model hub."""
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH" and not key.startswith("KVLAB_")}
    return env | {"HOME": str(work / "home"), "XDG_DATA_HOME": str(work / "data"), "HF_HUB_OFFLINE": "1"}


def build_wheel(work: Path) -> Path:
    """The wheel of this checkout, built from a copy of its sources under ``work``. Without build isolation when
    this environment has the build backend pyproject.toml asks for (no index is needed), else with it."""
    source = work / "source"
    source.mkdir()
    for name in BUILD_INPUTS:
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, source / name, ignore=NOT_BUILT)
        else:
            shutil.copy2(REPO / name, source / name)
    try:
        isolation = [] if int(importlib.metadata.version("setuptools").split(".")[0]) < 77 else ["--no-build-isolation"]
    except importlib.metadata.PackageNotFoundError:
        isolation = []
    wheels = work / "wheels"
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check"]
    build = [*pip, "wheel", "--no-deps", *isolation, "-q", "-w", str(wheels), str(source)]
    subprocess.run(build, cwd=work, env=outside_env(work), check=True)
    [wheel] = wheels.glob("kvlab-*.whl")
    return wheel


def install(wheel: Path, environment: Path) -> Path:
    """A fresh virtual environment holding kvlab from ``wheel`` alone, its dependencies found in this environment's
    ``site-packages``; returns its Python."""
    venv.create(environment, with_pip=False)
    python = environment / "bin" / "python"
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--python", str(python)]
    subprocess.run(
        [*pip, "install", "--no-deps", "-q", str(wheel)],
        cwd=environment.parent,
        env=outside_env(environment.parent),
        check=True,
    )
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    (Path(purelib) / "kvlab-test-dependencies.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    return python


#: The identities stored runs are found by that depend on files kvlab ships: its model's and its tasks' sources'.
IDENTITIES = (
    "from kvlab.paths import shipped; from kvlab.provenance import weights_hash; "
    "from kvlab.runs.records import needle_sources_hash; from kvlab.runs.sweep import ruler_sources_hash; "
    "print(weights_hash(shipped('models', 'kvlab-tiny-llama')), needle_sources_hash('needle', 'sweep'), "
    "ruler_sources_hash('ruler'))"
)


def identities_here() -> list[str]:
    """:data:`IDENTITIES` as this checkout computes them."""
    done = subprocess.run([sys.executable, "-c", IDENTITIES], cwd=REPO, capture_output=True, text=True, check=True)
    return done.stdout.split()


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_an_installed_wheel_works_from_any_directory(tmp_path: Path) -> None:
    before = sorted(path.name for path in REPO.iterdir())
    wheel = build_wheel(tmp_path)
    shipped = sorted(
        path.relative_to(REPO).as_posix()
        for path in (REPO / "kvlab" / "data").rglob("*")
        if path.is_file() and not NOT_BUILT(str(path.parent), [path.name])
    )
    with zipfile.ZipFile(wheel) as archive:
        assert set(shipped) <= set(archive.namelist())
    assert {"kvlab/data/models/kvlab-tiny-llama/model.safetensors", "kvlab/data/runs/claims.duckdb"} <= set(shipped)

    environment = tmp_path / "venv"
    python = install(wheel, environment)
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    env = outside_env(tmp_path)

    def kvlab(*args: str) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(
            [str(environment / "bin" / "kvlab"), *args], cwd=elsewhere, env=env, capture_output=True, text=True
        )
        assert done.returncode == 0, done.stderr
        return done

    found = subprocess.run(
        [str(python), "-c", "import kvlab, kvlab.paths; print(kvlab.__file__); print(kvlab.paths.checkout())"],
        cwd=elsewhere,
        env=env,
        capture_output=True,
        text=True,
    )
    assert found.returncode == 0, found.stderr
    where = found.stdout.split()
    package = Path(where[0]).parent
    assert package.is_relative_to(environment) and where[1] == "None"  # the wheel's kvlab, and no checkout
    identities = subprocess.run([str(python), "-c", IDENTITIES], cwd=elsewhere, env=env, capture_output=True, text=True)
    assert identities.stdout.split() == identities_here()  # stored runs are found again wherever kvlab is installed

    assert "kvlab-tiny-llama  [shipped; shipped with kvlab" in kvlab("models").stdout

    generated = kvlab("generate", "--prompt", "The capital of France is", "--max-new-tokens", "8")
    assert generated.stdout.strip()
    assert "[kvlab-tiny-llama: shipped with kvlab" in generated.stderr
    assert re.search(r"\] prompt \d+ tokens, \d+ generated, budget none;", generated.stderr)

    evidence = package / "data" / "runs" / "claims.duckdb"
    unchanged = digest(evidence)
    claims = kvlab("claims", "--only", "1,29")
    table = " ".join(claims.stdout.split())
    assert "42.9 GB (40.0 GiB) at 131,072 tokens" in table and "does not hold" in table
    assert "the benchmark results are not installed when kvlab runs from a wheel" in table
    left = f"{len(CATALOGUE)} claims evaluated against {evidence}, read only (--refresh stores them)."
    assert left in claims.stderr
    assert digest(evidence) == unchanged and not (package / "data" / "runs" / "claims.duckdb.wal").exists()

    assert sorted(path.name for path in REPO.iterdir()) == before  # the build wrote nothing beside the sources
