"""grouped_matmul on w4a8: fp8 ``block=(1, 128)`` activations (e4m3, a float32 scale per token and 128 columns)
with MXFP4 expert weights, against grouped_matmul_reference: float64 products of the dequantized operands.

Outputs are poisoned with NaN: an unwritten row fails, and rows past a_offsets[G] must still be NaN afterwards;
groups of expert -1 must be exact zeros. Small shapes: the interpreter runs each program in numpy.

Relative errors (Frobenius) measured under the Triton 3.9 interpreter (CPU), bounds about 10x those:

==========  ===============  ====================================================================================
out dtype   measured         what is left
==========  ===============  ====================================================================================
float32     4.7e-8 - 1.4e-7  fp32 sums of exact products (e4m3 x e2m1 · 2^e) and the promotions' roundings, fp32
                             epilogues; the reference's dequantized A is rounded to fp32 too; bound 2e-6
bfloat16    3.4e-3           the output's rounding; bound 1e-2
==========  ===============  ====================================================================================
"""

import dataclasses

import pytest
import torch
import triton
import triton.language as tl

import llmkernels as lk
from llmkernels import runtime
from llmkernels.formats import dequantize, quantize_reference
from llmkernels.grouped_matmul import GPT_OSS_SWIGLU, HOPPER_COPIES, default_launches, layout_cache
from llmkernels.grouped_matmul import config as gm_config
from llmkernels.grouped_matmul.backends import backend_for, w4a8_blocks, w4a8_decode, w4a8_hopper
from llmkernels.grouped_matmul.check import check_grouped_matmul
from llmkernels.grouped_matmul.w4a8_prepare import W4A8_COPIES, emulate_decode, prepare_weights
from llmkernels.launch import clear_plans
from llmkernels.testing import assert_close_relative, on_gpu, poison, random_group_offsets

# On a GPU the bf16 MMA's fp32 accumulation is not IEEE-exact in its order of additions: a looser fp32 bound there
TOLERANCE = {torch.float32: 1e-4 if on_gpu() else 2e-6, torch.bfloat16: 1e-2}

# Group sizes, expert of each group, experts: an empty group, a 1-row group, an expert -1, a group larger than
# one 16-row tile, ids in any order.
SIZES, IDS, EXPERTS = [17, 0, 1, 6, 13, 2], [2, 0, 1, -1, 1, 2], 3
TRAILING = 3  # rows past a_offsets[G]: never written
N = 96


def _config(block_m=16, block_n=32, block_k=128, swapped=False, num_programs=None):
    return lk.BlockScaledMatmulConfig(
        block_m, block_n, block_k, num_stages=1, num_warps=4, ab_swapped=swapped, num_programs=num_programs
    )


def _problem(k: int, device, n: int = N):
    """Activations with outlier columns (scales that differ per token and K block), weights whose 32-wide blocks
    span a wide range of scales; fp8 (1, 128) activations, MXFP4 weights and the metadata of SIZES / IDS."""
    num_tokens = sum(SIZES) + TRAILING
    x = torch.randn(num_tokens, k, device=device)
    x[:, ::7] *= 30.0
    w = torch.randn(EXPERTS, n, k, device=device) / k**0.5
    w *= (
        torch.exp2(torch.randint(-6, 7, (EXPERTS, n, k // 32, 1), device=device).float())
        .expand(-1, -1, -1, 32)
        .reshape(EXPERTS, n, k)
    )
    a = quantize_reference(x, "fp8", block=(1, 128))
    b = quantize_reference(w, "mxfp4")
    offsets = random_group_offsets(SIZES, device=device)
    ids = torch.tensor(IDS, dtype=torch.int32, device=device)
    return a, b, offsets, ids


def _run(a, b, offsets, ids, n_out, *, out_dtype=torch.float32, out=None, **kwargs):
    out = poison(torch.empty(a.shape[0], n_out, dtype=out_dtype, device=offsets.device)) if out is None else out
    result = lk.grouped_matmul(a, b, offsets, ids, out_dtype=out_dtype, out=out, **kwargs)
    assert result is out
    return out


def _check(out, a, b, offsets, ids, expert_scales=None, *, epilogue=None, reference_epilogue=None, bias=None):
    rows = sum(SIZES)
    expected = lk.grouped_matmul_reference(
        a, b, offsets, ids, expert_scales, epilogue=reference_epilogue or epilogue, bias=bias
    )
    assert_close_relative(out[:rows].float(), expected[:rows], TOLERANCE[out.dtype], "w4a8 grouped_matmul")
    assert out[rows:].isnan().all(), "rows past a_offsets[G] were written"
    starts = offsets.tolist()
    for group, expert in enumerate(IDS):
        if expert < 0:
            assert (out[starts[group] : starts[group + 1]] == 0).all(), "a group of expert -1 is not zeros"


@pytest.mark.parametrize(
    "config, k, scale_layout",
    [
        (_config(), 192, "row"),  # a ragged last K step (K % 128 = 64)
        (_config(block_k=64, swapped=True), 160, "row"),  # two steps per scale block of A, the last one ragged
        (_config(32, 64, swapped=True, num_programs=3), 256, "128x4"),  # persistent, a tile past N
    ],
    ids=["plain-K192", "swapped-bk64-K160", "persistent-128x4"],
)
def test_orientations_ragged_k_and_scale_layouts(config, k, scale_layout, device):
    a, b, offsets, ids = _problem(k, device)
    if scale_layout != "row":
        b = b.to_layout(scale_layout)
    expert_scales = torch.rand(EXPERTS, device=device) + 0.5
    out = _run(a, b, offsets, ids, N, expert_scales=expert_scales, config=config)
    _check(out, a, b, offsets, ids, expert_scales)


@triton.jit
def _row_col_epilogue(value, row, col):
    return value * (1.0 + 0.01 * row.to(tl.float32)) - 0.001 * col.to(tl.float32)


def _row_col_reference(value, row, col):
    return value * (1.0 + 0.01 * row) - 0.001 * col


# (epilogue, reference epilogue, config)
EPILOGUE_CASES = {
    "silu": ("silu", None, _config(32, 32)),
    "gelu": ("gelu", None, _config(swapped=True)),
    "swiglu": ("swiglu", None, _config(swapped=True)),
    "interleaved-clamped": (lk.SwiGLU(alpha=1.702, limit=0.5, up_shift=1.0, interleaved=True), None, _config()),
    "user": (_row_col_epilogue, _row_col_reference, _config()),
}


@pytest.mark.parametrize("case", sorted(EPILOGUE_CASES))
def test_epilogues_with_bias_and_expert_scales(case, device):
    epilogue, reference_epilogue, config = EPILOGUE_CASES[case]
    a, b, offsets, ids = _problem(128, device)
    expert_scales = torch.rand(EXPERTS, device=device) + 0.5
    bias = torch.randn(EXPERTS, N, device=device).to(torch.bfloat16 if case in ("gelu", "swiglu") else torch.float32)
    gated = epilogue == "swiglu" or isinstance(epilogue, lk.SwiGLU)
    out = _run(
        a,
        b,
        offsets,
        ids,
        N // 2 if gated else N,
        out_dtype=torch.bfloat16 if case == "user" else torch.float32,
        expert_scales=expert_scales,
        epilogue=epilogue,
        bias=bias,
        config=config,
    )
    _check(out, a, b, offsets, ids, expert_scales, epilogue=epilogue, reference_epilogue=reference_epilogue, bias=bias)


@pytest.mark.parametrize("route", ["portable", "decode"])
def test_views_give_the_bits_of_the_contiguous_call(route, request, device):
    """Token-major A scales (as vLLM and DeepGEMM keep them), A's data, the weights' data and scales as offset and
    strided views, a strided bias, strided metadata and an ``out=`` that is a transposed view: the bits of the call
    on contiguous copies; on the portable kernel (an explicit config) and on the ``w4a8_decode`` backend's default
    launches (routed to in the interpreter, :func:`decode_backend`)."""
    k = 128
    a, b, offsets, ids = _problem(k, device)
    bias = torch.randn(EXPERTS, N, device=device)
    config = _config(swapped=True)
    if route == "decode":
        request.getfixturevalue("decode_backend")
        config = None
    expected = _run(a, b, offsets, ids, N, out_dtype=torch.bfloat16, bias=bias, config=config)
    assert route == "portable" or len(HOPPER_COPIES) == 1, "the decode launches read no Hopper-layout copy"

    a_data = torch.zeros(a.shape[0] + 1, k + 16, dtype=a.data.dtype, device=device)[1:, 8 : 8 + k]
    a_data.copy_(a.data)
    a_scales = a.scales.t().contiguous().t()  # token-major
    b_data = torch.zeros(EXPERTS, N, k, dtype=b.data.dtype, device=device)[..., 1::2]
    b_data.copy_(b.data)
    b_scales = torch.zeros(EXPERTS, N + 1, k // 16, dtype=b.scales.dtype, device=device)[:, 1:, ::2]
    b_scales.copy_(b.scales)
    a_view = lk.ScaledTensor(a_data, a_scales, "fp8", block=(1, 128))
    b_view = lk.ScaledTensor(b_data, b_scales, "mxfp4")
    bias_view = torch.zeros(EXPERTS, 2 * N, device=device)[:, ::2]
    bias_view.copy_(bias)
    offsets_view = torch.zeros(2 * offsets.numel(), dtype=offsets.dtype, device=device)[::2]
    offsets_view.copy_(offsets)
    ids_view = torch.zeros(ids.numel() + 1, dtype=ids.dtype, device=device)[1:]
    ids_view.copy_(ids)
    out = poison(torch.empty(N, a.shape[0], dtype=torch.bfloat16, device=device)).t()
    _run(a_view, b_view, offsets_view, ids_view, N, out_dtype=torch.bfloat16, out=out, bias=bias_view, config=config)
    assert torch.equal(out.isnan(), expected.isnan())
    assert torch.equal(torch.nan_to_num(out), torch.nan_to_num(expected))


def test_default_launches_and_no_hopper_copy(monkeypatch, device):
    """config=None: the default launches (by group size class in the interpreter: swap-AB tiles for groups of up
    to 16 rows, plain ones above), K steps of 128. Row-layout MXFP4 weights with fp8 activations are never
    substituted by the generic Hopper-layout copy ahead of the call (its bf16 launches would decode A ahead to bf16,
    rounding it), also where the Hopper layout is preferred: only the ``w4a8_decode`` launches (sm_90) look the copy
    up, for the kernel's fp8 mode."""
    monkeypatch.setattr(layout_cache, "prefers_hopper_layout", lambda device: True)
    HOPPER_COPIES.clear()
    a, b, offsets, ids = _problem(128, device, n=64)
    out = _run(a, b, offsets, ids, 64)
    _check(out, a, b, offsets, ids)  # A rounded to bf16 ahead would miss the bound
    decode_backend = device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9
    assert len(HOPPER_COPIES) == (1 if decode_backend else 0)
    HOPPER_COPIES.clear()
    launches = default_launches(sum(SIZES), len(SIZES), 64, 128, device, "e4m3", "e2m1", b_scale="e8m0", a_scale="f32")
    assert all(config.block_k == 128 for config, _, _ in launches)


def test_bad_pairs_and_configs_raise_before_any_launch(device):
    a, b, offsets, ids = _problem(128, device)
    w = torch.randn(EXPERTS, N, 128, device=device)
    out = poison(torch.empty(a.shape[0], N, device=device))
    for b_wrong in (quantize_reference(w, "nvfp4"), quantize_reference(w, "mxfp8"), b.to_layout("hopper")):
        with pytest.raises(TypeError, match="a="):
            lk.grouped_matmul(a, b_wrong, offsets, ids, out=out, out_dtype=torch.float32)
    with pytest.raises(ValueError, match="block_k"):
        lk.grouped_matmul(a, b, offsets, ids, out=out, out_dtype=torch.float32, config=_config(block_k=256))
    bad = lk.ScaledTensor(a.data, a.scales, "fp8", block=(1, 128))
    bad.scales = a.scales[:, :0]  # no scale for the K block
    with pytest.raises(ValueError):
        lk.grouped_matmul(bad, b, offsets, ids, out=out, out_dtype=torch.float32)
    assert out.isnan().all(), "a call that raised wrote into out"


def _spread_weights(device, spread: int, n: int = 128, k: int = 128):
    """MXFP4 weights ``[2, n, k]`` whose first row's 32-K blocks span ``spread`` binades of scale."""
    w = torch.randn(2, n, k, device=device)
    w[0, 0, :32] *= 2.0**spread
    return quantize_reference(w, "mxfp4")


def test_prepared_weights_decode_to_the_dequantized_ones(device):
    """The Hopper kernel's weight preparation: its decode (emulated bit for bit in torch) gives ``dequantize(b)``
    exactly while a row's exponents spread by at most 14 binades (here 14, and a ragged K padded to 128-K steps);
    wider spreads raise ValueError naming the weights (or, with ``allow_rounding``, are rounded within the bound)."""
    for w in (_spread_weights(device, 12), quantize_reference(torch.randn(2, 128, 192, device=device), "mxfp4")):
        prepared = prepare_weights(w)
        assert prepared.rounded_blocks == 0
        assert torch.equal(emulate_decode(prepared), dequantize(w))
    wide = _spread_weights(device, 20)
    with pytest.raises(ValueError, match="w: .* rounded"):
        prepare_weights(wide)
    rounded = prepare_weights(wide, allow_rounding=True)
    assert rounded.rounded_blocks > 0 and not torch.equal(emulate_decode(rounded), dequantize(wide))
    with pytest.raises(ValueError, match="N a multiple of 128"):
        prepare_weights(quantize_reference(torch.randn(1, 96, 64, device=device), "mxfp4"))


def _bytes(w):
    return w.data.view(torch.uint8), w.scales.view(torch.uint8), tuple(w.shape)


def test_prepared_copies_follow_the_layout_cache_rules(monkeypatch, device):
    """One copy per weight memory (views and re-wraps find it), prepared again after an in-place write, dropped
    with the weights, none while a graph is captured or for tensors without version counters, none (remembered)
    for weights the decode cannot hold exactly, none when disabled."""
    W4A8_COPIES.clear()
    try:
        w = _spread_weights(device, 3)
        copy = W4A8_COPIES.get(*_bytes(w))
        assert copy is not None and len(W4A8_COPIES) == 1
        rewrapped = lk.ScaledTensor(w.data[:], w.scales.view(w.scales.shape), "mxfp4")
        assert W4A8_COPIES.get(*_bytes(rewrapped)) is copy and len(W4A8_COPIES) == 1
        other = quantize_reference(torch.randn(w.shape, device=device), "mxfp4")
        w.data.copy_(other.data)
        w.scales.copy_(other.scales)
        again = W4A8_COPIES.get(*_bytes(w))
        assert again is not copy and torch.equal(emulate_decode(again), dequantize(other))
        del w, rewrapped, copy, again
        assert len(W4A8_COPIES) == 0, "freed weights kept their copy"

        wide = _spread_weights(device, 20)
        assert W4A8_COPIES.get(*_bytes(wide)) is None and len(W4A8_COPIES) == 1  # remembered: not prepared again
        fresh = _spread_weights(device, 3)
        monkeypatch.setattr(layout_cache, "capturing", lambda device: True)
        assert W4A8_COPIES.get(*_bytes(fresh)) is None
        monkeypatch.undo()
        with torch.inference_mode():  # no version counter: a write could not be seen
            assert W4A8_COPIES.get(*_bytes(_spread_weights(device, 3))) is None
        W4A8_COPIES.enabled = False
        assert W4A8_COPIES.get(*_bytes(fresh)) is None
        assert len(W4A8_COPIES) == 1
    finally:
        W4A8_COPIES.enabled = True
        W4A8_COPIES.clear()


def test_hopper_backend_takes_large_plain_launches_only(monkeypatch, device):
    """Which backend takes a w4a8 launch on an sm_90 GPU (asked of the plan's rules, nothing runs): the Gluon
    ``w4a8_hopper`` kernel for plain 64- and 128-row tiles with the plain epilogue, bf16 out, N a multiple of 128, K
    of 64; the portable ``w4a8_blocks`` kernel for swap-AB or smaller tiles, epilogues, bias, expert scales, other out
    dtypes and shapes, and on other GPUs."""
    monkeypatch.setattr(w4a8_hopper, "interpreting", lambda: False)  # as on an H100, not the interpreter
    a, _, offsets, ids = _problem(128, device)
    b = quantize_reference(torch.randn(EXPERTS, 256, 128, device=device), "mxfp4")
    large = lk.BlockScaledMatmulConfig(128, 128, 64)

    def chosen(config=large, capability=(9, 0), b=b, expert_scales=None, epilogue=None, out_dtype=torch.bfloat16):
        bias = torch.zeros(EXPERTS, b.shape[1], device=device) if epilogue == "bias" else None
        epilogue = None if epilogue == "bias" else epilogue
        call = check_grouped_matmul(a, b, offsets, ids, expert_scales, epilogue, out_dtype, None, config, bias)
        with runtime.pretend_gpu(capability) as gpu:
            return backend_for(dataclasses.replace(call, device=gpu), config).__name__.rsplit(".", 1)[-1]

    assert chosen() == "w4a8_hopper" and chosen(lk.BlockScaledMatmulConfig(64, 128, 64)) == "w4a8_hopper"
    portable = [
        chosen(lk.BlockScaledMatmulConfig(128, 128, 64, ab_swapped=True)),
        chosen(lk.BlockScaledMatmulConfig(32, 128, 64)),
        chosen(capability=(10, 0)),
        chosen(b=quantize_reference(torch.randn(EXPERTS, 192, 128, device=device), "mxfp4")),
        chosen(b=b.to_layout("128x4")),
        chosen(expert_scales=torch.ones(EXPERTS, device=device)),
        chosen(epilogue="silu"),
        chosen(epilogue="bias"),
        chosen(out_dtype=torch.float32),
    ]
    assert portable == ["w4a8_blocks"] * len(portable), portable


@pytest.mark.gpu
@pytest.mark.parametrize(
    "sizes",
    [[256] * 8, [16] * 64, [0, 1, 300, 77, 40, 5, 129]],
    ids=["E8x256", "E64x16", "ragged"],
)
def test_gpu_shapes_repeats_and_capture(sizes, device):
    """Realistic shapes with the default launches (compute tiles, decode tiles, a ragged mix of size classes; K 2048
    with a ragged last scale block of 64): against float64, the same bits on a repeat and under CUDA-graph
    replay."""
    num_experts, n, k = 8, 512, 2048 - 64
    x = torch.randn(sum(sizes), k, device=device)
    x[:, ::7] *= 30.0
    a = lk.quantize(x, "fp8", block=(1, 128))
    b = lk.quantize(torch.randn(num_experts, n, k, device=device) / k**0.5, "mxfp4")
    offsets = random_group_offsets(sizes, device=device)
    ids = torch.arange(len(sizes), dtype=torch.int32, device=device) % num_experts
    ids[2] = -1
    out = _run(a, b, offsets, ids, n)
    expected = lk.grouped_matmul_reference(a, b, offsets, ids)
    assert_close_relative(out, expected, TOLERANCE[torch.float32], "w4a8 grouped_matmul")
    assert torch.equal(_run(a, b, offsets, ids, n), out), "a repeat changed the bits"
    graph_out = poison(torch.empty_like(out))
    lk.grouped_matmul(a, b, offsets, ids, out_dtype=torch.float32, out=graph_out)  # plans before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        lk.grouped_matmul(a, b, offsets, ids, out_dtype=torch.float32, out=graph_out)
    graph_out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(graph_out, out), "graph replay changed the bits"


@pytest.mark.gpu
@pytest.mark.parametrize("spread", [3, 20], ids=["exact-decode", "wide-spread-portable"])
def test_gpu_hopper_kernel(spread, device):
    """Groups of more than 64 tokens, the plain epilogue, bf16 out: on an sm_90 GPU the ``w4a8_hopper`` Gluon kernel
    through the prepared copy (weights whose exponents spread by 20 binades take the portable kernel instead, never
    rounded). Ragged groups (empty, -1, partial token tiles), rows past a_offsets[G] kept, K 1984 (a half last
    128-K step): against float64, the same bits on a repeat and under CUDA-graph replay."""
    sizes, num_experts, n, k = [0, 300, 77, 129, 256, 1000, 40], 8, 512, 1984
    x = torch.randn(sum(sizes) + 5, k, device=device)
    x[:, ::7] *= 30.0
    w = torch.randn(num_experts, n, k, device=device) / k**0.5
    w[:, 0, :32] *= 2.0**spread
    a, b = lk.quantize(x, "fp8", block=(1, 128)), lk.quantize(w, "mxfp4")
    offsets = random_group_offsets(sizes, device=device)
    ids = torch.tensor([3, 0, -1, 7, 1, 2, 5], dtype=torch.int32, device=device)
    W4A8_COPIES.clear()
    out = _run(a, b, offsets, ids, n, out_dtype=torch.bfloat16)
    if torch.cuda.get_device_capability(device)[0] == 9:
        prepared = W4A8_COPIES.get(b.data.view(torch.uint8), b.scales.view(torch.uint8), tuple(b.shape))
        assert len(W4A8_COPIES) == 1 and (prepared is None) == (spread > 14)
    rows = sum(sizes)
    expected = lk.grouped_matmul_reference(a, b, offsets, ids)
    assert_close_relative(out[:rows].float(), expected[:rows], TOLERANCE[torch.bfloat16], "w4a8 hopper")
    assert out[rows:].isnan().all() and (out[300:377] == 0).all()
    repeat = _run(a, b, offsets, ids, n, out_dtype=torch.bfloat16)  # rows past a_offsets[G] stay NaN: not compared
    assert torch.equal(repeat[:rows], out[:rows]) and repeat[rows:].isnan().all(), "a repeat changed the bits"
    graph_out = poison(torch.empty_like(out))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        lk.grouped_matmul(a, b, offsets, ids, out=graph_out)
    graph_out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(graph_out[:rows], out[:rows]) and graph_out[rows:].isnan().all(), "graph replay changed bits"
    W4A8_COPIES.clear()


# The w4a8_decode backend: the Hopper-layout kernel's fp8 (1, 128) mode on the weights' Hopper-layout copy. It runs
# on sm_90 GPUs only; in the interpreter the tests route the launches to it (supports patched) to run its kernel.


@pytest.fixture
def decode_backend(monkeypatch):
    """Every w4a8 launch with row-layout weights runs through the ``w4a8_decode`` backend (its launch, the copy
    lookup, the Hopper-layout kernel's fp8 mode); plans and copies are fresh before and after."""
    monkeypatch.setattr(
        w4a8_decode, "supports", lambda call, config: w4a8_blocks.takes(call.a, call.b) and call.b.scale_layout == "row"
    )
    clear_plans()
    HOPPER_COPIES.clear()
    yield HOPPER_COPIES
    monkeypatch.undo()
    clear_plans()
    HOPPER_COPIES.enabled = True
    HOPPER_COPIES.clear()


# (K, N, epilogue, out dtype, bias dtype): K 288 ends in a quarter 128-K step (half a 64-K chunk of the layout) and
# N 80 in a partial 32-column tile; SwiGLU's 48 output columns too, with bias and bf16 out; gpt-oss' interleaved rows
# (read through a [gate | up] copy, the bias de-interleaved per launch)
DECODE_CASES = {
    "plain-K288-N80": (288, 80, None, torch.float32, None),
    "swiglu-bias-bf16": (192, 96, "swiglu", torch.bfloat16, torch.bfloat16),
    "interleaved-clamped-bias": (
        128,
        96,
        lk.SwiGLU(alpha=1.702, limit=0.5, up_shift=1.0, interleaved=True),
        torch.float32,
        torch.float32,
    ),
}


@pytest.mark.parametrize("case", sorted(DECODE_CASES))
def test_decode_backend_matches_reference_and_portable_kernel(case, decode_backend, device):
    """The Hopper-layout kernel's fp8 mode on ragged groups (empty, 1 row, 17 rows over two 16-row tiles, an expert
    -1, ids in any order: the interpreter's default launches split them by size class), with expert scales and
    token-major A scales: close to float64, and within fp32 summation order of the portable w4a8 kernel (measured:
    the same bits in the interpreter); rows past a_offsets[G] unwritten; one Hopper-layout copy, found again by the
    next call."""
    k, n, epilogue, out_dtype, bias_dtype = DECODE_CASES[case]
    a, b, offsets, ids = _problem(k, device, n=n)
    a = lk.ScaledTensor(a.data, a.scales.t().contiguous().t(), "fp8", block=(1, 128))  # token-major scales
    expert_scales = torch.rand(EXPERTS, device=device) + 0.5
    bias = torch.randn(EXPERTS, n, device=device).to(bias_dtype) if bias_dtype is not None else None
    n_out = n // 2 if epilogue is not None else n
    kwargs = dict(out_dtype=out_dtype, expert_scales=expert_scales, epilogue=epilogue, bias=bias)
    out = _run(a, b, offsets, ids, n_out, **kwargs)
    assert len(decode_backend) == 1, "the decode launches did not read the Hopper-layout copy"
    _check(out, a, b, offsets, ids, expert_scales, epilogue=epilogue, bias=bias)
    rows = sum(SIZES)
    assert torch.equal(_run(a, b, offsets, ids, n_out, **kwargs)[:rows], out[:rows]) and len(decode_backend) == 1
    decode_backend.enabled = False  # no copy: the same launches run the portable kernel
    portable = _run(a, b, offsets, ids, n_out, **kwargs)
    assert len(decode_backend) == 1 and portable[rows:].isnan().all()
    # fp32: the bits in the interpreter, the MMAs' summation order on a GPU; bf16: one rounding of values an ulp apart
    tight = (2e-5 if on_gpu() else 1e-6) if out_dtype == torch.float32 else 4e-3
    assert_close_relative(out[:rows].float(), portable[:rows].float(), tight, "w4a8 decode against the portable")


def test_decode_backend_takes_the_default_decode_launches_on_sm90(monkeypatch, device):
    """Which backend takes a w4a8 launch on an sm_90 GPU (asked of the plan's rules, nothing runs): ``w4a8_decode`` for
    the default launches of groups of up to 64 tokens, on the Hopper-layout path's tiles of their size (16 tokens x 128
    weight rows, 64 under SwiGLU; 64 tokens x 64 rows; 128-K steps) in the kernel's fp8 mode, interleaved SwiGLU rows
    too; ``w4a8_hopper`` for the 128-row plain launches; the portable ``w4a8_blocks`` kernel for a config the caller
    chose, SwiGLU halves of partial 16-row blocks, 128x4 scales, 128-row launches with an epilogue, and other GPUs."""
    for module in (w4a8_hopper, w4a8_decode, gm_config):
        monkeypatch.setattr(module, "interpreting", lambda: False)  # as on an H100, not the interpreter
    a, _, offsets, ids = _problem(128, device)
    b = quantize_reference(torch.randn(EXPERTS, 256, 128, device=device), "mxfp4")

    def chosen(tokens, config=None, capability=(9, 0), b=b, epilogue=None, tile=None):
        swiglu = epilogue == "swiglu" or isinstance(epilogue, lk.SwiGLU)
        call = check_grouped_matmul(a, b, offsets, ids, None, epilogue, torch.bfloat16, None, None, None)
        with runtime.pretend_gpu(capability) as gpu:
            call = dataclasses.replace(call, device=gpu)
            config = config or gm_config.w4a8_config(tokens, 1, gpu, swiglu)
            backend = backend_for(call, config)
            if backend is w4a8_decode:
                spec = w4a8_decode.kernel_spec(call, config, (-1, 2**31 - 1))
                constexprs = spec.constexprs
                assert constexprs["A_FP8_BLOCKS"] and w4a8_decode.upcast_dtype(call, config) is None
                expected = gm_config.hopper_config(tokens, 1, gpu, swiglu)  # the bf16 x MXFP4 Hopper-layout path's
                assert (constexprs["BLOCK_M"], constexprs["BLOCK_N"], constexprs["BLOCK_K"]) == tile, constexprs
                assert (expected.block_m, expected.block_k) == (tile[0], tile[2]) and tile[1] <= expected.block_n
                assert spec.options == dict(num_warps=expected.num_warps, num_stages=expected.num_stages)
        return backend.__name__.rsplit(".", 1)[-1]

    assert chosen(1, tile=(16, 128, 128)) == "w4a8_decode"
    assert chosen(16, tile=(16, 128, 128)) == "w4a8_decode"
    assert chosen(48) == "w4a8_hopper"  # the plain 17-64-token class: the Gluon kernel's 128-token tiles
    assert chosen(8, epilogue="swiglu", tile=(16, 64, 128)) == "w4a8_decode"
    assert chosen(64, epilogue="swiglu", tile=(64, 64, 128)) == "w4a8_decode"
    assert chosen(8, epilogue=lk.SwiGLU(interleaved=True), tile=(16, 64, 128)) == "w4a8_decode"
    assert chosen(2048) == "w4a8_hopper"
    b_rows_40 = quantize_reference(torch.randn(EXPERTS, 40, 128, device=device), "mxfp4")
    portable = [
        chosen(8, config=lk.BlockScaledMatmulConfig(16, 64, 128, ab_swapped=True)),
        chosen(8, b=b_rows_40, epilogue="swiglu"),
        chosen(8, b=b.to_layout("128x4")),
        chosen(2048, epilogue="silu"),
        chosen(8, capability=(10, 0)),
        chosen(8, capability=(8, 9)),
    ]
    assert portable == ["w4a8_blocks"] * len(portable), portable


@pytest.mark.gpu
@pytest.mark.parametrize(
    "sizes, epilogue",
    [([1] * 64, None), ([16] * 32, "swiglu"), ([4] * 32, GPT_OSS_SWIGLU), ([0, 1, 40, 3, 64, 17, 9, 2], None)],
    ids=["E64x1", "E32x16-swiglu", "E32x4-gpt-oss", "ragged-decode"],
)
def test_gpu_decode_sizes(sizes, epilogue, device):
    """Decode sizes on the GPU with the default launches (on sm_90 the ``w4a8_decode`` backend through the weights'
    Hopper-layout copy): against float64, within fp32 summation order of the portable kernel (the copies off), rows
    past a_offsets[G] unwritten, an expert -1 zeros, the same bits on a repeat and under CUDA-graph replay. K 1984:
    a half last 128-K step; bias and expert scales under SwiGLU (gpt-oss' interleaved rows too)."""
    num_experts, n, k = 64, 512, 1984
    x = torch.randn(sum(sizes) + 5, k, device=device)
    x[:, ::7] *= 30.0
    a = lk.quantize(x, "fp8", block=(1, 128))
    b = lk.quantize(torch.randn(num_experts, n, k, device=device) / k**0.5, "mxfp4")
    offsets = random_group_offsets(sizes, device=device)
    ids = torch.arange(len(sizes), dtype=torch.int32, device=device) % num_experts
    ids[len(sizes) // 2] = -1
    expert_scales = torch.rand(num_experts, device=device) + 0.5 if epilogue is not None else None
    bias = torch.randn(num_experts, n, device=device) if epilogue is not None else None
    n_out = n // 2 if epilogue is not None else n
    kwargs = dict(out_dtype=torch.float32, expert_scales=expert_scales, epilogue=epilogue, bias=bias)
    HOPPER_COPIES.clear()
    try:
        out = _run(a, b, offsets, ids, n_out, **kwargs)
        if torch.cuda.get_device_capability(device)[0] == 9:
            assert len(HOPPER_COPIES) == 1, "the decode launches did not read the Hopper-layout copy"
        rows = sum(sizes)
        expected = lk.grouped_matmul_reference(a, b, offsets, ids, expert_scales, epilogue=epilogue, bias=bias)
        assert_close_relative(out[:rows], expected[:rows], TOLERANCE[torch.float32], "w4a8 decode")
        assert out[rows:].isnan().all(), "rows past a_offsets[G] were written"
        start, end = offsets[len(sizes) // 2].item(), offsets[len(sizes) // 2 + 1].item()
        assert (out[start:end] == 0).all(), "a group of expert -1 is not zeros"
        again = _run(a, b, offsets, ids, n_out, **kwargs)
        assert torch.equal(again[:rows], out[:rows]) and again[rows:].isnan().all(), "a repeat changed the bits"
        graph_out = poison(torch.empty_like(out))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            lk.grouped_matmul(a, b, offsets, ids, out=graph_out, **kwargs)
        graph_out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(graph_out[:rows], out[:rows]) and graph_out[rows:].isnan().all(), "graph replay changed bits"
        HOPPER_COPIES.enabled = False
        clear_plans()
        portable = _run(a, b, offsets, ids, n_out, **kwargs)
        # summation order only: both add exact products in fp32 per 128-K step (a bound not yet measured on a GPU)
        assert_close_relative(out[:rows], portable[:rows], 2e-5, "w4a8 decode against the portable kernel")
    finally:
        HOPPER_COPIES.enabled = True
        HOPPER_COPIES.clear()
