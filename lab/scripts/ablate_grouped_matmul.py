"""Ablations for the grouped matmul on the GPU: MMA path and tile configs per format and regime.

    python -m benchmarks ablate_grouped_matmul [--out DIR] [--formats mxfp8,mxfp4] [--budget-s 240]
        [--tiles list|default] [--mma ...] [--swap 0,1] [--prefetch 0,1] [--words 0,1] [--upcast 0,1]
        [--maxnreg 0,168] [--per-sm 2,3]

Switches left out take default_config's value for the problem (``--prefetch``, ``--words``, ``--upcast``,
``--mma``, ``--swap``); ``--tiles default`` with ``--per-sm`` varies only the programs per SM.

Every variant is checked against the reference (relative error printed) before it is timed; each
regime also times ``torch._grouped_mm`` in bf16 on the same problem (the `vs _grouped_mm` column).
Writes ablate_grouped_matmul.{csv,md} to DIR.
"""
from __future__ import annotations

import argparse
import itertools
import time

import torch

from benchmarks.common import default_out_dir, measure_ceilings, time_ms, write_table, zipf_offsets  # noqa: E402

import llmkernels as lk  # noqa: E402
from llmkernels._testing import relative_error  # noqa: E402
from llmkernels.grouped_matmul import default_config  # noqa: E402

REGIMES = {  # (experts, tokens per expert, N, K)
    "compute": (8, 2048, 4096, 7168),
    "compute_256": (8, 2048, 4096, 7168),  # the same problem, the 256-row tile family
    "decode": (128, 16, 4096, 7168),
    "decode64": (128, 64, 4096, 7168),
    "decode_zipf": (128, 16, 4096, 7168),  # Zipf-routed, same token count as "decode"
    "decode_e2m1": (128, 16, 4096, 7168),  # the decode problem, deeper and wider tiles for 4-bit weights
    "compute_e2m1": (8, 2048, 4096, 7168),
    "decode_occupancy": (128, 16, 4096, 7168),  # smaller B tiles, more programs per SM
    "decode_e4m3": (128, 16, 4096, 7168),
    "decode64_e4m3": (128, 64, 4096, 7168),
}
PAIRS = {"bf16": ("bf16", "bf16"), "mxfp8": ("mxfp8", "mxfp8"), "mxfp4": ("mxfp4", "mxfp4"),
         "nvfp4": ("nvfp4", "nvfp4"), "w4a16": ("bf16", "mxfp4"), "w8a16": ("bf16", "mxfp8"),
         "w4a16nv": ("bf16", "nvfp4")}
# (block_m, block_n, block_k, stages, warps, programs per SM); swap-AB and the MMA path follow
# default_config and mma="auto" unless --mma/--swap say otherwise.
TILES = {
    "compute": [(128, 128, 128, 3, 8, 1), (128, 256, 64, 3, 8, 1), (256, 128, 64, 3, 8, 1), (128, 128, 64, 4, 8, 1)],
    "compute_256": [(256, 128, 64, 3, 8, 1), (256, 128, 64, 4, 8, 1), (256, 128, 128, 2, 8, 1), (256, 64, 128, 3, 8, 1),
                    (128, 256, 64, 3, 8, 1)],
    "decode": [(16, 128, 128, 4, 4, 1), (16, 128, 128, 4, 4, 2), (16, 128, 128, 4, 4, 3),
               (16, 128, 128, 4, 8, 1), (16, 128, 128, 4, 8, 2), (16, 64, 128, 4, 4, 2), (16, 128, 256, 3, 4, 2),
               (64, 128, 128, 4, 4, 2), (64, 128, 128, 3, 8, 2)],
    "decode_zipf": [(16, 128, 128, 4, 4, 2), (16, 128, 256, 3, 4, 2), (32, 128, 128, 4, 4, 2),
                    (64, 128, 128, 4, 4, 2), (64, 128, 128, 3, 8, 2)],
    # 4-bit B tiles hold a quarter of a bf16 tile's bytes: more of them must be in flight per SM
    "decode_e2m1": [(16, 128, 128, 4, 4, 2), (16, 128, 128, 8, 4, 2), (16, 128, 256, 4, 4, 2), (16, 128, 256, 6, 4, 2),
                    (16, 128, 512, 3, 4, 2), (16, 128, 512, 4, 4, 2), (16, 128, 128, 4, 4, 3), (16, 128, 256, 4, 4, 3),
                    (16, 64, 256, 6, 4, 3), (16, 256, 256, 3, 4, 2), (16, 128, 256, 4, 8, 2)],
    "decode_occupancy": [(16, 128, 128, 4, 4, 2), (16, 128, 64, 4, 4, 3), (16, 128, 64, 6, 4, 4), (16, 64, 128, 4, 4, 3),
                         (16, 64, 128, 4, 4, 4), (16, 64, 256, 4, 4, 3), (16, 64, 64, 6, 4, 4), (16, 128, 128, 4, 2, 4)],
    "decode_e4m3": [(16, 128, 256, 3, 4, 2), (16, 64, 128, 4, 4, 3), (16, 64, 128, 5, 4, 3), (16, 64, 256, 3, 4, 3),
                    (16, 64, 128, 4, 4, 4), (16, 128, 128, 4, 4, 3)],
    "decode64_e4m3": [(64, 128, 128, 4, 4, 2), (64, 128, 128, 3, 8, 2), (64, 64, 128, 4, 4, 3), (64, 64, 128, 4, 4, 4),
                      (64, 64, 256, 3, 4, 3)],
    "compute_e2m1": [(256, 128, 64, 3, 8, 1), (256, 128, 64, 4, 8, 1), (256, 128, 128, 3, 8, 1), (256, 64, 128, 3, 8, 1),
                     (128, 256, 64, 3, 8, 1)],
    "decode64": [(16, 128, 128, 4, 4, 1), (64, 128, 128, 4, 4, 1), (64, 128, 128, 4, 4, 2),
                 (64, 128, 128, 3, 8, 1), (64, 128, 128, 3, 8, 2), (32, 128, 128, 4, 4, 2)],
}
ELEMENT = {"bf16": "bf16", "mxfp8": "e4m3", "mxfp4": "e2m1", "nvfp4": "e2m1"}


def _operand(x, fmt):
    return x.to(torch.bfloat16) if fmt == "bf16" else lk.quantize(x, fmt)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    parser.add_argument("--formats", default="mxfp8,mxfp4,w4a16,nvfp4")
    parser.add_argument("--regimes", default="compute,decode")
    parser.add_argument("--budget-s", type=float, default=240)
    parser.add_argument("--mma", default="default", help="default (default_config's), or comma-separated paths")
    parser.add_argument("--swap", default="default", help="default, or comma-separated 0/1")
    parser.add_argument("--tiles", default="list", help="list (the TILES of the regime) or default (default_config's)")
    parser.add_argument("--prefetch", default="default", help="default, or comma-separated 0/1: config.prefetch_scales")
    parser.add_argument("--words", default="default", help="default, or comma-separated 0/1: config.scale_words")
    parser.add_argument("--upcast", default="default", help="default, or comma-separated 0/1: config.upcast_a")
    parser.add_argument("--per-sm", default="", help="with --tiles default: comma-separated programs per SM")
    args = parser.parse_args()
    started = time.time()
    ceilings = measure_ceilings()
    sm_count = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    torch.manual_seed(0)
    for regime in args.regimes.split(","):
        num_experts, tokens_per_expert, n, k = REGIMES[regime]
        tokens = num_experts * tokens_per_expert
        x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(num_experts, n, k, device="cuda", dtype=torch.bfloat16) * k**-0.5
        offsets = torch.arange(num_experts + 1, dtype=torch.int32, device="cuda") * tokens_per_expert
        if regime.endswith("_zipf"):
            offsets = zipf_offsets(num_experts, tokens)
        ids = torch.arange(num_experts, dtype=torch.int32, device="cuda")
        x_bf16, w_t = x.to(torch.bfloat16), w.transpose(-2, -1)
        peer_ms = time_ms(lambda: torch._grouped_mm(x_bf16, w_t, offs=offsets[1:], out_dtype=torch.bfloat16))
        rows.append({"regime": regime, "pair": "torch._grouped_mm bf16", "mma": "", "tile": "", "swap": "",
                     "prefetch": "", "words": "", "upcast": "", "stages": "", "warps": "", "programs/SM": "", "us": peer_ms * 1e3,
                     "TFLOP/s": 2.0 * tokens * n * k / peer_ms / 1e9,
                     "weight GB/s": num_experts * n * k * 2 / peer_ms / 1e6,
                     "% copy": 100 * num_experts * n * k * 2 / peer_ms / 1e6 / ceilings["copy_gbps"],
                     "vs _grouped_mm": 1.0, "rel err": 0.0})
        weight_bytes = {"bf16": 2, "mxfp8": 1 + 1 / 32, "mxfp4": 0.5 + 1 / 32, "nvfp4": 0.5 + 1 / 16}
        for name in args.formats.split(","):
            fa, fb = PAIRS[name]
            a, b = _operand(x, fa), _operand(w, fb)
            expected = lk.grouped_matmul_reference(a, b, offsets, ids)
            base = default_config(tokens, num_experts, n, k, x.device, ELEMENT[fa], ELEMENT[fb])
            swaps = [base.ab_swapped] if args.swap == "default" else [bool(int(v)) for v in args.swap.split(",")]
            mmas = [base.mma] if args.mma == "default" else args.mma.split(",")
            prefetches = ([base.prefetch_scales] if args.prefetch == "default"
                          else [bool(int(v)) for v in args.prefetch.split(",")])
            words = [base.scale_words] if args.words == "default" else [bool(int(v)) for v in args.words.split(",")]
            upcasts = [base.upcast_a] if args.upcast == "default" else [bool(int(v)) for v in args.upcast.split(",")]
            per_sms = [int(v) for v in args.per_sm.split(",")] if args.per_sm else [
                (base.num_programs or sm_count) // sm_count]
            tiles = TILES[regime] if args.tiles == "list" else [
                (base.block_m, base.block_n, base.block_k, base.num_stages, base.num_warps, per_sm)
                for per_sm in per_sms]
            variants = itertools.product(tiles, mmas, swaps, prefetches, upcasts, words)
            for (bm, bn, bk, stages, warps, per_sm), mma, swapped, prefetch, upcast, word in variants:
                if upcast and fa == "bf16":
                    continue
                if time.time() - started > args.budget_s:
                    break
                if mma == "dot_scaled" and not (fb in ("mxfp8", "mxfp4") and fa in ("bf16", "mxfp8", "mxfp4")):
                    continue
                config = lk.BlockScaledMatmulConfig(bm, bn, bk, stages, warps, num_programs=per_sm * sm_count,
                                                    mma=mma, ab_swapped=swapped, prefetch_scales=prefetch,
                                                    upcast_a=upcast, scale_words=word)
                try:
                    out = lk.grouped_matmul(a, b, offsets, ids, config=config)
                    error = relative_error(out.float(), expected)
                    ms = time_ms(lambda: lk.grouped_matmul(a, b, offsets, ids, config=config))
                except Exception as exc:  # noqa: BLE001 - a variant that fails to compile is a result too
                    print(f"{regime} {name} {config}: {type(exc).__name__}: {str(exc)[:200]}")
                    error, ms = float("nan"), float("nan")
                tflops = 2.0 * tokens * n * k / ms / 1e9
                weight_gbps = num_experts * n * k * weight_bytes[fb] / ms / 1e6
                rows.append({"regime": regime, "pair": name, "mma": mma, "tile": f"{bm}x{bn}x{bk}", "swap": swapped,
                             "prefetch": prefetch, "words": word, "upcast": upcast, "stages": stages, "warps": warps, "programs/SM": per_sm,
                             "us": ms * 1e3, "TFLOP/s": tflops,
                             "weight GB/s": weight_gbps, "% copy": 100 * weight_gbps / ceilings["copy_gbps"],
                             "vs _grouped_mm": peer_ms / ms, "rel err": error})
                print(rows[-1], flush=True)
            del expected
    out_dir = args.out or default_out_dir()
    print(write_table(rows, out_dir, "ablate_grouped_matmul", "Grouped matmul ablations",
                      f"{torch.cuda.get_device_name()}; ceilings {ceilings}"))


if __name__ == "__main__":
    main()
