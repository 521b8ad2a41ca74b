"""Host time of one eager call, with the GPU work tiny: llmkernels next to its nearest PyTorch peer, one run.

    python -m benchmarks bench_host_overhead [--out DIR] [--calls N]

For each call: the host time (µs per call of a loop of N back-to-back calls, timed on the host with no
synchronization inside the loop: the GPU work is a few µs, so the host is what the loop waits for), the
median time one call takes to return when started on an idle GPU ("isolated": the host's own work), the
GPU time (CUDA-graph replay of the same call, µs) and the ratio of host times to the peer's. The targets
of issue 19 are printed beside them (H100): paged decode ≤ 35 µs, grouped_matmul ≤ 50 µs, quantize
≤ 25 µs, MoEFeedForward at one token ≤ 250 µs, every call ≤ 1.5× its peer. Writes
``host_overhead.{csv,md,png}`` under ``--out`` (default ``benchmarks/results/<gpu>/bench_host_overhead/``).
GPU only.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

import llmkernels as lk
from benchmarks.common import bar_plot, default_out_dir, graph_time_ms, require_gpu, write_table
from benchmarks.peers import moe_batched_mm_runner, sdpa_runner
from llmkernels.moe import MoEFeedForward

TARGETS_US = {
    "paged decode B=1 ctx=4k": 35.0,
    "grouped_matmul bf16": 50.0,
    "grouped_matmul mxfp8": 50.0,
    "quantize mxfp8": 25.0,
    "MoEFeedForward mxfp8, 1 token": 250.0,
}


def host_us(fn, calls: int) -> float:
    """µs of host time per call: ``calls`` back-to-back calls, no synchronization inside the loop."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(5):  # the best of five loops: the least disturbed by the OS
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls * 1e6)
        torch.cuda.synchronize()
    return best


def isolated_host_us(fn, calls: int) -> float:
    """Median µs for one call to return, each started on an idle GPU (synchronized before): the host's
    own work, with no wait on a full launch queue."""
    times = []
    for _ in range(calls):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2] * 1e6


def _problems(device) -> list[tuple[str, object, object, str]]:
    """(name, ours, peer or None, what the peer is)."""
    bf16 = dict(dtype=torch.bfloat16, device=device)
    problems = []

    # paged decode: B=1, 4k keys in pages of 16, Hq=32, Hkv=8, D=128; SDPA reads the same keys dense
    pages, page_size, context = 256, 16, 4096
    k_pages, v_pages = (torch.randn(pages, page_size, 8, 128, **bf16) for _ in range(2))
    cache = lk.PagedKVCache(
        k_pages,
        v_pages,
        torch.randperm(pages, device=device)[None].int(),
        torch.tensor([context], dtype=torch.int32, device=device),
    )
    q = torch.randn(1, 1, 32, 128, **bf16)
    k_dense = torch.randn(1, 8, context, 128, **bf16)
    problems.append(
        (
            "paged decode B=1 ctx=4k",
            lambda: lk.attention(q, None, None, kv_cache=cache, causal=True),
            sdpa_runner("flash", q.transpose(1, 2), k_dense, k_dense),
            "SDPA flash, dense KV",
        )
    )

    # prefill 1 x 128 x 8 x 64, causal
    qp, kp, vp = (torch.randn(1, 128, 8, 64, **bf16) for _ in range(3))
    problems.append(
        (
            "prefill 1x128x8x64 causal",
            lambda: lk.attention(qp, kp, vp, causal=True),
            sdpa_runner("flash", *(t.transpose(1, 2) for t in (qp, kp, vp)), causal=True),
            "SDPA flash",
        )
    )

    # grouped matmul: 8 experts, 2 tokens each, N = K = 256
    experts, rows, n, k = 8, 2, 256, 256
    x, w = torch.randn(experts * rows, k, **bf16), torch.randn(experts, n, k, **bf16)
    offsets = torch.arange(0, experts * rows + 1, rows, dtype=torch.int32, device=device)
    ids = torch.arange(experts, dtype=torch.int32, device=device)
    peer = None
    if hasattr(torch, "_grouped_mm"):
        w_t = w.transpose(1, 2)
        peer = lambda: torch._grouped_mm(x, w_t, offs=offsets[1:])  # noqa: E731
    problems.append(("grouped_matmul bf16", lambda: lk.grouped_matmul(x, w, offsets, ids), peer, "torch._grouped_mm"))
    w_q, x_q = lk.quantize(w, "mxfp8"), lk.quantize(x, "mxfp8")
    problems.append(
        ("grouped_matmul mxfp8", lambda: lk.grouped_matmul(x_q, w_q, offsets, ids), peer, "torch._grouped_mm (bf16)")
    )
    problems.append(
        (
            "quantize + grouped_matmul mxfp8",
            lambda: lk.grouped_matmul(lk.quantize(x, "mxfp8"), w_q, offsets, ids),
            peer,
            "torch._grouped_mm (bf16)",
        )
    )
    problems.append(
        ("quantize mxfp8", lambda: lk.quantize(x, "mxfp8"), lambda: x.to(torch.float8_e4m3fn), "x.to(float8_e4m3fn)")
    )

    # MoEFeedForward at one token, Qwen3-30B-A3B's layer: H=2048, I=768, 128 experts, top 8
    hidden, intermediate, num_experts = 2048, 768, 128
    weights = (
        torch.randn(num_experts, hidden, device=device) / 45,
        torch.randn(num_experts, 2 * intermediate, hidden, device=device) / 45,
        torch.randn(num_experts, hidden, intermediate, device=device) / 28,
    )
    block = MoEFeedForward.from_float(*weights, 8, weight_format="mxfp8")
    peer = moe_batched_mm_runner(*weights, 8)
    token = torch.randn(1, hidden, **bf16)
    problems.append(
        (
            "MoEFeedForward mxfp8, 1 token",
            lambda: block(token),
            lambda: peer(token),
            "PyTorch ops, batched_mm experts (bf16)",
        )
    )
    return problems


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args()
    require_gpu("bench_host_overhead")
    device = torch.device("cuda")
    rows = []
    with torch.inference_mode():
        for name, ours, peer, peer_name in _problems(device):
            ours_host = host_us(ours, args.calls)
            try:
                ours_gpu = graph_time_ms(ours) * 1e3
            except Exception as exc:  # noqa: BLE001 - a call that cannot be captured is a result too
                print(f"{name}: no CUDA graph ({type(exc).__name__}: {exc})")
                ours_gpu = float("nan")
            peer_host = host_us(peer, args.calls) if peer is not None else float("nan")
            ours_isolated = isolated_host_us(ours, args.calls)
            peer_isolated = isolated_host_us(peer, args.calls) if peer is not None else float("nan")
            target = TARGETS_US.get(name)
            rows.append(
                {
                    "call": name,
                    "host us": ours_host,
                    "GPU us (graph)": ours_gpu,
                    "peer": peer_name or "none",
                    "peer host us": peer_host if peer else "",
                    "host vs peer": ours_host / peer_host if peer else "",
                    "host us (isolated)": ours_isolated,
                    "peer host us (isolated)": peer_isolated if peer else "",
                    "target us": target or "",
                    "met": "" if target is None else ("yes" if ours_host <= target else "no"),
                }
            )
            print(rows[-1], flush=True)
    out_dir = args.out or default_out_dir("bench_host_overhead")
    gpu = torch.cuda.get_device_name()
    table = write_table(
        rows,
        out_dir,
        "host_overhead",
        f"Eager host time per call ({gpu})",
        f"torch {torch.__version__}; best of five loops of {args.calls} calls; "
        "GPU time from a CUDA-graph replay of the same call.",
    )
    bar_plot(
        [r["call"] for r in rows],
        {
            "llmkernels host": [r["host us"] for r in rows],
            "peer host": [r["peer host us"] or float("nan") for r in rows],
            "llmkernels GPU": [r["GPU us (graph)"] for r in rows],
        },
        "µs per call",
        os.path.join(out_dir, "host_overhead.png"),
        f"Eager host time per call ({gpu})",
    )
    print(table)


if __name__ == "__main__":
    main()
