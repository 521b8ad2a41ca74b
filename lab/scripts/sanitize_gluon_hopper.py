"""A few calls of the Gluon Hopper attention kernel under compute-sanitizer (memcheck: no access outside q, k, v,
the pages, out, lse; synccheck: barriers; racecheck: shared memory, e.g. the load warp's zeroing of a V tile
against the consumers' wgmmas). Dense, ragged and paged layouts (through ``lk.attention``, which takes the Gluon
kernel for them on an sm_90 GPU); each output is checked against the float32 reference too.

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


def paged_and_ragged_calls():
    """Chunked prefill over a shuffled paged cache (sequences ending inside a page and a tile, one with no key)
    and a ragged batch (a sequence ending inside a tile before another's rows)."""
    import llmkernels as lk

    seqlens, page = [1000, 37, 0], 16
    q = torch.randn(3, 200, 4, 128, device="cuda", dtype=torch.bfloat16)
    counts = [-(-n // page) for n in seqlens]
    order = torch.randperm(sum(counts) + 2).tolist()
    k_pages = torch.randn(len(order), page, 2, 128, device="cuda", dtype=torch.bfloat16)
    v_pages = torch.randn_like(k_pages)
    table = torch.zeros(3, max(counts) + 1, dtype=torch.int32)
    first = 0
    for b, count in enumerate(counts):
        table[b, :count] = torch.tensor(order[first:first + count], dtype=torch.int32)
        first += count
    cache = lk.PagedKVCache(k_pages, v_pages, table.cuda(), torch.tensor(seqlens, dtype=torch.int32, device="cuda"))
    yield "paged", lk.attention(q, None, None, kv_cache=cache, causal=True), attention_reference(
        q, None, None, kv_cache=cache, causal=True)
    lengths = [300, 77, 1000]
    cu = torch.tensor([0, 300, 377, 1377], dtype=torch.int32, device="cuda")
    q = torch.randn(sum(lengths), 4, 64, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(sum(lengths), 2, 64, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    kwargs = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=1000, max_seqlen_k=1000, causal=True)
    yield "ragged", lk.attention(q, k, v, **kwargs), attention_reference(q, k, v, **kwargs)


def main():
    import llmkernels as lk
    for name, out, expected in paged_and_ragged_calls():
        error = ((out.float() - expected.float()).norm() / expected.float().norm()).item()
        print(f"{name}: rel. error {error:.1e}")
        assert error < 1e-2
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
