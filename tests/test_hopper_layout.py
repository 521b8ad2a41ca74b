"""MXFP4 and NVFP4 weights in the Hopper layout (``ScaledTensor.to_layout("hopper")``): exact conversions, and the
grouped matmul's Hopper kernel against the reference and against the row layout.

In the interpreter both layouts compute in float32 from the same decoded values, so their results must be
bit-equal; on the GPU the Hopper kernel decodes through PTX and multiplies bf16 on wgmma (checked against
the float64 reference here, the PTX tile decode itself in ``test_hopper_fragments.py``)."""

import pytest
import torch
import triton
import triton.language as tl

import llmkernels as lk
from llmkernels.grouped_matmul import config as gm_config
from llmkernels.moe import MoEFeedForward
from llmkernels.moe import layer as moe_layer
from llmkernels.runtime import interpreting
from llmkernels.testing import assert_close_relative, poison, random_group_offsets

TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 8e-3}
GROUPINGS = {  # sizes, expert ids, experts
    "ragged": ([17, 0, 1, 33, 5], [2, 0, 3, 1, 2], 4),
    "minus_one": ([9, 20, 0, 7], [1, -1, 0, -1], 2),
    "all_empty": ([0, 0, 0], [0, 1, 0], 2),
    "size_classes": ([0, 3, 16, 17, 40, 64, 65, 130, 1, 2], [0, 1, 2, -1, 3, 1, 2, 0, 3, 2], 4),
}


def _bits(x: lk.ScaledTensor) -> tuple:
    return x.data.view(torch.uint8), x.scales.view(torch.uint8)


HOPPER_FORMATS = ("mxfp4", "nvfp4")


@pytest.mark.parametrize("fmt", HOPPER_FORMATS)
@pytest.mark.parametrize(
    "shape", [(40, 96), (3, 5, 32), (2, 3, 16, 64), (1, 33, 1056), (0, 16, 64)], ids=lambda s: "x".join(map(str, s))
)
def test_layout_round_trips_are_exact(shape, fmt, device):
    x = lk.quantize(torch.randn(*shape, device=device) * 4, fmt)
    hopper = x.to_layout("hopper")
    assert hopper.shape == x.shape and hopper.dim() == x.dim() and hopper.scale_layout == "hopper"
    assert hopper.global_scale is x.global_scale
    for back in (hopper.to_layout("row"), hopper.to_layout("128x4").to_layout("row")):
        assert all(torch.equal(u, v) for u, v in zip(_bits(back), _bits(x)))
    assert torch.equal(hopper.row_data().view(torch.uint8), x.data.view(torch.uint8))
    assert all(torch.equal(u, v) for u, v in zip(_bits(x.to_layout("128x4").to_layout("hopper")), _bits(hopper)))
    assert torch.equal(lk.dequantize(hopper), lk.dequantize(x))
    direct = lk.quantize(torch.randn(*shape, device=device), fmt, scale_layout="hopper")
    assert direct.scale_layout == "hopper" and direct.shape == x.shape


@pytest.mark.parametrize("fmt", HOPPER_FORMATS)
def test_layout_keeps_nan_and_extreme_scales(fmt, device):
    x = lk.quantize(torch.randn(4, 16, 64, device=device), fmt)
    scales = x.scales.view(torch.uint8)
    if fmt == "mxfp4":
        scales[0, 0, 0], scales[1, 2, 1], scales[3, 15, 1] = 0, 255, 254
    else:  # subnormal, NaN, the largest, negative
        scales[0, 0, 0], scales[1, 2, 1], scales[3, 15, 3], scales[2, 4, 2] = 0x01, 0x7F, 0x7E, 0xB8
    x.data.view(torch.uint8)[2, 3, :] = torch.arange(32, dtype=torch.uint8, device=device) * 8  # every code
    expected, actual = lk.dequantize(x), lk.dequantize(x.to_layout("hopper"))
    assert expected.isnan().any() and torch.equal(actual.isnan(), expected.isnan())
    assert torch.equal(actual.nan_to_num(7.0), expected.nan_to_num(7.0))


def test_layout_errors(device):
    w = torch.randn(2, 16, 64, device=device)
    with pytest.raises(ValueError, match="hopper"):
        lk.quantize(w, "mxfp8").to_layout("hopper")
    with pytest.raises(ValueError, match="hopper"):
        lk.quantize(w, "mxfp8", scale_layout="hopper")
    with pytest.raises(ValueError, match="hopper"):
        lk.quantize(torch.randn(64, device=device), "mxfp4", scale_layout="hopper")
    hopper = lk.quantize(w, "mxfp4").to_layout("hopper")
    with pytest.raises(ValueError, match="logical_shape"):
        lk.ScaledTensor(hopper.data, hopper.scales, "mxfp4", scale_layout="hopper")
    with pytest.raises(ValueError, match="do not fit"):
        lk.ScaledTensor(hopper.data, hopper.scales, "mxfp4", scale_layout="hopper", logical_shape=(2, 32, 64))
    with pytest.raises(ValueError, match="logical_shape"):
        lk.ScaledTensor(hopper.data, hopper.scales, "mxfp4", scale_layout="row", logical_shape=(2, 16, 64))
    with pytest.raises(ValueError, match="layout must be one of"):
        hopper.to_layout("sm90")
    nv = lk.quantize(w, "nvfp4").to_layout("hopper")
    with pytest.raises(ValueError, match="do not fit"):  # MXFP4's two scales per chunk row, not NVFP4's four
        lk.ScaledTensor(
            hopper.data, nv.scales.view(torch.float8_e8m0fnu), "mxfp4", scale_layout="hopper", logical_shape=(2, 16, 64)
        )
    with pytest.raises(TypeError, match="global_scale"):
        lk.ScaledTensor(nv.data, nv.scales, "nvfp4", scale_layout="hopper", logical_shape=(2, 16, 64))


def _problem(grouping: str, n: int, k: int, device, trailing_rows: int = 3, fmt: str = "mxfp4"):
    sizes, ids, experts = GROUPINGS[grouping]
    x = torch.randn(sum(sizes) + trailing_rows, k, device=device)
    w = lk.quantize(torch.randn(experts, n, k, device=device) / k**0.5, fmt)
    return (
        x,
        w,
        random_group_offsets(sizes, device=device),
        torch.tensor(ids, dtype=torch.int32, device=device),
        torch.rand(experts, device=device) + 0.5,
        sum(sizes),
    )


def _check(
    a, w, offsets, ids, scales, rows, *, epilogue=None, reference_epilogue=None, out_dtype=torch.float32, config=None
):
    """The Hopper layout's result: poisoned out fully written in the groups, untouched past them, close to the
    float64 reference and (interpreter) bit-equal to the row layout's."""
    hopper = w.to_layout("hopper")
    n_out = w.shape[1] // 2 if epilogue == "swiglu" else w.shape[1]
    out = poison(torch.empty(a.shape[0], n_out, dtype=out_dtype, device=offsets.device))
    result = lk.grouped_matmul(
        a, hopper, offsets, ids, scales, epilogue=epilogue, out_dtype=out_dtype, out=out, config=config
    )
    assert result is out
    expected = lk.grouped_matmul_reference(a, w, offsets, ids, scales, epilogue=reference_epilogue or epilogue)
    assert_close_relative(out[:rows].float(), expected[:rows], TOLERANCE[out_dtype])
    assert out[rows:].isnan().all(), "rows outside every group were written"
    if interpreting():  # the same K steps in both layouts: the same float32 sums up to the order numpy's dot
        # sums a step in, which depends on the operands' layout and the CPU (one float32 ulp seen on an AMD EPYC)
        row_config = config or gm_config.hopper_config(a.shape[0], ids.numel(), offsets.device)
        row_layout = lk.grouped_matmul(
            a, w, offsets, ids, scales, epilogue=epilogue, out_dtype=out_dtype, config=row_config
        )
        ulp = max(1e-5, torch.finfo(out_dtype).eps)  # a 16-bit output may round the one-ulp float32 apart
        torch.testing.assert_close(out[:rows], row_layout[:rows], rtol=ulp, atol=1e-6)


@pytest.mark.parametrize("fmt", HOPPER_FORMATS)
@pytest.mark.parametrize("grouping", list(GROUPINGS))
def test_groupings(grouping, fmt, device):
    x, w, offsets, ids, scales, rows = _problem(grouping, n=48, k=128, device=device, fmt=fmt)
    _check(x.bfloat16(), w, offsets, ids, scales, rows)


@pytest.mark.parametrize("fmt", HOPPER_FORMATS)
@pytest.mark.parametrize("epilogue", [None, "silu", "gelu", "swiglu"])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_epilogues_and_out_dtypes(epilogue, out_dtype, fmt, device):
    x, w, offsets, ids, scales, rows = _problem("ragged", n=64, k=96, device=device, fmt=fmt)
    _check(x.bfloat16(), w, offsets, ids, scales, rows, epilogue=epilogue, out_dtype=out_dtype)


@triton.jit
def _bias_by_position(value, row, col):
    return value * 0.5 + row.to(tl.float32) * 0.01 - col.to(tl.float32) * 0.001


def _bias_by_position_reference(value, row, col):
    return value * 0.5 + row.float() * 0.01 - col.float() * 0.001


def test_user_epilogue_sees_rows_and_columns(device):
    x, w, offsets, ids, scales, rows = _problem("minus_one", n=40, k=64, device=device)
    _check(
        x.bfloat16(),
        w,
        offsets,
        ids,
        scales,
        rows,
        epilogue=_bias_by_position,
        reference_epilogue=_bias_by_position_reference,
    )


@pytest.mark.parametrize(
    "fmt,n,k",
    [(fmt, n, k) for fmt in HOPPER_FORMATS for n, k in ((40, 160), (16, 32), (80, 1088), (48, 64))]
    + [("nvfp4", 24, 16)],
)
def test_partial_tiles_and_padded_chunks(fmt, n, k, device):
    """N not a multiple of the tile nor of 16; K not a multiple of 64 or of the K step (nor of 32: NVFP4)."""
    x, w, offsets, ids, scales, rows = _problem("ragged", n=n, k=k, device=device, fmt=fmt)
    _check(x.bfloat16(), w, offsets, ids, None, rows)


@pytest.mark.parametrize(
    "a_format,a_layout,b_format",
    [
        ("mxfp8", "row", "mxfp4"),
        ("mxfp4", "128x4", "mxfp4"),
        ("nvfp4", "row", "nvfp4"),
        ("nvfp4", "128x4", "nvfp4"),
        ("nvfp4", "row", "mxfp4"),
        ("mxfp4", "row", "nvfp4"),
    ],
)
def test_quantized_activations_are_decoded_ahead(a_format, a_layout, b_format, device):
    """A quantized A is decoded to bf16 first; NVFP4's global scales (A's and B's) reach the epilogue."""
    x, w, offsets, ids, scales, rows = _problem("ragged", n=32, k=64, device=device, fmt=b_format)
    a = lk.quantize(x * 3, a_format)  # a global scale far from 1
    a = a.to_layout(a_layout) if a_layout != "row" else a
    if (a_format == "nvfp4") != (b_format == "nvfp4"):  # nvfp4 pairs with nvfp4 only, whatever b's layout
        with pytest.raises(TypeError, match="nvfp4"):
            lk.grouped_matmul(a, w.to_layout("hopper"), offsets, ids)
        return
    _check(a, w, offsets, ids, scales, rows)


@pytest.mark.parametrize("fmt", HOPPER_FORMATS)
@pytest.mark.parametrize("block_k, k", [(128, 128), (64, 192), (64, 160)], ids=["k128", "k64", "k64_partial"])
def test_explicit_config(block_k, k, fmt, device):
    x, w, offsets, ids, scales, rows = _problem("size_classes", n=64, k=k, device=device, fmt=fmt)
    config = lk.BlockScaledMatmulConfig(block_m=32, block_n=64, block_k=block_k, num_stages=2, num_warps=4)
    _check(x.bfloat16(), w, offsets, ids, scales, rows, config=config)


def test_default_launches_split_by_size_in_the_interpreter(device):
    if not interpreting():
        pytest.skip("size classes split there; on the GPU from 1 GiB of weights")
    launches = gm_config.default_launches(100, 10, 64, 128, device, "bf16", "e2m1", 0, False, 32, "hopper")
    assert len(launches) == 3 and all(c.block_k >= 128 and c.ab_swapped for c, _, _ in launches)


def test_hopper_tiles_by_tokens_per_group():
    cuda = torch.device("cuda")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gm_config, "interpreting", lambda: False)
        for tokens, block_m in ((128, 16), (128 * 40, 64), (128 * 256, 128)):
            config = gm_config.hopper_config(tokens, 128, cuda)
            assert (config.block_m, config.block_n, config.block_k, config.num_warps) == (block_m, 128, 128, 4)
            swiglu = gm_config.hopper_config(tokens, 128, cuda, swiglu=True)
            assert (swiglu.block_m, swiglu.block_n, swiglu.num_stages) == (block_m, 64, 3)
        assert gm_config.hopper_config(128, 128, cuda).num_stages == 3
        assert gm_config.hopper_config(128 * 256, 128, cuda).num_stages == 3
        nvfp4 = gm_config.hopper_config(128 * 256, 128, cuda, b_scale_block=16)
        assert (nvfp4.block_k, nvfp4.num_stages) == (64, 3)
        nvfp4 = gm_config.hopper_config(128 * 256, 128, cuda, swiglu=True, b_scale_block=16)
        assert (nvfp4.block_k, nvfp4.num_stages) == (128, 2)


def test_argument_errors(device):
    x, w, offsets, ids, _, _ = _problem("ragged", n=48, k=64, device=device)
    hopper = w.to_layout("hopper")
    a = x.bfloat16()
    with pytest.raises(TypeError, match="fp16"):
        lk.grouped_matmul(x.half(), hopper, offsets, ids)
    with pytest.raises(ValueError, match="a is in the hopper layout"):
        lk.grouped_matmul(lk.quantize(x, "mxfp4", scale_layout="hopper"), hopper, offsets, ids)
    with pytest.raises(ValueError, match="multiple of 16"):
        lk.grouped_matmul(a, hopper, offsets, ids, epilogue="swiglu")  # N / 2 = 24
    with pytest.raises(ValueError, match="block_k"):  # the layout's K chunks are 64 wide
        lk.grouped_matmul(a, hopper, offsets, ids, config=lk.BlockScaledMatmulConfig(block_k=32))
    with pytest.raises(ValueError, match="mma"):
        lk.grouped_matmul(a, hopper, offsets, ids, config=lk.BlockScaledMatmulConfig(mma="dot_scaled"))
    if offsets.is_cuda and not interpreting():  # 32-row SwiGLU halves gave wrong results on the H100
        with pytest.raises(ValueError, match="block_n"):
            lk.grouped_matmul(a, hopper, offsets, ids, config=lk.BlockScaledMatmulConfig(block_n=32))
    grouped_a = lk.quantize(x, "mxfp8", scale_layout="128x4", group_offsets=offsets)
    with pytest.raises(ValueError, match="per group"):
        lk.grouped_matmul(grouped_a, hopper, offsets, ids)
    with pytest.raises(ValueError, match="K"):
        lk.grouped_matmul(a[:, :32], hopper, offsets, ids)


def _moe_weights(device, experts=4, hidden=64, intermediate=32):
    return (
        torch.randn(experts, hidden, device=device),
        torch.randn(experts, 2 * intermediate, hidden, device=device) / 8,
        torch.randn(experts, hidden, intermediate, device=device) / 8,
    )


@pytest.mark.parametrize("fmt", HOPPER_FORMATS)
def test_moe_block_in_the_hopper_layout(fmt, device):
    """Same block output as the row layout (NVFP4: nvfp4 activations, decoded ahead, both global scales)."""
    weights = _moe_weights(device)
    row = MoEFeedForward.from_float(*weights, 2, weight_format=fmt, weight_layout="row")
    hopper = MoEFeedForward.from_float(*weights, 2, weight_format=fmt, weight_layout="hopper")
    assert hopper.w_gate_up.scale_layout == "hopper" and hopper.w_down.shape == row.w_down.shape
    x = torch.randn(2, 7, 64, dtype=torch.bfloat16, device=device)
    out = hopper(x)
    assert_close_relative(out.float(), row(x).float(), 1e-2)
    if interpreting():
        assert torch.equal(out, row(x))
    rebuilt = MoEFeedForward.from_float(*weights, 2, weight_format=fmt, weight_layout="hopper")
    rebuilt.load_state_dict(hopper.state_dict())
    assert torch.equal(rebuilt(x), out)


def test_moe_default_layout_follows_the_gpu(device, monkeypatch):
    weights = _moe_weights(device)
    assert MoEFeedForward.from_float(*weights, 2, weight_format="mxfp4").w_down.scale_layout == (
        "hopper" if moe_layer.prefers_hopper_layout(weights[0].device) else "row"
    )
    monkeypatch.setattr(moe_layer, "prefers_hopper_layout", lambda device: True)
    for fmt in HOPPER_FORMATS:
        assert MoEFeedForward.from_float(*weights, 2, weight_format=fmt).w_down.scale_layout == "hopper"
    assert MoEFeedForward.from_float(*weights, 2, weight_format="mxfp8").w_down.scale_layout == "row"
    with pytest.raises(ValueError, match="weight_layout"):
        MoEFeedForward.from_float(*weights, 2, weight_format="mxfp8", weight_layout="hopper")
    with pytest.raises(ValueError, match="weight_layout"):
        MoEFeedForward.from_float(*weights, 2, weight_format="nvfp4", weight_layout="sm90")


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", HOPPER_FORMATS)
@pytest.mark.parametrize("tokens_per_expert", [1, 16, 40, 200])
@pytest.mark.parametrize("epilogue", [None, "swiglu"])
def test_realistic_shapes_default_tiles(tokens_per_expert, epilogue, fmt, device):
    """The default tiles (decode and compute regimes) on model-like shapes, with ragged and empty groups;
    repeated calls agree bit for bit (a race in a compiled pipeline showed as NaN and run-to-run differences,
    lab/NOTES.md, issue 21 session 11)."""
    experts, n, k = 16, 1024, 2880
    sizes = torch.full((experts,), tokens_per_expert)
    sizes[3], sizes[7] = 0, 3 * tokens_per_expert + 5
    w = lk.quantize(torch.randn(experts, n, k, device=device) / k**0.5, fmt)
    x = torch.randn(int(sizes.sum()) + 2, k, device=device)
    offsets = random_group_offsets(sizes.tolist(), device=device)
    ids = torch.randperm(experts, device=device).int()
    scales = torch.rand(experts, device=device) + 0.5
    _check(x.bfloat16(), w, offsets, ids, scales, int(sizes.sum()), epilogue=epilogue, out_dtype=torch.bfloat16)
    hopper = w.to_layout("hopper")
    runs = [
        lk.grouped_matmul(x.bfloat16(), hopper, offsets, ids, scales, epilogue=epilogue)[: int(sizes.sum())]
        for _ in range(3)
    ]
    assert all(torch.equal(run, runs[0]) for run in runs[1:])
