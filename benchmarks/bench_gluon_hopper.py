"""The Gluon Hopper attention kernels (issue 23) next to the Triton-language kernel and SDPA's cuDNN backend,
one run, on the prefill grid of issue 23: the single-warpgroup prototype and the warp-specialized kernel with its
schedule's switches (ping-pong off, 3 stages).

    python -m benchmarks bench_gluon_hopper [--out DIR]

bf16, B·S = 16k tokens, 16 heads, D 64 and 128, causal and not. Each system's output is checked against
cuDNN's first (relative error). Writes gluon_hopper.{csv,md,png} to DIR.
"""
from __future__ import annotations

import argparse

import torch

from benchmarks.common import bar_plot, default_out_dir, time_ms, write_table
from benchmarks.peers import sdpa_runner

import llmkernels as lk
from llmkernels.attention.gluon_hopper import gluon_attention
from llmkernels.attention.gluon_hopper_ws import gluon_attention_ws

SHAPES = [(8, 2048, 16, 64), (4, 4096, 16, 64), (4, 4096, 16, 128), (2, 8192, 16, 128)]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=default_out_dir())
    args = parser.parse_args(argv)
    rows = []
    for batch, seqlen, heads, dim in SHAPES:
        for causal in (False, True):
            q, k, v = (torch.randn(batch, seqlen, heads, dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            flops = 4 * batch * heads * seqlen * seqlen * dim * (0.5 if causal else 1.0)
            cudnn = sdpa_runner("cudnn", *(t.transpose(1, 2) for t in (q, k, v)), causal=causal)
            expected = cudnn().transpose(1, 2).float()
            systems = {"sdpa_cudnn": lambda: cudnn(),
                       "ours_triton": lambda: lk.attention(q, k, v, causal=causal),
                       "gluon_prototype": lambda: gluon_attention(q, k, v, causal=causal),
                       "gluon_ws": lambda: gluon_attention_ws(q, k, v, causal=causal),
                       "gluon_ws_no_pingpong": lambda: gluon_attention_ws(q, k, v, causal=causal, pingpong=False),
                       "gluon_ws_3_stages": lambda: gluon_attention_ws(q, k, v, causal=causal, stages=3)}
            if dim > 64:  # three stages of 128-key K and V tiles and Q exceed the 227 KiB of shared memory
                del systems["gluon_ws_3_stages"]
            times = {}
            for name, run in systems.items():
                out = run()
                out = out.transpose(1, 2) if name == "sdpa_cudnn" else out
                error = ((out.float() - expected).norm() / expected.norm()).item()
                times[name] = time_ms(run)
                rows.append(dict(batch=batch, seqlen=seqlen, heads=heads, head_dim=dim, causal=causal, system=name,
                                 ms=times[name], tflops=flops / times[name] / 1e9, rel_err_vs_cudnn=error))
            for row in rows[-len(systems):]:
                row["vs_cudnn"] = times["sdpa_cudnn"] / row["ms"]
                print(f"  {batch}x{heads}x{seqlen}x{dim} {'causal' if causal else 'full  '} {row['system']:22s}"
                      f" {row['tflops']:6.0f} TFLOP/s  {row['vs_cudnn']:.2f}x cuDNN  err {row['rel_err_vs_cudnn']:.1e}")
    print(write_table(rows, args.out, "gluon_hopper", "Gluon Hopper attention kernels",
                      f"{torch.cuda.get_device_name()}, torch {torch.__version__}; median CUDA-event times."))
    def label(r):
        return f"{r['batch']}x{r['seqlen']} D{r['head_dim']} {'causal' if r['causal'] else 'full'}"
    labels = [label(r) for r in rows if r["system"] == "sdpa_cudnn"]
    tflops = {(r["system"], label(r)): r["tflops"] for r in rows}
    systems = dict.fromkeys(r["system"] for r in rows)
    series = {name: [tflops.get((name, point), 0.0) for point in labels] for name in systems}
    bar_plot(labels, series, "TFLOP/s", f"{args.out}/gluon_hopper.png", "Gluon Hopper attention")


if __name__ == "__main__":
    main()
