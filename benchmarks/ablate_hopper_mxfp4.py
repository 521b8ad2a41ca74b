"""Prototype for issue 21: bf16 × MXFP4 experts on Hopper with the weights stored in wgmma's register-fragment
order, so that a 16-byte load per thread, decoded in registers, is that thread's operand of the MMA (no shared
memory round trip between decode and MMA). Not in the product until it wins; measured against ours and
triton_kernels in one run.

    PYTHONPATH=src:.peers/triton_kernels python -m benchmarks ablate_hopper_mxfp4 [--out DIR]

Layout: ``llmkernels.formats.fragments`` (data ``[N/16, K/64, 8, 4, 16]``, thread ``(g, t)``'s 16 bytes one word
per 16-wide K step with the bits of rows g and g + 8 placed for a mask-and-multiply decode; e8m0 scales
``[N/16, K/64, 8, 2, 2]``, one word per thread and chunk, or bf16 converted once on the host). What each
variant measured: ``benchmarks/NOTES.md`` (issue 21).

Limits of the prototype: MXFP4 weights under bf16 activations only, N a multiple of BLOCK_N, K of 64,
non-persistent grid of (N tiles, groups × tiles per group).
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
def fragment_mxfp4_kernel(x_ptr, w_ptr, s_ptr, out_ptr, offsets_ptr, ids_ptr, N, K, tiles_per_group,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                          EVEN_K: tl.constexpr, WRAP_ROWS: tl.constexpr):
    """out[rows of g, n] = x[rows of g] @ W[ids[g]]ᵀ with W in the fragment layout; swap-AB (the weights are
    the MMA's register operand, the tokens its N). Grid: (N / BLOCK_N, groups × tiles_per_group). ``s_ptr``:
    e8m0 bytes or bf16 scales. EVEN_K: K a multiple of BLOCK_K (no K masks); WRAP_ROWS: rows past the group
    read the group's rows again (unmasked loads), as triton_kernels does."""
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
    row_mask = rows < row_end
    load_rows = row_start + tl.arange(0, BLOCK_M) % (row_end - row_start) if WRAP_ROWS else rows
    ks = tl.arange(0, BLOCK_K)
    # data offsets of this program's [NB, C, 8, 4, 16] tile at K chunk 0
    chunk_bytes = 512
    nb = pid_n * NB + tl.arange(0, NB)
    d_off = (nb[:, None, None, None, None] * (K // 64) * chunk_bytes
             + tl.arange(0, C)[None, :, None, None, None] * chunk_bytes
             + tl.arange(0, 8)[None, None, :, None, None] * 64
             + tl.arange(0, 4)[None, None, None, :, None] * 16
             + tl.arange(0, 16)[None, None, None, None, :])
    s_off = (nb[:, None, None, None] * (K // 64) * 32 + tl.arange(0, C)[None, :, None, None] * 32
             + tl.arange(0, 8)[None, None, :, None] * 4 + tl.arange(0, 4)[None, None, None, :])
    w_base = w_ptr + expert * N * (K // 2)
    s_base = s_ptr + expert * N * (K // 32)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    chunks = tl.arange(0, C)
    for k in range(0, K, BLOCK_K):
        x_ptrs = x_ptr + load_rows[:, None].to(tl.int64) * K + k + ks[None, :]
        if EVEN_K:
            x = tl.load(x_ptrs) if WRAP_ROWS else tl.load(x_ptrs, mask=row_mask[:, None], other=0.0)
            data = tl.load(w_base + d_off + (k // 64) * chunk_bytes)
            scale_words = tl.load(s_base + s_off + (k // 64) * 32)
        else:
            row_ok = (load_rows >= 0) if WRAP_ROWS else row_mask
            x = tl.load(x_ptrs, mask=row_ok[:, None] & (k + ks < K)[None, :], other=0.0)
            chunk_ok = k // 64 + chunks < K // 64  # K is a multiple of 64, not always of BLOCK_K
            data = tl.load(w_base + d_off + (k // 64) * chunk_bytes, mask=chunk_ok[None, :, None, None, None],
                           other=0)
            scale_words = tl.load(s_base + s_off + (k // 64) * 32, mask=chunk_ok[None, :, None, None], other=127)
        w = decode_fragment_tile(data, scale_words, NB, C, True)
        acc = tl.dot(w, tl.trans(x), acc)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    tl.store(out_ptr + rows[None, :].to(tl.int64) * N + cols[:, None], acc.to(tl.bfloat16), mask=row_mask[None, :])


class FragmentMXFP4:
    """Weights of every expert in the fragment layout, from an llmkernels mxfp4 ScaledTensor ``[E, N, K]``."""

    def __init__(self, w_mxfp4):
        from llmkernels.formats.fragments import to_hopper_fragments

        self.n, self.k = w_mxfp4.shape[-2:]
        self.data, scales = to_hopper_fragments(w_mxfp4.data, w_mxfp4.scales)
        self.scales = scales.reshape(*scales.shape[:-2], 4)  # one word (h, j // 2) per thread and chunk
        bits = self.scales.to(torch.int32) << 23  # e8m0 → float32 → bf16, exactly (0: 2^-127, 255: NaN)
        bits = torch.where(self.scales == 0, 0x00400000, torch.where(self.scales == 255, 0x7FC00000, bits))
        self.scales_bf16 = bits.view(torch.float32).to(torch.bfloat16)

    def runner(self, x, offsets, ids, max_rows_per_group, block_m, block_n=128, num_warps=4, num_stages=4,
               block_k=128, bf16_scales=False, wrap_rows=False):
        out = torch.empty(x.shape[0], self.n, device=x.device, dtype=torch.bfloat16)
        tiles = triton.cdiv(max_rows_per_group, block_m)
        grid = (self.n // block_n, (offsets.numel() - 1) * tiles)

        def run():
            fragment_mxfp4_kernel[grid](x, self.data, self.scales_bf16 if bf16_scales else self.scales, out, offsets,
                                        ids, self.n, self.k, tiles, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                                        EVEN_K=self.k % block_k == 0, WRAP_ROWS=wrap_rows,
                                        num_warps=num_warps, num_stages=num_stages)
            return out
        return run


def _problem(experts: int, n: int, k: int, with_peer: bool = False) -> SimpleNamespace:
    """One projection's weights: llmkernels MXFP4 (``w_mx``), dequantized float32 (``w_ref``), the fragment
    layout (``fragment``), triton_kernels' own (``peer``, None without it or unless asked) and expert ids."""
    w = torch.randn(experts, n, k, device="cuda", dtype=torch.bfloat16) * k**-0.5
    w_mx = lk.quantize(w, "mxfp4")
    peer = None
    if with_peer:
        try:
            peer = TritonKernelsExperts(w)
        except ImportError:
            pass
    return SimpleNamespace(experts=experts, n=n, k=k, w_mx=w_mx, w_ref=lk.dequantize(w_mx).float(),
                           fragment=FragmentMXFP4(w_mx), peer=peer,
                           ids=torch.arange(experts, dtype=torch.int32, device="cuda"))


def _grouping(problem: SimpleNamespace, tokens_per_expert: int):
    """(offsets, x, reference output) of ``tokens_per_expert`` rows for every expert."""
    e, n, k, t = problem.experts, problem.n, problem.k, tokens_per_expert
    offsets = torch.arange(e + 1, dtype=torch.int32, device="cuda") * t
    x = torch.randn(e * t, k, device="cuda", dtype=torch.bfloat16)
    reference = torch.bmm(x.view(e, t, k).float(), problem.w_ref.transpose(1, 2)).view(e * t, n)
    return offsets, x, reference


def _time(fn, reference) -> tuple[float, float]:
    """(µs per CUDA-graph replay, relative error against ``reference``) of ``fn``."""
    error = ((fn().float() - reference).norm() / reference.norm()).item()
    return graph_time_ms(fn) * 1e3, error


def _write(out_dir, name: str, lines: list[str]) -> None:
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, name), "w") as file:
            file.write("\n".join(lines) + "\n")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--sweep", action="store_true", help="tile sweep at E=128, N=4096, K=7168 instead")
    parser.add_argument("--sweep-compute", action="store_true",
                        help="tile sweep at 64-2048 tokens per expert, N=4096, K=7168 instead")
    parser.add_argument("--profile", action="store_true",
                        help="three launches each of the prototype and triton_kernels at E=128, T=1 (for ncu)")
    args = parser.parse_args()
    if args.sweep:
        return sweep(args)
    if args.sweep_compute:
        return sweep_compute(args)
    if args.profile:
        return profile()
    torch.manual_seed(0)
    lines = [f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, Triton {triton.__version__}; µs per "
             "CUDA-graph replay; rel err against the fp32 product of the dequantized weights"]
    for experts, n, k, counts in ((128, 4096, 7168, (1, 16, 64, 256)), (32, 5760, 2880, (4, 64, 512)),
                                  (8, 4096, 7168, (2048,)), (256, 7168, 2048, (16, 256))):
        problem = _problem(experts, n, k, with_peer=True)
        for t in counts:
            offsets, x, ref = _grouping(problem, t)
            # the tiles the sweeps found best: 16 / 64 / 128 tokens per M tile, 128 weight rows, 4 warps
            block_m = 16 if t <= 16 else 64 if t <= 64 else 128
            systems = {"ours row layout": lambda: lambda: lk.grouped_matmul(x, problem.w_mx, offsets, problem.ids),
                       "fragment": lambda: problem.fragment.runner(x, offsets, problem.ids, t, block_m, 128, 4, 3,
                                                                   wrap_rows=True)}
            if problem.peer is not None:
                systems["triton_kernels"] = lambda: problem.peer.mxfp4(x, offsets)
            results = {}
            for name, make in systems.items():
                try:
                    results[name] = _time(make(), ref)
                except Exception as exc:  # noqa: BLE001
                    results[name] = (float("nan"), float("nan"))
                    print(f"{name} fails: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
            line = f"E={experts} T={t} N={n} K={k}: " + "; ".join(
                f"{name} {us:.1f} us (err {err:.1e})" for name, (us, err) in results.items())
            print(line, flush=True)
            lines.append(line)
        del problem
        torch.cuda.empty_cache()
    _write(args.out, "ablate_hopper_mxfp4.txt", lines)


def sweep(args):
    torch.manual_seed(0)
    problem = _problem(128, 4096, 7168)
    lines = [f"# sweep, {torch.cuda.get_device_name()}, Triton {triton.__version__}: E={problem.experts} "
             f"N={problem.n} K={problem.k}, us per CUDA-graph replay (weight GB/s)"]
    weight_bytes = problem.experts * problem.n * problem.k * (0.5 + 1 / 32)
    for t in (1, 16, 64):
        offsets, x, ref = _grouping(problem, t)
        block_m = 16 if t <= 16 else 64
        for bn, warps, stages, bk, bf16_scales, wrap in (
                (128, 4, 4, 128, False, False), (128, 4, 4, 128, True, False), (128, 4, 4, 128, False, True),
                (128, 4, 4, 128, True, True), (64, 4, 4, 128, True, True), (256, 8, 4, 128, True, True),
                (128, 8, 4, 128, True, True), (128, 4, 3, 128, True, True)):
            config = f"T={t} bm{block_m} bn{bn} w{warps} s{stages} bk{bk}"
            try:
                us, error = _time(problem.fragment.runner(x, offsets, problem.ids, t, block_m, bn, warps, stages, bk,
                                                          bf16_scales, wrap), ref)
                line = (f"{config} bf16s{int(bf16_scales)} wrap{int(wrap)}: {us:.1f} us "
                        f"({weight_bytes / us / 1e3:.0f} GB/s) err {error:.1e}")
            except Exception as exc:  # noqa: BLE001
                line = f"{config}: fails {type(exc).__name__}: {str(exc)[:120]}"
            print(line, flush=True)
            lines.append(line)
    _write(args.out, "ablate_hopper_mxfp4_sweep.txt", lines)


def sweep_compute(args):
    torch.manual_seed(0)
    n, k = 4096, 7168
    lines = [f"# compute-regime sweep, {torch.cuda.get_device_name()}, Triton {triton.__version__}: N={n} K={k}, "
             "e8m0 scales, wrapped rows; us per CUDA-graph replay (TFLOP/s)"]
    for experts, t in ((128, 64), (128, 256), (8, 2048)):
        problem = _problem(experts, n, k)
        offsets, x, ref = _grouping(problem, t)
        flops = 2.0 * experts * t * n * k
        for bm, bn, warps, stages in ((64, 128, 4, 3), (128, 128, 8, 3), (128, 128, 4, 3), (128, 256, 8, 3),
                                      (256, 128, 8, 2), (128, 64, 4, 3)):
            if bm > 2 * t:
                continue
            config = f"E={experts} T={t} bm{bm} bn{bn} w{warps} s{stages}"
            try:
                us, error = _time(problem.fragment.runner(x, offsets, problem.ids, t, bm, bn, warps, stages, 128,
                                                          False, True), ref)
                line = f"{config}: {us:.1f} us ({flops / us / 1e6:.0f} TFLOP/s) err {error:.1e}"
            except Exception as exc:  # noqa: BLE001
                line = f"{config}: fails {type(exc).__name__}: {str(exc)[:120]}"
            print(line, flush=True)
            lines.append(line)
        del problem
        torch.cuda.empty_cache()
    _write(args.out, "ablate_hopper_mxfp4_sweep_compute.txt", lines)


def profile():
    torch.manual_seed(0)
    t = 1
    problem = _problem(128, 4096, 7168, with_peer=True)
    offsets, x, _ = _grouping(problem, t)
    fragment, ids = problem.fragment, problem.ids
    # ncu -k regex:fragment -s 2 -c 1 profiles 128 weight rows with 4 warps, -s 5 -c 1 256 rows with 8
    for fn in (fragment.runner(x, offsets, ids, t, 16, 128, 4, 3), fragment.runner(x, offsets, ids, t, 16, 256, 8, 3),
               problem.peer.mxfp4(x, offsets), lambda: lk.grouped_matmul(x, problem.w_mx, offsets, ids)):
        for _ in range(3):
            fn()
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
