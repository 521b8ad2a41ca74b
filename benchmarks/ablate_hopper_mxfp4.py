"""Ablations of bf16 × MXFP4 experts in the Hopper layout (issue 21): the product kernel
(``grouped_matmul/hopper_kernel.py``) under other tiles, and variants of its K loop that are not in the
product, each against triton_kernels in the same run. What each measured: ``benchmarks/NOTES.md``.

    PYTHONPATH=src:.:.peers/triton_kernels python -m benchmarks ablate_hopper_mxfp4 [--out DIR] [--profile]

Variant ``prefetch``: the weights of the next K step are loaded into registers while the current step
decodes and multiplies (the fragment needs no shared memory; Triton's pipeline stages every load through
it), the activations pipelined by Triton as usual.
"""
from __future__ import annotations

import argparse
import os
from types import SimpleNamespace

import torch
import triton
import triton.language as tl

import llmkernels as lk
from benchmarks.common import graph_time_ms
from benchmarks.peers import TritonKernelsExperts
from llmkernels.formats.kernel import decode_fragment_tile


@triton.jit
def _fragment_words(w_base, s_base, d_off, s_off, k):
    return tl.load(w_base + d_off + (k // 64) * 512), tl.load(s_base + s_off + (k // 64) * 32)


@triton.jit
def prefetch_kernel(x_ptr, w_ptr, s_ptr, out_ptr, offsets_ptr, ids_ptr, N, K, tiles_per_group,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """out[rows of g] = x[rows of g] @ W[ids[g]]ᵀ, W in the Hopper layout; K a multiple of BLOCK_K, N of
    BLOCK_N, every group ≤ tiles_per_group M tiles (a benchmark kernel, balanced groupings only). The next
    step's weight words are loaded into registers one step ahead."""
    NB: tl.constexpr = BLOCK_N // 16
    C: tl.constexpr = BLOCK_K // 64
    pid_n = tl.program_id(0)
    group = tl.program_id(1) // tiles_per_group
    row_start = tl.load(offsets_ptr + group) + (tl.program_id(1) % tiles_per_group) * BLOCK_M
    row_end = tl.load(offsets_ptr + group + 1)
    if row_start >= row_end:
        return
    expert = tl.load(ids_ptr + group).to(tl.int64)
    rows = row_start + tl.arange(0, BLOCK_M)
    load_rows = row_start + tl.arange(0, BLOCK_M) % (row_end - row_start)
    ks = tl.arange(0, BLOCK_K)
    nb = pid_n * NB + tl.arange(0, NB)
    d_off = (nb[:, None, None, None, None] * (K // 64) * 512 + tl.arange(0, C)[None, :, None, None, None] * 512
             + tl.arange(0, 8)[None, None, :, None, None] * 64 + tl.arange(0, 4)[None, None, None, :, None] * 16
             + tl.arange(0, 16)[None, None, None, None, :])
    s_off = (nb[:, None, None, None] * (K // 64) * 32 + tl.arange(0, C)[None, :, None, None] * 32
             + tl.arange(0, 8)[None, None, :, None] * 4 + tl.arange(0, 4)[None, None, None, :])
    w_base = w_ptr + expert * N * (K // 2)
    s_base = s_ptr + expert * N * (K // 32)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    data, scales = _fragment_words(w_base, s_base, d_off, s_off, 0)
    for k in range(0, K, BLOCK_K):
        current_data, current_scales = data, scales
        data, scales = _fragment_words(w_base, s_base, d_off, s_off, tl.minimum(k + BLOCK_K, K - BLOCK_K))
        x = tl.load(x_ptr + load_rows[:, None].to(tl.int64) * K + k + ks[None, :])
        w = decode_fragment_tile(current_data, current_scales, NB, C, True)
        acc = tl.dot(w, tl.trans(x), acc)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    tl.store(out_ptr + rows[None, :].to(tl.int64) * N + cols[:, None], acc.to(tl.bfloat16),
             mask=(rows < row_end)[None, :])


def _prefetch_runner(problem, x, offsets, tokens_per_expert, block_m, block_n=128, num_warps=4, num_stages=1,
                     block_k=128):
    hopper = problem.hopper
    out = torch.empty(x.shape[0], problem.n, device=x.device, dtype=torch.bfloat16)
    tiles = triton.cdiv(tokens_per_expert, block_m)
    grid = (problem.n // block_n, problem.experts * tiles)

    def run():
        prefetch_kernel[grid](x, hopper.data, hopper.scales.view(torch.uint8), out, offsets, problem.ids, problem.n,
                              problem.k, tiles, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                              num_warps=num_warps, num_stages=num_stages)
        return out
    return run


def _product_runner(problem, x, offsets, config=None):
    return lambda: lk.grouped_matmul(x, problem.hopper, offsets, problem.ids, config=config)


def _problem(experts: int, n: int, k: int, with_peer: bool = True) -> SimpleNamespace:
    w = torch.randn(experts, n, k, device="cuda", dtype=torch.bfloat16) * k**-0.5
    w_mx = lk.quantize(w, "mxfp4")
    peer = None
    if with_peer:
        try:
            peer = TritonKernelsExperts(w)
        except ImportError as error:
            print(f"triton_kernels skipped: {error}")
    return SimpleNamespace(experts=experts, n=n, k=k, hopper=w_mx.to_layout("hopper"),
                           w_ref=lk.dequantize(w_mx).float(), peer=peer,
                           ids=torch.arange(experts, dtype=torch.int32, device="cuda"))


def _grouping(problem: SimpleNamespace, tokens_per_expert: int):
    e, n, k, t = problem.experts, problem.n, problem.k, tokens_per_expert
    offsets = torch.arange(e + 1, dtype=torch.int32, device="cuda") * t
    x = torch.randn(e * t, k, device="cuda", dtype=torch.bfloat16)
    reference = torch.bmm(x.view(e, t, k).float(), problem.w_ref.transpose(1, 2)).view(e * t, n)
    return offsets, x, reference


def _time(fn, reference) -> tuple[float, float]:
    """(µs per CUDA-graph replay, relative error against ``reference``)."""
    error = ((fn().float() - reference).norm() / reference.norm()).item()
    return graph_time_ms(fn) * 1e3, error


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--profile", action="store_true", help="3 launches each at E=128, T=1, for ncu")
    args = parser.parse_args()
    torch.manual_seed(0)
    if args.profile:
        problem = _problem(128, 4096, 7168)
        offsets, x, _ = _grouping(problem, 1)
        for fn in (_product_runner(problem, x, offsets), _prefetch_runner(problem, x, offsets, 1, 16),
                   problem.peer.mxfp4(x, offsets)):
            for _ in range(3):
                fn()
        torch.cuda.synchronize()
        return
    lines = [f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, Triton {triton.__version__}; µs per "
             "CUDA-graph replay (rel err against the fp32 product of the dequantized weights)"]
    for experts, n, k, counts in ((128, 4096, 7168, (1, 16, 64, 256)), (32, 5760, 2880, (4, 64)),
                                  (8, 4096, 7168, (2048,))):
        problem = _problem(experts, n, k)
        for t in counts:
            offsets, x, ref = _grouping(problem, t)
            block_m = 16 if t <= 16 else 64 if t <= 64 else 128
            systems = {"product": _product_runner(problem, x, offsets)}
            if problem.peer is not None:
                systems["triton_kernels"] = problem.peer.mxfp4(x, offsets)
            for stages in (1, 2, 3):
                systems[f"prefetch s{stages}"] = _prefetch_runner(problem, x, offsets, t, block_m, num_stages=stages)
            systems["prefetch s2 w8 bn256"] = _prefetch_runner(problem, x, offsets, t, block_m, 256, 8, 2)
            systems["product s4"] = _product_runner(problem, x, offsets, lk.BlockScaledMatmulConfig(
                block_m, 128, 128, num_stages=4, num_warps=4))
            results = {}
            for name, fn in systems.items():
                try:
                    results[name] = _time(fn, ref)
                except Exception as exc:  # noqa: BLE001 - a failing variant is a result too
                    results[name] = (float("nan"), float("nan"))
                    print(f"{name} fails: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
            line = f"E={experts} T={t} N={n} K={k}: " + "; ".join(
                f"{name} {us:.1f} us ({err:.1e})" for name, (us, err) in results.items())
            print(line, flush=True)
            lines.append(line)
        del problem
        torch.cuda.empty_cache()
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "ablate_hopper_mxfp4.txt"), "w") as file:
            file.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
