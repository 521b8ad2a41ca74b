"""Hopper's warp-specialized Gluon prefill against SDPA cuDNN and the portable Triton kernel (sm_90 GPUs only).

    python -m benchmarks bench_gluon_hopper [--out DIR]

One run, CUDA-graph replay times (GPU time, no host overhead). bf16, B·S = 16k tokens, 16 heads (8 at D = 256),
D 64, 128 and 256, causal and not. Systems: ``sdpa_cudnn``;
``portable_triton`` (``lk.attention`` with the default config but ``warp_specialized=False``: the Triton kernel);
``lk_attention`` (the public call: the Gluon kernel on an H100); at D = 64 ``gluon_2_consumers`` and
``gluon_3_consumers`` (the kernel with that many consumer warpgroups per block). Each output is checked against
cuDNN's first (relative error). Writes gluon_hopper.{csv,md,png} to DIR (default
``benchmarks/results/<gpu>/bench_gluon_hopper/``).
"""

from __future__ import annotations

import argparse

import torch

import llmkernels as lk
from benchmarks.common import bar_plot, default_out_dir, graph_time_ms, require_gpu, write_table
from benchmarks.peers import sdpa_runner
from llmkernels.attention.config import default_config
from llmkernels.attention.gluon_hopper import gluon_attention

SHAPES = [(8, 2048, 16, 64), (4, 4096, 16, 64), (4, 4096, 16, 128), (2, 8192, 16, 128), (4, 4096, 8, 256)]


def systems_of(q, k, v, causal):
    dim, heads = q.shape[-1], q.shape[2]
    portable = default_config(dim, q.dtype, q.device, num_q_heads=heads, num_kv_heads=k.shape[2]).replace(
        warp_specialized=False
    )
    cudnn = sdpa_runner("cudnn", *(t.transpose(1, 2) for t in (q, k, v)), causal=causal)
    systems = {
        "sdpa_cudnn": lambda: cudnn().transpose(1, 2),
        "portable_triton": lambda: lk.attention(q, k, v, causal=causal, config=portable),
        "lk_attention": lambda: lk.attention(q, k, v, causal=causal),
    }
    if dim == 64:  # the default runs two or three consumer warpgroups there (attention.config.gluon_prefill_consumers)
        systems["gluon_2_consumers"] = lambda: gluon_attention(q, k, v, causal=causal, consumers=2)
        systems["gluon_3_consumers"] = lambda: gluon_attention(q, k, v, causal=causal, consumers=3)
    return systems


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=default_out_dir("bench_gluon_hopper"))
    args = parser.parse_args(argv)
    require_gpu("bench_gluon_hopper", "an NVIDIA Hopper GPU (sm_90)", hopper=True)
    rows = []
    for batch, seqlen, heads, dim in SHAPES:
        for causal in (False, True):
            q, k, v = (torch.randn(batch, seqlen, heads, dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            flops = 4 * batch * heads * seqlen * seqlen * dim * (0.5 if causal else 1.0)
            systems = systems_of(q, k, v, causal)
            expected = systems["sdpa_cudnn"]().float()
            times = {}
            for name, run in systems.items():
                error = ((run().float() - expected).norm() / expected.norm()).item()
                times[name] = graph_time_ms(run)
                rows.append(
                    dict(
                        batch=batch,
                        seqlen=seqlen,
                        heads=heads,
                        head_dim=dim,
                        causal=causal,
                        system=name,
                        ms=times[name],
                        tflops=flops / times[name] / 1e9,
                        rel_err_vs_cudnn=error,
                    )
                )
            for row in rows[-len(systems) :]:
                row["vs_cudnn"] = times["sdpa_cudnn"] / row["ms"]
                print(
                    f"  {batch}x{heads}x{seqlen}x{dim} {'causal' if causal else 'full  '} {row['system']:18s}"
                    f" {row['tflops']:6.0f} TFLOP/s  {row['vs_cudnn']:.2f}x cuDNN  err {row['rel_err_vs_cudnn']:.1e}"
                )
    print(
        write_table(
            rows,
            args.out,
            "gluon_hopper",
            "Gluon Hopper attention against cuDNN",
            f"{torch.cuda.get_device_name()}, torch {torch.__version__}; median CUDA-graph replay times.",
        )
    )

    def label(r):
        return f"{r['batch']}x{r['seqlen']} D{r['head_dim']} {'causal' if r['causal'] else 'full'}"

    labels = [label(r) for r in rows if r["system"] == "sdpa_cudnn"]
    tflops = {(r["system"], label(r)): r["tflops"] for r in rows}
    names = dict.fromkeys(r["system"] for r in rows)
    series = {name: [tflops.get((name, point), 0.0) for point in labels] for name in names}
    bar_plot(labels, series, "TFLOP/s", f"{args.out}/gluon_hopper.png", "Gluon Hopper attention (graph replay)")


if __name__ == "__main__":
    main()
