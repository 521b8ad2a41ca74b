"""Chunked prefill over a paged KV cache (512-4096 new tokens on 4k-32k cached keys) against SDPA flash and cuDNN.

    python -m benchmarks bench_attention_chunked [--out DIR] [--budget S]

q_len new tokens appended to a context already in a paged KV cache, bottom-right causal, bf16, Hq = 32, Hkv = 8,
D = 128. llmkernels reads the paged cache (pages of 16 or 64 keys in random order) through ``lk.attention`` (the Gluon
kernel on Hopper) and, for reference, the same keys as dense tensors. The peers read dense ``[B, H, S, D]`` keys:
SDPA flash with ``causal_lower_right`` (the same work), SDPA cuDNN with the lower-right mask as a bool tensor
(the same work plus the mask's bytes) and SDPA cuDNN without a mask (``sdpa_cudnn nomask``: every query sees
every key, ``q_len² / 2`` more score pairs than the causal work: the ratio against it understates ours).
Every system is checked against SDPA flash first. Times are CUDA-graph replays (GPU time, no host launch
cost); TFLOP/s count the causal work, ``4 · B · Hq · D · (q_len · context + q_len (q_len + 1) / 2)``, for
every system. Writes ``attention_chunked_prefill.{csv,md,png}`` to DIR (default
``benchmarks/results/<gpu>/bench_attention_chunked/``). GPU only.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from benchmarks.common import default_out_dir, graph_time_ms, line_plots, measure_ceilings, require_gpu, write_table
from benchmarks.peers import lower_right_mask, sdpa_runner
from llmkernels.attention.api import attention
from llmkernels.attention.config import default_config
from llmkernels.attention.paged import PagedKVCache

HEADS, KV_HEADS, DIM = 32, 8, 128
K = 1024
# (batch, context already cached, new tokens, page size)
GRID = (
    [(1, c, q, 16) for c in (4 * K, 8 * K, 16 * K, 32 * K) for q in (512, 1024, 2048, 4096)]
    + [(4, c, q, 16) for c in (4 * K, 16 * K) for q in (512, 2048)]
    + [(1, c, q, 64) for c in (8 * K, 32 * K) for q in (1024, 4096)]
)


def checked_graph_ms(fn, expected):
    """(graph-replay ms, note) of a runner whose output is first checked against ``expected``."""
    try:
        out = fn()
        error = ((out.float() - expected).norm() / expected.norm()).item()
        if not error < 2e-2:
            return None, f"WRONG (rel. error {error:.2e})"
        return graph_time_ms(fn), ""
    except Exception as exc:  # noqa: BLE001 - a system that cannot run a problem is reported, not fatal
        return None, f"fails ({type(exc).__name__}: {str(exc)[:60]})"


def problem_rows(batch, context, q_len, page_size, bf16_tflops):
    from torch.nn.attention.bias import causal_lower_right

    keys = context + q_len  # the chunk's own keys are in the cache too
    pages_per_seq = keys // page_size
    num_pages = batch * pages_per_seq
    dtype = torch.bfloat16
    k_pages = torch.randn(num_pages, page_size, KV_HEADS, DIM, dtype=dtype, device="cuda")
    v_pages = torch.randn_like(k_pages)
    block_table = torch.randperm(num_pages, device="cuda").to(torch.int32).view(batch, pages_per_seq)
    cache = PagedKVCache(k_pages, v_pages, block_table, torch.full((batch,), keys, dtype=torch.int32, device="cuda"))
    q = torch.randn(batch, q_len, HEADS, DIM, dtype=dtype, device="cuda")
    pages = block_table.long()
    k = k_pages[pages].reshape(batch, keys, KV_HEADS, DIM)
    v = v_pages[pages].reshape(batch, keys, KV_HEADS, DIM)
    q_t, k_t, v_t = q.transpose(1, 2), k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()
    expected = sdpa_runner("flash", q_t, k_t, v_t, attn_mask=causal_lower_right(q_len, keys))().float()
    expected_nomask = torch.nn.functional.scaled_dot_product_attention(q_t, k_t, v_t, enable_gqa=True).float()
    portable = default_config(DIM, dtype, q.device).replace(warp_specialized=False)
    runners = {
        "llmkernels paged": (lambda: attention(q, None, None, kv_cache=cache, causal=True).transpose(1, 2), expected),
        "llmkernels dense": (lambda: attention(q, k, v, causal=True).transpose(1, 2), expected),
        "llmkernels paged portable": (
            lambda: attention(q, None, None, kv_cache=cache, causal=True, config=portable).transpose(1, 2),
            expected,
        ),
        "sdpa_flash lower_right": (
            sdpa_runner("flash", q_t, k_t, v_t, attn_mask=causal_lower_right(q_len, keys)),
            expected,
        ),
        "sdpa_cudnn mask": (
            sdpa_runner("cudnn", q_t, k_t, v_t, attn_mask=lower_right_mask(q_len, keys, "cuda")),
            expected,
        ),
        "sdpa_cudnn nomask": (sdpa_runner("cudnn", q_t, k_t, v_t), expected_nomask),
    }
    flops = 4 * batch * HEADS * DIM * (q_len * context + q_len * (q_len + 1) / 2)
    kv_bytes = 2 * k.numel() * k.element_size()
    problem = f"B={batch} ctx={context} q={q_len} page={page_size}"
    rows, ours = [], None
    for name, (fn, want) in runners.items():
        ms, note = checked_graph_ms(fn, want)
        if name == "llmkernels paged":
            ours = ms
        rows.append(
            dict(
                problem=problem,
                batch=batch,
                context=context,
                q_len=q_len,
                page=page_size,
                impl=name,
                graph_ms=ms,
                tflops=flops / ms / 1e9 if ms else None,
                pct_bf16=100 * flops / ms / 1e9 / bf16_tflops if ms and bf16_tflops else None,
                kv_gbps=kv_bytes / ms / 1e6 if ms else None,
                llmk_speedup=ms / ours if ms and ours and name != "llmkernels paged" else None,
                note=note,
            )
        )
        print(
            {key: (f"{value:.4g}" if isinstance(value, float) else value) for key, value in rows[-1].items()},
            flush=True,
        )
    return rows  # the tensors go with this frame; main() empties the allocator's cache between problems


def write_png(rows, out_dir):
    """TFLOP/s against the context, one panel per (batch, new tokens, page), one line per system."""
    panels = {}
    for r in rows:
        if r["tflops"] is not None:
            panel = f"B={r['batch']}, {r['q_len']} new tokens, page {r['page']}"
            panels.setdefault(panel, {}).setdefault(r["impl"], []).append((r["context"], r["tflops"]))
    panels = {name: series for name, series in panels.items() if max(len(p) for p in series.values()) > 1}
    line_plots(
        panels,
        "context (tokens)",
        "TFLOP/s of the causal work (graph replay)",
        os.path.join(out_dir, "attention_chunked_prefill.png"),
        "chunked prefill over a paged cache, bf16, Hq=32, Hkv=8, D=128",
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--budget", type=float, default=480.0, help="seconds; no new problem after this")
    args = parser.parse_args()
    require_gpu("bench_attention_chunked")
    torch.manual_seed(0)
    started = time.perf_counter()
    out_dir = args.out or default_out_dir("bench_attention_chunked")
    bf16_tflops = measure_ceilings().get("bf16_tflops")
    rows = []
    for problem in GRID:
        if time.perf_counter() - started > args.budget:
            print(f"time budget reached: {problem} and later not run", flush=True)
            break
        rows += problem_rows(*problem, bf16_tflops)
        torch.cuda.empty_cache()
    table = write_table(
        rows,
        out_dir,
        "attention_chunked_prefill",
        f"Chunked prefill over a paged cache on {torch.cuda.get_device_name()}",
        f"bf16, Hq={HEADS}, Hkv={KV_HEADS}, D={DIM}, bottom-right causal; CUDA-graph replay times; "
        "`tflops` count the causal work for every system; `pct_bf16` of the measured bf16 matmul "
        "ceiling; `llmk_speedup`: system time / llmkernels paged time (> 1: ours faster). "
        "`sdpa_cudnn nomask` does more work (no mask), `sdpa_cudnn mask` reads a bool mask.",
    )
    write_png(rows, out_dir)
    print(table)


if __name__ == "__main__":
    main()
