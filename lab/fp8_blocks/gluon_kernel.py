"""Warp-specialized Gluon kernel (sm_90a) for the grouped 1D-1D matmul on DeepSeek-style FP8 blocks (issue 44).

Same math and arguments as ``kernel.py``'s Triton prototype::

    out[rows of g] = expert_scales[e] · Σ_kb (A_kb @ B[e]_kbᵀ) · a_scale[row, kb] · b_scale[e, n // 128, kb]

with A ``float8_e4m3fn [T, K]`` (fp32 scales ``[T, ceil(K/128)]``), B ``float8_e4m3fn [E, N, K]`` (fp32 scales
``[E, ceil(N/128), ceil(K/128)]``), a_offsets int32 ``[G + 1]`` and expert_ids int32 ``[G]`` on the device (no host
sync), out bf16 ``[T, N]``; expert id outside ``[0, E)`` (-1) writes zeros, rows past ``a_offsets[G]`` are never
written.

Why Gluon: in Triton-language the promotion ``acc += partial · a_scale · b_scale`` of each 128-wide K block waits
for the MMA inside a warp group, and Triton's per-stage CTA barrier keeps the two warp groups of a 128-row tile in
lock-step, so both promote at the same time and the tensor cores idle (794-848 TFLOP/s on the H100,
results/fp8_blocks_h100.md). Here (DeepGEMM's schedule on Hopper):

* **persistent grid**, one program per SM; work tiles (group, m-tile of 128 rows, n-tile of BLOCK_N) numbered
  group after group, m-tiles fastest, never straddling two groups; program p takes tiles p, p + P, ...
* **a 1-warp load partition** finds each tile's group on the device (a cursor over the offsets, 32 groups per
  vector load, clamped like the prototype: running maximum, ``[0, T]``), publishes (first row, rows, first column,
  expert) to the consumers through a 2-slot shared-memory ring, and issues the TMA loads of the tile's K blocks
  into a ``STAGES``-deep ring: per stage two A boxes ``[64, 128]`` (one per consumer) and one B box
  ``[BLOCK_N, 128]``, all e4m3, one ``ready`` mbarrier with the byte count; a stage is refilled once both
  consumers released it. Rows past the group's end read the next group's rows (or TMA's zeros past T), weight
  rows past N the next expert's rows (or zeros): never stored. K past the end: TMA's zeros (an e4m3 NaN code
  cannot appear there).
* **two consumer warpgroups, split-M**: consumer c owns rows ``[64c, 64c + 64)`` of the 128-row tile and shares
  the stage's B box with the other one. Per K block: ``wgmma`` (async, both operands from shared memory,
  ``m64n128k32 e4m3``) into a fresh fp32 partial, wait, release the stage, promote ``acc = fma(partial,
  a_scale[row] · b_scale, acc)``. The two consumers synchronise only through the ring's mbarriers (no CTA
  barrier), so they drift out of phase: one promotes while the other's wgmma holds the tensor cores.
  ``PIPELINE_MMA`` (BLOCK_N = 128 only): each consumer also issues K block k + 1's wgmma *before* promoting block
  k (``warpgroup_mma_wait(num_outstanding=1)``), so even one consumer keeps the tensor cores busy (2 partials +
  the accumulator: 192 fp32 registers of the 232 a consumer gets).
  BLOCK_N = 256: two 128-column halves (each in one 128-row weight-scale block: one scalar b_scale per half and
  K block), acc 2 x 64 registers, one partial at a time (the second half's wgmma after the first's promotion).
* The A scales (two rows per thread in the wgmma layout) and the B scalar of K block k + 1 are loaded from global
  memory while block k runs (any strides, L2-resident: 0.2% of the bytes).
* **epilogue** per consumer (``GluonFp8Config.epilogue``): ``acc · expert_scale`` to bf16, then "tma": through a
  128B-swizzled shared buffer and an asynchronous TMA store when the consumer's 64 rows all lie in the group
  (waited for one tile later, so it drains under the next tile's wgmmas), else masked 16-byte stores ("vec");
  "scalar" is the first H100 run's epilogue, whose column the compiler could not prove aligned (2-byte stores,
  ~7 µs per tile: NOTES.md, second round). -1 experts: no loads, zeros stored.

Split-M rather than ping-pong (each consumer on its own tiles, CUTLASS's "pingpong"): a consumer holding a whole
tile would need 128 accumulator registers per thread for 128 x 128 (plus 64-128 for the partial: > 232), so
ping-pong tiles would be 64 x 128: the same B box then feeds 64 rows instead of 128, 1.5x the shared-memory and
L2 bytes per FLOP (24 KB per 2.1 MFLOP instead of 32 KB per 4.2), and the prototype measured 64-row tiles 13%
slower. Split-M keeps the 128-row reuse and gets its overlap from the drift (and PIPELINE_MMA).
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

SCALE_BLOCK = 128  # the format's block side, in K and (weights) in N
BLOCK_M = gl.constexpr(128)  # two consumer warpgroups of 64 rows
CONSUMER_ROWS = gl.constexpr(64)
BLOCK_K = gl.constexpr(128)
STOP = gl.constexpr(-2)  # published "expert" of the end-of-work message
# Registers per thread: 9 warps round up to 3 warpgroups (384 threads); the launch's maxnreg is 65536 / 384
# rounded down to a multiple of 8, setmaxnreg then gives each consumer 232 and the load warp's group 40
# (2 x 128 x 232 + 128 x 40 = 64512 <= 65536).
MAX_REGS = 168
CONSUMER_REGS = gl.constexpr(232)
LOADER_REGS = gl.constexpr(40)

# Triton 3.6 names the TMA copies async_copy_*; 3.9 (this CPU machine's) async_load / async_store.
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
_tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
_barrier = getattr(gl, "thread_barrier", None) or gl.barrier  # the partition's warps (3.6 / 3.9 names)
EPILOGUES = {"scalar": 0, "vec": 1, "tma": 2}  # GluonFp8Config.epilogue -> the kernel's EPILOGUE constexpr


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
def _find_tile(tile, cursor, a_offsets_ptr, num_groups, num_tokens, n_tiles, BLOCK_M: gl.constexpr,
               BAND: gl.constexpr = 0):
    """Work tile ``tile`` -> ``(found, group, group_start, group_end, m-tile, n-tile, cursor)``.

    ``cursor = (first group of a 32-group chunk, tiles before it, running max of the offsets before it)`` only moves
    forward (a program's tiles increase), so a tile costs one vector load of 33 offsets unless its group lies in a
    later chunk. Offsets are read as ``clamp(cummax(a_offsets), 0, T)``: every row belongs to at most one group and
    every store lands inside out, whatever the metadata (the prototype's rule). ``found`` is false past the last
    tile. Inside a group the (m, n) order is m-tile fastest (``BAND = 0``: consecutive tiles share the B tile), or
    ``BAND`` m-tiles at a time with the n-tile fastest inside a band (Triton's GROUP_M swizzle)."""
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
        raw_starts = gl.load(a_offsets_ptr + groups, mask=valid, other=0)
        raw_ends = gl.load(a_offsets_ptr + groups + 1, mask=valid, other=0)
        starts = gl.maximum(gl.associative_scan(raw_starts, 0, _max_combine), carried)
        ends = gl.maximum(gl.associative_scan(raw_ends, 0, _max_combine), carried)
        starts = gl.minimum(gl.maximum(starts, 0), num_tokens)
        ends = gl.minimum(gl.maximum(ends, 0), num_tokens)
        tiles = gl.where(valid, gl.cdiv(ends - starts, BLOCK_M) * n_tiles, 0)
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
            m_tiles = gl.maximum(gl.cdiv(ends - starts, BLOCK_M), 1)
            if BAND == 0:
                tile_m = _pick(local % m_tiles, lanes, index)
                tile_n = _pick(local // m_tiles, lanes, index)
            else:
                band = local // (BAND * n_tiles)
                band_rows = gl.maximum(gl.minimum(m_tiles - band * BAND, BAND), 1)
                in_band = local - band * (BAND * n_tiles)
                tile_m = _pick(band * BAND + in_band % band_rows, lanes, index)
                tile_n = _pick(in_band // band_rows, lanes, index)
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
def _publish7(count, info, schedule):
    """Stream-K: ``(first row, rows, first column, expert, first K block, end K block, tail slot)``."""
    info_smem, info_ready, info_empty = schedule
    slot = count % 2
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    first_row, rows, first_col, expert, kb0, kb1, tail = info
    f = gl.arange(0, 8, layout=layout)
    values = gl.where(f == 0, first_row, gl.where(f == 1, rows, gl.where(f == 2, first_col, gl.where(
        f == 3, expert, gl.where(f == 4, kb0, gl.where(f == 5, kb1, tail))))))
    mbarrier.wait(info_empty.index(slot), ((count // 2) & 1) ^ 1)
    info_smem.index(slot).store(values)
    mbarrier.arrive(info_ready.index(slot))


@gluon.jit
def _receive7(count, schedule):
    info_smem, info_ready, info_empty = schedule
    slot = count % 2
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    mbarrier.wait(info_ready.index(slot), (count // 2) & 1)
    values = info_smem.index(slot).load(layout)
    f = gl.arange(0, 8, layout=layout)
    first_row = gl.sum(gl.where(f == 0, values, 0), axis=0)
    rows = gl.sum(gl.where(f == 1, values, 0), axis=0)
    first_col = gl.sum(gl.where(f == 2, values, 0), axis=0)
    expert = gl.sum(gl.where(f == 3, values, 0), axis=0)
    kb0 = gl.sum(gl.where(f == 4, values, 0), axis=0)
    kb1 = gl.sum(gl.where(f == 5, values, 0), axis=0)
    tail = gl.sum(gl.where(f == 6, values, 0), axis=0)
    mbarrier.arrive(info_empty.index(slot))
    return first_row, rows, first_col, expert, kb0, kb1, tail


@gluon.jit
def _count_tiles(a_offsets_ptr, num_groups, num_tokens, n_tiles, BLOCK_M: gl.constexpr):
    """All work tiles of the launch (the same clamped offsets as :func:`_find_tile`)."""
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    lanes = gl.arange(0, 32, layout=layout)
    carried = gl.load(a_offsets_ptr)
    chunk = num_groups * 0
    total = num_groups * 0
    while chunk < num_groups:
        groups = chunk + lanes
        valid = groups < num_groups
        raw_starts = gl.load(a_offsets_ptr + groups, mask=valid, other=0)
        raw_ends = gl.load(a_offsets_ptr + groups + 1, mask=valid, other=0)
        starts = gl.maximum(gl.associative_scan(raw_starts, 0, _max_combine), carried)
        ends = gl.maximum(gl.associative_scan(raw_ends, 0, _max_combine), carried)
        starts = gl.minimum(gl.maximum(starts, 0), num_tokens)
        ends = gl.minimum(gl.maximum(ends, 0), num_tokens)
        total += gl.sum(gl.where(valid, gl.cdiv(ends - starts, BLOCK_M) * n_tiles, 0), axis=0)
        carried = gl.maximum(carried, gl.max(gl.where(valid, raw_ends, carried), axis=0))
        chunk += 32
    return total


@gluon.jit
def _load_blocks(a_desc, b_desc, a_smem, b_smem, ready, empty, loaded, first_row, b_row, kb0, kb1):
    """TMA loads of K blocks ``[kb0, kb1)`` of one tile into the ring; returns the ring position after them."""
    STAGES: gl.constexpr = b_smem.shape[0]
    STAGE_BYTES: gl.constexpr = 2 * a_desc.block_type.nbytes + b_desc.block_type.nbytes
    for kb in range(kb0, kb1):
        stage = loaded % STAGES
        mbarrier.wait(empty.index(stage), ((loaded // STAGES) & 1) ^ 1)  # fresh barriers: no wait
        mbarrier.expect(ready.index(stage), STAGE_BYTES)
        _tma_load(a_desc, [first_row, kb * BLOCK_K], ready.index(stage), a_smem.index(2 * stage))
        _tma_load(a_desc, [first_row + CONSUMER_ROWS, kb * BLOCK_K], ready.index(stage), a_smem.index(2 * stage + 1))
        _tma_load(b_desc, [b_row, kb * BLOCK_K], ready.index(stage), b_smem.index(stage))
        loaded += 1
    return loaded


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
def _load_partition(a_desc, b_desc, a_smem, b_smem, ready, empty, schedule, a_offsets_ptr, expert_ids_ptr,
                    num_groups, num_tokens, num_experts, N, K, n_tiles, BAND: gl.constexpr,
                    STREAM_K: gl.constexpr = False):
    """The load warp: finds this program's tiles, publishes each, then TMA-loads its K blocks into the ring.

    ``STREAM_K``: the tiles of the last partial wave (``total % programs`` of them, the "tail") are not given
    whole to one program each: their ``tail · k_blocks`` K blocks are cut into ``programs`` equal contiguous
    ranges (tail tile major), so every program gets ``≈ tail · k_blocks / programs`` K blocks (at most two pieces
    of two tiles); the consumers reduce the pieces in an fp32 workspace (:func:`_stream_k_fixup`)."""
    STAGES: gl.constexpr = b_smem.shape[0]
    BLOCK_N: gl.constexpr = b_smem.shape[1]
    STAGE_BYTES: gl.constexpr = 2 * a_desc.block_type.nbytes + b_desc.block_type.nbytes
    k_blocks = gl.cdiv(K, BLOCK_K)
    tile = gl.program_id(0)
    programs = gl.num_programs(0)
    if STREAM_K:
        total = _count_tiles(a_offsets_ptr, num_groups, num_tokens, n_tiles, BLOCK_M)
        tail = total % programs
        dp_end = total - tail  # tiles [0, dp_end): whole, data-parallel; [dp_end, total): stream-K
    cursor = (tile * 0, tile * 0, gl.load(a_offsets_ptr))
    count = 0
    loaded = 0
    found, group, group_start, group_end, tile_m, tile_n, cursor = _find_tile(
        tile, cursor, a_offsets_ptr, num_groups, num_tokens, n_tiles, BLOCK_M, BAND)
    if STREAM_K:
        found = found & (tile < dp_end)
    while found:
        first_row = group_start + tile_m * BLOCK_M
        first_col = tile_n * BLOCK_N
        expert = gl.load(expert_ids_ptr + group)
        expert_ok = (expert >= 0) & (expert < num_experts)
        expert = gl.where(expert_ok, expert, -1)
        if STREAM_K:
            _publish7(count, (first_row, gl.minimum(group_end - first_row, BLOCK_M), first_col, expert, tile * 0,
                              k_blocks, tile * 0 - 1), schedule)
        else:
            _publish(count, (first_row, gl.minimum(group_end - first_row, BLOCK_M), first_col, expert), schedule)
        if expert_ok:
            b_row = expert * N + first_col
            for kb in range(k_blocks):
                stage = loaded % STAGES
                mbarrier.wait(empty.index(stage), ((loaded // STAGES) & 1) ^ 1)  # fresh barriers: no wait
                mbarrier.expect(ready.index(stage), STAGE_BYTES)
                _tma_load(a_desc, [first_row, kb * BLOCK_K], ready.index(stage), a_smem.index(2 * stage))
                _tma_load(a_desc, [first_row + CONSUMER_ROWS, kb * BLOCK_K], ready.index(stage),
                          a_smem.index(2 * stage + 1))
                _tma_load(b_desc, [b_row, kb * BLOCK_K], ready.index(stage), b_smem.index(stage))
                loaded += 1
        count += 1
        tile += programs
        found, group, group_start, group_end, tile_m, tile_n, cursor = _find_tile(
            tile, cursor, a_offsets_ptr, num_groups, num_tokens, n_tiles, BLOCK_M, BAND)
        if STREAM_K:
            found = found & (tile < dp_end)
    if STREAM_K:
        # this program's K-block range of the tail (tail tile major); the cursor restarts (tail tiles can lie
        # before the data-parallel tile that ended the loop above)
        cursor = (tile * 0, tile * 0, gl.load(a_offsets_ptr))
        work = tail * k_blocks
        pid = gl.program_id(0)
        begin = (pid * work) // programs
        end = ((pid + 1) * work) // programs
        while begin < end:
            t = begin // k_blocks
            kb0 = begin - t * k_blocks
            kb1 = gl.minimum(end - t * k_blocks, k_blocks)
            found, group, group_start, group_end, tile_m, tile_n, cursor = _find_tile(
                dp_end + t, cursor, a_offsets_ptr, num_groups, num_tokens, n_tiles, BLOCK_M, BAND)
            first_row = group_start + tile_m * BLOCK_M
            first_col = tile_n * BLOCK_N
            expert = gl.load(expert_ids_ptr + group)
            expert_ok = (expert >= 0) & (expert < num_experts)
            expert = gl.where(expert_ok, expert, -1)
            _publish7(count, (first_row, gl.minimum(group_end - first_row, BLOCK_M), first_col, expert, kb0, kb1, t),
                      schedule)
            if expert_ok:
                loaded = _load_blocks(a_desc, b_desc, a_smem, b_smem, ready, empty, loaded, first_row,
                                      expert * N + first_col, kb0, kb1)
            count += 1
            begin = (t + 1) * k_blocks
        _publish7(count, (tile * 0, tile * 0, tile * 0, tile * 0 + STOP, tile * 0, tile * 0, tile * 0), schedule)
    else:
        _publish(count, (tile * 0, tile * 0, tile * 0, tile * 0 + STOP), schedule)


@gluon.jit
def _store_half(out_ptr, acc, multiplier, first_row, rows, col0, N, stride_out_row, CONSUMER: gl.constexpr):
    """``acc · multiplier`` (``[64, 128]`` fp32) as bf16 into ``out[first_row + 64·CONSUMER + i, col0 + j]`` for the
    tile's rows (``i + 64·CONSUMER < rows``) and ``col0 + j < N``: 16-byte stores through a blocked layout."""
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])
    values = gl.convert_layout((acc * multiplier).to(out_ptr.dtype.element_ty), layout)
    local = CONSUMER * CONSUMER_ROWS + gl.arange(0, CONSUMER_ROWS, layout=gl.SliceLayout(1, layout))
    cols = col0 + gl.arange(0, 128, layout=gl.SliceLayout(0, layout))
    offsets = gl.expand_dims((first_row + local).to(gl.int64) * stride_out_row, 1) + gl.expand_dims(cols, 0)
    mask = gl.expand_dims(local < rows, 1) & gl.expand_dims(cols < N, 0)
    gl.store(out_ptr + offsets, values, mask=mask)


@gluon.jit
def _mma(a_smem, b_smem, stage, into, CONSUMER: gl.constexpr, HALF: gl.constexpr):
    """Async ``wgmma`` of this consumer's A box of ``stage`` and 128 B rows (half ``HALF``) into a fresh partial,
    written over ``into``'s registers (a dead partial: no zero tensor stays alive, no register copy)."""
    b_tile = b_smem.index(stage)
    if b_tile.shape[0] != 128:
        b_tile = b_tile.slice(HALF * 128, 128, dim=0)
    return warpgroup_mma(a_smem.index(2 * stage + CONSUMER), b_tile.permute((1, 0)), into, use_acc=False,
                         is_async=True)


@gluon.jit
def _promote(acc, partial, a_scale_ptrs, b_scale_ptr, kb, stride_a_scale_k, stride_b_scale_k):
    """``acc + partial · a_scale[row, kb] · b_scale[kb]`` (one FFMA per element; the scale loads are issued
    before the wait on the partial by the callers' order, and hit L2)."""
    scale = gl.load(a_scale_ptrs + kb * stride_a_scale_k) * gl.load(b_scale_ptr + kb * stride_b_scale_k)
    return gl.fma(partial, gl.expand_dims(scale, 1), acc)


@gluon.jit
def _k_loop(a_smem, b_smem, ready, empty, consumed, kb_begin, kb_end, a_scale_ptrs, stride_a_scale_k, b0_scale_ptr,
            b1_scale_ptr, stride_b_scale_k, acc0, acc1, CONSUMER: gl.constexpr, SCALE_PREFETCH: gl.constexpr):
    """Per K block: wgmma, wait, (release,) promote; a 256-wide tile's two halves one after the other.

    ``SCALE_PREFETCH``: K block k + 1's scales are loaded during block k (one loop iteration, ~0.5 µs, ahead of
    their use) instead of at the top of block k, where the L2 latency of the 64-row gather (~0.3-0.6 µs under
    load) sits between the wgmma's wait and the promotion on every block."""
    STAGES: gl.constexpr = b_smem.shape[0]
    HALVES: gl.constexpr = b_smem.shape[1] // 128
    partial = gl.zeros_like(acc0)
    next_a = gl.load(a_scale_ptrs + kb_begin * stride_a_scale_k)
    next_b0 = gl.load(b0_scale_ptr + kb_begin * stride_b_scale_k)
    next_b1 = next_b0
    if HALVES == 2:
        next_b1 = gl.load(b1_scale_ptr + kb_begin * stride_b_scale_k)
    for kb in range(kb_begin, kb_end):
        position = consumed + (kb - kb_begin)
        stage = position % STAGES
        if SCALE_PREFETCH:
            scale_a = next_a
            scale_b0 = next_b0
            scale_b1 = next_b1
            ahead = gl.minimum(kb + 1, kb_end - 1)
            next_a = gl.load(a_scale_ptrs + ahead * stride_a_scale_k)
            next_b0 = gl.load(b0_scale_ptr + ahead * stride_b_scale_k)
            if HALVES == 2:
                next_b1 = gl.load(b1_scale_ptr + ahead * stride_b_scale_k)
        else:
            scale_a = gl.load(a_scale_ptrs + kb * stride_a_scale_k)
            scale_b0 = gl.load(b0_scale_ptr + kb * stride_b_scale_k)
            scale_b1 = scale_b0
            if HALVES == 2:
                scale_b1 = gl.load(b1_scale_ptr + kb * stride_b_scale_k)
        mbarrier.wait(ready.index(stage), (position // STAGES) & 1)
        partial = _mma(a_smem, b_smem, stage, partial, CONSUMER, 0)
        if HALVES == 2:
            partial = warpgroup_mma_wait(num_outstanding=0, deps=(partial, ))
            acc0 = gl.fma(partial, gl.expand_dims(scale_a * scale_b0, 1), acc0)
            partial = _mma(a_smem, b_smem, stage, partial, CONSUMER, 1)
            partial = warpgroup_mma_wait(num_outstanding=0, deps=(partial, ))
            mbarrier.arrive(empty.index(stage))
            acc1 = gl.fma(partial, gl.expand_dims(scale_a * scale_b1, 1), acc1)
        else:
            partial = warpgroup_mma_wait(num_outstanding=0, deps=(partial, ))
            mbarrier.arrive(empty.index(stage))
            acc0 = gl.fma(partial, gl.expand_dims(scale_a * scale_b0, 1), acc0)
    return acc0, acc1


@gluon.jit
def _pipelined_step(a_smem, b_smem, ready, empty, consumed, kb, done, in_flight, acc, a_scale_ptrs,
                    stride_a_scale_k, b0_scale_ptr, stride_b_scale_k, CONSUMER: gl.constexpr):
    """Issue K block ``kb``'s wgmma (into the registers of ``in_flight``, a consumed partial) while block
    ``kb - 1``'s (``done``) may still run; then wait for that one (one group left in flight), release its stage and
    promote it. Returns ``(block kb's partial, in flight; block kb - 1's, consumed; acc)``."""
    STAGES: gl.constexpr = b_smem.shape[0]
    position = consumed + kb
    scale_a = gl.load(a_scale_ptrs + (kb - 1) * stride_a_scale_k)
    scale_b = gl.load(b0_scale_ptr + (kb - 1) * stride_b_scale_k)
    mbarrier.wait(ready.index(position % STAGES), (position // STAGES) & 1)
    issued = _mma(a_smem, b_smem, position % STAGES, in_flight, CONSUMER, 0)
    done = warpgroup_mma_wait(num_outstanding=1, deps=(done, ))
    mbarrier.arrive(empty.index((position - 1) % STAGES))
    acc = gl.fma(done, gl.expand_dims(scale_a * scale_b, 1), acc)
    return issued, done, acc


@gluon.jit
def _k_loop_pipelined(a_smem, b_smem, ready, empty, consumed, k_blocks, a_scale_ptrs, stride_a_scale_k, b0_scale_ptr,
                      stride_b_scale_k, acc, CONSUMER: gl.constexpr):
    """BLOCK_N = 128: K block k + 1's wgmma runs while block k is promoted (``wait_group 1``). Two partials
    ``p_even`` / ``p_odd`` alternate (the loop is unrolled by two), so an in-flight accumulator is never copied
    between registers (a copy would make ptxas serialize every wgmma: its C7514)."""
    STAGES: gl.constexpr = b_smem.shape[0]
    p_even = gl.zeros_like(acc)
    p_odd = gl.zeros_like(acc)
    mbarrier.wait(ready.index(consumed % STAGES), (consumed // STAGES) & 1)
    p_even = _mma(a_smem, b_smem, consumed % STAGES, p_even, CONSUMER, 0)
    kb = 1
    while kb + 1 < k_blocks:
        p_odd, p_even, acc = _pipelined_step(a_smem, b_smem, ready, empty, consumed, kb, p_even, p_odd, acc,
                                             a_scale_ptrs, stride_a_scale_k, b0_scale_ptr, stride_b_scale_k, CONSUMER)
        p_even, p_odd, acc = _pipelined_step(a_smem, b_smem, ready, empty, consumed, kb + 1, p_odd, p_even, acc,
                                             a_scale_ptrs, stride_a_scale_k, b0_scale_ptr, stride_b_scale_k, CONSUMER)
        kb += 2
    # p_even (block kb - 1) in flight; each branch drains its own partial (a phi of two in-flight partials
    # would be a register copy)
    if kb < k_blocks:  # one block left
        tail, _, acc = _pipelined_step(a_smem, b_smem, ready, empty, consumed, kb, p_even, p_odd, acc,
                                       a_scale_ptrs, stride_a_scale_k, b0_scale_ptr, stride_b_scale_k, CONSUMER)
        last = warpgroup_mma_wait(num_outstanding=0, deps=(tail, ))
        mbarrier.arrive(empty.index((consumed + k_blocks - 1) % STAGES))
        acc = _promote(acc, last, a_scale_ptrs, b0_scale_ptr, k_blocks - 1, stride_a_scale_k, stride_b_scale_k)
    else:
        last = warpgroup_mma_wait(num_outstanding=0, deps=(p_even, ))
        mbarrier.arrive(empty.index((consumed + k_blocks - 1) % STAGES))
        acc = _promote(acc, last, a_scale_ptrs, b0_scale_ptr, k_blocks - 1, stride_a_scale_k, stride_b_scale_k)
    return acc


@gluon.jit
def _store_half_staged(buffer, out_ptr, acc, multiplier, first_row, rows, col0, N, stride_out_row,
                       CONSUMER: gl.constexpr):
    """:func:`_store_half` through the staging buffer instead of ``convert_layout`` (whose 16 KB of scratch
    shared memory the 4-stage 128x256 TMA-store config cannot afford): STSM into the buffer, read back in the
    16-byte blocked layout, masked stores."""
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])
    tma.store_wait(0)  # a TMA store still reading the buffer
    _barrier()
    buffer.store((acc * multiplier).to(buffer.dtype))
    _barrier()
    values = buffer.load(layout)
    local = CONSUMER * CONSUMER_ROWS + gl.arange(0, CONSUMER_ROWS, layout=gl.SliceLayout(1, layout))
    cols = col0 + gl.arange(0, 128, layout=gl.SliceLayout(0, layout))
    offsets = gl.expand_dims((first_row + local).to(gl.int64) * stride_out_row, 1) + gl.expand_dims(cols, 0)
    mask = gl.expand_dims(local < rows, 1) & gl.expand_dims(cols < N, 0)
    gl.store(out_ptr + offsets, values, mask=mask)


@gluon.jit
def _stream_k_fixup(ws_ptr, counters_ptr, tail, acc0, acc1, blocks, k_blocks, out_ptr, multiplier, first_row, rows,
                    first_col, N, stride_out_row, CONSUMER: gl.constexpr, HALVES: gl.constexpr):
    """A stream-K piece (``blocks`` of the tile's ``k_blocks`` K blocks) of this consumer's 64 rows: fp32 atomic
    adds into its ``[64, 128·HALVES]`` workspace slot, then (partition barrier, one acq_rel atomic) adds
    ``blocks`` to the slot's counter; the piece that completes the count reads the sum back (L2, ``.cg``), stores
    it as bf16 (masked rows / columns) and leaves the slot and its counter zeroed for the next launch. No piece
    waits for another: no deadlock whatever the order the programs run in."""
    WIDTH: gl.constexpr = 128 * HALVES
    mma_layout: gl.constexpr = acc0.type.layout
    slot = ws_ptr + (tail * 2 + CONSUMER).to(gl.int64) * (CONSUMER_ROWS * WIDTH)
    r = gl.arange(0, CONSUMER_ROWS, layout=gl.SliceLayout(1, mma_layout))
    c = gl.arange(0, 128, layout=gl.SliceLayout(0, mma_layout))
    offsets = gl.expand_dims(r, 1) * WIDTH + gl.expand_dims(c, 0)
    gl.atomic_add(slot + offsets, acc0, sem="relaxed", scope="gpu")
    if HALVES == 2:
        gl.atomic_add(slot + 128 + offsets, acc1, sem="relaxed", scope="gpu")
    _barrier()  # every thread's adds, before the release below
    lane_layout: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    lane = gl.arange(0, 128, layout=lane_layout)
    counter = counters_ptr + tail * 2 + CONSUMER + lane * 0
    old = gl.atomic_add(counter, gl.where(lane == 0, blocks, 0), mask=lane == 0, sem="acq_rel", scope="gpu")
    done = gl.sum(gl.where(lane == 0, old, 0), axis=0) + blocks  # broadcast (through smem and a barrier)
    if done == k_blocks:
        layout: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])
        rr = gl.arange(0, CONSUMER_ROWS, layout=gl.SliceLayout(1, layout))
        cc = gl.arange(0, 128, layout=gl.SliceLayout(0, layout))
        local = CONSUMER * CONSUMER_ROWS + rr
        for h in gl.static_range(HALVES):
            where = slot + h * 128 + gl.expand_dims(rr, 1) * WIDTH + gl.expand_dims(cc, 0)
            total = gl.load(where, cache_modifier=".cg")
            gl.store(where, gl.zeros_like(total))
            cols = first_col + h * 128 + cc
            out_offsets = gl.expand_dims((first_row + local).to(gl.int64) * stride_out_row, 1) + gl.expand_dims(cols, 0)
            mask = gl.expand_dims(local < rows, 1) & gl.expand_dims(cols < N, 0)
            gl.store(out_ptr + out_offsets, (total * multiplier).to(out_ptr.dtype.element_ty), mask=mask)
        gl.store(counter, lane * 0, mask=lane == 0)


@gluon.jit
def _epilogue_half(out_desc, c_smem, out_ptr, acc, multiplier, first_row, rows, col0, N, stride_out_row,
                   CONSUMER: gl.constexpr, HALF: gl.constexpr, EPILOGUE: gl.constexpr,
                   ONE_BUFFER: gl.constexpr = False):
    """Store one ``[64, 128]`` accumulator of this consumer. ``EPILOGUE`` 0/1: masked pointer stores (1 with the
    column known to be a multiple of 128, so 16-byte stores); 2: when all 64 rows of this consumer belong to the
    group, through shared memory and an asynchronous TMA store (the columns past N clipped by the descriptor; the
    next tile's wgmmas run while it drains), else the masked stores."""
    if EPILOGUE == 2 and ONE_BUFFER:
        # one staging buffer for both halves: half 1 waits for half 0's TMA store to have read it (~16 KB)
        buffer = c_smem.index(0)
        if rows >= (CONSUMER + 1) * CONSUMER_ROWS:
            tma.store_wait(0)
            _barrier()
            buffer.store((acc * multiplier).to(c_smem.dtype))
            fence_async_shared()
            _barrier()
            _tma_store(out_desc, [first_row + CONSUMER * CONSUMER_ROWS, col0], buffer)
        else:
            _store_half_staged(buffer, out_ptr, acc, multiplier, first_row, rows, col0, N, stride_out_row, CONSUMER)
    elif EPILOGUE == 2:
        if rows >= (CONSUMER + 1) * CONSUMER_ROWS:
            buffer = c_smem.index(HALF)
            tma.store_wait(0)  # this buffer's previous TMA store has read it (long done: one tile ago)
            _barrier()
            buffer.store((acc * multiplier).to(c_smem.dtype))
            fence_async_shared()
            _barrier()
            _tma_store(out_desc, [first_row + CONSUMER * CONSUMER_ROWS, col0], buffer)
        else:
            _store_half(out_ptr, acc, multiplier, first_row, rows, col0, N, stride_out_row, CONSUMER)
    else:
        _store_half(out_ptr, acc, multiplier, first_row, rows, col0, N, stride_out_row, CONSUMER)


@gluon.jit
def _consumer_partition(a_smem, b_smem, ready, empty, schedule, a_scales_ptr, b_scales_ptr, out_ptr, out_desc,
                        c_smem, expert_scales_ptr, stride_a_scale_row, stride_a_scale_k, stride_b_scale_expert,
                        stride_b_scale_row, stride_b_scale_k, stride_out_row, num_tokens, N, K,
                        CONSUMER: gl.constexpr, PIPELINE_MMA: gl.constexpr, HAS_EXPERT_SCALES: gl.constexpr,
                        EPILOGUE: gl.constexpr, SCALE_PREFETCH: gl.constexpr, ws_ptr=None, counters_ptr=None,
                        ONE_BUFFER: gl.constexpr = False, STREAM_K: gl.constexpr = False):
    """Consumer warpgroup ``CONSUMER``: rows ``[64·CONSUMER, 64·CONSUMER + 64)`` of every tile it is handed."""
    BLOCK_N: gl.constexpr = b_smem.shape[1]
    HALVES: gl.constexpr = BLOCK_N // 128
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, 128, 32])
    row_layout: gl.constexpr = gl.SliceLayout(1, mma_layout)
    zero = gl.zeros([CONSUMER_ROWS, 128], gl.float32, layout=mma_layout)
    k_blocks = gl.cdiv(K, BLOCK_K)
    count = 0
    consumed = 0
    kb0 = 0
    kb1 = k_blocks
    tail = -1  # >= 0: a stream-K piece of tail tile `tail`, K blocks [kb0, kb1)
    if STREAM_K:
        first_row, rows, first_col, expert, kb0, kb1, tail = _receive7(count, schedule)
    else:
        first_row, rows, first_col, expert = _receive(count, schedule)
    while expert != STOP:
        if EPILOGUE != 0:
            # published through shared memory, so the compiler knows nothing of it: re-derived as a multiple of
            # 128 (it is one of BLOCK_N) so that the epilogue's stores are 16 bytes wide. Without it (EPILOGUE 0,
            # the first run's kernel) they are scalar 2-byte STG.E.U16, 64 per thread per 64x128 half
            # (gl.multiple_of on a scalar is dropped by Triton 3.6)
            first_col = (first_col // 128) * 128
        acc0 = zero
        acc1 = zero
        if expert >= 0:
            # the scales of this consumer's rows (clamped: rows past T are not stored) and of the B half-tiles
            a_rows = gl.minimum(first_row + CONSUMER * CONSUMER_ROWS + gl.arange(0, CONSUMER_ROWS, layout=row_layout),
                                num_tokens - 1)
            a_scale_ptrs = a_scales_ptr + a_rows.to(gl.int64) * stride_a_scale_row
            b_scale_base = b_scales_ptr + expert.to(gl.int64) * stride_b_scale_expert
            b0_scale_ptr = b_scale_base + (first_col // 128) * stride_b_scale_row
            # a second half wholly past N reads the first half's scale row (it is not stored)
            b1_scale_ptr = b_scale_base + (gl.minimum(first_col + 128, N - 1) // 128) * stride_b_scale_row
            if PIPELINE_MMA:
                acc0 = _k_loop_pipelined(a_smem, b_smem, ready, empty, consumed, k_blocks, a_scale_ptrs,
                                         stride_a_scale_k, b0_scale_ptr, stride_b_scale_k, acc0, CONSUMER)
            else:
                acc0, acc1 = _k_loop(a_smem, b_smem, ready, empty, consumed, kb0, kb1, a_scale_ptrs, stride_a_scale_k,
                                     b0_scale_ptr, b1_scale_ptr, stride_b_scale_k, acc0, acc1, CONSUMER,
                                     SCALE_PREFETCH)
            consumed += kb1 - kb0
        multiplier = 1.0
        if HAS_EXPERT_SCALES:
            multiplier = gl.load(expert_scales_ptr + gl.maximum(expert, 0))
        if STREAM_K:
            if tail >= 0:
                _stream_k_fixup(ws_ptr, counters_ptr, tail, acc0, acc1, kb1 - kb0, k_blocks, out_ptr, multiplier,
                                first_row, rows, first_col, N, stride_out_row, CONSUMER, HALVES)
            else:
                _epilogue_half(out_desc, c_smem, out_ptr, acc0, multiplier, first_row, rows, first_col, N,
                               stride_out_row, CONSUMER, 0, EPILOGUE, ONE_BUFFER)
                if HALVES == 2:
                    _epilogue_half(out_desc, c_smem, out_ptr, acc1, multiplier, first_row, rows, first_col + 128, N,
                                   stride_out_row, CONSUMER, 1, EPILOGUE, ONE_BUFFER)
        else:
            _epilogue_half(out_desc, c_smem, out_ptr, acc0, multiplier, first_row, rows, first_col, N,
                           stride_out_row, CONSUMER, 0, EPILOGUE, ONE_BUFFER)
            if HALVES == 2:
                _epilogue_half(out_desc, c_smem, out_ptr, acc1, multiplier, first_row, rows, first_col + 128, N,
                               stride_out_row, CONSUMER, 1, EPILOGUE, ONE_BUFFER)
        count += 1
        if STREAM_K:
            first_row, rows, first_col, expert, kb0, kb1, tail = _receive7(count, schedule)
        else:
            first_row, rows, first_col, expert = _receive(count, schedule)
    if EPILOGUE == 2:
        tma.store_wait(0)  # the shared memory must outlive the last TMA store's read


@gluon.jit
def fp8_block_grouped_matmul_gluon_kernel(
    a_desc, b_desc, out_desc, a_scales_ptr, b_scales_ptr, out_ptr, a_offsets_ptr, expert_ids_ptr, expert_scales_ptr,
    stride_a_scale_row, stride_a_scale_k, stride_b_scale_expert, stride_b_scale_row, stride_b_scale_k,
    stride_out_row, num_tokens, num_groups, num_experts, N, K, n_tiles, ws_ptr, counters_ptr,
    STAGES: gl.constexpr, PIPELINE_MMA: gl.constexpr, HAS_EXPERT_SCALES: gl.constexpr,
    EPILOGUE: gl.constexpr = 0, SCALE_PREFETCH: gl.constexpr = False, BAND: gl.constexpr = 0,
    ONE_BUFFER: gl.constexpr = False, STREAM_K: gl.constexpr = False,
):
    """Persistent warp-specialized grouped FP8-block matmul (module docstring).

    a_desc: TMA descriptor over A ``[T, K]`` e4m3, block ``[64, 128]``; b_desc: over B viewed as ``[E·N, K]``,
    block ``[BLOCK_N, 128]`` (BLOCK_N 128 or 256); out_desc: over out ``[T, N]`` bf16, block ``[64, 128]`` (used
    by ``EPILOGUE == 2`` only). Grid ``(min(SMs, tile bound),)``, ``num_warps=4`` (consumer 0,
    the default partition) + consumer 1 (4 warps) + the load warp; ``maxnreg`` = :data:`MAX_REGS`."""
    BLOCK_N: gl.constexpr = b_desc.block_type.shape[0]
    gl.static_assert(BLOCK_N == 128 or BLOCK_N == 256)
    gl.static_assert(not PIPELINE_MMA or BLOCK_N == 128)
    a_smem = gl.allocate_shared_memory(a_desc.dtype, [2 * STAGES, CONSUMER_ROWS, BLOCK_K], a_desc.layout)
    b_smem = gl.allocate_shared_memory(b_desc.dtype, [STAGES, BLOCK_N, BLOCK_K], b_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    if EPILOGUE == 2 and ONE_BUFFER:  # one [64, 128] bf16 staging buffer per consumer, for both halves
        c_smem = gl.allocate_shared_memory(out_desc.dtype, [1, CONSUMER_ROWS, 128], out_desc.layout)
        c_smem1 = gl.allocate_shared_memory(out_desc.dtype, [1, CONSUMER_ROWS, 128], out_desc.layout)
    elif EPILOGUE == 2:  # one [64, 128] bf16 staging buffer per consumer and 128-column half
        c_smem = gl.allocate_shared_memory(out_desc.dtype, [BLOCK_N // 128, CONSUMER_ROWS, 128], out_desc.layout)
        c_smem1 = gl.allocate_shared_memory(out_desc.dtype, [BLOCK_N // 128, CONSUMER_ROWS, 128], out_desc.layout)
    else:  # unused
        c_smem = gl.allocate_shared_memory(gl.int32, [1, 1], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
        c_smem1 = c_smem
    if STREAM_K:  # (first row, rows, first column, expert, K block range, tail slot) per published tile
        info_smem = gl.allocate_shared_memory(gl.int32, [2, 8], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    else:
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
    gl.warp_specialize([
        (_consumer_partition, (a_smem, b_smem, ready, empty, schedule, a_scales_ptr, b_scales_ptr, out_ptr,
                               out_desc, c_smem, expert_scales_ptr, stride_a_scale_row, stride_a_scale_k,
                               stride_b_scale_expert, stride_b_scale_row, stride_b_scale_k, stride_out_row,
                               num_tokens, N, K, 0, PIPELINE_MMA, HAS_EXPERT_SCALES, EPILOGUE, SCALE_PREFETCH,
                               ws_ptr, counters_ptr, ONE_BUFFER, STREAM_K)),
        (_consumer_partition, (a_smem, b_smem, ready, empty, schedule, a_scales_ptr, b_scales_ptr, out_ptr,
                               out_desc, c_smem1, expert_scales_ptr, stride_a_scale_row, stride_a_scale_k,
                               stride_b_scale_expert, stride_b_scale_row, stride_b_scale_k, stride_out_row,
                               num_tokens, N, K, 1, PIPELINE_MMA, HAS_EXPERT_SCALES, EPILOGUE, SCALE_PREFETCH,
                               ws_ptr, counters_ptr, ONE_BUFFER, STREAM_K)),
        (_load_partition, (a_desc, b_desc, a_smem, b_smem, ready, empty, schedule, a_offsets_ptr, expert_ids_ptr,
                           num_groups, num_tokens, num_experts, N, K, n_tiles, BAND, STREAM_K)),
    ], [4, 1], [CONSUMER_REGS, LOADER_REGS])


# ----------------------------------------------------------------------------------------------------- host side


@dataclass(frozen=True)
class GluonFp8Config:
    """The defaults of the fields after ``pipeline_mma`` reproduce the first H100 run's kernel (results/gluon.md)."""
    block_n: int = 128  # 128 or 256
    stages: int = 4
    pipeline_mma: bool = False  # issue K block k+1's wgmma before promoting block k (block_n 128 only)
    epilogue: str = "scalar"  # "scalar" (first run: 2-byte stores), "vec" (16-byte stores), "tma" (smem + TMA store)
    scale_prefetch: bool = False  # load K block k+1's scales during block k
    band: int = 0  # 0: m-tile fastest inside a group; b > 0: bands of b m-tiles, n-tile fastest inside a band
    one_buffer: bool = False  # "tma": one [64, 128] staging buffer per consumer for both halves (frees 32 KB)
    stream_k: bool = False  # the last partial wave's tiles split in K over all programs (fp32 workspace fixup)

    @property
    def label(self) -> str:
        extras = ([self.epilogue + ("1" if self.one_buffer else "")] + (["pf"] if self.scale_prefetch else [])
                  + ([f"band{self.band}"] if self.band else []) + (["streamK"] if self.stream_k else []))
        return (f"gluon 128x{self.block_n}x128 s{self.stages}{' pipeMMA' if self.pipeline_mma else ''} split-M "
                + " ".join(extras))

    def smem_bytes(self) -> int:
        staging = (2 * (128 if self.one_buffer else self.block_n) * 64 * 2) if self.epilogue == "tma" else 0
        return self.stages * (128 + self.block_n) * 128 + staging + 1024


DEFAULT_CONFIG = GluonFp8Config(128, 5, False, "tma", True)
FIRST_RUN_CONFIG = GluonFp8Config(128, 5, False)  # results/gluon.md's default: the ablation's baseline
# The ablation ladder (bench_gluon_gpu.py and compile_gluon_sm90.py): each step changes one thing.
ABLATION_CONFIGS = [
    FIRST_RUN_CONFIG,
    GluonFp8Config(128, 5, False, "vec"),  # (5) 16-byte epilogue stores
    GluonFp8Config(128, 5, False, "vec", True),  # + scale prefetch
    DEFAULT_CONFIG,  # (1) + TMA-store epilogue, overlapped with the next tile
    GluonFp8Config(128, 4, False, "tma", True),
    GluonFp8Config(128, 5, False, "tma", True, 8),  # (2) GROUP_M-style bands of 8 m-tiles
    GluonFp8Config(256, 3, False, "tma", True),  # 128x256: 1/4 less smem/L2 feed per FLOP
    GluonFp8Config(256, 4, False, "vec", True),
    # third round (NOTES.md): 4 stages with the TMA-store epilogue through one staging buffer per consumer;
    # stream-K over the last partial wave
    GluonFp8Config(256, 4, False, "tma", True, one_buffer=True),  # 8
    GluonFp8Config(256, 4, False, "vec", True, stream_k=True),  # 9
    GluonFp8Config(256, 4, False, "tma", True, one_buffer=True, stream_k=True),  # 10
    GluonFp8Config(256, 3, False, "tma", True, stream_k=True),  # 11
]
LAST_COMPILED = {}  # config -> the compiled kernel of its last launch (the bench reads registers from it)


def _nvmma_layout(block, dtype=gl.float8e4nv):
    return gl.NVMMASharedLayout.get_default_for(block, dtype)


def descriptor_type(block, dtype=gl.float8e4nv) -> str:
    """Triton's type string of a tensor-descriptor argument with this block (ahead-of-time compiles)."""
    name = {gl.float8e4nv: "fp8e4nv", gl.bfloat16: "bf16"}[dtype]
    return f"tensordesc<{name}[{', '.join(map(str, block))}],{_nvmma_layout(block, dtype)!r}>"


def compile_signature(config: GluonFp8Config, has_expert_scales: bool = False):
    """``(signature, constexprs)`` of the kernel for ``triton.compile`` (no tensors, no GPU)."""
    names = fp8_block_grouped_matmul_gluon_kernel.arg_names
    types = dict(a_desc=descriptor_type([64, 128]), b_desc=descriptor_type([config.block_n, 128]),
                 out_desc=descriptor_type([64, 128], gl.bfloat16),
                 a_scales_ptr="*fp32", b_scales_ptr="*fp32", out_ptr="*bf16", a_offsets_ptr="*i32",
                 expert_ids_ptr="*i32", expert_scales_ptr="*fp32", ws_ptr="*fp32", counters_ptr="*i32")
    constexprs = dict(STAGES=config.stages, PIPELINE_MMA=config.pipeline_mma, HAS_EXPERT_SCALES=has_expert_scales,
                      EPILOGUE=EPILOGUES[config.epilogue], SCALE_PREFETCH=config.scale_prefetch, BAND=config.band,
                      ONE_BUFFER=config.one_buffer, STREAM_K=config.stream_k)
    signature = {name: ("constexpr" if name in constexprs else types.get(name, "i32")) for name in names}
    return signature, constexprs


def _multiprocessors(device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


_DUMMY_OUT = {}
_STREAM_K_WORKSPACE = {}


def _stream_k_workspace(device, programs: int, block_n: int):
    """fp32 ``[programs, 2, 64, block_n]`` partial sums and int32 ``[programs, 2]`` counters of the stream-K
    tail (at most ``programs - 1`` tail tiles), zeroed once: the kernel leaves them zeroed (the finalizing piece
    resets its slot). One per device and width: two launches in flight on different streams must not share it."""
    key = (str(device), block_n)
    if key not in _STREAM_K_WORKSPACE or _STREAM_K_WORKSPACE[key][0].shape[0] < programs:
        _STREAM_K_WORKSPACE[key] = (torch.zeros(programs, 2, 64, block_n, dtype=torch.float32, device=device),
                                    torch.zeros(programs, 2, dtype=torch.int32, device=device))
    return _STREAM_K_WORKSPACE[key]


def _dummy_out(device) -> torch.Tensor:
    """A bf16 tensor for the unused TMA-store descriptor when out's strides do not allow one."""
    if device not in _DUMMY_OUT:
        _DUMMY_OUT[device] = torch.zeros(64, 128, dtype=torch.bfloat16, device=device)
    return _DUMMY_OUT[device]


def _pad_k(t: torch.Tensor) -> torch.Tensor:
    """TMA needs 16-byte row strides: K padded with zeros to a multiple of 16 (a copy; a slow path)."""
    k = t.shape[-1]
    if k % 16 == 0 and t.stride(-1) == 1 and all(s % 16 == 0 for s in t.stride()[:-1]) and t.data_ptr() % 16 == 0:
        return t
    padded = torch.zeros(*t.shape[:-1], triton.cdiv(k, 16) * 16, dtype=t.dtype, device=t.device)
    padded[..., :k] = t
    return padded


def fp8_block_grouped_matmul_gluon(a: torch.Tensor, a_scales: torch.Tensor, b: torch.Tensor, b_scales: torch.Tensor,
                                   a_offsets: torch.Tensor, expert_ids: torch.Tensor,
                                   expert_scales: torch.Tensor | None = None, out: torch.Tensor | None = None,
                                   config: GluonFp8Config | None = None) -> torch.Tensor:
    """The Gluon kernel on an sm_90 GPU; same arguments and result as ``kernel.fp8_block_grouped_matmul`` (bf16
    out only). Rows of ``out`` past ``a_offsets[G]`` are left as they are."""
    config = config or DEFAULT_CONFIG
    if a.dim() != 2 or b.dim() != 3 or a.dtype != torch.float8_e4m3fn or b.dtype != torch.float8_e4m3fn:
        raise ValueError("a must be e4m3 [T, K] and b e4m3 [E, N, K]")
    (num_tokens, k), (num_experts, n, k_b) = a.shape, b.shape
    if k_b != k:
        raise ValueError(f"K mismatch: {k} vs {k_b}")
    k_blocks = triton.cdiv(k, SCALE_BLOCK)
    if tuple(a_scales.shape) != (num_tokens, k_blocks) or a_scales.dtype != torch.float32:
        raise ValueError(f"a_scales must be float32 {(num_tokens, k_blocks)}")
    if tuple(b_scales.shape) != (num_experts, triton.cdiv(n, SCALE_BLOCK), k_blocks) or b_scales.dtype != torch.float32:
        raise ValueError("b_scales must be float32 [E, ceil(N/128), ceil(K/128)]")
    num_groups = expert_ids.numel()
    if a_offsets.numel() != num_groups + 1 or a_offsets.dtype != torch.int32 or expert_ids.dtype != torch.int32:
        raise ValueError("a_offsets must be int32 [G + 1] and expert_ids int32 [G]")
    if (config.block_n not in (128, 256) or (config.pipeline_mma and config.block_n != 128)
            or config.epilogue not in EPILOGUES or config.band < 0):
        raise ValueError(f"unsupported config {config}")
    if out is None:
        out = torch.empty(num_tokens, n, dtype=torch.bfloat16, device=a.device)
    if out.dtype != torch.bfloat16 or tuple(out.shape) != (num_tokens, n):
        raise ValueError("out must be bf16 [T, N]")
    if num_groups == 0 or num_tokens == 0 or n == 0:
        return out
    a_data = _pad_k(a)
    b_data = _pad_k(b.reshape(num_experts * n, k) if b.is_contiguous() else b.contiguous().reshape(num_experts * n, k))
    target = out if out.stride(1) == 1 else out.contiguous()
    a_desc = TensorDescriptor.from_tensor(a_data, [64, 128], _nvmma_layout([64, 128]))
    b_desc = TensorDescriptor.from_tensor(b_data, [config.block_n, 128], _nvmma_layout([config.block_n, 128]))
    epilogue = EPILOGUES[config.epilogue]
    tma_ok = target.stride(0) % 8 == 0 and target.data_ptr() % 16 == 0  # TMA: 16-byte row stride and base
    if epilogue == 2 and not tma_ok:
        epilogue = 1  # the 16-byte pointer stores instead
    # the TMA-store descriptor (used only when epilogue == 2, for 64-row halves wholly inside their group; its
    # global shape [T, N] clips the columns past N)
    out_desc = TensorDescriptor.from_tensor(target if tma_ok else _dummy_out(a.device), [64, 128],
                                            _nvmma_layout([64, 128], gl.bfloat16))
    n_tiles = triton.cdiv(n, config.block_n)
    bound = (triton.cdiv(num_tokens, 128) + num_groups) * n_tiles
    grid = (max(1, min(bound, _multiprocessors(a.device))),)
    if config.stream_k:
        ws, counters = _stream_k_workspace(a.device, grid[0], config.block_n)
    else:
        ws, counters = a_scales, a_offsets  # unused
    LAST_COMPILED[config] = fp8_block_grouped_matmul_gluon_kernel[grid](
        a_desc, b_desc, out_desc, a_scales, b_scales, target, a_offsets.contiguous(), expert_ids.contiguous(),
        expert_scales.contiguous() if expert_scales is not None else a_scales,
        a_scales.stride(0), a_scales.stride(1), b_scales.stride(0), b_scales.stride(1), b_scales.stride(2),
        target.stride(0), num_tokens, num_groups, num_experts, n, k, n_tiles, ws, counters,
        STAGES=config.stages, PIPELINE_MMA=config.pipeline_mma, HAS_EXPERT_SCALES=expert_scales is not None,
        EPILOGUE=epilogue, SCALE_PREFETCH=config.scale_prefetch, BAND=config.band, ONE_BUFFER=config.one_buffer,
        STREAM_K=config.stream_k, num_warps=4, maxnreg=MAX_REGS)
    if target is not out:
        out.copy_(target)
    return out
