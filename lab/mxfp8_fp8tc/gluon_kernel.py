"""LAB Gluon kernel (sm_90a): grouped MXFP8 x MXFP8 matmul on Hopper's FP8 tensor cores, exact per-32-K promotion.

For every group g with rows ``a_offsets[g]:a_offsets[g+1]`` and expert ``e = expert_ids[g]``::

    out[rows] = Σ_k32 (A[rows, k32] @ B[e][:, k32]ᵀ) · 2^(ea[row, k32] − 127) · 2^(eb[e, n, k32] − 127)

A ``float8_e4m3fn [T, K]`` with e8m0 exponent bytes a_exps uint8 ``[T, K/32]``, B ``float8_e4m3fn [E, N, K]`` with
b_exps uint8 ``[E, N, K/32]``, a_offsets int32 ``[G + 1]``, expert_ids int32 ``[G]`` (an id outside ``[0, E)``,
e.g. -1, writes zero rows), out bf16 ``[T, N]`` (rows past ``a_offsets[G]`` untouched). K a multiple of 128.

Schedule: the product's FP8-blocks kernel (``llmkernels.grouped_matmul.gluon_fp8_kernel``), whose tile finder and
tile hand-off (``_find_tile``, ``_publish``, ``_receive``) and masked store (``_store_half``) this file imports: a
persistent grid, a 1-warp TMA load partition with a ring of 128-K stages (two A boxes ``[64, 128]``, one per
consumer, and ``NUM_B`` B boxes ``[128, 128]``), two consumer warpgroups split-M (64 rows each) sharing the B
boxes. The new part is the K loop: per stage, per 32-wide sub-block j and per B box, a ``wgmma m64n128k32 e4m3``
of the A slice ``[64, 32]`` and the B slice ``[128, 32]`` (shared-memory ``.slice(32·j, 32, dim=1)`` of the 128B
-swizzled boxes) into a *fresh* fp32 partial, then the promotion ``acc = fma(partial · fa[:, None], fb[None, :],
acc)``: one FMUL + one FFMA per accumulator element per 32 K (SASS: 64 FMUL + 64 FFMA per thread, box and 32 K).

Factors (exact powers of two, no ex2):

* fa (2 rows per thread in the wgmma layout): A's exponent bytes, read per sub-block from global memory (2 one-byte
  loads per thread), turned into fp32 by bit construction (``e << 23``; e = 0 → 2^-127, e = 255 → NaN: two
  selects): ~12 instructions per thread per 32 K for its 64 accumulator elements.
* fb (32 columns per thread): the launcher converts b_exps once into factors ``[E, K/32, N + 256]`` (transposed,
  so a thread's column pairs are adjacent; padded so that no column clamp is needed), bf16 by default (powers of two
  2^-127..2^127 and NaN are exact in bf16): 16 four-byte loads and 32 one-instruction unpacks (shift / mask) per
  thread, box and 32 K, 16 registers per sub-block in flight; ``factors="fp32"``: 16 eight-byte loads, no unpack,
  32 registers. In the product this is a one-time weight conversion (2 or 4 bytes per 32 weights: +6% or +12% of
  the e4m3 bytes). Converting the bytes in the loop instead would cost ~5 instructions per column (shift, two
  compares, two selects), 160 per thread per 32 K, more than the promotion's 128.

Variants (``Mxfp8GluonConfig.variant``):

* ``"v1"``: two B boxes (BLOCK_N 256), one partial, a full wgmma wait after every sub-wgmma (the product's pattern
  x4: 8 QGMMA and 8 waits per stage and consumer); MMA and promotion overlap only across the two consumers.
* ``"v2"``: one B box (BLOCK_N 128), two partials: sub-block j + 1's wgmma is issued before sub-block j is
  promoted (``warpgroup_mma_wait(num_outstanding=1)``), inside a stage (nothing in flight across the loop's back
  edge: the FP8-blocks lab's cross-iteration version made ptxas serialize every wgmma, C7515).

Register pressure (results/compile_gluon_sm90.md, Triton 3.9): both hold 192 accumulator registers (v1: 2 x 64 +
one partial, v2: 64 + two partials) of a consumer's 240 (setmaxnreg; the load warp keeps 24). ptxas issues the next
wgmma into fresh registers before the last promotion's FFMAs are done and hoists the next sub-blocks' factor
loads, which spills. Options: ``tie`` (the next wgmma overwrites the promoted partial's scaled copy), ``late``
(factor loads after the wait), ``volatile`` (``ld.volatile``: not hoisted, but not cached in L1). The defaults
(:data:`VARIANTS`): v2 bf16 ``tie``, whose K loops have 0 (consumer 0) and 3 (consumer 1: one scalar) spill
instructions per stage; v1 bf16 ``late``, still ~380 spill instructions per stage (2.1 KB): v1 does not fit.

Not run on a GPU by its author: ``bench_gpu.py`` is its check; ``compile_gluon_sm90.py`` compiles it without one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from llmkernels.grouped_matmul.gluon_fp8_kernel import _find_tile, _publish, _receive, _store_half

CONSUMER_ROWS = gl.constexpr(64)
K_STEP = gl.constexpr(128)
STOP = gl.constexpr(-2)
# 9 warps round up to 3 warpgroups: the launch's 168 registers a thread, then setmaxnreg moves them to the consumers:
# 2 x 128 x 240 + 128 x 24 = 3 x 128 x 168. 240 rather than the product's 232 (the load warp keeps 24 instead of
# 40): with 232, v2's K loops spill 72 B, with 240 consumer 0's loop spills nothing and consumer 1's one scalar.
MAX_REGS = 168
CONSUMER_REGS = gl.constexpr(240)
LOADER_REGS = gl.constexpr(24)

_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared


@gluon.jit
def _e8m0(e):
    """Exact fp32 2^(e − 127) of int32 exponent bytes (e = 0 → 2^-127, the subnormal 0x00400000; 255 → NaN)."""
    bits = gl.where(e == 0, 0x00400000, gl.where(e == 255, 0x7FC00000, e << 23))
    return bits.to(gl.float32, bitcast=True)


@gluon.jit
def _load_partition(
    a_desc,
    b_desc,
    a_smem,
    b_smem,
    ready,
    empty,
    schedule,
    a_offsets_ptr,
    expert_ids_ptr,
    num_groups,
    num_tokens,
    num_experts,
    N,
    K,
    n_tiles,
    NUM_B: gl.constexpr,
):
    """The load warp: finds this program's tiles, publishes each, TMA-loads its 128-K stages."""
    STAGES: gl.constexpr = a_smem.shape[0] // 2
    STAGE_BYTES: gl.constexpr = 2 * a_desc.block_type.nbytes + NUM_B * b_desc.block_type.nbytes
    k_blocks = gl.cdiv(K, K_STEP)
    tile = gl.program_id(0)
    programs = gl.num_programs(0)
    cursor = (tile * 0, tile * 0, gl.load(a_offsets_ptr).to(gl.int32))
    count = 0
    loaded = 0
    found, group, group_start, group_end, tile_m, tile_n, cursor = _find_tile(
        tile, cursor, a_offsets_ptr, num_groups, num_tokens, n_tiles, 0, num_tokens
    )
    while found:
        first_row = group_start + tile_m * 128
        first_col = tile_n * (128 * NUM_B)
        expert = gl.load(expert_ids_ptr + group)
        expert_ok = (expert >= 0) & (expert < num_experts)
        expert = gl.where(expert_ok, expert, -1)
        _publish(count, (first_row, gl.minimum(group_end - first_row, 128), first_col, expert), schedule)
        if expert_ok:
            b_row = expert * N + first_col
            for kb in range(k_blocks):
                stage = loaded % STAGES
                mbarrier.wait(empty.index(stage), ((loaded // STAGES) & 1) ^ 1)
                mbarrier.expect(ready.index(stage), STAGE_BYTES)
                _tma_load(a_desc, [first_row, kb * K_STEP], ready.index(stage), a_smem.index(2 * stage))
                _tma_load(
                    a_desc, [first_row + CONSUMER_ROWS, kb * K_STEP], ready.index(stage), a_smem.index(2 * stage + 1)
                )
                for h in gl.static_range(NUM_B):
                    _tma_load(
                        b_desc, [b_row + 128 * h, kb * K_STEP], ready.index(stage), b_smem.index(NUM_B * stage + h)
                    )
                loaded += 1
        count += 1
        tile += programs
        found, group, group_start, group_end, tile_m, tile_n, cursor = _find_tile(
            tile, cursor, a_offsets_ptr, num_groups, num_tokens, n_tiles, 0, num_tokens
        )
    _publish(count, (tile * 0, tile * 0, tile * 0, tile * 0 + STOP), schedule)


@gluon.jit
def _sub_mma(a_tile, b_tile, j: gl.constexpr, into):
    """Async wgmma of K columns ``[32·j, 32·j + 32)`` of the stage: A ``[64, 32]`` x B ``[128, 32]``ᵀ, fresh."""
    return warpgroup_mma(
        a_tile.slice(32 * j, 32, dim=1),
        b_tile.slice(32 * j, 32, dim=1).permute((1, 0)),
        into,
        use_acc=False,
        is_async=True,
    )


@gluon.jit
def _promote(acc, partial, fa, fb):
    """``(acc + partial · fa[row] · fb[col], partial · fa[row])`` (FMUL + FFMA; exact scalings by powers of two).
    The second value is what a ``TIE`` loop hands the next wgmma as its (overwritten) accumulator: that wgmma then
    reads registers the FFMAs read, so ptxas cannot issue it into fresh registers before they are done."""
    scaled = partial * gl.expand_dims(fa, 1)
    return gl.fma(scaled, gl.expand_dims(fb, 0), acc), scaled


@gluon.jit
def _row_factors(a_exps_ptr, a_exp_rows, k32):
    """fa ``[64]`` fp32 of sub-block ``k32`` for this consumer's rows (2 one-byte loads per thread)."""
    return _e8m0(gl.load(a_exps_ptr + k32 + a_exp_rows).to(gl.int32))


@gluon.jit
def _col_factors(b_base, k32, stride_bf_k32, HALF: gl.constexpr, VOLATILE: gl.constexpr):
    """fb ``[128]`` fp32 of sub-block ``k32`` for B box ``HALF`` (a thread's 32 columns, pairs adjacent: 16 loads
    of 8 (fp32) or 4 (bf16) bytes). ``VOLATILE``: ``ld.volatile``, which ptxas does not hoist above the wgmma waits
    (hoisted, the next sub-blocks' factors stay live across a promotion: spills), but which bypasses L1."""
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 128, 32]
    )
    cols = HALF * 128 + gl.arange(0, 128, layout=gl.SliceLayout(0, mma_layout))
    return gl.load(b_base + k32 * stride_bf_k32 + cols, volatile=VOLATILE).to(gl.float32)


@gluon.jit
def _k_loop_v1(
    a_smem,
    b_smem,
    ready,
    empty,
    consumed,
    k_blocks,
    a_exps_ptr,
    a_exp_rows,
    b_base,
    stride_bf_k32,
    acc0,
    acc1,
    CONSUMER: gl.constexpr,
    LATE: gl.constexpr,
    VOLATILE: gl.constexpr,
    TIE: gl.constexpr,
):
    """Two B boxes, one partial: per sub-block and box wgmma, full wait, promote (8 waits per stage)."""
    STAGES: gl.constexpr = a_smem.shape[0] // 2
    partial = gl.zeros_like(acc0)
    for kb in range(k_blocks):
        position = consumed + kb
        stage = position % STAGES
        mbarrier.wait(ready.index(stage), (position // STAGES) & 1)
        a_tile = a_smem.index(2 * stage + CONSUMER)
        b_tile0 = b_smem.index(2 * stage)
        b_tile1 = b_smem.index(2 * stage + 1)
        for j in gl.static_range(4):
            k32 = kb * 4 + j
            fa = _row_factors(a_exps_ptr, a_exp_rows, k32)
            partial = _sub_mma(a_tile, b_tile0, j, partial)
            if not LATE:
                fb = _col_factors(b_base, k32, stride_bf_k32, 0, VOLATILE)
            partial = warpgroup_mma_wait(num_outstanding=0, deps=(partial,))
            if LATE:
                fb = _col_factors(b_base, k32, stride_bf_k32, 0, VOLATILE)
            acc0, scaled = _promote(acc0, partial, fa, fb)
            if TIE:
                partial = scaled
            partial = _sub_mma(a_tile, b_tile1, j, partial)
            if not LATE:
                fb = _col_factors(b_base, k32, stride_bf_k32, 1, VOLATILE)
            partial = warpgroup_mma_wait(num_outstanding=0, deps=(partial,))
            if LATE:
                fb = _col_factors(b_base, k32, stride_bf_k32, 1, VOLATILE)
            if j == 3:
                mbarrier.arrive(empty.index(stage))
            acc1, scaled = _promote(acc1, partial, fa, fb)
            if TIE:
                partial = scaled
    return acc0, acc1


@gluon.jit
def _v2_step(
    acc,
    done,
    OUTSTANDING: gl.constexpr,
    a_exps_ptr,
    a_exp_rows,
    b_base,
    k32,
    stride_bf_k32,
    LATE: gl.constexpr,
    VOLATILE: gl.constexpr,
    TIE: gl.constexpr,
):
    """Wait for ``done`` (sub-block k32's partial) leaving ``OUTSTANDING`` wgmma groups in flight, promote it."""
    fa = _row_factors(a_exps_ptr, a_exp_rows, k32)
    if not LATE:
        fb = _col_factors(b_base, k32, stride_bf_k32, 0, VOLATILE)
    done = warpgroup_mma_wait(num_outstanding=OUTSTANDING, deps=(done,))
    if LATE:
        fb = _col_factors(b_base, k32, stride_bf_k32, 0, VOLATILE)
    acc, scaled = _promote(acc, done, fa, fb)
    if TIE:
        done = scaled
    return acc, done


@gluon.jit
def _k_loop_v2(
    a_smem,
    b_smem,
    ready,
    empty,
    consumed,
    k_blocks,
    a_exps_ptr,
    a_exp_rows,
    b_base,
    stride_bf_k32,
    acc,
    CONSUMER: gl.constexpr,
    LATE: gl.constexpr,
    VOLATILE: gl.constexpr,
    TIE: gl.constexpr,
):
    """One B box, two partials: sub-block j + 1's wgmma runs while sub-block j is promoted (``wait_group 1``);
    the stage drains at its end (no wgmma in flight across the loop's back edge)."""
    STAGES: gl.constexpr = a_smem.shape[0] // 2
    p_even = gl.zeros_like(acc)
    p_odd = gl.zeros_like(acc)
    for kb in range(k_blocks):
        position = consumed + kb
        stage = position % STAGES
        k32 = kb * 4
        mbarrier.wait(ready.index(stage), (position // STAGES) & 1)
        a_tile = a_smem.index(2 * stage + CONSUMER)
        b_tile = b_smem.index(stage)
        p_even = _sub_mma(a_tile, b_tile, 0, p_even)
        p_odd = _sub_mma(a_tile, b_tile, 1, p_odd)
        acc, p_even = _v2_step(acc, p_even, 1, a_exps_ptr, a_exp_rows, b_base, k32, stride_bf_k32, LATE, VOLATILE, TIE)
        p_even = _sub_mma(a_tile, b_tile, 2, p_even)
        acc, p_odd = _v2_step(
            acc, p_odd, 1, a_exps_ptr, a_exp_rows, b_base, k32 + 1, stride_bf_k32, LATE, VOLATILE, TIE
        )
        p_odd = _sub_mma(a_tile, b_tile, 3, p_odd)
        acc, p_even = _v2_step(
            acc, p_even, 1, a_exps_ptr, a_exp_rows, b_base, k32 + 2, stride_bf_k32, LATE, VOLATILE, TIE
        )
        fa = _row_factors(a_exps_ptr, a_exp_rows, k32 + 3)
        if not LATE:
            fb = _col_factors(b_base, k32 + 3, stride_bf_k32, 0, VOLATILE)
        p_odd = warpgroup_mma_wait(num_outstanding=0, deps=(p_odd,))
        mbarrier.arrive(empty.index(stage))
        if LATE:
            fb = _col_factors(b_base, k32 + 3, stride_bf_k32, 0, VOLATILE)
        acc, scaled = _promote(acc, p_odd, fa, fb)
        if TIE:
            p_odd = scaled
    return acc


@gluon.jit
def _consumer_partition(
    a_smem,
    b_smem,
    ready,
    empty,
    schedule,
    a_exps_ptr,
    b_factors_ptr,
    out_ptr,
    stride_a_exp_row,
    stride_bf_expert,
    stride_bf_k32,
    stride_out_row,
    num_tokens,
    N,
    K,
    CONSUMER: gl.constexpr,
    NUM_B: gl.constexpr,
    LATE: gl.constexpr,
    VOLATILE: gl.constexpr,
    TIE: gl.constexpr,
):
    """Consumer warpgroup ``CONSUMER``: rows ``[64·CONSUMER, 64·CONSUMER + 64)`` of every tile it is handed."""
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 128, 32]
    )
    row_layout: gl.constexpr = gl.SliceLayout(1, mma_layout)
    zero = gl.zeros([CONSUMER_ROWS, 128], gl.float32, layout=mma_layout)
    k_blocks = gl.cdiv(K, K_STEP)
    count = 0
    consumed = 0
    first_row, rows, first_col, expert = _receive(count, schedule)
    while expert != STOP:
        first_col = (first_col // 128) * 128  # a multiple of 128, which the compiler cannot see through smem
        acc0 = zero
        acc1 = zero
        if expert >= 0:
            # rows past T and columns past N are clamped (their results are never stored)
            a_rows = gl.minimum(
                first_row + CONSUMER * CONSUMER_ROWS + gl.arange(0, CONSUMER_ROWS, layout=row_layout), num_tokens - 1
            )
            # int32 offsets from scalar bases: a [128] tensor of 64-bit pointers would hold 64 registers
            a_exp_rows = a_rows * stride_a_exp_row
            # the factor rows are padded by 256 columns (launcher): no column clamp, 8-byte loads
            b_base = b_factors_ptr + expert.to(gl.int64) * stride_bf_expert + first_col
            if NUM_B == 2:
                acc0, acc1 = _k_loop_v1(
                    a_smem,
                    b_smem,
                    ready,
                    empty,
                    consumed,
                    k_blocks,
                    a_exps_ptr,
                    a_exp_rows,
                    b_base,
                    stride_bf_k32,
                    acc0,
                    acc1,
                    CONSUMER,
                    LATE,
                    VOLATILE,
                    TIE,
                )
            else:
                acc0 = _k_loop_v2(
                    a_smem,
                    b_smem,
                    ready,
                    empty,
                    consumed,
                    k_blocks,
                    a_exps_ptr,
                    a_exp_rows,
                    b_base,
                    stride_bf_k32,
                    acc0,
                    CONSUMER,
                    LATE,
                    VOLATILE,
                    TIE,
                )
            consumed += k_blocks
        valid = expert >= 0
        _store_half(out_ptr, gl.where(valid, acc0, 0.0), first_row, rows, first_col, N, stride_out_row, CONSUMER)
        if NUM_B == 2:
            _store_half(
                out_ptr, gl.where(valid, acc1, 0.0), first_row, rows, first_col + 128, N, stride_out_row, CONSUMER
            )
        count += 1
        first_row, rows, first_col, expert = _receive(count, schedule)


@gluon.jit
def mxfp8_fp8tc_kernel(
    a_desc,
    b_desc,
    a_exps_ptr,
    b_factors_ptr,
    out_ptr,
    a_offsets_ptr,
    expert_ids_ptr,
    stride_a_exp_row,
    stride_bf_expert,
    stride_bf_k32,
    stride_out_row,
    num_tokens,
    num_groups,
    num_experts,
    N,
    K,
    n_tiles,
    STAGES: gl.constexpr,
    NUM_B: gl.constexpr,
    LATE_FACTORS: gl.constexpr,
    VOLATILE_FACTORS: gl.constexpr,
    TIE_PARTIALS: gl.constexpr,
):
    """Persistent warp-specialized grouped MXFP8 matmul (module docstring).

    a_desc: TMA descriptor over A ``[T, K]`` e4m3, block ``[64, 128]``; b_desc over B viewed as ``[E·N, K]`` e4m3,
    block ``[128, 128]``; a_exps_ptr uint8 ``[T, K/32]`` (unit column stride); b_factors_ptr fp32 ``[E, K/32, N]``
    (unit column stride); out_ptr bf16 ``[T, N]`` (unit column stride). NUM_B 2 runs variant v1 (BLOCK_N 256), 1
    runs v2 (BLOCK_N 128). LATE_FACTORS: a sub-block's factor loads after its wgmma wait instead of before;
    VOLATILE_FACTORS: as ``ld.volatile`` (see :func:`_col_factors`); TIE_PARTIALS: see :func:`_promote`. Grid
    ``(min(SMs, tile bound),)``, ``num_warps=4``, ``maxnreg`` = :data:`MAX_REGS`."""
    a_smem = gl.allocate_shared_memory(a_desc.dtype, [2 * STAGES, CONSUMER_ROWS, K_STEP], a_desc.layout)
    b_smem = gl.allocate_shared_memory(b_desc.dtype, [NUM_B * STAGES, 128, K_STEP], b_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    info_smem = gl.allocate_shared_memory(gl.int32, [2, 4], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    info_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    info_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)  # both consumers release a stage
    for i in gl.static_range(2):
        mbarrier.init(info_ready.index(i), count=1)
        mbarrier.init(info_empty.index(i), count=2)
    fence_async_shared()
    schedule = (info_smem, info_ready, info_empty)
    gl.warp_specialize(
        [
            (
                _consumer_partition,
                (
                    a_smem,
                    b_smem,
                    ready,
                    empty,
                    schedule,
                    a_exps_ptr,
                    b_factors_ptr,
                    out_ptr,
                    stride_a_exp_row,
                    stride_bf_expert,
                    stride_bf_k32,
                    stride_out_row,
                    num_tokens,
                    N,
                    K,
                    0,
                    NUM_B,
                    LATE_FACTORS,
                    VOLATILE_FACTORS,
                    TIE_PARTIALS,
                ),
            ),
            (
                _consumer_partition,
                (
                    a_smem,
                    b_smem,
                    ready,
                    empty,
                    schedule,
                    a_exps_ptr,
                    b_factors_ptr,
                    out_ptr,
                    stride_a_exp_row,
                    stride_bf_expert,
                    stride_bf_k32,
                    stride_out_row,
                    num_tokens,
                    N,
                    K,
                    1,
                    NUM_B,
                    LATE_FACTORS,
                    VOLATILE_FACTORS,
                    TIE_PARTIALS,
                ),
            ),
            (
                _load_partition,
                (
                    a_desc,
                    b_desc,
                    a_smem,
                    b_smem,
                    ready,
                    empty,
                    schedule,
                    a_offsets_ptr,
                    expert_ids_ptr,
                    num_groups,
                    num_tokens,
                    num_experts,
                    N,
                    K,
                    n_tiles,
                    NUM_B,
                ),
            ),
        ],
        [4, 1],
        [CONSUMER_REGS, LOADER_REGS],
    )


# ----------------------------------------------------------------------------------------------------- host side


@dataclass(frozen=True)
class Mxfp8GluonConfig:
    """``variant`` "v1" (two B boxes, BLOCK_N 256, one partial) or "v2" (one B box, BLOCK_N 128, two partials);
    ``stages``: the TMA ring's depth (v1: 48 KB a stage, v2: 32 KB)."""

    variant: str = "v1"
    stages: int = 3
    factors: str = "bf16"  # dtype of B's column factors in memory: "bf16" (16 registers per 32 columns) or "fp32"
    late: bool = False  # load a sub-block's factors after its wgmma wait (else before its wgmma is issued)
    volatile: bool = False  # factor loads as ld.volatile (not hoisted by ptxas; bypass L1)
    tie: bool = False  # the next wgmma overwrites the promoted partial's scaled copy (see _promote)

    @property
    def num_b(self) -> int:
        return 2 if self.variant == "v1" else 1

    @property
    def block_n(self) -> int:
        return 128 * self.num_b

    @property
    def label(self) -> str:
        extras = (
            ("" if not self.late else " late")
            + ("" if not self.volatile else " volatile")
            + (" tie" if self.tie else "")
        )
        return f"gluon {self.variant} 128x{self.block_n}x128 s{self.stages} fb-{self.factors}{extras}"

    @property
    def factor_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.factors == "bf16" else torch.float32


VARIANTS = [Mxfp8GluonConfig("v1", 3, "bf16", late=True), Mxfp8GluonConfig("v2", 4, "bf16", tie=True)]
LAST_COMPILED = {}  # config -> the compiled kernel of its last launch (the bench reads registers from it)


def nvmma_layout(block, dtype=gl.float8e4nv):
    return gl.NVMMASharedLayout.get_default_for(block, dtype)


def descriptor_type(block, dtype=gl.float8e4nv) -> str:
    """Triton's type string of a tensor-descriptor argument (ahead-of-time compiles)."""
    return f"tensordesc<fp8e4nv[{', '.join(map(str, block))}],{nvmma_layout(block, dtype)!r}>"


def compile_signature(config: Mxfp8GluonConfig):
    """``(signature, constexprs)`` of the kernel for ``triton.compile`` (no tensors, no GPU)."""
    names = mxfp8_fp8tc_kernel.arg_names
    types = dict(
        a_desc=descriptor_type([64, 128]),
        b_desc=descriptor_type([128, 128]),
        a_exps_ptr="*u8",
        b_factors_ptr="*bf16" if config.factors == "bf16" else "*fp32",
        out_ptr="*bf16",
        a_offsets_ptr="*i32",
        expert_ids_ptr="*i32",
    )
    constexprs = dict(
        STAGES=config.stages,
        NUM_B=config.num_b,
        LATE_FACTORS=config.late,
        VOLATILE_FACTORS=config.volatile,
        TIE_PARTIALS=config.tie,
    )
    signature = {name: ("constexpr" if name in constexprs else types.get(name, "i32")) for name in names}
    return signature, constexprs


def b_exponent_factors(b_exps: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The one-time weight conversion: e8m0 bytes uint8 ``[E, N, K/32]`` → exact ``dtype`` factors ``[E, K/32, N']``
    (2^(e − 127); e = 0 → 2^-127, e = 255 → NaN), K/32-major so a thread's column pairs are adjacent; rows padded
    with ones to ``N' = N + 256`` rounded up to 16 columns (the kernel's tiles read past N unclamped; a row
    stride divisible by 16 lets Triton's specialization prove the factor pairs' alignment: vector loads)."""
    e = b_exps.to(torch.int32)
    bits = torch.where(e == 0, 0x00400000, torch.where(e == 255, 0x7FC00000, e << 23)).to(torch.int32)
    num_experts, n, k32 = b_exps.shape
    padded = torch.ones(num_experts, k32, triton.cdiv(n + 256, 16) * 16, dtype=dtype, device=b_exps.device)
    padded[:, :, :n] = bits.view(torch.float32).transpose(1, 2).to(dtype)  # powers of two: exact in bf16 too
    return padded


def _exps(scales: torch.Tensor) -> torch.Tensor:
    return scales.view(torch.uint8) if scales.dtype != torch.uint8 else scales


def mxfp8_grouped_matmul_gluon(a, a_exps, b, b_exps, a_offsets, expert_ids, out=None, config=None, b_factors=None):
    """The Gluon kernel on an sm_90 GPU. a e4m3 ``[T, K]``, a_exps uint8 (or e8m0) ``[T, K/32]``, b e4m3
    ``[E, N, K]``, b_exps uint8 (or e8m0) ``[E, N, K/32]``, a_offsets int32 ``[G + 1]``, expert_ids int32 ``[G]``;
    out bf16 ``[T, N]`` (rows past ``a_offsets[G]`` left as they are). ``b_factors``: the result of
    :func:`b_exponent_factors` for these weights (a timed call passes it: the conversion is per weight, not per
    call); built here when None. K a multiple of 128. Raises ValueError on any other shape or dtype."""
    config = config or VARIANTS[0]
    if config.variant not in ("v1", "v2") or config.stages < 2 or config.factors not in ("bf16", "fp32"):
        raise ValueError(f"config: unsupported {config}")
    if a.dim() != 2 or b.dim() != 3 or a.dtype != torch.float8_e4m3fn or b.dtype != torch.float8_e4m3fn:
        raise ValueError("a must be e4m3 [T, K] and b e4m3 [E, N, K]")
    (num_tokens, k), (num_experts, n, k_b) = a.shape, b.shape
    if k_b != k or k % 128:
        raise ValueError(f"K: must match and be a multiple of 128, got {k} and {k_b}")
    a_exps, b_exps = _exps(a_exps), _exps(b_exps)
    if tuple(a_exps.shape) != (num_tokens, k // 32) or tuple(b_exps.shape) != (num_experts, n, k // 32):
        raise ValueError("a_exps must be [T, K/32] and b_exps [E, N, K/32]")
    num_groups = expert_ids.numel()
    if a_offsets.numel() != num_groups + 1 or a_offsets.dtype != torch.int32 or expert_ids.dtype != torch.int32:
        raise ValueError("a_offsets must be int32 [G + 1] and expert_ids int32 [G]")
    if out is None:
        out = torch.empty(num_tokens, n, dtype=torch.bfloat16, device=a.device)
    if out.dtype != torch.bfloat16 or tuple(out.shape) != (num_tokens, n):
        raise ValueError("out must be bf16 [T, N]")
    if num_groups == 0 or num_tokens == 0 or n == 0:
        return out
    if b_factors is None:
        b_factors = b_exponent_factors(b_exps, config.factor_dtype)
    if (
        tuple(b_factors.shape[:2]) != (num_experts, k // 32)
        or b_factors.shape[2] < n + 256
        or b_factors.dtype != config.factor_dtype
    ):
        raise ValueError("b_factors: must be b_exponent_factors(b_exps)")
    a_data = a.contiguous()
    b_data = b.contiguous().reshape(num_experts * n, k)
    a_exps = a_exps if a_exps.stride(1) == 1 else a_exps.contiguous()
    if num_tokens * a_exps.stride(0) >= 2**31:
        raise ValueError("a_exps: the kernel's int32 row offsets need T * stride < 2^31")
    target = out if out.stride(1) == 1 else out.contiguous()
    a_desc = TensorDescriptor.from_tensor(a_data, [64, 128], nvmma_layout([64, 128]))
    b_desc = TensorDescriptor.from_tensor(b_data, [128, 128], nvmma_layout([128, 128]))
    n_tiles = triton.cdiv(n, config.block_n)
    bound = (triton.cdiv(num_tokens, 128) + num_groups) * n_tiles
    grid = (max(1, min(bound, torch.cuda.get_device_properties(a.device).multi_processor_count)),)
    LAST_COMPILED[config] = mxfp8_fp8tc_kernel[grid](
        a_desc,
        b_desc,
        a_exps,
        b_factors,
        target,
        a_offsets.contiguous(),
        expert_ids.contiguous(),
        a_exps.stride(0),
        b_factors.stride(0),
        b_factors.stride(1),
        target.stride(0),
        num_tokens,
        num_groups,
        num_experts,
        n,
        k,
        n_tiles,
        STAGES=config.stages,
        NUM_B=config.num_b,
        LATE_FACTORS=config.late,
        VOLATILE_FACTORS=config.volatile,
        TIE_PARTIALS=config.tie,
        num_warps=4,
        maxnreg=MAX_REGS,
    )
    if target is not out:
        out.copy_(target)
    return out
