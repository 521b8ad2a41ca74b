"""Sliding-window and chunked attention: time against the visible area, next to FlexAttention.

    python -m benchmarks bench_attention_window [--out DIR]

bf16 prefill 2 x 16 x 8192 x 128 (causal), with ``SlidingWindow(w, 0)`` for w from 128 to 8192 and
``Chunked(c)`` for c from 256 to 8192. The visible area (query-key pairs that pass the mask) is counted
exactly; a kernel that skips invisible tiles runs in time proportional to it, plus the diagonal tiles
that it masks per element. ``time / area`` (ns per million visible pairs) should stay about constant;
FlexAttention with the same block mask is the peer (it skips whole invisible blocks too). Writes
``attention_window.{csv,md,png}`` to DIR (default ``benchmarks/results/<gpu>/bench_attention_window/``). Without a
GPU, a tiny shape runs through the interpreter (a smoke test).
"""

from __future__ import annotations

import argparse
import os
import time

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from benchmarks.common import default_out_dir, line_plots, time_ms, write_table  # noqa: E402
from benchmarks.peers import flex_runner  # noqa: E402
from llmkernels.attention.api import attention  # noqa: E402
from llmkernels.attention.config import default_config  # noqa: E402
from llmkernels.attention.masks import Chunked, SlidingWindow  # noqa: E402
from llmkernels.attention.reference import attention_reference  # noqa: E402

ON_GPU = torch.cuda.is_available()


def visible_pairs(seqlen: int, window: int | None = None, chunk: int | None = None) -> int:
    """Query-key pairs of one causal head that a sliding window (keys i - window .. i) or a chunk keeps."""
    q = torch.arange(seqlen)[:, None]
    k = torch.arange(seqlen)[None, :]
    visible = k <= q
    if window is not None:
        visible &= k >= q - window
    if chunk is not None:
        visible &= (k // chunk) == (q // chunk)
    return int(visible.sum())


def window_mask_mod(window, chunk):
    """FlexAttention mask_mod of causal attention within a sliding window and / or a chunk."""

    def mask_mod(b, h, q_idx, kv_idx):
        keep = kv_idx <= q_idx
        if window is not None:
            keep = keep & (kv_idx >= q_idx - window)
        if chunk is not None:
            keep = keep & ((kv_idx // chunk) == (q_idx // chunk))
        return keep

    return mask_mod


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--no-flex", action="store_true")
    parser.add_argument(
        "--tiles",
        action="store_true",
        help="also time smaller K/V tiles (BM128 BN64, BM64 BN64): fewer masked columns per edge",
    )
    args = parser.parse_args()
    torch.manual_seed(0)
    if ON_GPU:
        batch, heads, seqlen, dim = 2, 16, 8192, 128
        windows, chunks = (128, 512, 2048, 8192), (256, 1024, 4096, 8192)
    else:
        batch, heads, seqlen, dim = 1, 2, 64, 32
        windows, chunks = (8, 32), (16,)
    device = "cuda" if ON_GPU else "cpu"
    q, k, v = (torch.randn(batch, seqlen, heads, dim, device=device, dtype=torch.bfloat16) for _ in range(3))
    q_t, k_t, v_t = (x.transpose(1, 2) for x in (q, k, v))
    cases = [(f"window {w}", SlidingWindow(w, 0), w, None) for w in windows]
    cases += [(f"chunk {c}", Chunked(c), None, c) for c in chunks]
    rows = []
    for name, mask, window, chunk in cases:
        pairs = visible_pairs(seqlen, window, chunk) * batch * heads
        fn = lambda mask=mask: attention(q, k, v, causal=True, mask=mask)  # noqa: E731
        out = fn()
        if not ON_GPU:
            expected = attention_reference(q, k, v, causal=True, mask=mask)
            error = ((out.float() - expected.float()).norm() / expected.float().norm()).item()
            assert error < 2e-2, f"{name}: rel. error {error:.2e}"
        if ON_GPU:
            ms = time_ms(fn)
        else:
            started = time.perf_counter()
            fn()
            ms = (time.perf_counter() - started) * 1e3
        row = dict(
            mask=name,
            visible_pairs_m=pairs / 1e6,
            ms=ms,
            ns_per_m_pairs=ms * 1e6 / (pairs / 1e6),
            tflops=4 * pairs * dim / ms / 1e9,
            flex_ms="not run",
        )
        if args.tiles and ON_GPU:
            base = default_config(dim, q.dtype, q.device).replace(warp_specialized=False)  # portable
            for label, config in (
                ("ms_bm128_bn64", base.replace(BN=64)),
                ("ms_bm64_bn64", base.replace(BM=64, BN=64, num_warps=4)),
            ):
                try:
                    tiled = lambda mask=mask, config=config: attention(
                        q,
                        k,
                        v,
                        causal=True,
                        mask=mask,  # noqa: E731
                        config=config,
                    )
                    error = ((tiled().float() - out.float()).norm() / out.float().norm()).item()
                    row[label] = time_ms(tiled) if error < 2e-2 else f"WRONG ({error:.1e})"
                except Exception as exc:  # noqa: BLE001 - a config that does not compile is a result too
                    row[label] = f"fails ({type(exc).__name__})"
        if ON_GPU and not args.no_flex:
            try:
                flex = flex_runner(q_t, k_t, v_t, window_mask_mod(window, chunk))
                flex()
                row["flex_ms"] = time_ms(flex)
            except Exception as exc:  # noqa: BLE001 - a peer that fails is reported
                row["flex_ms"] = f"fails ({type(exc).__name__})"
        rows.append(row)
        print(row, flush=True)
    device_name = torch.cuda.get_device_name() if ON_GPU else "cpu-interpreter"
    out_dir = args.out or default_out_dir("bench_attention_window")
    table = write_table(
        rows,
        out_dir,
        "attention_window",
        f"Sliding-window and chunked attention on {device_name}",
        f"bf16 causal prefill {batch}x{heads}x{seqlen}x{dim}; `ns_per_m_pairs`: time per million "
        "visible query-key pairs (flat = time proportional to the visible area); `tflops` counts "
        "visible pairs only; `flex_ms`: FlexAttention with the same block mask.",
    )
    write_png(rows, out_dir)
    print(table)


def write_png(rows, out_dir):
    """Milliseconds against visible pairs, one panel per mask family, llmkernels and FlexAttention."""
    panels = {}
    for row in rows:
        family = row["mask"].split()[0]
        for impl, key in (("llmkernels", "ms"), ("flex", "flex_ms")):
            if isinstance(row[key], float):
                panels.setdefault(f"{family} (causal)", {}).setdefault(impl, []).append(
                    (row["visible_pairs_m"], row[key])
                )
    line_plots(
        panels,
        "visible query-key pairs (millions)",
        "ms",
        os.path.join(out_dir, "attention_window.png"),
        "time against the visible area",
    )


if __name__ == "__main__":
    main()
