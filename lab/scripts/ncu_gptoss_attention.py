"""gpt-oss's attention where ours trails cuDNN (D 64, Hq 64, Hkv 8, 16 x 1024 causal: 0.63x) and under its 128-token
window, beside cuDNN's causal kernel, for Nsight Compute; only the NVTX range "profile" counts.

    PYTHONPATH=src:. ncu --nvtx --nvtx-include "profile/" --section ... python lab/scripts/ncu_gptoss_attention.py
"""

from __future__ import annotations

import torch

from llmkernels.attention.api import attention
from llmkernels.attention.masks import SlidingWindow


def main() -> None:
    torch.manual_seed(0)
    batch, seqlen, heads, kv_heads, head_dim = 16, 1024, 64, 8, 64
    q = torch.randn(batch, seqlen, heads, head_dim, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(batch, seqlen, kv_heads, head_dim, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(batch, seqlen, kv_heads, head_dim, device="cuda", dtype=torch.bfloat16)
    q_t, k_t, v_t = (x.transpose(1, 2) for x in (q, k, v))
    window = SlidingWindow(127, 0)

    def calls():
        attention(q, k, v, causal=True)
        attention(q, k, v, causal=True, mask=window)
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.CUDNN_ATTENTION):
            torch.nn.functional.scaled_dot_product_attention(q_t, k_t, v_t, is_causal=True, enable_gqa=True)

    for _ in range(2):
        calls()
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_push("profile")
    calls()
    torch.cuda.nvtx.range_pop()
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
