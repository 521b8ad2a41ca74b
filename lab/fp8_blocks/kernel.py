"""Prototype grouped 1D-1D matmul for DeepSeek-style FP8 blocks on Hopper's FP8 tensor cores (issue 44).

``out[rows of g] = expert_scales[e] · Σ_kb (A_kb @ B[e]_kbᵀ) · a_scale[row, kb] · b_scale[e, n // 128, kb]``,
``e = expert_ids[g]``, for all groups in one launch, on:

* A: ``float8_e4m3fn [T, K]``, a_scales float32 ``[T, ceil(K / 128)]`` (one per token per 128 columns);
* B: ``float8_e4m3fn [E, N, K]``, b_scales float32 ``[E, ceil(N / 128), ceil(K / 128)]`` (one per 128 x 128 tile);
* a_offsets int32 ``[G + 1]`` and expert_ids int32 ``[G]`` on the device (no host sync: the kernel finds each
  tile's group itself); out bf16 ``[T, N]`` (float32 also works, for exactness tests).

The K loop steps one 128-wide scale block at a time (``BLOCK_K = 128``). Each step is one ``tl.dot`` of the raw
e4m3 tiles into a fresh fp32 partial product (``wgmma.mma_async...e4m3.e4m3`` on sm_90a), then the *promotion*
``acc += partial · (a_scale · b_scale)``, DeepGEMM's scheme: the tensor core only ever accumulates 128 products
in its reduced-precision fp8 accumulator, the running sum is a full fp32 FFMA on the CUDA cores. The weight tile
is one or two sub-tiles (``SPLIT_N``) of ``BLOCK_N / SPLIT_N`` rows, a divisor of 128: each lies in one 128-row
scale block, so its weight scale is one scalar per K step and the promotion is a single FFMA per accumulator
element with a per-row factor.

Two orientations (``SWAP_AB``):

* plain: acc ``[BLOCK_M tokens, BLOCK_N weight rows]`` = A tile · B tileᵀ (prefill, many tokens per expert);
* swap-AB: acc ``[BLOCK_N weight rows, BLOCK_M tokens]`` = B tile · A tileᵀ, the weights on wgmma's M side
  (which must be 64 rows or more) and the few tokens of a decode step on its N side (16 or more, padded).

Grid: tiles (group, n-tile, m-tile) are numbered group after group, m-tiles fastest (neighbouring programs
share a weight tile in L2); tiles never straddle two groups and empty groups have none. Program ``p`` takes
tiles ``p, p + P, ...``: a grid of the host's upper bound on the tile count is a flat launch (one tile per
program, the extra programs exit), a grid of a few programs per SM is a persistent launch.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

SCALE_BLOCK = 128  # the format's block side, in K and (weights) in N


@triton.jit
def _running_max(a, b):
    return tl.maximum(a, b)


@triton.jit
def _pick(values, ids, index):
    """``values[index]`` of a small register vector (a masked sum: no dynamic register indexing)."""
    return tl.sum(tl.where(ids == index, values, 0))


@triton.jit
def group_tiles(a_offsets_ptr, num_tokens, num_groups, n_tiles, BLOCK_M: tl.constexpr, BLOCK_GROUPS: tl.constexpr):
    """The launch's tiles from the device offsets: ``(group_ids, starts, ends, tiles, tiles_through, total)``.

    Per group (``[BLOCK_GROUPS]`` vectors): its row range, its tile count ``cdiv(rows, BLOCK_M) · n_tiles``
    and the running sum of the counts; ``total`` is the launch's tile count. Offsets are clamped to
    ``[0, num_tokens]`` and made non-decreasing (running maximum), so whatever the metadata every row belongs
    to at most one group and every store lands inside ``out`` (the library's rule, same idea)."""
    group_ids = tl.arange(0, BLOCK_GROUPS)
    in_range = group_ids < num_groups
    first = tl.load(a_offsets_ptr).to(tl.int64)
    starts = tl.load(a_offsets_ptr + group_ids, mask=in_range, other=0).to(tl.int64)
    ends = tl.load(a_offsets_ptr + group_ids + 1, mask=in_range, other=0).to(tl.int64)
    starts = tl.minimum(tl.maximum(tl.associative_scan(starts, 0, _running_max), 0), num_tokens)
    ends = tl.maximum(tl.associative_scan(ends, 0, _running_max), first)
    ends = tl.minimum(tl.maximum(ends, 0), num_tokens)
    tiles = tl.where(in_range, tl.cdiv(ends - starts, BLOCK_M) * n_tiles, 0)
    return group_ids, starts, ends, tiles, tl.cumsum(tiles, 0), tl.sum(tiles)


@triton.jit
def find_group(tile, group_ids, starts, ends, tiles, tiles_through):
    """``(group, group_start, group_end, tile_in_group)`` of tile number ``tile`` (as :func:`group_tiles` counts)."""
    group = tl.sum((tiles_through <= tile).to(tl.int32))
    tile_in_group = tile - (_pick(tiles_through, group_ids, group) - _pick(tiles, group_ids, group))
    return group, _pick(starts, group_ids, group), _pick(ends, group_ids, group), tile_in_group


@triton.jit
def promoted_step(acc, a, b, a_scale, b_scale, SWAP_AB: tl.constexpr):
    """One 128-wide K step: the raw e4m3 tiles' product on the tensor cores (a fresh fp32 partial, wgmma's own
    accumulator), then the promotion into ``acc`` with one FFMA per element.

    a ``[BLOCK_M, 128]`` tokens, b ``[SUB_N, 128]`` weight rows (e4m3); a_scale ``[BLOCK_M]``; b_scale a
    scalar (the sub-tile lies in one 128-row scale block). acc ``[BLOCK_M, SUB_N]``, or ``[SUB_N, BLOCK_M]``
    with SWAP_AB (the weights on wgmma's M side)."""
    if SWAP_AB:
        return acc + tl.dot(b, tl.trans(a)) * (a_scale * b_scale)[None, :]
    else:
        return acc + tl.dot(a, tl.trans(b)) * (a_scale * b_scale)[:, None]


@triton.jit
def store_tile(out_ptr, acc, rows, row_mask, cols, stride_out_row, N, multiplier, expert_ok, SWAP_AB: tl.constexpr):
    """``acc · multiplier`` (zeros for a bad expert id) into ``out[rows, cols]``, masked to the group's rows and N;
    a SWAP_AB tile (``[cols, rows]``) is stored transposed, with no register shuffle."""
    result = tl.where(expert_ok, acc * multiplier, 0.0).to(out_ptr.dtype.element_ty)
    col_mask = cols < N
    if SWAP_AB:
        tl.store(out_ptr + rows[None, :] * stride_out_row + cols[:, None], result,
                 mask=row_mask[None, :] & col_mask[:, None])
    else:
        tl.store(out_ptr + rows[:, None] * stride_out_row + cols[None, :], result,
                 mask=row_mask[:, None] & col_mask[None, :])


@triton.jit
def compute_tile(
    tile, group_ids, starts, ends, tiles, tiles_through,
    a_ptr, a_scales_ptr, b_ptr, b_scales_ptr, out_ptr, expert_ids_ptr, expert_scales_ptr,
    stride_a_row, stride_a_scale_row, stride_a_scale_k,
    stride_b_expert, stride_b_row, stride_b_scale_expert, stride_b_scale_row, stride_b_scale_k,
    stride_out_row, num_experts, N, K,
    HAS_EXPERT_SCALES: tl.constexpr, SWAP_AB: tl.constexpr, EVEN_K: tl.constexpr, SPLIT_N: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """One output tile: ``[BLOCK_M tokens of one group] x [BLOCK_N weight rows]`` over all of K."""
    SUB_N: tl.constexpr = BLOCK_N // SPLIT_N
    group, group_start, group_end, tile_in_group = find_group(tile, group_ids, starts, ends, tiles, tiles_through)
    m_tiles = tl.cdiv(group_end - group_start, BLOCK_M)
    tile_m = tile_in_group % m_tiles
    tile_n = tile_in_group // m_tiles

    expert = tl.load(expert_ids_ptr + group)
    expert_ok = (expert >= 0) & (expert < num_experts)
    expert = tl.where(expert_ok, expert, 0).to(tl.int64)

    # 64-bit scalar bases per tile, 32-bit offsets inside it (a tile spans < 2**31 bytes). Loads need no row or
    # column masks (fewer registers in the K loop): rows past the group's end read the group's rows again and
    # weight rows past N read row N - 1; neither is stored. Only a ragged K is masked.
    tile_start = group_start + tile_m * BLOCK_M  # int64
    tile_rows = (group_end - tile_start).to(tl.int32)  # >= 1
    local_rows = tl.arange(0, BLOCK_M)
    rows = tile_start + local_rows
    row_mask = local_rows < tile_rows
    load_rows = local_rows % tile_rows
    ks = tl.arange(0, BLOCK_K)
    a_tile_ptrs = (a_ptr + tile_start * stride_a_row) + (load_rows[:, None] * stride_a_row + ks[None, :])
    a_scale_ptrs = (a_scales_ptr + tile_start * stride_a_scale_row) + load_rows * stride_a_scale_row
    # Weight sub-tile j: rows cols_j; its scale row (cols_j[0] // 128) is one scalar per K step.
    first_col = tile_n * BLOCK_N
    sub_rows = tl.arange(0, SUB_N)
    cols0 = first_col + sub_rows
    cols1 = cols0 + SUB_N
    last_row = (N - 1 - first_col).to(tl.int32)
    b_tile_base = b_ptr + expert * stride_b_expert + first_col.to(tl.int64) * stride_b_row
    b0_ptrs = b_tile_base + (tl.minimum(sub_rows, last_row)[:, None] * stride_b_row + ks[None, :])
    b1_ptrs = b_tile_base + (tl.minimum(sub_rows + SUB_N, last_row)[:, None] * stride_b_row + ks[None, :])
    b_scale_expert = b_scales_ptr + expert * stride_b_scale_expert
    b0_scale_ptr = b_scale_expert + (first_col // 128) * stride_b_scale_row
    # a second sub-tile wholly past N reads the first one's scale row (the next may not exist); it is not stored
    b1_scale_ptr = b_scale_expert + (tl.minimum(first_col + SUB_N, N - 1) // 128) * stride_b_scale_row

    if SWAP_AB:
        acc0 = tl.zeros((SUB_N, BLOCK_M), dtype=tl.float32)
    else:
        acc0 = tl.zeros((BLOCK_M, SUB_N), dtype=tl.float32)
    acc1 = acc0
    for k_step in range(tl.where(expert_ok, tl.cdiv(K, BLOCK_K), 0)):
        k_start = k_step * BLOCK_K
        a_scale = tl.load(a_scale_ptrs + k_step * stride_a_scale_k)
        b0_scale = tl.load(b0_scale_ptr + k_step * stride_b_scale_k)
        if EVEN_K:
            a = tl.load(a_tile_ptrs + k_start)
            b0 = tl.load(b0_ptrs + k_start)
        else:  # the tail of the last K step reads zeros (garbage there could be NaN codes)
            k_mask = (ks < K - k_start)[None, :]
            a = tl.load(a_tile_ptrs + k_start, mask=k_mask, other=0.0)
            b0 = tl.load(b0_ptrs + k_start, mask=k_mask, other=0.0)
        acc0 = promoted_step(acc0, a, b0, a_scale, b0_scale, SWAP_AB)
        if SPLIT_N == 2:
            b1_scale = tl.load(b1_scale_ptr + k_step * stride_b_scale_k)
            if EVEN_K:
                b1 = tl.load(b1_ptrs + k_start)
            else:
                b1 = tl.load(b1_ptrs + k_start, mask=k_mask, other=0.0)
            acc1 = promoted_step(acc1, a, b1, a_scale, b1_scale, SWAP_AB)

    multiplier = 1.0
    if HAS_EXPERT_SCALES:
        multiplier = tl.load(expert_scales_ptr + expert)
    store_tile(out_ptr, acc0, rows, row_mask, cols0, stride_out_row, N, multiplier, expert_ok, SWAP_AB)
    if SPLIT_N == 2:
        store_tile(out_ptr, acc1, rows, row_mask, cols1, stride_out_row, N, multiplier, expert_ok, SWAP_AB)


@triton.jit
def fp8_block_grouped_matmul_kernel(
    a_ptr, a_scales_ptr, b_ptr, b_scales_ptr, out_ptr, a_offsets_ptr, expert_ids_ptr, expert_scales_ptr,
    stride_a_row, stride_a_scale_row, stride_a_scale_k,
    stride_b_expert, stride_b_row, stride_b_scale_expert, stride_b_scale_row, stride_b_scale_k,
    stride_out_row,
    num_tokens, num_groups, num_experts, N, K,
    HAS_EXPERT_SCALES: tl.constexpr, SWAP_AB: tl.constexpr, EVEN_K: tl.constexpr, SPLIT_N: tl.constexpr,
    PERSISTENT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_GROUPS: tl.constexpr,
):
    """Grouped FP8-block matmul with per-128-K promotion (see the module docstring for the math).

    a ``[num_tokens, K]`` e4m3, unit column stride; a_scales float32 ``[num_tokens, cdiv(K, 128)]`` (any
    strides: row-major or token-major); b ``[num_experts, N, K]`` e4m3, unit column stride; b_scales float32
    ``[num_experts, cdiv(N, 128), cdiv(K, 128)]``; out ``[num_tokens, N]`` bf16/fp32, unit column stride;
    a_offsets int32 ``[num_groups + 1]``; expert_ids int32 ``[num_groups]``; expert_scales float32
    ``[num_experts]`` (read when HAS_EXPERT_SCALES).

    BLOCK_K must be 128 (one scale block per step). The weight tile is SPLIT_N (1 or 2) sub-tiles of
    ``SUB_N = BLOCK_N / SPLIT_N`` rows, SUB_N a divisor of 128: each sub-tile lies in one 128-row scale block
    (one scalar weight scale per K step) and has its own accumulator and MMA, so a 256-wide tile holds two
    accumulators but only one sub-tile's partial product at a time (registers: acc + partial / SPLIT_N).
    BLOCK_GROUPS: a power of two >= num_groups. A group whose expert id is outside ``[0, num_experts)`` is
    written as zeros (its K loop runs no step). Rows outside every group are never written.
    """
    SUB_N: tl.constexpr = BLOCK_N // SPLIT_N
    tl.static_assert(BLOCK_K == 128, "one 128-wide scale block per K step")
    tl.static_assert(SPLIT_N == 1 or SPLIT_N == 2, "one or two weight sub-tiles")
    tl.static_assert(128 % SUB_N == 0, "a weight sub-tile must lie in one 128-row scale block")
    n_tiles = tl.cdiv(N, BLOCK_N)
    group_ids, starts, ends, tiles, tiles_through, total_tiles = group_tiles(
        a_offsets_ptr, num_tokens, num_groups, n_tiles, BLOCK_M, BLOCK_GROUPS)

    if PERSISTENT:
        for tile in range(tl.program_id(0), total_tiles, tl.num_programs(0)):
            compute_tile(
                tile, group_ids, starts, ends, tiles, tiles_through,
                a_ptr, a_scales_ptr, b_ptr, b_scales_ptr, out_ptr, expert_ids_ptr, expert_scales_ptr,
                stride_a_row, stride_a_scale_row, stride_a_scale_k,
                stride_b_expert, stride_b_row, stride_b_scale_expert, stride_b_scale_row, stride_b_scale_k,
                stride_out_row, num_experts, N, K,
                HAS_EXPERT_SCALES, SWAP_AB, EVEN_K, SPLIT_N, BLOCK_M, BLOCK_N, BLOCK_K)
    else:  # one tile per program; programs past the last tile exit
        tile = tl.program_id(0)
        if tile < total_tiles:
            compute_tile(
                tile, group_ids, starts, ends, tiles, tiles_through,
                a_ptr, a_scales_ptr, b_ptr, b_scales_ptr, out_ptr, expert_ids_ptr, expert_scales_ptr,
                stride_a_row, stride_a_scale_row, stride_a_scale_k,
                stride_b_expert, stride_b_row, stride_b_scale_expert, stride_b_scale_row, stride_b_scale_k,
                stride_out_row, num_experts, N, K,
                HAS_EXPERT_SCALES, SWAP_AB, EVEN_K, SPLIT_N, BLOCK_M, BLOCK_N, BLOCK_K)


# ----------------------------------------------------------------------------------------------------------------
# Host side


@dataclass(frozen=True)
class Fp8BlockConfig:
    """One launch configuration.

    block_m: tokens per tile (wgmma's M side when not swapped: 64 or 128; with swap_ab its N side: 16..64).
    block_n: weight rows per tile (wgmma's N side, or with swap_ab its M side: >= 64), made of split_n
    sub-tiles of ``block_n / split_n`` rows, a divisor of 128 (each sub-tile in one weight-scale block:
    256-wide tiles are two 128-row sub-tiles).
    programs_per_sm: None for a flat grid (one tile per program), else a persistent grid of that many programs
    per SM.
    """

    block_m: int = 128
    block_n: int = 128
    num_warps: int = 8
    num_stages: int = 3
    swap_ab: bool = False
    programs_per_sm: int | None = None
    split_n: int = 1

    def __post_init__(self):
        if self.split_n not in (1, 2) or 128 % (self.block_n // self.split_n) or self.block_n % self.split_n:
            raise ValueError(f"block_n / split_n must divide 128 (split_n 1 or 2), got {self.block_n} / {self.split_n}")

    @property
    def label(self) -> str:
        grid = "flat" if self.programs_per_sm is None else f"persistent x{self.programs_per_sm}"
        swap = " swapAB" if self.swap_ab else ""
        split = f" split{self.split_n}" if self.split_n > 1 else ""
        return f"{self.block_m}x{self.block_n}x128{split} w{self.num_warps} s{self.num_stages}{swap} {grid}"


# Defaults for sm_90a (the GPU bench sweeps around them): prefill tiles 128 tokens x 128 weight rows in two
# consumer warp groups (each a 64-row wgmma m64n128k32, fp32 acc + partial = 128 registers per thread), and for
# decode 16 tokens x 128 weight rows swapped (weights streamed through 4 stages of 16 KB).
COMPUTE_CONFIG = Fp8BlockConfig(block_m=128, block_n=128, num_warps=8, num_stages=4)
DECODE_CONFIG = Fp8BlockConfig(block_m=16, block_n=128, num_warps=4, num_stages=4, swap_ab=True)


def default_config(num_tokens: int, num_groups: int) -> Fp8BlockConfig:
    """Decode tiles when the average group is small (<= 32 tokens), else prefill tiles. Shapes only: no sync."""
    return DECODE_CONFIG if num_tokens <= 32 * max(num_groups, 1) else COMPUTE_CONFIG


def _multiprocessors(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # the interpreter: a few programs, so that tests walk the persistent loop


def max_tiles(num_tokens: int, num_groups: int, n: int, config: Fp8BlockConfig) -> int:
    """Upper bound on the tile count of any grouping of ``num_tokens`` rows into ``num_groups`` groups:
    ``Σ_g cdiv(rows_g, BLOCK_M) <= cdiv(T, BLOCK_M) + G`` m-tiles, times the n-tiles."""
    return (triton.cdiv(num_tokens, config.block_m) + num_groups) * triton.cdiv(n, config.block_n)


def check_arguments(a, a_scales, b, b_scales, a_offsets, expert_ids, expert_scales, out) -> None:
    """Raises ValueError on wrong dtypes or shapes (shapes only: no device sync)."""
    if a.dtype != torch.float8_e4m3fn or b.dtype != torch.float8_e4m3fn:
        raise ValueError(f"a and b must be float8_e4m3fn, got {a.dtype} and {b.dtype}")
    if a.dim() != 2 or b.dim() != 3 or a.shape[1] != b.shape[2]:
        raise ValueError(f"a must be [T, K] and b [E, N, K], got {tuple(a.shape)} and {tuple(b.shape)}")
    (num_tokens, k), (num_experts, n, _) = a.shape, b.shape
    k_blocks, n_blocks = triton.cdiv(k, SCALE_BLOCK), triton.cdiv(n, SCALE_BLOCK)
    if tuple(a_scales.shape) != (num_tokens, k_blocks) or a_scales.dtype != torch.float32:
        raise ValueError(f"a_scales must be float32 {(num_tokens, k_blocks)}, got {a_scales.dtype} "
                         f"{tuple(a_scales.shape)}")
    if tuple(b_scales.shape) != (num_experts, n_blocks, k_blocks) or b_scales.dtype != torch.float32:
        raise ValueError(f"b_scales must be float32 {(num_experts, n_blocks, k_blocks)}, got {b_scales.dtype} "
                         f"{tuple(b_scales.shape)}")
    num_groups = expert_ids.numel()
    if a_offsets.numel() != num_groups + 1 or a_offsets.dtype != torch.int32 or expert_ids.dtype != torch.int32:
        raise ValueError("a_offsets must be int32 [G + 1] and expert_ids int32 [G]")
    if expert_scales is not None and (tuple(expert_scales.shape) != (num_experts,)
                                      or expert_scales.dtype != torch.float32):
        raise ValueError(f"expert_scales must be float32 [{num_experts}]")
    if tuple(out.shape) != (num_tokens, n) or out.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"out must be bf16 or float32 {(num_tokens, n)}, got {out.dtype} {tuple(out.shape)}")
    if a.stride(1) != 1 or b.stride(2) != 1 or out.stride(1) != 1:
        raise ValueError("a, b and out need a unit column stride (the launcher copies other views)")


def plan_launch(a, a_scales, b, b_scales, a_offsets, expert_ids, expert_scales, out, config: Fp8BlockConfig,
                multiprocessors: int):
    """``(grid, arguments, constexprs, options)`` of the kernel launch on these tensors: what
    :func:`fp8_block_grouped_matmul` launches and what ``compile_sm90.py`` compiles (on meta tensors, which
    give the same signature: shapes, strides and dtypes only)."""
    check_arguments(a, a_scales, b, b_scales, a_offsets, expert_ids, expert_scales, out)
    (num_tokens, k), (num_experts, n, _) = a.shape, b.shape
    num_groups = expert_ids.numel()
    tiles = max_tiles(num_tokens, num_groups, n, config)
    if config.programs_per_sm is not None:
        tiles = min(tiles, config.programs_per_sm * multiprocessors)
    arguments = dict(
        a_ptr=a, a_scales_ptr=a_scales, b_ptr=b, b_scales_ptr=b_scales, out_ptr=out, a_offsets_ptr=a_offsets,
        expert_ids_ptr=expert_ids,
        expert_scales_ptr=expert_scales if expert_scales is not None else a_scales,  # unread without the flag
        stride_a_row=a.stride(0), stride_a_scale_row=a_scales.stride(0), stride_a_scale_k=a_scales.stride(1),
        stride_b_expert=b.stride(0), stride_b_row=b.stride(1), stride_b_scale_expert=b_scales.stride(0),
        stride_b_scale_row=b_scales.stride(1), stride_b_scale_k=b_scales.stride(2), stride_out_row=out.stride(0),
        num_tokens=num_tokens, num_groups=num_groups, num_experts=num_experts, N=n, K=k)
    constexprs = dict(
        HAS_EXPERT_SCALES=expert_scales is not None, SWAP_AB=config.swap_ab, EVEN_K=k % SCALE_BLOCK == 0,
        SPLIT_N=config.split_n, PERSISTENT=config.programs_per_sm is not None,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=SCALE_BLOCK,
        BLOCK_GROUPS=max(triton.next_power_of_2(num_groups), 2))
    options = dict(num_warps=config.num_warps, num_stages=config.num_stages)
    return (max(tiles, 1),), arguments, constexprs, options


def fp8_block_grouped_matmul(a: torch.Tensor, a_scales: torch.Tensor, b: torch.Tensor, b_scales: torch.Tensor,
                             a_offsets: torch.Tensor, expert_ids: torch.Tensor,
                             expert_scales: torch.Tensor | None = None, out: torch.Tensor | None = None,
                             config: Fp8BlockConfig | None = None) -> torch.Tensor:
    """``out[rows of g] = expert_scales[e] · A[rows of g] @ B[e]ᵀ`` on decoded FP8 blocks, ``e = expert_ids[g]``.

    Args:
        a: ``float8_e4m3fn [T, K]``; a_scales: float32 ``[T, ceil(K / 128)]`` (any strides).
        b: ``float8_e4m3fn [E, N, K]``; b_scales: float32 ``[E, ceil(N / 128), ceil(K / 128)]`` (any strides).
        a_offsets: int32 ``[G + 1]`` on a's device (a_offsets[0] = 0, non-decreasing, <= T).
        expert_ids: int32 ``[G]``; -1 (or any id outside [0, E)) writes the group's rows as zeros.
        expert_scales: optional float32 ``[E]``, multiplies the fp32 accumulator.
        out: optional ``[T, N]`` bf16 (or float32) to write into; rows past ``a_offsets[G]`` are left as they
            are. Default: a new bf16 tensor (those rows uninitialized).
        config: :class:`Fp8BlockConfig`; default :func:`default_config`.

    Returns:
        ``out``.

    Raises:
        ValueError: wrong dtypes or shapes (checked on the host from shapes only: no device sync).
    """
    if a.dim() != 2 or b.dim() != 3:
        raise ValueError(f"a must be [T, K] and b [E, N, K], got {tuple(a.shape)} and {tuple(b.shape)}")
    if out is None:
        out = torch.empty(a.shape[0], b.shape[1], dtype=torch.bfloat16, device=a.device)
    if expert_ids.numel() == 0 or a.shape[0] == 0 or b.shape[1] == 0:
        check_arguments(a, a_scales, b, b_scales, a_offsets, expert_ids, expert_scales, out)
        return out
    # The kernel reads data rows with unit column stride (vector loads) and the metadata contiguous; other
    # views are copied (a prototype's shortcut: the library takes any strides).
    a = a if a.stride(1) == 1 else a.contiguous()
    b = b if b.stride(2) == 1 else b.contiguous()
    a_offsets, expert_ids = a_offsets.contiguous(), expert_ids.contiguous()
    expert_scales = expert_scales.contiguous() if expert_scales is not None else None
    target = out if out.stride(1) == 1 else out.contiguous()
    config = config or default_config(a.shape[0], expert_ids.numel())
    grid, arguments, constexprs, options = plan_launch(a, a_scales, b, b_scales, a_offsets, expert_ids,
                                                       expert_scales, target, config, _multiprocessors(a.device))
    fp8_block_grouped_matmul_kernel[grid](**arguments, **constexprs, **options)
    if target is not out:
        out.copy_(target)
    return out
