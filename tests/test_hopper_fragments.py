"""The Hopper register-fragment layout of MXFP4 and NVFP4 weights (``llmkernels.formats.layouts.hopper``): exact round trips
at odd shapes, zero/unit padding, and the decode contract a kernel relies on (masks and shifts of each word
give bf16 lanes that times 2^126 are the e2m1 values of the documented rows and columns)."""

import pytest
import torch
import triton
import triton.language as tl

from llmkernels.formats.layouts.hopper import (
    SLOT_BITS,
    decode_fragment_tile,
    from_hopper_fragments,
    to_hopper_fragments,
)
from llmkernels.runtime import interpreting

E2M1 = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], dtype=torch.float64)


def _operands(lead, n, k, seed=0, block=32):
    generator = torch.Generator().manual_seed(seed)
    data = torch.randint(0, 256, (*lead, n, k // 2), dtype=torch.uint8, generator=generator)
    scales = torch.randint(0, 256, (*lead, n, k // block), dtype=torch.uint8, generator=generator)
    return data, scales


@pytest.mark.parametrize("block", [32, 16], ids=["mx", "nv"])
@pytest.mark.parametrize("lead", [(), (3,)])
@pytest.mark.parametrize("n, k", [(16, 64), (1, 32), (5, 32), (17, 96), (48, 448), (33, 160)])
def test_round_trip_is_exact(lead, n, k, block):
    data, scales = _operands(lead, n, k, block=block)
    scale_dtype = torch.float8_e8m0fnu if block == 32 else torch.float8_e4m3fn
    fragment_data, fragment_scales = to_hopper_fragments(data, scales.view(scale_dtype), block)
    nb, kc = -(-n // 16), -(-k // 64)
    assert fragment_data.shape == (*lead, nb, kc, 8, 4, 16) and fragment_data.dtype == torch.uint8
    assert fragment_scales.shape == (*lead, nb, kc, 8, 2, 64 // block) and fragment_scales.dtype == torch.uint8
    back_data, back_scales = from_hopper_fragments(fragment_data, fragment_scales, n, k)
    assert torch.equal(back_data, data) and torch.equal(back_scales, scales)


def _decode(words: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What the kernel does to one word: four masked/shifted copies, each two bf16 lanes times 2^126;
    returns row g's four values (k = 2t, 2t+1, 2t+8, 2t+9) and row g+8's."""
    mask = 0x81C081C0
    slots = [
        words & mask,
        (words << 3) & mask,
        (words << 6) & mask,
        ((words << 1) & 0x80008000) | ((words >> 5) & 0x01000100) | ((words >> 4) & 0x00C000C0),
    ]

    def lanes(x):
        low = ((x & 0xFFFF).to(torch.int32) << 16).view(torch.float32).double()
        high = (((x >> 16) & 0xFFFF).to(torch.int32) << 16).view(torch.float32).double()
        return low * 2.0**126, high * 2.0**126

    (a, b), (c, d), (e, f), (g, h) = map(lanes, slots)
    return torch.stack([a, b, c, d], -1), torch.stack([e, f, g, h], -1)


def test_words_decode_to_the_fragment_values():
    n, k = 32, 128
    data, scales = _operands((), n, k, seed=1)
    data[0, :8] = torch.arange(0, 256, 32, dtype=torch.uint8) | torch.arange(8, dtype=torch.uint8)  # every code
    fragment_data, _ = to_hopper_fragments(data, scales)
    words = fragment_data.view(torch.int32).to(torch.int64) & 0xFFFFFFFF  # (nb, c, g, t, j)
    row_g, row_g8 = _decode(words)
    codes = torch.stack([data & 0xF, data >> 4], -1).reshape(n, k).long()
    values = E2M1[codes]
    nb, c, g, t, j = torch.meshgrid(*(torch.arange(s) for s in words.shape), indexing="ij")
    for i, dk in enumerate((0, 1, 8, 9)):
        cols = 64 * c + 16 * j + 2 * t + dk
        assert torch.equal(row_g[..., i], values[16 * nb + g, cols])
        assert torch.equal(row_g8[..., i], values[16 * nb + 8 + g, cols])


def test_slots_cover_every_bit_once():
    bits = [position for slot in SLOT_BITS for position in slot]
    assert sorted(bits) == list(range(16))


@pytest.mark.parametrize("block, unit", [(32, 127), (16, 0x38)], ids=["mx", "nv"])
def test_padding_is_zero_codes_and_unit_scales(block, unit):
    data, scales = _operands((), 5, 32, seed=2, block=block)
    fragment_data, fragment_scales = to_hopper_fragments(data, scales, block, unit)
    padded_data, padded_scales = from_hopper_fragments(fragment_data, fragment_scales, 16, 64)
    columns = 32 // block
    assert torch.equal(padded_data[:5, :16], data) and torch.equal(padded_scales[:5, :columns], scales)
    assert not padded_data[5:].any() and not padded_data[:, 16:].any()
    assert (padded_scales[5:] == unit).all() and (padded_scales[:, columns:] == unit).all()


def test_scales_that_do_not_fit_are_refused():
    data, scales = _operands((), 16, 64)
    with pytest.raises(ValueError, match="do not fit"):
        to_hopper_fragments(data, scales[:, :1])
    with pytest.raises(ValueError, match="do not fit"):
        to_hopper_fragments(data, scales, block=16)  # NVFP4 needs 4 per row here
    with pytest.raises(ValueError, match="16 or 32"):
        to_hopper_fragments(data, scales, block=64)


@triton.jit
def _decode_whole(
    data_ptr, scales_ptr, out_ptr, NB: tl.constexpr, C: tl.constexpr, PACKED_DECODE: tl.constexpr, SCALE: tl.constexpr
):
    """Decodes a whole fragment tensor ``[NB, C, 8, 4, 16]`` as one tile into ``out [NB * 16, C * 64]``."""
    S: tl.constexpr = 2 if SCALE == "e8m0" else 4
    a = tl.arange(0, NB)[:, None, None, None, None] * C + tl.arange(0, C)[None, :, None, None, None]
    data_offsets = (
        (a * 8 + tl.arange(0, 8)[None, None, :, None, None]) * 4 + tl.arange(0, 4)[None, None, None, :, None]
    ) * 16 + tl.arange(0, 16)[None, None, None, None, :]
    scale_offsets = (
        (a * 8 + tl.arange(0, 8)[None, None, :, None, None]) * 2 + tl.arange(0, 2)[None, None, None, :, None]
    ) * S + tl.arange(0, S)[None, None, None, None, :]
    values = decode_fragment_tile(
        tl.load(data_ptr + data_offsets), tl.load(scales_ptr + scale_offsets), NB, C, PACKED_DECODE, SCALE=SCALE
    )
    rows, cols = tl.arange(0, NB * 16), tl.arange(0, C * 64)
    tl.store(out_ptr + rows[:, None] * (C * 64) + cols[None, :], values.to(tl.float32))


@pytest.mark.parametrize("scale", ["e8m0", "e4m3"])
def test_kernel_tile_decode_gives_the_dequantized_weights(scale, device):
    """The device decode of a fragment tile (integer ops in the interpreter, PTX on a GPU) equals the
    dequantized row-layout weights, element for element: every code; e8m0 scales at 2^-127 (0), NaN (255)
    and in between; e4m3 scales subnormal, at 448, NaN (0x7F) and negative."""
    nb, c = 2, 2
    n, k = 16 * nb, 64 * c
    block = 32 if scale == "e8m0" else 16
    data, scales = _operands((), n, k, seed=3, block=block)
    if scale == "e8m0":
        scales = (scales % 40) + 100
        scales[0, 0], scales[1, 1], scales[2, 2] = 0, 255, 125
        scale_values = torch.where(scales == 255, float("nan"), torch.exp2(scales.double() - 127))
    else:
        scales[0, 0], scales[1, 1], scales[2, 2], scales[3, 3], scales[4, 4] = 0x01, 0x7E, 0x7F, 0xB8, 0x00
        scale_values = scales.view(torch.float8_e4m3fn).double()
    data[0, :8] = torch.arange(0, 256, 32, dtype=torch.uint8) | torch.arange(8, dtype=torch.uint8)
    fragment_data, fragment_scales = to_hopper_fragments(data, scales, block)
    out = torch.full((n, k), float("nan"), device=device)
    _decode_whole[(1,)](
        fragment_data.to(device), fragment_scales.to(device), out, nb, c, PACKED_DECODE=not interpreting(), SCALE=scale
    )
    codes = torch.stack([data & 0xF, data >> 4], -1).reshape(n, k).long()
    expected = E2M1[codes] * scale_values.repeat_interleave(block, dim=1)
    if interpreting():  # the interpreter's float32 → bf16 cast flushes subnormals (GPUs keep them: tested there)
        expected = torch.where(expected.abs() < 2.0**-126, 0.0 * expected, expected)
    assert expected.isnan().any()
    assert torch.equal(out.cpu().double().isnan(), expected.isnan())
    assert torch.equal(out.cpu().double().nan_to_num(), expected.nan_to_num())
