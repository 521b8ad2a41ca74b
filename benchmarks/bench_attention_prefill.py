"""Dense prefill over a grid (16k tokens, S 2k-16k, D 64/128/256, causal and not) against SDPA and FlexAttention.

    python -m benchmarks bench_attention_prefill [--out DIR] [--flex-dims 128]

B·S = 16k tokens with S in {2k, 4k, 8k, 16k}, Hq = Hkv = 16 and GQA 32/8, D in {64, 128, 256}, causal and not;
bf16; llmkernels against SDPA's cuDNN and flash backends (FlexAttention, compiled once per shape, at
the head dims of ``--flex-dims`` only: its compiles dominate the run). Each system is checked against
SDPA flash's output before it is timed, then timed eagerly (events) and as a CUDA-graph replay (not flex).
Writes ``attention_prefill_grid.{csv,md}`` and ``attention_prefill_grid.png`` (TFLOP/s against sequence
length, one panel per head dim and head layout, causal and not) to DIR (default
``benchmarks/results/<gpu>/bench_attention_prefill/``). GPU only.
"""

from __future__ import annotations

import argparse
import os

import torch

from benchmarks import bench_attention  # noqa: E402
from benchmarks.bench_attention import PEERS, bench, bench_graph, run_peer, run_peer_graph  # noqa: E402
from benchmarks.common import default_out_dir, line_plots, measure_ceilings, require_gpu, write_table  # noqa: E402
from benchmarks.peers import sdpa_runner  # noqa: E402
from llmkernels.attention.api import attention  # noqa: E402

TOKENS = 16 * 1024
SEQLENS = (2048, 4096, 8192, 16384)
HEAD_LAYOUTS = ((16, 16), (32, 8))  # (Hq, Hkv)
HEAD_DIMS = (64, 128, 256)


def problem_rows(seqlen: int, heads: int, kv_heads: int, head_dim: int, flex: bool, bf16_tflops: float) -> list:
    batch = TOKENS // seqlen
    q = torch.randn(batch, seqlen, heads, head_dim, dtype=torch.bfloat16, device="cuda")
    k, v = (torch.randn(batch, seqlen, kv_heads, head_dim, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    q_t, k_t, v_t = (x.transpose(1, 2) for x in (q, k, v))
    rows = []
    for causal in (False, True):
        flops = 4 * batch * heads * seqlen * seqlen * head_dim * (0.5 if causal else 1.0)
        expected = sdpa_runner("flash", q_t, k_t, v_t, causal=causal)().float()
        times = {}
        fn = lambda: attention(q, k, v, causal=causal)  # noqa: E731
        error = ((fn().float().transpose(1, 2) - expected).norm() / expected.norm()).item()
        times["llmkernels"] = (bench(fn), "") if error < 5e-2 else (None, f"WRONG (rel. error {error:.1e})")
        for peer in PEERS:
            if peer == "flex" and not flex:
                times[peer] = (None, "not run")
                continue
            times[peer] = run_peer(peer, q_t, k_t, v_t, causal, expected)
        # graph replay (no host launch time, which events count at 2k) of every system that ran, but flex
        graph = {"llmkernels": bench_graph(fn) if times["llmkernels"][0] else None}
        graph.update({name: run_peer_graph(name, q_t, k_t, v_t, causal) if times[name][0] else None for name in PEERS})
        ours_ms = times["llmkernels"][0]
        peer_ms = {name: times[name][0] for name in ("sdpa_cudnn", "sdpa_flash", "flex")}
        for system, (ms, note) in times.items():
            graph_ms = graph[system]
            tflops = flops / (graph_ms or ms) / 1e9 if ms else float("nan")
            rows.append(
                {
                    "seqlen": seqlen,
                    "batch": batch,
                    "heads": f"{heads}/{kv_heads}",
                    "head_dim": head_dim,
                    "causal": causal,
                    "system": system,
                    "ms": ms if ms else float("nan"),
                    "graph_ms": graph_ms if graph_ms else float("nan"),
                    "TFLOP/s": tflops,
                    "% bf16 peak": 100 * tflops / bf16_tflops,
                    **{
                        f"llmk vs {name}": peer / ours_ms if system == "llmkernels" and peer and ours_ms else ""
                        for name, peer in peer_ms.items()
                    },
                    **{
                        f"llmk vs {name} (graph)": graph[name] / graph["llmkernels"]
                        if system == "llmkernels" and graph[name] and graph["llmkernels"]
                        else ""
                        for name in ("sdpa_cudnn", "sdpa_flash")
                    },
                    "note": note,
                }
            )
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--flex-dims", default="128", help="head dims at which FlexAttention runs ('' for none)")
    args = parser.parse_args()
    require_gpu("bench_attention_prefill")
    torch.manual_seed(0)
    bench_attention.TIME_BUDGET_S = float("inf")  # that script's own time budget does not apply here
    ceilings = measure_ceilings()
    flex_dims = {int(d) for d in args.flex_dims.split(",") if d}
    rows = []
    for head_dim in HEAD_DIMS:
        for heads, kv_heads in HEAD_LAYOUTS:
            for seqlen in SEQLENS:
                rows += problem_rows(seqlen, heads, kv_heads, head_dim, head_dim in flex_dims, ceilings["bf16_tflops"])
                print(rows[-8:], flush=True)
    gpu = torch.cuda.get_device_name()
    out_dir = args.out or default_out_dir("bench_attention_prefill")
    header = (
        f"GPU: {gpu}, torch {torch.__version__}; bf16 matmul ceiling measured in this run "
        f"{ceilings['bf16_tflops']:.0f} TFLOP/s. B·S = {TOKENS} tokens; causal counts half the FLOPs. "
        "`llmk vs X`: X's time / ours (> 1: ours faster), median event times (do_bench); `(graph)`: the "
        "same from CUDA-graph replay times (no host launch time), which `TFLOP/s` also uses where there is one."
    )
    print(write_table(rows, out_dir, "attention_prefill_grid", "Prefill attention: the issue-8 grid", header))
    panels = {}
    for row in rows:
        if row["TFLOP/s"] == row["TFLOP/s"]:
            panel = f"D={row['head_dim']} H={row['heads']}{' causal' if row['causal'] else ''}"
            panels.setdefault(panel, {}).setdefault(row["system"], []).append((row["seqlen"], row["TFLOP/s"]))
    line_plots(
        panels,
        "sequence length",
        "TFLOP/s",
        os.path.join(out_dir, "attention_prefill_grid.png"),
        f"Prefill attention, bf16, {gpu}",
    )


if __name__ == "__main__":
    main()
