"""The warp-specialized Gluon grouped matmul on Hopper (``fp8_hopper`` on FP8 blocks, ``bf16_hopper`` on plain
bf16 / fp16 operands), which the default launches pick for groups of more than 64 rows on an sm_90 GPU: against
``grouped_matmul_reference`` (float64 products of the operands as the call quantizes them), with NaN-poisoned
outputs (an unwritten row fails; rows past ``a_offsets[G]`` must stay NaN) and expert -1 groups as exact zeros.

GPU only (Gluon has no interpreter; on the CPU the binding of these backends is tested in test_compile_targets).
Bounds: bf16 / fp16 output 1e-2 (the output's rounding, ~2e-3 measured); float32 output 1e-4 for bf16 operands
(fp32 accumulation of exact products) and 3e-3 for FP8 blocks (the fp8 wgmma's reduced-precision accumulation
within each 128-wide K block).
"""

import pytest
import torch

import llmkernels as lk
from llmkernels.formats import quantize_reference
from llmkernels.grouped_matmul import SwiGLU
from llmkernels.grouped_matmul.backends import backend_for
from llmkernels.grouped_matmul.check import check_grouped_matmul
from llmkernels.grouped_matmul.plan import launch_configs
from llmkernels.runtime import cuda_capability, interpreting
from llmkernels.testing import assert_close_relative, poison, random_group_offsets

pytestmark = pytest.mark.skipif(
    interpreting() or not torch.cuda.is_available() or (cuda_capability(torch.device("cuda")) or (0, 0))[0] != 9,
    reason="the warp-specialized Gluon kernels run on sm_90 GPUs only",
)

# groups larger and smaller than a 128-row tile, an empty one, a 1-row one, an expert -1 one, ids in any order
SIZES, IDS, EXPERTS = [130, 0, 300, 1, 77, 200], [2, 0, 1, -1, 2, 0], 3
TRAILING = 5


def _problem(n, k, fmt, dtype=torch.bfloat16):
    torch.manual_seed(0)
    tokens = sum(SIZES) + TRAILING
    x = torch.randn(tokens, k, device="cuda")
    w = torch.randn(EXPERTS, n, k, device="cuda") / k**0.5
    offsets = random_group_offsets(SIZES, device="cuda")
    ids = torch.tensor(IDS, dtype=torch.int32, device="cuda")
    if fmt == "fp8":
        return (
            quantize_reference(x, "fp8", block=(1, 128)),
            quantize_reference(w, "fp8", block=(128, 128)),
            offsets,
            ids,
        )
    return x.to(dtype), w.to(dtype), offsets, ids


def _backends(a, b, offsets, ids, epilogue, out_dtype):
    call = check_grouped_matmul(a, b, offsets, ids, None, epilogue, out_dtype, None, None)
    return {backend_for(call, config).__name__.rsplit(".", 1)[-1] for config, _, _ in launch_configs(call, None)}


def _check(out, a, b, offsets, ids, tolerance, **kwargs):
    rows = sum(SIZES)
    expected = lk.grouped_matmul_reference(a, b, offsets, ids, **kwargs)
    assert_close_relative(out[:rows].float(), expected[:rows], tolerance, "warp-specialized grouped_matmul")
    assert out[rows:].isnan().all(), "rows past a_offsets[G] were written"
    starts = offsets.tolist()
    for group, expert in enumerate(IDS):
        if expert < 0:
            assert (out[starts[group] : starts[group + 1]] == 0).all(), "a group of expert -1 is not zeros"


CASES = {  # name: (format, operand dtype, N, K, epilogue, out dtype, expert scales and bias)
    "bf16-plain-K320": ("bf16", torch.bfloat16, 384, 320, None, torch.bfloat16, False),
    "bf16-fp32out-bias-scales-K264": ("bf16", torch.bfloat16, 320, 264, None, torch.float32, True),
    "fp16-silu": ("bf16", torch.float16, 256, 256, "silu", torch.float16, False),
    "bf16-gelu-bias": ("bf16", torch.bfloat16, 256, 192, "gelu", torch.bfloat16, True),
    "bf16-swiglu-gptoss": ("bf16", torch.bfloat16, 512, 320, SwiGLU(1.702, 7.0, 1.0), torch.bfloat16, True),
    "fp8-plain-K320": ("fp8", None, 384, 320, None, torch.bfloat16, True),
    "fp8-swiglu": ("fp8", None, 512, 256, "swiglu", torch.float32, False),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_default_launches_of_large_groups(case):
    fmt, dtype, n, k, epilogue, out_dtype, extras = CASES[case]
    a, b, offsets, ids = _problem(n, k, fmt, dtype or torch.bfloat16)
    wanted = "fp8_hopper" if fmt == "fp8" else "bf16_hopper"
    assert wanted in _backends(a, b, offsets, ids, epilogue, out_dtype)
    kwargs = {}
    if extras:
        kwargs = dict(
            expert_scales=torch.rand(EXPERTS, device="cuda") + 0.5,
            bias=torch.randn(EXPERTS, n, device="cuda", dtype=torch.bfloat16),
        )
    n_out = n // 2 if epilogue is not None and not isinstance(epilogue, str) or epilogue == "swiglu" else n
    out = poison(torch.empty(a.shape[0], n_out, dtype=out_dtype, device="cuda"))
    result = lk.grouped_matmul(a, b, offsets, ids, epilogue=epilogue, out_dtype=out_dtype, out=out, **kwargs)
    assert result is out
    tolerance = 1e-2 if out_dtype != torch.float32 else 3e-3 if fmt == "fp8" else 1e-4
    _check(out, a, b, offsets, ids, tolerance, epilogue=epilogue, **kwargs)


def test_views_a_strided_and_unaligned_b_spaced_out_offset():
    """A with padded rows (TMA reads it in place) and with rows 2 bytes off 16-byte alignment (copied per call), B
    whose experts are not back to back (copied), out as a column slice: the bits of the contiguous call."""
    a, b, offsets, ids = _problem(256, 320, "bf16")
    expected = lk.grouped_matmul(a, b, offsets, ids)
    padded = torch.zeros(a.shape[0], 384, dtype=a.dtype, device="cuda")[:, :320]
    padded.copy_(a)
    unaligned = torch.zeros(a.shape[0], 321, dtype=a.dtype, device="cuda")[:, 1:]
    unaligned.copy_(a)
    spaced = torch.zeros(EXPERTS, 272, 320, dtype=b.dtype, device="cuda")[:, :256]
    spaced.copy_(b)
    for a_view, b_view in ((padded, b), (unaligned, b), (a, spaced)):
        assert torch.equal(lk.grouped_matmul(a_view, b_view, offsets, ids)[: sum(SIZES)], expected[: sum(SIZES)])
    wide = poison(torch.empty(a.shape[0], 300, dtype=torch.bfloat16, device="cuda"))
    lk.grouped_matmul(a, b, offsets, ids, out=wide[:, 40:296])
    assert torch.equal(wide[: sum(SIZES), 40:296], expected[: sum(SIZES)])
    assert wide[:, :40].isnan().all() and wide[:, 296:].isnan().all()


def test_tile_counters_across_launches_streams_and_graph_replay():
    """Work tiles past the first grid come from a zeroed counter per launch: 300 launches in a row (the per-stream
    counters are zeroed again after 256), launches on two streams, and a captured launch replayed twice (its own
    counter, zeroed by the graph) all give the bits of the first call."""
    a, b, offsets, ids = _problem(8192, 320, "bf16")  # 9 m-tiles x 32 n-tiles: 288 tiles, over twice the grid
    expected = lk.grouped_matmul(a, b, offsets, ids)
    for _ in range(300):
        out = lk.grouped_matmul(a, b, offsets, ids)
    assert torch.equal(out[: sum(SIZES)], expected[: sum(SIZES)])
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        beside = [lk.grouped_matmul(a, b, offsets, ids) for _ in range(3)]
    here = lk.grouped_matmul(a, b, offsets, ids)
    torch.cuda.current_stream().wait_stream(side)
    for result in (*beside, here):
        assert torch.equal(result[: sum(SIZES)], expected[: sum(SIZES)])
    graph_out = poison(torch.empty_like(expected))
    lk.grouped_matmul(a, b, offsets, ids, out=graph_out)  # planned before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        lk.grouped_matmul(a, b, offsets, ids, out=graph_out)
    for _ in range(2):
        graph_out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(graph_out[: sum(SIZES)], expected[: sum(SIZES)])
