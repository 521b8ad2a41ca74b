"""A few calls of the Gluon Hopper attention kernel under compute-sanitizer (memcheck: no access outside q, k, v,
out, lse; synccheck: barriers). Each call's output is checked against the float32 reference too.

    compute-sanitizer --tool memcheck python -m benchmarks.sanitize_gluon_hopper
"""
from __future__ import annotations

import torch

from llmkernels.attention.gluon_hopper import gluon_attention
from llmkernels.attention.reference import attention_reference

CASES = [  # (B, Sq, Skv, Hq, Hkv, D, causal, window)
    (2, 300, 1000, 4, 2, 64, True, None),
    (1, 1000, 200, 2, 1, 128, True, None),
    (2, 333, 900, 2, 1, 256, False, (100, 50)),
    (1, 4500, 4500, 2, 2, 64, True, (300, -1)),
    (3, 77, 77, 4, 4, 128, False, None),
]


def main():
    import llmkernels as lk
    for batch, seqlen_q, seqlen_kv, q_heads, kv_heads, dim, causal, window in CASES:
        q = torch.randn(batch, seqlen_q, q_heads, dim, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(batch, seqlen_kv, kv_heads, dim, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        out, lse = gluon_attention(q, k, v, causal=causal, window=window, return_lse=True)
        mask = lk.SlidingWindow(*window) if window is not None else None
        expected = attention_reference(q, k, v, causal=causal, mask=mask)
        error = ((out.float() - expected.float()).norm() / expected.float().norm()).item()
        print(f"{batch}x{seqlen_q}x{seqlen_kv} D{dim} causal={causal} window={window}: rel. error {error:.1e}")
        assert error < 1e-2
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
