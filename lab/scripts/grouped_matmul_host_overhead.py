"""The Python host time of eager grouped_matmul and quantize calls on the CPU, with every kernel launch stubbed out.

    TRITON_INTERPRET=1 PYTHONPATH=src python lab/scripts/grouped_matmul_host_overhead.py [--calls 2000] [--profile]

The method of ``attention_host_overhead.py``: ``BoundKernel.__call__`` and Triton's ``JITFunction.run`` /
interpreter ``run`` are no-ops, so what remains is the plan lookup, the per-call checks, output allocation and the
argument lists handed to the (stubbed) bound launches; Triton's launcher is ``benchmarks/bench_host_overhead.py``'s
to measure on a GPU. Problems: ``bench_host_overhead``'s grouped_matmul bf16 and mxfp8 (pre-quantized a and b; 8
experts of 2 tokens, N = K = 256), quantize mxfp8 of its ``[16, 256]`` bf16 x, and MoEFeedForward mxfp8 at one token
on a reduced layer (H 256, I 128, 16 experts, top 8: the bench's Qwen3 layer would take minutes to quantize through
the interpreter; the per-call host work does not depend on those sizes except through the default launches).
Prints the process's CPU µs per call (best of 5 passes by default; CPU time, so other processes on a shared machine count
less) and with ``--profile`` a cProfile listing of each call (the top functions by own time).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import time

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

import llmkernels as lk  # noqa: E402
from llmkernels import launch  # noqa: E402
from llmkernels.moe import MoEFeedForward  # noqa: E402


def _no_launch(*args, **kwargs):
    return None


def _stub_launches() -> None:
    for owner, name in ((JITFunction, "run"), (InterpretedFunction, "run"), (launch.BoundKernel, "__call__")):
        setattr(owner, name, _no_launch)


def _per_call_us(call, calls: int, passes: int = 5) -> float:
    times = []
    for _ in range(passes):
        started = time.process_time()
        for _ in range(calls):
            call()
        times.append((time.process_time() - started) / calls * 1e6)
    return min(times)


def _problems():
    bf16 = dict(dtype=torch.bfloat16)
    experts, rows, n, k = 8, 2, 256, 256
    x, w = torch.randn(experts * rows, k, **bf16), torch.randn(experts, n, k, **bf16)
    offsets = torch.arange(0, experts * rows + 1, rows, dtype=torch.int32)
    ids = torch.arange(experts, dtype=torch.int32)
    w_q, x_q = lk.quantize(w, "mxfp8"), lk.quantize(x, "mxfp8")

    hidden, intermediate, num_experts = 256, 128, 16
    weights = (
        torch.randn(num_experts, hidden) / 16,
        torch.randn(num_experts, 2 * intermediate, hidden) / 16,
        torch.randn(num_experts, hidden, intermediate) / 11,
    )
    block = MoEFeedForward.from_float(*weights, 8, weight_format="mxfp8")
    token = torch.randn(1, hidden, **bf16)
    return [
        ("grouped_matmul bf16", lambda: lk.grouped_matmul(x, w, offsets, ids)),
        ("grouped_matmul mxfp8", lambda: lk.grouped_matmul(x_q, w_q, offsets, ids)),
        ("quantize mxfp8", lambda: lk.quantize(x, "mxfp8")),
        ("MoEFeedForward mxfp8, 1 token (H256 E16)", lambda: block(token)),
    ]


def _profile(call, calls: int, top: int) -> str:
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(calls):
        call()
    profile.disable()
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(top)
    lines = text.getvalue().splitlines()
    start = next(i for i, line in enumerate(lines) if "ncalls" in line)
    return "\n".join(lines[start - 2 : start + top + 1])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--passes", type=int, default=5, help="timed passes of --calls calls; the best is printed")
    parser.add_argument("--profile", action="store_true", help="also print a cProfile listing of each call")
    parser.add_argument("--top", type=int, default=25, help="functions per cProfile listing")
    args = parser.parse_args(argv)
    _stub_launches()
    torch.manual_seed(0)
    with torch.inference_mode():
        problems = _problems()
        for name, call in problems:
            call()
            print(f"{name:45s} {_per_call_us(call, args.calls, args.passes):8.1f} us/call", flush=True)
        if args.profile:
            for name, call in problems:
                print(f"\n== {name}: cProfile of {args.calls} calls, by own time", flush=True)
                print(_profile(call, args.calls, args.top), flush=True)


if __name__ == "__main__":
    main()
