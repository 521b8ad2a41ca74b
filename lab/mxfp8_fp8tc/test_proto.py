"""Interpreter tests of the MXFP8 x MXFP8 per-32-K-promotion prototype (lab/mxfp8_fp8tc/kernel.py).

    python3 -m pytest -n 0 -p no:cacheprovider -c /dev/null lab/mxfp8_fp8tc/test_proto.py

Operands come from the library's public ``llmkernels.quantize(x, "mxfp8")``; the reference is a float64 matmul of
``llmkernels.dequantize`` of both. The kernel's only roundings are the fp32 sums (32 exact e4m3 products per
partial, exact power-of-two promotion, one fp32 add per sub-step), so float32 output must agree to 1e-6 relative
(Frobenius, and max element over max |ref|). bf16 output: within one bf16 ulp (the interpreter truncates).
"""
from __future__ import annotations

import os
import sys

os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import pytest
import torch
from kernel import mxfp8_matmul

import llmkernels


def make_operands(m, n, k, seed=0, spread=True):
    """Random A [m, k] and B [n, k] quantized to MXFP8; with ``spread`` the 32-wide blocks get very different
    scales (per row and per K block), so a wrong exponent, block index or factor orientation shows."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=generator)
    w = torch.randn(n, k, generator=generator) * k**-0.5
    if spread:
        x = x * torch.exp2(torch.randint(-6, 7, (m, k // 32), generator=generator).float()).repeat_interleave(32, 1)
        w = w * torch.exp2(torch.randint(-6, 7, (n, k // 32), generator=generator).float()).repeat_interleave(32, 1)
    return llmkernels.quantize(x, "mxfp8"), llmkernels.quantize(w, "mxfp8")


def reference(qa, qb):
    return llmkernels.dequantize(qa).double() @ llmkernels.dequantize(qb).double().T


def relative_errors(out, ref):
    diff = out.double() - ref
    return (diff.norm() / ref.norm()).item(), (diff.abs().max() / ref.abs().max()).item()


SHAPES = [(64, 64, 64), (48, 80, 96), (64, 64, 256), (33, 17, 96), (16, 128, 256)]


@pytest.mark.parametrize("m,n,k", SHAPES)
@pytest.mark.parametrize("block_k", [32, 64, 128])
def test_float32_exact(m, n, k, block_k):
    qa, qb = make_operands(m, n, k, seed=m + n + k)
    assert qa.scales.dtype == torch.float8_e8m0fnu and qa.scales.shape == (m, k // 32)
    ref = reference(qa, qb)
    out = mxfp8_matmul(qa.data, qa.scales, qb.data, qb.scales, torch.float32, block_m=32, block_n=32, block_k=block_k)
    fro, worst = relative_errors(out, ref)
    assert fro <= 1e-6 and worst <= 1e-6, f"relative error {fro:.3g} (Frobenius), {worst:.3g} (max)"


@pytest.mark.parametrize("k", [64, 96, 256])
def test_rowcol_promotion_same_bits(k):
    """Both associations of the promotion multiply by exact powers of two: identical results."""
    qa, qb = make_operands(32, 48, k, seed=k)
    one = mxfp8_matmul(qa.data, qa.scales, qb.data, qb.scales, block_m=32, block_n=16)
    two = mxfp8_matmul(qa.data, qa.scales, qb.data, qb.scales, block_m=32, block_n=16, promote_rowcol=True)
    assert torch.equal(one, two)


@pytest.mark.parametrize("k", [64, 96, 256])
def test_bf16_within_one_ulp(k):
    qa, qb = make_operands(40, 64, k, seed=7 * k)
    ref = reference(qa, qb)
    out = mxfp8_matmul(qa.data, qa.scales, qb.data, qb.scales, torch.bfloat16, block_m=32, block_n=32)
    ulp = torch.exp2(torch.floor(torch.log2(ref.abs().clamp_min(1e-300))) - 7)
    assert ((out.double() - ref).abs() <= ulp + 1e-6 * ref.abs().max()).all()


def test_extreme_exponents():
    """Scales far from 1 (2^±60 per block, products up to 2^±120): the bit-built factors stay exact."""
    generator = torch.Generator().manual_seed(3)
    k = 128
    x = torch.randn(32, k, generator=generator) * torch.tensor([2.0**60, 2.0**-60, 1.0, 2.0**30]).repeat_interleave(32)
    w = torch.randn(16, k, generator=generator) * torch.tensor([2.0**60, 2.0**-60, 2.0**-30, 1.0]).repeat_interleave(32)
    qa, qb = llmkernels.quantize(x, "mxfp8"), llmkernels.quantize(w, "mxfp8")
    ref = reference(qa, qb)
    out = mxfp8_matmul(qa.data, qa.scales, qb.data, qb.scales, block_m=32, block_n=16)
    assert torch.isfinite(out).all()
    fro, worst = relative_errors(out, ref)
    assert fro <= 1e-6 and worst <= 1e-6, (fro, worst)


def test_scale_orientation_matters():
    """Guards the test itself: swapping which operand's exponents go where is caught."""
    qa, qb = make_operands(32, 32, 128, seed=11)
    ref = reference(qa, qb)
    out = mxfp8_matmul(qa.data, qb.scales, qb.data, qa.scales, block_m=32, block_n=32)
    assert relative_errors(out, ref)[0] > 1e-2


# ---------------------------------------------------------------------------------------------------------------
# Grouped version


@pytest.mark.parametrize("k", [64, 96, 256])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_grouped(k, out_dtype):
    """Groups of 0, 1, 37 and 20 rows (an empty group, one-row group, ragged tiles), experts out of order and
    repeated, 6 trailing rows in no group (must stay NaN), expert weights with different scales."""
    from kernel import mxfp8_grouped_matmul
    generator = torch.Generator().manual_seed(k)
    sizes, experts, num_experts, n = [0, 1, 37, 20], [2, 0, 2, 1], 3, 48
    tokens = sum(sizes) + 6
    x = torch.randn(tokens, k, generator=generator)
    x = x * torch.exp2(torch.randint(-6, 7, (tokens, k // 32), generator=generator).float()).repeat_interleave(32, 1)
    w = torch.randn(num_experts, n, k, generator=generator) * k**-0.5
    w = w * torch.exp2(torch.randint(-6, 7, (num_experts, n, k // 32), generator=generator).float()).repeat_interleave(32, 2)
    qa, qb = llmkernels.quantize(x, "mxfp8"), llmkernels.quantize(w, "mxfp8")
    assert qb.scales.shape == (num_experts, n, k // 32)
    offsets = torch.tensor([0, *torch.tensor(sizes).cumsum(0).tolist()], dtype=torch.int32)
    ids = torch.tensor(experts, dtype=torch.int32)
    out = torch.full((tokens, n), float("nan"), dtype=out_dtype)
    mxfp8_grouped_matmul(qa.data, qa.scales, qb.data, qb.scales, offsets, ids, out=out, block_m=16, block_n=32,
                         block_k=64)
    xa, wb = llmkernels.dequantize(qa).double(), llmkernels.dequantize(qb).double()
    ref = torch.zeros(sum(sizes), n, dtype=torch.float64)
    for g, e in enumerate(experts):
        ref[offsets[g]:offsets[g + 1]] = xa[offsets[g]:offsets[g + 1]] @ wb[e].T
    got = out[: sum(sizes)]
    if out_dtype == torch.float32:
        fro, worst = relative_errors(got, ref)
        assert fro <= 1e-6 and worst <= 1e-6, (fro, worst)
    else:
        ulp = torch.exp2(torch.floor(torch.log2(ref.abs().clamp_min(1e-300))) - 7)
        assert ((got.double() - ref).abs() <= ulp + 1e-6 * ref.abs().max()).all()
    assert torch.isnan(out[sum(sizes):].float()).all(), "a row outside every group was written"


def test_grouped_bad_expert_writes_zeros():
    from kernel import mxfp8_grouped_matmul
    qa, qb = make_operands(20, 32, 64, seed=5)
    b, b_scales = qb.data[None].expand(2, -1, -1), qb.scales[None].expand(2, -1, -1)
    offsets = torch.tensor([0, 8, 20], dtype=torch.int32)
    ids = torch.tensor([1, 7], dtype=torch.int32)
    out = mxfp8_grouped_matmul(qa.data, qa.scales, b.contiguous(), b_scales.contiguous(), offsets, ids,
                               block_m=16, block_n=32)
    ref = reference(qa, qb)
    assert relative_errors(out[:8], ref[:8])[0] <= 1e-6
    assert (out[8:] == 0).all()
