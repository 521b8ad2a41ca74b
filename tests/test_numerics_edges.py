"""Numerics at the edges: values near the dtype's max, scores that overflow fp16 before scaling, NaN
and inf in inputs (they propagate where the reference propagates them and never reach unrelated
rows), subnormal block scales. All-zero blocks and fully masked rows are in test_formats.py and
test_attention.py."""

import pytest
import torch

import llmkernels as lk
from llmkernels.testing import assert_close_relative, poison

SMALL = lk.BlockScaledMatmulConfig(block_m=16, block_n=32, block_k=64, num_stages=1, num_warps=4)

pytestmark = pytest.mark.filterwarnings(
    "ignore:invalid value encountered:RuntimeWarning", "ignore:overflow encountered:RuntimeWarning"
)


def _bits_equal(q, ref):
    return torch.equal(q.data.view(torch.uint8), ref.data.view(torch.uint8)) and torch.equal(
        q.scales.view(torch.uint8), ref.scales.view(torch.uint8)
    )


@pytest.mark.parametrize("format", ["mxfp8", "mxfp4", "nvfp4"])
def test_quantize_nan_inf_and_extremes_match_reference_bits(format, device):
    """Block by block: NaN, +inf, -inf, the fp32 max, subnormal fp32 values (block scales at the
    bottom of e8m0 / e4m3), and ordinary blocks next to them, which must not change."""
    x = torch.randn(6, 128, device=device)
    x[0, 3] = float("nan")
    x[1, 40] = float("inf")
    x[2, 70] = -float("inf")
    x[3, :32] = torch.finfo(torch.float32).max * torch.linspace(-1, 1, 32, device=device)
    x[4, :64] = 1e-40 * torch.randn(64, device=device)  # float32 subnormals
    x[5, 96:] = 3e-39
    for rows in (slice(0, 6), slice(3, 6)):  # with and without the non-finite blocks
        part = x[rows].contiguous()
        # nvfp4's per-tensor scale comes from amax(|x|): pass a finite one so that only the
        # non-finite blocks are affected
        global_scale = torch.tensor(1.0, device=device) if format == "nvfp4" else None
        q = lk.quantize(part, format, global_scale=global_scale)
        ref = lk.quantize_reference(part, format, global_scale=global_scale)
        assert _bits_equal(q, ref), f"{format}, rows {rows}"
    clean = lk.quantize(x[3:].contiguous(), format, global_scale=global_scale)
    mixed = lk.quantize(x, format, global_scale=global_scale)
    assert torch.equal(mixed.data[3:].view(torch.uint8), clean.data.view(torch.uint8))


@pytest.mark.parametrize("formats", [("bf16", "bf16"), ("mxfp8", "mxfp8"), ("bf16", "mxfp4")], ids="x".join)
def test_grouped_matmul_nan_stays_in_its_rows(formats, device):
    """A NaN in one row of A poisons that row's outputs only; an inf in one expert's weights
    poisons that expert's rows only; every other row matches the reference."""
    k, n = 128, 64
    ids = [1, 0, 2]  # of groups of 5, 7 and 4 rows
    offsets = torch.tensor([0, 5, 12, 16], dtype=torch.int32, device=device)
    x = torch.randn(16, k, device=device)
    w = torch.randn(3, n, k, device=device) / k**0.5
    x[6, 10] = float("nan")  # group 1 (expert 0)
    w[2, 3, 20] = float("inf")  # expert 2 (group 2, rows 12..15), output column 3
    a = x.to(torch.bfloat16) if formats[0] == "bf16" else lk.quantize(x, formats[0])
    b = w.to(torch.bfloat16) if formats[1] == "bf16" else lk.quantize(w, formats[1])
    expert_ids = torch.tensor(ids, dtype=torch.int32, device=device)
    out = lk.grouped_matmul(
        a, b, offsets, expert_ids, out_dtype=torch.float32, config=SMALL, out=poison(torch.empty(16, n, device=device))
    )
    ref = lk.grouped_matmul_reference(a, b, offsets, expert_ids)
    assert torch.equal(torch.isnan(out), torch.isnan(ref)) and torch.equal(torch.isinf(out), torch.isinf(ref))
    bad_rows = torch.isnan(ref).any(1) | torch.isinf(ref).any(1)
    assert bad_rows[6] and bad_rows[12:].all() and bad_rows.sum() == 5
    assert_close_relative(out[~bad_rows], ref[~bad_rows], 1e-5, "clean rows")


def test_grouped_matmul_fp16_near_max(device):
    """fp16 operands near 65504: products accumulate in fp32 (no overflow); an fp16 output
    overflows to inf exactly where the float32 result passes the fp16 range."""
    k, n = 64, 32
    a = (torch.rand(8, k, device=device) * 2 - 1).mul(60000).to(torch.float16)
    b = (torch.rand(1, n, k, device=device) * 2 - 1).mul(4).to(torch.float16)
    offsets = torch.tensor([0, 8], dtype=torch.int32, device=device)
    ids = torch.zeros(1, dtype=torch.int32, device=device)
    ref = lk.grouped_matmul_reference(a, b, offsets, ids)
    out32 = lk.grouped_matmul(a, b, offsets, ids, out_dtype=torch.float32, config=SMALL)
    assert_close_relative(out32, ref, 1e-5, "fp32 out")
    out16 = lk.grouped_matmul(a, b, offsets, ids, out_dtype=torch.float16, config=SMALL)
    assert torch.equal(torch.isinf(out16), ref.abs() > 65519.0)  # 65520 rounds to inf in fp16


def test_attention_scores_past_fp16_range(device):
    """fp16 q·k of ~10^6 (past fp16's 65504 before the softmax scale): the kernel's fp32 scores keep
    the softmax exact, as the float32 reference does."""
    q = torch.randn(1, 24, 2, 64, device=device).mul(150).to(torch.float16)
    k = torch.randn(1, 40, 2, 64, device=device).mul(150).to(torch.float16)
    v = torch.randn(1, 40, 2, 64, device=device, dtype=torch.float16)
    out, lse = lk.attention(q, k, v, causal=True, return_lse=True)
    ref, ref_lse = lk.attention_reference(q, k, v, causal=True, return_lse=True)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    assert_close_relative(out, ref, 4e-3, "out")
    assert_close_relative(lse, ref_lse, 1e-4, "lse")


def test_attention_nan_in_one_sequence_stays_there(device):
    """A NaN key in sequence 1 of a ragged batch makes sequence 1's rows that see it NaN (as in
    the reference) and leaves sequences 0 and 2 exact."""
    lengths = [17, 23, 9]
    cu = torch.tensor([0, 17, 40, 49], dtype=torch.int32, device=device)
    q = torch.randn(49, 4, 32, device=device, dtype=torch.bfloat16)
    k = torch.randn(49, 2, 32, device=device, dtype=torch.bfloat16)
    v = torch.randn(49, 2, 32, device=device, dtype=torch.bfloat16)
    k[17 + 5, 1, 7] = float("nan")  # key 5 of sequence 1, kv head 1 (q heads 2, 3)
    kwargs = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(lengths), max_seqlen_k=max(lengths), causal=True)
    out = lk.attention(q, k, v, **kwargs)
    ref = lk.attention_reference(q, k, v, **kwargs)
    assert torch.equal(torch.isnan(out), torch.isnan(ref))
    nan_rows = torch.isnan(ref).any(-1)
    assert nan_rows[17 + 5 : 40, 2:].all() and not nan_rows[:17].any() and not nan_rows[40:].any()
    clean = ~nan_rows
    assert_close_relative(out[clean], ref[clean], 2e-2, "clean rows")
