"""Where the eager (not graph-captured) time of one MoE block call goes, per stage and per Python function.

    PYTHONPATH=src:. python lab/scripts/profile_moe_eager.py OUT_DIR [--tokens 1] [--formats bf16,mxfp8,fp8]

For the Qwen3-30B-A3B layer of ``bench_moe_layer``: each stage of ``profile_moe_layer.stages`` timed eagerly (mean
of 200 back-to-back calls between two synchronizations: host-bound stages show their host time) beside its
CUDA-graph replay time, then a cProfile listing (by own time) of 200 whole-block calls. Writes
``OUT_DIR/moe_eager_<format>.txt``.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import time

import torch

from benchmarks.bench_moe_layer import MODELS
from benchmarks.common import graph_time_ms
from lab.scripts.profile_moe_layer import stages
from llmkernels.moe import MoEFeedForward


def eager_us(call, calls: int = 200) -> float:
    for _ in range(10):
        call()
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(calls):
        call()
    torch.cuda.synchronize()
    return (time.perf_counter() - started) / calls * 1e6


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--tokens", type=int, default=1)
    parser.add_argument("--formats", default="bf16,mxfp8,fp8")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    torch.manual_seed(0)
    experts, hidden, intermediate, top_k, routing = MODELS["Qwen3-30B-A3B"]
    router = torch.randn(experts, hidden, device="cuda", dtype=torch.bfloat16) * hidden**-0.5
    w_gate_up = torch.randn(experts, 2 * intermediate, hidden, device="cuda", dtype=torch.bfloat16) * hidden**-0.5
    w_down = torch.randn(experts, hidden, intermediate, device="cuda", dtype=torch.bfloat16) * intermediate**-0.5
    x = torch.randn(args.tokens, hidden, device="cuda", dtype=torch.bfloat16)
    for weight_format in args.formats.split(","):
        block = MoEFeedForward.from_float(router, w_gate_up, w_down, top_k, weight_format=weight_format, **routing)
        report = [f"# {weight_format}, {args.tokens} tokens: eager us (host-bound where above graph) / graph us"]
        with torch.inference_mode():
            for name, call in stages(block, x).items():
                try:
                    graph = graph_time_ms(call) * 1e3
                except Exception as error:  # noqa: BLE001 - a stage that cannot be captured is reported
                    graph = float("nan")
                    report.append(f"  ({name}: no graph: {type(error).__name__})")
                report.append(f"{name:40s} eager {eager_us(call):8.1f}  graph {graph:8.1f}")
            profile = cProfile.Profile()
            profile.enable()
            for _ in range(200):
                block(x)
            profile.disable()
            torch.cuda.synchronize()
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(35)
        report.append(text.getvalue())
        body = "\n".join(report)
        print(body, flush=True)
        with open(os.path.join(args.out, f"moe_eager_{weight_format}.txt"), "w") as handle:
            handle.write(body)


if __name__ == "__main__":
    main()
