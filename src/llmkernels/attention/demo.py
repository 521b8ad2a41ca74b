"""The attention's part of ``python -m llmkernels demo``: a causal prefill and a paged GQA decode,
checked against the float32 reference and timed on the GPU."""

from __future__ import annotations

import torch

from ..testing import relative_error
from .api import attention
from .paged import PagedKVCache
from .reference import attention_reference

TOLERANCE = 2e-2  # bf16 output


def _paged_problem(batch, context, num_q_heads, num_kv_heads, head_dim, page_size, device, generator):
    pages_per_seq = -(-context // page_size)
    num_pages = batch * pages_per_seq
    k_pages = torch.randn(num_pages, page_size, num_kv_heads, head_dim, generator=generator).bfloat16().to(device)
    v_pages = torch.randn(num_pages, page_size, num_kv_heads, head_dim, generator=generator).bfloat16().to(device)
    block_table = torch.randperm(num_pages, generator=generator).int().view(batch, pages_per_seq).to(device)
    seqlens = torch.tensor([context - 7 * b for b in range(batch)], dtype=torch.int32).to(device)
    q = torch.randn(batch, 1, num_q_heads, head_dim, generator=generator).bfloat16().to(device)
    return q, PagedKVCache(k_pages, v_pages, block_table, seqlens)


def run_demo(device: torch.device) -> list[dict]:
    """Runs the default problems; returns rows {kernel, problem, rel_error, ok, time_ms} (time_ms None on CPU)."""
    on_gpu = device.type == "cuda"
    generator = torch.Generator().manual_seed(0)
    batch, heads, seqlen, head_dim = (4, 16, 4096, 128) if on_gpu else (1, 2, 48, 32)
    q = torch.randn(batch, seqlen, heads, head_dim, generator=generator).bfloat16().to(device)
    k = torch.randn(batch, seqlen, heads, head_dim, generator=generator).bfloat16().to(device)
    v = torch.randn(batch, seqlen, heads, head_dim, generator=generator).bfloat16().to(device)
    decode_shape = (8, 8192, 32, 8, 128, 16) if on_gpu else (2, 40, 4, 2, 32, 16)
    q_decode, cache = _paged_problem(*decode_shape, device=device, generator=generator)

    cases = [
        (
            "attention prefill causal bf16",
            f"B={batch} H={heads} S={seqlen} D={head_dim}",
            lambda: attention(q, k, v, causal=True),
            lambda: attention_reference(q, k, v, causal=True),
        ),
        (
            "attention paged decode bf16 (split-KV)",
            f"B={decode_shape[0]} ctx={decode_shape[1]} Hq={decode_shape[2]} Hkv={decode_shape[3]} D={decode_shape[4]} "
            f"page={decode_shape[5]}",
            lambda: attention(q_decode, None, None, kv_cache=cache),
            lambda: attention_reference(q_decode, None, None, kv_cache=cache),
        ),
    ]
    rows = []
    for kernel, problem, run, reference in cases:
        error = relative_error(run().float(), reference())
        time_ms = None
        if on_gpu:
            import triton.testing

            time_ms = triton.testing.do_bench(run, return_mode="median")
        rows.append(
            {"kernel": kernel, "problem": problem, "rel_error": error, "ok": error <= TOLERANCE, "time_ms": time_ms}
        )
    return rows
