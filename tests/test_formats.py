"""Block-scaled formats: the Triton quantize kernel against the PyTorch reference, known values,
round trips and the 128x4 scale layouts."""

import pytest
import torch
import triton
import triton.language as tl

import llmkernels as lk
from llmkernels.formats import (
    ScaledTensor,
    from_blocked_scales,
    from_grouped_blocked_scales,
    reference,
    to_blocked_scales,
    to_grouped_blocked_scales,
)
from llmkernels.formats import api as formats_api
from llmkernels.formats.kernel import decode_e2m1, decode_e2m1_pairs_bf16, decode_scale
from llmkernels.testing import poison, relative_error

# dequantize(quantize(x)) vs x, relative error bounds for Gaussian x (rms error of the element type)
ROUND_TRIP_TOLERANCE = {"mxfp8": 0.04, "mxfp4": 0.16, "nvfp4": 0.13}
FORMAT_NAMES = ["mxfp8", "mxfp4", "nvfp4"]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def _wide_range_input(shape, dtype, device):
    """Gaussian rows whose magnitudes span ~2^±8, so scales of many exponents occur."""
    x = torch.randn(shape, device=device) * torch.exp2(torch.randint(-8, 9, (*shape[:-1], 1), device=device).float())
    return x.to(dtype)


@pytest.mark.parametrize("format", FORMAT_NAMES)
@pytest.mark.parametrize("shape", [(1, 32), (5, 96), (3, 7, 256), (33, 160)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_quantize_kernel_matches_reference_bits(format, shape, dtype, device):
    x = _wide_range_input(shape, dtype, device)
    x.view(-1, shape[-1])[0, :16] = 0.0  # an all-zero block (nvfp4) / half block (MX)
    ours = lk.quantize(x, format)
    ref = lk.quantize_reference(x, format)
    assert ours.data.shape == ref.data.shape and ours.scales.shape == ref.scales.shape
    assert torch.equal(_bits(ours.scales), _bits(ref.scales)), "scales differ"
    assert torch.equal(_bits(ours.data), _bits(ref.data)), "data differ"
    if format == "nvfp4":
        assert torch.equal(ours.global_scale, ref.global_scale)


@pytest.mark.parametrize("format", FORMAT_NAMES)
def test_round_trip_error(format, device):
    x = torch.randn(64, 256, device=device)
    error = relative_error(lk.dequantize(lk.quantize(x, format)), x)
    assert 0 < error <= ROUND_TRIP_TOLERANCE[format]


@pytest.mark.parametrize("format", ["mxfp8", "mxfp4"])
def test_mx_requantize_is_identity(format, device):
    q = lk.quantize(_wide_range_input((8, 128), torch.float32, device), format)
    again = lk.quantize(lk.dequantize(q), format)
    assert torch.equal(_bits(again.data), _bits(q.data)) and torch.equal(_bits(again.scales), _bits(q.scales))


def test_mxfp4_known_values_round_to_nearest_even(device):
    # amax 7 -> scale 2^(floor(log2 7) - 2) = 1, so elements are coded as they are.
    values = [7.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.3, -5.5, 6.0, 0.0, 0.26, -1.0, 4.4, 1.5]
    expected = [6.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -0.5, -6.0, 6.0, 0.0, 0.5, -1.0, 4.0, 1.5]
    x = torch.tensor(values * 2, device=device)[None, :]
    for quantize in (lk.quantize, lk.quantize_reference):
        q = quantize(x, "mxfp4")
        assert _bits(q.scales).tolist() == [[127]]
        assert lk.dequantize(q)[0].tolist() == expected * 2
        assert _bits(q.data)[0, 0].item() == 0x07 | (0x00 << 4)  # 6.0 low nibble, 0.0 high nibble


def test_e2m1_encode_every_tie(device):
    """Every multiple of 1/64 in [-6, 6] (all of e2m1's ties among them) in blocks whose scale is 1:
    the kernel's e2m1 rounding gives the reference's codes."""
    grid = torch.arange(-6 * 64, 6 * 64 + 1, device=device, dtype=torch.float32) / 64
    blocks = torch.nn.functional.pad(grid, (0, (-grid.numel()) % 31)).view(-1, 31)
    x = torch.cat([torch.full((blocks.shape[0], 1), 6.0, device=device), blocks], 1)  # amax 6: scale 2^0
    for format, global_scale in (("mxfp4", None), ("nvfp4", torch.tensor(1.0, device=device))):
        q = lk.quantize(x, format, global_scale=global_scale)
        ref = lk.quantize_reference(x, format, global_scale=global_scale)
        assert torch.equal(q.data, ref.data), format


def test_negative_values_rounding_to_zero_keep_their_sign(device):
    """-tiny in a block with a large amax rounds to -0 (code 0x80 in e4m3, 0x8 in e2m1), as a cast
    does; found by the > 2^31-element GPU test, where random data hits it (about 1 in 250k)."""
    x = torch.zeros(2, 64, device=device)
    x[:, 0] = 100.0
    x[:, 1:5] = torch.tensor([-1e-6, 1e-6, -0.0, 0.0])
    for format in ("mxfp8", "mxfp4", "nvfp4"):
        q, ref = lk.quantize(x, format), lk.quantize_reference(x, format)
        assert torch.equal(q.data.view(torch.uint8), ref.data.view(torch.uint8)), format
    assert lk.quantize(x, "mxfp8").data.view(torch.uint8)[0, 1:5].tolist() == [0x80, 0x00, 0x80, 0x00]


def test_mxfp8_known_scale_and_saturation(device):
    x = torch.full((1, 32), 0.5, device=device)
    x[0, 0] = 1.0 * 1.99  # floor(log2) = 0 -> scale 2^(0 - 8); 1.99 / 2^-8 = 509 saturates to 448
    for quantize in (lk.quantize, lk.quantize_reference):
        q = quantize(x, "mxfp8")
        assert _bits(q.scales).tolist() == [[127 - 8]]
        decoded = lk.dequantize(q)[0]
        assert decoded[0].item() == 448.0 / 256 and decoded[1].item() == 0.5


def test_nvfp4_global_scale_is_decode_scale(device):
    x = torch.randn(4, 64, device=device)
    q = lk.quantize(x, "nvfp4")
    expected = x.abs().max() / (448.0 * 6.0)
    assert torch.allclose(q.global_scale, expected)
    # The largest element codes as 6 with a block scale of 448, so it decodes to amax.
    assert torch.allclose(lk.dequantize(q).abs().max(), x.abs().max())
    given = torch.tensor(0.01, device=device)
    q2 = lk.quantize(x, "nvfp4", global_scale=given)
    assert q2.global_scale.item() == pytest.approx(0.01)
    assert relative_error(lk.dequantize(q2), x) <= ROUND_TRIP_TOLERANCE["nvfp4"]


def test_blocked_layout_positions(device):
    rows, cols = 200, 9
    scales = torch.randint(0, 255, (rows, cols), dtype=torch.uint8, device=device).view(torch.float8_e8m0fnu)
    blocked = to_blocked_scales(scales)
    assert blocked.shape == (2, 3, 32, 16)
    flat = _bits(blocked).reshape(-1)
    for r, c in [(0, 0), (37, 5), (131, 8), (199, 3), (127, 4)]:
        tile = (r // 128) * 3 + c // 4
        byte = tile * 512 + (r % 32) * 16 + (r % 128) // 32 * 4 + c % 4
        assert flat[byte] == _bits(scales)[r, c]
    assert (flat.reshape(2, 3, 32, 4, 4)[1, :, :, 3, :] == 127).all()  # rows 224.. are padding (1.0)
    assert torch.equal(_bits(from_blocked_scales(blocked, rows, cols)), _bits(scales))


def test_blocked_layout_batched_round_trip(device):
    scales = torch.randint(0, 255, (3, 130, 8), dtype=torch.uint8, device=device).view(torch.float8_e4m3fn)
    blocked = to_blocked_scales(scales)
    assert blocked.shape == (3, 2, 2, 32, 16)
    assert torch.equal(_bits(from_blocked_scales(blocked, 130, 8)), _bits(scales))


def test_grouped_blocked_layout(device):
    sizes = [130, 0, 5, 128, 1]
    offsets = torch.tensor([0, 130, 130, 135, 263, 264], dtype=torch.int32, device=device)
    num_rows = 270  # 6 rows past the last group
    scales = torch.randint(0, 255, (num_rows, 6), dtype=torch.uint8, device=device).view(torch.float8_e8m0fnu)
    blocked, group_scale_offsets = to_grouped_blocked_scales(scales, offsets)
    # Tiles per group: 2, 0, 1, 1, 1 -> first tiles 0, 2, 2, 3, 4.
    first_tiles = [0, 2, 2, 3, 4]
    assert group_scale_offsets.tolist() == [f - o // 128 for f, o in zip(first_tiles, offsets[:-1].tolist())]
    flat = _bits(blocked).reshape(blocked.shape[0], blocked.shape[1], 512)
    starts = offsets.tolist()
    for g, size in enumerate(sizes):
        for local in {0, size // 2, size - 1} if size else set():
            row = starts[g] + local
            tile_row = local // 128 + starts[g] // 128 + group_scale_offsets[g].item()
            byte = (local % 128 % 32) * 16 + (local % 128) // 32 * 4 + 5 % 4
            assert flat[tile_row, 5 // 4, byte] == _bits(scales)[row, 5]
    back = from_grouped_blocked_scales(blocked, offsets, num_rows, 6)
    assert torch.equal(_bits(back)[:264], _bits(scales)[:264])
    assert (_bits(back)[264:] == 127).all()


@pytest.mark.parametrize("format", FORMAT_NAMES)
def test_to_layout_round_trip_and_dequantize(format, device):
    x = torch.randn(150, 64, device=device)
    q = lk.quantize(x, format)
    offsets = torch.tensor([0, 3, 3, 140, 150], dtype=torch.int32, device=device)
    for blocked in (q.to_layout("128x4"), lk.quantize(x, format, scale_layout="128x4", group_offsets=offsets)):
        assert blocked.scale_layout == "128x4"
        assert torch.equal(lk.dequantize(blocked), lk.dequantize(q))
        assert torch.equal(_bits(blocked.to_layout("row").scales), _bits(q.scales))


def test_quantize_rejects_bad_input(device):
    x = torch.randn(4, 64, device=device)
    with pytest.raises(ValueError, match="format"):
        lk.quantize(x, "fp6")
    with pytest.raises(TypeError, match="x must be"):
        lk.quantize(x.to(torch.int32), "mxfp8")
    with pytest.raises(ValueError, match="multiple of 32"):
        lk.quantize(torch.randn(4, 48, device=device), "mxfp4")
    with pytest.raises(ValueError, match="global_scale is for nvfp4"):
        lk.quantize(x, "mxfp8", global_scale=torch.tensor(1.0, device=device))


def test_scaled_tensor_rejects_inconsistent_parts(device):
    q = lk.quantize(torch.randn(4, 64, device=device), "nvfp4")
    with pytest.raises(TypeError, match="data must be"):
        ScaledTensor(q.data.view(torch.int8), q.scales, "nvfp4", q.global_scale)
    with pytest.raises(ValueError, match="do not fit"):
        ScaledTensor(q.data, q.scales[:, :2], "nvfp4", q.global_scale)
    with pytest.raises(TypeError, match="global_scale"):
        ScaledTensor(q.data, q.scales, "nvfp4")
    with pytest.raises(TypeError, match="scales must be"):
        ScaledTensor(q.data, q.scales, "mxfp4")


@triton.jit
def _decode_codes_kernel(codes_ptr, e2m1_ptr, e8m0_ptr, e4m3_ptr):
    offsets = tl.arange(0, 256)
    codes = tl.load(codes_ptr + offsets)
    tl.store(e2m1_ptr + offsets, decode_e2m1(codes & 0xF))
    tl.store(e8m0_ptr + offsets, decode_scale(codes, "e8m0"))
    tl.store(e4m3_ptr + offsets, decode_scale(codes, "e4m3"))


def test_kernel_decoders_match_the_reference_for_every_code(device):
    codes = torch.arange(256, dtype=torch.int32, device=device).to(torch.uint8)
    e2m1, e8m0, e4m3 = (poison(torch.empty(256, device=device)) for _ in range(3))
    _decode_codes_kernel[(1,)](codes, e2m1, e8m0, e4m3)
    expected_e2m1 = reference.decode_e2m1(codes & 0xF)
    assert torch.equal(e2m1, expected_e2m1), (e2m1, expected_e2m1)
    expected_e8m0 = reference.decode_e8m0(codes)
    assert torch.equal(e8m0[:255], expected_e8m0[:255]) and torch.isnan(e8m0[255])
    expected_e4m3 = codes.view(torch.float8_e4m3fn).float()
    finite = torch.isfinite(expected_e4m3)  # scales are never NaN (and the interpreter decodes 0x7F as 480)
    assert torch.equal(e4m3[finite], expected_e4m3[finite])


@triton.jit
def _decode_pairs_kernel(packed_ptr, scale_ptr, even_ptr, odd_ptr, SIZE: tl.constexpr):
    offsets = tl.arange(0, SIZE)
    even, odd = decode_e2m1_pairs_bf16(tl.load(packed_ptr + offsets), tl.load(scale_ptr + offsets))
    tl.store(even_ptr + offsets, even)
    tl.store(odd_ptr + offsets, odd)


@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="PTX decoder: NVIDIA GPUs only (the interpreter decodes in float32)"
)
def test_packed_e2m1_decoder_matches_the_reference_for_every_byte_and_scale():
    """Every byte (two codes, both signs, ±0) times every e8m0 scale (subnormal 2^-127 and NaN included)
    and every finite e4m3 scale, against the float32 reference rounded to bf16: bit for bit."""
    device = torch.device("cuda")
    e8m0 = reference.decode_e8m0(torch.arange(256, device=device).to(torch.uint8))
    e4m3 = torch.arange(256, device=device).to(torch.uint8).view(torch.float8_e4m3fn).float()
    scales = torch.cat([e8m0, e4m3[torch.isfinite(e4m3)]])
    packed = torch.arange(256, device=device).to(torch.uint8).repeat(scales.numel())
    scale = scales.repeat_interleave(256).to(torch.bfloat16)
    size = triton.next_power_of_2(packed.numel())
    packed = torch.cat([packed, torch.zeros(size - packed.numel(), dtype=torch.uint8, device=device)])
    scale = torch.cat([scale, torch.ones(size - scale.numel(), dtype=torch.bfloat16, device=device)])
    even, odd = (poison(torch.empty(size, dtype=torch.bfloat16, device=device)) for _ in range(2))
    _decode_pairs_kernel[(1,)](packed, scale, even, odd, SIZE=size, num_warps=8)
    expected_even = (reference.decode_e2m1(packed & 0xF) * scale.float()).to(torch.bfloat16)
    expected_odd = (reference.decode_e2m1(packed >> 4) * scale.float()).to(torch.bfloat16)
    for got, expected in ((even, expected_even), (odd, expected_odd)):
        nan = expected.isnan()
        assert torch.equal(got.isnan(), nan)
        assert torch.equal(got[~nan].view(torch.int16), expected[~nan].view(torch.int16))


@pytest.mark.parametrize("gather_after", [False, True], ids=["one-pass", "quantize-then-gather"])
@pytest.mark.parametrize("format", FORMAT_NAMES)
def test_quantize_gathered_rows_match_quantize_of_the_gather(format, gather_after, device, monkeypatch):
    """Both ways of ``rows=`` (one pass; x quantized whole then its rows copied, for large gathers) give the bits of
    quantizing ``x[rows]``, indices clamped to x's rows."""
    if gather_after:
        monkeypatch.setattr(formats_api, "GATHER_AFTER_MIN_ELEMENTS", 0)
    x = _wide_range_input((9, 96), torch.bfloat16, device)
    rows = torch.tensor([4, 0, 4, 8, 1, 7, 7, 2, 3, 5, 6, 0, 8, 4, 1, 3, 2, 2, 0, 7], device=device)  # repeated
    gathered = lk.quantize(x, format, rows=rows, global_scale=lk.quantize(x, format).global_scale)
    expected = lk.quantize(x[rows], format, global_scale=lk.quantize(x, format).global_scale)
    assert torch.equal(_bits(gathered.data), _bits(expected.data))
    assert torch.equal(_bits(gathered.scales), _bits(expected.scales))
    if format == "nvfp4":  # the default global scale comes from all of x
        assert torch.equal(lk.quantize(x, format, rows=rows[:3]).global_scale, lk.quantize(x, format).global_scale)
    with pytest.raises(TypeError, match="rows"):
        lk.quantize(x, format, rows=rows.float())
    with pytest.raises(ValueError, match="rows"):
        lk.quantize(x[None], format, rows=rows)


# --- regressions found by the property tests (tests/test_properties.py) ----------------------------


def test_mxfp8_keeps_the_sign_of_zero(device):
    """-0.0, and negatives that round to zero, code as e4m3 -0 (0x80): the bits of the reference's
    PyTorch cast (the kernel's round-by-addition gave +0)."""
    x = torch.full((2, 32), 0.5, device=device)
    x[0, :4] = torch.tensor([-0.0, 0.0, -1e-6, 1e-6])  # 1e-6 / 2^-9 is below half the smallest subnormal
    x[1] = -0.0  # an all-(-0) block
    q = lk.quantize(x, "mxfp8")
    assert _bits(q.data)[0, :4].tolist() == [0x80, 0x00, 0x80, 0x00]
    assert (_bits(q.data)[1] == 0x80).all()
    assert torch.equal(_bits(q.data), _bits(lk.quantize_reference(x, "mxfp8").data))


@pytest.mark.parametrize("format", FORMAT_NAMES)
@pytest.mark.parametrize("shape", [(0, 64), (3, 0, 64)])
def test_quantize_empty_input(format, shape, device):
    """No rows: empty data and scales (nvfp4's default global scale used to fail in aminmax)."""
    x = torch.empty(shape, device=device)
    for quantize in (lk.quantize, lk.quantize_reference):
        q = quantize(x, format)
        assert q.shape == x.shape and lk.dequantize(q).shape == x.shape
        if format == "nvfp4":
            assert q.global_scale.item() == 1.0


@pytest.mark.parametrize("format", FORMAT_NAMES)
def test_grouped_blocked_layout_with_no_groups(format, device):
    """group_offsets = [0] (G = 0, which grouped_matmul accepts): every row is outside the groups
    (to_grouped_blocked_scales used to index an empty tensor)."""
    x = torch.randn(5, 64, device=device)
    offsets = torch.zeros(1, dtype=torch.int32, device=device)
    q = lk.quantize(x, format, scale_layout="128x4", group_offsets=offsets)
    assert q.group_scale_offsets.shape == (0,) and q.scales.shape == (1, 1, 32, 16)
    one = lk.FORMATS[format].scale_one_bits
    assert (_bits(q.to_layout("row").scales) == one).all()  # rows outside every group read as 1.0
    w = lk.quantize(torch.randn(2, 32, 64, device=device), "nvfp4" if format == "nvfp4" else "mxfp8")
    out = poison(torch.empty(5, 32, device=device))
    lk.grouped_matmul(q, w, offsets, torch.zeros(0, dtype=torch.int32, device=device), out=out, out_dtype=torch.float32)
    assert out.isnan().all()
