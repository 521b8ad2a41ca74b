"""The fp8 block format (DeepSeek-style): e4m3 data with one float32 scale per ``(1, 128)`` (activations) or
``(128, 128)`` (weights) tile.

The quantize kernel must give the bits of ``quantize_reference``; the reference itself is checked against the
rule in float64 (scale = amax / 448 rounded to float32, element = the nearest e4m3 value of x / scale), and
dequantize against the exact float64 decode.
"""

import math

import pytest
import torch
from public_calls import forbid_launches, poisoned_buffer

import llmkernels as lk
from llmkernels import runtime
from llmkernels.formats import api as formats_api
from llmkernels.formats import quantize_reference, scaled_tensor_from_parts, scaled_tensor_parts

ACTIVATIONS, WEIGHTS = (1, 128), (128, 128)


@pytest.fixture(autouse=True)
def _poisoned_outputs(monkeypatch):
    """Every buffer a kernel writes starts NaN / 0xFF: an element the kernel leaves unwritten shows."""
    monkeypatch.setattr(runtime, "new_buffer", poisoned_buffer)


def _wide_range(shape, dtype, device) -> torch.Tensor:
    """Normal values times a power of two per 32 columns (2^-20 .. 2^20; fp16 2^-10 .. 2^10): tiles with scales far apart, and small
    elements inside a tile with a large amax (e4m3 subnormal codes)."""
    span = 10 if dtype == torch.float16 else 20  # (fp16 overflows past 65504)
    exponents = torch.randint(-span, span + 1, (*shape[:-1], math.ceil(shape[-1] / 32)))
    factors = torch.exp2(exponents.float()).repeat_interleave(32, dim=-1)[..., : shape[-1]]
    return (torch.randn(shape) * factors).to(dtype).to(device)


def _bits(x: lk.ScaledTensor) -> tuple:
    return x.data.view(torch.uint8), x.scales.view(torch.int32)


def assert_same_bits(got: lk.ScaledTensor, expected: lk.ScaledTensor):
    assert got.format == expected.format == "fp8" and got.block == expected.block
    assert got.data.shape == expected.data.shape and got.scales.shape == expected.scales.shape
    assert got.data.dtype == torch.float8_e4m3fn and got.scales.dtype == torch.float32
    for name, a, b in zip(("data", "scales"), _bits(got), _bits(expected)):
        mismatched = (a.cpu() != b.cpu()).nonzero()
        assert mismatched.numel() == 0, f"{name}: {mismatched.shape[0]} elements differ, first at {mismatched[:4]}"


CASES = [
    # block, shape, dtype, power_of_two_scales
    (ACTIVATIONS, (5, 128), torch.float32, False),
    (ACTIVATIONS, (3, 4, 320), torch.bfloat16, False),
    (ACTIVATIONS, (7, 200), torch.float16, False),
    (ACTIVATIONS, (200,), torch.float32, True),
    (ACTIVATIONS, (6, 320), torch.bfloat16, True),
    (WEIGHTS, (130, 200), torch.float32, False),  # partial tiles in both dims
    (WEIGHTS, (2, 129, 128), torch.bfloat16, False),  # 3D weights, K = 128
    (WEIGHTS, (3, 20, 320), torch.float16, True),  # N < 128
]


@pytest.mark.parametrize(("block", "shape", "dtype", "power_of_two"), CASES, ids=str)
def test_quantize_bits_match_the_reference(block, shape, dtype, power_of_two, device):
    x = _wide_range(shape, dtype, device)
    got = lk.quantize(x, "fp8", block=block, power_of_two_scales=power_of_two)
    assert_same_bits(got, quantize_reference(x, "fp8", block=block, power_of_two_scales=power_of_two))
    rows, cols = block
    scale_rows = () if len(shape) == 1 else (shape[-2] if rows == 1 else math.ceil(shape[-2] / rows),)
    assert got.scales.shape == (*shape[:-2], *scale_rows, math.ceil(shape[-1] / cols))


def _e4m3_half_ulp(v: torch.Tensor) -> torch.Tensor:
    """Half the e4m3 spacing at |v| (float64): 2^(max(floor(log2 |v|), -6) - 4); 3 mantissa bits."""
    exponent = torch.floor(torch.log2(v.abs().clamp_min(2.0**-6)))
    return torch.exp2(exponent - 4)


@pytest.mark.parametrize("power_of_two", [False, True])
@pytest.mark.parametrize("block", [ACTIVATIONS, WEIGHTS])
def test_reference_follows_the_rule_in_float64(block, power_of_two, device):
    """Independent of the reference's code: each scale is amax / 448 rounded to float32 (or the next power of two
    up), each element within half an e4m3 ulp of x / scale (ties to an even code), and 448 never exceeded."""
    x = _wide_range((2, 150, 260), torch.float32, device).double()
    q = quantize_reference(x.float(), "fp8", block=block, power_of_two_scales=power_of_two)
    rows, cols = block
    r, k = x.shape[-2:]
    padded = torch.nn.functional.pad(x.abs(), (0, -k % cols, 0, -r % rows))
    amax = padded.reshape(2, -1, rows, math.ceil(k / cols), cols).amax(dim=(-3, -1))
    expected = (amax / 448).float().double()
    if power_of_two:
        expected = torch.exp2(torch.ceil(torch.log2(expected)))
    assert torch.equal(q.scales.double(), expected)
    per_element = q.scales.double().repeat_interleave(rows, -2).repeat_interleave(cols, -1)[..., :r, :k]
    scaled = (x / per_element).float().double()  # x / scale, correctly rounded to float32
    decoded = q.data.double()
    assert decoded.abs().max() <= 448
    error = (decoded - scaled).abs()
    assert (error <= _e4m3_half_ulp(scaled)).all()
    ties = error == _e4m3_half_ulp(scaled)
    assert (q.data[ties].view(torch.uint8) % 2 == 0).all(), "a tie rounds to the even code"
    if not power_of_two:  # the element that is the amax becomes ±448: every tile's largest code is 448
        decoded_tiles = torch.nn.functional.pad(decoded.abs(), (0, -k % cols, 0, -r % rows))
        tile_max = decoded_tiles.reshape(2, -1, rows, math.ceil(k / cols), cols).amax(dim=(-3, -1))
        assert (tile_max == 448).all()


def test_special_tiles(device):
    """A zero tile (scale 1.0, zeros), a NaN tile (NaN scale and elements, the other tiles untouched), values
    near 448, e4m3 subnormal codes and their ties."""
    x = torch.randn(4, 512)
    x[0, :128] = 0.0
    x[1, 128:256] = torch.randn(128)
    x[1, 130] = float("nan")
    x[2, :128] = torch.linspace(-448, 448, 128)  # amax 448: scale 1.0
    x[2, 1] = 447.0  # between 440 and 448: nearest 448
    x[2, 128:256] = 0.0
    x[2, 128] = 448.0  # scale 1.0 again, and e4m3 subnormals: 2^-9 · (1, 0.5, 1.5, 2.5, 0.25), negatives
    x[2, 129:135] = torch.tensor([1.0, 0.5, 1.5, 2.5, 0.25, -2.5]) * 2.0**-9
    x[3, 256:384] = 1e-30  # tiny but normal
    x = x.to(device)
    for power_of_two in (False, True):
        q = lk.quantize(x, "fp8", block=ACTIVATIONS, power_of_two_scales=power_of_two)
        assert_same_bits(q, quantize_reference(x, "fp8", block=ACTIVATIONS, power_of_two_scales=power_of_two))
        scales, data = q.scales.cpu(), q.data.cpu()
        assert scales[0, 0] == 1.0 and (data[0, :128].float() == 0).all()
        assert scales[1, 1].isnan() and data[1, 128:256].float().isnan().all()
        assert not data[1, :128].float().isnan().any() and not data[1, 256:].float().isnan().any()
        assert scales[2, 0] == 1.0 and scales[2, 1] == 1.0
        assert data[2, 0].float() == -448 and data[2, 127].float() == 448 and data[2, 1].float() == 448
        codes = data[2, 129:135].view(torch.uint8).tolist()
        # 2^-9 is code 1; 0.5 ulp ties to 0; 1.5 ulp ties to 2; 2.5 ulp ties to 2; 0.25 ulp rounds to 0
        assert codes == [0x01, 0x00, 0x02, 0x02, 0x00, 0x82]
        assert scales[3, 2] > 0 and (data[3, 256:384].float() == 448).all() != power_of_two


def test_all_zero_weight_tile_and_nan(device):
    x = torch.randn(2, 130, 140)
    x[0, :128, :128] = 0.0
    x[1, 128:, 128:] = float("nan")
    x = x.to(device)
    q = lk.quantize(x, "fp8", block=WEIGHTS)
    assert_same_bits(q, quantize_reference(x, "fp8", block=WEIGHTS))
    scales = q.scales.cpu()
    assert scales[0, 0, 0] == 1.0 and (q.data[0, :128, :128].cpu().float() == 0).all()
    assert scales[1, 1, 1].isnan() and scales.isnan().sum() == 1


def _views(tensor: torch.Tensor):
    """Strided, expanded, offset and (2D and up) transposed views holding tensor's values."""
    strided = torch.empty((*tensor.shape[:-1], 2 * tensor.shape[-1]), dtype=tensor.dtype, device=tensor.device)
    yield "strided", strided[..., ::2].copy_(tensor)
    yield "expanded", tensor.narrow(0, 0, 1).expand(tensor.shape)
    offset = torch.empty(tensor.numel() + 3, dtype=tensor.dtype, device=tensor.device)
    yield "offset", offset[3:].view(tensor.shape).copy_(tensor)
    if tensor.dim() >= 2:
        transposed = torch.empty(
            (*tensor.shape[:-2], tensor.shape[-1], tensor.shape[-2]), dtype=tensor.dtype, device=tensor.device
        )
        yield "transposed", transposed.transpose(-1, -2).copy_(tensor)


@pytest.mark.parametrize("block", [ACTIVATIONS, WEIGHTS])
def test_any_view_of_x_gives_the_bits_of_its_contiguous_copy(block, device):
    x = _wide_range((2, 129, 72) if block == WEIGHTS else (9, 200), torch.bfloat16, device)
    expected = quantize_reference(x, "fp8", block=block)
    for kind, view in _views(x):
        same_values = kind != "expanded"  # (an expanded view repeats its first slice)
        reference = expected if same_values else quantize_reference(view.contiguous(), "fp8", block=block)
        assert_same_bits(lk.quantize(view, "fp8", block=block), reference)


def test_rows_gather_any_view(device):
    """``rows=`` quantizes x[rows] in one pass (indices clamped to x's rows), with any view of x and rows."""
    x = _wide_range((9, 200), torch.float32, device)
    rows = torch.tensor([3, 0, 8, 8, 4, 1, 7], device=device)
    expected = quantize_reference(x[rows], "fp8", block=ACTIVATIONS)
    assert_same_bits(lk.quantize(x, "fp8", block=ACTIVATIONS, rows=rows), expected)
    assert_same_bits(lk.quantize(x, "fp8", block=ACTIVATIONS, rows=rows.int(), power_of_two_scales=False), expected)
    for _kind, view in _views(x):
        assert_same_bits(
            lk.quantize(view, "fp8", block=ACTIVATIONS, rows=rows),
            quantize_reference(view.contiguous()[rows], "fp8", block=ACTIVATIONS),
        )
    for _kind, view in _views(rows):
        assert_same_bits(
            lk.quantize(x, "fp8", block=ACTIVATIONS, rows=view),
            quantize_reference(x[view.contiguous()], "fp8", block=ACTIVATIONS),
        )
    clamped = torch.tensor([-5, 20], device=device)
    assert_same_bits(
        lk.quantize(x, "fp8", block=ACTIVATIONS, rows=clamped), quantize_reference(x[[0, 8]], "fp8", block=ACTIVATIONS)
    )


def test_rows_gather_after_quantize(device, monkeypatch):
    """Large gathers quantize x once and copy its rows: the bits of the one-pass gather, indices clamped."""
    monkeypatch.setattr(formats_api, "GATHER_AFTER_MIN_ELEMENTS", 0)
    x = _wide_range((5, 200), torch.bfloat16, device)
    rows = torch.tensor([3, 0, 4, 4, -5, 1, 20, 2, 3, 0, 1], device=device)
    for _kind, view in _views(rows):
        expected = quantize_reference(x[view.contiguous().clamp(0, 4)], "fp8", block=ACTIVATIONS)
        assert_same_bits(lk.quantize(x, "fp8", block=ACTIVATIONS, rows=view), expected)
    narrow = x[:, :128]  # a strided view, one scale block a row
    assert_same_bits(
        lk.quantize(narrow, "fp8", block=ACTIVATIONS, rows=rows.int()),
        quantize_reference(narrow[rows.clamp(0, 4)], "fp8", block=ACTIVATIONS),
    )


@pytest.mark.parametrize("block", [ACTIVATIONS, WEIGHTS])
def test_dequantize_within_half_an_e4m3_ulp(block, device):
    """dequantize is float(data) · scale in float32 (the float64 product rounded once), within half an e4m3 ulp
    of x per element (in x's units: half the ulp of x / scale, times the scale)."""
    x = _wide_range((2, 130, 200), torch.float32, device)
    q = lk.quantize(x, "fp8", block=block)
    values = lk.dequantize(q)
    assert values.dtype == torch.float32 and values.shape == x.shape
    rows, cols = block
    per_element = q.scales.double().repeat_interleave(rows, -2).repeat_interleave(cols, -1)[..., :130, :200]
    assert torch.equal(values, (q.data.double() * per_element).float())
    bound = _e4m3_half_ulp(x.double() / per_element) * per_element * (1 + 2.0**-20)
    assert ((values.double() - x.double()).abs() <= bound).all()
    rebuilt = lk.ScaledTensor(q.data, q.scales, "fp8", block=block)  # from checkpoint parts
    assert torch.equal(lk.dequantize(rebuilt), values)
    for _kind, view in _views(q.scales):  # any view of the parts: the values of its contiguous copy
        contiguous = lk.dequantize(lk.ScaledTensor(q.data, view.contiguous(), "fp8", block=block))
        assert torch.equal(lk.dequantize(lk.ScaledTensor(q.data, view, "fp8", block=block)), contiguous)


def test_scaled_tensor_checks_each_part(device):
    w = lk.quantize(torch.randn(2, 130, 200, device=device), "fp8", block=WEIGHTS)
    a = lk.quantize(torch.randn(5, 200, device=device), "fp8", block=ACTIVATIONS)
    data, scales = w.data, w.scales
    assert w.block == WEIGHTS and a.block == ACTIVATIONS and w.scales.shape == (2, 2, 2)
    assert lk.ScaledTensor(data, scales, "fp8", block=[128, 128]).block == WEIGHTS  # a list is taken as the pair
    assert lk.ScaledTensor(a.data[0], a.scales[0], "fp8", block=ACTIVATIONS).shape == (200,)
    bad = [
        ("data", TypeError, lambda: lk.ScaledTensor(data.view(torch.uint8), scales, "fp8", block=WEIGHTS)),
        ("data", TypeError, lambda: lk.ScaledTensor(data.bfloat16(), scales, "fp8", block=WEIGHTS)),
        ("scales", TypeError, lambda: lk.ScaledTensor(data, scales.bfloat16(), "fp8", block=WEIGHTS)),
        ("scales", TypeError, lambda: lk.ScaledTensor(data, scales.view(torch.int32), "fp8", block=WEIGHTS)),
        ("block", ValueError, lambda: lk.ScaledTensor(data, scales, "fp8")),
        ("block", ValueError, lambda: lk.ScaledTensor(data, scales, "fp8", block=(64, 128))),
        ("block", ValueError, lambda: lk.ScaledTensor(data, scales, "fp8", block=(128, 64))),
        ("block", ValueError, lambda: lk.ScaledTensor(data, scales, "fp8", block=(128.0, 128))),
        ("block", ValueError, lambda: lk.ScaledTensor(data, scales, "fp8", block=128)),
        ("scale_layout", ValueError, lambda: lk.ScaledTensor(data, scales, "fp8", scale_layout="128x4", block=WEIGHTS)),
        ("global_scale", ValueError, lambda: lk.ScaledTensor(data, scales, "fp8", torch.ones(()), block=WEIGHTS)),
        ("data", ValueError, lambda: lk.ScaledTensor(data[0, 0], scales[0, 0], "fp8", block=WEIGHTS)),  # 1D
        ("scales", ValueError, lambda: lk.ScaledTensor(data, scales, "fp8", block=ACTIVATIONS)),
        ("scales", ValueError, lambda: lk.ScaledTensor(a.data, a.scales.T.contiguous(), "fp8", block=ACTIVATIONS)),
        ("block", ValueError, lambda: lk.ScaledTensor(*_mxfp8_parts(device), "mxfp8", block=WEIGHTS)),
        ("layout", ValueError, lambda: w.to_layout("128x4")),
    ]
    for dim in range(3):  # the scales one too many or too few along each dim
        for change in (1, -1):
            shape = list(scales.shape)
            shape[dim] += change
            wrong = torch.ones(shape, device=device)
            bad.append(("scales", ValueError, lambda wrong=wrong: lk.ScaledTensor(data, wrong, "fp8", block=WEIGHTS)))
    for name, error, make in bad:
        with pytest.raises(error, match=name):
            make()
    assert lk.ScaledTensor(*_mxfp8_parts(device), "mxfp8").block == (1, 32)
    assert lk.ScaledTensor(*_mxfp8_parts(device), "mxfp8", block=(1, 32)).block == (1, 32)


def _mxfp8_parts(device):
    x = lk.quantize(torch.randn(4, 64, device=device), "mxfp8")
    return x.data, x.scales


def test_parts_and_plan_key_carry_the_block(device):
    w = lk.quantize(torch.randn(130, 256, device=device), "fp8", block=WEIGHTS)
    a = lk.quantize(torch.randn(128, 256, device=device), "fp8", block=ACTIVATIONS)
    parts = scaled_tensor_parts(w)
    assert parts[8] == [128, 128] and parts[1].dtype == torch.uint8 and parts[1].shape == (2, 8)
    rebuilt = scaled_tensor_from_parts(*parts[:7], shape=parts[7], block=parts[8])
    assert rebuilt.block == WEIGHTS and torch.equal(lk.dequantize(rebuilt), lk.dequantize(w))
    assert scaled_tensor_parts(torch.randn(2, 3).bfloat16())[8] is None
    one_scale = lk.ScaledTensor(a.data, torch.ones(1, 2, device=device), "fp8", block=WEIGHTS)
    assert WEIGHTS in one_scale.plan_key() and ACTIVATIONS in a.plan_key()


def test_quantize_rejects_bad_arguments_before_any_launch(device, monkeypatch):
    x = torch.randn(4, 200, device=device)
    forbid_launches(monkeypatch)
    cases = [
        (ValueError, "block", lambda: lk.quantize(x, "fp8")),
        (ValueError, "block", lambda: lk.quantize(x, "fp8", block=(64, 128))),
        (ValueError, "block", lambda: lk.quantize(x[:, :192], "mxfp8", block=WEIGHTS)),
        (ValueError, "power_of_two_scales", lambda: lk.quantize(x[:, :192], "mxfp8", power_of_two_scales=True)),
        (TypeError, "power_of_two_scales", lambda: lk.quantize(x, "fp8", block=ACTIVATIONS, power_of_two_scales=1)),
        (ValueError, "rows", lambda: lk.quantize(x, "fp8", block=WEIGHTS, rows=torch.zeros(2, dtype=torch.int64))),
        (ValueError, "x", lambda: lk.quantize(x[0], "fp8", block=WEIGHTS)),
        (ValueError, "scale_layout", lambda: lk.quantize(x, "fp8", block=ACTIVATIONS, scale_layout="128x4")),
        (ValueError, "global_scale", lambda: lk.quantize(x, "fp8", block=ACTIVATIONS, global_scale=torch.ones(()))),
        (TypeError, "x", lambda: lk.quantize(x.double(), "fp8", block=ACTIVATIONS)),
        (ValueError, "forward-only", lambda: lk.quantize(x.clone().requires_grad_(), "fp8", block=ACTIVATIONS)),
    ]
    for error, message, call in cases:
        with pytest.raises(error, match=message):
            call()


@pytest.mark.parametrize(("block", "shape"), [(ACTIVATIONS, (3, 0)), (ACTIVATIONS, (0, 200)), (WEIGHTS, (2, 0, 128))])
def test_empty_shapes(block, shape, device):
    q = lk.quantize(torch.randn(shape, device=device), "fp8", block=block)
    assert q.shape == shape and lk.dequantize(q).shape == shape
