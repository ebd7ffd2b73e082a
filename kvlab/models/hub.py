"""The Hugging Face hub as kvlab meets it: its local cache, and whether it answers at all.

Whether the hub can be reached is asked once per load, so that a loader without network reads the local cache alone
instead of retrying every file for minutes. Nothing here imports torch.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from pathlib import Path

#: How long kvlab waits for the Hugging Face hub to answer before it reads hub models from the local cache alone.
HUB_PROBE_TIMEOUT_S = 2.0


def hub_cache_dir(env: Mapping[str, str] = os.environ) -> Path:
    """The Hugging Face hub cache, found as huggingface_hub finds it: ``$HF_HUB_CACHE``, else ``$HF_HOME/hub``,
    else ``$XDG_CACHE_HOME/huggingface/hub``, else ``~/.cache/huggingface/hub``."""
    if env.get("HF_HUB_CACHE"):
        return Path(env["HF_HUB_CACHE"]).expanduser()
    if env.get("HF_HOME"):
        return Path(env["HF_HOME"]).expanduser() / "hub"
    caches = Path(env["XDG_CACHE_HOME"]).expanduser() if env.get("XDG_CACHE_HOME") else Path.home() / ".cache"
    return caches / "huggingface" / "hub"


def in_hub_cache(repo_id: str, filename: str = "config.json") -> bool:
    """Whether the local Hugging Face cache holds ``filename`` of the hub repository ``repo_id`` (nothing is
    downloaded; the cache is the one transformers loads from)."""
    from huggingface_hub import try_to_load_from_cache

    try:
        return isinstance(try_to_load_from_cache(repo_id, filename), str)
    except Exception:  # a name huggingface_hub's validator refuses is in no cache
        return False


def hub_reachable(timeout_s: float = HUB_PROBE_TIMEOUT_S) -> bool:
    """Whether the Hugging Face hub answers one request within ``timeout_s`` seconds.

    Without network, huggingface_hub retries every file it looks for five times over 23 s (config, tokenizer files,
    generation config, chat templates: minutes for one model), so a loader asks this once and then reads the local
    cache alone. It asks ``$HF_ENDPOINT`` through huggingface_hub's own HTTP client (its proxies and settings) and
    is ``False`` at once under ``HF_HUB_OFFLINE``. The request runs in a thread that is given up after
    ``timeout_s``: a name lookup with no resolver to answer it is not bounded by the HTTP timeout."""
    from huggingface_hub import constants

    if constants.is_offline_mode():
        return False
    answers: list[bool] = []
    probe = threading.Thread(
        target=lambda: answers.append(_hub_answers(constants.ENDPOINT, timeout_s)), name="hub-probe", daemon=True
    )
    probe.start()
    probe.join(timeout_s)
    return bool(answers) and answers[0]


def _hub_answers(endpoint: str, timeout_s: float) -> bool:
    """Whether one HEAD request to the hub's endpoint gets an answer other than a server error (a hub that is
    down is no better than none: huggingface_hub would retry it too)."""
    from huggingface_hub import get_session

    try:
        response = get_session().head(endpoint, timeout=timeout_s, follow_redirects=False)
    except Exception:  # refused, unresolvable, timed out, a proxy error, offline mode: httpx raises many kinds
        return False
    return response.status_code < 500
