"""One launch each of the FP8-tensor-core attempts at E8 x 2048 tokens, N 4096, K 7168, for Nsight Compute.

    PYTHONPATH=src:lab/mxfp8_fp8tc:. ncu --set full -k regex:"mxfp8|w4a8|fp8_hopper" \
        python lab/scripts/ncu_fp8tc_attempts.py

Launches: the Gluon MXFP8 x MXFP8 kernel with per-32-K promotion (lab/mxfp8_fp8tc, v2), the w4a8 Triton prototype
(lab/w4a8, default compute config) and, as the reference of a kernel that reaches the FP8 rate, the library's
fp8_hopper kernel on FP8 blocks. Each runs twice (the first compiles); profile the second.
"""

from __future__ import annotations

import importlib.util
import os
import sys

import torch
from gluon_kernel import VARIANTS, b_exponent_factors, mxfp8_grouped_matmul_gluon

import llmkernels as lk

# both lab folders name their Triton prototype kernel.py: w4a8's is loaded by path
_spec = importlib.util.spec_from_file_location(
    "w4a8_kernel", os.path.join(os.path.dirname(__file__), "..", "w4a8", "kernel.py")
)
w4a8 = sys.modules["w4a8_kernel"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(w4a8)

E, T, N, K = 8, 2048, 4096, 7168


def main() -> None:
    torch.manual_seed(0)
    x = torch.randn(E * T, K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(E, N, K, device="cuda", dtype=torch.bfloat16) * K**-0.5
    offsets = torch.arange(0, E * T + 1, T, device="cuda", dtype=torch.int32)
    ids = torch.arange(E, device="cuda", dtype=torch.int32)
    a_mx, w_mx = lk.quantize(x, "mxfp8"), lk.quantize(w, "mxfp8")
    a_exps, b_exps = a_mx.scales.view(torch.uint8), w_mx.scales.view(torch.uint8)
    v2 = VARIANTS[1]
    factors = b_exponent_factors(b_exps, v2.factor_dtype)
    a_fp8 = lk.quantize(x, "fp8", block=(1, 128))
    w_fp4 = lk.quantize(w, "mxfp4")
    w_fp8 = lk.quantize(w, "fp8", block=(128, 128))
    for _ in range(2):
        mxfp8_grouped_matmul_gluon(a_mx.data, a_exps, w_mx.data, b_exps, offsets, ids, config=v2, b_factors=factors)
        w4a8.w4a8_grouped_matmul(a_fp8, w_fp4, offsets, ids, config=w4a8.COMPUTE_CONFIG)
        lk.grouped_matmul(a_fp8, w_fp8, offsets, ids)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
