"""The custom operators: schema and fake implementations (opcheck), and torch.compile(fullgraph=True)
of a function that quantizes and calls the grouped matmul, against the eager call."""
import pytest
import torch

import llmkernels as lk
from llmkernels._testing import assert_close_relative, random_group_offsets
from llmkernels.formats import scaled_tensor_parts


def _moe_problem(device, num_experts=3, n=64, k=64):
    sizes = [5, 0, 17]
    x = torch.randn(sum(sizes) + 2, k, device=device)
    w = torch.randn(num_experts, n, k, device=device) / k**0.5
    offsets = random_group_offsets(sizes, device=device)
    ids = torch.tensor([2, 0, 1], dtype=torch.int32, device=device)
    scales = torch.rand(num_experts, device=device) + 0.5
    return x, w, offsets, ids, scales, sum(sizes)


@pytest.mark.parametrize("formats", [("bf16", "bf16"), ("mxfp8", "mxfp8"), ("nvfp4", "nvfp4"), ("bf16", "mxfp4")],
                         ids="x".join)
def test_grouped_matmul_opcheck(formats, device):
    x, w, offsets, ids, scales, _ = _moe_problem(device)
    a = x.to(torch.bfloat16) if formats[0] == "bf16" else lk.quantize(x, formats[0])
    b = w.to(torch.bfloat16) if formats[1] == "bf16" else lk.quantize(w, formats[1])
    b_parts = scaled_tensor_parts(b)
    args = (*scaled_tensor_parts(a)[:7], *b_parts[:5], b_parts[7], offsets, ids, scales, "swiglu", torch.bfloat16,
            torch.randn(w.shape[:2], device=device), 1.702, 7.0, 1.0, True)
    # rows past the groups are left unwritten, so compare only the checks that do not read them
    torch.library.opcheck(torch.ops.llmkernels.grouped_matmul.default, args,
                          test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize("format", ["mxfp8", "mxfp4", "nvfp4"])
def test_quantize_opcheck(format, device):
    x = torch.randn(6, 64, device=device, dtype=torch.bfloat16)
    torch.library.opcheck(torch.ops.llmkernels.quantize.default, (x, format, None))


def _moe_block(x, w_gate_up, offsets, ids, scales):
    a = lk.quantize(x, "mxfp8")
    return lk.grouped_matmul(a, w_gate_up, offsets, ids, scales, epilogue="swiglu")


def test_compile_fullgraph_matches_eager(device):
    x, w, offsets, ids, scales, rows = _moe_problem(device)
    w_q = lk.quantize(w, "mxfp8")
    eager = _moe_block(x, w_q, offsets, ids, scales)
    compiled = torch.compile(_moe_block, fullgraph=True, backend="aot_eager")(x, w_q, offsets, ids, scales)
    assert compiled.shape == eager.shape and compiled.dtype == eager.dtype
    assert torch.equal(compiled[:rows], eager[:rows])


def _gpt_oss_block(x, w_gate_up, offsets, ids, bias):
    return lk.grouped_matmul(x, w_gate_up, offsets, ids, epilogue=lk.GPT_OSS_SWIGLU, bias=bias)


def test_compile_fullgraph_bias_and_swiglu_parameters(device):
    """A SwiGLU epilogue and a bias cross the custom op (as its fields) and give the eager call's bits."""
    x, w, offsets, ids, _, rows = _moe_problem(device)
    x, w_q, bias = x.bfloat16(), lk.quantize(w * 8, "mxfp4"), torch.randn(w.shape[:2], device=device)
    eager = _gpt_oss_block(x, w_q, offsets, ids, bias)
    compiled = torch.compile(_gpt_oss_block, fullgraph=True, backend="aot_eager")(x, w_q, offsets, ids, bias)
    assert torch.equal(compiled[:rows], eager[:rows])
    plain = lk.grouped_matmul(x, w_q, offsets, ids, epilogue="swiglu")
    assert not torch.equal(plain[:rows], eager[:rows])  # the parameters made a difference


@pytest.mark.gpu
def test_compile_cuda_graph(device):
    x, w, offsets, ids, scales, rows = _moe_problem(device, num_experts=8, n=512, k=256)
    w_q = lk.quantize(w, "mxfp4")
    eager = _moe_block(x, w_q, offsets, ids, scales)
    compiled = torch.compile(_moe_block, fullgraph=True, mode="reduce-overhead")
    for _ in range(3):  # warm-up, record, replay
        out = compiled(x, w_q, offsets, ids, scales)
    assert_close_relative(out[:rows].float(), eager[:rows].float(), 1e-6, "compiled + CUDA graph")


def _attention_args(q, k=None, v=None, *, has_window=False, left=-1, right=-1, chunk=0, softcap=0.0, slopes=None,
                    sinks=None, cu_q=None, cu_k=None, max_q=None, max_k=None, cache=None, num_splits=None,
                    return_lse=True):
    pages = (cache.k_pages, cache.v_pages, cache.block_table, cache.seqlens) if cache is not None else (None,) * 4
    return (q, k, v, has_window, left, right, chunk, softcap, slopes, sinks, q.shape[-1] ** -0.5, cu_q, cu_k, max_q,
            max_k, *pages, num_splits, return_lse)


@pytest.mark.parametrize("layout", ["dense", "ragged", "paged"])
def test_attention_opcheck(layout, device):
    dtype = torch.bfloat16
    if layout == "dense":
        q = torch.randn(2, 5, 4, 32, device=device, dtype=dtype)
        k, v = (torch.randn(2, 7, 2, 32, device=device, dtype=dtype) for _ in range(2))
        args = _attention_args(q, k, v, has_window=True, left=3, right=0, sinks=torch.randn(4, device=device))
    elif layout == "ragged":
        q = torch.randn(9, 4, 32, device=device, dtype=dtype)
        k, v = (torch.randn(11, 2, 32, device=device, dtype=dtype) for _ in range(2))
        cu_q = torch.tensor([0, 4, 9], dtype=torch.int32, device=device)
        cu_k = torch.tensor([0, 5, 11], dtype=torch.int32, device=device)
        args = _attention_args(q, k, v, chunk=4, softcap=20.0, cu_q=cu_q, cu_k=cu_k, max_q=5, max_k=6)
    else:
        q = torch.randn(2, 1, 4, 32, device=device, dtype=dtype)
        pages = torch.randperm(6, device=device).to(torch.int32).view(2, 3)
        cache = lk.PagedKVCache(torch.randn(6, 16, 2, 32, device=device, dtype=dtype),
                                torch.randn(6, 16, 2, 32, device=device, dtype=dtype), pages,
                                torch.tensor([40, 17], dtype=torch.int32, device=device))
        args = _attention_args(q, cache=cache, num_splits=3, slopes=torch.rand(4, device=device))
    torch.library.opcheck(torch.ops.llmkernels.attention.default, args, test_utils=("test_schema", "test_faketensor"))


def _attention_block(q, k, v, sinks):
    return lk.attention(q, k, v, causal=True, mask=lk.SlidingWindow(8, 0), score_mod=lk.softcap(30.0), sinks=sinks,
                        return_lse=True)


def test_attention_compile_fullgraph_matches_eager(device):
    q = torch.randn(2, 24, 4, 32, device=device, dtype=torch.bfloat16)
    k, v = (torch.randn(2, 24, 2, 32, device=device, dtype=torch.bfloat16) for _ in range(2))
    sinks = torch.randn(4, device=device)
    eager_out, eager_lse = _attention_block(q, k, v, sinks)
    out, lse = torch.compile(_attention_block, fullgraph=True, backend="aot_eager")(q, k, v, sinks)
    assert torch.equal(out, eager_out) and torch.equal(lse, eager_lse)


def test_attention_compile_fullgraph_with_a_traced_softmax_scale(device):
    q, k = (torch.randn(1, 16, 2, 16, device=device, dtype=torch.float16) for _ in range(2))
    compiled = torch.compile(lambda q, k, scale: lk.attention(q, k, k, causal=True, softmax_scale=scale),
                             fullgraph=True, backend="aot_eager")
    for scale in (0.3, 0.2):
        assert torch.equal(compiled(q, k, scale), lk.attention(q, k, k, causal=True, softmax_scale=scale))
    with pytest.raises(TypeError, match="softmax_scale must be a finite float"):
        compiled(q, k, float("nan"))  # checked when the op runs


def test_moe_combine_opcheck(device):
    y = torch.randn(12, 48, device=device, dtype=torch.bfloat16)
    row_of_copy = torch.randperm(12, device=device).view(4, 3)
    weights = torch.rand(4, 3, device=device)
    torch.library.opcheck(torch.ops.llmkernels.moe_combine.default, (y, row_of_copy, weights, torch.bfloat16))


def test_moe_dispatch_opcheck(device):
    ids = torch.randint(0, 6, (9, 2), device=device, dtype=torch.int32)
    torch.library.opcheck(torch.ops.llmkernels.moe_dispatch.default, (ids, 6))
