"""Grouped MoE matmul on the GPU: llmkernels.grouped_matmul next to torch._grouped_mm (bf16) and
torch._scaled_grouped_mm (fp8 rowwise), same shapes, one run.

    python benchmarks/bench_grouped_matmul.py [--out DIR] [--quick]

Prints a table (µs, TFLOP/s, GB/s, % of the measured ceilings, ratio to each peer) and writes
grouped_matmul.{csv,md,png} to DIR (default benchmarks/results/<gpu>/).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import bar_plot, default_out_dir, measure_ceilings, time_ms, write_table  # noqa: E402

import llmkernels as lk  # noqa: E402

# (experts, tokens per expert, N, K): DeepSeek-V3-like, Qwen-like, decode, gpt-oss-like.
SHAPES = [(8, 2048, 4096, 7168), (128, 128, 4096, 7168), (128, 16, 4096, 7168), (64, 512, 2048, 7168),
          (32, 4, 5760, 2880)]
# (label, a format, b format)
OURS = [("ours bf16", "bf16", "bf16"), ("ours mxfp8", "mxfp8", "mxfp8"), ("ours mxfp4", "mxfp4", "mxfp4"),
        ("ours nvfp4", "nvfp4", "nvfp4"), ("ours bf16 x mxfp4 (w4a16)", "bf16", "mxfp4")]
BYTES_PER_ELEMENT = {"bf16": 2.0, "fp8": 1.0, "mxfp8": 1 + 1 / 32, "mxfp4": 0.5 + 1 / 32, "nvfp4": 0.5 + 1 / 16}
PEERS = (("torch._grouped_mm bf16", "bf16"), ("torch._scaled_grouped_mm fp8", "fp8"))


def _operand(x, fmt):
    return x.to(torch.bfloat16) if fmt == "bf16" else lk.quantize(x, fmt)


def _peer_grouped_mm(x, w, ends):
    a, b = x.to(torch.bfloat16), w.to(torch.bfloat16).transpose(-2, -1)
    return lambda: torch._grouped_mm(a, b, offs=ends, out_dtype=torch.bfloat16)


def _peer_scaled_grouped_mm(x, w, ends):
    a = x.to(torch.float8_e4m3fn)
    b = w.to(torch.float8_e4m3fn).transpose(-2, -1)
    scale_a = torch.ones(x.shape[0], device=x.device)
    scale_b = torch.ones(w.shape[0], w.shape[1], device=x.device)
    return lambda: torch._scaled_grouped_mm(a, b, scale_a, scale_b, offs=ends, out_dtype=torch.bfloat16)


def run(shapes, out_dir):
    ceilings = measure_ceilings()
    print(f"ceilings: copy {ceilings['copy_gbps']:.0f} GB/s, bf16 {ceilings['bf16_tflops']:.0f} TFLOP/s, "
          f"fp8 {ceilings['fp8_tflops']:.0f} TFLOP/s")
    rows, plot_labels, plot_series = [], [], {}
    for num_experts, tokens_per_expert, n, k in shapes:
        tokens = num_experts * tokens_per_expert
        x = torch.randn(tokens, k, device="cuda")
        w = torch.randn(num_experts, n, k, device="cuda") / k**0.5
        offsets = torch.tensor([0] + [tokens_per_expert * (i + 1) for i in range(num_experts)], dtype=torch.int32,
                               device="cuda")
        ids = torch.arange(num_experts, dtype=torch.int32, device="cuda")
        flops = 2.0 * tokens * n * k
        shape_label = f"E{num_experts} t{tokens_per_expert} N{n} K{k}"
        timings = {}
        for (name, fmt), make in zip(PEERS, (_peer_grouped_mm, _peer_scaled_grouped_mm)):
            try:
                timings[name] = (time_ms(make(x, w, offsets[1:])), fmt, fmt)
            except Exception as error:  # noqa: BLE001 - report the peer as failing, keep going
                print(f"{name} fails on {shape_label}: {type(error).__name__}: {str(error)[:120]}")
                timings[name] = (float("nan"), fmt, fmt)
        for label, fa, fb in OURS:
            a, b = _operand(x, fa), _operand(w, fb)
            timings[label] = (time_ms(lambda: lk.grouped_matmul(a, b, offsets, ids)), fa, fb)
        del x, w
        peer_bf16 = timings[PEERS[0][0]][0]
        peer_fp8 = timings[PEERS[1][0]][0]
        for label, (ms, activation_format, weight_format) in timings.items():
            bytes_moved = (tokens * k * BYTES_PER_ELEMENT[activation_format]
                           + num_experts * n * k * BYTES_PER_ELEMENT[weight_format] + tokens * n * 2)
            tflops = flops / ms / 1e9
            gbps = bytes_moved / ms / 1e6
            rows.append({
                "shape": shape_label, "kernel": label, "us": ms * 1e3, "TFLOP/s": tflops, "GB/s": gbps,
                "% bf16 peak": 100 * tflops / ceilings["bf16_tflops"], "% copy BW": 100 * gbps / ceilings["copy_gbps"],
                "vs _grouped_mm": peer_bf16 / ms, "vs _scaled_grouped_mm": peer_fp8 / ms,
            })
            plot_series.setdefault(label, []).append(tflops)
        plot_labels.append(shape_label)
    notes = (f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}. Ceilings measured in this run: "
             f"copy {ceilings['copy_gbps']:.0f} GB/s, bf16 matmul {ceilings['bf16_tflops']:.0f} TFLOP/s, "
             f"fp8 matmul {ceilings['fp8_tflops']:.0f} TFLOP/s. Equal group sizes; times are medians (do_bench). "
             "'vs' columns: peer time / our time (>1: we are faster). GB/s counts A, all of B (with scales), "
             "and the bf16 output once.")
    table = write_table(rows, out_dir, "grouped_matmul", "Grouped MoE matmul", notes)
    bar_plot(plot_labels, plot_series, "TFLOP/s", os.path.join(out_dir, "grouped_matmul.png"),
             f"Grouped matmul, {torch.cuda.get_device_name()}")
    print(table)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--quick", action="store_true", help="two small shapes only")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("this benchmark needs a CUDA GPU")
    shapes = [(8, 256, 1024, 1024), (32, 4, 5760, 2880)] if args.quick else SHAPES
    run(shapes, args.out or default_out_dir())


if __name__ == "__main__":
    main()
