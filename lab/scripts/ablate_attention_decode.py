"""Paged-decode configs of llmkernels.attention on this GPU, under CUDA-graph replay, next to SDPA cuDNN.

    python -m benchmarks ablate_attention_decode [--out DIR] [--budget SECONDS]

bf16, D=128, Hq=32, Hkv=8 (GQA packed: the 4 q heads of a KV head share a tile), page 16, one query
per sequence. For each (batch, context): the default (on an H100 the Gluon split pass where it applies), the
portable split pass, then its (BN, num_kv_stages, num_warps) variants and split counts that fill the GPU 1x /
2x (the default rule) / 4x / 8x; each checked against SDPA first
(rel. error < 2e-2) and timed as a CUDA-graph replay (no launch overhead, as a decode step runs).
cuDNN reads the same keys as a dense tensor. Writes ``ablate_attention_decode.{csv,md}``.
"""
from __future__ import annotations

import argparse
import time

import torch

from benchmarks.common import default_out_dir, graph_time_ms, write_table  # noqa: E402
from benchmarks.peers import sdpa_runner  # noqa: E402

from llmkernels._runtime import cdiv, num_programs_hint  # noqa: E402
from llmkernels.attention.api import attention  # noqa: E402
from llmkernels.attention.config import default_config  # noqa: E402
from llmkernels.attention.paged import PagedKVCache  # noqa: E402

PROBLEMS = [(1, 8192), (1, 32768), (8, 8192), (32, 8192), (64, 8192), (64, 32768)]
HEADS, KV_HEADS, DIM, PAGE = 32, 8, 128, 16
TILES = [(64, 3, 4), (64, 4, 4), (128, 3, 4), (128, 2, 8), (32, 4, 4), (64, 3, 2)]  # (BN, stages, warps)
FILL = (1, 4, 8)  # programs x splits ~ FILL x SMs (the default rule is 2x)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--budget", type=float, default=400.0, help="seconds; no new problem after this")
    args = parser.parse_args()
    start = time.perf_counter()
    torch.manual_seed(0)
    device = torch.device("cuda")
    sms = num_programs_hint(device)
    rows = []
    for batch, context in PROBLEMS:
        if time.perf_counter() - start > args.budget:
            break
        pages_per_seq = context // PAGE
        num_pages = batch * pages_per_seq
        k_pages = torch.randn(num_pages, PAGE, KV_HEADS, DIM, dtype=torch.bfloat16, device=device)
        v_pages = torch.randn_like(k_pages)
        table = torch.randperm(num_pages, device=device).to(torch.int32).view(batch, pages_per_seq)
        cache = PagedKVCache(k_pages, v_pages, table, torch.full((batch,), context, dtype=torch.int32, device=device))
        q = torch.randn(batch, 1, HEADS, DIM, dtype=torch.bfloat16, device=device)
        k_dense = k_pages[table.long()].reshape(batch, context, KV_HEADS, DIM).transpose(1, 2).contiguous()
        v_dense = v_pages[table.long()].reshape(batch, context, KV_HEADS, DIM).transpose(1, 2).contiguous()
        q_t = q.transpose(1, 2)
        kv_bytes = 2 * k_dense.numel() * 2
        cudnn = sdpa_runner("cudnn", q_t, k_dense, v_dense)
        expected = cudnn().transpose(1, 2).float()
        cudnn_ms = graph_time_ms(cudnn)
        problem = f"B={batch} ctx={context}"
        default = default_config(DIM, torch.bfloat16, device, decode=True)
        base = default.replace(warp_specialized=False)  # the portable split pass, whose fields the sweep varies
        programs = batch * KV_HEADS
        variants = [("default", default, None), ("portable", base, None)]
        variants += [(f"BN{bn} s{s} w{w}", base.replace(BN=bn, num_kv_stages=s, num_warps=w), None) for bn, s, w in TILES]
        variants += [(f"portable, fill {f}x", base, max(1, min(cdiv(f * sms, programs), context // base.BN)))
                     for f in FILL]
        for name, config, splits in variants:
            try:
                fn = lambda: attention(q, None, None, kv_cache=cache, config=config, num_splits=splits)  # noqa: E731
                error = ((fn().float() - expected).norm() / expected.norm()).item()
                ms, note = (graph_time_ms(fn), "") if error < 2e-2 else (float("nan"), f"WRONG {error:.1e}")
            except Exception as exc:  # noqa: BLE001 - a config that fails is a result
                ms, note = float("nan"), f"fails: {type(exc).__name__} {str(exc)[:60]}"
            rows.append(dict(problem=problem, variant=name, splits=splits or "auto", us=ms * 1e3,
                             gbps=kv_bytes / ms / 1e6, vs_cudnn=cudnn_ms / ms, note=note))
            print(rows[-1], flush=True)
        rows.append(dict(problem=problem, variant="sdpa_cudnn (dense KV)", splits="", us=cudnn_ms * 1e3,
                         gbps=kv_bytes / cudnn_ms / 1e6, vs_cudnn=1.0, note=""))
        del k_pages, v_pages, k_dense, v_dense, cache
        torch.cuda.empty_cache()
    table = write_table(rows, args.out or default_out_dir(), "ablate_attention_decode",
                        f"Paged decode configs on {torch.cuda.get_device_name()} (CUDA-graph replay)",
                        "bf16, D=128, Hq=32, Hkv=8, page 16, one query; `vs_cudnn`: cuDNN time / this time "
                        "(> 1: ours faster); GB/s of K+V.")
    print(table)


if __name__ == "__main__":
    main()
