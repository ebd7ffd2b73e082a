"""Hub models without network: a model the local Hugging Face cache holds loads at once, one it does not hold is
refused at once in one sentence, instead of after huggingface_hub's retries (23 s for every file it looks for)."""

from __future__ import annotations

import http.server
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from huggingface_hub import constants
from tiny_models import write_tiny_llama_gguf

from kvlab.errors import KvlabError
from kvlab.models.hub import hub_cache_dir, hub_reachable, in_hub_cache
from kvlab.models.loading import load_model

REPO = Path(__file__).resolve().parents[2]
#: Well under the 23 s huggingface_hub spends retrying one file, with room for a slow test machine.
QUICK_S = 8.0


@pytest.fixture
def closed_endpoint(monkeypatch) -> str:
    """A hub endpoint on a local port nobody listens on: every connection is refused, as without network."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    endpoint = f"http://127.0.0.1:{port}"
    monkeypatch.setattr(constants, "ENDPOINT", endpoint)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    return endpoint


@pytest.fixture
def hub_cache(tmp_path, monkeypatch) -> Path:
    """An empty Hugging Face hub cache in the test's directory, the one huggingface_hub and transformers read."""
    root = tmp_path / "hub"
    root.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(root))
    return root


def cache_model(root: Path, repo_id: str, model_dir: str) -> None:
    """Put a model directory into a hub cache as huggingface_hub lays one out: a snapshot named by its commit,
    and the ``main`` ref pointing at it."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = root / f"models--{repo_id.replace('/', '--')}"
    shutil.copytree(model_dir, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit, encoding="utf-8")


def test_a_cached_model_loads_at_once_without_network(checkpoint, hub_cache, closed_endpoint):
    cache_model(hub_cache, "kvlab-test/tiny", checkpoint)
    assert in_hub_cache("kvlab-test/tiny")
    started = time.monotonic()
    loaded = load_model("kvlab-test/tiny")
    assert time.monotonic() - started < QUICK_S
    assert loaded.arch.num_layers == 3 and loaded.tokenizer is not None
    assert loaded.source.label == "kvlab-test/tiny" and loaded.source.origin == "Hugging Face hub"


@pytest.mark.parametrize("offline_mode", [False, True])
def test_an_uncached_model_is_refused_at_once_without_network(hub_cache, closed_endpoint, monkeypatch, offline_mode):
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", offline_mode)
    assert not in_hub_cache("kvlab-nobody/not-cached")
    started = time.monotonic()
    with pytest.raises(KvlabError, match="^Could not fetch 'kvlab-nobody/not-cached' .* no network connection"):
        load_model("kvlab-nobody/not-cached")
    assert time.monotonic() - started < QUICK_S


def test_a_cached_gguf_file_on_the_hub_loads_at_once_without_network(hub_cache, closed_endpoint, tmp_path):
    folder = tmp_path / "written"
    folder.mkdir()
    write_tiny_llama_gguf(folder / "m.Q8_0.gguf")
    cache_model(hub_cache, "kvlab-test/tiny-gguf", str(folder))
    assert in_hub_cache("kvlab-test/tiny-gguf", "m.Q8_0.gguf")
    started = time.monotonic()
    loaded = load_model("kvlab-test/tiny-gguf/m.Q8_0.gguf", device="cpu")
    assert time.monotonic() - started < QUICK_S and loaded.source.label == "kvlab-test/tiny-gguf/m.Q8_0.gguf"


def test_an_uncached_gguf_file_on_the_hub_is_refused_at_once_without_network(hub_cache, closed_endpoint):
    started = time.monotonic()
    with pytest.raises(KvlabError, match="^Could not fetch 'kvlab-nobody/repo/m.Q4_0.gguf' .* no network connection"):
        load_model("kvlab-nobody/repo/m.Q4_0.gguf")
    assert time.monotonic() - started < QUICK_S


@pytest.mark.slow
def test_the_command_line_refuses_an_uncached_hub_id_at_once_without_network(tmp_path, closed_endpoint):
    """The whole command, as a user runs it: the endpoint and cache come from the environment."""
    env = {**os.environ, "HF_ENDPOINT": closed_endpoint, "HF_HOME": str(tmp_path), "PYTHONPATH": str(REPO)}
    env.pop("HF_HUB_OFFLINE", None)
    env.pop("HF_HUB_CACHE", None)
    started = time.monotonic()
    completed = subprocess.run(
        [sys.executable, "-m", "kvlab", "generate", "--model", "kvlab-nobody/not-cached", "--prompt", "hi"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    # the interpreter imports torch and transformers first; the refusal itself must add no retries
    assert time.monotonic() - started < 20
    assert completed.returncode == 2
    assert completed.stderr.strip() == (
        "error: Could not fetch 'kvlab-nobody/not-cached' from the Hugging Face hub: there is no network connection "
        "and it is not in the local cache."
    )


@pytest.fixture
def silent_endpoint(monkeypatch) -> Iterator[str]:
    """A hub endpoint that accepts connections and never answers, as behind a firewall that drops packets."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(8)
        endpoint = f"http://127.0.0.1:{server.getsockname()[1]}"
        monkeypatch.setattr(constants, "ENDPOINT", endpoint)
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
        yield endpoint


def test_a_silent_hub_is_given_up_after_the_timeout(silent_endpoint):
    started = time.monotonic()
    assert not hub_reachable(timeout_s=0.5)
    assert time.monotonic() - started < 2.0


class _Status(http.server.BaseHTTPRequestHandler):
    """Answers every HEAD request with the status the server is built with."""

    status = 200

    def do_HEAD(self) -> None:  # noqa: N802 (the name http.server calls)
        self.send_response(self.status)
        self.end_headers()

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 (http.server's signature)
        """Quiet: the test reads the answer, not the log."""


@pytest.mark.parametrize("status,reachable", [(200, True), (404, True), (503, False)])
def test_a_hub_that_answers_is_reachable_unless_it_is_down(monkeypatch, status, reachable):
    handler = type("Handler", (_Status,), {"status": status})
    server = http.server.HTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{server.server_address[1]}")
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
        assert hub_reachable() is reachable
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
        assert hub_reachable() is False
    finally:
        server.shutdown()
        server.server_close()


def test_the_hub_cache_is_found_where_huggingface_hub_looks(tmp_path):
    """The model list and the loader must agree on the cache: huggingface_hub honours ``$XDG_CACHE_HOME`` when
    neither ``$HF_HUB_CACHE`` nor ``$HF_HOME`` is set."""
    env = {"XDG_CACHE_HOME": str(tmp_path / "xdg"), "PATH": os.environ.get("PATH", "")}
    code = "from huggingface_hub import constants; print(constants.HF_HUB_CACHE)"
    theirs = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert hub_cache_dir(env) == Path(theirs.stdout.strip())
    assert hub_cache_dir({**env, "HF_HOME": str(tmp_path / "home")}) == tmp_path / "home" / "hub"
