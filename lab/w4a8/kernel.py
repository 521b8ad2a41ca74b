"""LAB prototype: w4a8 grouped matmul, MXFP4 expert weights decoded in registers to e4m3 and multiplied on
Hopper's FP8 tensor cores against FP8-block activations (not the product).

``out[rows of g] = Σ_kb (A_kb @ W[e]_kbᵀ) · a_scale[row, kb] · 2^(R[e, n, kb] − 127)``, ``e = expert_ids[g]``:

* A: e4m3 ``[T, K]`` with one float32 scale per token and 128 K (``llmkernels.quantize(x, "fp8", block=(1, 128))``);
* W: MXFP4 ``[E, N, K]`` (``llmkernels.quantize(w, "mxfp4")``): uint8 ``[E, N, K/2]``, two e2m1 codes per byte, low
  nibble the even element, and e8m0 exponents ``[E, N, K/32]``.

Per weight row n and 128-wide K block kb, ``R = max_j e_j`` over the block's four e8m0 exponents; each e2m1 code of
sub-block j becomes the e4m3 of ``value · 2^-(R − e_j)``. With ``d = R − e_j <= 8`` that is exact (e2m1 has two
significant bits, the smallest product ``0.5 · 2^-8 = 2^-9`` is e4m3's smallest subnormal). The decode: the code's
three magnitude bits shifted into an fp16's exponent/mantissa fields are the value times 2^-14 (the e2m1 subnormal
0.5 lands on the fp16 subnormal 2^-15), one fp16 multiply by the exact ``2^(14 − d)`` and the hardware's
fp16 → e4m3 conversion (``cvt.rn.satfinite.e4m3x2.f16x2``, exact here). Then one ``tl.dot`` of the e4m3 tiles into a
fresh fp32 partial per 128 K and the promotion by the outer product ``a_scale[m] · 2^(R[n] − 127)``.

Exactness when a block's exponents spread by more than 8: per tile and K block the kernel takes
``max_n (R[n] − min_j e_j[n])``; over 8 it runs that K block as four 32-wide dots, each sub-block decoded at its own
exponent (d = 0) and promoted with ``a_scale · 2^(e_j − 127)``: slower, still exact. Real checkpoints spread by
0-3 within 128 K (NOTES.md), so the fast branch is the common one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from llmkernels import ScaledTensor
from llmkernels.grouped_matmul.kernel import find_group, group_tiles

BLOCK_K = 128  # one activation scale block per K step
MX_BLOCK = 32
MAX_SHIFT = tl.constexpr(8)  # largest exponent gap the fast branch decodes exactly (e4m3's smallest subnormal is 2^-9)


@dataclass(frozen=True)
class W4A8Config:
    """A launch of :func:`w4a8_grouped_matmul`: ``block_m`` tokens x ``block_n`` weight rows per tile; swap_ab puts
    the weight rows on the MMA's M side (decode: few tokens per group); tile_reference: one reference exponent per
    tile and K block instead of per weight row (one FFMA of promotion per element instead of FMUL + FFMA; the
    exact loop runs when the tile's exponents, not a row's, spread by more than 8)."""

    block_m: int = 128
    block_n: int = 128
    num_warps: int = 8
    num_stages: int = 3
    swap_ab: bool = False
    tile_reference: bool = False

    @property
    def label(self) -> str:
        return (
            f"{self.block_m}x{self.block_n} w{self.num_warps} s{self.num_stages}"
            + (" swapAB" if self.swap_ab else "")
            + (" tileref" if self.tile_reference else "")
        )


COMPUTE_CONFIG = W4A8Config(128, 128, 8, 3)
DECODE_CONFIG = W4A8Config(16, 128, 4, 4, swap_ab=True)
SWEEPS = {  # what bench_gpu.py times and compile_sm90.py compiles; the first of each is the regime's default
    "compute": [
        COMPUTE_CONFIG,  # two consumer warp groups of 64 tokens, one 128-row decoded weight tile
        W4A8Config(128, 128, 8, 3, tile_reference=True),
        W4A8Config(128, 256, 8, 3),  # each A tile feeds twice the weight rows (half the A traffic per FLOP)
        W4A8Config(256, 128, 8, 3),  # the decode amortized over twice the tokens
        W4A8Config(64, 128, 4, 4),
    ],
    "decode": [
        DECODE_CONFIG,  # weights on wgmma's M side (m64 per warp group), 16 tokens as N
        W4A8Config(16, 128, 4, 4, swap_ab=True, tile_reference=True),
        W4A8Config(32, 128, 4, 4, swap_ab=True),
        W4A8Config(64, 64, 4, 4, swap_ab=True),
        W4A8Config(64, 128, 4, 3),  # not swapped: 64-token tiles
    ],
}


@triton.jit
def e8m0_to_f32(e):
    """Exact 2^(e − 127) of e8m0 exponents (int32 in [0, 255]): e = 0 → the fp32 subnormal 2^-127, 255 → NaN."""
    bits = tl.where(e == 0, 0x00400000, tl.where(e == 255, 0x7FC00000, e << 23))
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def e2m1_as_f16(codes):
    """fp16 holding ``e2m1(code) · 2^-14`` exactly, codes int32 in [0, 15] (bit 3 the sign)."""
    bits = ((codes & 7) << 9) | ((codes & 8) << 12)
    return bits.to(tl.int16).to(tl.float16, bitcast=True)


@triton.jit
def shift_factor(shift):
    """fp16 ``2^(14 − shift)`` for int32 shifts in [0, 8] (exponent field 29 − shift)."""
    return ((29 - shift) << 10).to(tl.int16).to(tl.float16, bitcast=True)


@triton.jit
def decode_tile(packed, shifts, ROWS: tl.constexpr, COLS: tl.constexpr):
    """e4m3 ``[ROWS, COLS]`` of packed e2m1 bytes ``[ROWS, COLS / 2]`` (int32, low nibble the even element), each
    32-wide sub-block j scaled by ``2^-shifts[:, j]`` (shifts int32 ``[ROWS, COLS / 32]``, in [0, 8]): exact."""
    codes = tl.reshape(tl.join(packed & 15, packed >> 4), (ROWS, COLS))
    values = tl.reshape(e2m1_as_f16(codes), (ROWS, COLS // 32, 32))
    values = values * shift_factor(shifts)[:, :, None]
    return tl.reshape(values, (ROWS, COLS)).to(tl.float8e4nv)


@triton.jit
def decode_codes_kernel(codes_ptr, shifts_ptr, out_ptr, ROWS: tl.constexpr):
    """Test harness of :func:`decode_tile`: codes int32 ``[ROWS, 64]`` (0..15, the tile's element order), shifts
    int32 ``[ROWS, 2]``, out uint8 ``[ROWS, 64]`` (e4m3 bits)."""
    rows = tl.arange(0, ROWS)
    pairs = tl.arange(0, 32)
    low = tl.load(codes_ptr + rows[:, None] * 64 + 2 * pairs[None, :])
    high = tl.load(codes_ptr + rows[:, None] * 64 + 2 * pairs[None, :] + 1)
    shifts = tl.load(shifts_ptr + rows[:, None] * 2 + tl.arange(0, 2)[None, :])
    e4m3 = decode_tile(low | (high << 4), shifts, ROWS, 64)
    tl.store(out_ptr + rows[:, None] * 64 + tl.arange(0, 64)[None, :], e4m3.to(tl.uint8, bitcast=True))


def decode_e2m1(codes: torch.Tensor, shifts: torch.Tensor) -> torch.Tensor:
    """The kernel's decode on its own: e4m3 bits (uint8 ``[R, 64]``) of ``e2m1(codes) · 2^-shift``, codes int
    ``[R, 64]`` in [0, 15], shifts int ``[R, 2]`` in [0, 8] (one per 32 codes); R a power of two."""
    rows = codes.shape[0]
    if codes.shape != (rows, 64) or shifts.shape != (rows, 2) or rows & (rows - 1):
        raise ValueError(
            f"codes must be [R, 64] and shifts [R, 2], R a power of two; got {codes.shape}, {shifts.shape}"
        )
    out = torch.empty(rows, 64, dtype=torch.uint8, device=codes.device)
    decode_codes_kernel[(1,)](codes.int().contiguous(), shifts.int().contiguous(), out, ROWS=rows)
    return out


@triton.jit
def _k_step(
    acc,
    a_ptrs,
    a32_ptrs,
    a_scale_ptrs,
    w_ptrs,
    w16_ptrs,
    w_exp_ptrs,
    k_step,
    stride_a_k,
    stride_a_scale_k,
    stride_w_k,
    stride_w_exp_k,
    K,
    SWAP_AB: tl.constexpr,
    EXACT_BRANCH: tl.constexpr,
    EVEN_K: tl.constexpr,
    TILE_REFERENCE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """One 128-wide K step: acc ``[BLOCK_M, BLOCK_N]`` (``[BLOCK_N, BLOCK_M]`` with SWAP_AB) plus the step's
    promoted product. a_ptrs ``[BLOCK_M, 128]`` (a32_ptrs: its first 32 columns), a_scale_ptrs ``[BLOCK_M]``,
    w_ptrs ``[BLOCK_N, 64]`` bytes (w16_ptrs: its first 16), w_exp_ptrs ``[BLOCK_N, 4]``, all at K step 0. Without
    EXACT_BRANCH the caller knows every block's exponents spread by at most 8 (no branch in the loop: Triton
    pipelines its loads); with it, a block spread further takes the four-dot branch. Not EVEN_K (K a multiple of
    32, not of 128): columns past K read zero codes and zero activations; their exponents count for nothing.
    TILE_REFERENCE: the reference exponent is the tile's (max over its rows and sub-blocks), the spread that of the
    whole tile's exponents, and the promotion one FFMA by ``a_scale · 2^(R − 127)``; else one reference per row."""
    k0 = k_step * 128
    if EVEN_K:
        exps = tl.load(w_exp_ptrs + (4 * k_step) * stride_w_exp_k).to(tl.int32)  # [BLOCK_N, 4]
        low = exps
    else:
        exp_ok = (k0 + 32 * tl.arange(0, 4) < K)[None, :]
        exps = tl.load(w_exp_ptrs + (4 * k_step) * stride_w_exp_k, mask=exp_ok, other=0).to(tl.int32)
        low = tl.where(exp_ok, exps, 255)
    if TILE_REFERENCE:  # one reference for the whole tile: a scalar weight factor
        reference = tl.max(tl.max(exps, axis=1), axis=0)
        floor = tl.min(tl.min(low, axis=1), axis=0)
    else:  # one per weight row
        reference = tl.max(exps, axis=1)
        floor = tl.min(low, axis=1)
    a_scale = tl.load(a_scale_ptrs + k_step * stride_a_scale_k)
    if EXACT_BRANCH and TILE_REFERENCE:
        spread = reference - floor
    elif EXACT_BRANCH:
        spread = tl.max(reference - floor)
    else:
        spread = 0
    if spread <= MAX_SHIFT:
        if EVEN_K:
            a = tl.load(a_ptrs + k0 * stride_a_k)
            packed = tl.load(w_ptrs + (k_step * 64) * stride_w_k).to(tl.int32)
            if TILE_REFERENCE:
                shifts = reference - exps
            else:
                shifts = reference[:, None] - exps
        else:
            a = tl.load(a_ptrs + k0 * stride_a_k, mask=(k0 + tl.arange(0, 128) < K)[None, :], other=0)
            packed = tl.load(
                w_ptrs + (k_step * 64) * stride_w_k, mask=(k0 + 2 * tl.arange(0, 64) < K)[None, :], other=0
            ).to(tl.int32)
            if TILE_REFERENCE:
                shifts = tl.minimum(reference - exps, MAX_SHIFT)  # (a column past K: zero codes)
            else:
                shifts = tl.minimum(reference[:, None] - exps, MAX_SHIFT)
        a = a.to(tl.float8e4nv, bitcast=True)
        w = decode_tile(packed, shifts, BLOCK_N, 128)
        w_factor = e8m0_to_f32(reference)
        if TILE_REFERENCE:  # one FFMA per element, as the FP8-blocks kernel
            if SWAP_AB:
                acc += tl.dot(w, tl.trans(a)) * (a_scale * w_factor)[None, :]
            else:
                acc += tl.dot(a, tl.trans(w)) * (a_scale * w_factor)[:, None]
        elif SWAP_AB:  # a factor tile (FMUL) and the FFMA per element
            acc += tl.dot(w, tl.trans(a)) * (w_factor[:, None] * a_scale[None, :])
        else:
            acc += tl.dot(a, tl.trans(w)) * (a_scale[:, None] * w_factor[None, :])
    else:
        # Exponents too far apart for one reference: four 32-wide dots, each sub-block at its own exponent.
        for j in tl.static_range(4):
            # (K a multiple of 32: a sub-block lies wholly before or past K)
            a32 = tl.load(
                a32_ptrs + (k0 + 32 * j) * stride_a_k, mask=(k0 + 32 * j + tl.arange(0, 32) < K)[None, :], other=0
            ).to(tl.float8e4nv, bitcast=True)
            packed16 = tl.load(
                w16_ptrs + (k_step * 64 + 16 * j) * stride_w_k,
                mask=(k0 + 32 * j + tl.arange(0, 16) < K)[None, :],
                other=0,
            ).to(tl.int32)
            w32 = decode_tile(packed16, tl.zeros((BLOCK_N, 1), dtype=tl.int32), BLOCK_N, 32)
            factor_j = e8m0_to_f32(tl.sum(tl.where(tl.arange(0, 4)[None, :] == j, exps, 0), axis=1))
            if SWAP_AB:
                acc += tl.dot(w32, tl.trans(a32)) * (factor_j[:, None] * a_scale[None, :])
            else:
                acc += tl.dot(a32, tl.trans(w32)) * (a_scale[:, None] * factor_j[None, :])
    return acc


@triton.jit
def tile_spread(w_exp_row_ptrs, num_exps, stride_w_exp_k, TILE_REFERENCE: tl.constexpr, BLOCK_N: tl.constexpr):
    """``max_n,kb (max_j e[n, kb, j] − min_j e[n, kb, j])`` over a weight tile's rows (w_exp_row_ptrs ``[BLOCK_N]``
    at exponent column 0) and its ``num_exps`` exponents (the last 128-K block may hold fewer than 4), 16 K blocks
    per load. TILE_REFERENCE: max − min over all the tile's exponents of a K block, not per row."""
    columns = tl.arange(0, 64)
    spread = 0
    for start in range(0, num_exps, 64):
        valid = (start + columns < num_exps)[None, :]
        exps = tl.load(w_exp_row_ptrs[:, None] + (start + columns)[None, :] * stride_w_exp_k, mask=valid, other=0)
        high = tl.reshape(exps.to(tl.int32), (BLOCK_N, 16, 4))
        low = tl.reshape(tl.where(valid, exps.to(tl.int32), 255), (BLOCK_N, 16, 4))
        if TILE_REFERENCE:
            block_spread = tl.max(tl.max(high, axis=2), axis=0) - tl.min(tl.min(low, axis=2), axis=0)
        else:
            block_spread = tl.max(high, axis=2) - tl.min(low, axis=2)
        spread = tl.maximum(spread, tl.max(block_spread))
    return spread


@triton.jit
def w4a8_grouped_matmul_kernel(
    a_ptr,
    a_scales_ptr,
    w_ptr,
    w_exps_ptr,
    out_ptr,
    a_offsets_ptr,
    expert_ids_ptr,
    stride_a_row,
    stride_a_k,
    stride_a_scale_row,
    stride_a_scale_k,
    stride_w_expert,
    stride_w_row,
    stride_w_k,
    stride_w_exp_expert,
    stride_w_exp_row,
    stride_w_exp_k,
    stride_out_row,
    stride_out_col,
    num_tokens,
    num_groups,
    num_experts,
    N,
    K,
    SWAP_AB: tl.constexpr,
    EVEN_K: tl.constexpr,
    TILE_REFERENCE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_GROUPS: tl.constexpr,
):
    """One ``[BLOCK_M tokens, BLOCK_N columns]`` output tile per program (tile numbering of
    :func:`~llmkernels.grouped_matmul.kernel.group_tiles`; programs past the tile count exit).

    a: e4m3 bytes ``[T, K]``; a_scales float32 ``[T, cdiv(K, 128)]``; w: uint8 ``[E, N, K / 2]``; w_exps: uint8 e8m0
    ``[E, N, K / 32]``; out ``[T, N]``; a_offsets int32 ``[G + 1]`` (clamped on the device), expert_ids int32
    ``[G]`` (outside ``[0, E)``: zeros). K a multiple of 32; EVEN_K: of 128 (no masks in the K loop). Rows past a group's end re-read its rows (never
    stored); weight rows past N read row N − 1 (never stored): the K loop has no row masks."""
    n_tiles = tl.cdiv(N, BLOCK_N)
    group_ids, starts, ends, tiles, tiles_through, total_tiles = group_tiles(
        a_offsets_ptr, num_tokens, num_groups, -1, num_tokens, n_tiles, BLOCK_M, BLOCK_GROUPS
    )
    tile = tl.program_id(0)
    if tile >= total_tiles:
        return
    group, group_start, group_end, tile_in_group = find_group(tile, group_ids, starts, ends, tiles, tiles_through)
    m_tiles = tl.cdiv(group_end - group_start, BLOCK_M)
    tile_m = tile_in_group % m_tiles
    tile_n = tile_in_group // m_tiles
    expert = tl.load(expert_ids_ptr + group)
    expert_ok = (expert >= 0) & (expert < num_experts)
    expert = tl.where(expert_ok, expert, 0).to(tl.int64)

    tile_start = group_start + tile_m * BLOCK_M
    tile_rows = (group_end - tile_start).to(tl.int32)
    local_rows = tl.arange(0, BLOCK_M)
    load_rows = local_rows % tile_rows
    a_ptrs = (a_ptr + tile_start * stride_a_row) + (
        load_rows[:, None] * stride_a_row + tl.arange(0, 128)[None, :] * stride_a_k
    )
    a32_ptrs = (a_ptr + tile_start * stride_a_row) + (
        load_rows[:, None] * stride_a_row + tl.arange(0, 32)[None, :] * stride_a_k
    )
    a_scale_ptrs = (a_scales_ptr + tile_start * stride_a_scale_row) + load_rows * stride_a_scale_row
    first_col = tile_n * BLOCK_N
    w_rows = tl.minimum(first_col + tl.arange(0, BLOCK_N), N - 1)
    w_ptrs = (w_ptr + expert * stride_w_expert) + (
        w_rows[:, None] * stride_w_row + tl.arange(0, 64)[None, :] * stride_w_k
    )
    w16_ptrs = (w_ptr + expert * stride_w_expert) + (
        w_rows[:, None] * stride_w_row + tl.arange(0, 16)[None, :] * stride_w_k
    )
    w_exp_ptrs = (w_exps_ptr + expert * stride_w_exp_expert) + (
        w_rows[:, None] * stride_w_exp_row + tl.arange(0, 4)[None, :] * stride_w_exp_k
    )

    if SWAP_AB:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # One look at the tile's exponents picks the loop: the branch-free one (the common case: Triton pipelines
    # it) or the one that checks each K block.
    k_steps = tl.where(expert_ok, tl.cdiv(K, 128), 0)
    w_exp_row_ptrs = (w_exps_ptr + expert * stride_w_exp_expert) + w_rows * stride_w_exp_row
    if (
        tile_spread(w_exp_row_ptrs, tl.where(expert_ok, K // 32, 0), stride_w_exp_k, TILE_REFERENCE, BLOCK_N)
        <= MAX_SHIFT
    ):
        for k_step in range(0, k_steps):
            acc = _k_step(
                acc,
                a_ptrs,
                a32_ptrs,
                a_scale_ptrs,
                w_ptrs,
                w16_ptrs,
                w_exp_ptrs,
                k_step,
                stride_a_k,
                stride_a_scale_k,
                stride_w_k,
                stride_w_exp_k,
                K,
                SWAP_AB,
                False,
                EVEN_K,
                TILE_REFERENCE,
                BLOCK_M,
                BLOCK_N,
            )
    else:
        for k_step in range(0, k_steps):
            acc = _k_step(
                acc,
                a_ptrs,
                a32_ptrs,
                a_scale_ptrs,
                w_ptrs,
                w16_ptrs,
                w_exp_ptrs,
                k_step,
                stride_a_k,
                stride_a_scale_k,
                stride_w_k,
                stride_w_exp_k,
                K,
                SWAP_AB,
                True,
                EVEN_K,
                TILE_REFERENCE,
                BLOCK_M,
                BLOCK_N,
            )
    if SWAP_AB:
        acc = tl.trans(acc)
    cols = first_col + tl.arange(0, BLOCK_N)
    out_ptrs = (out_ptr + tile_start * stride_out_row) + (
        local_rows[:, None] * stride_out_row + cols[None, :] * stride_out_col
    )
    mask = (local_rows < tile_rows)[:, None] & (cols < N)[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def _check(a_fp8, w, a_offsets, expert_ids, out, out_dtype):
    if not isinstance(a_fp8, ScaledTensor) or a_fp8.format != "fp8" or tuple(a_fp8.block) != (1, 128):
        raise TypeError("a_fp8 must be a ScaledTensor of format 'fp8' with block (1, 128)")
    if not isinstance(w, ScaledTensor) or w.format != "mxfp4" or w.data.dim() != 3:
        raise TypeError("w must be a ScaledTensor of format 'mxfp4', shape [E, N, K], row scale layout")
    tokens, k = a_fp8.data.shape
    experts, n, half_k = w.data.shape
    if k != 2 * half_k or k % MX_BLOCK:
        raise ValueError(f"a_fp8 and w must share K, a multiple of 32; got {k} and {2 * half_k}")
    if a_fp8.scales.shape != (tokens, triton.cdiv(k, BLOCK_K)) or a_fp8.scales.dtype != torch.float32:
        raise ValueError(f"a_fp8.scales must be float32 [T, cdiv(K, 128)], got {tuple(a_fp8.scales.shape)}")
    if w.scales.shape != (experts, n, k // MX_BLOCK):
        raise ValueError(f"w.scales must be [E, N, K / 32] (row layout), got {tuple(w.scales.shape)}")
    if a_offsets.dtype != torch.int32 or a_offsets.dim() != 1:
        raise TypeError("a_offsets must be a 1-D int32 tensor")
    if expert_ids.dtype != torch.int32 or expert_ids.shape != (a_offsets.shape[0] - 1,):
        raise ValueError("expert_ids must be int32 [G] with a_offsets [G + 1]")
    if out_dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"out_dtype must be bf16, fp16 or fp32, got {out_dtype}")
    if out is not None and (out.shape != (tokens, n) or out.dtype != out_dtype):
        raise ValueError(f"out must be {out_dtype} [{tokens}, {n}], got {out.dtype} {tuple(out.shape)}")


def plan_launch(a_fp8, w, a_offsets, expert_ids, out, config: W4A8Config = COMPUTE_CONFIG):
    """``(grid, arguments, constexprs, options)`` of one launch (no sync: the grid bounds the tile count from the
    shapes alone)."""
    tokens, k = a_fp8.data.shape
    experts, n, _ = w.data.shape
    groups = expert_ids.shape[0]
    a = a_fp8.data.view(torch.uint8) if a_fp8.data.dtype != torch.uint8 else a_fp8.data
    w_exps = w.scales.view(torch.uint8) if w.scales.dtype != torch.uint8 else w.scales
    n_tiles = triton.cdiv(n, config.block_n)
    grid = (max((triton.cdiv(tokens, config.block_m) + groups) * n_tiles, 1),)
    arguments = dict(
        a_ptr=a,
        a_scales_ptr=a_fp8.scales,
        w_ptr=w.data,
        w_exps_ptr=w_exps,
        out_ptr=out,
        a_offsets_ptr=a_offsets,
        expert_ids_ptr=expert_ids,
        stride_a_row=a.stride(0),
        stride_a_k=a.stride(1),
        stride_a_scale_row=a_fp8.scales.stride(0),
        stride_a_scale_k=a_fp8.scales.stride(1),
        stride_w_expert=w.data.stride(0),
        stride_w_row=w.data.stride(1),
        stride_w_k=w.data.stride(2),
        stride_w_exp_expert=w_exps.stride(0),
        stride_w_exp_row=w_exps.stride(1),
        stride_w_exp_k=w_exps.stride(2),
        stride_out_row=out.stride(0),
        stride_out_col=out.stride(1),
        num_tokens=tokens,
        num_groups=groups,
        num_experts=experts,
        N=n,
        K=k,
    )
    constexprs = dict(
        SWAP_AB=config.swap_ab,
        EVEN_K=k % BLOCK_K == 0,
        TILE_REFERENCE=config.tile_reference,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_GROUPS=max(triton.next_power_of_2(groups), 2),
    )
    options = dict(num_warps=config.num_warps, num_stages=config.num_stages)
    return grid, arguments, constexprs, options


def w4a8_grouped_matmul(
    a_fp8: ScaledTensor,
    w: ScaledTensor,
    a_offsets: torch.Tensor,
    expert_ids: torch.Tensor,
    out: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    config: W4A8Config = COMPUTE_CONFIG,
) -> torch.Tensor:
    """Grouped ``A[rows of g] @ W[expert_ids[g]]ᵀ`` with FP8-block activations and MXFP4 weights.

    Args:
        a_fp8: ScaledTensor ``fp8`` block (1, 128): e4m3 ``[T, K]``, float32 scales ``[T, cdiv(K, 128)]``.
        w: ScaledTensor ``mxfp4`` (row scale layout): uint8 ``[E, N, K / 2]``, e8m0 ``[E, N, K / 32]``.
        a_offsets: int32 ``[G + 1]`` on the device (clamped there, never read on the host).
        expert_ids: int32 ``[G]``; an id outside ``[0, E)`` writes its group's rows as zeros.
        out: optional ``[T, N]`` of out_dtype; rows outside every group keep what they hold.
        out_dtype: bf16 (default), fp16 or fp32.
        config: :class:`W4A8Config` (COMPUTE_CONFIG or DECODE_CONFIG).

    Returns ``out`` ``[T, N]``. Raises TypeError / ValueError (naming the argument) before any launch. K must be
    a multiple of 32 (a multiple of 128 runs without K masks).
    """
    _check(a_fp8, w, a_offsets, expert_ids, out, out_dtype)
    tokens = a_fp8.data.shape[0]
    if out is None:
        out = torch.empty(tokens, w.data.shape[1], dtype=out_dtype, device=a_fp8.data.device)
    if tokens == 0 or expert_ids.shape[0] == 0:
        return out
    grid, arguments, constexprs, options = plan_launch(a_fp8, w, a_offsets, expert_ids, out, config)
    w4a8_grouped_matmul_kernel[grid](**arguments, **constexprs, **options)
    return out
