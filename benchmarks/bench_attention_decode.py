"""Paged decode over a grid (batch 1-128, 1k-128k keys, 1-16 query tokens) against SDPA and FlexAttention.

    python -m benchmarks bench_attention_decode [--out DIR] [--budget S] [--fp8]

Batch 1..128, context 1k..128k, page 16 and 64, 1 query token and 2..16 (speculative decoding), and a KV cache past
2^31 elements. bf16, D=128, Hq=32, Hkv=8; llmkernels reads a paged cache (pages in random order), the peers (SDPA
cuDNN and flash, FlexAttention at batch <= 8) the same keys as dense ``[B, H, S, D]`` tensors. With more than one
query token, llmkernels runs the bottom-right causal mask that speculative decoding needs; the SDPA peers run it as
``causal_lower_right`` and, for the bare-bandwidth comparison, without a mask (``sdpa_cudnn nomask``: the same KV
bytes, nothing masked). Eager times (do_bench median) and CUDA-graph replay times. Writes
``attention_decode_grid.{csv,md,png}`` to DIR (default ``benchmarks/results/<gpu>/bench_attention_decode/``).
Without a GPU, two tiny problems run through the interpreter (a smoke test of the script, not a measurement).

``--fp8``: the FP8 KV cache (float8_e4m3fn pages, FlashAttention-3's ``k_descale`` / ``v_descale`` per sequence and
KV head) at the FP8 grid (:data:`FP8_GRID`, one query token, page 16) against our bf16 cache and cuDNN's bf16 SDPA
on the same (dequantized) keys, with the ratios of the FP8 cache's time to each; the KV bytes of the FP8 cache are
half the bf16 ones. Writes ``attention_decode_fp8.{csv,md}`` to DIR (default the suite's ``fp8/`` folder).
"""

from __future__ import annotations

import argparse
import os
import time

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from benchmarks.common import default_out_dir, graph_time_ms, line_plots, measure_ceilings, time_ms, write_table  # noqa: E402
from benchmarks.peers import causal_mask_mod, flex_runner, lower_right_mask, sdpa_runner  # noqa: E402
from llmkernels.attention.api import attention  # noqa: E402
from llmkernels.attention.paged import PagedKVCache  # noqa: E402
from llmkernels.attention.reference import attention_reference  # noqa: E402

ON_GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if ON_GPU else "cpu")
HEADS, KV_HEADS, DIM = 32, 8, 128
K = 1024

# (batch, context, query tokens, page size)
GRID = (
    [
        (b, c, 1, 16)
        for b, c in [
            (1, 1 * K),
            (1, 8 * K),
            (1, 32 * K),
            (1, 128 * K),
            (8, 8 * K),
            (8, 32 * K),
            (8, 128 * K),
            (32, 8 * K),
            (32, 32 * K),
            (64, 8 * K),
            (64, 32 * K),
            (128, 1 * K),
            (128, 8 * K),
            (128, 16 * K),
        ]
    ]
    + [(b, c, 1, 64) for b, c in [(1, 8 * K), (1, 128 * K), (8, 32 * K), (64, 8 * K), (128, 8 * K)]]
    + [(b, c, q, 16) for q in (2, 4, 16) for b, c in [(1, 8 * K), (8, 8 * K), (32, 8 * K), (8, 32 * K)]]
    + [(32, 128 * K, 1, 16)]  # 32 x 128k x 8 x 128 = 4.3e9 elements per K and per V: 64-bit offsets
)
CPU_GRID = [(2, 64, 1, 16), (2, 64, 4, 16)]
FP8_GRID = [(8, 32 * K), (32, 8 * K), (1, 128 * K), (1, 8 * K)]  # (batch, context), one query token, page 16
CPU_FP8_GRID = [(2, 64)]
FLEX_BATCH_LIMIT = 8


def timed(fn, expected, graph: bool):
    """(eager ms, graph ms, note) of a runner checked against ``expected`` first."""
    try:
        out = fn()
        error = ((out.float() - expected).norm() / expected.norm()).item()
        if not error < 5e-2:
            return None, None, f"WRONG (rel. error {error:.2e})"
        if not ON_GPU:
            started = time.perf_counter()
            fn()
            return (time.perf_counter() - started) * 1e3, None, ""
        graph_ms = None
        if graph:
            try:
                graph_ms = graph_time_ms(fn)
            except Exception:  # noqa: BLE001 - not capturable: eager time only
                graph_ms = None
        return time_ms(fn), graph_ms, ""
    except Exception as exc:  # noqa: BLE001 - a system that cannot run a problem is reported, not fatal
        return None, None, f"fails ({type(exc).__name__}: {str(exc)[:60]})"


def problem_rows(batch, context, q_len, page_size, heads, kv_heads, dim, copy_gbps):
    pages_per_seq = context // page_size
    num_pages = batch * pages_per_seq
    dtype = torch.bfloat16
    k_pages = torch.randn(num_pages, page_size, kv_heads, dim, dtype=dtype, device=DEVICE)
    v_pages = torch.randn_like(k_pages)
    block_table = torch.randperm(num_pages, device=DEVICE).to(torch.int32).view(batch, pages_per_seq)
    cache = PagedKVCache(k_pages, v_pages, block_table, torch.full((batch,), context, dtype=torch.int32, device=DEVICE))
    q = torch.randn(batch, q_len, heads, dim, dtype=dtype, device=DEVICE)
    q_t = q.transpose(1, 2)
    pages = block_table.long()
    k_dense = k_pages[pages].reshape(batch, context, kv_heads, dim).transpose(1, 2).contiguous()
    v_dense = v_pages[pages].reshape(batch, context, kv_heads, dim).transpose(1, 2).contiguous()
    mask = lower_right_mask(q_len, context, DEVICE) if q_len > 1 else None
    if ON_GPU:  # bf16 SDPA (default backend) as the sanity check; tests/ hold the exact float64 ones
        expected = torch.nn.functional.scaled_dot_product_attention(
            q_t, k_dense, v_dense, attn_mask=mask, enable_gqa=True
        ).float()
        expected_nomask = (
            expected
            if mask is None
            else torch.nn.functional.scaled_dot_product_attention(q_t, k_dense, v_dense, enable_gqa=True).float()
        )
    else:
        expected = attention_reference(q, None, None, kv_cache=cache, causal=True).transpose(1, 2).float()
        expected_nomask = expected
    kv_bytes = 2 * k_dense.numel() * k_dense.element_size()
    flops = 4 * batch * heads * q_len * context * dim
    runners = {"llmkernels": (lambda: attention(q, None, None, kv_cache=cache, causal=True).transpose(1, 2), expected)}
    if ON_GPU:
        runners["sdpa_cudnn"] = (sdpa_runner("cudnn", q_t, k_dense, v_dense, attn_mask=mask), expected)
        runners["sdpa_flash"] = (sdpa_runner("flash", q_t, k_dense, v_dense, attn_mask=mask), expected)
        if q_len > 1:
            runners["sdpa_cudnn nomask"] = (sdpa_runner("cudnn", q_t, k_dense, v_dense), expected_nomask)
        if batch <= FLEX_BATCH_LIMIT and page_size == 16 and context <= 32 * K:
            mask_mod = causal_mask_mod(q_len, k_dense.shape[2]) if q_len > 1 else None
            runners["flex"] = (flex_runner(q_t, k_dense, v_dense, mask_mod), expected)
    problem = f"B={batch} ctx={context} q={q_len} page={page_size}"
    rows, ours = [], {}
    for name, (fn, want) in runners.items():
        ms, graph_ms, note = timed(fn, want, graph=name != "flex")
        if name == "llmkernels":
            ours = {"ms": ms, "graph_ms": graph_ms}
        best = graph_ms or ms
        rows.append(
            dict(
                problem=problem,
                batch=batch,
                context=context,
                q_len=q_len,
                page=page_size,
                impl=name,
                ms=ms,
                graph_ms=graph_ms,
                gbps=kv_bytes / best / 1e6 if best else None,
                pct_copy=100 * kv_bytes / best / 1e6 / copy_gbps if best and copy_gbps else None,
                tflops=flops / best / 1e9 if best else None,
                llmk_speedup=(ms / ours["ms"]) if ms and ours.get("ms") and name != "llmkernels" else None,
                llmk_speedup_graph=(graph_ms / ours["graph_ms"])
                if graph_ms and ours.get("graph_ms") and name != "llmkernels"
                else None,
                note=note,
            )
        )
        print({k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in rows[-1].items()}, flush=True)
    del k_pages, v_pages, k_dense, v_dense, cache
    if ON_GPU:
        torch.cuda.empty_cache()
    return rows


def write_png(rows, out_dir):
    """GB/s of the KV read against context, one panel per (batch, query tokens, page), one line per system."""
    panels = {}
    for r in rows:
        if r["gbps"] is None:
            continue
        panel = f"batch {r['batch']}, {r['q_len']} query token(s), page {r['page']}"
        panels.setdefault(panel, {}).setdefault(r["impl"], []).append((r["context"], r["gbps"]))
    panels = {name: series for name, series in panels.items() if max(len(p) for p in series.values()) > 1}
    line_plots(
        panels,
        "context (tokens)",
        "KV GB/s (graph replay where capturable)",
        os.path.join(out_dir, "attention_decode_grid.png"),
        "paged decode, bf16, Hq=32, Hkv=8, D=128",
    )


def fp8_rows(batch, context, heads, kv_heads, dim, copy_gbps):
    """Our decode over an FP8 cache against our bf16 cache and cuDNN's bf16 SDPA, one query token, page 16. The FP8
    pages hold ``round_e4m3(k / k_descale)`` with one descale per (sequence, KV head) (amax / 448 of the bf16 keys);
    every system reads the same keys (the bf16 ones are the FP8 ones dequantized)."""
    page_size, dtype = 16, torch.bfloat16
    pages_per_seq = context // page_size
    num_pages = batch * pages_per_seq
    block_table = torch.randperm(num_pages, device=DEVICE).to(torch.int32).view(batch, pages_per_seq)
    seqlens = torch.full((batch,), context, dtype=torch.int32, device=DEVICE)
    raw = [torch.randn(num_pages, page_size, kv_heads, dim, dtype=dtype, device=DEVICE) for _ in range(2)]
    pages_of = block_table.long()
    descales, fp8_pages, bf16_pages = [], [], []
    for t in raw:
        per_seq = t[pages_of].float()  # [B, pages, page, Hkv, D]
        descale = per_seq.abs().amax(dim=(1, 2, 4)) / 448.0  # [B, Hkv]
        scaled = torch.empty(num_pages, page_size, kv_heads, dim, dtype=torch.float32, device=DEVICE)
        scaled[pages_of.flatten()] = (per_seq / descale[:, None, None, :, None]).flatten(0, 1)
        fp8 = scaled.to(torch.float8_e4m3fn)
        dequantized = torch.empty_like(scaled)
        dequantized[pages_of.flatten()] = (fp8[pages_of].float() * descale[:, None, None, :, None]).flatten(0, 1)
        descales.append(descale)
        fp8_pages.append(fp8)
        bf16_pages.append(dequantized.to(dtype))
        del per_seq, scaled, dequantized
    fp8_cache = PagedKVCache(fp8_pages[0], fp8_pages[1], block_table, seqlens)
    bf16_cache = PagedKVCache(bf16_pages[0], bf16_pages[1], block_table, seqlens)
    q = torch.randn(batch, 1, heads, dim, dtype=dtype, device=DEVICE)
    q_t = q.transpose(1, 2)
    k_dense = bf16_pages[0][pages_of].reshape(batch, context, kv_heads, dim).transpose(1, 2).contiguous()
    v_dense = bf16_pages[1][pages_of].reshape(batch, context, kv_heads, dim).transpose(1, 2).contiguous()
    if ON_GPU:
        expected = torch.nn.functional.scaled_dot_product_attention(q_t, k_dense, v_dense, enable_gqa=True).float()
    else:
        expected = attention_reference(q, None, None, kv_cache=bf16_cache).transpose(1, 2).float()
    k_descale, v_descale = descales
    runners = {
        "llmkernels fp8 cache": lambda: attention(
            q, None, None, kv_cache=fp8_cache, k_descale=k_descale, v_descale=v_descale
        ).transpose(1, 2),
        "llmkernels bf16 cache": lambda: attention(q, None, None, kv_cache=bf16_cache).transpose(1, 2),
    }
    if ON_GPU:
        runners["sdpa_cudnn bf16"] = sdpa_runner("cudnn", q_t, k_dense, v_dense)
    bf16_bytes = 2 * k_dense.numel() * 2
    times = {name: timed(fn, expected, graph=True) for name, fn in runners.items()}
    rows = []
    ours = times["llmkernels fp8 cache"]
    for name, (ms, graph_ms, note) in times.items():
        best = graph_ms or ms
        kv_bytes = bf16_bytes // 2 if "fp8" in name else bf16_bytes
        rows.append(
            dict(
                problem=f"B={batch} ctx={context}",
                impl=name,
                ms=ms,
                graph_ms=graph_ms,
                gbps=kv_bytes / best / 1e6 if best else None,
                pct_copy=100 * kv_bytes / best / 1e6 / copy_gbps if best and copy_gbps else None,
                fp8_speedup=(best / (ours[1] or ours[0])) if best and (ours[1] or ours[0]) else None,
                note=note,
            )
        )
        print({k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in rows[-1].items()}, flush=True)
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--budget", type=float, default=480.0, help="seconds; no new problem after this")
    parser.add_argument("--fp8", action="store_true", help="the FP8 KV cache against bf16 at the FP8 grid")
    args = parser.parse_args()
    torch.manual_seed(0)
    started = time.perf_counter()
    if args.fp8:
        out_dir = args.out or default_out_dir("bench_attention_decode/fp8")
        copy_gbps = measure_ceilings()["copy_gbps"] if ON_GPU else None
        grid, shape = (FP8_GRID, (HEADS, KV_HEADS, DIM)) if ON_GPU else (CPU_FP8_GRID, (4, 2, 32))
        rows = [row for problem in grid for row in fp8_rows(*problem, *shape, copy_gbps)]
        device_name = torch.cuda.get_device_name() if ON_GPU else "cpu-interpreter"
        print(
            write_table(
                rows,
                out_dir,
                "attention_decode_fp8",
                f"Paged decode over an FP8 KV cache on {device_name}",
                f"Hq={shape[0]}, Hkv={shape[1]}, D={shape[2]}, one query token, page 16; copy "
                f"{copy_gbps or float('nan'):.0f} GB/s (this run). `gbps` counts the KV bytes each system reads (FP8: "
                "half of bf16's); `fp8_speedup`: this system's time / the FP8 cache's (> 1: FP8 faster), graph "
                "replay where capturable.",
            )
        )
        return
    out_dir = args.out or default_out_dir("bench_attention_decode")
    if ON_GPU:
        grid, shape = GRID, (HEADS, KV_HEADS, DIM)
        copy_gbps = measure_ceilings()["copy_gbps"]
    else:
        grid, shape, copy_gbps = CPU_GRID, (4, 2, 32), None
    rows = []
    for problem in grid:
        if time.perf_counter() - started > args.budget:
            print(f"time budget reached: {problem} and later not run", flush=True)
            break
        rows += problem_rows(*problem, *shape, copy_gbps)
    device_name = torch.cuda.get_device_name() if ON_GPU else "cpu-interpreter"
    copy_note = f"copy {copy_gbps:.0f} GB/s (measured in this run)" if copy_gbps else "no GPU"
    table = write_table(
        rows,
        out_dir,
        "attention_decode_grid",
        f"Paged decode grid on {device_name}",
        f"bf16, Hq={shape[0]}, Hkv={shape[1]}, D={shape[2]}; {copy_note}. `gbps`, `pct_copy`, "
        "`tflops` from the graph-replay time where there is one, else eager. `llmk_speedup`: peer "
        "time / llmkernels time (> 1: llmkernels faster), eager and graph. With q > 1, llmkernels "
        "and `sdpa_*` run the bottom-right causal mask; `sdpa_cudnn nomask` reads the same KV "
        "without a mask.",
    )
    write_png(rows, out_dir)
    print(table)


if __name__ == "__main__":
    main()
