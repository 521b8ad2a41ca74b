"""torchao's MXTensor / NVFP4Tensor (torchao 0.18) as ScaledTensors and back: same bits, views of the same storage,
and ``grouped_matmul`` / ``MoEFeedForward`` results equal to those of the same data passed as ScaledTensors."""
import warnings

import pytest
import torch

import llmkernels as lk
from llmkernels._testing import random_group_offsets
from llmkernels.formats import from_torchao, is_torchao_tensor, to_torchao
from llmkernels.moe import MoEFeedForward

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
@pytest.mark.parametrize("shape,swizzled", [((40, 64), False), ((3, 20, 96), False), ((200, 96), True)],
                         ids=["2d", "3d", "2d_swizzled"])
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
        assert torch.equal(lk.grouped_matmul(x.bfloat16(), b, offsets, ids),
                           lk.grouped_matmul(x.bfloat16(), from_torchao(b), offsets, ids))
    router = torch.randn(experts, k, device=device)
    w_gate_up, w_down = torch.randn(experts, 2 * n, k, device=device) / 8, torch.randn(experts, k, n, device=device) / 8
    theirs = MoEFeedForward(router, _torchao(w_gate_up, "mxfp4"), _torchao(w_down, "mxfp4"), 2)
    ours = MoEFeedForward(router, from_torchao(_torchao(w_gate_up, "mxfp4")), from_torchao(_torchao(w_down, "mxfp4")), 2)
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
