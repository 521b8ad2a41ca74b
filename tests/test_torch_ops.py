"""The custom operators: schema and fake implementations (opcheck), and torch.compile(fullgraph=True)
of a function that quantizes and calls the grouped matmul, against the eager call."""
import pytest
import torch

import llmkernels as lk
from llmkernels._testing import assert_close_relative, random_group_offsets
from llmkernels.ops import scaled_tensor_parts


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
    args = (*scaled_tensor_parts(a), *scaled_tensor_parts(b)[:5], offsets, ids, scales, "swiglu", torch.bfloat16)
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


@pytest.mark.gpu
def test_compile_cuda_graph(device):
    x, w, offsets, ids, scales, rows = _moe_problem(device, num_experts=8, n=512, k=256)
    w_q = lk.quantize(w, "mxfp4")
    eager = _moe_block(x, w_q, offsets, ids, scales)
    compiled = torch.compile(_moe_block, fullgraph=True, mode="reduce-overhead")
    for _ in range(3):  # warm-up, record, replay
        out = compiled(x, w_q, offsets, ids, scales)
    assert_close_relative(out[:rows].float(), eager[:rows].float(), 1e-6, "compiled + CUDA graph")
