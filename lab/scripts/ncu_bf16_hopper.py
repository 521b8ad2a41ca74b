"""Our bf16_hopper grouped matmul beside torch._grouped_mm at E16 x 4096 tokens, N 7168, K 2048 (0.97x there), and the
lab Gluon bf16 x MXFP4 kernel at E8 x 2048, N 4096, K 7168, for Nsight Compute; only the NVTX range "profile" counts.

    PYTHONPATH=src:lab/gluon_w4:. ncu --nvtx --nvtx-include "profile/" --section ... python lab/scripts/ncu_bf16_hopper.py
"""

from __future__ import annotations

import torch

import llmkernels as lk


def main() -> None:
    torch.manual_seed(0)
    experts, per, n, k = 16, 4096, 7168, 2048
    a = torch.randn(experts * per, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(experts, n, k, device="cuda", dtype=torch.bfloat16) * k**-0.5
    offsets = torch.arange(0, experts * per + 1, per, device="cuda", dtype=torch.int32)
    ids = torch.arange(experts, device="cuda", dtype=torch.int32)
    b_t = b.transpose(-2, -1)
    from gluon_kernel import W4GluonConfig, prepare_weights, w4_grouped_matmul_gluon

    x4 = torch.randn(8 * 2048, 7168, device="cuda", dtype=torch.bfloat16)
    w4 = prepare_weights(lk.quantize(torch.randn(8, 4096, 7168, device="cuda") * 7168**-0.5, "mxfp4"))
    off4 = torch.arange(0, 8 * 2048 + 1, 2048, device="cuda", dtype=torch.int32)
    ids4 = torch.arange(8, device="cuda", dtype=torch.int32)
    config = W4GluonConfig(2, block_t=256)  # the best at this shape
    for _ in range(2):
        lk.grouped_matmul(a, b, offsets, ids)
        torch._grouped_mm(a, b_t, offs=offsets[1:], out_dtype=torch.bfloat16)
        w4_grouped_matmul_gluon(x4, w4, off4, ids4, config=config)
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_push("profile")
    lk.grouped_matmul(a, b, offsets, ids)
    torch._grouped_mm(a, b_t, offs=offsets[1:], out_dtype=torch.bfloat16)
    w4_grouped_matmul_gluon(x4, w4, off4, ids4, config=config)
    torch.cuda.nvtx.range_pop()
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
