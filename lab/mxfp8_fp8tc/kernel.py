"""LAB prototype: MXFP8 x MXFP8 matmul on Hopper's FP8 tensor cores with per-32-K promotion (group-free case).

``out[m, n] = Σ_kb (A[m, kb] · B[n, kb]ᵀ) · 2^(ea[m, kb] − 127) · 2^(eb[n, kb] − 127)``, kb the 32-wide K blocks:

* A: ``float8_e4m3fn [M, K]``, a_exps uint8 ``[M, K / 32]`` (the e8m0 scale bytes, bias 127; the library's
  ``"mxfp8"`` row layout, ``ScaledTensor.scales.view(torch.uint8)``);
* B: ``float8_e4m3fn [N, K]``, b_exps uint8 ``[N, K / 32]``;
* out float32 or bf16 ``[M, N]``. K a multiple of 32 (the format's rule).

Each K step covers ``BLOCK_K`` columns (a multiple of 32) as ``BLOCK_K / 32`` *sub-steps*; each sub-step is one
``tl.dot`` of the raw e4m3 ``[BLOCK_M, 32] x [32, BLOCK_N]`` tiles into a fresh fp32 partial (one
``wgmma.mma_async.m64nNk32.f32.e4m3.e4m3`` per 64-row warp-group block on sm_90a), then the promotion
``acc += partial · (2^(ea − 127) ⊗ 2^(eb − 127))``. The two factors are built from the exponent bytes by bit
construction (``e << 23`` reinterpreted as float32; e = 0 → 2^-127, the fp32 subnormal 0x00400000; e = 255 →
NaN), so they are exact powers of two and the promotion multiplies exactly (no ex2.approx). Unlike the FP8-blocks
kernel, B's scale varies along N inside the tile (one per weight row), so the factor is an outer product: the
promotion costs one FMUL (the factor tile) + one FFMA per accumulator element per 32 K — see NOTES.md.

Not the product: no grouping, no persistent grid, no swap-AB; rows/cols past M/N are masked on load (zeros).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

MX_BLOCK = 32


@triton.jit
def e8m0_to_f32(e):
    """Exact 2^(e − 127) of e8m0 bytes (int32 in [0, 255]): the fp32 with exponent field e, e = 0 → 2^-127
    (subnormal), e = 255 → NaN (the e8m0 NaN code)."""
    bits = tl.where(e == 0, 0x00400000, tl.where(e == 255, 0x7FC00000, e << 23))
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def promoted_k_loop(a_ptrs, a_exp_ptrs, b_ptrs, b_exp_ptrs, rows, cols, K,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    PROMOTE_ROWCOL: tl.constexpr, EVEN_K: tl.constexpr):
    """The K loop: ``Σ_kb dot(A_kb, B_kbᵀ) · (fa_kb ⊗ fb_kb)`` as a ``[BLOCK_M, BLOCK_N]`` fp32 tile.

    a_ptrs ``[BLOCK_M, 32]`` and b_ptrs ``[32, BLOCK_N]`` point at column 0 of the tiles' rows, a_exp_ptrs /
    b_exp_ptrs ``[BLOCK_M]`` / ``[BLOCK_N]`` at exponent column 0, all of them at rows that exist (the callers
    clamp rows past the end to the last row: those results are never stored, and the loads need no row masks,
    fewer registers in the loop); rows / cols only give the masks' shapes. K a multiple of 32 (K = 0: an all-zero
    tile). EVEN_K (K a multiple of BLOCK_K): no masks at all; else the K tail is masked to zeros.
    PROMOTE_ROWCOL: False: ``acc += partial * (fa[:, None] * fb[None, :])`` (factor tile, then FFMA);
    True: ``acc += (partial * fb[None, :]) * fa[:, None]`` (same op count, other association; both exact, the
    factors being powers of two). Kept to compare what ptxas makes of each."""
    tl.static_assert(BLOCK_K % 32 == 0, "BLOCK_K: whole 32-wide MX blocks")
    SUB: tl.constexpr = BLOCK_K // 32
    ks = tl.arange(0, 32)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        for s in tl.static_range(SUB):
            k = k0 + s * 32
            if EVEN_K:
                a = tl.load(a_ptrs + k)
                b = tl.load(b_ptrs + k)
                ea = tl.load(a_exp_ptrs + k // 32).to(tl.int32)
                eb = tl.load(b_exp_ptrs + k // 32).to(tl.int32)
            else:
                k_ok = (k + ks) < K  # K % 32 == 0: a sub-step is wholly in or wholly out
                a = tl.load(a_ptrs + k, mask=k_ok[None, :], other=0.0)
                b = tl.load(b_ptrs + k, mask=k_ok[:, None], other=0.0)
                # (the vector form of the scalar test: the interpreter rejects a broadcast scalar mask)
                # out-of-range sub-steps read exponent 127 (factor 1) over zero data: they add exact zeros
                ea = tl.load(a_exp_ptrs + k // 32, mask=rows * 0 + k < K, other=127).to(tl.int32)
                eb = tl.load(b_exp_ptrs + k // 32, mask=cols * 0 + k < K, other=127).to(tl.int32)
            fa = e8m0_to_f32(ea)
            fb = e8m0_to_f32(eb)
            partial = tl.dot(a, b, out_dtype=tl.float32)  # fresh fp32 partial: 32 products per element
            if PROMOTE_ROWCOL:
                acc += (partial * fb[None, :]) * fa[:, None]
            else:
                acc += partial * (fa[:, None] * fb[None, :])
    return acc


@triton.jit
def mxfp8_matmul_kernel(
    a_ptr, a_exp_ptr, b_ptr, b_exp_ptr, out_ptr,
    M, N, K,
    stride_am, stride_aem, stride_bn, stride_ben, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PROMOTE_ROWCOL: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    """One ``[BLOCK_M, BLOCK_N]`` output tile per program (grid: cdiv(M, BLOCK_M) x cdiv(N, BLOCK_N))."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < N
    ks = tl.arange(0, 32)
    load_rows = tl.minimum(rows, M - 1).to(tl.int64)
    load_cols = tl.minimum(cols, N - 1).to(tl.int64)
    a_ptrs = a_ptr + load_rows[:, None] * stride_am + ks[None, :]
    b_ptrs = b_ptr + load_cols[None, :] * stride_bn + ks[:, None]  # [32, BLOCK_N]: B tile transposed
    a_exp_ptrs = a_exp_ptr + load_rows * stride_aem
    b_exp_ptrs = b_exp_ptr + load_cols * stride_ben
    acc = promoted_k_loop(a_ptrs, a_exp_ptrs, b_ptrs, b_exp_ptrs, rows, cols, K,
                          BLOCK_M, BLOCK_N, BLOCK_K, PROMOTE_ROWCOL, EVEN_K)
    out = acc.to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :], out,
             mask=row_ok[:, None] & col_ok[None, :])


def _exps(scales: torch.Tensor) -> torch.Tensor:
    """e8m0 scales (float8_e8m0fnu or their uint8 bytes) as uint8."""
    return scales.view(torch.uint8) if scales.dtype != torch.uint8 else scales


def mxfp8_matmul(a, a_scales, b, b_scales, out_dtype=torch.float32, block_m=64, block_n=64, block_k=128,
                 num_warps=4, num_stages=3, promote_rowcol=False):
    """``A · Bᵀ`` of MXFP8 operands: a e4m3 ``[M, K]`` + e8m0 ``[M, K/32]``, b e4m3 ``[N, K]`` + e8m0 ``[N, K/32]``."""
    M, K = a.shape
    N, Kb = b.shape
    if K != Kb or K % MX_BLOCK:
        raise ValueError(f"K must match and be a multiple of 32, got {K} and {Kb}")
    a_exps, b_exps = _exps(a_scales), _exps(b_scales)
    if a_exps.shape != (M, K // 32) or b_exps.shape != (N, K // 32):
        raise ValueError("scales must be [rows, K / 32]")
    if a.stride(1) != 1 or b.stride(1) != 1 or a_exps.stride(1) != 1 or b_exps.stride(1) != 1:
        raise ValueError("unit column strides only")
    out = torch.empty(M, N, dtype=out_dtype, device=a.device)
    grid = (triton.cdiv(M, block_m), triton.cdiv(N, block_n))
    mxfp8_matmul_kernel[grid](
        a, a_exps, b, b_exps, out, M, N, K,
        a.stride(0), a_exps.stride(0), b.stride(0), b_exps.stride(0), out.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, PROMOTE_ROWCOL=promote_rowcol,
        EVEN_K=K % block_k == 0, num_warps=num_warps, num_stages=num_stages)
    return out


# ----------------------------------------------------------------------------------------------------------------
# Grouped (MoE) version: the same K loop per tile; simple grid, not the product's tile scheduler.


@triton.jit
def mxfp8_grouped_matmul_kernel(
    a_ptr, a_exp_ptr, b_ptr, b_exp_ptr, out_ptr, a_offsets_ptr, expert_ids_ptr,
    num_tokens, num_experts, N, K, m_tiles,
    stride_am, stride_aem, stride_be, stride_bn, stride_bee, stride_ben, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PROMOTE_ROWCOL: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    """``out[rows of g] = A[rows of g] · B[expert_ids[g]]ᵀ`` for all groups, MXFP8 operands.

    Grid ``(G · m_tiles, cdiv(N, BLOCK_N))`` with ``m_tiles = cdiv(num_tokens, BLOCK_M)``, an upper bound on any
    group's m-tiles known without reading the device offsets (no host sync); programs past their group's rows
    exit. That wastes programs when G is large — the product would use lab/fp8_blocks' ``group_tiles`` /
    ``find_group`` (a flat list of real tiles). Offsets are clamped to ``[0, num_tokens]`` and each group's end to
    at least its start; an expert id outside ``[0, num_experts)`` writes zeros (its K loop runs no step)."""
    pid = tl.program_id(0)
    group = pid // m_tiles
    tile_m = pid % m_tiles
    start = tl.minimum(tl.maximum(tl.load(a_offsets_ptr + group), 0), num_tokens)
    end = tl.minimum(tl.maximum(tl.load(a_offsets_ptr + group + 1), start), num_tokens)
    row_start = start + tile_m * BLOCK_M
    if row_start < end:
        expert = tl.load(expert_ids_ptr + group)
        expert_ok = (expert >= 0) & (expert < num_experts)
        expert = tl.where(expert_ok, expert, 0).to(tl.int64)
        k_run = tl.where(expert_ok, K, 0)
        rows = row_start + tl.arange(0, BLOCK_M)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < end
        col_ok = cols < N
        ks = tl.arange(0, 32)
        load_rows = tl.minimum(rows, end - 1).to(tl.int64)  # rows past the group read its last row again
        load_cols = tl.minimum(cols, N - 1).to(tl.int64)
        a_ptrs = a_ptr + load_rows[:, None] * stride_am + ks[None, :]
        b_ptrs = (b_ptr + expert * stride_be) + load_cols[None, :] * stride_bn + ks[:, None]
        a_exp_ptrs = a_exp_ptr + load_rows * stride_aem
        b_exp_ptrs = (b_exp_ptr + expert * stride_bee) + load_cols * stride_ben
        acc = promoted_k_loop(a_ptrs, a_exp_ptrs, b_ptrs, b_exp_ptrs, rows, cols, k_run,
                              BLOCK_M, BLOCK_N, BLOCK_K, PROMOTE_ROWCOL, EVEN_K)
        tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & col_ok[None, :])


def mxfp8_grouped_matmul(a, a_scales, b, b_scales, a_offsets, expert_ids, out=None, out_dtype=torch.float32,
                         block_m=64, block_n=64, block_k=128, num_warps=4, num_stages=3, promote_rowcol=False):
    """Grouped ``A · B[e]ᵀ``: a e4m3 ``[T, K]`` + e8m0 ``[T, K/32]``; b e4m3 ``[E, N, K]`` + e8m0 ``[E, N, K/32]``;
    a_offsets int32 ``[G + 1]``, expert_ids int32 ``[G]`` (device tensors, not read on the host). Rows outside
    every group are not written (``out`` may be passed in to keep what it holds there)."""
    T, K = a.shape
    E, N, Kb = b.shape
    if K != Kb or K % MX_BLOCK:
        raise ValueError(f"K must match and be a multiple of 32, got {K} and {Kb}")
    a_exps, b_exps = _exps(a_scales), _exps(b_scales)
    if a_exps.shape != (T, K // 32) or b_exps.shape != (E, N, K // 32):
        raise ValueError("scales must be [..., rows, K / 32]")
    if a.stride(1) != 1 or b.stride(2) != 1 or a_exps.stride(1) != 1 or b_exps.stride(2) != 1:
        raise ValueError("unit column strides only")
    if out is None:
        out = torch.empty(T, N, dtype=out_dtype, device=a.device)
    groups = expert_ids.shape[0]
    m_tiles = max(triton.cdiv(T, block_m), 1)
    if groups == 0 or T == 0:
        return out
    grid = (groups * m_tiles, triton.cdiv(N, block_n))
    mxfp8_grouped_matmul_kernel[grid](
        a, a_exps, b, b_exps, out, a_offsets, expert_ids, T, E, N, K, m_tiles,
        a.stride(0), a_exps.stride(0), b.stride(0), b.stride(1), b_exps.stride(0), b_exps.stride(1), out.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, PROMOTE_ROWCOL=promote_rowcol,
        EVEN_K=K % block_k == 0, num_warps=num_warps, num_stages=num_stages)
    return out
