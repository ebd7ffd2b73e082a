"""Measuring a model's attention profile (:mod:`kvlab.models.profiles`): its mean attention entropy per layer over a
held-out text read with the full cache, and CAKE's dispersion and shift of the text's last observation window."""

from __future__ import annotations

import torch

from kvlab import __version__
from kvlab.attention.observe import window_probabilities
from kvlab.attention.stats import StatsRequest
from kvlab.cache.allocation import CAKE_WINDOW
from kvlab.cache.cake import cake_dispersion_and_shift
from kvlab.engine.generation import Generation
from kvlab.engine.spec import RunSpec
from kvlab.errors import KvlabError
from kvlab.hashing import text_sha256
from kvlab.models.loading import LoadedModel
from kvlab.models.profiles import DEFAULT_PROFILE_TOKENS, PROFILE_CHUNK, Profile
from kvlab.policies.full import Full
from kvlab.policies.snapkv import SnapKV
from kvlab.policies.variants import Variant
from kvlab.tasks.texts import text_pass


def measure_profile(
    loaded: LoadedModel, text: str, text_name: str, tokens: int = DEFAULT_PROFILE_TOKENS, chunk: int = PROFILE_CHUNK
) -> Profile:
    """Read the first ``tokens`` tokens of ``text`` with the full cache in chunks of ``chunk`` and measure each
    layer's mean attention entropy over the queries after the first chunk, per query head, then CAKE's dispersion
    and shift of the last window (the window's own keys left out, as CAKE's code leaves them out)."""
    if tokens <= chunk:
        raise KvlabError(f"A profile reads more than one chunk of {chunk} tokens, not {tokens}.")
    weights_hash = loaded.weights_hash
    if weights_hash is None:
        raise KvlabError(f"The weights of {loaded.source.label} have no identity to file a profile under.")
    passage = text_pass(loaded.tokenizer, text, text_name, prefix=tokens, scored=0)
    ids = torch.tensor([passage.ids], dtype=torch.long)
    spec = RunSpec(Full(), chunk=chunk, max_new_tokens=0, stats=StatsRequest(n_sink=1, n_bins=1))
    generation = Generation(loaded, spec, ids, observe_for=[Variant.published(SnapKV(window=CAKE_WINDOW))])
    weighted, counted, seen = None, 0, 0
    for event in generation.events():
        queries, seen = event.seen_tokens - seen, event.seen_tokens
        if event.stats is None or event.seen_tokens <= chunk:
            continue
        entropy = event.stats["entropy"][:, 0].double() * queries  # (layers, query heads) of the one sequence
        weighted = entropy if weighted is None else weighted + entropy
        counted += queries
    assert weighted is not None
    per_head = weighted / counted
    arch = loaded.arch
    per_kv_head = per_head.reshape(arch.num_layers, arch.num_kv_heads, -1).mean(-1)
    dispersion, shift = [], []
    for layer in generation.cache.layers:
        assert layer.positions is not None
        positions = layer.positions[:, :, : layer.used]
        before_window = (positions >= 0) & (positions < seen - CAKE_WINDOW)
        h, v = cake_dispersion_and_shift(window_probabilities(layer, layer.used), before_window)
        dispersion.append(h)
        shift.append(v)
    return Profile(
        model=loaded.source.label,
        weights_hash=weights_hash,
        tokenizer_hash=loaded.tokenizer_hash,
        text=text_name,
        text_sha256=text_sha256(text),
        tokens=len(passage.ids),
        chunk=chunk,
        device=loaded.device_kind,
        dtype=loaded.dtype_name,
        kvlab_version=__version__,
        entropy=tuple(float(value) for value in per_head.mean(-1)),
        head_entropy=tuple(tuple(float(value) for value in row) for row in per_kv_head),
        cake_window=CAKE_WINDOW,
        cake_dispersion=tuple(dispersion),
        cake_shift=tuple(shift),
    )
