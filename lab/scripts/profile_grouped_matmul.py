"""One grouped-matmul problem, warmed up and then run a few times: the target for a profiler.

    ncu --clock-control none --set full -k regex:grouped_matmul -s 2 -c 1 \\
        python -m benchmarks profile_grouped_matmul --pair mxfp8,mxfp8 --shape 128,16,4096,7168
    (``--layout hopper``: MXFP4 or NVFP4 weights in the Hopper layout, kernel regex ``hopper_fp4``)

Prints the median time; ``--config`` takes BlockScaledMatmulConfig fields as ``block_m=16,ab_swapped=1``.
"""
from __future__ import annotations

import argparse
import dataclasses

import torch

from benchmarks.common import time_ms  # noqa: E402

import llmkernels as lk  # noqa: E402
from llmkernels.grouped_matmul import default_config  # noqa: E402

ELEMENT = {"bf16": "bf16", "mxfp8": "e4m3", "mxfp4": "e2m1", "nvfp4": "e2m1"}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pair", default="mxfp8,mxfp8", help="activation,weight formats")
    parser.add_argument("--shape", default="128,16,4096,7168", help="experts,tokens per expert,N,K")
    parser.add_argument("--config", default="", help="BlockScaledMatmulConfig overrides, e.g. block_n=64,num_warps=8")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--layout", default="row", choices=("row", "hopper"), help="the weights' layout")
    args = parser.parse_args()
    fa, fb = args.pair.split(",")
    num_experts, tokens_per_expert, n, k = (int(v) for v in args.shape.split(","))
    x = torch.randn(num_experts * tokens_per_expert, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(num_experts, n, k, device="cuda", dtype=torch.bfloat16) * k**-0.5
    a = x if fa == "bf16" else lk.quantize(x, fa)
    b = w if fb == "bf16" else lk.quantize(w, fb)
    if args.layout == "hopper":
        b = b.to_layout("hopper")
    offsets = torch.arange(num_experts + 1, dtype=torch.int32, device="cuda") * tokens_per_expert
    ids = torch.arange(num_experts, dtype=torch.int32, device="cuda")
    config = None
    if args.config:
        overrides = {key: int(value) if value.lstrip("-").isdigit() else value
                     for key, value in (item.split("=") for item in args.config.split(","))}
        base = default_config(x.shape[0], num_experts, n, k, x.device, ELEMENT[fa], ELEMENT[fb])
        config = dataclasses.replace(base, **overrides)
    for _ in range(args.runs):
        lk.grouped_matmul(a, b, offsets, ids, config=config)
    torch.cuda.synchronize()
    ms = time_ms(lambda: lk.grouped_matmul(a, b, offsets, ids, config=config))
    weight_bytes = b.data.numel() * b.data.element_size() + (b.scales.numel() if fb != "bf16" else 0)
    print(f"{args.pair} {args.shape} {config}: {ms * 1e3:.0f} us, weights {weight_bytes / ms / 1e6:.0f} GB/s")


if __name__ == "__main__":
    main()
