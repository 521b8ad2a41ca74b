"""LAB: gluon_kernel.py with one ``m64n256k16`` wgmma per consumer and K step instead of two ``m64n128k16`` (each
consumer's A tile read from shared memory once per step, half the wgmma instructions), plain epilogues only: the two
``[128, 64]`` B boxes of a stage are TMA-loaded into the two halves of one ``[256, 64]`` shared buffer (the 128-byte
swizzle repeats every 8 rows, so two stacked boxes are one box), and the ``[64, 256]`` accumulator is split into
the epilogue's two ``[64, 128]`` halves at the end of each tile. ncu showed the two-wgmma kernel executing 2x the
instructions of CUTLASS's at 88% tensor-pipe use (lab/gluon_bf16/NOTES.md); prediction: the 3-5% gap to
``_grouped_mm`` at the compute shapes closes.
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
]

BLOCK_M = 128  # two consumer warpgroups of 64 rows
BLOCK_N = 256  # weight rows per tile: two 128-row B boxes
BLOCK_K = 64  # one 128-byte swizzled bf16 row
STAGES = 3  # 3 x 48 KB + one [64, 128] TMA-store staging buffer per consumer (both halves); 4 stages fit only
# with pointer stores (16.5 KB of the 227 KB go to the compiler's scratch)
A_BOX = [64, 64]
B_BOX = [128, 64]
OUT_BOX = [64, 128]
# 9 warps round up to 3 warpgroups (384 threads): the launch's maxnreg is 65536 / 384 rounded down to a multiple
# of 8; setmaxnreg then gives each consumer 232 and the load warp's group 40 (2 x 128 x 232 + 128 x 40 <= 65536).
MAX_REGS = 168
_CONSUMER_REGS = gl.constexpr(232)
_LOADER_REGS = gl.constexpr(40)
_CONSUMER_ROWS = gl.constexpr(64)
_K_STEP = gl.constexpr(BLOCK_K)
_STOP = gl.constexpr(-2)  # the "expert" of the end-of-work message

# Triton 3.6 names the TMA copies async_copy_*, later releases async_load / async_store, and the partition's
# barrier gl.thread_barrier / gl.barrier: the kernel compiles with both.
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
_tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
_barrier = getattr(gl, "thread_barrier", None) or gl.barrier


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
def _find_tile(tile, cursor, a_offsets_ptr, num_groups, num_tokens, n_tiles, min_group_rows, max_group_rows):
    """Work tile ``tile`` -> ``(found, group, group_start, group_end, m-tile, n-tile, cursor)``.

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
        tiles = gl.where(taken, gl.cdiv(sizes, 128) * n_tiles, 0)
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
            m_tiles = gl.maximum(gl.cdiv(ends - starts, 128), 1)
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
    SWIGLU: gl.constexpr,
):
    """The load warp: finds this program's tiles, publishes each, then TMA-loads its K blocks into the ring."""
    STAGES_: gl.constexpr = a_smem.shape[0] // 2
    STAGE_BYTES: gl.constexpr = 2 * a_desc.block_type.nbytes + 2 * b_desc.block_type.nbytes
    OUT_COLS: gl.constexpr = 128 if SWIGLU else 256
    k_blocks = gl.cdiv(K, _K_STEP)
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
                _tma_load(a_desc, [first_row, kb * _K_STEP], ready.index(stage), a_smem.index(2 * stage))
                _tma_load(
                    a_desc, [first_row + _CONSUMER_ROWS, kb * _K_STEP], ready.index(stage), a_smem.index(2 * stage + 1)
                )
                wide = b_smem.index(stage)
                _tma_load(b_desc, [b_row0, kb * _K_STEP], ready.index(stage), wide.slice(0, 128, dim=0))
                _tma_load(b_desc, [b_row1, kb * _K_STEP], ready.index(stage), wide.slice(128, 128, dim=0))
                loaded += 1
        count += 1
        tile += programs
        found, group, group_start, group_end, tile_m, tile_n, cursor = _find_tile(
            tile, cursor, a_offsets_ptr, num_groups, num_tokens, n_tiles, min_group_rows, max_group_rows
        )
    _publish(count, (tile * 0, tile * 0, tile * 0, tile * 0 + _STOP), schedule)


@gluon.jit
def _k_loop(a_smem, b_smem, ready, empty, consumed, k_blocks, acc, CONSUMER: gl.constexpr):
    """Per K step one async m64n256k16 wgmma into the [64, 256] accumulator; the previous step's stage is released
    when its wgmma has retired (the current one stays in flight)."""
    STAGES_: gl.constexpr = a_smem.shape[0] // 2
    for kb in range(k_blocks):
        position = consumed + kb
        stage = position % STAGES_
        mbarrier.wait(ready.index(stage), (position // STAGES_) & 1)
        acc = warpgroup_mma(a_smem.index(2 * stage + CONSUMER), b_smem.index(stage).permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
        if kb > 0:
            mbarrier.arrive(empty.index((position - 1) % STAGES_))
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    if k_blocks > 0:
        mbarrier.arrive(empty.index((consumed + k_blocks - 1) % STAGES_))
    return acc


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
            buffer = c_smem.index(0)  # both halves: the store_wait below orders them
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
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 128, 16]
    )
    row_layout: gl.constexpr = gl.SliceLayout(1, mma_layout)
    col_layout: gl.constexpr = gl.SliceLayout(0, mma_layout)
    SWIGLU: gl.constexpr = EPILOGUE == "swiglu"
    zero = gl.zeros([_CONSUMER_ROWS, 128], gl.float32, layout=mma_layout)
    wide_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 256, 16]
    )
    wide_zero = gl.zeros([_CONSUMER_ROWS, 256], gl.float32, layout=wide_layout)
    k_blocks = gl.cdiv(K, _K_STEP)
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
            acc = _k_loop(a_smem, b_smem, ready, empty, consumed, k_blocks, wide_zero, CONSUMER)
            halves = gl.permute(gl.reshape(acc, [_CONSUMER_ROWS, 2, 128]), (0, 2, 1))
            acc0, acc1 = gl.split(halves)
            acc0 = gl.convert_layout(acc0, mma_layout)
            acc1 = gl.convert_layout(acc1, mma_layout)
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
    n_tiles: output column tiles, ``cdiv(N_out, 256)`` (128 under SwiGLU). Only groups of ``min_group_rows < rows
    <= max_group_rows`` are computed (the launch's size class). Grid ``(min(SMs, tile bound),)``, ``num_warps=4``
    (consumer 0, the default partition) + consumer 1 (4 warps) + the load warp; ``maxnreg`` = :data:`MAX_REGS`."""
    a_desc = a_ptr
    b_desc = b_ptr
    gl.static_assert(b_desc.block_type.shape[0] == 128)
    OUT_HALVES: gl.constexpr = 1
    a_smem = gl.allocate_shared_memory(a_desc.dtype, [2 * STAGES, _CONSUMER_ROWS, _K_STEP], a_desc.layout)
    b_smem = gl.allocate_shared_memory(b_desc.dtype, [STAGES, 256, _K_STEP], b_desc.layout)
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
                    EPILOGUE == "swiglu",
                ),
            ),
        ],
        [4, 1],
        [_CONSUMER_REGS, _LOADER_REGS],
    )


def bf16_grouped_matmul_gluon(a, b, a_offsets, expert_ids, out=None, stages=STAGES, tma_store=True):
    """Lab launcher: a bf16 ``[T, K]``, b bf16 ``[E, N, K]`` (contiguous), a_offsets int32 ``[G + 1]``, expert_ids
    int32 ``[G]``; out bf16 ``[T, N]`` (rows past ``a_offsets[G]`` untouched, -1 experts zeros). K, N multiples of 8."""
    import torch
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    num_tokens, k = a.shape
    num_experts, n, _ = b.shape
    if out is None:
        out = torch.empty(num_tokens, n, dtype=torch.bfloat16, device=a.device)
    layout = gl.NVMMASharedLayout.get_default_for
    a_desc = TensorDescriptor(a, [num_tokens, k], [a.stride(0), 1], A_BOX, layout(A_BOX, gl.bfloat16))
    b_desc = TensorDescriptor(
        b.view(num_experts * n, k), [num_experts * n, k], [k, 1], B_BOX, layout(B_BOX, gl.bfloat16)
    )
    out_desc = TensorDescriptor(out, [num_tokens, n], [out.stride(0), 1], OUT_BOX, layout(OUT_BOX, gl.bfloat16))
    dummy = torch.zeros(1, dtype=torch.float32, device=a.device)
    num_groups = expert_ids.numel()
    n_tiles = -(-n // BLOCK_N)
    bound = (-(-num_tokens // BLOCK_M) + num_groups) * n_tiles
    sms = torch.cuda.get_device_properties(a.device).multi_processor_count
    fp8_hopper_grouped_kernel[(max(1, min(bound, sms)),)](
        a_desc,
        dummy,
        b_desc,
        dummy,
        out,
        a_offsets,
        expert_ids,
        dummy,
        dummy,
        out_desc,
        0,
        0,
        0,
        0,
        0,
        out.stride(0),
        0,
        num_tokens,
        num_groups,
        num_experts,
        n,
        n,
        k,
        n_tiles,
        0,
        num_tokens,
        STAGES=stages,
        HAS_EXPERT_SCALES=False,
        HAS_BIAS=False,
        EPILOGUE="none",
        EPILOGUE_FN=None,
        GLU_ALPHA=1.0,
        GLU_LIMIT=None,
        GLU_UP_SHIFT=0.0,
        TMA_STORE=tma_store,
        num_warps=4,
        maxnreg=MAX_REGS,
    )
    return out
