"""Interleaved repeated timings: the product's bf16 Gluon kernel (two m64n128 wgmmas per K step) against the lab's
m64n256 variant and torch._grouped_mm, ROUNDS rounds of the three in turn per shape (CUDA-graph replays), so that
a drift of the GPU's clocks hits all three alike. The verdict is the median over rounds of each ratio.

    PYTHONPATH=src:lab/gluon_bf16 python lab/gluon_bf16/interleaved.py OUT.md [ROUNDS]
"""

from __future__ import annotations

import importlib.util
import os
import statistics
import sys

import torch
from gluon_kernel_wide import bf16_grouped_matmul_gluon as wide_gluon

import llmkernels as lk

SHAPES = {  # name: (experts, tokens per expert, N, K)
    "E8x2048 N4096 K7168": (8, 2048, 4096, 7168),
    "E16x4096 N7168 K2048": (16, 4096, 7168, 2048),
    "E256x256 N7168 K2048": (256, 256, 7168, 2048),
    "E128x128 N4096 K7168": (128, 128, 4096, 7168),
    "gpt-oss E32x512 N5760 K2880": (32, 512, 5760, 2880),
}


def _graph_time_us():
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "fp8_blocks", "bench_gpu.py")
    spec = importlib.util.spec_from_file_location("fp8_blocks_bench_gpu", path)
    module = sys.modules["fp8_blocks_bench_gpu"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.graph_time_us


def main() -> None:
    graph_time_us = _graph_time_us()
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 5
    lines = [
        "# bf16 Gluon kernel: two m64n128 wgmmas (product) vs one m64n256 (lab), interleaved rounds",
        "",
        f"GPU: {torch.cuda.get_device_name()}, {rounds} rounds; µs are medians over rounds, ratios medians of "
        "per-round ratios.",
        "",
        "| shape | _grouped_mm µs | product µs | m64n256 µs | product vs _grouped_mm | m64n256 vs _grouped_mm | "
        "m64n256 / product speed | rounds m64n256 faster |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, (experts, per, n, k) in SHAPES.items():
        tokens = experts * per
        torch.manual_seed(0)
        a = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(experts, n, k, device="cuda", dtype=torch.bfloat16) * k**-0.5
        offsets = torch.arange(0, tokens + 1, per, device="cuda", dtype=torch.int32)
        ids = torch.arange(experts, device="cuda", dtype=torch.int32)
        out = torch.empty(tokens, n, device="cuda", dtype=torch.bfloat16)
        b_t = b.transpose(-2, -1)
        peer = torch._grouped_mm(a, b_t, offs=offsets[1:], out_dtype=torch.bfloat16).float()
        wide_gluon(a, b, offsets, ids, out, 4, False)
        product = lk.grouped_matmul(a, b, offsets, ids)
        errors = [((x.float() - peer).norm() / peer.norm()).item() for x in (out, product)]
        systems = {
            "peer": lambda: torch._grouped_mm(a, b_t, offs=offsets[1:], out_dtype=torch.bfloat16),
            "product": lambda: lk.grouped_matmul(a, b, offsets, ids),
            "wide": lambda: wide_gluon(a, b, offsets, ids, out, 4, False),
        }
        times = {label: [] for label in systems}
        for _ in range(rounds):
            for label, fn in systems.items():
                times[label].append(graph_time_us(fn))
        med = {label: statistics.median(t) for label, t in times.items()}
        vs_peer = {
            label: statistics.median(p / t for p, t in zip(times["peer"], times[label]))
            for label in ("product", "wide")
        }
        speed = statistics.median(p / w for p, w in zip(times["product"], times["wide"]))
        wins = sum(w < p for p, w in zip(times["product"], times["wide"]))
        line = (
            f"| {name} | {med['peer']:.1f} | {med['product']:.1f} | {med['wide']:.1f} | {vs_peer['product']:.3f} | "
            f"{vs_peer['wide']:.3f} | {speed:.3f} | {wins}/{rounds} |"
        )
        if max(errors) > 1e-2:
            line += f" ERROR {errors}"
        print(line, flush=True)
        lines.append(line)
    with open(sys.argv[1], "w") as handle:
        handle.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
