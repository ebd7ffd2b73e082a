"""Fixtures the test modules share: the shipped model, a tiny checkpoint on disk and an empty store."""

import atexit
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# The tests live in one folder per package (tests/cache, tests/dashboard…), each module named uniquely across them.
# The helpers above (tiny_models, browser, disks) are imported by name from every folder, and a few modules import
# another module's helpers by name (``from test_pages import open_page``): every folder is on the path, so those
# imports work whichever folder or file a run starts from.
sys.path[2:2] = [
    str(folder) for folder in sorted(Path(__file__).resolve().parent.iterdir()) if any(folder.glob("test_*.py"))
]

# Hypothesis keeps examples and constants in ./.hypothesis unless told otherwise; the suite must leave the working
# tree as it found it, so it keeps nothing between runs and writes its scratch files to a temporary directory.
if "HYPOTHESIS_STORAGE_DIRECTORY" not in os.environ:
    _scratch = tempfile.mkdtemp(prefix="kvlab-hypothesis-")
    os.environ["HYPOTHESIS_STORAGE_DIRECTORY"] = _scratch
    atexit.register(shutil.rmtree, _scratch, ignore_errors=True)

# GGUF models are dequantised into a cache; the suite's conversions go to a directory of its own, removed at exit.
if "KVLAB_MODEL_CACHE" not in os.environ:
    _models = tempfile.mkdtemp(prefix="kvlab-model-cache-")
    os.environ["KVLAB_MODEL_CACHE"] = _models
    atexit.register(shutil.rmtree, _models, ignore_errors=True)

import torch  # noqa: E402  (imports no Triton)

# Without CUDA, kvlab's own Triton kernels (kvlab.attention.slot_kernels) run in Triton's interpreter, on CPU tensors,
# so that the tests check them where CI runs. Triton reads the switch as it defines a kernel, its own library's too,
# so it is set before anything imports Triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from hypothesis import settings  # noqa: E402

settings.register_profile("kvlab", database=None)
settings.load_profile("kvlab")

import pytest  # noqa: E402
from tiny_models import save_tiny_checkpoint  # noqa: E402

from kvlab.models.catalog import package_models  # noqa: E402
from kvlab.models.loading import LoadedModel, load_model  # noqa: E402
from kvlab.store import Store, open_store  # noqa: E402

#: The GGUF files of the published models that scripts/published_models.txt installs: a Llama (SmolLM2) and a
#: Gemma 3 (carried in four parts, reassembled on first load).
PUBLISHED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
PUBLISHED_GEMMA_GGUF = "gemma-3-270m-q4_k_m.gguf"
#: Fixtures whose set-up alone takes ten seconds or more on a 2-core CPU (a published model's conversion, a local Ray
#: cluster): every test that uses one is marked ``long``, so that the default run never pays for them.
LONG_FIXTURES = frozenset({"published", "published_gemma", "local_ray"})


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark ``long`` every test that uses a fixture of :data:`LONG_FIXTURES`, directly or through another."""
    for item in items:
        if LONG_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.long)


@pytest.fixture(scope="session")
def shipped() -> LoadedModel:
    """The model shipped in ``data/``, loaded once for the whole suite (tests read it and never change it)."""
    return load_model()


def load_published(file_name: str) -> LoadedModel:
    """A published model the set-up installs from the package registry, found among the installed packages by its
    file's name and loaded offline (skipped where the install left the published models out)."""
    entries = [entry for entry in package_models() if entry.name.endswith(file_name)]
    if not entries and os.environ.get("KVLAB_PUBLISHED_MODELS") == "0":
        pytest.skip("the published models were left out of the install (KVLAB_PUBLISHED_MODELS=0)")
    assert entries, f"{file_name} is not installed; run scripts/install.sh"
    return load_model(entries[0].name, device="cpu")


@pytest.fixture(scope="session")
def published() -> LoadedModel:
    """SmolLM2-135M-Instruct (GGUF Q4_1, a Llama), loaded once for the whole suite."""
    return load_published(PUBLISHED_GGUF)


@pytest.fixture(scope="session")
def published_gemma() -> LoadedModel:
    """Gemma 3 270M (GGUF Q4_K_M, five of every six layers with a sliding window), loaded once for the whole
    suite."""
    return load_published(PUBLISHED_GEMMA_GGUF)


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory) -> str:
    """The directory of a tiny Llama with a byte-level BPE tokenizer, saved like a hub checkpoint."""
    return save_tiny_checkpoint(tmp_path_factory.mktemp("tiny"))


@pytest.fixture
def store(tmp_path) -> Iterator[Store]:
    """An empty store in the test's temporary directory, closed afterwards."""
    opened = open_store(tmp_path / "runs.duckdb")
    yield opened
    opened.close()


@pytest.fixture
def db(tmp_path, monkeypatch) -> Iterator[Path]:
    """The dashboard's run store (``$KVLAB_DB``) in the test's temporary directory; opened once more at the end, so
    whatever a page left there must still open as a kvlab store."""
    path = tmp_path / "runs.duckdb"
    monkeypatch.setenv("KVLAB_DB", str(path))
    yield path
    open_store(path).close()
