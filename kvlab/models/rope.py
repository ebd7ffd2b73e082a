"""The model's rotary position embedding, as policies that reason about future queries need it.

The heap holds keys and remembered queries after RoPE. A policy that predicts the queries of positions not yet seen
(Expected Attention) must rotate query statistics to those positions, and one that needs the queries before RoPE
must undo a rotation; both are plain rotations by position differences, which :meth:`Rope.rotate` applies with the
model's own inverse frequencies and its ``rotate_half`` convention. The attention scaling some RoPE variants apply
(YaRN) multiplies every query and key alike and is not part of a rotation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Rope:
    """A model's rotary embedding: ``inv_freq`` (``(rotary_dim / 2,)``, float32) rotates the first ``rotary_dim``
    channels of each head, pairing channel ``i`` with ``i + rotary_dim / 2`` as transformers' ``rotate_half`` does;
    any channels after them are not rotated (partial rotary embeddings)."""

    inv_freq: torch.Tensor

    @property
    def rotary_dim(self) -> int:
        return 2 * int(self.inv_freq.shape[0])

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Cosines and sines of the angles at ``positions`` (``(n,)``), each ``(n, rotary_dim)``."""
        angles = positions.float().unsqueeze(-1) * self.inv_freq.to(positions.device).unsqueeze(0)
        angles = torch.cat([angles, angles], dim=-1)
        return angles.cos(), angles.sin()

    def rotate(self, vectors: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``vectors`` (``(..., n, head_dim)``) each rotated by its position in ``positions`` (``(n,)``); a negative
        position undoes the rotation by that position. Computed in float32."""
        cos, sin = self.cos_sin(positions)
        rotary, rest = vectors.float()[..., : self.rotary_dim], vectors.float()[..., self.rotary_dim :]
        half = self.rotary_dim // 2
        rotated_half = torch.cat([-rotary[..., half:], rotary[..., :half]], dim=-1)
        return torch.cat([rotary * cos + rotated_half * sin, rest], dim=-1)

    def mean_rotation(self, positions: torch.Tensor, head_dim: int) -> torch.Tensor:
        """The rotation matrix averaged over ``positions``, ``(head_dim, head_dim)`` float32: applied to a vector it
        gives the mean of that vector rotated to each of the positions (as kvpress's Expected Attention averages R).
        A rotation is ``diag(cos) + diag(sin) J`` with ``J`` the matrix of ``rotate_half``, so its mean takes the mean
        cosines and sines only (no matrix per position); channels past the rotary ones stay as they are."""
        cos, sin = self.cos_sin(positions)
        half = self.rotary_dim // 2
        turn = torch.zeros(self.rotary_dim, self.rotary_dim, device=cos.device)
        turn[:half, half:] = -torch.eye(half, device=cos.device)  # rotate_half: (x1, x2) -> (-x2, x1)
        turn[half:, :half] = torch.eye(half, device=cos.device)
        rotary = torch.diag(cos.mean(dim=0)) + sin.mean(dim=0).unsqueeze(1) * turn
        mean = torch.eye(head_dim, device=cos.device)
        mean[: self.rotary_dim, : self.rotary_dim] = rotary
        return mean


#: One :class:`Rope` per decoder layer: models with several layer types rotate each type by its own frequencies
#: (Gemma 3: a base of 10,000 in its sliding-window layers, 1,000,000 in its global ones).
LayerRopes = tuple[Rope, ...]


def layer_ropes(model: Any) -> LayerRopes | None:
    """Each decoder layer's rotary embedding in a transformers causal LM (``model.model.rotary_emb``): its
    ``inv_freq`` for every layer, or per layer type its ``<type>_inv_freq`` for the layer types of
    ``config.layer_types``; ``None`` for a model without one where kvlab can find it."""
    inner = getattr(model, "model", None)
    rotary = getattr(inner, "rotary_emb", None)
    config = getattr(model, "config", None)
    layers = getattr(config, "num_hidden_layers", None)
    if rotary is None or not isinstance(layers, int):
        return None
    shared = getattr(rotary, "inv_freq", None)
    if isinstance(shared, torch.Tensor):
        return (Rope(shared.detach().float()),) * layers
    types = getattr(config, "layer_types", None)
    if not isinstance(types, list | tuple) or len(types) != layers:
        return None
    ropes: dict[str, Rope] = {}
    for kind in set(types):
        inv_freq = getattr(rotary, f"{kind}_inv_freq", None)
        if not isinstance(inv_freq, torch.Tensor):
            return None
        ropes[kind] = Rope(inv_freq.detach().float())
    return tuple(ropes[kind] for kind in types)
