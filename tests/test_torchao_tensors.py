"""torchao's MXTensor / NVFP4Tensor (torchao 0.18) as ScaledTensors and back: same bits, views of the same storage,
torchao's own dequantized values for the views torchao's ops make (row and column slices, select, swizzled and 3D
tensors), a transposed one refused, and ``grouped_matmul`` / ``MoEFeedForward`` results equal to those of the same
data passed as ScaledTensors."""

import warnings

import pytest
import torch

import llmkernels as lk
from llmkernels.formats import from_torchao, is_torchao_tensor, to_torchao
from llmkernels.moe import MoEFeedForward
from llmkernels.testing import random_group_offsets

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    mx_tensor = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor")
    nvfp4_tensor = pytest.importorskip("torchao.prototype.mx_formats.nvfp4_tensor")

ELEMENTS = {"mxfp8": torch.float8_e4m3fn, "mxfp4": torch.float4_e2m1fn_x2}


def _torchao(x, fmt, swizzled=False):
    if fmt == "nvfp4":
        scale = (x.abs().amax().float() / (448 * 6)).clamp_min(2.0**-126)
        return nvfp4_tensor.NVFP4Tensor.to_nvfp4(x, per_tensor_scale=scale, is_swizzled_scales=swizzled)
    return mx_tensor.MXTensor.to_mx(x, ELEMENTS[fmt], 32, is_swizzled_scales=swizzled)


def _bits(x: lk.ScaledTensor):
    return x.data.view(torch.uint8), x.row_scales().view(torch.uint8)


@pytest.mark.parametrize("fmt", ["mxfp8", "mxfp4", "nvfp4"])
@pytest.mark.parametrize(
    "shape,swizzled",
    [((40, 64), False), ((3, 20, 96), False), ((200, 96), True), ((2, 128, 64), True)],
    ids=["2d", "3d", "2d_swizzled", "3d_swizzled"],
)
def test_round_trip_keeps_bits_and_storage(fmt, shape, swizzled, device):
    x = torch.randn(*shape, device=device) * 3
    theirs = _torchao(x, fmt, swizzled)
    assert is_torchao_tensor(theirs) and not is_torchao_tensor(x)
    ours = from_torchao(theirs)
    assert ours.format == fmt and ours.shape == x.shape and ours.scale_layout == ("128x4" if swizzled else "row")
    assert ours.data.data_ptr() == theirs.qdata.data_ptr() and ours.scales.data_ptr() == theirs.scale.data_ptr()
    quantized = lk.quantize(x, fmt, global_scale=ours.global_scale) if fmt == "nvfp4" else lk.quantize(x, fmt)
    assert all(torch.equal(u, v) for u, v in zip(_bits(ours), _bits(quantized)))
    assert torch.equal(lk.dequantize(ours), theirs.dequantize(torch.float32))
    back = to_torchao(ours, torch.float32)
    assert type(back) is type(theirs) and back.qdata.data_ptr() == theirs.qdata.data_ptr()
    assert torch.equal(back.dequantize(torch.float32), theirs.dequantize(torch.float32))


def test_grouped_matmul_and_moe_take_them(device):
    experts, n, k = 4, 64, 128
    x = torch.randn(30, k, device=device)
    w = torch.randn(experts, n, k, device=device) / k**0.5
    offsets = random_group_offsets([7, 0, 13, 10], device=device)
    ids = torch.arange(experts, dtype=torch.int32, device=device)
    for fmt in ("mxfp8", "mxfp4", "nvfp4"):
        a, b = _torchao(x, fmt), _torchao(w, fmt)
        expected = lk.grouped_matmul(from_torchao(a), from_torchao(b), offsets, ids)
        assert torch.equal(lk.grouped_matmul(a, b, offsets, ids), expected)
        assert torch.equal(
            lk.grouped_matmul(x.bfloat16(), b, offsets, ids),
            lk.grouped_matmul(x.bfloat16(), from_torchao(b), offsets, ids),
        )
    router = torch.randn(experts, k, device=device)
    w_gate_up, w_down = torch.randn(experts, 2 * n, k, device=device) / 8, torch.randn(experts, k, n, device=device) / 8
    theirs = MoEFeedForward(router, _torchao(w_gate_up, "mxfp4"), _torchao(w_down, "mxfp4"), 2)
    ours = MoEFeedForward(
        router, from_torchao(_torchao(w_gate_up, "mxfp4")), from_torchao(_torchao(w_down, "mxfp4")), 2
    )
    tokens = torch.randn(9, k, dtype=torch.bfloat16, device=device)
    assert torch.equal(theirs(tokens), ours(tokens))


def test_unsupported_ones_are_refused(device):
    x = torch.randn(64, 64, device=device)
    with pytest.raises(ValueError, match="elem_dtype"):
        from_torchao(mx_tensor.MXTensor.to_mx(x, torch.float8_e5m2, 32))
    with pytest.raises(TypeError, match="MXTensor"):
        from_torchao(x)
    with pytest.raises(ValueError, match="to_layout"):
        to_torchao(lk.quantize(x[None], "mxfp4").to_layout("hopper"))


def _dequantized(x) -> torch.Tensor:
    return x.dequantize(torch.float32)


# name: (logical shape, swizzled, view) of views torchao 0.18's own ops make and dequantize, slices at the
# boundaries they take (swizzled rows: at multiples of 128 or to the end)
TORCHAO_VIEWS = {
    "rows": ((40, 128), False, lambda t: t[3:37]),
    "narrow_rows": ((40, 128), False, lambda t: t.narrow(0, 5, 20)),
    "select_3d": ((3, 20, 64), False, lambda t: t[1]),
    "select_row": ((20, 64), False, lambda t: t[7]),
    "swizzled_rows_tail": ((200, 64), True, lambda t: t[128:]),
    "swizzled_rows_head": ((200, 64), True, lambda t: t[:128]),
    "swizzled_3d": ((2, 128, 64), True, lambda t: t),
    "swizzled_3d_partial_tiles": ((2, 100, 64), True, lambda t: t),  # torchao tiles the 200 rows as one
}


@pytest.mark.parametrize("fmt", ["mxfp8", "mxfp4", "nvfp4"])
@pytest.mark.parametrize("view", list(TORCHAO_VIEWS))
def test_views_give_torchaos_values(fmt, view, device):
    shape, swizzled, make_view = TORCHAO_VIEWS[view]
    if fmt == "nvfp4" and view == "select_row":
        pytest.skip("torchao 0.18 has no 1D NVFP4Tensor (its dequantize reads dim -2)")
    theirs = _torchao(torch.randn(*shape, device=device) * 3, fmt, swizzled)
    sliced = make_view(theirs)
    ours = from_torchao(sliced)
    assert ours.shape == sliced.shape
    assert torch.equal(lk.dequantize(ours), _dequantized(sliced))
    assert ours.data.untyped_storage().data_ptr() == theirs.qdata.untyped_storage().data_ptr()


@pytest.mark.parametrize("fmt", ["mxfp8", "mxfp4", "nvfp4"])
@pytest.mark.parametrize("columns", [(32, 96), (0, 64), (64, 128)], ids=["mid", "head", "tail"])
def test_column_slices_at_block_boundaries(fmt, columns, device):
    """torchao 0.18 slices columns at block boundaries (other starts it refuses) but cannot dequantize an
    MXTensor so sliced (it reads the non-contiguous data as transposed, and gives an MXFP4 one the shape
    ``[48, end - start]``): the values are then those of the unsliced tensor's columns."""
    start, end = columns
    theirs = _torchao(torch.randn(24, 128, device=device), fmt)
    ours = from_torchao(theirs[:, start:end])
    assert ours.shape == (24, end - start)
    assert torch.equal(lk.dequantize(ours), _dequantized(theirs)[:, start:end])
    if fmt == "nvfp4":
        assert torch.equal(lk.dequantize(ours), _dequantized(theirs[:, start:end]))
    with pytest.raises(AssertionError, match="multiple of block_size"):
        theirs[:, start + 8 : end]  # torchao's own refusal: never a ScaledTensor to make


def test_swizzled_nvfp4_column_slice(device):
    theirs = _torchao(torch.randn(200, 256, device=device), "nvfp4", swizzled=True)
    sliced = theirs[:, 64:128]
    ours = from_torchao(sliced)
    assert ours.scale_layout == "128x4"
    assert torch.equal(lk.dequantize(ours), _dequantized(sliced))
    assert torch.equal(lk.dequantize(ours), _dequantized(theirs)[:, 64:128])


@pytest.mark.parametrize("fmt", ["mxfp8", "mxfp4", "nvfp4"])
@pytest.mark.parametrize("swizzled", [False, True], ids=["row", "swizzled"])
def test_transposed_is_refused(fmt, swizzled, device):
    """A transposed MXTensor / NVFP4Tensor blocks along dim 0: read as a ScaledTensor (blocks along the last
    dim) its scales would scale the wrong elements."""
    theirs = _torchao(torch.randn(64, 128, device=device), fmt, swizzled)
    with pytest.raises(
        ValueError,
        match=r"^x: a transposed \w+ of shape \(128, 64\): its blocks run along dim 0, "
        r"and a ScaledTensor blocks along the last dim",
    ):
        from_torchao(theirs.t())
    with pytest.raises(ValueError, match="transposed"):  # torchao's linear hands its weight over as w.t()
        lk.grouped_matmul(
            torch.randn(5, 64, device=device, dtype=torch.bfloat16),
            theirs.t(),
            torch.tensor([0, 5], dtype=torch.int32, device=device),
            torch.zeros(1, dtype=torch.int32, device=device),
        )
    assert torch.equal(lk.dequantize(from_torchao(theirs.t().t())), _dequantized(theirs))


def test_transposed_3d_nvfp4_is_refused(device):
    theirs = _torchao(torch.randn(2, 32, 64, device=device), "nvfp4")
    with pytest.raises(ValueError, match="blocks run along dim 1"):
        from_torchao(theirs.transpose(1, 2))


def test_data_of_other_strides_is_not_transposed(device):
    """Data stored column-major with scales of the untransposed shape is the untransposed tensor (what the
    any-strides walk hands in), however torchao itself would read it."""
    x = torch.randn(64, 128, device=device)
    for fmt in ("mxfp8", "mxfp4", "nvfp4"):
        theirs = _torchao(x, fmt)
        column_major = theirs.qdata.t().contiguous().t()
        if fmt == "nvfp4":
            same = nvfp4_tensor.NVFP4Tensor(column_major, theirs.scale, 16, torch.float32, theirs.per_tensor_scale)
        else:
            same = mx_tensor.MXTensor(
                column_major, theirs.scale, ELEMENTS[fmt], 32, torch.float32, theirs.kernel_preference, None, False
            )
        assert torch.equal(lk.dequantize(from_torchao(same)), _dequantized(theirs))


def test_what_a_scaled_tensor_cannot_hold_is_refused(device):
    x = torch.randn(3, 32, 64, device=device)
    per_expert = x.abs().amax(dim=(1, 2), keepdim=True) / (448 * 6)
    with pytest.raises(ValueError, match=r"per_tensor_scale of shape \(3, 1, 1\)"):
        from_torchao(nvfp4_tensor.NVFP4Tensor.to_nvfp4(x, per_tensor_scale=per_expert))
    theirs = _torchao(x[0], "mxfp8")
    short_scale = mx_tensor.MXTensor(
        theirs.qdata, theirs.scale[:, :1], torch.float8_e4m3fn, 32, torch.float32, theirs.kernel_preference, None, False
    )
    with pytest.raises(ValueError, match="scale holds 32 scales, but data of logical shape"):
        from_torchao(short_scale)


@pytest.mark.parametrize("fmt", ["mxfp8", "mxfp4", "nvfp4"])
def test_to_torchao_of_any_strides_gives_our_values(fmt, device):
    """torchao reads non-contiguous MX data as transposed: to_torchao hands it a contiguous copy."""
    x = lk.quantize(torch.randn(48, 128, device=device), fmt)
    views = {
        "column_major": lk.ScaledTensor(
            x.data.t().contiguous().t(), x.scales.t().contiguous().t(), fmt, x.global_scale
        ),
        "column_slice": lk.ScaledTensor(
            x.data[:, x.data.shape[1] // 4 :], x.scales[:, x.scales.shape[1] // 4 :], fmt, x.global_scale
        ),
        "expanded": lk.ScaledTensor(
            x.data[:1].expand_as(x.data), x.scales[:1].expand_as(x.scales), fmt, x.global_scale
        ),
        "swizzled": x.to_layout("128x4"),
    }
    for name, view in views.items():
        assert torch.equal(_dequantized(to_torchao(view, torch.float32)), lk.dequantize(view)), name


def test_to_torchao_refuses_what_torchao_reads_otherwise(device):
    with pytest.raises(ValueError, match=r"rows in multiples of 128"):
        to_torchao(lk.quantize(torch.randn(2, 100, 64, device=device), "mxfp8", scale_layout="128x4"))
    with pytest.raises(ValueError, match="NVFP4Tensor has at least 2 dims"):
        to_torchao(lk.quantize(torch.randn(64, device=device), "nvfp4"))
    one_row = lk.quantize(torch.randn(64, device=device), "mxfp4")
    assert torch.equal(_dequantized(to_torchao(one_row, torch.float32)), lk.dequantize(one_row))
