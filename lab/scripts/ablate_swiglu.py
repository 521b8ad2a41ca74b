"""The fused SwiGLU epilogue against the plain gate_up matmul of the same shape, on the GPU.

    python -m benchmarks ablate_swiglu [--out DIR]

SwiGLU configs take half the plain config's block_n (a SwiGLU tile loads the gate and the up rows of
B, so it reads the same B bytes per stage as the plain tile; the full block_n overflows shared
memory). This measures what that costs: the same [E·t, H] × [E, 2I, H] product with
``epilogue=None`` (out [E·t, 2I]) and ``epilogue="swiglu"`` (out [E·t, I]), default configs, both
checked against the reference first, then SwiGLU candidates with the full block_n where they fit
shared memory (``tools/compile_defaults.py`` checks that offline). Writes ablate_swiglu.{csv,md}.
"""
from __future__ import annotations

import argparse

import torch

from benchmarks.common import default_out_dir, measure_ceilings, time_ms, write_table  # noqa: E402

import llmkernels as lk  # noqa: E402
from llmkernels._testing import relative_error  # noqa: E402
from llmkernels.grouped_matmul import BlockScaledMatmulConfig, default_launches  # noqa: E402
from llmkernels._runtime import num_programs_hint  # noqa: E402

SHAPES = {"DeepSeek-V3": (256, 2048, 7168), "Qwen3-30B-A3B": (128, 768, 2048), "gpt-oss-120b": (128, 2880, 2880)}
TOKENS_PER_EXPERT = (16, 64, 512)
PAIRS = {"bf16": ("bf16", "bf16"), "mxfp8": ("mxfp8", "mxfp8"), "bf16 x mxfp4": ("bf16", "mxfp4")}
ELEMENT = {"bf16": "bf16", "mxfp8": "e4m3", "mxfp4": "e2m1"}
C = BlockScaledMatmulConfig
# SwiGLU candidates per (pair, regime): (block_m, block_n, block_k, stages, warps, two per SM, swap[, upcast_a[, mma]])
CANDIDATES = {
    ("bf16", "decode"): [(16, 128, 128, 2, 4, True, True), (16, 128, 128, 3, 4, False, True)],
    ("mxfp8", "decode"): [(16, 128, 256, 2, 4, True, False), (16, 128, 128, 4, 4, True, False)],
    ("bf16 x mxfp4", "decode"): [(16, 128, 128, 4, 4, True, True)],
    ("bf16", "compute"): [(128, 256, 64, 2, 8, False, False), (128, 128, 64, 4, 8, False, False)],
    ("mxfp8", "compute"): [(128, 128, 128, 3, 8, False, False, True), (256, 64, 64, 3, 8, False, False, True),
                           (128, 128, 64, 4, 8, False, False, True), (256, 64, 128, 2, 8, False, False, True)],
    ("bf16 x mxfp4", "compute"): [(128, 128, 128, 3, 8, False, False), (256, 64, 64, 3, 8, False, False),
                                  (128, 128, 64, 4, 8, False, False),
                                  (256, 64, 64, 3, 8, False, False, False, "dequant"),
                                  (128, 128, 128, 3, 8, False, False, False, "dequant"),
                                  (128, 128, 64, 4, 8, False, False, False, "dequant")],
}


def _operand(x, fmt):
    return x.to(torch.bfloat16) if fmt == "bf16" else lk.quantize(x, fmt)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--tokens", default=",".join(map(str, TOKENS_PER_EXPERT)), help="tokens per expert to run")
    parser.add_argument("--pairs", default=",".join(PAIRS), help="format pairs to run")
    args = parser.parse_args()
    tokens_per_expert = [int(t) for t in args.tokens.split(",")]
    torch.manual_seed(0)
    ceilings = measure_ceilings()
    rows = []
    for model, (experts, intermediate, hidden) in SHAPES.items():
        weight = torch.randn(experts, 2 * intermediate, hidden, device="cuda", dtype=torch.bfloat16) * hidden**-0.5
        for pair in args.pairs.split(","):
            a_fmt, b_fmt = PAIRS[pair]
            b = _operand(weight, b_fmt)
            for t in tokens_per_expert:
                total = experts * t
                a = _operand(torch.randn(total, hidden, device="cuda"), a_fmt)
                offsets = torch.arange(0, total + 1, t, device="cuda", dtype=torch.int32)
                ids = torch.arange(experts, device="cuda", dtype=torch.int32)
                times = {}
                regime = "decode" if t <= 64 else "compute"
                variants = [(None, None), ("swiglu", None)]
                if t <= 16 or t > 64:
                    for bm, bn, bk, stages, warps, two, swap, *extra in CANDIDATES.get((pair, regime), []):
                        programs = 2 * num_programs_hint(a.device) if two else None
                        mma = extra[1] if len(extra) > 1 else "dequant" if regime == "decode" else "auto"
                        variants.append(("swiglu", C(bm, bn, bk, stages, warps, programs, mma, swap,
                                                     upcast_a=bool(extra and extra[0]))))
                for epilogue, config in variants:
                    run = lambda: lk.grouped_matmul(a, b, offsets, ids, epilogue=epilogue, config=config)  # noqa: E731
                    error = relative_error(run(), lk.grouped_matmul_reference(a, b, offsets, ids, epilogue=epilogue))
                    ms = time_ms(run) if error < 2e-2 else float("nan")
                    times.setdefault(epilogue, ms)
                    swiglu = epilogue == "swiglu"
                    if config is None:
                        weight_bytes = (b.data if isinstance(b, lk.ScaledTensor) else b).nbytes
                        config = default_launches(total, experts, intermediate if swiglu else 2 * intermediate,
                                                  hidden, a.device, ELEMENT[a_fmt], ELEMENT[b_fmt], weight_bytes,
                                                  swiglu)[0][0]
                        label = "default"
                    else:
                        label = "candidate"
                    rows.append({"model": model, "formats": pair, "tokens/expert": t,
                                 "epilogue": epilogue or "none", "config": label, "us": ms * 1e3,
                                 "vs plain": ms / times[None],
                                 "tile": f"{config.block_m}x{config.block_n}x{config.block_k} s{config.num_stages} "
                                         f"w{config.num_warps}{' 2/SM' if config.num_programs else ''}"
                                         f"{' swap' if config.ab_swapped else ''}"
                                         f"{' upcast' if config.upcast_a else ''} {config.mma}",
                                 "rel err": error})
                    print(rows[-1], flush=True)
        del weight
        torch.cuda.empty_cache()
    notes = (f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}; ceilings {ceilings}. Median times "
             "(do_bench); 'default' rows: default configs, 'candidate' rows: SwiGLU tiles tried; balanced "
             "routing, t tokens per expert; out is [E·t, 2I] (plain) or [E·t, I] (swiglu).")
    print(write_table(rows, args.out or default_out_dir(), "ablate_swiglu", "SwiGLU epilogue vs plain gate_up",
                      notes))


if __name__ == "__main__":
    main()
