"""The lab FP8 attention kernel (default variant) once at 4x16x4096x128, full, for Nsight Compute; only the NVTX range
"profile" counts.

    PYTHONPATH=src:.:lab/gluon_fp8_attention ncu --nvtx --nvtx-include "profile/" --set full \
        python lab/gluon_fp8_attention/ncu_fp8_attention.py [causal]
"""

from __future__ import annotations

import sys

import torch
from fp8_attention import fp8_attention


def main() -> None:
    causal = "causal" in sys.argv[1:]
    torch.manual_seed(0)
    b, s, h, d = 4, 4096, 16, 128
    q, k, v = (torch.randn(b, s, h, d, device="cuda").to(torch.float8_e4m3fn) for _ in range(3))
    ones = torch.ones(b, h, device="cuda")
    for _ in range(2):
        fp8_attention(q, k, v, ones, ones, ones, causal=causal)
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_push("profile")
    fp8_attention(q, k, v, ones, ones, ones, causal=causal)
    torch.cuda.nvtx.range_pop()
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
