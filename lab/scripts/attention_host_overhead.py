"""The Python host time of eager attention calls on the CPU, with every kernel launch stubbed out (no GPU needed).

    TRITON_INTERPRET=1 PYTHONPATH=src python lab/scripts/attention_host_overhead.py [--calls 2000]

What remains of a call once its launches cost nothing: the plan lookup, the per-call checks, output allocation
and the argument lists handed to the (stubbed) bound launches. ``BoundKernel.__call__`` and Triton's
``JITFunction.run`` / interpreter ``run`` are replaced by no-ops (the way ``tests/public_calls.py``'s
``patch_launches`` does), so the figures do not include Triton's launcher (measured on a GPU by
``benchmarks/bench_host_overhead.py``). Problems: ``bench_host_overhead``'s prefill (1x128x8x64 causal) and paged
decode (B 1, 4k keys in pages of 16, Hq 32 / Hkv 8, D 128), a dense decode whose KV grows by one key per call as
transformers' DynamicCache makes it (new head-major ``[B, Hkv, S, D]`` tensors each step, through the
transformers adapter), and ``flash_attn_with_kvcache`` on a paged cache with one new token. Prints the process's
CPU microseconds per call (the best of 5 passes; CPU time, not wall time, so that other processes on a shared
machine count less) and, for the growing cache, how many plans its 200 steps made.
"""
from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

import llmkernels as lk  # noqa: E402
from llmkernels import launch  # noqa: E402
from llmkernels.flash_attn import flash_attn_with_kvcache  # noqa: E402
from llmkernels.integrations.transformers import attention_forward  # noqa: E402


def _no_launch(*args, **kwargs):
    return None


def _stub_launches() -> None:
    for owner, name in ((JITFunction, "run"), (InterpretedFunction, "run"), (launch.BoundKernel, "__call__")):
        setattr(owner, name, _no_launch)


def _attention_plans():
    """The attention plan cache, wherever this version of the library keeps it."""
    try:
        from llmkernels.attention.plan import PLANS
        return PLANS
    except ImportError:
        from llmkernels.attention import api
        return api._PLANS


def _per_call_us(call, calls: int, passes: int = 5) -> float:
    times = []
    for _ in range(passes):
        started = time.process_time()
        for i in range(calls):
            call(i)
        times.append((time.process_time() - started) / calls * 1e6)
    return min(times)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args(argv)
    _stub_launches()
    torch.manual_seed(0)
    bf16 = dict(dtype=torch.bfloat16)

    qp, kp, vp = (torch.randn(1, 128, 8, 64, **bf16) for _ in range(3))
    pages, page_size, context = 256, 16, 4096
    k_pages, v_pages = (torch.randn(pages, page_size, 8, 128, **bf16) for _ in range(2))
    cache = lk.PagedKVCache(k_pages, v_pages, torch.randperm(pages)[None].int(),
                            torch.tensor([context], dtype=torch.int32))
    q = torch.randn(1, 1, 32, 128, **bf16)
    seqlens = torch.tensor([context - 1], dtype=torch.int32)
    k_new, v_new = (torch.randn(1, 1, 8, 128, **bf16) for _ in range(2))
    rows = [
        ("prefill 1x128x8x64 causal", lambda i: lk.attention(qp, kp, vp, causal=True)),
        ("paged decode B=1 ctx=4k", lambda i: lk.attention(q, None, None, kv_cache=cache, causal=True)),
        ("flash_attn_with_kvcache paged, 1 new token",
         lambda i: flash_attn_with_kvcache(q, k_pages, v_pages, k_new, v_new, cache_seqlens=seqlens,
                                           block_table=cache.block_table, causal=True)),
    ]
    for name, call in rows:
        call(0)
        print(f"{name:45s} {_per_call_us(call, args.calls):8.1f} us/call", flush=True)

    # DynamicCache: new contiguous [B, Hkv, S, D] tensors each step, S one longer
    batch, heads, kv_heads, dim, start, steps = 1, 32, 8, 128, 64, 200
    module = torch.nn.Module()
    module.is_causal = True
    query = torch.randn(batch, heads, 1, dim, **bf16)
    full_k, full_v = (torch.randn(batch, kv_heads, start + steps, dim, **bf16) for _ in range(2))
    keys = [full_k[:, :, :start + i].contiguous() for i in range(steps)]
    values = [full_v[:, :, :start + i].contiguous() for i in range(steps)]
    plans = _attention_plans()
    plans.clear()
    started = time.process_time()
    for i in range(steps):
        attention_forward(module, query, keys[i], values[i], None, scaling=dim ** -0.5)
    growing = (time.process_time() - started) / steps * 1e6
    print(f"{'dense decode, KV growing by one key per call':45s} {growing:8.1f} us/call, "
          f"{len(plans)} plans for {steps} steps", flush=True)


if __name__ == "__main__":
    main()
