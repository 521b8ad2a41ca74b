"""One launch of the w4a8 Gluon kernel (default config) at E8 x 2048 tokens, N 4096, K 7168, for Nsight Compute; the
product's fp8_hopper kernel on FP8 blocks beside it as the reference of a loop at the FP8 rate.

    PYTHONPATH=src:lab/gluon_w4 ncu --section SpeedOfLight --section SchedulerStats --section WarpStateStats \
        --section InstructionStats --section ComputeWorkloadAnalysis -k regex:"w4a8|fp8_hopper" -c 4 \
        python lab/scripts/ncu_w4a8.py

Each runs twice (the first compiles); profile the second.
"""

from __future__ import annotations

import torch
from gluon_w4a8 import prepare_weights, w4a8_grouped_matmul_gluon

import llmkernels as lk

E, T, N, K = 8, 2048, 4096, 7168


def main() -> None:
    torch.manual_seed(0)
    x = torch.randn(E * T, K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(E, N, K, device="cuda", dtype=torch.bfloat16) * K**-0.5
    offsets = torch.arange(0, E * T + 1, T, device="cuda", dtype=torch.int32)
    ids = torch.arange(E, device="cuda", dtype=torch.int32)
    a = lk.quantize(x, "fp8", block=(1, 128))
    prepared = prepare_weights(lk.quantize(w, "mxfp4"))
    w_fp8 = lk.quantize(w, "fp8", block=(128, 128))
    for _ in range(2):
        w4a8_grouped_matmul_gluon(a, prepared, offsets, ids)
        lk.grouped_matmul(a, w_fp8, offsets, ids)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
