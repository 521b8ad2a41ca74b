"""One attention problem, warmed up and then run a few times: the target for a profiler.

    ncu --clock-control none --section WarpStateStats -k regex:attention_fwd -s 3 -c 1 \\
        python -m benchmarks profile_attention prefill --shape 4,16,4096,128 [--causal]
    ncu ... python -m benchmarks profile_attention decode --shape 1,8192   # B, context; Hq=32, Hkv=8, D=128, page 16

Prints the median time of the call.
"""
from __future__ import annotations

import argparse

import torch

from benchmarks.common import time_ms  # noqa: E402

import llmkernels as lk  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kind", choices=("prefill", "decode"))
    parser.add_argument("--shape", required=True, help="prefill: B,H,S,D; decode: B,context")
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    dims = [int(v) for v in args.shape.split(",")]
    if args.kind == "prefill":
        batch, heads, seqlen, head_dim = dims
        q, k, v = (torch.randn(batch, seqlen, heads, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        call = lambda: lk.attention(q, k, v, causal=args.causal)  # noqa: E731
    else:
        batch, context = dims
        page, heads_kv, head_dim = 16, 8, 128
        pages_per_seq = -(-context // page)
        k_pages, v_pages = (torch.randn(batch * pages_per_seq, page, heads_kv, head_dim, device="cuda",
                                        dtype=torch.bfloat16) for _ in range(2))
        table = torch.randperm(batch * pages_per_seq, device="cuda", dtype=torch.int32).view(batch, pages_per_seq)
        seqlens = torch.full((batch,), context, device="cuda", dtype=torch.int32)
        cache = lk.PagedKVCache(k_pages, v_pages, table, seqlens)
        q = torch.randn(batch, 1, 32, head_dim, device="cuda", dtype=torch.bfloat16)
        call = lambda: lk.attention(q, None, None, kv_cache=cache)  # noqa: E731
    for _ in range(args.runs):
        call()
    torch.cuda.synchronize()
    print(f"{args.kind} {args.shape} causal={args.causal}: {time_ms(call) * 1e3:.1f} us")


if __name__ == "__main__":
    main()
