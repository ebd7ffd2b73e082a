"""KeyDiff: keep the keys least like the layer's average key."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from kvlab.policies.base import LayerView
from kvlab.policies.scoring import ScoringPolicy


@dataclass
class KeyDiff(ScoringPolicy):
    """KeyDiff (Park et al., "KeyDiff: Key Similarity-Based KV Cache Eviction for Long-Context LLM Inference in
    Resource-Constrained Environments", arXiv:2504.15364): tokens whose keys point away from the others' are the ones
    attention can single out, so each token is scored by the negative cosine similarity of its key to the anchor, the
    mean of the held keys each scaled to unit length, per sequence and KV head. Like Knorm it reads no attention.

    Differs from the paper: the anchor is the mean over the tokens the cache holds at the eviction (free slots take
    no part); the paper's block-wise prefill, which evicts after every block of the prompt, is kvlab's ``streaming``
    mode with the block as the chunk, and ``prefill`` mode scores the whole context at once (as kvpress's
    ``KeyDiffPress`` does without its ``BlockPress``). Keys are the cached (post-RoPE) ones, as in kvpress.
    """

    name: ClassVar[str] = "keydiff"

    def score(self, view: LayerView) -> torch.Tensor:
        return keydiff_scores(view.keys, view.positions >= 0)


def keydiff_scores(keys: torch.Tensor, held: torch.Tensor) -> torch.Tensor:
    """``-cos(k_i, anchor)`` for every slot, ``(batch, kv_heads, slots)``, where the anchor is the mean of the unit
    keys over the ``held`` slots of each sequence and KV head (``keys`` ``(batch, kv_heads, slots, head_dim)``)."""
    unit = F.normalize(keys.float(), dim=-1)
    weights = held.unsqueeze(-1).float()
    anchor = (unit * weights).sum(dim=2, keepdim=True) / weights.sum(dim=2, keepdim=True).clamp_min(1.0)
    return -F.cosine_similarity(keys.float(), anchor, dim=-1)
