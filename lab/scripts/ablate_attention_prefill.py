"""Prefill configs and FA4 switches of llmkernels.attention on this GPU, next to SDPA cuDNN and flash.

    python -m benchmarks ablate_attention_prefill [--out DIR] [--heads-dims 128,64,256]

For each prefill shape (bf16, B x H x S x D, causal and not): a sweep of (BM, BN, num_kv_stages,
num_warps) with and without TMA loads of the fully visible band (``tma_kv``) and Triton's warp
specialization, then the FA4 switches on the best tile (rescale threshold 8 vs 0, polynomial exp2,
two Q tiles, the next tile's Q K^T issued before the softmax), and the peers. Each variant
is checked against SDPA's flash output first (rel. error < 2e-2) and timed with do_bench (median).
Writes ``ablate_attention_prefill.{csv,md}``; the table's ``vs cuDNN`` column is cuDNN time / ours.
"""
from __future__ import annotations

import argparse
import time

import torch

from benchmarks.common import default_out_dir, time_ms, write_table  # noqa: E402
from benchmarks.peers import sdpa_runner  # noqa: E402

from llmkernels.attention.api import attention  # noqa: E402
from llmkernels.attention.config import FA4Config, default_config  # noqa: E402

SHAPES = {128: (4, 16, 4096, 128), 64: (8, 16, 2048, 64), 256: (4, 8, 4096, 256)}
# (BM, BN, num_kv_stages, num_warps, tma_kv) per head dim, threshold 0. Triton's automatic warp
# specialization and a software-pipelined Q K^T were measured here and lost (benchmarks/NOTES.md); they
# left the product, so they are no longer candidates.
TILES = {
    128: [(128, 128, 3, 8, True), (128, 128, 3, 8, False), (128, 128, 2, 8, True), (64, 64, 3, 4, True),
          (64, 64, 4, 4, True)],
    64: [(128, 128, 3, 8, True), (128, 128, 4, 8, True), (128, 128, 3, 8, False), (128, 64, 3, 4, True),
         (64, 64, 3, 4, True), (64, 64, 4, 4, True)],
    256: [(128, 64, 2, 8, True), (128, 64, 2, 8, False), (64, 64, 2, 4, True), (64, 64, 3, 4, True),
          (128, 32, 3, 8, True), (64, 32, 3, 4, True)],
}
# FA4 switches measured on the best tile of each problem
SWITCHES = {128: {"threshold=8": dict(rescale_threshold=8.0), "poly_exp2=0.25": dict(poly_exp2_fraction=0.25),
                  "poly_exp2=0.5": dict(poly_exp2_fraction=0.5), "two_q_tiles BM=256": dict(BM=256, num_q_tiles=2)},
            64: {"threshold=8": dict(rescale_threshold=8.0)},
            256: {"threshold=8": dict(rescale_threshold=8.0)}}
PEERS = {"sdpa_cudnn": "cudnn", "sdpa_flash": "flash"}


def checked_time(fn, expected) -> tuple[float, str]:
    """Median ms of ``fn`` if its output is within 2e-2 of ``expected`` (NaN and a note otherwise)."""
    try:
        error = ((fn().float() - expected).norm() / expected.norm()).item()
        if error >= 2e-2:
            return float("nan"), f"WRONG {error:.1e}"
        return time_ms(fn), ""
    except Exception as exc:  # noqa: BLE001 - a config that fails to compile is a result
        return float("nan"), f"fails: {type(exc).__name__} {str(exc)[:60]}"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--head-dims", default="128,64,256")
    parser.add_argument("--budget", type=float, default=520.0, help="seconds; no new variant after this")
    args = parser.parse_args()
    start = time.perf_counter()
    torch.manual_seed(0)
    rows = []
    for head_dim in (int(d) for d in args.head_dims.split(",")):
        batch, heads, seqlen, _ = SHAPES[head_dim]
        q, k, v = (torch.randn(batch, seqlen, heads, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        q_t, k_t, v_t = (x.transpose(1, 2) for x in (q, k, v))
        # the portable kernel's variants (on sm_90 the default takes the Gluon kernel, whose tiles are fixed)
        default = default_config(head_dim, torch.bfloat16, q.device).replace(warp_specialized=False)
        for causal in (False, True):
            problem = f"{batch}x{heads}x{seqlen}x{head_dim}{' causal' if causal else ''}"
            flops = 4 * batch * heads * seqlen * seqlen * head_dim * (0.5 if causal else 1.0)
            peer_ms = {}
            for name, backend in PEERS.items():
                peer_ms[name] = time_ms(sdpa_runner(backend, q_t, k_t, v_t, causal=causal))
            expected = sdpa_runner("flash", q_t, k_t, v_t, causal=causal)().transpose(1, 2).float()

            def add_row(variant, ms, note=""):
                rows.append(dict(problem=problem, variant=variant, ms=ms, tflops=flops / ms / 1e9,
                                 vs_cudnn=peer_ms["sdpa_cudnn"] / ms, vs_flash=peer_ms["sdpa_flash"] / ms, note=note))
                print(rows[-1], flush=True)

            variants = [("default", default)]
            for bm, bn, stages, warps, tma in TILES[head_dim]:
                variants.append((f"BM{bm} BN{bn} s{stages} w{warps}{' tma' if tma else ''}",
                                 FA4Config(BM=bm, BN=bn, num_kv_stages=stages, num_warps=warps, tma_kv=tma,
                                           rescale_threshold=0.0)))
            for name, config in variants:
                if time.perf_counter() - start > args.budget:
                    break
                add_row(name, *checked_time(lambda: attention(q, k, v, causal=causal, config=config), expected))
            best = min((r for r in rows if r["problem"] == problem and r["ms"] == r["ms"] and r["variant"] != "default"),
                       key=lambda r: r["ms"], default=None)
            if best is not None and time.perf_counter() - start < args.budget:
                config = next(c for n, c in variants if n == best["variant"])
                for switch, changes in SWITCHES[head_dim].items():
                    add_row(f"{best['variant']} {switch}", *checked_time(
                        lambda: attention(q, k, v, causal=causal, config=config.replace(**changes)), expected))
            for name, ms in peer_ms.items():
                add_row(name, ms)
        del q, k, v, q_t, k_t, v_t
    table = write_table(rows, args.out or default_out_dir(), "ablate_attention_prefill",
                        f"Attention prefill configs on {torch.cuda.get_device_name()}",
                        "bf16; threshold 0 unless named; `vs_cudnn` / `vs_flash`: peer time / this time (> 1: ours faster).")
    print(table)


if __name__ == "__main__":
    main()
