"""Chunked prefill over a paged KV cache (512-4096 new tokens on 4k-32k cached keys) against SDPA flash and cuDNN.

    python -m benchmarks bench_attention_chunked [--out DIR] [--budget S] [--fp8]

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

``--fp8``: the same bf16 chunks over a paged cache whose pages are float8_e4m3fn (``k_descale`` / ``v_descale``
float32 ``[B, Hkv]``, one per sequence and KV head) against the same cache in bf16 (ours both: ``lk.attention``
with ``kv_cache=``), at the problems of the grid with 8k, 16k and 32k cached keys (:data:`FP8_GRID`). The bf16
pages hold the FP8 ones dequantized (exact: power-of-two descales), so both read the same keys. Prints and writes
the graph-replay ms, the FP8 cache's speedup over the bf16 one and the bandwidth of the bytes each reads (KV pages
and q). Writes ``attention_chunked_fp8.{csv,md,png}`` to DIR (default the suite's ``fp8/`` folder). GPU only.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from benchmarks.common import (
    default_out_dir,
    e4m3_descale,
    graph_time_ms,
    line_plots,
    measure_ceilings,
    require_gpu,
    write_table,
)
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
FP8_GRID = [problem for problem in GRID if problem[1] >= 8 * K]  # 8k, 16k and 32k cached keys


# A runner whose relative error against the reference exceeds this is reported WRONG and not timed; over an FP8
# cache the kernel rounds P (and a bf16 q, per row) to e4m3: measured 2-3e-2 on these inputs, so FP8 runners get
# the prefill bench's FP8 bound.
WRONG = 2e-2
FP8_WRONG = 0.1


def checked_graph_ms(fn, expected, wrong=WRONG):
    """(graph-replay ms, note) of a runner whose output is first checked against ``expected`` (its relative error
    is in the note)."""
    try:
        out = fn()
        error = ((out.float() - expected).norm() / expected.norm()).item()
        if not error < wrong:
            return None, f"WRONG (rel. error {error:.2e})"
        return graph_time_ms(fn), f"rel. error {error:.1e}"
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


def fp8_caches(k_pages, v_pages, block_table, seqlens):
    """``(fp8 cache, bf16 cache, k_descale, v_descale)`` from bf16 pages: the FP8 pages hold ``round_e4m3(x /
    descale)`` with one descale per (sequence, KV head) (:func:`~benchmarks.common.e4m3_descale` of that sequence's
    amax, float32 ``[B, Hkv]``), the bf16 pages the FP8 values dequantized (exact in bf16)."""
    pages_of = block_table.long()
    fp8_pages, bf16_pages, descales = [], [], []
    for pages in (k_pages, v_pages):
        per_seq = pages[pages_of].float()  # [B, pages per sequence, page, Hkv, D]
        descale = e4m3_descale(per_seq.abs().amax(dim=(1, 2, 4)))  # [B, Hkv]
        scaled = torch.empty(pages.shape, dtype=torch.float32, device=pages.device)
        scaled[pages_of.flatten()] = (per_seq / descale[:, None, None, :, None]).flatten(0, 1)
        fp8 = scaled.to(torch.float8_e4m3fn)
        dequantized = torch.empty(pages.shape, dtype=torch.float32, device=pages.device)
        dequantized[pages_of.flatten()] = (fp8[pages_of].float() * descale[:, None, None, :, None]).flatten(0, 1)
        fp8_pages.append(fp8)
        bf16_pages.append(dequantized.to(pages.dtype))
        descales.append(descale)
        del per_seq, scaled, dequantized
    fp8_cache = PagedKVCache(fp8_pages[0], fp8_pages[1], block_table, seqlens)
    bf16_cache = PagedKVCache(bf16_pages[0], bf16_pages[1], block_table, seqlens)
    return fp8_cache, bf16_cache, descales[0], descales[1]


def fp8_problem_rows(batch, context, q_len, page_size, bf16_tflops, device="cuda"):
    """Ours over the FP8 cache and over the bf16 cache on one chunked-prefill problem (bottom-right causal), both
    checked against SDPA flash on the dense dequantized keys, then timed as graph replays."""
    from torch.nn.attention.bias import causal_lower_right

    keys = context + q_len  # the chunk's own keys are in the cache too
    pages_per_seq = keys // page_size
    num_pages = batch * pages_per_seq
    dtype = torch.bfloat16
    # KV heads of different magnitudes: per-(sequence, KV head) descales that differ, so a wrong one shows
    magnitude = torch.linspace(0.5, 2.0, KV_HEADS, device=device)[None, None, :, None]
    k_pages, v_pages = (
        (torch.randn(num_pages, page_size, KV_HEADS, DIM, device=device) * magnitude).to(dtype) for _ in range(2)
    )
    block_table = torch.randperm(num_pages, device=device).to(torch.int32).view(batch, pages_per_seq)
    seqlens = torch.full((batch,), keys, dtype=torch.int32, device=device)
    fp8_cache, bf16_cache, k_descale, v_descale = fp8_caches(k_pages, v_pages, block_table, seqlens)
    del k_pages, v_pages
    q = torch.randn(batch, q_len, HEADS, DIM, dtype=dtype, device=device)
    pages = block_table.long()
    k, v = (x[pages].reshape(batch, keys, KV_HEADS, DIM) for x in (bf16_cache.k_pages, bf16_cache.v_pages))
    q_t, k_t, v_t = q.transpose(1, 2), k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()
    expected = sdpa_runner("flash", q_t, k_t, v_t, attn_mask=causal_lower_right(q_len, keys))().float()
    del k, v, k_t, v_t
    runners = {
        "llmkernels paged fp8": lambda: attention(
            q, None, None, kv_cache=fp8_cache, causal=True, k_descale=k_descale, v_descale=v_descale
        ).transpose(1, 2),
        "llmkernels paged bf16": lambda: attention(q, None, None, kv_cache=bf16_cache, causal=True).transpose(1, 2),
    }
    times = {
        name: checked_graph_ms(fn, expected, FP8_WRONG if "fp8" in name else WRONG) for name, fn in runners.items()
    }
    flops = 4 * batch * HEADS * DIM * (q_len * context + q_len * (q_len + 1) / 2)
    q_bytes = q.numel() * q.element_size()
    fp8_ms, bf16_ms = times["llmkernels paged fp8"][0], times["llmkernels paged bf16"][0]
    rows = []
    for name, (ms, note) in times.items():
        cache = fp8_cache if "fp8" in name else bf16_cache
        read_bytes = 2 * batch * keys * KV_HEADS * DIM * cache.k_pages.element_size() + q_bytes
        rows.append(
            dict(
                problem=f"B={batch} ctx={context} q={q_len} page={page_size}",
                batch=batch,
                context=context,
                q_len=q_len,
                page=page_size,
                impl=name,
                graph_ms=ms,
                fp8_speedup=bf16_ms / fp8_ms if name.endswith("fp8") and fp8_ms and bf16_ms else None,
                read_gbps=read_bytes / ms / 1e6 if ms else None,
                tflops=flops / ms / 1e9 if ms else None,
                pct_bf16=100 * flops / ms / 1e9 / bf16_tflops if ms and bf16_tflops else None,
                note=note,
            )
        )
        print(
            {key: (f"{value:.4g}" if isinstance(value, float) else value) for key, value in rows[-1].items()},
            flush=True,
        )
    return rows


def grid_rows(grid, make_rows, budget, started) -> list:
    """``make_rows(*problem, bf16_tflops)`` of each problem of ``grid`` in order, none started past ``budget``
    seconds after ``started``."""
    bf16_tflops = measure_ceilings().get("bf16_tflops")
    rows = []
    for problem in grid:
        if time.perf_counter() - started > budget:
            print(f"time budget reached: {problem} and later not run", flush=True)
            break
        rows += make_rows(*problem, bf16_tflops)
        torch.cuda.empty_cache()
    return rows


def run_fp8(out_dir, budget, started):
    """The ``--fp8`` mode over :data:`FP8_GRID` (no new problem past ``budget`` seconds)."""
    out_dir = out_dir or default_out_dir("bench_attention_chunked/fp8")
    rows = grid_rows(FP8_GRID, fp8_problem_rows, budget, started)
    table = write_table(
        rows,
        out_dir,
        "attention_chunked_fp8",
        f"Chunked prefill over an FP8 paged cache on {torch.cuda.get_device_name()}",
        f"bf16 q, Hq={HEADS}, Hkv={KV_HEADS}, D={DIM}, bottom-right causal, torch {torch.__version__}; ours both: "
        "`llmkernels paged fp8` reads float8_e4m3fn pages with k_descale / v_descale [B, Hkv] (one per sequence and "
        "KV head, powers of two), `llmkernels paged bf16` the same keys dequantized (exact) in bf16 pages. "
        "`graph_ms`: CUDA-graph replay time; `fp8_speedup`: the bf16 cache's time / the FP8 cache's (> 1: FP8 "
        "faster); `read_gbps`: the bytes each reads once (the sequence's K and V, 1 byte per element in FP8 and 2 "
        "in bf16, plus q) per second; `tflops`: the causal work, `pct_bf16` of the measured bf16 matmul ceiling.",
    )
    write_png(
        rows,
        out_dir,
        "attention_chunked_fp8.png",
        "chunked prefill, bf16 q over an FP8 or bf16 paged cache, Hq=32, Hkv=8, D=128",
    )
    print(table)


def write_png(
    rows,
    out_dir,
    filename="attention_chunked_prefill.png",
    title="chunked prefill over a paged cache, bf16, Hq=32, Hkv=8, D=128",
):
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
        os.path.join(out_dir, filename),
        title,
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--budget", type=float, default=480.0, help="seconds; no new problem after this")
    parser.add_argument("--fp8", action="store_true", help="an FP8 (e4m3) paged cache against bf16, 8k-32k context")
    args = parser.parse_args()
    require_gpu("bench_attention_chunked")
    torch.manual_seed(0)
    started = time.perf_counter()
    if args.fp8:
        run_fp8(args.out, args.budget, started)
        return
    out_dir = args.out or default_out_dir("bench_attention_chunked")
    rows = grid_rows(GRID, problem_rows, args.budget, started)
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
