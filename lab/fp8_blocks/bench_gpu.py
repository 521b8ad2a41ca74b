"""GPU check and benchmark of the FP8-block grouped matmul prototype against PyTorch's peers (H100, one run).

    PYTHONPATH=src python lab/fp8_blocks/bench_gpu.py OUT.md [--shapes NAME,...] [--budget-s 170]

Per shape, first correctness: every config of the sweep against the float64 product of the decoded operands on
a sample of groups (relative Frobenius and max error; bf16 output rounds to nearest, expect ~1.5e-3; a config
over 3e-3 / 1e-2 is reported FAIL and not timed). Then CUDA-graph replay timings (median of event-timed replays
of a graph holding one call: GPU time, no host overhead) of:

* ours, over a small sweep of tile configs (the first is the default of the regime);
* ``torch._scaled_grouped_mm`` fp8 rowwise (unit scales: rowwise is less work than block scales);
* ``torch._grouped_mm`` bf16;
* cuBLAS's dense block-scaled GEMM ``F.scaled_mm(a, w.t(), scale_a, BlockWise1x128, scale_b, BlockWise128x128)``
  on the same total work (all tokens against one expert's weights; its output on group 0 is compared with ours).

A peer that raises is reported 'unavailable' with its error. Prints TFLOP/s, GB/s (each system's own bytes:
operands, scales and output once) and ratios, the copy bandwidth measured in the same run, and for our configs
the compiled kernel's registers, spills, shared memory and wgmma kind. Writes the tables as markdown to OUT.md.
Written for torch 2.11 + Triton 3.6 (the kernel uses no newer API); stops timing new configs once
``--budget-s`` seconds (default 170) have passed: the whole run is meant to take < 4 minutes.
"""
from __future__ import annotations

import argparse
import math
import os
import re
import sys
import time
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
if "--dry-run" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"

import torch
import triton
from kernel import (
    COMPUTE_CONFIG,
    DECODE_CONFIG,
    Fp8BlockConfig,
    fp8_block_grouped_matmul,
    fp8_block_grouped_matmul_kernel,
    plan_launch,
)
from quantize import quantize_fp8_blocks, reference_grouped_matmul, relative_errors

START = time.perf_counter()
DEVICE = "cuda"  # "cpu" under --dry-run
TOLERANCE = (3e-3, 1e-2)  # (Frobenius, max) relative error of a bf16 output, rounded to nearest
DRY_RUN_TOLERANCE = (5e-3, 1e-2)  # the interpreter truncates fp32 -> bf16 (test_proto.py says more)


@dataclass(frozen=True)
class Shape:
    name: str
    experts: int
    tokens_per_expert: int
    n: int
    k: int
    regime: str  # "compute" or "decode": which sweep


SHAPES = [  # the most important first: a run that hits the time budget still times every default
    Shape("E8x2048 N4096 K7168", 8, 2048, 4096, 7168, "compute"),
    Shape("decode E128x16 N4096 K7168", 128, 16, 4096, 7168, "decode"),
    Shape("decode E128x1 N4096 K7168", 128, 1, 4096, 7168, "decode"),
    Shape("DSv3-down E256x256 N7168 K2048", 256, 256, 7168, 2048, "compute"),
    Shape("DSv3-down E16x4096 N7168 K2048", 16, 4096, 7168, 2048, "compute"),
]
SWEEPS = {
    "compute": [
        COMPUTE_CONFIG,  # 128x128 w8 s4: two consumer warp groups of 64 rows, one program per SM
        Fp8BlockConfig(128, 256, 8, 3, split_n=2),  # two 128-row weight sub-tiles: 1/3 less L2 traffic per FLOP
        Fp8BlockConfig(128, 128, 4, 3, split_n=2),  # one warp group, two programs per SM (MMA/promotion interleave)
        Fp8BlockConfig(64, 128, 4, 4),  # one warp group, m64n128, two programs per SM
        Fp8BlockConfig(128, 128, 8, 3),
        Fp8BlockConfig(128, 128, 8, 4, programs_per_sm=1),  # persistent
    ],
    "decode": [
        DECODE_CONFIG,  # 16x128 swap-AB w4 s4: weights on wgmma's M side, three programs per SM
        Fp8BlockConfig(16, 128, 4, 6, swap_ab=True),
        Fp8BlockConfig(16, 64, 4, 6, swap_ab=True),
        Fp8BlockConfig(16, 256, 4, 4, swap_ab=True, split_n=2),
        Fp8BlockConfig(64, 128, 4, 4),  # not swapped: 64-token tiles, mostly padding
    ],
}


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def elapsed() -> float:
    return time.perf_counter() - START


def log(message: str) -> None:
    print(f"[{elapsed():6.1f}s] {message}", flush=True)


def graph_time_us(fn, target_ms: float = 60.0) -> float:
    """Median GPU time (µs) of one replay of a CUDA graph that holds one call of ``fn``."""
    if DEVICE == "cpu":  # --dry-run: one timed call through the interpreter
        begin = time.perf_counter()
        fn()
        return 1e6 * (time.perf_counter() - begin)
    fn()
    sync()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    sync()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    graph.replay()
    end.record()
    sync()
    replays = int(min(max(target_ms / max(begin.elapsed_time(end), 1e-3), 5), 200))
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(replays)]
    for first, last in events:
        first.record()
        graph.replay()
        last.record()
    sync()
    times = sorted(first.elapsed_time(last) for first, last in events)
    del graph
    return 1e3 * times[len(times) // 2]


def copy_bandwidth_gbs() -> float:
    """Device-to-device copy of 1 GiB (read + write bytes per second): the weight-streaming ceiling."""
    source = torch.empty(2**30 if DEVICE == "cuda" else 2**20, dtype=torch.uint8, device=DEVICE)
    target = torch.empty_like(source)
    us = graph_time_us(lambda: target.copy_(source))
    return 2 * source.numel() / us / 1e3


def quantize_weights(w: torch.Tensor, chunk: int = 8):
    """(b, b_scales) of bf16 weights [E, N, K], a few experts at a time (the torch reference's temporaries
    are ~5x the chunk in float32)."""
    parts = [quantize_fp8_blocks(w[e:e + chunk], (128, 128)) for e in range(0, w.shape[0], chunk)]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


class Problem:
    """One shape's operands: bf16 originals (for the bf16 peer), FP8 blocks, metadata and a float64 reference
    on a few groups."""

    def __init__(self, shape: Shape):
        self.shape = shape
        e, t, n, k = shape.experts, shape.experts * shape.tokens_per_expert, shape.n, shape.k
        self.tokens = t
        torch.manual_seed(0)
        self.x = torch.randn(t, k, device=DEVICE, dtype=torch.bfloat16)
        self.w = torch.randn(e, n, k, device=DEVICE, dtype=torch.bfloat16) * k**-0.5
        self.a, self.a_scales = quantize_fp8_blocks(self.x, (1, 128))
        self.b, self.b_scales = quantize_weights(self.w)
        self.offsets = (torch.arange(e + 1, device=DEVICE, dtype=torch.int32) * shape.tokens_per_expert)
        self.ids = torch.arange(e, device=DEVICE, dtype=torch.int32)
        self.out = torch.empty(t, n, device=DEVICE, dtype=torch.bfloat16)
        self.groups = sorted({0, e // 2, e - 1})
        self.reference = reference_grouped_matmul(self.a, self.a_scales, self.b, self.b_scales, self.offsets,
                                                  self.ids, groups=self.groups)
        self.flops = 2.0 * t * n * k

    def bytes(self, a_bytes: float, b_bytes: float, scales: bool) -> float:
        e, t, n, k = self.shape.experts, self.tokens, self.shape.n, self.shape.k
        total = t * k * a_bytes + e * n * k * b_bytes + t * n * 2
        if scales:
            total += 4 * (t * math.ceil(k / 128) + e * math.ceil(n / 128) * math.ceil(k / 128))
        return total


def compiled_report(problem: Problem, config: Fp8BlockConfig) -> str:
    """Registers, spills, shared memory and wgmma kind of the kernel this config compiles to here."""
    grid, arguments, constexprs, options = plan_launch(
        problem.a, problem.a_scales, problem.b, problem.b_scales, problem.offsets, problem.ids, None, problem.out,
        config, torch.cuda.get_device_properties(0).multi_processor_count if DEVICE == "cuda" else 4)
    compiled = fp8_block_grouped_matmul_kernel[grid](**arguments, **constexprs, **options)
    if compiled is None:  # the interpreter
        return "interpreter"
    kinds = sorted(set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+\.\w+\.\w+\.\w+)",
                                  compiled.asm["ptx"])))
    kind = ",".join(kinds) or ("mma.sync" if "mma.sync" in compiled.asm["ptx"] else "none")
    return (f"regs {getattr(compiled, 'n_regs', '?')}, spills {getattr(compiled, 'n_spills', '?')}, "
            f"smem {compiled.metadata.shared}, {kind}")


def ours(problem: Problem, config: Fp8BlockConfig):
    return lambda: fp8_block_grouped_matmul(problem.a, problem.a_scales, problem.b, problem.b_scales,
                                            problem.offsets, problem.ids, out=problem.out, config=config)


def peer_scaled_grouped_mm(problem: Problem):
    scale_a = torch.ones(problem.tokens, device=DEVICE, dtype=torch.float32)
    scale_b = torch.ones(problem.shape.experts, problem.shape.n, device=DEVICE, dtype=torch.float32)
    b_t = problem.b.transpose(-2, -1)
    return lambda: torch._scaled_grouped_mm(problem.a, b_t, scale_a, scale_b, offs=problem.offsets[1:],
                                            out_dtype=torch.bfloat16)


def peer_grouped_mm(problem: Problem):
    w_t = problem.w.transpose(-2, -1)
    return lambda: torch._grouped_mm(problem.x, w_t, offs=problem.offsets[1:], out_dtype=torch.bfloat16)


def peer_dense_blockwise(problem: Problem):
    """cuBLAS block-scaled GEMM on all tokens against expert 0 (same FLOPs); scale_a token-major ([K/128, T]
    transposed), scale_b ``[N/128, K/128]`` transposed. Returns (fn, note) or raises."""
    from torch.nn.functional import ScalingType, scaled_mm
    a, w, w_scales = problem.a, problem.b[0], problem.b_scales[0]
    scale_a = problem.a_scales.t().contiguous().t()
    attempts = [("scale_b [N/128, K/128] transposed", w_scales.t()),
                ("scale_b [K/128, N/128] contiguous", w_scales.t().contiguous())]
    errors = []
    for note, scale_b in attempts:
        def fn(scale_b=scale_b):
            return scaled_mm(a, w.t(), scale_a, ScalingType.BlockWise1x128, scale_b, ScalingType.BlockWise128x128,
                             output_dtype=torch.bfloat16)
        try:
            fn()
            sync()
            return fn, note
        except Exception as error:  # noqa: BLE001 - try the other layout, report both
            errors.append(f"{note}: {type(error).__name__}: {str(error).splitlines()[0][:150]}")
    raise RuntimeError(" | ".join(errors))


def run_shape(shape: Shape, budget_s: float, copy_gbs: float) -> list[str]:
    log(f"{shape.name}: building operands")
    problem = Problem(shape)
    lines = [f"\n## {shape.name} ({shape.regime}; {problem.tokens} tokens, {problem.flops / 1e12:.3f} TFLOP, "
             f"fp8 weights {problem.shape.experts * shape.n * shape.k / 1e9:.2f} GB)\n",
             f"Correctness: float64 reference on groups {problem.groups} (bf16 output).\n",
             "| system | config | compiled (this GPU) | rel. err Frobenius / max | µs | TFLOP/s | GB/s | "
             "% copy BW | vs _grouped_mm bf16 | vs _scaled_grouped_mm fp8 | vs dense cuBLAS blockwise |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    rows = []  # (system, config, compiled, error, us, bytes)

    # peers first (their times are the ratios' denominators)
    peers = {}
    for name, make, nbytes in (
            ("torch._grouped_mm bf16", peer_grouped_mm, problem.bytes(2, 2, False)),
            ("torch._scaled_grouped_mm fp8 rowwise", peer_scaled_grouped_mm, problem.bytes(1, 1, True)),
            ("F.scaled_mm dense 1x128/128x128 (cuBLAS)", peer_dense_blockwise, None)):
        try:
            made = make(problem)
            fn, note = made if isinstance(made, tuple) else (made, "")
            us = graph_time_us(fn)
            if nbytes is None:  # dense: all tokens x one expert's weights
                nbytes = problem.tokens * shape.k + shape.n * shape.k + problem.tokens * shape.n * 2
                dense = fn()
                group = problem.groups[0]
                start, end = int(problem.offsets[group]), int(problem.offsets[group + 1])
                fro, worst = relative_errors(dense[start:end], problem.reference[start:end])
                note = f"{note}; vs f64 ref on group 0: {fro:.2e} / {worst:.2e}"
            peers[name] = us
            rows.append((name, note, "", "", us, nbytes))
            log(f"  {name}: {us:.1f} µs")
        except Exception as error:  # noqa: BLE001 - a failing peer is a result
            rows.append((name, f"unavailable: {type(error).__name__}: {str(error)[:300]}", "", "", float("nan"), 0))
            log(f"  {name}: unavailable ({type(error).__name__}: {str(error)[:200]})")

    for index, config in enumerate(SWEEPS[shape.regime]):
        if index > 0 and elapsed() > budget_s:
            rows.append(("ours", config.label, "", "skipped: time budget", float("nan"), 0))
            continue
        try:
            compiled = compiled_report(problem, config)
            problem.out.fill_(float("nan"))
            ours(problem, config)()
            sync()
            fro, worst = relative_errors(problem.out, problem.reference)
            error = f"{fro:.2e} / {worst:.2e}"
            tolerance = TOLERANCE if DEVICE == "cuda" else DRY_RUN_TOLERANCE
            if not (fro <= tolerance[0] and worst <= tolerance[1]):
                rows.append(("ours", config.label, compiled, f"FAIL {error}", float("nan"), 0))
                log(f"  ours {config.label}: FAIL {error}")
                continue
            us = graph_time_us(ours(problem, config))
            rows.append(("ours", config.label + (" (default)" if index == 0 else ""), compiled, error, us,
                         problem.bytes(1, 1, True)))
            log(f"  ours {config.label}: {us:.1f} µs, error {error}, {compiled}")
        except Exception as error:  # noqa: BLE001 - a failing config is a result
            rows.append(("ours", config.label, "", f"error: {type(error).__name__}: {str(error)[:200]}",
                         float("nan"), 0))
            log(f"  ours {config.label}: {type(error).__name__}: {str(error)[:300]}")

    def ratio(us: float, peer: str) -> str:
        base = peers.get(peer)
        return f"{base / us:.2f}x" if base and not math.isnan(us) else "-"

    for system, config, compiled, error, us, nbytes in rows:
        config, error = config.replace("|", "/"), error.replace("|", "/")  # error texts inside a table row
        timed = not math.isnan(us)
        tflops = f"{problem.flops / us / 1e6:.0f}" if timed else "-"
        gbs = f"{nbytes / us / 1e3:.0f}" if timed and nbytes else "-"
        copy = f"{100 * nbytes / us / 1e3 / copy_gbs:.0f}%" if timed and nbytes else "-"
        lines.append(f"| {system} | {config} | {compiled} | {error} | {us:.1f} | {tflops} | {gbs} | {copy} | "
                     f"{ratio(us, 'torch._grouped_mm bf16')} | {ratio(us, 'torch._scaled_grouped_mm fp8 rowwise')} | "
                     f"{ratio(us, 'F.scaled_mm dense 1x128/128x128 (cuBLAS)')} |")
    del problem
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="markdown file to write")
    parser.add_argument("--shapes", default="", help="comma-separated prefixes of shape names (default: all)")
    parser.add_argument("--budget-s", type=float, default=170.0,
                        help="stop timing new configs (beyond each shape's default) after this many seconds")
    parser.add_argument("--dry-run", action="store_true",
                        help="check the script's logic on the CPU: Triton interpreter, tiny shapes, no graphs")
    args = parser.parse_args()
    if args.dry_run:
        global DEVICE, SHAPES
        DEVICE = "cpu"
        SHAPES = [Shape("dry compute E3x40 N192 K320", 3, 40, 192, 320, "compute"),
                  Shape("dry decode E4x2 N128 K256", 4, 2, 128, 256, "decode")]
        for name in SWEEPS:
            SWEEPS[name] = [Fp8BlockConfig(c.block_m if c.swap_ab else 32, c.block_n, c.num_warps, 2, c.swap_ab,
                                           c.programs_per_sm, c.split_n) for c in SWEEPS[name]]
    elif not torch.cuda.is_available():
        print("needs a CUDA GPU (or --dry-run)")
        return 1
    wanted = [s for s in args.shapes.split(",") if s]
    shapes = [s for s in SHAPES if not wanted or any(s.name.startswith(w) for w in wanted)]
    device = torch.cuda.get_device_name(0) if DEVICE == "cuda" else "CPU dry run (interpreter)"
    copy_gbs = copy_bandwidth_gbs()
    header = [f"# FP8-block grouped matmul prototype (lab/fp8_blocks), {device}",
              f"\ntorch {torch.__version__}, Triton {triton.__version__}, CUDA {torch.version.cuda}; "
              f"copy bandwidth {copy_gbs:.0f} GB/s (same run). CUDA-graph replay, median. GB/s: each system's "
              "operands, scales and bf16 output once; % copy BW against the measured copy. FP8 dense peak (spec) "
              "1979 TFLOP/s."]
    log(f"{device}: copy {copy_gbs:.0f} GB/s")
    lines = list(header)
    for shape in shapes:
        try:
            lines += run_shape(shape, args.budget_s, copy_gbs)
        except torch.OutOfMemoryError as error:
            lines.append(f"\n## {shape.name}\n\nout of memory: {str(error)[:200]}")
            torch.cuda.empty_cache()
        with open(args.out, "w") as file:  # after every shape: a partial run still leaves its tables
            file.write("\n".join(lines) + "\n")
    lines.append(f"\nTotal time {elapsed():.0f} s.")
    with open(args.out, "w") as file:
        file.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
