"""Prefill and paged-decode attention at a few shapes: llmkernels against SDPA (flash, cuDNN) and FlexAttention.

    python -m benchmarks bench_attention [--quick] [--out DIR] [--no-ablation]

Prefill (bf16, B x H x S x D from gpu-baselines.md, causal and not) and paged decode (bf16, D=128,
Hq=32, Hkv=8, batch 1..64, context 1k..32k; peers read the same K/V as dense tensors). Median times
from ``triton.testing.do_bench``; ceilings measured in the same run (1 GiB device copy, bf16 8192^3
matmul). Prints a markdown table and writes CSV + markdown + PNG (if matplotlib is installed) to
``--out`` (default ``benchmarks/results/<gpu>/bench_attention/``). A peer that fails is reported as "fails".
On a machine without a GPU, ``--quick`` runs tiny shapes through the Triton interpreter (a smoke test
of the script, not a measurement).
"""

from __future__ import annotations

import argparse
import csv
import os
import time

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from benchmarks.common import bar_plot, default_out_dir, graph_time_ms, time_ms  # noqa: E402
from benchmarks.common import measure_ceilings as measure_gpu_ceilings  # noqa: E402
from benchmarks.peers import causal_mask_mod, flex_runner, sdpa_runner  # noqa: E402
from llmkernels.attention.api import attention  # noqa: E402
from llmkernels.attention.config import default_config  # noqa: E402
from llmkernels.attention.paged import PagedKVCache  # noqa: E402
from llmkernels.attention.reference import attention_reference  # noqa: E402

ON_GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if ON_GPU else "cpu")
DTYPE = torch.bfloat16
TIME_BUDGET_S = 270.0  # stop starting new peers after this (the whole run must stay under 5 minutes)
START = time.perf_counter()

PREFILL_SHAPES = [(4, 16, 4096, 128), (2, 16, 8192, 128), (8, 16, 2048, 64), (4, 8, 4096, 256)]
DECODE_PROBLEMS = [(b, c) for b in (1, 8, 32, 64) for c in (1024, 8192, 32768)]
QUICK_PREFILL = [(4, 16, 4096, 128)]
QUICK_DECODE = [(1, 8192), (32, 8192)]
CPU_PREFILL = [(1, 2, 64, 32)]
CPU_DECODE = [(2, 64)]
DECODE_HEADS, DECODE_KV_HEADS, DECODE_DIM, PAGE_SIZE = 32, 8, 128, 16


def bench(fn) -> float:
    """Median milliseconds of ``fn`` (one interpreter run on CPU)."""
    if not ON_GPU:
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    return time_ms(fn)


def bench_graph(fn) -> float | None:
    """Median milliseconds of a CUDA-graph replay of ``fn`` (no launch overhead), or None."""
    if not ON_GPU:
        return None
    try:
        return graph_time_ms(fn)
    except Exception:  # noqa: BLE001 - a peer that cannot be captured just has no graph time
        return None


def over_budget() -> bool:
    return time.perf_counter() - START > TIME_BUDGET_S


def measure_ceilings() -> dict:
    if not ON_GPU:
        return {"copy_gbps": float("nan"), "matmul_tflops": float("nan")}
    ceilings = measure_gpu_ceilings()
    return {"copy_gbps": ceilings["copy_gbps"], "matmul_tflops": ceilings["bf16_tflops"]}


def _sdpa_peer(backend: str):
    return lambda q, k, v, causal: sdpa_runner(backend, q, k, v, causal=causal)


def _flex_peer(q, k, v, causal):
    return flex_runner(q, k, v, causal_mask_mod(q.shape[2], k.shape[2]) if causal else None)


PEERS = {"sdpa_flash": _sdpa_peer("flash"), "sdpa_cudnn": _sdpa_peer("cudnn"), "flex": _flex_peer}


def run_peer(name, q_bhsd, k_bhsd, v_bhsd, causal, expected):
    """(ms, note): time of one peer, or (None, 'fails: ...')."""
    if not ON_GPU:
        return None, "n/a (no GPU)"
    if over_budget():
        return None, "skipped (time budget)"
    try:
        fn = PEERS[name](q_bhsd, k_bhsd, v_bhsd, causal)
        out = fn()
        error = (out.float() - expected).norm() / expected.norm()
        if not torch.isfinite(error) or error > 5e-2:
            return None, f"fails (rel. error {error:.2e})"
        return bench(fn), ""
    except Exception as exc:  # a peer that cannot run this problem is reported, not fatal
        return None, f"fails ({type(exc).__name__})"


def run_peer_graph(name, q_bhsd, k_bhsd, v_bhsd, causal):
    """CUDA-graph replay time of a peer that ran (decode rows), or None."""
    if not ON_GPU or name == "flex":
        return None
    return bench_graph(PEERS[name](q_bhsd, k_bhsd, v_bhsd, causal))


def prefill_rows(shapes, ablation: bool):
    rows = []
    for batch, heads, seqlen, head_dim in shapes:
        q = torch.randn(batch, seqlen, heads, head_dim, dtype=DTYPE, device=DEVICE)
        k = torch.randn_like(q)
        v = torch.randn_like(q)
        q_t, k_t, v_t = (x.transpose(1, 2) for x in (q, k, v))
        for causal in (False, True):
            problem = f"prefill {batch}x{heads}x{seqlen}x{head_dim}{' causal' if causal else ''}"
            flops = 4 * batch * heads * seqlen * seqlen * head_dim * (0.5 if causal else 1.0)
            io_bytes = 4 * q.numel() * q.element_size()
            if ON_GPU:
                expected = sdpa_runner("flash", q_t, k_t, v_t, causal=causal)().float()
            else:
                expected = attention_reference(q, k, v, causal=causal).transpose(1, 2)
            variants = {"llmkernels": None}
            if ablation and ON_GPU and (batch, heads, seqlen, head_dim) == PREFILL_SHAPES[0]:
                base = default_config(head_dim, DTYPE, DEVICE).replace(warp_specialized=False)  # portable
                variants.update(
                    {
                        "llmk two_q_tiles": base.replace(BM=max(base.BM, 128), num_q_tiles=2),
                        "llmk threshold=0": base.replace(rescale_threshold=0.0),
                        "llmk poly_exp2=0.5": base.replace(poly_exp2_fraction=0.5),
                        "llmk poly_exp2=0.25": base.replace(poly_exp2_fraction=0.25),
                    }
                )
            for name, config in variants.items():
                try:
                    fn = lambda config=config: attention(q, k, v, causal=causal, config=config)  # noqa: E731
                    error = (fn().float().transpose(1, 2) - expected).norm() / expected.norm()
                    ms = bench(fn)
                    note = "" if error < 5e-2 else f"WRONG (rel. error {error:.2e})"
                except Exception as exc:
                    ms, note = None, f"fails ({type(exc).__name__}: {str(exc)[:80]})"
                rows.append(
                    dict(section="prefill", problem=problem, impl=name, ms=ms, flops=flops, bytes=io_bytes, note=note)
                )
            for peer in PEERS:
                ms, note = run_peer(peer, q_t, k_t, v_t, causal, expected)
                rows.append(
                    dict(section="prefill", problem=problem, impl=peer, ms=ms, flops=flops, bytes=io_bytes, note=note)
                )
        del q, k, v, q_t, k_t, v_t
    return rows


def decode_rows(problems, heads=DECODE_HEADS, kv_heads=DECODE_KV_HEADS, head_dim=DECODE_DIM):
    rows = []
    for batch, context in problems:
        pages_per_seq = context // PAGE_SIZE
        num_pages = batch * pages_per_seq
        k_pages = torch.randn(num_pages, PAGE_SIZE, kv_heads, head_dim, dtype=DTYPE, device=DEVICE)
        v_pages = torch.randn_like(k_pages)
        block_table = torch.randperm(num_pages, device=DEVICE).to(torch.int32).view(batch, pages_per_seq)
        seqlens = torch.full((batch,), context, dtype=torch.int32, device=DEVICE)
        cache = PagedKVCache(k_pages, v_pages, block_table, seqlens)
        q = torch.randn(batch, 1, heads, head_dim, dtype=DTYPE, device=DEVICE)
        # the same keys as dense [B, H, S, D] tensors for the peers
        pages = block_table.long()
        k_dense = k_pages[pages].reshape(batch, context, kv_heads, head_dim).transpose(1, 2).contiguous()
        v_dense = v_pages[pages].reshape(batch, context, kv_heads, head_dim).transpose(1, 2).contiguous()
        q_t = q.transpose(1, 2)
        problem = f"decode paged B={batch} ctx={context}"
        flops = 4 * batch * heads * context * head_dim
        io_bytes = 2 * k_dense.numel() * k_dense.element_size() + 2 * q.numel() * q.element_size()
        if ON_GPU:
            # bf16 SDPA as the sanity check (a float32 one needs 4x the KV memory); tests/ hold the exact checks
            expected = torch.nn.functional.scaled_dot_product_attention(q_t, k_dense, v_dense, enable_gqa=True).float()
        else:
            expected = attention_reference(q, None, None, kv_cache=cache).transpose(1, 2)
        try:
            fn = lambda: attention(q, None, None, kv_cache=cache)  # noqa: E731
            error = (fn().float().transpose(1, 2) - expected).norm() / expected.norm()
            ms, note = bench(fn), ("" if error < 5e-2 else f"WRONG (rel. error {error:.2e})")
            graph_ms = bench_graph(fn)
        except Exception as exc:
            ms, graph_ms, note = None, None, f"fails ({type(exc).__name__}: {str(exc)[:80]})"
        rows.append(
            dict(
                section="decode",
                problem=problem,
                impl="llmkernels",
                ms=ms,
                flops=flops,
                bytes=io_bytes,
                note=note,
                graph_ms=graph_ms,
            )
        )
        for peer in PEERS:
            if peer == "flex" and context != 8192 and ON_GPU:
                # each new shape costs torch.compile ~10-20 s: compare at the baseline's 8k context only
                rows.append(
                    dict(
                        section="decode",
                        problem=problem,
                        impl=peer,
                        ms=None,
                        flops=flops,
                        bytes=io_bytes,
                        note="skipped (compile time; see ctx=8192)",
                    )
                )
                continue
            ms, note = run_peer(peer, q_t, k_dense, v_dense, False, expected)
            graph_ms = run_peer_graph(peer, q_t, k_dense, v_dense, False) if ms is not None else None
            rows.append(
                dict(
                    section="decode",
                    problem=problem,
                    impl=peer,
                    ms=ms,
                    flops=flops,
                    bytes=io_bytes,
                    note=note + (" (dense KV)" if ms is not None else ""),
                    graph_ms=graph_ms,
                )
            )
        del k_pages, v_pages, k_dense, v_dense, cache
        if ON_GPU:
            torch.cuda.empty_cache()
    return rows


def add_metrics(rows, ceilings):
    ours = {(r["problem"]): r["ms"] for r in rows if r["impl"] == "llmkernels"}
    ours_graph = {(r["problem"]): r.get("graph_ms") for r in rows if r["impl"] == "llmkernels"}
    for r in rows:
        graph_ms, our_graph_ms = r.setdefault("graph_ms", None), ours_graph.get(r["problem"])
        r["graph_speedup"] = (
            graph_ms / our_graph_ms if graph_ms and our_graph_ms and r["impl"] != "llmkernels" else None
        )
        ms = r["ms"]
        r["tflops"] = r["flops"] / ms / 1e9 if ms else None
        r["gbps"] = r["bytes"] / ms / 1e6 if ms else None
        if ms and ON_GPU:
            r["pct_ceiling"] = (
                100 * r["tflops"] / ceilings["matmul_tflops"]
                if r["section"] == "prefill"
                else 100 * r["gbps"] / ceilings["copy_gbps"]
            )
        else:
            r["pct_ceiling"] = None
        our_ms = ours.get(r["problem"])
        r["ours_speedup"] = (ms / our_ms) if (ms and our_ms and r["impl"] != "llmkernels") else None
    return rows


def fmt(value, spec):
    return "" if value is None else format(value, spec)


def markdown(rows, ceilings, device_name) -> str:
    lines = [
        f"# Attention benchmark on {device_name}",
        "",
        f"Ceilings measured in this run: copy {ceilings['copy_gbps']:.0f} GB/s, bf16 matmul "
        f"{ceilings['matmul_tflops']:.0f} TFLOP/s. `% ceiling`: TFLOP/s of the matmul (prefill) or GB/s of "
        "the copy (decode). `llmk speedup`: peer time / llmkernels time (> 1: llmkernels faster). Decode "
        "rows also give the CUDA-graph replay time (`graph ms`, no launch overhead) and the speedup "
        "measured that way.",
        "",
        "| problem | impl | ms | TFLOP/s | GB/s | % ceiling | llmk speedup | graph ms | llmk speedup (graph) | note |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {r['problem']} | {r['impl']} | {fmt(r['ms'], '.3f')} | {fmt(r['tflops'], '.0f')} | "
            f"{fmt(r['gbps'], '.0f')} | {fmt(r['pct_ceiling'], '.0f')} | {fmt(r['ours_speedup'], '.2f')} | "
            f"{fmt(r['graph_ms'], '.4f')} | {fmt(r['graph_speedup'], '.2f')} | {r['note']} |"
        )
    return "\n".join(lines) + "\n"


def write_png(rows, out_dir):
    """One grouped bar chart per section: TFLOP/s for prefill, GB/s for decode."""
    for section, metric, label in (("prefill", "tflops", "TFLOP/s"), ("decode", "gbps", "GB/s")):
        section_rows = [r for r in rows if r["section"] == section]
        problems = list(dict.fromkeys(r["problem"] for r in section_rows))
        series = {
            impl: [
                next((r[metric] or 0.0 for r in section_rows if r["problem"] == p and r["impl"] == impl), 0.0)
                for p in problems
            ]
            for impl in dict.fromkeys(r["impl"] for r in section_rows)
        }
        bar_plot(problems, series, label, os.path.join(out_dir, f"attention_{section}.png"), f"attention {section}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one prefill shape and two decode problems")
    parser.add_argument("--no-ablation", action="store_true", help="skip the FA4-switch rows")
    parser.add_argument("--out", default=None, help="output folder (default benchmarks/results/<gpu>/bench_attention/)")
    args = parser.parse_args(argv)
    device_name = torch.cuda.get_device_name() if ON_GPU else "cpu-interpreter"
    out_dir = args.out or default_out_dir("bench_attention")
    os.makedirs(out_dir, exist_ok=True)
    if ON_GPU:
        prefill, decode = (QUICK_PREFILL, QUICK_DECODE) if args.quick else (PREFILL_SHAPES, DECODE_PROBLEMS)
        decode_kwargs = {}
    else:
        if not args.quick:
            print("no GPU: running the --quick smoke test through the Triton interpreter")
        prefill, decode = CPU_PREFILL, CPU_DECODE
        decode_kwargs = dict(heads=4, kv_heads=2, head_dim=32)
    ceilings = measure_ceilings()
    rows = prefill_rows(prefill, ablation=not args.no_ablation and not args.quick)
    rows += decode_rows(decode, **decode_kwargs)
    rows = add_metrics(rows, ceilings)
    table = markdown(rows, ceilings, device_name)
    print(table)
    with open(os.path.join(out_dir, "attention.md"), "w") as f:
        f.write(table)
    fields = [
        "section",
        "problem",
        "impl",
        "ms",
        "tflops",
        "gbps",
        "pct_ceiling",
        "ours_speedup",
        "graph_ms",
        "graph_speedup",
        "note",
    ]
    with open(os.path.join(out_dir, "attention.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    write_png(rows, out_dir)
    print(f"wrote {sorted(os.listdir(out_dir))} to {out_dir} in {time.perf_counter() - START:.0f} s")


if __name__ == "__main__":
    main()
