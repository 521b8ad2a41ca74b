"""grouped_matmul against grouped_matmul_reference (float64 products of the dequantized operands).

Every output is poisoned with NaN first: an unwritten row fails, and rows outside every group must
still be NaN afterwards. Runs under the Triton interpreter on CPU (small shapes) and on the GPU.
"""

import pytest
import torch
import triton
import triton.language as tl

import llmkernels as lk
from llmkernels.grouped_matmul import config as gm_config
from llmkernels.grouped_matmul import default_launches
from llmkernels.launch import clear_plans
from llmkernels.runtime import interpreting
from llmkernels.testing import assert_close_relative, poison, random_group_offsets

# Relative error bounds by output dtype. Products of decoded operands are exact in bf16/fp16 and
# accumulate in fp32, so what is left is fp32 summation and the output rounding.
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 8e-3, torch.float16: 1e-3}

# (a format, b format); "bf16"/"fp16" are plain tensors.
FORMAT_PAIRS = [
    ("bf16", "bf16"),
    ("fp16", "fp16"),
    ("mxfp8", "mxfp8"),
    ("mxfp4", "mxfp4"),
    ("nvfp4", "nvfp4"),
    ("mxfp8", "mxfp4"),
    ("bf16", "mxfp8"),
    ("bf16", "mxfp4"),
    ("bf16", "nvfp4"),
    ("fp16", "mxfp4"),
]
DOT_SCALED_PAIRS = [("mxfp8", "mxfp8"), ("mxfp4", "mxfp4"), ("mxfp8", "mxfp4"), ("bf16", "mxfp8"), ("bf16", "mxfp4")]
SMALL = lk.BlockScaledMatmulConfig(block_m=16, block_n=32, block_k=64, num_stages=1, num_warps=4)

# Group layouts: sizes of each group, expert of each group, experts in B. Sizes are not multiples
# of the tile; some groups are empty; -1 experts; ids in any order, repeated or unused.
GROUPINGS = {
    "ragged": ([17, 0, 1, 33, 5], [2, 0, 3, 1, 2], 4),
    "minus_one": ([9, 20, 0, 7], [1, -1, 0, -1], 2),
    "permuted": ([3, 16, 8, 2, 11], [4, 2, 0, 3, 1], 5),
    "single": ([40], [0], 1),
    "all_empty": ([0, 0, 0], [0, 1, 0], 2),
    # every size class of the default decode launches: <= 16, 17..64, > 64 rows (average <= 64)
    "size_classes": ([0, 3, 16, 17, 40, 64, 65, 130, 1, 2], [0, 1, 2, -1, 3, 1, 2, 0, 3, 2], 4),
}


def _make_operand(x: torch.Tensor, format: str):
    if format in ("bf16", "fp16"):
        return x.to(torch.bfloat16 if format == "bf16" else torch.float16)
    return lk.quantize(x, format)


def _problem(grouping: str, k: int, n: int, device, trailing_rows: int = 3):
    sizes, ids, num_experts = GROUPINGS[grouping]
    num_tokens = sum(sizes) + trailing_rows  # rows past a_offsets[G] must stay unwritten
    a_offsets = random_group_offsets(sizes, device=device)
    expert_ids = torch.tensor(ids, dtype=torch.int32, device=device)
    x = torch.randn(num_tokens, k, device=device)
    w = torch.randn(num_experts, n, k, device=device) / k**0.5
    expert_scales = torch.rand(num_experts, device=device) + 0.5
    return x, w, a_offsets, expert_ids, expert_scales, sum(sizes)


def _check(
    a,
    b,
    a_offsets,
    expert_ids,
    expert_scales,
    rows_in_groups,
    *,
    out_dtype=torch.float32,
    epilogue=None,
    reference_epilogue=None,
    config=SMALL,
    validate=False,
    bias=None,
):
    num_tokens = a.shape[0]
    n_out = b.shape[1] // 2 if epilogue == "swiglu" or isinstance(epilogue, lk.SwiGLU) else b.shape[1]
    out = poison(torch.empty(num_tokens, n_out, dtype=out_dtype, device=a_offsets.device))
    result = lk.grouped_matmul(
        a,
        b,
        a_offsets,
        expert_ids,
        expert_scales,
        epilogue=epilogue,
        bias=bias,
        out_dtype=out_dtype,
        out=out,
        config=config,
        validate=validate,
    )
    assert result is out
    expected = lk.grouped_matmul_reference(
        a, b, a_offsets, expert_ids, expert_scales, epilogue=reference_epilogue or epilogue, bias=bias
    )
    assert_close_relative(out[:rows_in_groups].float(), expected[:rows_in_groups], TOLERANCE[out_dtype])
    assert out[rows_in_groups:].isnan().all(), "rows outside every group were written"


@pytest.mark.parametrize("formats", FORMAT_PAIRS, ids="x".join)
@pytest.mark.parametrize("grouping", ["ragged", "minus_one"])
def test_format_pairs(formats, grouping, device):
    x, w, offsets, ids, scales, rows = _problem(grouping, k=128, n=48, device=device)
    _check(_make_operand(x, formats[0]), _make_operand(w, formats[1]), offsets, ids, scales, rows)


@pytest.mark.skipif(
    interpreting() and tuple(map(int, triton.__version__.split(".")[:2])) < (3, 9),
    reason="Triton's interpreter runs tl.dot_scaled from 3.9 on",
)
@pytest.mark.parametrize("formats", DOT_SCALED_PAIRS, ids="x".join)
def test_dot_scaled_path(formats, device):
    x, w, offsets, ids, scales, rows = _problem("ragged", k=128, n=48, device=device)
    config = lk.BlockScaledMatmulConfig(block_m=16, block_n=32, block_k=64, num_stages=1, num_warps=4, mma="dot_scaled")
    _check(_make_operand(x, formats[0]), _make_operand(w, formats[1]), offsets, ids, scales, rows, config=config)


@pytest.mark.parametrize("formats", FORMAT_PAIRS, ids="x".join)
def test_swapped_ab(formats, device):
    x, w, offsets, ids, scales, rows = _problem("ragged", k=128, n=48, device=device)
    config = lk.BlockScaledMatmulConfig(block_m=16, block_n=32, block_k=64, num_stages=1, num_warps=4, ab_swapped=True)
    _check(
        _make_operand(x, formats[0]),
        _make_operand(w, formats[1]),
        offsets,
        ids,
        scales,
        rows,
        config=config,
        epilogue="swiglu",
    )


@pytest.mark.parametrize("formats", [("mxfp8", "mxfp8"), ("nvfp4", "nvfp4"), ("bf16", "mxfp4")], ids="x".join)
@pytest.mark.parametrize("prefetch, words", [(False, False), (True, True), (False, True)])
def test_scale_loading_orders(formats, prefetch, words, device):
    """prefetch_scales=False (the ablation's baseline) loads each step's scales in that step, True one
    step ahead; scale_words reads them as int32 words of four columns. Every way must give the same
    products, over K steps whose words straddle nothing and past K (the last prefetch), with SwiGLU's
    second B tile and both scale layouts of B."""
    x, w, offsets, ids, scales, rows = _problem("ragged", k=384, n=48, device=device)
    config = lk.BlockScaledMatmulConfig(
        block_m=16, block_n=32, block_k=128, num_stages=1, num_warps=4, prefetch_scales=prefetch, scale_words=words
    )
    a, b = _make_operand(x, formats[0]), _make_operand(w, formats[1])
    _check(a, b, offsets, ids, scales, rows, config=config, epilogue="swiglu")
    _check(a, b.to_layout("128x4"), offsets, ids, scales, rows, config=config, epilogue="swiglu")
    if isinstance(a, lk.ScaledTensor):  # A's scales padded per group (the seed's a_scale_offsets)
        grouped = a.to_layout("128x4", group_offsets=offsets)
        _check(grouped, b.to_layout("128x4"), offsets, ids, scales, rows, config=config)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the packed decode is PTX: NVIDIA GPUs only")
@pytest.mark.parametrize(
    "formats", [("mxfp4", "mxfp4"), ("bf16", "mxfp4"), ("nvfp4", "nvfp4"), ("mxfp8", "mxfp4")], ids="x".join
)
@pytest.mark.parametrize("swap", [False, True])
def test_packed_e2m1_decode_equals_the_float32_decode(formats, swap, monkeypatch):
    """The packed decode (bf16 pairs through PTX, what bf16 tiles take on NVIDIA GPUs) and the float32
    decode give the same tiles, so the same products bit for bit, in both operand orders and with A
    decoded ahead; both also match the reference."""
    device = torch.device("cuda")
    x, w, offsets, ids, scales, rows = _problem("ragged", k=192, n=48, device=device)
    a, b = _make_operand(x, formats[0]), _make_operand(w, formats[1])
    config = lk.BlockScaledMatmulConfig(
        block_m=16,
        block_n=32,
        block_k=64,
        num_stages=2,
        num_warps=4,
        mma="dequant",
        ab_swapped=swap,
        upcast_a=formats[0] != "bf16" and not swap,
    )
    outputs = []
    for packed in (True, False):
        if not packed:  # the float32 decode, which the product takes elsewhere (fp16, the interpreter)
            monkeypatch.setattr(gm_config, "packed_decode", lambda *args: False)
            clear_plans()  # the plans of the first round bound the packed decode
        _check(a, b, offsets, ids, scales, rows, config=config, epilogue="swiglu")
        outputs.append(lk.grouped_matmul(a, b, offsets, ids, scales, config=config, out_dtype=torch.float32))
    assert torch.equal(outputs[0][:rows], outputs[1][:rows])


@pytest.mark.skipif(
    interpreting() and tuple(map(int, triton.__version__.split(".")[:2])) < (3, 9),
    reason="Triton's interpreter runs tl.dot_scaled from 3.9 on",
)
@pytest.mark.parametrize("formats", DOT_SCALED_PAIRS, ids="x".join)
def test_swapped_ab_dot_scaled(formats, device):
    x, w, offsets, ids, scales, rows = _problem("minus_one", k=128, n=48, device=device)
    config = lk.BlockScaledMatmulConfig(
        block_m=16, block_n=32, block_k=64, num_stages=1, num_warps=4, mma="dot_scaled", ab_swapped=True
    )
    _check(_make_operand(x, formats[0]), _make_operand(w, formats[1]), offsets, ids, scales, rows, config=config)


@pytest.mark.parametrize(
    "formats", [("bf16", "bf16"), ("mxfp8", "mxfp8"), ("nvfp4", "nvfp4"), ("bf16", "mxfp4")], ids="x".join
)
def test_default_size_class_launches(formats, device, monkeypatch):
    """config=None splits small-group calls into size classes, each launch taking its own groups."""
    monkeypatch.setattr(gm_config, "_SPLIT_MIN_WEIGHT_BYTES", 0)  # split these small weights too
    default_launches.cache_clear()
    x, w, offsets, ids, scales, rows = _problem("size_classes", k=64, n=32, device=device)
    a, b = _make_operand(x, formats[0]), _make_operand(w, formats[1])
    launches = default_launches(a.shape[0], ids.numel(), 32, 64, offsets.device)
    assert len(launches) == 3
    bounds = [(low, high) for _, low, high in launches]
    assert bounds[0][0] < 0 and all(bounds[i][1] == bounds[i + 1][0] for i in range(2)) and bounds[-1][1] >= 2**31 - 1
    _check(a, b, offsets, ids, scales, rows, out_dtype=torch.bfloat16, config=None)
    default_launches.cache_clear()


@pytest.mark.parametrize("grouping", sorted(GROUPINGS))
@pytest.mark.parametrize("format", ["mxfp8", "nvfp4"])
def test_groupings(grouping, format, device):
    x, w, offsets, ids, scales, rows = _problem(grouping, k=64, n=40, device=device)
    _check(lk.quantize(x, format), lk.quantize(w, format), offsets, ids, scales, rows)


@pytest.mark.parametrize("epilogue", [None, "silu", "gelu", "swiglu"])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_epilogues_and_out_dtypes(epilogue, out_dtype, device):
    x, w, offsets, ids, scales, rows = _problem("ragged", k=64, n=64, device=device)
    _check(
        lk.quantize(x, "mxfp4"),
        lk.quantize(w, "mxfp4"),
        offsets,
        ids,
        scales,
        rows,
        out_dtype=out_dtype,
        epilogue=epilogue,
    )


# gpt-oss' activation, and one whose clamp and shift bite on these values (|pre-activation| ~ 1)
SWIGLUS = {
    "gpt_oss": lk.GPT_OSS_SWIGLU,
    "clamped": lk.SwiGLU(alpha=1.702, limit=0.5, up_shift=-0.25),
    "clamped_interleaved": lk.SwiGLU(alpha=0.5, limit=0.75, up_shift=1.0, interleaved=True),
}


@pytest.mark.parametrize("format", ["bf16", "mxfp8", "mxfp4", "nvfp4"])
@pytest.mark.parametrize("epilogue", [None, "silu", "swiglu", *SWIGLUS], ids=str)
@pytest.mark.parametrize("bias_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_bias_and_gated_epilogues(format, epilogue, bias_dtype, device):
    """A per-expert bias before the activation; SwiGLU's slope, clamp (NaN kept) and shift, on [gate | up]
    halves or interleaved rows, in the grouped kernel."""
    epilogue = SWIGLUS.get(epilogue, epilogue)
    x, w, offsets, ids, scales, rows = _problem("minus_one", k=64, n=64, device=device)
    bias = (torch.randn(w.shape[:2], device=device) * 0.5).to(bias_dtype)
    _check(
        _make_operand(x, "bf16" if format == "bf16" else format),
        _make_operand(w, format),
        offsets,
        ids,
        scales,
        rows,
        epilogue=epilogue,
        bias=bias,
    )


@pytest.mark.parametrize("format", ["mxfp4", "nvfp4"])
@pytest.mark.parametrize("epilogue", [None, "swiglu", "clamped"], ids=str)
def test_bias_and_gated_epilogues_hopper_layout(format, epilogue, device):
    epilogue = SWIGLUS.get(epilogue, epilogue)
    x, w, offsets, ids, scales, rows = _problem("ragged", k=128, n=64, device=device)
    bias = torch.randn(w.shape[:2], device=device) * 0.5
    b = lk.quantize(w, format, scale_layout="hopper")
    _check(
        x.bfloat16(),
        b,
        offsets,
        ids,
        scales,
        rows,
        epilogue=epilogue,
        bias=bias,
        config=lk.BlockScaledMatmulConfig(block_m=16, block_n=32, block_k=64, num_stages=1, num_warps=4)
        if interpreting()
        else None,
    )


def test_swiglu_clamp_keeps_nan(device):
    x = torch.ones(4, 64, device=device).bfloat16()
    w = torch.zeros(1, 64, 64, device=device).bfloat16()
    bias = torch.zeros(1, 64, device=device)
    bias[0, 3] = float("nan")  # the up row of output column 1 (rows alternate gate, up)
    bias[0, 1] = float("inf")  # the up row of output column 0: clamped to the limit
    offsets = torch.tensor([0, 4], dtype=torch.int32, device=device)
    ids = torch.zeros(1, dtype=torch.int32, device=device)
    out = lk.grouped_matmul(x, w, offsets, ids, epilogue=lk.GPT_OSS_SWIGLU, bias=bias, out_dtype=torch.float32)
    expected = lk.grouped_matmul_reference(x, w, offsets, ids, epilogue=lk.GPT_OSS_SWIGLU, bias=bias)
    assert out[:, 1].isnan().all() and not out[:, 0].isnan().any()
    torch.testing.assert_close(out, expected, equal_nan=True)


@triton.jit
def _bias_by_position(value, row, col):
    return value * 0.5 + row.to(tl.float32) * 0.01 - col.to(tl.float32) * 0.001


def _bias_by_position_reference(value, row, col):
    return value * 0.5 + row.float() * 0.01 - col.float() * 0.001


@pytest.mark.parametrize("format", ["bf16", "nvfp4"])
def test_user_epilogue(format, device):
    x, w, offsets, ids, scales, rows = _problem("minus_one", k=64, n=40, device=device)
    _check(
        _make_operand(x, format),
        _make_operand(w, format),
        offsets,
        ids,
        scales,
        rows,
        epilogue=_bias_by_position,
        reference_epilogue=_bias_by_position_reference,
    )


@pytest.mark.parametrize("format", ["mxfp8", "mxfp4", "nvfp4"])
@pytest.mark.parametrize("a_layout", ["row", "128x4", "128x4_grouped"])
@pytest.mark.parametrize("b_layout", ["row", "128x4"])
@pytest.mark.parametrize("upcast_a", [False, True], ids=["fused", "upcast"])
def test_scale_layouts(format, a_layout, b_layout, upcast_a, device):
    # 140 rows: the grouped layout pads group 1 (rows 5..139) into a fresh tile; N = 150 spans two
    # 128-row B tiles with padding.
    sizes = [5, 135]
    offsets = random_group_offsets(sizes, device=device)
    ids = torch.tensor([1, 0], dtype=torch.int32, device=device)
    x, w = torch.randn(sum(sizes), 128, device=device), torch.randn(2, 150, 128, device=device)
    a, b = lk.quantize(x, format), lk.quantize(w, format)
    if a_layout != "row":
        a = a.to_layout("128x4", group_offsets=offsets if a_layout == "128x4_grouped" else None)
    b = b.to_layout(b_layout)
    _check(a, b, offsets, ids, None, sum(sizes), config=lk.BlockScaledMatmulConfig(32, 32, 64, 1, 4, upcast_a=upcast_a))


@pytest.mark.parametrize(
    "formats", [("mxfp8", "mxfp8"), ("mxfp4", "mxfp4"), ("nvfp4", "nvfp4"), ("mxfp8", "mxfp4")], ids="x".join
)
@pytest.mark.parametrize("mma", ["dequant", "dot_scaled"])
def test_a_decoded_ahead(formats, mma, device):
    """upcast_a: A decoded to bf16 by the pre-pass, then bf16 × B (nvfp4's global scale of A still
    applied by the matmul), with SwiGLU and the -1 ids; dot_scaled takes the decoded A as bf16."""
    if mma == "dot_scaled" and (
        formats[1] == "nvfp4" or (interpreting() and tuple(map(int, triton.__version__.split(".")[:2])) < (3, 9))
    ):
        pytest.skip("dot_scaled: MX weights only, and Triton's interpreter runs it from 3.9 on")
    x, w, offsets, ids, scales, rows = _problem("minus_one", k=192, n=48, device=device)
    a = _make_operand(x * 3.0, formats[0])  # a global scale of A away from 1
    config = lk.BlockScaledMatmulConfig(
        block_m=16, block_n=32, block_k=64, num_stages=1, num_warps=4, mma=mma, upcast_a=True
    )
    _check(a, _make_operand(w, formats[1]), offsets, ids, scales, rows, config=config, epilogue="swiglu")


def test_uint32_offsets_and_no_expert_scales(device):
    x, w, offsets, ids, _, rows = _problem("permuted", k=64, n=32, device=device)
    _check(lk.quantize(x, "mxfp8"), lk.quantize(w, "mxfp8"), offsets.to(torch.uint32), ids, None, rows)


def test_default_config_and_new_output(device):
    x, w, offsets, ids, scales, rows = _problem("ragged", k=64, n=32, device=device)
    a, b = lk.quantize(x, "mxfp8"), lk.quantize(w, "mxfp8")
    out = lk.grouped_matmul(a, b, offsets, ids, scales)
    assert out.dtype == torch.bfloat16 and out.shape == (x.shape[0], 32)
    expected = lk.grouped_matmul_reference(a, b, offsets, ids, scales)
    assert_close_relative(out[:rows].float(), expected[:rows], TOLERANCE[torch.bfloat16])


def test_bad_offsets_never_write_outside_out(device):
    # Offsets past T, decreasing and negative: the kernel clamps, so the guard rows around `out`
    # stay poisoned, and validate=True reports the problem instead.
    x = torch.randn(20, 64, device=device)
    w = torch.randn(3, 32, 64, device=device)
    a, b = lk.quantize(x, "mxfp4"), lk.quantize(w, "mxfp4")
    offsets = torch.tensor([0, 12, 7, 500, -3], dtype=torch.int32, device=device)
    ids = torch.tensor([0, 1, 7, 2], dtype=torch.int32, device=device)  # 7 >= E: zeros
    buffer = poison(torch.empty(24, 32, device=device))
    out = buffer[2:22]
    lk.grouped_matmul(a, b, offsets, ids, out=out, out_dtype=torch.float32, config=SMALL)
    assert buffer[:2].isnan().all() and buffer[22:].isnan().all()
    expected = lk.grouped_matmul_reference(a, b, offsets, ids)
    # Read as [0, 12, 12, 20, 20]: group 0 intact, group 2 (rows 12..19) has an invalid expert.
    assert_close_relative(out[:12], expected[:12], TOLERANCE[torch.float32])
    assert (out[12:20] == 0).all() and (expected[12:20] == 0).all()
    with pytest.raises(ValueError, match=r"non-decreasing: a_offsets\[2\] = 7 < a_offsets\[1\] = 12"):
        lk.grouped_matmul(a, b, offsets, ids, validate=True)
    with pytest.raises(ValueError, match=r"a_offsets\[2\] = 30 exceeds the 20 rows"):
        lk.grouped_matmul(a, b, torch.tensor([0, 12, 30], dtype=torch.int32, device=device), ids[:2], validate=True)
    with pytest.raises(ValueError, match=r"a_offsets\[0\] must be 0"):
        lk.grouped_matmul(a, b, torch.tensor([2, 12, 20], dtype=torch.int32, device=device), ids[:2], validate=True)
    with pytest.raises(ValueError, match=r"expert_ids\[1\] = 3"):
        lk.grouped_matmul(
            a,
            b,
            torch.tensor([0, 12, 20], dtype=torch.int32, device=device),
            torch.tensor([0, 3], dtype=torch.int32, device=device),
            validate=True,
        )


def _bad_input_cases(device):
    x = torch.randn(8, 64, device=device)
    w = torch.randn(2, 32, 64, device=device)
    a, b = lk.quantize(x, "mxfp8"), lk.quantize(w, "mxfp8")
    offsets = torch.tensor([0, 4, 8], dtype=torch.int32, device=device)
    ids = torch.tensor([0, 1], dtype=torch.int32, device=device)
    ok = dict(a=a, b=b, a_offsets=offsets, expert_ids=ids)
    out = torch.empty(8, 32, dtype=torch.bfloat16, device=device)
    shrunk = lk.ScaledTensor(a.data, a.scales, "mxfp8")
    shrunk.scales = a.scales[:4]  # fields can be re-assigned: checked again at the call
    moved = lk.ScaledTensor(b.data, b.scales, "mxfp8")
    moved.scales = b.scales.to("meta")
    shared = torch.randn(8, 64, dtype=torch.bfloat16, device=device)
    return [
        (ValueError, "out has elements that share memory", dict(ok, out=out[:1].expand(8, 32))),
        (ValueError, "out has elements that share memory", dict(ok, out=out.view(-1)[:8].as_strided((8, 32), (1, 1)))),
        (ValueError, "out shares memory with a", dict(ok, a=shared, b=w.bfloat16(), out=shared[:, 32:])),
        (TypeError, "out must be torch.bfloat16", dict(ok, out=out.float())),
        (ValueError, "scales of shape", dict(ok, a=shrunk)),
        (ValueError, "share one device", dict(ok, b=moved)),
        (TypeError, "a must be", dict(ok, a=x.int())),
        (TypeError, "plain operands must share", dict(ok, a=x.bfloat16(), b=w.half())),
        (TypeError, "nvfp4 pairs only", dict(ok, b=lk.quantize(w, "nvfp4"))),
        (TypeError, "quantized weights", dict(ok, b=w.bfloat16())),
        (ValueError, "K = ", dict(ok, b=lk.quantize(torch.randn(2, 32, 96, device=device), "mxfp8"))),
        (ValueError, "b must be 3D", dict(ok, b=lk.quantize(w[0], "mxfp8"))),
        (TypeError, "a_offsets must be", dict(ok, a_offsets=offsets.long())),
        (ValueError, "expert_ids has", dict(ok, expert_ids=ids[:1])),
        (TypeError, "expert_ids must be", dict(ok, expert_ids=ids.long())),
        (ValueError, "expert_scales must have shape", dict(ok, expert_scales=torch.ones(3, device=device))),
        (TypeError, "expert_scales must be", dict(ok, expert_scales=torch.ones(2, device=device, dtype=torch.float16))),
        (ValueError, "epilogue must be", dict(ok, epilogue="relu")),
        (ValueError, "bias must have shape", dict(ok, bias=torch.zeros(2, 16, device=device))),
        (TypeError, "bias must be a float32", dict(ok, bias=torch.zeros(2, 32, device=device, dtype=torch.int32))),
        (
            ValueError,
            "interleaved",
            dict(ok, a=x.bfloat16(), b=lk.quantize(w, "mxfp4", scale_layout="hopper"), epilogue=lk.GPT_OSS_SWIGLU),
        ),
        (ValueError, "out must have shape", dict(ok, out=torch.empty(8, 31, device=device, dtype=torch.bfloat16))),
        (TypeError, "out_dtype", dict(ok, out_dtype=torch.int32)),
        (
            ValueError,
            "even N",
            dict(ok, b=lk.quantize(torch.randn(2, 33, 64, device=device), "mxfp8"), epilogue="swiglu"),
        ),
        (
            ValueError,
            "mma='dot_scaled'",
            dict(
                ok,
                a=lk.quantize(x, "nvfp4"),
                b=lk.quantize(w, "nvfp4"),
                config=lk.BlockScaledMatmulConfig(mma="dot_scaled"),
            ),
        ),
    ]


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(limit=0.0), "limit must be None or a finite number > 0"),
        (dict(limit=float("inf")), "limit"),
        (dict(alpha=float("nan")), "alpha must be a finite"),
        (dict(up_shift="1"), "up_shift"),
        (dict(interleaved=1), "interleaved must be a bool"),
    ],
)
def test_swiglu_fields_are_checked(fields, message):
    with pytest.raises((TypeError, ValueError), match=message):
        lk.SwiGLU(**fields)


def test_bad_input_raises_before_launch(device):
    for error, message, kwargs in _bad_input_cases(device):
        with pytest.raises(error, match=message):
            lk.grouped_matmul(**kwargs)


def test_cpu_tensors_need_the_interpreter(monkeypatch):
    import llmkernels.runtime as runtime

    monkeypatch.setattr(runtime, "interpreting", lambda: False)
    x, w = torch.randn(4, 32), torch.randn(1, 16, 32)
    with pytest.raises(ValueError, match="CUDA tensors"):
        lk.grouped_matmul(
            x.bfloat16(), w.bfloat16(), torch.tensor([0, 4], dtype=torch.int32), torch.tensor([0], dtype=torch.int32)
        )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs two devices: CPU and CUDA")
def test_mixed_devices_raise():
    x, w = torch.randn(4, 32).bfloat16(), torch.randn(1, 16, 32, device="cuda").bfloat16()
    with pytest.raises(ValueError, match="share a device"):
        lk.grouped_matmul(x, w, torch.tensor([0, 4], dtype=torch.int32), torch.tensor([0], dtype=torch.int32))


def test_hopper_compute_defaults(monkeypatch):
    """The measured Hopper choices that the host makes: SwiGLU over e2m1 weights decodes in registers,
    the plain e2m1 product keeps dot_scaled, NVFP4 reads its scales as words, e4m3 decode tiles run
    three programs per SM."""
    monkeypatch.setattr(gm_config, "cuda_capability", lambda device: (9, 0))
    monkeypatch.setattr(gm_config, "interpreting", lambda: False)
    monkeypatch.setattr(gm_config, "num_programs_hint", lambda device: 132)
    device = torch.device("cuda", 0)
    compute = dict(num_tokens=8 * 2048, num_groups=8, n_out=4096, k=7168, device=device)
    plain = gm_config.default_config(**compute, a_element="bf16", b_element="e2m1")
    swiglu = gm_config.default_config(**compute, a_element="bf16", b_element="e2m1", swiglu=True)
    assert (plain.block_m, plain.mma) == (256, "auto") and (swiglu.block_n, swiglu.mma) == (64, "dequant")
    assert gm_config.default_config(**compute, a_element="e2m1", b_element="e2m1", b_scale_block=16).scale_words
    decode = gm_config.default_config(128 * 16, 128, 4096, 7168, device, "e4m3", "e4m3")
    assert (decode.block_n, decode.num_programs, decode.mma) == (64, 3 * 132, "dequant")


@pytest.mark.parametrize(
    "field, value",
    [
        ("block_m", 24),
        ("block_n", 512),
        ("block_k", 16),
        ("num_stages", 0),
        ("num_warps", 3),
        ("num_programs", 0),
        ("mma", "wgmma"),
        ("ab_swapped", 1),
        ("prefetch_scales", 1),
        ("scale_words", 0),
        ("upcast_a", "yes"),
    ],
)
def test_config_validation(field, value):
    with pytest.raises(ValueError, match=field):
        lk.BlockScaledMatmulConfig(**{field: value})


# --- realistic shapes: GPU only -------------------------------------------------------------------


def _moe_offsets(num_experts: int, tokens_per_expert: int, device):
    """Uneven routing: group sizes drawn around tokens_per_expert, some empty."""
    sizes = torch.poisson(torch.full((num_experts,), float(tokens_per_expert))).int()
    sizes[torch.randperm(num_experts)[: max(1, num_experts // 8)]] = 0
    return random_group_offsets(sizes.tolist(), device=device), int(sizes.sum())


@pytest.mark.gpu
@pytest.mark.parametrize("formats", FORMAT_PAIRS, ids="x".join)
@pytest.mark.parametrize(
    "num_experts, tokens_per_expert, n, k", [(8, 300, 4096, 7168), (64, 24, 2048, 7168), (32, 5, 5760, 2880)]
)
def test_realistic_shapes(formats, num_experts, tokens_per_expert, n, k, device):
    offsets, rows = _moe_offsets(num_experts, tokens_per_expert, device)
    ids = torch.randperm(num_experts, device=device).int()
    x = torch.randn(rows + 7, k, device=device)
    w = torch.randn(num_experts, n, k, device=device) / k**0.5
    scales = torch.rand(num_experts, device=device) + 0.5
    a, b = _make_operand(x, formats[0]), _make_operand(w, formats[1])
    _check(a, b, offsets, ids, scales, rows, out_dtype=torch.bfloat16, config=None)


@pytest.mark.gpu
@pytest.mark.parametrize("formats", DOT_SCALED_PAIRS, ids="x".join)
def test_realistic_dot_scaled(formats, device):
    offsets, rows = _moe_offsets(16, 200, device)
    ids = torch.randperm(16, device=device).int()
    x, w = torch.randn(rows, 2048, device=device), torch.randn(16, 1024, 2048, device=device) / 45
    config = lk.BlockScaledMatmulConfig(mma="dot_scaled")
    _check(
        _make_operand(x, formats[0]),
        _make_operand(w, formats[1]),
        offsets,
        ids,
        None,
        rows,
        out_dtype=torch.bfloat16,
        config=config,
        epilogue="swiglu",
    )


@pytest.mark.gpu
def test_cuda_graph_capture_reads_offsets_on_device(device):
    num_experts, k, n = 8, 1024, 512
    x, w = torch.randn(400, k, device=device), torch.randn(num_experts, n, k, device=device) / 32
    a, b = lk.quantize(x, "mxfp8"), lk.quantize(w, "mxfp8")
    offsets = random_group_offsets([50] * 8, device=device)
    ids = torch.arange(num_experts, dtype=torch.int32, device=device)
    out = torch.empty(400, n, dtype=torch.bfloat16, device=device)
    lk.grouped_matmul(a, b, offsets, ids, out=out)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        lk.grouped_matmul(a, b, offsets, ids, out=out)
    for sizes in ([0, 100, 3, 97, 0, 150, 40, 10], [400, 0, 0, 0, 0, 0, 0, 0]):
        offsets.copy_(random_group_offsets(sizes, device=device))
        ids.copy_(torch.randperm(num_experts, device=device).int())
        poison(out)
        graph.replay()
        expected = lk.grouped_matmul_reference(a, b, offsets, ids)
        assert_close_relative(out.float(), expected, TOLERANCE[torch.bfloat16])


@pytest.mark.gpu
@pytest.mark.parametrize("formats", FORMAT_PAIRS, ids="x".join)
@pytest.mark.parametrize("epilogue", [None, "swiglu"])
@pytest.mark.parametrize("tokens_per_expert", [8, 200])
def test_default_configs_compile_and_fit(formats, epilogue, tokens_per_expert, device):
    """Every default config (decode and compute tiles, plain and SwiGLU) compiles within the GPU's
    shared memory and is correct."""
    num_experts, n, k = 4, 512, 512
    offsets, rows = _moe_offsets(num_experts, tokens_per_expert, device)
    ids = torch.arange(num_experts, dtype=torch.int32, device=device)
    x = torch.randn(rows + 5, k, device=device)
    w = torch.randn(num_experts, n, k, device=device) / k**0.5
    scales = torch.rand(num_experts, device=device) + 0.5
    a, b = _make_operand(x, formats[0]), _make_operand(w, formats[1])
    _check(a, b, offsets, ids, scales, rows, out_dtype=torch.bfloat16, epilogue=epilogue, config=None)
