"""Precision tiers for cached keys and values: KIVI's asymmetric quantisation, physically packed.

A token's key and value can be held at 16 bits (the tensor itself, untouched), 8, 4 or 2 bits. The layout follows
KIVI (Liu et al., "KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache", ICML 2024, arXiv:2402.02750):

* **keys per channel**: a few key channels carry outliers whose magnitude dwarfs the rest. Sharing one scale along a
  token would spend every level on those channels and flatten all the others, so each channel gets its own scale
  and zero point over a group of tokens.
* **values per token**: values have no such fixed outlier channels, and each output mixes value vectors token by
  token with the attention weights, so the error is best kept local to a token: each token's channels are split
  into groups of consecutive channels, each with its own scale and zero point.

Quantisation is asymmetric min-max (a scale and a zero point per group, so a group that is all positive uses every
level), computed in float32 with the scale and zero point stored in float16, as KIVI stores them. Codes are packed
along the last dimension, low bits first: four 2-bit codes or two 4-bit codes per byte. What a :class:`Quantized`
holds is exactly what the cache keeps in memory, so its bytes are read from its tensors, never computed.

Everything here is pure tensor maths, vectorised over tokens, groups and heads, on the CPU or CUDA alike.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvlab.cache.spec import BITS
from kvlab.errors import KvlabError

_FULL = 16
_BYTE = 8


def check_bits(bits: int, what: str) -> int:
    """``bits`` when it is one of :data:`BITS`, else one sentence naming ``what`` (for example "Keys")."""
    if not isinstance(bits, int) or bits not in BITS:
        widths = ", ".join(str(b) for b in BITS[:-1]) + f" or {BITS[-1]}"
        raise KvlabError(f"{what} cannot be held at {bits!r} bits; choose {widths}.")
    return bits


def _shifts(bits: int, device: torch.device) -> torch.Tensor:
    """Where each of the codes sharing a byte sits in it: 0, bits, 2*bits, ... (low bits first)."""
    check_bits(bits, "Packed codes")
    if bits == _FULL:
        raise KvlabError("16-bit keys and values are held as they are, so there are no codes to pack.")
    return torch.arange(0, _BYTE, bits, dtype=torch.uint8, device=device)


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes ``(..., n)`` (uint8 in ``[0, 2**bits)``) packed into ``(..., ceil(n * bits / 8))`` bytes along the last
    dimension, low bits first; 8-bit codes are returned as they are. A row that does not fill its last byte is
    padded with zero codes, which :func:`unpack` drops again given ``n``. Codes out of range would spill into their
    neighbours; the quantisers below never produce them."""
    shifts = _shifts(bits, codes.device)
    per_byte = shifts.numel()
    if per_byte == 1:
        return codes.contiguous()
    n = codes.shape[-1]
    padding = -n % per_byte
    padded = torch.nn.functional.pad(codes, (0, padding)) if padding else codes
    lanes = padded.reshape(*codes.shape[:-1], -1, per_byte)
    return (lanes << shifts).sum(dim=-1, dtype=torch.uint8)


def unpack(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """The ``n`` codes per row that :func:`pack` packed into ``packed`` ``(..., bytes)``, as uint8 ``(..., n)``."""
    shifts = _shifts(bits, packed.device)
    if shifts.numel() == 1:
        return packed[..., :n]
    mask = (1 << bits) - 1
    lanes = (packed.unsqueeze(-1) >> shifts) & mask
    return lanes.reshape(*packed.shape[:-1], -1)[..., :n]


@dataclass(frozen=True, eq=False)
class Quantized:
    """Keys or values as the cache holds them.

    ``packed`` holds the packed codes (uint8), or at 16 bits the original tensor itself; ``scale`` and ``zero``
    (float16, ``None`` at 16 bits) broadcast against the codes viewed as ``grouped_shape``; ``shape`` is the
    logical shape that :meth:`dequantize` returns. Codes are packed along the last dimension of ``shape``.
    """

    packed: torch.Tensor
    scale: torch.Tensor | None
    zero: torch.Tensor | None
    bits: int
    shape: tuple[int, ...]
    grouped_shape: tuple[int, ...]

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """The tensor of ``shape`` in ``dtype``: ``code * scale + zero`` computed in float32 (at 16 bits the
        original tensor, unchanged when it already has ``dtype``)."""
        if self.scale is None or self.zero is None:
            return self.packed.to(dtype)
        codes = unpack(self.packed, self.bits, self.shape[-1]).reshape(self.grouped_shape)
        values = codes.to(torch.float32) * self.scale.to(torch.float32) + self.zero.to(torch.float32)
        return values.reshape(self.shape).to(dtype)

    def nbytes(self) -> int:
        """Bytes held: ``numel * element_size`` of the packed codes (or the 16-bit tensor), scales and zero points."""
        held = (t for t in (self.packed, self.scale, self.zero) if t is not None)
        return sum(t.numel() * t.element_size() for t in held)


def _quantize(x: torch.Tensor, bits: int, reduce_dim: int, shape: tuple[int, ...]) -> Quantized:
    """``x`` (already viewed in its groups) quantised with one min-max scale and zero point per group, the group
    running along ``reduce_dim``; ``shape`` is the logical shape the codes are packed and restored in.

    The scale and zero point are rounded to float16 before the codes are computed, so the codes fit what is
    stored: the error stays within half a stored step except for float16's rounding of the range's ends. A constant
    group has scale 0; its codes are all 0 and it dequantises to its (float16) value, never to NaN.
    """
    levels = (1 << bits) - 1
    x32 = x.to(torch.float32)
    low = x32.amin(dim=reduce_dim, keepdim=True)
    high = x32.amax(dim=reduce_dim, keepdim=True)
    scale = ((high - low) / levels).to(torch.float16)
    zero = low.to(torch.float16)
    step = scale.to(torch.float32)
    safe_step = torch.where(step > 0, step, torch.ones_like(step))
    codes = torch.round((x32 - zero.to(torch.float32)) / safe_step).clamp_(0, levels).to(torch.uint8)
    packed = pack(codes.reshape(shape), bits)
    return Quantized(packed, scale, zero, bits, shape, tuple(x.shape))


def _kept(x: torch.Tensor, shape: tuple[int, ...]) -> Quantized:
    """A 16-bit tier: the tensor itself, no quantisation."""
    return Quantized(x, None, None, _FULL, shape, shape)


def quantize_keys(keys: torch.Tensor, bits: int) -> Quantized:
    """Keys ``(..., groups, group, head_dim)`` quantised per channel, as KIVI: every (group of tokens, channel) pair
    has its own scale and zero point over that group's ``group`` tokens (scale and zero ``(..., groups, 1,
    head_dim)``), because outlier channels would otherwise take the levels of every other channel. Leading
    dimensions (batch, heads) are independent. The caller groups the tokens; a partial group is its own call."""
    check_bits(bits, "Keys")
    shape = tuple(keys.shape)
    if bits == _FULL:
        return _kept(keys, shape)
    return _quantize(keys, bits, reduce_dim=-2, shape=shape)


def value_group(head_dim: int, group: int) -> int:
    """The channels per value group: ``group`` when it divides ``head_dim``, else the largest divisor of
    ``head_dim`` below it, so that every group of a token has the same number of channels (one scale each)."""
    if group < 1:
        raise KvlabError(f"A quantisation group of {group} channels is not possible; it must be at least 1.")
    return max(d for d in range(1, min(group, head_dim) + 1) if head_dim % d == 0)


def quantize_values(values: torch.Tensor, bits: int, group: int) -> Quantized:
    """Values ``(..., tokens, head_dim)`` quantised per token, as KIVI: each token's channels are split into groups
    of :func:`value_group` consecutive channels (``group``, or the largest divisor of ``head_dim`` below it), each
    with its own scale and zero point (``(..., tokens, head_dim // group, 1)``), so a token's error stays its own.
    Leading dimensions (batch, heads) are independent."""
    check_bits(bits, "Values")
    shape = tuple(values.shape)
    if bits == _FULL:
        return _kept(values, shape)
    channels = value_group(shape[-1], group)
    grouped = values.reshape(*shape[:-1], shape[-1] // channels, channels)
    return _quantize(grouped, bits, reduce_dim=-1, shape=shape)
