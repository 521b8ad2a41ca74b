"""Host time of one eager attention call in a decode loop whose KV grows by a token each step (transformers'
DynamicCache), against the same call at a fixed length (a plan-cache hit), and PyTorch's SDPA.

    python -m benchmarks profile_growing_kv_host

Prints microseconds per call: the best of 3 passes of 200 calls, each timed by wall clock and synchronized once
at the end, so that it is the host's time while the GPU keeps up.
"""
from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from llmkernels.integrations.transformers import attention_forward


def _per_call_us(call, lengths) -> float:
    torch.cuda.synchronize()
    started = time.perf_counter()
    for length in lengths:
        call(length)
    torch.cuda.synchronize()
    return (time.perf_counter() - started) / len(lengths) * 1e6


def main(argv=None):
    batch, heads, kv_heads, dim, start, steps = 1, 32, 8, 128, 1024, 200
    q = torch.randn(batch, heads, 1, dim, device="cuda", dtype=torch.bfloat16)
    passes = 3
    k = torch.randn(batch, kv_heads, start + (passes + 1) * steps, dim, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    module = torch.nn.Module()
    module.is_causal = True
    # DynamicCache's tensors are new, contiguous [B, H, S, D] tensors each step: copies, as its cat makes
    keys = {s: k[:, :, :s].contiguous() for s in range(start, start + (passes + 1) * steps)}
    values = {s: v[:, :, :s].contiguous() for s in range(start, start + (passes + 1) * steps)}

    def ours(length):
        attention_forward(module, q, keys[length], values[length], None, scaling=dim ** -0.5)

    def sdpa(length):
        F.scaled_dot_product_attention(q, keys[length], values[length], enable_gqa=True)

    growing = list(range(start, start + steps))
    for name, call in (("llmkernels", ours), ("sdpa", sdpa)):
        call(start)  # warm
        fixed = min(_per_call_us(call, [start] * steps) for _ in range(passes))
        _per_call_us(call, growing)  # first pass: compiles what the lengths need
        grown = min(_per_call_us(call, list(range(start + p * steps, start + (p + 1) * steps)))
                    for p in range(1, passes + 1))
        print(f"{name:10s} fixed length {fixed:7.1f} us/call   growing length {grown:7.1f} us/call")


if __name__ == "__main__":
    main()
