"""One launch of every kernel family on a tiny problem, each checked against its reference, for
``compute-sanitizer --tool racecheck`` (and ``synccheck``), which instruments every shared-memory
access and is too slow for the test suite (no suite test finished in 150 s under it).

Triton manages shared memory itself (multi-buffered ``cp.async`` / TMA pipelines with barriers), so a
hazard here would be a compiler pipelining bug; the kernels are run with their default configs, the
pipelined ones included. Run the script once without the sanitizer first so that compilation is cached:

    python tools/racecheck_smoke.py
    compute-sanitizer --tool racecheck --racecheck-report all python tools/racecheck_smoke.py
"""

import sys

import torch

import llmkernels as lk
from llmkernels.moe import combine, dispatch, dispatch_reference
from llmkernels.testing import default_device, random_group_offsets, relative_error


def check(name: str, error: float, bound: float) -> bool:
    ok = error <= bound
    print(f"{name:40s} rel. error {error:.2e} (bound {bound:.0e}) {'ok' if ok else 'FAIL'}", flush=True)
    return ok


def main() -> int:
    torch.manual_seed(0)
    dev = default_device()
    results = []

    x = torch.randn(256, 256, device=dev, dtype=torch.bfloat16)
    for fmt in ("mxfp8", "mxfp4", "nvfp4"):
        ours, ref = lk.quantize(x, fmt), lk.quantize_reference(x, fmt)
        same = torch.equal(ours.data.view(torch.uint8), ref.data.view(torch.uint8)) and torch.equal(
            ours.scales.view(torch.uint8), ref.scales.view(torch.uint8)
        )
        results.append(check(f"quantize {fmt} (bits)", 0.0 if same else 1.0, 0.0))

    num_experts, n, k = 4, 256, 512
    offsets = random_group_offsets([0, 37, 130, 1], device=dev)  # an empty group, ragged sizes
    ids = torch.tensor([2, 0, 3, 1], device=dev, dtype=torch.int32)
    a = torch.randn(int(offsets[-1]), k, device=dev, dtype=torch.bfloat16)
    w = torch.randn(num_experts, n, k, device=dev, dtype=torch.bfloat16) / k**0.5
    for a_fmt, b_fmt in ((None, None), ("mxfp8", "mxfp8"), (None, "mxfp4"), ("nvfp4", "nvfp4")):
        a_in = a if a_fmt is None else lk.quantize(a, a_fmt)
        b_in = w if b_fmt is None else lk.quantize(w, b_fmt)
        for epilogue in (None, "swiglu"):
            out = lk.grouped_matmul(a_in, b_in, offsets, ids, epilogue=epilogue)
            ref = lk.grouped_matmul_reference(a_in, b_in, offsets, ids, epilogue=epilogue)
            results.append(
                check(f"grouped_matmul {a_fmt or 'bf16'}x{b_fmt or 'bf16'} {epilogue}", relative_error(out, ref), 2e-2)
            )

    q = torch.randn(2, 200, 4, 64, device=dev, dtype=torch.bfloat16)
    kv = torch.randn(2, 300, 2, 64, device=dev, dtype=torch.bfloat16)
    for causal in (False, True):
        out = lk.attention(q, kv, kv * 0.5, causal=causal)
        ref = lk.attention_reference(q, kv, kv * 0.5, causal=causal)
        results.append(check(f"attention prefill causal={causal}", relative_error(out, ref), 2e-2))

    page, pages = 16, 64
    k_pages = torch.randn(pages, page, 2, 128, device=dev, dtype=torch.bfloat16)
    v_pages = torch.randn_like(k_pages)
    table = torch.randperm(pages, device=dev, dtype=torch.int32).reshape(2, 32)
    seqlens = torch.tensor([300, 511], device=dev, dtype=torch.int32)
    cache = lk.PagedKVCache(k_pages, v_pages, table, seqlens)
    qd = torch.randn(2, 1, 8, 128, device=dev, dtype=torch.bfloat16)
    k_dense = k_pages[table.long()].flatten(1, 2)
    v_dense = v_pages[table.long()].flatten(1, 2)
    for splits in (1, 4):
        out = lk.attention(qd, None, None, kv_cache=cache, num_splits=splits)
        refs = [
            lk.attention_reference(
                qd[b : b + 1], k_dense[b : b + 1, : int(seqlens[b])], v_dense[b : b + 1, : int(seqlens[b])]
            )
            for b in range(2)
        ]
        results.append(check(f"attention paged decode splits={splits}", relative_error(out, torch.cat(refs)), 2e-2))

    expert_ids = torch.randint(0, 8, (50, 2), device=dev, dtype=torch.int32)
    got, want = dispatch(expert_ids, 8), dispatch_reference(expert_ids, 8)
    results.append(
        check("moe dispatch (exact)", 0.0 if all(torch.equal(g, r) for g, r in zip(got, want)) else 1.0, 0.0)
    )
    y = torch.randn(100, 128, device=dev, dtype=torch.bfloat16)
    weights = torch.rand(50, 2, device=dev)
    rows = got[2]
    mixed = combine(y, rows, weights)
    expected = (y.float()[rows.long()] * weights[..., None]).sum(1)
    results.append(check("moe combine", relative_error(mixed, expected), 1e-2))

    if dev.type == "cuda":
        torch.cuda.synchronize()
    print(f"{sum(results)}/{len(results)} checks passed", flush=True)
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
