"""Precision tiers: packing is exactly invertible and exactly as small as computed, quantisation stays within half a
stored step (plus float16's rounding of what is stored), constant groups come back exactly, 16 bits is the tensor
itself, bytes are read from the held tensors, and KIVI's per-channel keys beat per-token keys on an outlier channel."""

from __future__ import annotations

import math

import pytest
import torch

from kvlab.cache.quant import Quantized, check_bits, pack, quantize_keys, quantize_values, unpack, value_group
from kvlab.cache.spec import BITS
from kvlab.errors import KvlabError

PACKED = (2, 4, 8)
HEAD_DIM = 64
#: Half a unit in the last place, relative: float16 (scale and zero point as stored) and float32 (the arithmetic).
F16_ROUNDING = torch.finfo(torch.float16).eps / 2
F32_ROUNDING = torch.finfo(torch.float32).eps / 2
#: float32 roundings between an input and its dequantised value: x - zero, the division, code * scale, + zero.
F32_OPERATIONS = 4


def generator() -> torch.Generator:
    return torch.Generator().manual_seed(14)


def bytes_of(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def error_bound(x: torch.Tensor, quantized: Quantized, grouped: torch.Tensor) -> torch.Tensor:
    """The largest error each element may have: half a stored step, plus float16's rounding of the stored scale and
    zero point (the codes can reach the group's ends only up to ``levels`` steps of rounding and the zero point's
    own), plus the float32 arithmetic's roundings; ``grouped`` is ``x`` viewed in its groups."""
    assert quantized.scale is not None and quantized.zero is not None
    levels = (1 << quantized.bits) - 1
    scale = quantized.scale.float()
    zero = quantized.zero.float().abs()
    bound = scale / 2 + F16_ROUNDING * (levels * scale + zero)
    bound = bound + F32_OPERATIONS * F32_ROUNDING * (grouped.abs() + levels * scale + zero)
    return bound.reshape(x.shape)


@pytest.mark.parametrize("bits", PACKED)
@pytest.mark.parametrize("n", [1, 7, 13, 64])
def test_pack_round_trip_and_size(bits: int, n: int) -> None:
    codes = torch.randint(0, 1 << bits, (3, 5, n), dtype=torch.uint8, generator=generator())
    codes[0, 0, :] = (1 << bits) - 1  # every bit set: a spill into a neighbour would show
    packed = pack(codes, bits)
    assert packed.dtype == torch.uint8
    assert packed.shape == (3, 5, math.ceil(n * bits / 8))
    assert torch.equal(unpack(packed, bits, n), codes)


def test_pack_puts_low_bits_first() -> None:
    two_bit = torch.tensor([1, 2, 3, 0, 3], dtype=torch.uint8)
    assert pack(two_bit, 2).tolist() == [1 | 2 << 2 | 3 << 4, 3]
    four_bit = torch.tensor([5, 12, 9], dtype=torch.uint8)
    assert pack(four_bit, 4).tolist() == [5 | 12 << 4, 9]


@pytest.mark.parametrize("bits", PACKED)
@pytest.mark.parametrize("group", [8, 32])
def test_keys_within_half_a_step_per_channel(bits: int, group: int) -> None:
    keys = torch.randn(128 // group, group, HEAD_DIM, generator=generator()) * 3 + 1
    quantized = quantize_keys(keys, bits)
    assert quantized.scale is not None and quantized.zero is not None
    assert quantized.scale.shape == quantized.zero.shape == (128 // group, 1, HEAD_DIM)
    assert quantized.scale.dtype == quantized.zero.dtype == torch.float16
    error = (quantized.dequantize(torch.float32) - keys).abs()
    assert (error <= error_bound(keys, quantized, keys)).all()
    assert error.max() > 0  # the bound is tested on real rounding, not on a lossless path


@pytest.mark.parametrize("bits", PACKED)
@pytest.mark.parametrize("group", [16, 64])
def test_values_within_half_a_step_per_token(bits: int, group: int) -> None:
    values = torch.randn(2, 37, HEAD_DIM, generator=generator()) * 2 - 0.5
    quantized = quantize_values(values, bits, group)
    assert quantized.scale is not None and quantized.zero is not None
    assert quantized.scale.shape == quantized.zero.shape == (2, 37, HEAD_DIM // group, 1)
    error = (quantized.dequantize(torch.float32) - values).abs()
    grouped = values.reshape(2, 37, HEAD_DIM // group, group)
    assert (error <= error_bound(values, quantized, grouped)).all()
    assert error.max() > 0


def test_value_group_falls_back_to_a_divisor() -> None:
    assert value_group(HEAD_DIM, 48) == 32
    assert value_group(96, 64) == 48
    assert value_group(7, 4) == 1
    assert value_group(HEAD_DIM, 128) == HEAD_DIM
    quantized = quantize_values(torch.randn(5, 96, generator=generator()), 4, 64)
    assert quantized.scale is not None and quantized.scale.shape == (5, 2, 1)
    with pytest.raises(KvlabError):
        value_group(HEAD_DIM, 0)


@pytest.mark.parametrize("bits", PACKED)
def test_constant_groups_come_back_exactly(bits: int) -> None:
    keys = torch.randn(2, 8, HEAD_DIM, generator=generator())
    keys[0, :, 3] = 1.5  # one channel constant over a group of tokens (exact in float16)
    keys[1] = -3.25  # a whole group constant
    restored_keys = quantize_keys(keys, bits).dequantize(torch.float32)
    assert torch.equal(restored_keys[0, :, 3], keys[0, :, 3])
    assert torch.equal(restored_keys[1], keys[1])
    values = torch.randn(6, HEAD_DIM, generator=generator())
    values[2, 16:32] = 0.0  # one token's channel group constant
    values[4] = 7.0
    restored_values = quantize_values(values, bits, 16).dequantize(torch.float32)
    assert not restored_values.isnan().any()
    assert torch.equal(restored_values[2, 16:32], values[2, 16:32])
    assert torch.equal(restored_values[4], values[4])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_sixteen_bits_is_the_tensor_itself(dtype: torch.dtype) -> None:
    keys = torch.randn(4, 8, HEAD_DIM, generator=generator()).to(dtype)
    values = torch.randn(32, HEAD_DIM, generator=generator()).to(dtype)
    for original, quantized in ((keys, quantize_keys(keys, 16)), (values, quantize_values(values, 16, 32))):
        assert quantized.scale is None and quantized.zero is None
        assert quantized.packed is original
        assert torch.equal(quantized.dequantize(dtype), original)
        assert quantized.nbytes() == bytes_of(original)


@pytest.mark.parametrize("bits", PACKED)
def test_bytes_are_the_held_tensors_and_fall_with_the_bits(bits: int) -> None:
    groups, group, value_channels = 4, 32, 16
    keys = torch.randn(groups, group, HEAD_DIM, generator=generator()).to(torch.bfloat16)
    values = torch.randn(groups * group, HEAD_DIM, generator=generator()).to(torch.bfloat16)
    half = torch.tensor(0, dtype=torch.float16).element_size()
    for original, quantized, scales in (
        (keys, quantize_keys(keys, bits), groups * HEAD_DIM),
        (values, quantize_values(values, bits, value_channels), groups * group * HEAD_DIM // value_channels),
    ):
        held = [t for t in (quantized.packed, quantized.scale, quantized.zero) if t is not None]
        assert quantized.nbytes() == sum(bytes_of(t) for t in held)
        rows = original.numel() // HEAD_DIM
        packed_bytes = rows * math.ceil(HEAD_DIM * bits / 8)
        overhead = 2 * scales * half  # a scale and a zero point per group
        assert quantized.nbytes() == packed_bytes + overhead
        full = bytes_of(original)
        assert full * bits / 16 <= quantized.nbytes() <= full * bits / 16 + overhead < full


@pytest.mark.parametrize("bad", [0, 1, 3, 32, 4.0, True])
def test_bad_bits_are_one_sentence(bad) -> None:
    for call in (
        lambda: check_bits(bad, "Keys"),
        lambda: quantize_keys(torch.zeros(1, 4, 8), bad),
        lambda: quantize_values(torch.zeros(4, 8), bad, 4),
    ):
        with pytest.raises(KvlabError) as raised:
            call()
        message = str(raised.value)
        assert "\n" not in message and message.endswith(".") and message.count(". ") == 0
    assert check_bits(4, "Keys") == 4 and set(BITS) == {2, 4, 8, 16}


@pytest.mark.parametrize("bits", PACKED)
def test_per_channel_keys_beat_per_token_keys_on_an_outlier_channel(bits: int) -> None:
    """KIVI's reason for quantising keys per channel: one outlier channel stretches every token's range, so a
    per-token scale flattens all the other channels, while a per-channel scale confines it to its own channel."""
    keys = torch.randn(4, 32, HEAD_DIM, generator=generator())
    keys[..., 5] = keys[..., 5] * 4 + 40
    per_channel = quantize_keys(keys, bits).dequantize(torch.float32)
    per_token = quantize_values(keys.reshape(-1, HEAD_DIM), bits, HEAD_DIM).dequantize(torch.float32)
    channel_error = (per_channel - keys).abs().mean()
    token_error = (per_token.reshape(keys.shape) - keys).abs().mean()
    assert channel_error < token_error / 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_matches_the_cpu() -> None:
    keys = torch.randn(2, 4, 16, HEAD_DIM, generator=generator()).to(torch.bfloat16)
    values = torch.randn(2, 4, 64, HEAD_DIM, generator=generator()).to(torch.bfloat16)
    for bits in PACKED:
        for quantize in (lambda x: quantize_keys(x, bits), lambda x: quantize_values(x, bits, 32)):
            for x in (keys, values):
                on_cpu, on_gpu = quantize(x), quantize(x.cuda())
                assert torch.equal(on_gpu.packed.cpu(), on_cpu.packed)
                assert torch.equal(on_gpu.dequantize(torch.bfloat16).cpu(), on_cpu.dequantize(torch.bfloat16))
