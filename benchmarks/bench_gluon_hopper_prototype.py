"""The Gluon Hopper attention prototype (issue 23's starting point) next to the Triton-language kernel and
SDPA's cuDNN backend, one run, on the prefill grid of issue 23.

    python -m benchmarks bench_gluon_hopper_prototype [--out DIR]

bf16, B·S = 16k tokens, 16 heads, D 64 and 128, causal and not. Each system's output is checked against
cuDNN's first (relative error). Writes gluon_hopper_prototype.{csv,md,png} to DIR.
"""
from __future__ import annotations

import argparse

import torch

from benchmarks.common import bar_plot, default_out_dir, time_ms, write_table
from benchmarks.peers import sdpa_runner

import llmkernels as lk
from llmkernels.attention.gluon_hopper import gluon_attention

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
                       "gluon_prototype": lambda: gluon_attention(q, k, v, causal=causal)}
            times = {}
            for name, run in systems.items():
                out = run()
                out = out.transpose(1, 2) if name == "sdpa_cudnn" else out
                error = ((out.float() - expected).norm() / expected.norm()).item()
                times[name] = time_ms(run)
                rows.append(dict(batch=batch, seqlen=seqlen, heads=heads, head_dim=dim, causal=causal, system=name,
                                 ms=times[name], tflops=flops / times[name] / 1e9, rel_err_vs_cudnn=error))
            for row in rows[-3:]:
                row["vs_cudnn"] = times["sdpa_cudnn"] / row["ms"]
                print(f"  {batch}x{heads}x{seqlen}x{dim} {'causal' if causal else 'full  '} {row['system']:16s}"
                      f" {row['tflops']:6.0f} TFLOP/s  {row['vs_cudnn']:.2f}x cuDNN  err {row['rel_err_vs_cudnn']:.1e}")
    print(write_table(rows, args.out, "gluon_hopper_prototype", "Gluon Hopper attention prototype",
                      f"{torch.cuda.get_device_name()}, torch {torch.__version__}; median CUDA-event times."))
    series = {}
    for r in rows:
        series.setdefault(r["system"], []).append(r["tflops"])
    labels = [f"{r['batch']}x{r['seqlen']} D{r['head_dim']} {'causal' if r['causal'] else 'full'}"
              for r in rows if r["system"] == "sdpa_cudnn"]
    bar_plot(labels, series, "TFLOP/s", f"{args.out}/gluon_hopper_prototype.png", "Gluon Hopper prototype")


if __name__ == "__main__":
    main()
