"""The custom operators: schema and fake implementations (opcheck), and torch.compile(fullgraph=True) of the
public functions (quantize + grouped matmul, attention, dispatch, combine, select_experts), also with
dynamic=True at two sizes (one graph of symbolic shapes), against the eager call's bits."""

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import llmkernels as lk
from llmkernels import ops
from llmkernels.formats import scaled_tensor_parts
from llmkernels.testing import assert_close_relative, random_group_offsets


def _moe_problem(device, num_experts=3, n=64, k=64):
    sizes = [5, 0, 17]
    x = torch.randn(sum(sizes) + 2, k, device=device)
    w = torch.randn(num_experts, n, k, device=device) / k**0.5
    offsets = random_group_offsets(sizes, device=device)
    ids = torch.tensor([2, 0, 1], dtype=torch.int32, device=device)
    scales = torch.rand(num_experts, device=device) + 0.5
    return x, w, offsets, ids, scales, sum(sizes)


@pytest.mark.parametrize(
    "formats", [("bf16", "bf16"), ("mxfp8", "mxfp8"), ("nvfp4", "nvfp4"), ("bf16", "mxfp4")], ids="x".join
)
def test_grouped_matmul_opcheck(formats, device):
    x, w, offsets, ids, scales, _ = _moe_problem(device)
    a = x.to(torch.bfloat16) if formats[0] == "bf16" else lk.quantize(x, formats[0])
    b = w.to(torch.bfloat16) if formats[1] == "bf16" else lk.quantize(w, formats[1])
    b_parts = scaled_tensor_parts(b)
    args = (
        *scaled_tensor_parts(a)[:7],
        *b_parts[:5],
        b_parts[7],
        offsets,
        ids,
        scales,
        "swiglu",
        torch.bfloat16,
        torch.randn(w.shape[:2], device=device),
        1.702,
        7.0,
        1.0,
        True,
    )
    # rows past the groups are left unwritten, so compare only the checks that do not read them
    torch.library.opcheck(
        torch.ops.llmkernels.grouped_matmul.default, args, test_utils=("test_schema", "test_faketensor")
    )


@pytest.mark.parametrize("format", ["mxfp8", "mxfp4", "nvfp4", "nvfp4_given_scale", "fp8_1x128", "fp8_128x128"])
def test_quantize_opcheck(format, device):
    x = torch.randn(6, 64, device=device, dtype=torch.bfloat16)
    args = (x, format, None)
    if format == "nvfp4_given_scale":  # the op's output must not alias it
        args = (x, "nvfp4", torch.tensor(0.01, device=device))
    elif format == "fp8_1x128":  # K = 200: a partial scale block; float32 scales cross as 4 bytes each
        args = (torch.randn(2, 5, 200, device=device), "fp8", None, [1, 128], False)
    elif format == "fp8_128x128":
        args = (torch.randn(2, 130, 200, device=device, dtype=torch.bfloat16), "fp8", None, [128, 128], True)
    torch.library.opcheck(torch.ops.llmkernels.quantize.default, args)


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


def _attention_args(
    q,
    k=None,
    v=None,
    *,
    has_window=False,
    left=-1,
    right=-1,
    chunk=0,
    softcap=0.0,
    slopes=None,
    sinks=None,
    cu_q=None,
    cu_k=None,
    max_q=None,
    max_k=None,
    cache=None,
    num_splits=None,
    return_lse=True,
):
    pages = (cache.k_pages, cache.v_pages, cache.block_table, cache.seqlens) if cache is not None else (None,) * 4
    return (
        q,
        k,
        v,
        has_window,
        left,
        right,
        chunk,
        softcap,
        slopes,
        sinks,
        q.shape[-1] ** -0.5,
        cu_q,
        cu_k,
        max_q,
        max_k,
        *pages,
        num_splits,
        return_lse,
    )


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
        cache = lk.PagedKVCache(
            torch.randn(6, 16, 2, 32, device=device, dtype=dtype),
            torch.randn(6, 16, 2, 32, device=device, dtype=dtype),
            pages,
            torch.tensor([40, 17], dtype=torch.int32, device=device),
        )
        args = _attention_args(q, cache=cache, num_splits=3, slopes=torch.rand(4, device=device))
    torch.library.opcheck(torch.ops.llmkernels.attention.default, args, test_utils=("test_schema", "test_faketensor"))


def _attention_block(q, k, v, sinks):
    return lk.attention(
        q, k, v, causal=True, mask=lk.SlidingWindow(8, 0), score_mod=lk.softcap(30.0), sinks=sinks, return_lse=True
    )


def test_attention_compile_fullgraph_matches_eager(device):
    q = torch.randn(2, 24, 4, 32, device=device, dtype=torch.bfloat16)
    k, v = (torch.randn(2, 24, 2, 32, device=device, dtype=torch.bfloat16) for _ in range(2))
    sinks = torch.randn(4, device=device)
    eager_out, eager_lse = _attention_block(q, k, v, sinks)
    out, lse = torch.compile(_attention_block, fullgraph=True, backend="aot_eager")(q, k, v, sinks)
    assert torch.equal(out, eager_out) and torch.equal(lse, eager_lse)


def test_attention_compile_fullgraph_with_a_traced_softmax_scale(device):
    q, k = (torch.randn(1, 16, 2, 16, device=device, dtype=torch.float16) for _ in range(2))
    compiled = torch.compile(
        lambda q, k, scale: lk.attention(q, k, k, causal=True, softmax_scale=scale), fullgraph=True, backend="aot_eager"
    )
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


def test_moe_select_experts_opcheck(device):
    logits = torch.randn(7, 6, device=device)
    torch.library.opcheck(
        torch.ops.llmkernels.moe_select_experts.default, (logits, 2, "sigmoid", True, torch.rand(6, device=device))
    )


# ------------------------------------------------------------------------------------------------ dynamic=True


def _assert_same_bits(compiled, eager) -> None:
    if isinstance(eager, torch.Tensor):
        assert compiled.dtype == eager.dtype and torch.equal(compiled, eager)
    else:
        assert len(compiled) == len(eager)
        for c, e in zip(compiled, eager):
            _assert_same_bits(c, e)


def _assert_dynamic_compile_matches_eager(fn, inputs_of_size, backend="aot_eager") -> None:
    """``fn`` under torch.compile(fullgraph=True, dynamic=True), called at two sizes, gives eager's bits, and
    the second size compiles nothing (the sizes stay symbolic)."""
    counter = CompileCounterWithBackend(backend)
    compiled = torch.compile(fn, fullgraph=True, dynamic=True, backend=counter)
    graphs = []
    for size in (5, 9):
        inputs = inputs_of_size(size)
        _assert_same_bits(compiled(*inputs), fn(*inputs))
        graphs.append(counter.frame_count)
    assert graphs[0] >= 1 and graphs[1] == graphs[0]


def _grouped_inputs(device, k=64, dtype=torch.float32):
    """inputs_of_size for (x, a_offsets, expert_ids): groups of size, 0 and 2 * size tokens, 2 rows past them."""
    ids = torch.tensor([2, 0, 1], dtype=torch.int32, device=device)

    def inputs_of_size(size):
        x = torch.randn(3 * size + 2, k, device=device, dtype=dtype)
        return x, random_group_offsets([size, 0, 2 * size], device=device), ids

    return inputs_of_size


def test_dynamic_compile_quantize_and_grouped_matmul_default_backend(device):
    """The MoE block's call, through the default backend (inductor)."""
    w = lk.quantize(torch.randn(3, 64, 64, device=device) / 8, "mxfp8")

    def block(x, offsets, ids):  # the rows past the groups are not written: compare the others
        return lk.grouped_matmul(lk.quantize(x, "mxfp8"), w, offsets, ids, epilogue="swiglu")[: x.shape[0] - 2]

    _assert_dynamic_compile_matches_eager(block, _grouped_inputs(device), backend="inductor")


def _swiglu_of_traced_floats(device):
    """A SwiGLU made inside the compiled function of floats it traces (symbolic under dynamic=True; the op
    specializes on their values, a model's constants)."""
    w = lk.quantize(torch.randn(3, 64, 64, device=device) / 8, "mxfp4")
    grouped = _grouped_inputs(device, dtype=torch.bfloat16)

    def block(x, offsets, ids, alpha, limit):
        glu = lk.SwiGLU(alpha, limit, interleaved=True)
        return lk.grouped_matmul(x, w, offsets, ids, epilogue=glu)[: x.shape[0] - 2]

    return block, lambda size: (*grouped(size), 1.702, 7.0)


def _nvfp4_gathered_rows(device):
    """quantize(rows=) of nvfp4: the op takes the global scale the compiled function computed."""
    w = lk.quantize(torch.randn(3, 64, 64, device=device) / 8, "nvfp4")
    grouped = _grouped_inputs(device)

    def block(x, offsets, ids):
        rows = torch.arange(x.shape[0] - 2, device=x.device)
        a = lk.quantize(x, "nvfp4", rows=rows, global_scale=x.abs().amax() / (448 * 6))
        return lk.grouped_matmul(a, w, offsets, ids)

    return block, grouped


def _hopper_layout_weights(device):
    """b in the hopper layout: its alignment is checked by address, which a traced tensor has not."""
    w = lk.quantize(torch.randn(3, 64, 64, device=device) / 8, "mxfp4").to_layout("hopper")

    def block(x, offsets, ids):
        return lk.grouped_matmul(x, w, offsets, ids, epilogue="swiglu")[: x.shape[0] - 2]

    return block, _grouped_inputs(device, dtype=torch.bfloat16)


def _moe_routing(device):
    """select_experts, dispatch and combine: the routing around the expert matmuls."""

    def route(logits, y):
        weights, expert_ids = ops.select_experts(logits, 2)
        token_of_row, offsets, row_of_copy = ops.dispatch(expert_ids, 6)
        return token_of_row, offsets, ops.combine(y[: row_of_copy.numel()], row_of_copy, weights)

    return route, lambda size: (torch.randn(size, 6, device=device), torch.randn(18, 32, device=device))


def _attention_dense_and_paged(device):
    """A causal dense call with sinks and a split-KV paged decode step of symbolic lengths."""

    def layer(q, k, v, sinks, k_pages, v_pages, block_table, seqlens):
        cache = lk.PagedKVCache(k_pages, v_pages, block_table, seqlens)
        return (
            lk.attention(q, k, v, causal=True, sinks=sinks, return_lse=True),
            lk.attention(q[:, -1:], None, None, kv_cache=cache, num_splits=3),
        )

    def inputs_of_size(size):
        rand = lambda *shape: torch.randn(*shape, device=device, dtype=torch.bfloat16)  # noqa: E731
        pages = torch.randperm(2 * size, device=device).to(torch.int32).view(2, size)
        seqlens = torch.tensor([4 * size, 16 * size - 3], dtype=torch.int32, device=device)
        return (
            rand(2, size, 4, 16),
            rand(2, size + 3, 2, 16),
            rand(2, size + 3, 2, 16),
            torch.randn(4, device=device),
            rand(2 * size, 16, 2, 16),
            rand(2 * size, 16, 2, 16),
            pages,
            seqlens,
        )

    return layer, inputs_of_size


def _fp8_blocks(device):
    """fp8: activations quantized (1, 128) with rows= and weights (128, 128) with power-of-two scales inside the
    compiled function (their blocks cross the ops), the grouped matmul of fp8 weights made outside it."""
    w = lk.quantize(torch.randn(3, 64, 200, device=device) / 8, "fp8", block=(128, 128))
    grouped = _grouped_inputs(device, k=200)

    def block(x, offsets, ids):
        rows = torch.arange(x.shape[0] - 2, device=x.device)
        a = lk.quantize(x, "fp8", block=(1, 128), rows=rows)
        weights = lk.quantize(x[:, :130].T, "fp8", block=(128, 128), power_of_two_scales=True)
        out = lk.grouped_matmul(a, w, offsets, ids)
        return a.data.view(torch.uint8), a.scales, weights.data.view(torch.uint8), weights.scales, out

    return block, grouped


@pytest.mark.parametrize(
    "case",
    [
        _swiglu_of_traced_floats,
        _nvfp4_gathered_rows,
        _hopper_layout_weights,
        _moe_routing,
        _attention_dense_and_paged,
        _fp8_blocks,
    ],
    ids=lambda case: case.__name__.strip("_"),
)
def test_dynamic_compile_matches_eager(case, device):
    fn, inputs_of_size = case(device)
    _assert_dynamic_compile_matches_eager(fn, inputs_of_size)
