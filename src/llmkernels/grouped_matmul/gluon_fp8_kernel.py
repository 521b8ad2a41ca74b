"""The warp-specialized grouped matmul for Hopper (sm_90a, Gluon) on FP8 blocks, the kernel the ``fp8_hopper``
backend launches (``backends/fp8_hopper.py``), and on plain bf16 / fp16 operands, which ``bf16_hopper`` launches
(K steps of 64, one 128-byte row; wgmma accumulating straight into the accumulators, no promotion; its figures are
in that backend's docstring).

For every group g with rows ``a_offsets[g]:a_offsets[g+1]`` and expert ``e = expert_ids[g]``::

    out[rows] = epilogue(expert_scales[e] · Σ_kb (A_kb @ B[e]_kbᵀ) · a_scale[row, kb] · b_scale[e, n // 128, kb]
                         + bias[e])

A ``float8_e4m3fn [T, K]`` with fp32 scales ``[T, ceil(K/128)]`` (block (1, 128)), B ``float8_e4m3fn [E, N, K]``
with fp32 scales ``[E, ceil(N/128), ceil(K/128)]`` (block (128, 128)); both scale tensors with any strides. The
fp32 partial of each 128-wide K block (a fresh wgmma accumulator: the tensor core's reduced-precision fp8
accumulation never runs past 128 products) is multiplied by its two scales and added to an fp32 accumulator
(the "promotion"). Expert ids outside ``[0, E)`` (-1) write zero rows; rows past ``a_offsets[G]`` are never
written; offsets are read as ``clamp(cummax(a_offsets), 0, T)``, so hostile metadata cannot move a store
outside ``out`` or write a row twice.

Schedule (DeepGEMM's on Hopper):

* a **persistent grid** of ``min(SMs, tile bound)`` programs; work tiles (group, 128-row m-tile, n-tile) numbered
  group after group, m-tiles fastest (neighbouring programs share a weight tile in L2), never straddling groups;
  program p takes tile p first, then the next tile an atomic counter hands out (in order, as load warps ask): a
  program that shares its SM with another kernel (an NCCL exchange beside the experts) takes fewer tiles
  instead of finishing last (a static p, p + P, ... schedule measured 0.2 ms late per NCCL overlap).
* a **1-warp load partition** finds each tile's group on the device (a forward-only cursor over the offsets,
  32 groups per vector load), publishes ``(first row, rows, first column, expert)`` to the consumers through a
  2-slot shared-memory ring, and issues the TMA loads of the tile's K blocks into a 3-stage ring: per stage two
  A boxes ``[64, 128]`` (one per consumer) and two B boxes ``[128, 128]``, one ``ready`` mbarrier with the byte
  count. Rows past a group's end read the next group's rows (never stored); K past the end reads TMA's zeros.
* **two consumer warpgroups, split-M**: consumer c owns rows ``[64c, 64c + 64)`` of the tile and shares the
  stage's B boxes. Per K block and B box: async ``wgmma m64n128k32 e4m3`` (both operands in shared memory) into
  a fresh partial, wait, promote (one FMA per element). The consumers synchronise only through the ring's
  mbarriers, so they drift out of phase: one promotes while the other's wgmma holds the tensor cores. K block
  k + 1's scales are loaded while block k runs.
* **epilogue** per consumer and 128-column half: expert scale, bias, activation, then through a 128B-swizzled
  shared buffer and an asynchronous TMA store when the consumer's 64 rows all lie in the group (waited for one
  tile later: it drains under the next tile's wgmmas), else masked 16-byte stores.

Tile: 128 rows x 256 weight rows, 3 stages, TMA-store epilogue. Of the variants measured on an H100 (Triton
3.6, CUDA-graph replay; ``lab/fp8_blocks/NOTES.md``) it was the fastest at every shape: 1149 / 1157 / 995
TFLOP/s at E8x2048 N4096 K7168 / E16x4096 N7168 K2048 / E256x256 N7168 K2048, 0.99x / 1.16x / 1.18x
``torch._scaled_grouped_mm`` rowwise fp8 of the same run. 128x128 tiles measured 3-15% slower (the run before),
4 stages with vector stores 1-5% slower, a stream-K tail 0-12% slower.

The two B boxes of a tile are weight rows ``[c, c + 128)`` and ``[c + 128, c + 256)`` (output columns ``[c, c +
256)``), or under SwiGLU the gate rows ``[c, c + 128)`` and the matching up rows ``[N/2 + c, N/2 + c + 128)``
(output columns ``[c, c + 128)``): each box lies in one 128-row weight-scale block, so B's scale is one scalar per
box and K block. What this kernel does not take (its backend declines, the portable ``fp8_blocks`` backend runs
it): interleaved SwiGLU rows, SwiGLU with ``N / 2`` not a multiple of 128, K not a multiple of 16 (TMA's 16-byte
rows), swap-AB (decode) tiles. A user's ``@triton.jit`` epilogue is called as the portable kernels call it.

Compiled for sm_90a without a GPU (``tools/compile_defaults.py --pairs fp8xfp8``: the backend's default launches,
with expert scales) with Triton 3.9 and with Triton 3.6 (the wheel's ptxas each): only ``wgmma.mma_async
m64n128k32 f32.e4m3.e4m3`` (16 QGMMA, 4 full waits: one per B box, K block and consumer, by design), setmaxnreg
232 (consumers) / 40 (load warp); in the plain launch's SASS no spill instruction lies inside a K loop (its stack
holds per-tile values, stored and reloaded outside them):

=========================================  ============  =========  ==================
launch                                     shared bytes  registers  stack bytes 3.9/3.6
=========================================  ============  =========  ==================
plain, bf16 out (TMA-store epilogue)       229512        168        32 / 40
SwiGLU, bf16 out (one output half)         196744        168        32 / 16
plain, fp32 out + bias (pointer stores)    163976        168        (not read)
=========================================  ============  =========  ==================

Not run on a GPU from the library yet: ``lab/fp8_blocks/check_backend_gpu.py`` is its check.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

__all__ = [
    "fp8_hopper_grouped_kernel",
    "BLOCK_M",
    "BLOCK_N",
    "BLOCK_K",
    "A_BOX",
    "B_BOX",
    "OUT_BOX",
    "STAGES",
    "MAX_REGS",
    "out_columns_per_tile",
    "boxes",
]

BLOCK_M = 128  # two consumer warpgroups of 64 rows
BLOCK_N = 256  # weight rows per tile: two 128-row B boxes
BLOCK_K = 128  # one scale block per K step
STAGES = 3
A_BOX = [64, 128]
B_BOX = [128, 128]
OUT_BOX = [64, 128]
# 9 warps round up to 3 warpgroups (384 threads): the launch's maxnreg is 65536 / 384 rounded down to a multiple
# of 8; setmaxnreg then gives each consumer 232 and the load warp's group 40 (2 x 128 x 232 + 128 x 40 <= 65536).
MAX_REGS = 168
_CONSUMER_REGS = gl.constexpr(232)
_LOADER_REGS = gl.constexpr(40)
_CONSUMER_ROWS = gl.constexpr(64)
_STOP = gl.constexpr(-2)  # the "expert" of the end-of-work message

# Triton 3.6 names the TMA copies async_copy_*, later releases async_load / async_store, and the partition's
# barrier gl.thread_barrier / gl.barrier: the kernel compiles with both.
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
_tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
_barrier = getattr(gl, "thread_barrier", None) or gl.barrier


def boxes(element) -> tuple[list[int], list[int]]:
    """The TMA boxes of A and B for operands of Gluon dtype ``element``: one 128-byte row of K per box (128 FP8
    elements, 64 of 16 bits)."""
    k_step = 128 // element.primitive_bitwidth * 8
    return [_CONSUMER_ROWS.value, k_step], [128, k_step]


def out_columns_per_tile(swiglu: bool) -> int:
    """Output columns of one work tile: 256, or 128 under SwiGLU (its two B boxes are gate and up rows)."""
    return BLOCK_N // 2 if swiglu else BLOCK_N


@gluon.jit
def _max_combine(a, b):
    return gl.maximum(a, b)


@gluon.jit
def _add_combine(a, b):
    return a + b


@gluon.jit
def _pick(values, lanes, index):
    """``values[index]`` of a one-warp vector (a masked sum)."""
    return gl.sum(gl.where(lanes == index, values, 0), axis=0)


@gluon.jit
def _find_tile(
    tile,
    cursor,
    a_offsets_ptr,
    num_groups,
    num_tokens,
    n_tiles,
    min_group_rows,
    max_group_rows,
    TILE_ROWS: gl.constexpr = 128,
):
    """Work tile ``tile`` -> ``(found, group, group_start, group_end, m-tile, n-tile, cursor)``, m-tiles of
    ``TILE_ROWS`` rows.

    ``cursor = (first group of a 32-group chunk, tiles before it, running max of the offsets before it)`` only moves
    forward (a program's tiles increase), so a tile costs one vector load of 33 offsets unless its group lies in a
    later chunk. Offsets are read as ``clamp(cummax(a_offsets), 0, T)``. Only groups of ``min_group_rows < rows <=
    max_group_rows`` have tiles (the launch's size class). ``found`` is false past the last tile."""
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    lanes = gl.arange(0, 32, layout=layout)
    chunk, before, carried = cursor
    searching = tile >= 0
    found = tile < 0
    group = tile * 0
    group_start = tile * 0
    group_end = tile * 0
    tile_m = tile * 0
    tile_n = tile * 0
    while searching:
        groups = chunk + lanes
        valid = groups < num_groups
        raw_starts = gl.load(a_offsets_ptr + groups, mask=valid, other=0).to(gl.int32)
        raw_ends = gl.load(a_offsets_ptr + groups + 1, mask=valid, other=0).to(gl.int32)
        starts = gl.maximum(gl.associative_scan(raw_starts, 0, _max_combine), carried)
        ends = gl.maximum(gl.associative_scan(raw_ends, 0, _max_combine), carried)
        starts = gl.minimum(gl.maximum(starts, 0), num_tokens)
        ends = gl.minimum(gl.maximum(ends, 0), num_tokens)
        sizes = ends - starts
        taken = valid & (sizes > min_group_rows) & (sizes <= max_group_rows)
        tiles = gl.where(taken, gl.cdiv(sizes, TILE_ROWS) * n_tiles, 0)
        through = before + gl.associative_scan(tiles, 0, _add_combine)
        chunk_tiles = gl.sum(tiles, axis=0)
        if tile < before + chunk_tiles:
            index = gl.sum((through <= tile).to(gl.int32), axis=0)
            group = chunk + index
            group_start = _pick(starts, lanes, index)
            group_end = _pick(ends, lanes, index)
            # (m-tile, n-tile) per lane, picked after: Triton 3.6's Gluon crashes (GluonInferCoalescedEncodings)
            # on a scalar integer division by a loop-carried scalar here
            local = tile - (through - tiles)
            m_tiles = gl.maximum(gl.cdiv(ends - starts, TILE_ROWS), 1)
            tile_m = _pick(local % m_tiles, lanes, index)
            tile_n = _pick(local // m_tiles, lanes, index)
            found = tile >= 0
            searching = tile < 0
        else:
            if chunk + 32 >= num_groups:
                searching = tile < 0
            else:
                before += chunk_tiles
                carried = gl.maximum(carried, gl.max(gl.where(valid, raw_ends, carried), axis=0))
                chunk += 32
    return found, group, group_start, group_end, tile_m, tile_n, (chunk, before, carried)


@gluon.jit
def _publish(count, info, schedule):
    """The load warp hands its ``count``-th tile ``(first row, rows, first column, expert)`` to the consumers."""
    info_smem, info_ready, info_empty = schedule
    slot = count % 2
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    first_row, rows, first_col, expert = info
    fields = gl.arange(0, 4, layout=layout)
    values = gl.where(fields == 0, first_row, gl.where(fields == 1, rows, gl.where(fields == 2, first_col, expert)))
    mbarrier.wait(info_empty.index(slot), ((count // 2) & 1) ^ 1)
    info_smem.index(slot).store(values)
    mbarrier.arrive(info_ready.index(slot))


@gluon.jit
def _receive(count, schedule):
    """A consumer's ``count``-th tile, as published."""
    info_smem, info_ready, info_empty = schedule
    slot = count % 2
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    mbarrier.wait(info_ready.index(slot), (count // 2) & 1)
    values = info_smem.index(slot).load(layout)
    fields = gl.arange(0, 4, layout=layout)
    first_row = gl.sum(gl.where(fields == 0, values, 0), axis=0)
    rows = gl.sum(gl.where(fields == 1, values, 0), axis=0)
    first_col = gl.sum(gl.where(fields == 2, values, 0), axis=0)
    expert = gl.sum(gl.where(fields == 3, values, 0), axis=0)
    mbarrier.arrive(info_empty.index(slot))
    return first_row, rows, first_col, expert


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
    N_out,
    K,
    n_tiles,
    min_group_rows,
    max_group_rows,
    tile_counter,
    SWIGLU: gl.constexpr,
):
    """The load warp: finds this program's tiles (its program id, then what ``tile_counter`` hands out), publishes
    each, then TMA-loads its K blocks into the ring."""
    STAGES_: gl.constexpr = a_smem.shape[0] // 2
    STAGE_BYTES: gl.constexpr = 2 * a_desc.block_type.nbytes + 2 * b_desc.block_type.nbytes
    K_STEP: gl.constexpr = a_desc.block_type.shape[1]
    OUT_COLS: gl.constexpr = 128 if SWIGLU else 256
    k_blocks = gl.cdiv(K, K_STEP)
    tile = gl.program_id(0)
    programs = gl.num_programs(0)
    cursor = (tile * 0, tile * 0, gl.load(a_offsets_ptr).to(gl.int32))
    count = 0
    loaded = 0
    found, group, group_start, group_end, tile_m, tile_n, cursor = _find_tile(
        tile, cursor, a_offsets_ptr, num_groups, num_tokens, n_tiles, min_group_rows, max_group_rows
    )
    while found:
        first_row = group_start + tile_m * 128
        first_col = tile_n * OUT_COLS
        expert = gl.load(expert_ids_ptr + group)
        expert_ok = (expert >= 0) & (expert < num_experts)
        expert = gl.where(expert_ok, expert, -1)
        _publish(count, (first_row, gl.minimum(group_end - first_row, 128), first_col, expert), schedule)
        if expert_ok:
            b_row0 = expert * N + first_col
            if SWIGLU:
                b_row1 = b_row0 + N_out  # the up rows of these gate rows
            else:
                b_row1 = b_row0 + 128
            for kb in range(k_blocks):
                stage = loaded % STAGES_
                mbarrier.wait(empty.index(stage), ((loaded // STAGES_) & 1) ^ 1)  # fresh barriers: no wait
                mbarrier.expect(ready.index(stage), STAGE_BYTES)
                _tma_load(a_desc, [first_row, kb * K_STEP], ready.index(stage), a_smem.index(2 * stage))
                _tma_load(
                    a_desc, [first_row + _CONSUMER_ROWS, kb * K_STEP], ready.index(stage), a_smem.index(2 * stage + 1)
                )
                _tma_load(b_desc, [b_row0, kb * K_STEP], ready.index(stage), b_smem.index(2 * stage))
                _tma_load(b_desc, [b_row1, kb * K_STEP], ready.index(stage), b_smem.index(2 * stage + 1))
                loaded += 1
        count += 1
        tile = programs + gl.atomic_add(tile_counter, 1)
        found, group, group_start, group_end, tile_m, tile_n, cursor = _find_tile(
            tile, cursor, a_offsets_ptr, num_groups, num_tokens, n_tiles, min_group_rows, max_group_rows
        )
    _publish(count, (tile * 0, tile * 0, tile * 0, tile * 0 + _STOP), schedule)


@gluon.jit
def _promoted_k_loop(
    a_smem,
    b_smem,
    ready,
    empty,
    consumed,
    k_blocks,
    a_scale_ptrs,
    stride_a_scale_k,
    b0_scale_ptr,
    b1_scale_ptr,
    stride_b_scale_k,
    acc0,
    acc1,
    CONSUMER: gl.constexpr,
):
    """Per K block: for each B box, wgmma into a fresh partial, wait, promote; the stage is released after the
    second. K block k + 1's scales are loaded during block k: the L2 latency of the 64-row gather stays off the
    path between a wgmma's wait and its promotion."""
    STAGES_: gl.constexpr = a_smem.shape[0] // 2
    partial = gl.zeros_like(acc0)
    next_a = gl.load(a_scale_ptrs)
    next_b0 = gl.load(b0_scale_ptr)
    next_b1 = gl.load(b1_scale_ptr)
    for kb in range(k_blocks):
        position = consumed + kb
        stage = position % STAGES_
        scale_a = next_a
        scale_b0 = next_b0
        scale_b1 = next_b1
        ahead = gl.minimum(kb + 1, k_blocks - 1)
        next_a = gl.load(a_scale_ptrs + ahead * stride_a_scale_k)
        next_b0 = gl.load(b0_scale_ptr + ahead * stride_b_scale_k)
        next_b1 = gl.load(b1_scale_ptr + ahead * stride_b_scale_k)
        mbarrier.wait(ready.index(stage), (position // STAGES_) & 1)
        a_tile = a_smem.index(2 * stage + CONSUMER)
        # the partial is written over the previous one's registers: no zero tensor stays alive
        partial = warpgroup_mma(a_tile, b_smem.index(2 * stage).permute((1, 0)), partial, use_acc=False, is_async=True)
        partial = warpgroup_mma_wait(num_outstanding=0, deps=(partial,))
        acc0 = gl.fma(partial, gl.expand_dims(scale_a * scale_b0, 1), acc0)
        partial = warpgroup_mma(
            a_tile, b_smem.index(2 * stage + 1).permute((1, 0)), partial, use_acc=False, is_async=True
        )
        partial = warpgroup_mma_wait(num_outstanding=0, deps=(partial,))
        mbarrier.arrive(empty.index(stage))
        acc1 = gl.fma(partial, gl.expand_dims(scale_a * scale_b1, 1), acc1)
    return acc0, acc1


@gluon.jit
def _accumulating_k_loop(a_smem, b_smem, ready, empty, consumed, k_blocks, acc0, acc1, CONSUMER: gl.constexpr):
    """bf16 / fp16 operands: per K step, two async wgmmas (one per B box) straight into the accumulators; a stage
    is released once its wgmmas have retired, one step behind (the current step's two stay in flight)."""
    STAGES_: gl.constexpr = a_smem.shape[0] // 2
    for kb in range(k_blocks):
        position = consumed + kb
        stage = position % STAGES_
        mbarrier.wait(ready.index(stage), (position // STAGES_) & 1)
        a_tile = a_smem.index(2 * stage + CONSUMER)
        acc0 = warpgroup_mma(a_tile, b_smem.index(2 * stage).permute((1, 0)), acc0, is_async=True)
        acc1 = warpgroup_mma(a_tile, b_smem.index(2 * stage + 1).permute((1, 0)), acc1, is_async=True)
        acc0, acc1 = warpgroup_mma_wait(num_outstanding=2, deps=(acc0, acc1))
        if kb > 0:
            mbarrier.arrive(empty.index((position - 1) % STAGES_))
    acc0, acc1 = warpgroup_mma_wait(num_outstanding=0, deps=(acc0, acc1))
    if k_blocks > 0:
        mbarrier.arrive(empty.index((consumed + k_blocks - 1) % STAGES_))
    return acc0, acc1


@gluon.jit
def _bias_row(bias_ptr, expert, stride_bias_expert, cols, limit, HAS_BIAS: gl.constexpr):
    """``bias[expert, cols]`` as fp32 ``[1, 128]`` (columns from ``limit`` on read 0), or 0.0 without a bias."""
    if HAS_BIAS:
        row = bias_ptr + gl.maximum(expert, 0).to(gl.int64) * stride_bias_expert
        return gl.expand_dims(gl.load(row + cols, mask=cols < limit, other=0.0).to(gl.float32), 0)
    else:
        return 0.0


@gluon.jit
def _activation(
    acc,
    up,
    multiplier,
    bias,
    up_bias,
    rows,
    cols,
    EPILOGUE: gl.constexpr,
    EPILOGUE_FN: gl.constexpr,
    GLU_ALPHA: gl.constexpr,
    GLU_LIMIT: gl.constexpr,
    GLU_UP_SHIFT: gl.constexpr,
):
    """The library's epilogue on a fp32 ``[64, 128]`` half: expert scale, bias, then silu, gelu (erf form),
    SwiGLU (``up``: the matching up rows; clamp, shift and slope as :class:`~llmkernels.grouped_matmul.SwiGLU`;
    a NaN stays NaN through the clamp, as torch.clamp keeps it) or the user's ``@triton.jit`` ``EPILOGUE_FN(value,
    row, col)`` with the global token rows ``[64, 1]`` and output columns ``[1, 128]``."""
    acc = acc * multiplier + bias
    if EPILOGUE == "silu":
        acc = acc / (1.0 + gl.exp(-acc))
    elif EPILOGUE == "gelu":
        acc = 0.5 * acc * (1.0 + gl.erf(acc * 0.7071067811865476))
    elif EPILOGUE == "swiglu":
        up = up * multiplier + up_bias
        if GLU_LIMIT is not None:
            acc = gl.where(acc > GLU_LIMIT, GLU_LIMIT, acc)
            up = gl.where(up > GLU_LIMIT, GLU_LIMIT, gl.where(up < -GLU_LIMIT, -GLU_LIMIT, up))
        if GLU_UP_SHIFT != 0.0:
            up = up + GLU_UP_SHIFT
        slope = acc
        if GLU_ALPHA != 1.0:
            slope = acc * GLU_ALPHA
        acc = acc / (1.0 + gl.exp(-slope)) * up
    elif EPILOGUE == "user":
        acc = EPILOGUE_FN(acc, rows, cols)
    return acc


@gluon.jit
def _store_half(out_ptr, values, first_row, rows, col0, N_out, stride_out_row, CONSUMER: gl.constexpr):
    """``values`` (fp32 ``[64, 128]``) into ``out[first_row + 64·CONSUMER + i, col0 + j]`` for the tile's rows
    (``i + 64·CONSUMER < rows``) and ``col0 + j < N_out``: 16-byte stores through a blocked layout."""
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])
    values = gl.convert_layout(values.to(out_ptr.dtype.element_ty), layout)
    local = CONSUMER * _CONSUMER_ROWS + gl.arange(0, _CONSUMER_ROWS, layout=gl.SliceLayout(1, layout))
    cols = col0 + gl.arange(0, 128, layout=gl.SliceLayout(0, layout))
    offsets = gl.expand_dims((first_row + local).to(gl.int64) * stride_out_row, 1) + gl.expand_dims(cols, 0)
    mask = gl.expand_dims(local < rows, 1) & gl.expand_dims(cols < N_out, 0)
    gl.store(out_ptr + offsets, values, mask=mask)


@gluon.jit
def _epilogue_half(
    out_desc,
    c_smem,
    out_ptr,
    values,
    first_row,
    rows,
    col0,
    N_out,
    stride_out_row,
    CONSUMER: gl.constexpr,
    HALF: gl.constexpr,
    TMA_STORE: gl.constexpr,
):
    """Stores one ``[64, 128]`` half of this consumer: when all its 64 rows belong to the group (and
    ``TMA_STORE``), through shared memory and an asynchronous TMA store (columns past N_out clipped by the
    descriptor; the next tile's wgmmas run while it drains), else masked pointer stores."""
    if TMA_STORE:
        if rows >= (CONSUMER + 1) * _CONSUMER_ROWS:
            buffer = c_smem.index(HALF)
            tma.store_wait(0)  # this buffer's previous TMA store has read it (long done: one tile ago)
            _barrier()
            buffer.store(values.to(c_smem.dtype))
            fence_async_shared()
            _barrier()
            _tma_store(out_desc, [first_row + CONSUMER * _CONSUMER_ROWS, col0], buffer)
        else:
            _store_half(out_ptr, values, first_row, rows, col0, N_out, stride_out_row, CONSUMER)
    else:
        _store_half(out_ptr, values, first_row, rows, col0, N_out, stride_out_row, CONSUMER)


@gluon.jit
def _consumer_partition(
    a_smem,
    b_smem,
    ready,
    empty,
    schedule,
    a_scales_ptr,
    b_scales_ptr,
    out_ptr,
    out_desc,
    c_smem,
    expert_scales_ptr,
    bias_ptr,
    stride_a_scale_row,
    stride_a_scale_k,
    stride_b_scale_expert,
    stride_b_scale_row,
    stride_b_scale_k,
    stride_out_row,
    stride_bias_expert,
    num_tokens,
    N,
    N_out,
    K,
    CONSUMER: gl.constexpr,
    HAS_EXPERT_SCALES: gl.constexpr,
    HAS_BIAS: gl.constexpr,
    EPILOGUE: gl.constexpr,
    EPILOGUE_FN: gl.constexpr,
    GLU_ALPHA: gl.constexpr,
    GLU_LIMIT: gl.constexpr,
    GLU_UP_SHIFT: gl.constexpr,
    TMA_STORE: gl.constexpr,
):
    """Consumer warpgroup ``CONSUMER``: rows ``[64·CONSUMER, 64·CONSUMER + 64)`` of every tile it is handed."""
    PROMOTE: gl.constexpr = a_smem.dtype == gl.float8e4nv  # FP8 blocks: a fresh partial per scale block
    K_STEP: gl.constexpr = a_smem.shape[2]
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 128, 32 if PROMOTE else 16]
    )
    row_layout: gl.constexpr = gl.SliceLayout(1, mma_layout)
    col_layout: gl.constexpr = gl.SliceLayout(0, mma_layout)
    SWIGLU: gl.constexpr = EPILOGUE == "swiglu"
    zero = gl.zeros([_CONSUMER_ROWS, 128], gl.float32, layout=mma_layout)
    k_blocks = gl.cdiv(K, K_STEP)
    count = 0
    consumed = 0
    first_row, rows, first_col, expert = _receive(count, schedule)
    while expert != _STOP:
        # published through shared memory, so the compiler knows nothing of it: re-derived as a multiple of 128
        # (it is one) so that the fallback stores are 16 bytes wide instead of 2
        first_col = (first_col // 128) * 128
        if SWIGLU:
            col1 = first_col + N_out  # the up rows
        else:
            col1 = first_col + 128
        acc0 = zero
        acc1 = zero
        if expert >= 0:
            if PROMOTE:
                # the scales of this consumer's rows (clamped: rows past T are not stored) and of the two B boxes
                a_rows = gl.minimum(
                    first_row + CONSUMER * _CONSUMER_ROWS + gl.arange(0, _CONSUMER_ROWS, layout=row_layout),
                    num_tokens - 1,
                )
                a_scale_ptrs = a_scales_ptr + a_rows.to(gl.int64) * stride_a_scale_row
                b_scale_base = b_scales_ptr + expert.to(gl.int64) * stride_b_scale_expert
                b0_scale_ptr = b_scale_base + (first_col // 128) * stride_b_scale_row
                # a second box wholly past N reads the first box's scale row (it is not stored)
                b1_scale_ptr = b_scale_base + (gl.minimum(col1, N - 1) // 128) * stride_b_scale_row
                acc0, acc1 = _promoted_k_loop(
                    a_smem,
                    b_smem,
                    ready,
                    empty,
                    consumed,
                    k_blocks,
                    a_scale_ptrs,
                    stride_a_scale_k,
                    b0_scale_ptr,
                    b1_scale_ptr,
                    stride_b_scale_k,
                    acc0,
                    acc1,
                    CONSUMER,
                )
            else:
                acc0, acc1 = _accumulating_k_loop(
                    a_smem, b_smem, ready, empty, consumed, k_blocks, acc0, acc1, CONSUMER
                )
            consumed += k_blocks
        multiplier = 1.0
        if HAS_EXPERT_SCALES:
            multiplier = gl.load(expert_scales_ptr + gl.maximum(expert, 0))
        cols0 = first_col + gl.arange(0, 128, layout=col_layout)
        bias0 = _bias_row(bias_ptr, expert, stride_bias_expert, cols0, N_out, HAS_BIAS)
        bias1 = _bias_row(bias_ptr, expert, stride_bias_expert, cols0 + (col1 - first_col), N, HAS_BIAS)
        valid = expert >= 0  # other experts write zeros
        rows2d = gl.expand_dims(
            first_row + CONSUMER * _CONSUMER_ROWS + gl.arange(0, _CONSUMER_ROWS, layout=row_layout), 1
        )
        values0 = _activation(
            acc0,
            acc1,
            multiplier,
            bias0,
            bias1,
            rows2d,
            gl.expand_dims(cols0, 0),
            EPILOGUE,
            EPILOGUE_FN,
            GLU_ALPHA,
            GLU_LIMIT,
            GLU_UP_SHIFT,
        )
        values0 = gl.where(valid, values0, 0.0)
        _epilogue_half(
            out_desc,
            c_smem,
            out_ptr,
            values0,
            first_row,
            rows,
            first_col,
            N_out,
            stride_out_row,
            CONSUMER,
            0,
            TMA_STORE,
        )
        if not SWIGLU:
            values1 = _activation(
                acc1,
                acc1,
                multiplier,
                bias1,
                bias1,
                rows2d,
                gl.expand_dims(cols0 + 128, 0),
                EPILOGUE,
                EPILOGUE_FN,
                GLU_ALPHA,
                GLU_LIMIT,
                GLU_UP_SHIFT,
            )
            values1 = gl.where(valid, values1, 0.0)
            _epilogue_half(
                out_desc, c_smem, out_ptr, values1, first_row, rows, col1, N_out, stride_out_row, CONSUMER, 1, TMA_STORE
            )
        count += 1
        first_row, rows, first_col, expert = _receive(count, schedule)
    if TMA_STORE:
        tma.store_wait(0)  # the shared memory must outlive the last TMA store's read


@gluon.jit
def fp8_hopper_grouped_kernel(
    a_ptr,
    a_scales_ptr,
    b_ptr,
    b_scales_ptr,
    out_ptr,
    a_offsets_ptr,
    expert_ids_ptr,
    expert_scales_ptr,
    bias_ptr,
    out_desc,
    tile_counter,
    stride_a_scale_row,
    stride_a_scale_k,
    stride_b_scale_expert,
    stride_b_scale_row,
    stride_b_scale_k,
    stride_out_row,
    stride_bias_expert,
    num_tokens,
    num_groups,
    num_experts,
    N,
    N_out,
    K,
    n_tiles,
    min_group_rows,
    max_group_rows,
    STAGES: gl.constexpr,
    HAS_EXPERT_SCALES: gl.constexpr,
    HAS_BIAS: gl.constexpr,
    EPILOGUE: gl.constexpr,
    EPILOGUE_FN: gl.constexpr,
    GLU_ALPHA: gl.constexpr,
    GLU_LIMIT: gl.constexpr,
    GLU_UP_SHIFT: gl.constexpr,
    TMA_STORE: gl.constexpr,
):
    """Persistent warp-specialized grouped FP8-block matmul (module docstring).

    a_ptr: a TMA descriptor over A ``[T, K]`` e4m3, block :data:`A_BOX`; b_ptr: over B viewed as ``[E·N, K]`` e4m3,
    block :data:`B_BOX` (named after the call's tensors, which the plan hands them by name); a_scales_ptr fp32
    ``[T, ceil(K/128)]`` and b_scales_ptr fp32 ``[E, ceil(N/128), ceil(K/128)]`` with the strides given;
    out_ptr ``[T, N_out]`` bf16/fp16/fp32 (unit column stride) and out_desc a descriptor over it, block
    :data:`OUT_BOX` (read only with ``TMA_STORE``); a_offsets_ptr int32/uint32 ``[G + 1]``; expert_ids_ptr int32
    ``[G]``; expert_scales_ptr fp32 ``[E]`` (``HAS_EXPERT_SCALES``); bias_ptr fp32/bf16/fp16 ``[E, N]`` with unit
    column stride (``HAS_BIAS``). EPILOGUE: ``"none"``, ``"silu"``, ``"gelu"``, ``"swiglu"`` (``[gate | up]``
    halves, N_out = N / 2 a multiple of 128) or ``"user"`` (``EPILOGUE_FN``, a ``@triton.jit`` function).
    n_tiles: output column tiles, ``cdiv(N_out, 256)`` (128 under SwiGLU). tile_counter: int32 ``[1]``, zero at
    launch (:func:`llmkernels.launch.take_tile_counter`). Only groups of ``min_group_rows < rows
    <= max_group_rows`` are computed (the launch's size class). Grid ``(min(SMs, tile bound),)``, ``num_warps=4``
    (consumer 0, the default partition) + consumer 1 (4 warps) + the load warp; ``maxnreg`` = :data:`MAX_REGS`."""
    a_desc = a_ptr
    b_desc = b_ptr
    gl.static_assert(b_desc.block_type.shape[0] == 128)
    OUT_HALVES: gl.constexpr = 1 if EPILOGUE == "swiglu" else 2
    K_STEP: gl.constexpr = a_desc.block_type.shape[1]
    a_smem = gl.allocate_shared_memory(a_desc.dtype, [2 * STAGES, _CONSUMER_ROWS, K_STEP], a_desc.layout)
    b_smem = gl.allocate_shared_memory(b_desc.dtype, [2 * STAGES, 128, K_STEP], b_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    if TMA_STORE:  # one [64, 128] staging buffer per consumer and output half
        c_smem = gl.allocate_shared_memory(out_desc.dtype, [OUT_HALVES, _CONSUMER_ROWS, 128], out_desc.layout)
        c_smem1 = gl.allocate_shared_memory(out_desc.dtype, [OUT_HALVES, _CONSUMER_ROWS, 128], out_desc.layout)
    else:  # unused
        c_smem = gl.allocate_shared_memory(gl.int32, [1, 1], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
        c_smem1 = c_smem
    info_smem = gl.allocate_shared_memory(gl.int32, [2, 4], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    info_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    info_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)  # both consumers release a stage
    for i in gl.static_range(2):
        mbarrier.init(info_ready.index(i), count=1)
        mbarrier.init(info_empty.index(i), count=2)
    fence_async_shared()  # the initialised barriers, before TMA (the async proxy) signals them
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
                    a_scales_ptr,
                    b_scales_ptr,
                    out_ptr,
                    out_desc,
                    c_smem,
                    expert_scales_ptr,
                    bias_ptr,
                    stride_a_scale_row,
                    stride_a_scale_k,
                    stride_b_scale_expert,
                    stride_b_scale_row,
                    stride_b_scale_k,
                    stride_out_row,
                    stride_bias_expert,
                    num_tokens,
                    N,
                    N_out,
                    K,
                    0,
                    HAS_EXPERT_SCALES,
                    HAS_BIAS,
                    EPILOGUE,
                    EPILOGUE_FN,
                    GLU_ALPHA,
                    GLU_LIMIT,
                    GLU_UP_SHIFT,
                    TMA_STORE,
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
                    a_scales_ptr,
                    b_scales_ptr,
                    out_ptr,
                    out_desc,
                    c_smem1,
                    expert_scales_ptr,
                    bias_ptr,
                    stride_a_scale_row,
                    stride_a_scale_k,
                    stride_b_scale_expert,
                    stride_b_scale_row,
                    stride_b_scale_k,
                    stride_out_row,
                    stride_bias_expert,
                    num_tokens,
                    N,
                    N_out,
                    K,
                    1,
                    HAS_EXPERT_SCALES,
                    HAS_BIAS,
                    EPILOGUE,
                    EPILOGUE_FN,
                    GLU_ALPHA,
                    GLU_LIMIT,
                    GLU_UP_SHIFT,
                    TMA_STORE,
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
                    N_out,
                    K,
                    n_tiles,
                    min_group_rows,
                    max_group_rows,
                    tile_counter,
                    EPILOGUE == "swiglu",
                ),
            ),
        ],
        [4, 1],
        [_CONSUMER_REGS, _LOADER_REGS],
    )
