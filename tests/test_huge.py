"""Inputs with more than 2^31 elements (GPU only): every index product that can pass int32 must be
64-bit. Each test checks the rows that lie beyond the 2^31-element mark against the reference, and
poisons the output so that an unwritten row fails."""

import pytest
import torch

import llmkernels as lk
from llmkernels.testing import assert_close_relative

pytestmark = pytest.mark.gpu

INT32_LIMIT = 2**31


def _free_gib() -> float:
    free, _ = torch.cuda.mem_get_info()
    return free / 2**30


@pytest.mark.parametrize("a_format", ["bf16", "mxfp8"])
def test_grouped_matmul_a_past_int32(a_format, device):
    """A of [T, K] with T·K > 2^31: the last group's rows start past element 2^31."""
    k, n, experts = 4096, 128, 4
    rows = INT32_LIMIT // k + 3000
    if _free_gib() < 3 * rows * k * 2 / 2**30:
        pytest.skip("not enough GPU memory")
    a_float = torch.empty(rows, k, device=device, dtype=torch.bfloat16).normal_()
    a = a_float if a_format == "bf16" else lk.quantize(a_float, "mxfp8")
    del a_float  # (a keeps it alive for bf16)
    b = torch.randn(experts, n, k, device=device, dtype=torch.bfloat16) * k**-0.5
    b = b if a_format == "bf16" else lk.quantize(b, "mxfp8")
    offsets = torch.tensor([0, 1000, 2000, rows - 5000, rows], device=device, dtype=torch.int32)
    ids = torch.tensor([3, 0, 2, 1], device=device, dtype=torch.int32)
    out = torch.full((rows, n), float("nan"), device=device, dtype=torch.bfloat16)
    lk.grouped_matmul(a, b, offsets, ids, out=out)
    tail = slice(rows - 5000, rows)  # group 3 (expert 1), all past element 2^31 of A
    if a_format == "bf16":
        expected = a[tail].float() @ b[1].float().t()
    else:
        a_tail = lk.ScaledTensor(a.data[tail], a.scales[tail], "mxfp8")
        expected = lk.dequantize(a_tail) @ lk.dequantize(lk.ScaledTensor(b.data[1], b.scales[1], "mxfp8")).t()
    assert_close_relative(out[tail].float(), expected, 1e-2, "rows past 2^31 elements")
    assert not out[: rows - 5000].isnan().any()


@pytest.mark.parametrize("b_format", ["bf16", "mxfp8"])
def test_grouped_matmul_b_past_int32(b_format, device):
    """B of [E, N, K] with E·N·K > 2^31: the last expert's weights start past element 2^31."""
    experts, n, k = 68, 8192, 4096
    if _free_gib() < 2.5 * experts * n * k * 2 / 2**30:
        pytest.skip("not enough GPU memory")
    b_float = torch.empty(experts, n, k, device=device, dtype=torch.bfloat16).normal_()
    b = b_float if b_format == "bf16" else lk.quantize(b_float, "mxfp8")
    del b_float
    a = torch.randn(48, k, device=device, dtype=torch.bfloat16)
    offsets = torch.tensor([0, 16, 32, 48], device=device, dtype=torch.int32)
    ids = torch.tensor([experts - 1, 0, experts - 2], device=device, dtype=torch.int32)
    out = lk.grouped_matmul(
        a, b, offsets, ids, out=torch.full((48, n), float("nan"), device=device, dtype=torch.bfloat16)
    )
    for group, expert in enumerate(ids.tolist()):
        weight = (
            b[expert].float()
            if b_format == "bf16"
            else lk.dequantize(lk.ScaledTensor(b.data[expert], b.scales[expert], "mxfp8"))
        )
        rows = slice(16 * group, 16 * group + 16)
        assert_close_relative(out[rows].float(), a[rows].float() @ weight.t(), 1e-2, f"expert {expert}")


def test_quantize_past_int32(device):
    k = 4096
    rows = INT32_LIMIT // k + 64
    x = torch.empty(rows, k, device=device, dtype=torch.bfloat16).normal_()
    for fmt in ("mxfp8", "mxfp4"):
        q = lk.quantize(x, fmt)
        ref = lk.quantize_reference(x[-64:], fmt)
        assert torch.equal(q.data[-64:].view(torch.uint8), ref.data.view(torch.uint8))
        assert torch.equal(q.scales[-64:].view(torch.uint8), ref.scales.view(torch.uint8))
        del q


def _decode_reference(q, k, v):
    """q [Hq, D], k/v [S, Hkv, D] → [Hq, D] in float32."""
    group = q.shape[0] // k.shape[1]
    k = k.float().repeat_interleave(group, dim=1)
    v = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("hd,shd->hs", q.float(), k) * q.shape[-1] ** -0.5
    return torch.einsum("hs,shd->hd", scores.softmax(-1), v)


@pytest.mark.parametrize("layout", ["dense", "paged"])
def test_attention_decode_kv_past_int32(layout, device):
    """Batch 32 × 128k context × 8 KV heads × 128: 4.3·10^9 elements per K and per V."""
    batch, context, heads_kv, heads_q, dim, page = 32, 128 * 1024, 8, 32, 128, 64
    if _free_gib() < 2.2 * 2 * batch * context * heads_kv * dim * 2 / 2**30:
        pytest.skip("not enough GPU memory")
    q = torch.randn(batch, 1, heads_q, dim, device=device, dtype=torch.bfloat16)
    shape = (batch, context, heads_kv, dim) if layout == "dense" else (batch * context // page, page, heads_kv, dim)
    k = torch.empty(shape, device=device, dtype=torch.bfloat16).normal_()
    v = torch.empty(shape, device=device, dtype=torch.bfloat16).normal_()
    if layout == "dense":
        out = lk.attention(q, k, v)
        sequence_kv = {b: (k[b], v[b]) for b in (0, batch - 1)}
    else:
        pages_per_sequence = context // page
        block_table = torch.randperm(batch * pages_per_sequence, device=device, dtype=torch.int32)
        block_table = block_table.view(batch, pages_per_sequence)
        seqlens = torch.full((batch,), context, device=device, dtype=torch.int32)
        out = lk.attention(q, None, None, kv_cache=lk.PagedKVCache(k, v, block_table, seqlens))
        sequence_kv = {
            b: (k[block_table[b].long()].flatten(0, 1), v[block_table[b].long()].flatten(0, 1)) for b in (0, batch - 1)
        }
    assert not out.isnan().any()
    for b, (k_b, v_b) in sequence_kv.items():
        assert_close_relative(out[b, 0].float(), _decode_reference(q[b, 0], k_b, v_b), 1e-2, f"sequence {b}")
