"""grouped_matmul on fp8 blocks (DeepSeek-style: e4m3 with a float32 scale per (1, 128) activation and (128, 128)
weight tile) against grouped_matmul_reference: float64 products of the dequantized operands (bf16 and fp16
activations quantized to fp8 (1, 128) first, as the call does).

Outputs are poisoned with NaN: an unwritten row fails, and rows past a_offsets[G] must still be NaN afterwards;
groups of expert -1 must be exact zeros. Small shapes: the interpreter runs each program in numpy.

Relative errors (Frobenius) measured under the Triton 3.9 interpreter (CPU), bounds about 3x those:

==========  ===============  ====================================================================================
out dtype   measured         what is left
==========  ===============  ====================================================================================
float32     6.1e-8 - 1.1e-7  fp32 sums of exact e4m3 products and the promotions' roundings, fp32 epilogues;
            3.8e-7           gpt-oss' clamped SwiGLU (three fp32 factors); bound 1e-6. On a GPU the fp8 MMA adds
                             its reduced-precision accumulation inside each 128-wide K block (not measured here;
                             bound 3e-5 there)
bfloat16    3.2e-3 - 3.4e-3  the output's rounding (the interpreter truncates fp32 to bf16: a uniform error of
                             up to one ulp); bound 1e-2
==========  ===============  ====================================================================================
"""

import pytest
import torch
import triton
import triton.language as tl

import llmkernels as lk
from llmkernels.formats import quantize_reference
from llmkernels.grouped_matmul import default_launches
from llmkernels.testing import assert_close_relative, on_gpu, poison, random_group_offsets

# fp32 output on an H100: 2.1e-4 to 2.4e-4, 1.2e-3 under the clamped SwiGLU (Hopper's fp8 wgmma adds its
# products in reduced precision within each 128-wide K block, which the per-block promotion bounds)
TOLERANCE = {torch.float32: 3e-3 if on_gpu() else 1e-6, torch.bfloat16: 1e-2}

# Group sizes, expert of each group, experts: an empty group, a 1-row group, an expert -1, a group larger than
# one 16-row tile, ids in any order.
SIZES, IDS, EXPERTS = [17, 0, 1, 6, 13, 2], [2, 0, 1, -1, 1, 2], 3
TRAILING = 3  # rows past a_offsets[G]: never written
N = 192  # a partial last 128-row weight-scale block


def _config(block_m=16, block_n=64, swapped=False, num_programs=None):
    return lk.BlockScaledMatmulConfig(
        block_m, block_n, 128, num_stages=1, num_warps=4, ab_swapped=swapped, num_programs=num_programs
    )


def _problem(k: int, device, n: int = N):
    """Activations with outlier columns (scales that differ per token and K block) and weights whose 128-row
    blocks differ in scale; the metadata of SIZES / IDS."""
    num_tokens = sum(SIZES) + TRAILING
    x = torch.randn(num_tokens, k, device=device)
    x[:, ::7] *= 30.0
    w = torch.randn(EXPERTS, n, k, device=device) / k**0.5
    w[:, 128:] *= 8.0
    offsets = random_group_offsets(SIZES, device=device)
    ids = torch.tensor(IDS, dtype=torch.int32, device=device)
    return x, w, offsets, ids


def _activations(x: torch.Tensor, format: str):
    if format in ("bf16", "fp16"):  # quantized to fp8 (1, 128) by the call
        return x.to(torch.bfloat16 if format == "bf16" else torch.float16)
    return quantize_reference(x, "fp8", block=(1, 128))


def _weights(w: torch.Tensor):
    return quantize_reference(w, "fp8", block=(128, 128))


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
    assert_close_relative(out[:rows].float(), expected[:rows], TOLERANCE[out.dtype], "fp8 grouped_matmul")
    assert out[rows:].isnan().all(), "rows past a_offsets[G] were written"
    starts = offsets.tolist()
    for group, expert in enumerate(IDS):
        if expert < 0:
            assert (out[starts[group] : starts[group + 1]] == 0).all(), "a group of expert -1 is not zeros"


@pytest.mark.parametrize(
    "a_format, config, k",
    [
        ("fp8", _config(), 320),
        ("fp8", _config(swapped=True), 200),
        ("bf16", _config(), 200),
        ("fp16", _config(swapped=True), 128),
        ("fp8", _config(32, 256, swapped=True, num_programs=3), 320),  # two sub-tiles, the second past N; persistent
    ],
    ids=["fp8-plain-K320", "fp8-swapped-K200", "bf16-plain-K200", "fp16-swapped-K128", "fp8-split-persistent"],
)
def test_pairs_orientations_and_ragged_k(a_format, config, k, device):
    x, w, offsets, ids = _problem(k, device)
    a, b = _activations(x, a_format), _weights(w)
    expert_scales = torch.rand(EXPERTS, device=device) + 0.5
    out = _run(a, b, offsets, ids, N, expert_scales=expert_scales, config=config)
    _check(out, a, b, offsets, ids, expert_scales)


@triton.jit
def _row_col_epilogue(value, row, col):
    return value * (1.0 + 0.01 * row.to(tl.float32)) - 0.001 * col.to(tl.float32)


def _row_col_reference(value, row, col):
    return value * (1.0 + 0.01 * row) - 0.001 * col


# (epilogue, reference epilogue, config): swiglu halves of 96 columns against 64-wide sub-tiles read a scale per
# weight row; interleaved rows against 128-wide sub-tiles too; the others one scale per sub-tile.
EPILOGUE_CASES = {
    "none": (None, None, _config(swapped=True)),
    "silu": ("silu", None, _config(32, 128)),
    "gelu": ("gelu", None, _config(swapped=True)),
    "swiglu": ("swiglu", None, _config()),
    "swiglu-uniform": ("swiglu", None, _config(block_n=32, swapped=True)),
    "interleaved-clamped": (
        lk.SwiGLU(alpha=1.702, limit=0.5, up_shift=1.0, interleaved=True),
        None,
        _config(block_n=128, swapped=True),
    ),
    "user": (_row_col_epilogue, _row_col_reference, _config()),
}


@pytest.mark.parametrize("case", sorted(EPILOGUE_CASES))
def test_epilogues_with_bias_and_expert_scales(case, device):
    epilogue, reference_epilogue, config = EPILOGUE_CASES[case]
    x, w, offsets, ids = _problem(200, device)
    a, b = _activations(x, "bf16" if case in ("silu", "swiglu") else "fp8"), _weights(w)
    expert_scales = torch.rand(EXPERTS, device=device) + 0.5
    bias_dtype = torch.bfloat16 if case in ("gelu", "swiglu") else torch.float32
    bias = torch.randn(EXPERTS, N, device=device).to(bias_dtype)
    gated = epilogue == "swiglu" or isinstance(epilogue, lk.SwiGLU)
    out_dtype = torch.bfloat16 if case in ("none", "swiglu-uniform", "user") else torch.float32
    out = _run(
        a,
        b,
        offsets,
        ids,
        N // 2 if gated else N,
        out_dtype=out_dtype,
        expert_scales=expert_scales,
        epilogue=epilogue,
        bias=bias,
        config=config,
    )
    _check(out, a, b, offsets, ids, expert_scales, epilogue=epilogue, reference_epilogue=reference_epilogue, bias=bias)


def test_views_give_the_bits_of_the_contiguous_call(device):
    """Token-major A scales (``[K/128, T]`` seen transposed, as vLLM and DeepGEMM keep them), A and weights as
    offset and strided views, weight scales transposed, a strided bias and an ``out=`` that is a transposed view:
    the bits of the call on contiguous copies."""
    k = 200
    x, w, offsets, ids = _problem(k, device)
    a, b = _activations(x, "fp8"), _weights(w)
    bias = torch.randn(EXPERTS, N, device=device)
    config = _config(block_n=128, swapped=True)
    expected = _run(a, b, offsets, ids, N, out_dtype=torch.bfloat16, bias=bias, config=config)

    a_data = torch.zeros(a.shape[0] + 1, k + 16, dtype=a.data.dtype, device=device)[1:, 8 : 8 + k]
    a_data.copy_(a.data)
    a_scales = a.scales.t().contiguous().t()  # token-major
    b_data = torch.zeros(EXPERTS, N, 2 * k, dtype=b.data.dtype, device=device)[..., ::2]
    b_data.copy_(b.data)
    b_scales = b.scales.transpose(1, 2).contiguous().transpose(1, 2)
    a_view = lk.ScaledTensor(a_data, a_scales, "fp8", block=(1, 128))
    b_view = lk.ScaledTensor(b_data, b_scales, "fp8", block=(128, 128))
    bias_view = torch.zeros(EXPERTS, 2 * N, device=device)[:, ::2]
    bias_view.copy_(bias)
    out = poison(torch.empty(N, a.shape[0], dtype=torch.bfloat16, device=device)).t()
    _run(a_view, b_view, offsets, ids, N, out_dtype=torch.bfloat16, out=out, bias=bias_view, config=config)
    assert torch.equal(out.isnan(), expected.isnan())
    assert torch.equal(torch.nan_to_num(out), torch.nan_to_num(expected))


def test_default_configs(device):
    """config=None: the default launches (by group size class in the interpreter: swap-AB tiles for the groups of
    up to 16 rows, plain ones above)."""
    x, w, offsets, ids = _problem(128, device, n=64)
    a, b = _activations(x, "fp8"), _weights(w)
    out = _run(a, b, offsets, ids, 64)
    _check(out, a, b, offsets, ids)
    launches = default_launches(
        sum(SIZES), len(SIZES), 64, 128, device, "e4m3", "e4m3", b_scale_block=128, b_scale="f32"
    )
    assert all(config.block_k == 128 for config, _, _ in launches)


def _bad_call(a, b, offsets, ids, out, **kwargs):
    lk.grouped_matmul(a, b, offsets, ids, out=out, out_dtype=torch.float32, **kwargs)


def test_bad_pairs_scales_and_configs_raise_before_any_launch(device):
    x, w, offsets, ids = _problem(128, device)
    a, b = _activations(x, "fp8"), _weights(w)
    out = poison(torch.empty(x.shape[0], N, device=device))
    wrong_pairs = [
        (a, quantize_reference(w, "mxfp8")),
        (quantize_reference(x, "mxfp8"), b),
        (quantize_reference(x, "fp8", block=(128, 128)), b),  # weight blocks as activations
        (a, quantize_reference(w, "fp8", block=(1, 128))),  # activation blocks as weights
        (a, w.to(torch.bfloat16)),
    ]
    for a_wrong, b_wrong in wrong_pairs:
        with pytest.raises(TypeError, match="a="):
            _bad_call(a_wrong, b_wrong, offsets, ids, out)
    with pytest.raises(ValueError, match="block_k"):
        _bad_call(a, b, offsets, ids, out, config=lk.BlockScaledMatmulConfig(16, 64, 64))
    for operand, name in ((a, "a"), (b, "b")):
        bad = lk.ScaledTensor(operand.data, operand.scales, "fp8", block=operand.block)
        bad.scales = operand.scales[..., :-1]  # one K block short
        with pytest.raises(ValueError):
            _bad_call(bad if name == "a" else a, bad if name == "b" else b, offsets, ids, out)
    with pytest.raises(ValueError):
        lk.ScaledTensor(b.data, b.scales[:, :1], "fp8", block=(128, 128))
    assert out.isnan().all(), "a call that raised wrote into out"
