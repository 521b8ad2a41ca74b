"""Ablations of bf16 × MXFP4 experts in the Hopper layout (issue 21): the product kernel
(``grouped_matmul/hopper_kernel.py``) under other tiles, warps and stages, against triton_kernels in the same
run. What each measured: ``benchmarks/NOTES.md``.

    PYTHONPATH=src:.:.peers/triton_kernels python -m benchmarks ablate_hopper_mxfp4 [--out DIR] [--profile]

``--profile``: three launches each of the product and of triton_kernels at E=128, 1 token per expert, and
of the product's default and 256-token tiles at E=8 × 2048 tokens, for ncu.
"""
from __future__ import annotations

import argparse
import os
from types import SimpleNamespace

import torch
import triton

import llmkernels as lk
from benchmarks.common import graph_time_ms
from benchmarks.peers import TritonKernelsExperts

# (block_m tokens, block_n weight rows, block_k, warps, stages) against the default of the regime. K steps of 64
# are refused by the product since session 11 (wrong results on the H100; tools/hopper_wgmma_hazard.py).
COMPUTE_VARIANTS = {
    "s2": (128, 128, 128, 4, 2),      # 74 KB of shared memory: room for two programs per SM
    "w8": (128, 128, 128, 8, 3),      # the weight rows over two warpgroups, no spill
    "m256 w8 s2": (256, 128, 128, 8, 2),  # each weight tile decoded once per 256 tokens
    "m64": (64, 128, 128, 4, 3),
}
DECODE_VARIANTS = {
    "k256 s2": (None, 128, 256, 4, 2),
}


def _config(block_m, block_n, block_k, warps, stages):
    return lk.BlockScaledMatmulConfig(block_m, block_n, block_k, num_stages=stages, num_warps=warps, ab_swapped=True,
                                      mma="dequant")


def _problem(experts: int, n: int, k: int, with_peer: bool = True) -> SimpleNamespace:
    w = torch.randn(experts, n, k, device="cuda", dtype=torch.bfloat16) * k**-0.5
    w_mx, w_nv = lk.quantize(w, "mxfp4"), lk.quantize(w, "nvfp4")
    peer = None
    if with_peer:
        try:
            peer = TritonKernelsExperts(w)
        except ImportError as error:
            print(f"triton_kernels skipped: {error}")
    return SimpleNamespace(experts=experts, n=n, k=k, hopper=w_mx.to_layout("hopper"),
                           hopper_nv=w_nv.to_layout("hopper"), w_ref=lk.dequantize(w_mx).float(),
                           w_ref_nv=lk.dequantize(w_nv).float(), peer=peer,
                           ids=torch.arange(experts, dtype=torch.int32, device="cuda"))


def _grouping(problem: SimpleNamespace, tokens_per_expert: int):
    e, n, k, t = problem.experts, problem.n, problem.k, tokens_per_expert
    offsets = torch.arange(e + 1, dtype=torch.int32, device="cuda") * t
    x = torch.randn(e * t, k, device="cuda", dtype=torch.bfloat16)
    product = lambda w: torch.bmm(x.view(e, t, k).float(), w.transpose(1, 2)).view(e * t, n)  # noqa: E731
    return offsets, x, product(problem.w_ref), product(problem.w_ref_nv)


def _time(fn, reference) -> tuple[float, float]:
    """(µs per CUDA-graph replay, relative error against ``reference``)."""
    error = ((fn().float() - reference).norm() / reference.norm()).item()
    return graph_time_ms(fn) * 1e3, error


def _runner(weights, problem, x, offsets, config=None):
    return lambda: lk.grouped_matmul(x, weights, offsets, problem.ids, config=config)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--profile", action="store_true", help="launches for ncu (see the module doc)")
    args = parser.parse_args()
    torch.manual_seed(0)
    if args.profile:
        problem = _problem(128, 4096, 7168)
        offsets, x, _, _ = _grouping(problem, 1)
        runs = [_runner(problem.hopper, problem, x, offsets), problem.peer.mxfp4(x, offsets)]
        problem = _problem(8, 4096, 7168, with_peer=False)
        offsets, x, _, _ = _grouping(problem, 2048)
        runs += [_runner(problem.hopper, problem, x, offsets),
                 _runner(problem.hopper, problem, x, offsets, _config(*COMPUTE_VARIANTS["m256 w8 s2"]))]
        for fn in runs:
            for _ in range(3):
                fn()
        torch.cuda.synchronize()
        return
    lines = [f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, Triton {triton.__version__}; µs per "
             "CUDA-graph replay (rel err against the fp32 product of the dequantized weights)"]
    for experts, n, k, counts in ((128, 4096, 7168, (1, 16, 256)), (32, 5760, 2880, (64, 512)),
                                  (8, 4096, 7168, (2048,)), (256, 7168, 2048, (256,))):
        problem = _problem(experts, n, k)
        for t in counts:
            offsets, x, ref, ref_nv = _grouping(problem, t)
            block_m = 16 if t <= 16 else 64 if t <= 64 else 128
            systems = {"product": (_runner(problem.hopper, problem, x, offsets), ref),
                       "product nvfp4": (_runner(problem.hopper_nv, problem, x, offsets), ref_nv)}
            if problem.peer is not None:
                systems["triton_kernels"] = (problem.peer.mxfp4(x, offsets), ref)
            variants = COMPUTE_VARIANTS if t >= 256 else DECODE_VARIANTS
            for name, (bm, bn, bk, warps, stages) in variants.items():
                config = _config(bm or block_m, bn, bk, warps, stages)
                systems[name] = (_runner(problem.hopper, problem, x, offsets, config), ref)
            results = {}
            for name, (fn, reference) in systems.items():
                try:
                    results[name] = _time(fn, reference)
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
