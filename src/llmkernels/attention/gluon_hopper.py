"""Attention forward in Gluon for Hopper (sm_90a), warp-specialized on FA3's schedule.

The backend :data:`BACKEND` (:class:`GluonPrefill`) is the prefill path of :func:`llmkernels.attention` on an sm_90
GPU for fp16/bf16 inputs with head dim 64, 128 or 256, causal and / or a sliding window (bottom-right aligned) or
neither, MHA/GQA/MQA, optionally with the LSE: dense q, k, v; ragged ones (``cu_seqlens``); q dense or ragged over a
paged KV cache (chunked prefill). Its ``supports(call, tiles)`` says whether a call qualifies (the first of the
plan's backends: everything else runs the portable Triton kernel) and ``spec(call, tiles)`` gives the launch.
:func:`gluon_attention` runs the dense layout alone; :func:`supports` and :func:`supports_paged` ask the same of
tensors.

The kernel is persistent: one program per SM runs work tiles (a Q block of one (batch, q head)) until none is
left, in head-major order so that the blocks running together share their heads' K/V in L2. Unmasked calls
stride the grid; masked ones (causal, windows), whose blocks differ in length, hand tiles out through an atomic
counter, longest first within a head. Roles (``gl.warp_specialize``):

* a **load warp** picks the work tiles and passes each to the consumers through a two-slot shared-memory ring,
  then issues its TMA loads: the block's 64-row Q tiles (once the consumers released the last block's), then K
  and V tiles through two separate two-stage rings (``*_ready`` / ``*_empty`` mbarriers), so that K tile
  ``j + 1`` can land while V tile ``j`` is still read, and the next block's first tiles while the consumers
  finish this one;
* two or three **consumer warpgroups** (the default partition and workers), each owning 64 Q rows. Each
  issues ``S_j = Q K_j^T`` and ``O += P_{j-1} V_{j-1}`` as asynchronous wgmmas, then runs the online softmax
  of ``S_j`` once the first is done (``P`` stays in registers as the A operand of ``P V``). The warp
  schedulers interleave the consumers: one warpgroup's softmax runs while another's matmuls hold the tensor
  cores. An explicit ping-pong (the consumers taking turns through mbarriers, FA3's) measured no
  faster on the H100 and left (lab/NOTES.md).

Scores stay unscaled until the exponent: ``p = exp2(s * c - m * c)`` with ``c = softmax_scale * log2(e) > 0``
is one FMA per score. A block visits only the key tiles some of its rows see; only tiles a consumer sees in part
(the window's edges, the last tile past Skv) are masked. Dense TMA descriptors are
per sequence (``[B, S, H·D]`` with the tensors' own batch and token strides), so tiles past ``S`` read zeros,
never the next sequence's rows. Ragged K/V come through one descriptor over all rows and paged ones one box per
page a tile spans (pages from the block table): a sequence's last tile then holds other rows (the next
sequence's, stale pages, NaN included), which the load warp zeroes in the last V tile before the consumers read
it (its K rows only get masked scores). At D = 64 three consumer warpgroups share each block (192 rows, 160 registers
each: FA3's choice there; two for masked calls of at most 4096 queries), at D 128 and 256 two (128 rows,
240 registers).

:func:`compile_for_sm90` builds the kernel without a GPU, so that CPU tests can inspect its PTX.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import threading

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

from ..launch import BoundKernel, KernelSpec, PlanCache, take_tile_counter
from ..runtime import num_programs_hint, pretend_gpu
from . import config as attention_config
from .check import CheckedCall, check_attention
from .config import FA4Config, Tiling
from .layout import paged_metadata, tma_ready
from .masks import SCORE_MOD_NONE, UNBOUNDED, MaskSpec, ScoreModSpec
from .portable import TYPE_NAMES

__all__ = [
    "gluon_attention",
    "supports",
    "supports_paged",
    "tma_ready",
    "as_tma_ready",
    "BACKEND",
    "GluonPrefill",
    "gluon_eligible",
    "compile_for_sm90",
]

LOG2E = 1.4426950408889634
LN2 = gl.constexpr(0.6931471805599453)
CONSUMER_ROWS = 64  # Q rows per consumer warpgroup: one m64 wgmma row block
HEAD_DIMS = (64, 128, 256)
MAX_WORK_TILES = 2**31 - 2**20  # work-tile indices (and the counter, which overshoots by a grid) stay in int32
DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}
# the element types of the tiles the Gluon kernels read through descriptors: DTYPES and e4m3 (gluon_fp8_prefill)
TILE_DTYPES = {**DTYPES, torch.float8_e4m3fn: gl.float8e4nv}
# Registers per thread. Two consumer warpgroups: 240 each and 24 for the load warp's warpgroup, 12 warps in all
# (4 + 4 + 1, rounded up to warpgroups) sharing the SM's 64K registers: the launch's maxnreg
# (config.GLUON_PREFILL_MAX_REGS) is 65536 / (12 * 32) rounded down to a multiple of 8, and the default partition
# gets what the workers leave. Three consumers (FA3's choice at D = 64): 16 warps, maxnreg 128, 160 per consumer.
CONSUMER_REGS = gl.constexpr(240)
CONSUMER_REGS_3 = gl.constexpr(160)
LOADER_REGS = gl.constexpr(24)


# The TMA global -> shared copy: ``async_copy_global_to_shared`` in Triton 3.6, ``async_load`` in later ones
# (3.9 removed the old name), so that the kernel also compiles with the newer Triton of a CPU test machine.
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
# A barrier of one partition's warps: ``thread_barrier`` in Triton 3.9, ``barrier`` in 3.6.
partition_barrier = getattr(gl, "thread_barrier", None) or gl.barrier


@gluon.constexpr_function
def _store_layout(head_dim, num_warps):
    """A blocked layout for ``[rows, head_dim]`` 16-bit values with 16-byte vectors per thread (coalesced
    stores: rows of one warp are contiguous in memory only within a head)."""
    vector = 8
    threads_per_row = head_dim // vector
    return gl.BlockedLayout([1, vector], [32 // threads_per_row, threads_per_row], [num_warps, 1], [1, 0])


@gluon.jit
def _as_box(buffer):
    """A ``[rows, D]`` shared-memory tile as the ``[1, rows, D]`` box of a per-sequence (3-D) TMA descriptor."""
    return buffer.reshape([1, buffer.shape[0], buffer.shape[1]])


@gluon.jit
def _ragged_bounds(cu_seqlens_ptr, batch, total, NUM_WARPS: gl.constexpr):
    """``(first row, rows)`` of sequence ``batch`` of a ragged tensor of ``total`` rows, read as if ``cu_seqlens``
    were ``clamp(cummax(cu_seqlens), 0, total)`` (the portable kernel's ``ragged_bounds``: valid prefix sums
    unchanged, no row outside the tensor or in two sequences, a decreasing entry gives no rows)."""
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [NUM_WARPS], [0])
    BLOCK: gl.constexpr = 32 * NUM_WARPS
    prefix_max = batch * 0
    for first in range(0, batch + 1, BLOCK):
        entries = first + gl.arange(0, BLOCK, layout=layout)
        values = gl.load(cu_seqlens_ptr + entries, mask=entries <= batch, other=0)
        prefix_max = gl.maximum(prefix_max, gl.max(values, axis=0))
    start = gl.minimum(prefix_max, total)
    end = gl.minimum(gl.maximum(gl.load(cu_seqlens_ptr + batch + 1), start), total)
    return start, end - start


@gluon.jit
def _tile_block(
    tile,
    geometry,
    lens,
    num_q_heads,
    group_size,
    num_m_blocks,
    WINDOW: gl.constexpr,
    TILE_N: gl.constexpr,
    CONSUMERS: gl.constexpr,
    RAGGED: gl.constexpr,
    PAGED: gl.constexpr,
    NUM_WARPS: gl.constexpr,
):
    """Work tile ``tile``, as every role computes it: ``(batch, q head, kv head, first Q row, first K/V tile,
    number of K/V tiles, geometry, place)``. Tiles are head-major, so that the blocks running together share their
    heads' K/V in L2; masked blocks of a head run longest first, so that the last ones to finish are short.

    geometry: ``(Sq, Skv, shift = Skv - Sq, window left, window right)`` of the tile's sequence: the kernel's
    (dense), or from ``lens = (cu_seqlens_q, cu_seqlens_k, seqlens, total_q, total_k)``: RAGGED q reads its
    rows from ``cu_seqlens_q`` (and k from ``cu_seqlens_k`` unless PAGED), PAGED k has ``seqlens[batch]`` keys
    clamped to ``[0, Skv]`` (Skv then the table's bound). A ragged block past its sequence's queries is empty
    (first Q row < 0 or >= Sq): the load warp skips it.
    place: ``(q box batch, q first row, kv box batch, kv first row, out's first token, lse's first element)``,
    where the sequence starts in the descriptors (``[B, S, ...]`` dense, ``[1, total, ...]`` ragged), in out
    (``[tokens, Hq, D]``) and in lse (``[B, Hq, Sq]`` dense, ``[Hq, total_q]`` ragged).
    At least one K/V tile, so that a block that sees no key still runs (and writes zeros)."""
    seqlen_q, seqlen_kv, shift, window_left, window_right = geometry
    cu_seqlens_q_ptr, cu_seqlens_k_ptr, seqlens_ptr, total_q, total_k = lens
    pid_bh = tile // num_m_blocks
    pid_m = tile % num_m_blocks
    batch = pid_bh // num_q_heads
    head = pid_bh % num_q_heads
    q_batch = batch
    kv_batch = batch
    q_row0 = batch * 0
    kv_row0 = batch * 0
    if RAGGED:
        q_row0, seqlen_q = _ragged_bounds(cu_seqlens_q_ptr, batch, total_q, NUM_WARPS)
        q_batch = batch * 0
        if not PAGED:
            kv_row0, seqlen_kv = _ragged_bounds(cu_seqlens_k_ptr, batch, total_k, NUM_WARPS)
            kv_batch = batch * 0
    if PAGED:
        seqlen_kv = gl.minimum(gl.maximum(gl.load(seqlens_ptr + batch), 0), seqlen_kv)
    shift = seqlen_kv - seqlen_q
    geometry = (seqlen_q, seqlen_kv, shift, window_left, window_right)
    if WINDOW:
        if RAGGED:  # this sequence's blocks (at most num_m_blocks), longest first; -1: past them, empty
            pid_m = gl.maximum(gl.minimum(gl.cdiv(seqlen_q, CONSUMERS * 64), num_m_blocks) - 1 - pid_m, -1)
        else:
            pid_m = num_m_blocks - 1 - pid_m
    if RAGGED:
        place = (q_batch, q_row0, kv_batch, kv_row0, q_row0, head.to(gl.int64) * total_q + q_row0)
    else:
        lse_base = (batch * num_q_heads + head).to(gl.int64) * seqlen_q
        place = (q_batch, q_row0, kv_batch, kv_row0, batch * seqlen_q, lse_base)
    q_start = pid_m * (CONSUMERS * 64)
    first_tile = q_start * 0
    end_tile = gl.maximum(gl.cdiv(seqlen_kv, TILE_N), 1)
    if WINDOW:  # keys some row of the block sees: [pos_first - left, pos_last + right]
        q_last = gl.minimum(q_start + CONSUMERS * 64, seqlen_q) - 1
        kv_lo = gl.maximum(q_start + shift - window_left, 0)
        kv_hi = gl.minimum(q_last + shift + window_right + 1, seqlen_kv)
        first_tile = gl.minimum(kv_lo // TILE_N, end_tile - 1)
        end_tile = gl.maximum(gl.cdiv(kv_hi, TILE_N), first_tile + 1)
    return batch, head, head // group_size, q_start, first_tile, end_tile - first_tile, geometry, place


@gluon.jit
def publish_tile(tile, count, schedule, NUM_WARPS: gl.constexpr):
    """The loading partition (``NUM_WARPS`` warps) hands work tile ``tile`` (its ``count``-th) to the consumers
    through a 2-slot ring."""
    tile_smem, tile_ready, tile_empty = schedule
    slot = count % 2
    mbarrier.wait(tile_empty.index(slot), ((count // 2) & 1) ^ 1)
    tile_smem.index(slot).store(gl.full([1], tile, gl.int32, layout=gl.BlockedLayout([1], [32], [NUM_WARPS], [0])))
    if NUM_WARPS > 1:
        partition_barrier()  # every warp's store is done before the arrive
    mbarrier.arrive(tile_ready.index(slot))


@gluon.jit
def _receive_tile(count, schedule):
    """A consumer's ``count``-th work tile, as the load warp published it (>= the tile count: no more work)."""
    tile_smem, tile_ready, tile_empty = schedule
    slot = count % 2
    mbarrier.wait(tile_ready.index(slot), (count // 2) & 1)
    tile = gl.max(tile_smem.index(slot).load(gl.BlockedLayout([1], [32], [4], [0])), axis=0)
    mbarrier.arrive(tile_empty.index(slot))
    return tile


@gluon.jit
def _load_kv_tile(desc, buffer, bar, batch, key, column, pages, PAGE_SIZE: gl.constexpr):
    """TMA loads of keys ``[key, key + TILE_N)`` of sequence ``batch``, columns ``[column, column + W)`` of a row
    (a KV head's ``column = kv_head * D``), into the ``[TILE_N, W]`` shared tile ``buffer``, arriving on ``bar``:
    one box (PAGE_SIZE 0: dense ``[B, S, H * D]``), or one per page the tile spans (a box of ``min(PAGE_SIZE,
    TILE_N)`` rows of ``[num_pages, PAGE_SIZE, H * D]``), the page found in the block table. Slots past the table
    and entries outside ``[0, num_pages)`` are clamped: a bad entry reads a wrong page of the cache, never memory
    outside it."""
    if PAGE_SIZE == 0:
        _tma_load(desc, [batch, key, column], bar, _as_box(buffer))
    else:
        BOX: gl.constexpr = desc.block_type.shape[1]
        for r in gl.static_range(buffer.shape[0] // BOX):
            box_key = key + r * BOX
            page = page_of(pages, batch, box_key, PAGE_SIZE)
            _tma_load(desc, [page, box_key % PAGE_SIZE, column], bar, _as_box(buffer).slice(r * BOX, BOX, dim=1))


@gluon.jit
def page_of(pages, batch, key, PAGE_SIZE: gl.constexpr):
    """The page holding key ``key`` of sequence ``batch``: its block-table entry, the slot clamped to the table
    and the entry to ``[0, num_pages)`` (a bad entry reads a wrong page of the cache, never memory outside it)."""
    block_table_ptr, stride_block_table, max_pages, num_pages = pages
    row_ptr = block_table_ptr + batch.to(gl.int64) * stride_block_table
    page = gl.load(row_ptr + gl.minimum(key // PAGE_SIZE, max_pages - 1))
    return gl.minimum(gl.maximum(page, 0), num_pages - 1)


@gluon.jit
def _zero_rows_from(buffer, first):
    """Zeroes the rows ``>= first`` of a ``[TILE_N, D]`` shared tile, from the load warp: ``[8, 64]`` chunks (the
    128-byte swizzle's atoms), so that its 24 registers hold one."""
    layout: gl.constexpr = _store_layout(64, 1)
    rows = gl.arange(0, 8, layout=gl.SliceLayout(1, layout))
    for c in gl.static_range(buffer.shape[0] // 8):
        if c * 8 + 8 > first:
            for d in gl.static_range(buffer.shape[1] // 64):
                chunk = buffer.slice(c * 8, 8, dim=0).slice(d * 64, 64, dim=1)
                values = chunk.load(layout)
                keep = gl.expand_dims(c * 8 + rows < first, 1)
                chunk.store(gl.where(keep, values, gl.zeros_like(values)))


@gluon.jit
def _load_partition(
    descs,
    smem,
    bars,
    v_landed,
    schedule,
    geometry,
    lens,
    pages,
    num_q_heads,
    group_size,
    num_m_blocks,
    num_work_tiles,
    tile_counter,
    WINDOW: gl.constexpr,
    RAGGED: gl.constexpr,
    PAGE_SIZE: gl.constexpr,
):
    """The load warp: for each work tile of this program (ragged blocks past their sequence skipped), publishes
    it, loads its Q tiles once the consumers released the last ones, then K_j and V_j for every key tile into the
    rings, once released. The next work tile comes from ``tile_counter`` (WINDOW: masked blocks differ in length,
    so the first program to ask gets the next one) or by striding the grid.

    Ragged or paged K/V: the rows of a sequence's last V tile past its keys hold the next sequence's values or
    whatever the pages do (NaN, say), which ``P V`` would multiply by P's zeros: that tile lands on ``v_landed``
    and is zeroed from there before ``v_ready`` is signalled. (K's rows need nothing: their scores are masked to
    -inf. Dense K/V need nothing: a per-sequence descriptor reads zeros there.)"""
    q_desc, k_desc, v_desc = descs
    q_smem, k_smem, v_smem = smem
    q_ready, q_empty, k_ready, k_empty, v_ready, v_empty = bars
    TILE_N: gl.constexpr = k_smem.shape[1]
    HEAD_DIM: gl.constexpr = k_smem.shape[2]
    STAGES: gl.constexpr = k_smem.shape[0]
    CONSUMERS: gl.constexpr = q_smem.shape[0]
    TILE_BYTES: gl.constexpr = TILE_N * HEAD_DIM * k_smem.dtype.primitive_bitwidth // 8
    ZERO_TAILS: gl.constexpr = RAGGED or PAGE_SIZE > 0
    tile = gl.program_id(0)
    count = 0
    loaded = 0  # K/V tiles loaded by this program so far: the rings' position
    zeroed = 0  # V tiles zeroed past their sequence's end so far: v_landed's phase
    while tile < num_work_tiles:
        batch, head, kv_head, q_start, first_tile, num_tiles, tile_geometry, place = _tile_block(
            tile,
            geometry,
            lens,
            num_q_heads,
            group_size,
            num_m_blocks,
            WINDOW,
            TILE_N,
            CONSUMERS,
            RAGGED,
            PAGE_SIZE > 0,
            1,
        )
        seqlen_q = tile_geometry[0]
        seqlen_kv = tile_geometry[1]
        q_batch, q_row0, kv_batch, kv_row0, _, _ = place
        if (q_start >= 0) & (q_start < seqlen_q):
            publish_tile(tile, count, schedule, 1)
            for c in gl.static_range(CONSUMERS):
                # Fresh mbarriers count as having completed the phase before 0: the first lap does not wait.
                mbarrier.wait(q_empty.index(c), (count & 1) ^ 1)
                mbarrier.expect(q_ready.index(c), q_desc.block_type.nbytes)
                _tma_load(
                    q_desc,
                    [q_batch, q_row0 + q_start + c * 64, head * HEAD_DIM],
                    q_ready.index(c),
                    _as_box(q_smem.index(c)),
                )
            for i in range(num_tiles):
                stage = (loaded + i) % STAGES
                phase = ((loaded + i) // STAGES) & 1
                key = (first_tile + i) * TILE_N
                mbarrier.wait(k_empty.index(stage), phase ^ 1)
                mbarrier.expect(k_ready.index(stage), TILE_BYTES)
                _load_kv_tile(
                    k_desc,
                    k_smem.index(stage),
                    k_ready.index(stage),
                    kv_batch,
                    kv_row0 + key,
                    kv_head * HEAD_DIM,
                    pages,
                    PAGE_SIZE,
                )
                mbarrier.wait(v_empty.index(stage), phase ^ 1)
                zero_tail = False
                if ZERO_TAILS:
                    zero_tail = key + TILE_N > seqlen_kv
                if zero_tail:
                    mbarrier.expect(v_landed.index(0), TILE_BYTES)
                    _load_kv_tile(
                        v_desc,
                        v_smem.index(stage),
                        v_landed.index(0),
                        kv_batch,
                        kv_row0 + key,
                        kv_head * HEAD_DIM,
                        pages,
                        PAGE_SIZE,
                    )
                    mbarrier.wait(v_landed.index(0), zeroed & 1)
                    _zero_rows_from(v_smem.index(stage), seqlen_kv - key)
                    fence_async_shared()  # the generic-proxy stores, before wgmma reads the tile
                    mbarrier.arrive(v_ready.index(stage))
                    zeroed += 1
                else:
                    mbarrier.expect(v_ready.index(stage), TILE_BYTES)
                    _load_kv_tile(
                        v_desc,
                        v_smem.index(stage),
                        v_ready.index(stage),
                        kv_batch,
                        kv_row0 + key,
                        kv_head * HEAD_DIM,
                        pages,
                        PAGE_SIZE,
                    )
            loaded += num_tiles
            count += 1
        if WINDOW:
            tile = gl.num_programs(0) + gl.atomic_add(tile_counter, 1)
        else:
            tile += gl.num_programs(0)
    publish_tile(num_work_tiles, count, schedule, 1)  # no more work


@gluon.jit
def _softmax_tile(s, m_i, l_i, j, rows, geometry, qk_scale, MASKED: gl.constexpr, WINDOW: gl.constexpr):
    """Online softmax of the raw scores ``s`` of tile ``j``: returns ``(p, m_new, l_new, alpha)``, with ``m``
    the running max of raw scores and ``alpha = exp2((m_i - m_new) * qk_scale)`` the factor for O."""
    seqlen_q, seqlen_kv, shift, window_left, window_right = geometry
    TILE_N: gl.constexpr = s.shape[1]
    if MASKED:
        cols = gl.expand_dims(j * TILE_N + gl.arange(0, TILE_N, layout=gl.SliceLayout(0, s.type.layout)), 0)
        valid = cols < seqlen_kv
        if WINDOW:  # int32 is enough: sides are <= 2**30 and |pos| < 2**30
            pos = gl.expand_dims(rows + shift, 1)
            valid = valid & (cols <= pos + window_right) & (cols >= pos - window_left)
        s = gl.where(valid, s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, axis=1))
    m_scaled = m_new * qk_scale
    if MASKED:  # a row that has seen no key yet: exp2(-inf - 0) = 0 for its alpha and p, not NaN
        m_scaled = gl.where(m_new == float("-inf"), 0.0, m_scaled)
    alpha = gl.exp2(m_i * qk_scale - m_scaled)
    p = gl.exp2(gl.fma(s, qk_scale, -gl.expand_dims(m_scaled, 1)))
    l_new = l_i * alpha + gl.sum(p, axis=1)
    return p, m_new, l_new, alpha


@gluon.jit
def consumer_bands(first_row, first_tile, end_tile, geometry, WINDOW: gl.constexpr, TILE_N: gl.constexpr):
    """``(my_end, band_lo, band_hi)`` of the consumer whose 64 query rows start at ``first_row``, in a block of key
    tiles ``[first_tile, end_tile)``: the tiles past ``my_end`` hold no key its rows see (the causal diagonal of the
    block's other rows: it only releases them); every row sees the tiles ``[band_lo, band_hi)`` whole (no mask).
    Tile ``first_tile`` is always masked (``band_lo > first_tile``)."""
    seqlen_q, seqlen_kv, shift, window_left, window_right = geometry
    if WINDOW:
        last_row = gl.minimum(first_row + 64, seqlen_q) - 1
        full_lo = gl.maximum(last_row + shift - window_left, 0)
        full_hi = gl.minimum(first_row + shift + window_right + 1, seqlen_kv)
        seen_hi = gl.minimum(last_row + shift + window_right + 1, seqlen_kv)
        my_end = gl.minimum(gl.maximum(gl.cdiv(seen_hi, TILE_N), first_tile + 1), end_tile)
    else:
        full_lo = first_row * 0
        full_hi = seqlen_kv
        my_end = end_tile
    band_lo = gl.minimum(gl.maximum(gl.cdiv(full_lo, TILE_N), first_tile + 1), my_end)
    band_hi = gl.maximum(gl.minimum(gl.maximum(full_hi, 0) // TILE_N, my_end), band_lo)
    return my_end, band_lo, band_hi


@gluon.jit
def fold_sink(acc, l_i, m_log2, sinks_ptr, head):
    """Q head ``head``'s attention sink (``sinks[head]``, float32, a logit) joins the rows' softmax denominator.
    ``m_log2``: the rows' max in log2 units (-inf for a row that saw no key), ``acc`` ``[64, D]`` and ``l_i``
    relative to it; returns ``(acc, l, m)`` relative to ``max(m, sink * log2 e)``. As the portable kernel
    (:func:`kernel.store_q_tile`): a row that saw no key gets O = 0 and LSE = the sink, a sink of +inf takes all the
    weight (O = 0, LSE = +inf), -inf is no sink, NaN gives NaN."""
    sink = gl.load(sinks_ptr + head) * 1.4426950408889634  # log2(e)
    final = gl.maximum(m_log2, sink)
    final = gl.where(final == float("-inf"), 0.0, final)
    alpha = gl.exp2(m_log2 - final)
    # a sink at the max adds exactly 1, also a sink of +inf (where inf - inf would be NaN)
    l_i = l_i * alpha + gl.exp2(gl.where(sink == final, 0.0, sink - final))
    acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, acc.type.layout)), 1)
    return acc, l_i, final


@gluon.jit
def store_rows(out_ptr, out, out_token0, first_row, seqlen_q, num_q_heads, head):
    """Stores a consumer's fp32 output rows ``out`` ``[64, D]`` (rows ``first_row + i`` of the sequence whose first
    token is ``out_token0``, head ``head``) into ``[tokens, Hq, D]`` ``out_ptr`` in its dtype, rows past
    ``seqlen_q`` left alone: 16-byte vectors per thread."""
    HEAD_DIM: gl.constexpr = out.shape[1]
    store_layout: gl.constexpr = _store_layout(HEAD_DIM, 4)
    out = gl.convert_layout(out.to(out_ptr.dtype.element_ty), store_layout)
    out_rows = first_row + gl.arange(0, 64, layout=gl.SliceLayout(1, store_layout))
    out_cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, store_layout))
    # int64: B * Sq * Hq * D can exceed 2**31 elements.
    row_offsets = ((out_token0 + out_rows).to(gl.int64) * num_q_heads + head) * HEAD_DIM
    offsets = gl.expand_dims(row_offsets, 1) + gl.expand_dims(out_cols, 0)
    gl.store(out_ptr + offsets, out, mask=gl.expand_dims(out_rows < seqlen_q, 1))


@gluon.jit
def _consumer_step(
    i, j, q, smem, bars, p, m_i, l_i, acc, rows, s_zero, geometry, qk_scale, MASKED: gl.constexpr, WINDOW: gl.constexpr
):
    """Ring position i (the block's tiles follow the program's earlier blocks' tiles; key tile j): issue
    ``S_j = Q K_j^T`` and ``O += P_{j-1} V_{j-1}``, run the softmax of ``S_j`` once the first is done, then rescale
    O. Returns ``(p_j, m, l, acc)``."""
    q_smem, k_smem, v_smem = smem
    q_ready, q_empty, k_ready, k_empty, v_ready, v_empty = bars
    STAGES: gl.constexpr = k_smem.shape[0]
    stage = i % STAGES
    prev = (i - 1) % STAGES
    mbarrier.wait(k_ready.index(stage), (i // STAGES) & 1)
    s = warpgroup_mma(q, k_smem.index(stage).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    mbarrier.wait(v_ready.index(prev), ((i - 1) // STAGES) & 1)
    acc = warpgroup_mma(p, v_smem.index(prev), acc, is_async=True)
    s = warpgroup_mma_wait(num_outstanding=1, deps=(s,))
    mbarrier.arrive(k_empty.index(stage))
    p_new, m_i, l_i, alpha = _softmax_tile(s, m_i, l_i, j, rows, geometry, qk_scale, MASKED, WINDOW)
    p_new = gl.convert_layout(p_new.to(p.dtype), p.type.layout)
    # The softmax's results pass through the wait, so that LLVM keeps them before it (ptxas still hoists the
    # wait above most of the exponentials: lab/NOTES.md).
    acc, p_new, l_i, alpha = warpgroup_mma_wait(num_outstanding=0, deps=(acc, p_new, l_i, alpha))
    mbarrier.arrive(v_empty.index(prev))
    acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, acc.type.layout)), 1)
    return p_new, m_i, l_i, acc


@gluon.jit
def _consumer_block(
    tile,
    count,
    base,
    smem,
    bars,
    out_ptr,
    lse_and_sinks,
    geometry,
    lens,
    num_q_heads,
    group_size,
    num_m_blocks,
    qk_scale,
    CONSUMER: gl.constexpr,
    WINDOW: gl.constexpr,
    RETURN_LSE: gl.constexpr,
    HAS_SINKS: gl.constexpr,
    RAGGED: gl.constexpr,
    PAGED: gl.constexpr,
):
    """One consumer warpgroup on work tile ``tile`` (this program's ``count``-th, its K/V tiles from ring position
    ``base``): the block's Q rows ``[64 * CONSUMER, 64 * CONSUMER + 64)`` against its K/V tiles. Returns the number
    of K/V tiles it used."""
    q_smem, k_smem, v_smem = smem
    q_ready, q_empty, k_ready, k_empty, v_ready, v_empty = bars
    TILE_N: gl.constexpr = k_smem.shape[1]
    HEAD_DIM: gl.constexpr = k_smem.shape[2]
    STAGES: gl.constexpr = k_smem.shape[0]
    dtype: gl.constexpr = q_smem.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, TILE_N, 16]
    )
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_DIM, 16]
    )
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)

    batch, head, kv_head, q_start, first_tile, num_tiles, geometry, place = _tile_block(
        tile, geometry, lens, num_q_heads, group_size, num_m_blocks, WINDOW, TILE_N, q_smem.shape[0], RAGGED, PAGED, 4
    )
    seqlen_q, seqlen_kv, shift, window_left, window_right = geometry
    out_token0 = place[4]
    lse_base = place[5]
    first_row = q_start + CONSUMER * 64
    rows = first_row + gl.arange(0, 64, layout=row_layout)
    end_tile = first_tile + num_tiles
    # The block's tiles past [first_tile, my_end) hold no key this consumer's rows see (the causal diagonal of a
    # 192-row block): it only releases them. The tiles every row of this consumer sees whole, [band_lo, band_hi),
    # skip the mask; tile first_tile (run alone below) always takes it.
    my_end, band_lo, band_hi = consumer_bands(first_row, first_tile, end_tile, geometry, WINDOW, TILE_N)
    # ring position of key tile j: base + j - first_tile
    offset = base - first_tile

    q = q_smem.index(CONSUMER)
    mbarrier.wait(q_ready.index(CONSUMER), count & 1)
    s_zero = gl.zeros([64, TILE_N], gl.float32, layout=s_layout)
    acc = gl.zeros([64, HEAD_DIM], gl.float32, layout=o_layout)

    # The first tile alone: S and its softmax.
    mbarrier.wait(k_ready.index(base % STAGES), (base // STAGES) & 1)
    s = warpgroup_mma(q, k_smem.index(base % STAGES).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
    mbarrier.arrive(k_empty.index(base % STAGES))
    m_i = gl.full([64], float("-inf"), gl.float32, layout=row_layout)
    l_i = gl.full([64], 0.0, gl.float32, layout=row_layout)
    p, m_i, l_i, alpha = _softmax_tile(s, m_i, l_i, first_tile, rows, geometry, qk_scale, True, WINDOW)
    p = gl.convert_layout(p.to(dtype), p_layout)

    for j in range(first_tile + 1, band_lo):
        p, m_i, l_i, acc = _consumer_step(
            offset + j, j, q, smem, bars, p, m_i, l_i, acc, rows, s_zero, geometry, qk_scale, True, WINDOW
        )
    for j in range(band_lo, band_hi):
        p, m_i, l_i, acc = _consumer_step(
            offset + j, j, q, smem, bars, p, m_i, l_i, acc, rows, s_zero, geometry, qk_scale, False, WINDOW
        )
    for j in range(band_hi, my_end):
        p, m_i, l_i, acc = _consumer_step(
            offset + j, j, q, smem, bars, p, m_i, l_i, acc, rows, s_zero, geometry, qk_scale, True, WINDOW
        )
    mbarrier.arrive(q_empty.index(CONSUMER))  # every S of the block is done: the next block's Q may land

    # The last tile's P V.
    last = offset + my_end - 1
    mbarrier.wait(v_ready.index(last % STAGES), (last // STAGES) & 1)
    acc = warpgroup_mma(p, v_smem.index(last % STAGES), acc, is_async=True)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    mbarrier.arrive(v_empty.index(last % STAGES))
    # Tiles this consumer does not see, released once landed (an early arrive would count towards the phase
    # of the tile two before); after the last P V, whose release the load of the second of them waits for.
    for j in range(my_end, end_tile):
        position = offset + j
        mbarrier.wait(k_ready.index(position % STAGES), (position // STAGES) & 1)
        mbarrier.arrive(k_empty.index(position % STAGES))
        mbarrier.wait(v_ready.index(position % STAGES), (position // STAGES) & 1)
        mbarrier.arrive(v_empty.index(position % STAGES))

    lse_ptr, sinks_ptr = lse_and_sinks
    m_log2 = m_i * qk_scale  # acc and l_i are relative to 2^m_log2
    if HAS_SINKS:
        acc, l_i, m_log2 = fold_sink(acc, l_i, m_log2, sinks_ptr, head)
    if RETURN_LSE:  # natural log, [B, Hq, Sq] ([Hq, total_q] ragged) contiguous; -inf for a row that saw no key
        lse = (m_log2 + gl.log2(l_i)) * LN2
        gl.store(lse_ptr + lse_base + rows, lse, mask=rows < seqlen_q)
    l_safe = gl.where(l_i == 0.0, 1.0, l_i)  # a row that saw no key (and no sink): output 0
    out = acc / gl.expand_dims(gl.convert_layout(l_safe, gl.SliceLayout(1, o_layout)), 1)
    store_rows(out_ptr, out, out_token0, first_row, seqlen_q, num_q_heads, head)
    return num_tiles


@gluon.jit
def _consumer_partition(
    smem,
    bars,
    schedule,
    out_ptr,
    lse_and_sinks,
    geometry,
    lens,
    num_q_heads,
    group_size,
    num_m_blocks,
    num_work_tiles,
    qk_scale,
    CONSUMER: gl.constexpr,
    WINDOW: gl.constexpr,
    RETURN_LSE: gl.constexpr,
    HAS_SINKS: gl.constexpr,
    RAGGED: gl.constexpr,
    PAGED: gl.constexpr,
):
    """One consumer warpgroup: every work tile the load warp hands this program, in turn."""
    count = 0
    base = 0
    tile = _receive_tile(count, schedule)
    while tile < num_work_tiles:
        base += _consumer_block(
            tile,
            count,
            base,
            smem,
            bars,
            out_ptr,
            lse_and_sinks,
            geometry,
            lens,
            num_q_heads,
            group_size,
            num_m_blocks,
            qk_scale,
            CONSUMER,
            WINDOW,
            RETURN_LSE,
            HAS_SINKS,
            RAGGED,
            PAGED,
        )
        count += 1
        tile = _receive_tile(count, schedule)


@gluon.jit
def _attention_fwd_kernel(
    q_desc,
    k_desc,
    v_desc,
    out_ptr,
    lse_ptr,
    sinks_ptr,
    tile_counter,
    cu_seqlens_q_ptr,
    cu_seqlens_k_ptr,
    total_q,
    total_k,
    block_table_ptr,
    seqlens_ptr,
    stride_block_table,
    max_pages,
    num_pages,
    seqlen_q,
    seqlen_kv,
    window_left,
    window_right,
    num_q_heads,
    group_size,
    num_m_blocks,
    num_work_tiles,
    qk_scale,
    WINDOW: gl.constexpr,
    RETURN_LSE: gl.constexpr,
    HAS_SINKS: gl.constexpr,
    CONSUMERS: gl.constexpr,
    TILE_N: gl.constexpr,
    RAGGED: gl.constexpr,
    PAGE_SIZE: gl.constexpr,
    Q_LAYOUT: gl.constexpr,
    KV_LAYOUT: gl.constexpr,
):
    """Persistent: each program runs work tiles (a Q block of ``CONSUMERS`` x 64 rows of one (batch, q head))
    until none is left.

    q_desc: TMA descriptor over q viewed as ``[B, Sq, Hq * D]`` (16-bit floats), block ``[1, 64, D]``.
    k_desc, v_desc: over k / v viewed as ``[B, Skv, Hkv * D]``, block ``[1, TILE_N, D]`` (TILE_N: 128 keys, 64 at
    D = 256); paged (PAGE_SIZE > 0): over the pages ``[num_pages, PAGE_SIZE, Hkv * D]``, block
    ``[1, min(PAGE_SIZE, TILE_N), D]``, sequence b's key i in page ``block_table[b, i // PAGE_SIZE]``
    (``block_table_ptr``: int32, rows ``stride_block_table`` apart, ``max_pages`` per row) with ``seqlens[b]``
    keys (int32, clamped to ``[0, seqlen_kv]``; ``seqlen_kv`` is then ``max_pages * PAGE_SIZE``).
    RAGGED: q ``[total_q, Hq, D]`` (descriptor over ``[1, total_q, Hq * D]``), sequence b's rows from int32
    ``cu_seqlens_q`` ``[B + 1]``, and unless paged k / v ``[total_k, Hkv, D]`` likewise from ``cu_seqlens_k``
    (read clamped: :func:`_ragged_bounds`); ``seqlen_q`` (and ``seqlen_kv``) are then host bounds on one
    sequence's queries (keys): ``num_m_blocks = cdiv(seqlen_q, CONSUMERS * 64)`` blocks per (sequence, head).
    out_ptr: ``[B, Sq, Hq, D]`` (ragged ``[total_q, Hq, D]``) in q's dtype, contiguous. lse_ptr: float32
    ``[B, Hq, Sq]`` (ragged ``[Hq, total_q]``) (RETURN_LSE). sinks_ptr: float32 ``[Hq]`` contiguous, each q head's
    attention-sink logit, which joins the softmax's denominator (HAS_SINKS: :func:`fold_sink`).
    tile_counter: int32 ``[1]`` zero (WINDOW: work tiles are handed out in order as programs ask for them, since
    masked blocks differ in length; otherwise program p runs tiles p, p + grid, ...).
    WINDOW: query i sees keys ``i + Skv - Sq - window_left <= j <= i + Skv - Sq + window_right`` (bottom-right
    aligned; sides in ``[0, 2**30]``, 2**30 unbounded; causal is ``(2**30, 0)``); otherwise every key.
    group_size: Hq // Hkv. num_m_blocks: ``cdiv(Sq, CONSUMERS * 64)``; num_work_tiles: ``num_m_blocks * B * Hq``.
    qk_scale: ``softmax_scale * log2(e)`` (> 0).
    Q_LAYOUT, KV_LAYOUT: the shared layouts of the ``[64, D]`` and ``[TILE_N, D]`` tiles.
    CONSUMERS: 2 or 3 consumer warpgroups (launched with ``maxnreg`` 168 or 128: 240 or 160 registers each).
    Grid: ``(min(num_work_tiles, SMs),)``; ``num_warps=4`` (the default partition, consumer 0).
    """
    HEAD_DIM: gl.constexpr = q_desc.block_type.shape[2]
    dtype: gl.constexpr = q_desc.dtype
    STAGES: gl.constexpr = 2  # a third stage measured no faster at D = 64 and does not fit larger D
    q_smem = gl.allocate_shared_memory(dtype, [CONSUMERS, 64, HEAD_DIM], Q_LAYOUT)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, TILE_N, HEAD_DIM], KV_LAYOUT)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, TILE_N, HEAD_DIM], KV_LAYOUT)
    tile_smem = gl.allocate_shared_memory(gl.int32, [2, 1], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    q_ready = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_landed = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    tile_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    tile_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(CONSUMERS):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(q_empty.index(i), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=CONSUMERS)  # every consumer releases a tile
        mbarrier.init(v_empty.index(i), count=CONSUMERS)
    mbarrier.init(v_landed.index(0), count=1)
    for i in gl.static_range(2):
        mbarrier.init(tile_ready.index(i), count=1)
        mbarrier.init(tile_empty.index(i), count=CONSUMERS)
    smem = (q_smem, k_smem, v_smem)
    bars = (q_ready, q_empty, k_ready, k_empty, v_ready, v_empty)
    schedule = (tile_smem, tile_ready, tile_empty)
    geometry = (seqlen_q, seqlen_kv, seqlen_kv - seqlen_q, window_left, window_right)
    pages = (block_table_ptr, stride_block_table, max_pages, num_pages)
    lens = (cu_seqlens_q_ptr, cu_seqlens_k_ptr, seqlens_ptr, total_q, total_k)
    PAGED: gl.constexpr = PAGE_SIZE > 0
    if CONSUMERS == 3:
        gl.warp_specialize(
            [
                (
                    _consumer_partition,
                    (
                        smem,
                        bars,
                        schedule,
                        out_ptr,
                        (lse_ptr, sinks_ptr),
                        geometry,
                        lens,
                        num_q_heads,
                        group_size,
                        num_m_blocks,
                        num_work_tiles,
                        qk_scale,
                        0,
                        WINDOW,
                        RETURN_LSE,
                        HAS_SINKS,
                        RAGGED,
                        PAGED,
                    ),
                ),
                (
                    _consumer_partition,
                    (
                        smem,
                        bars,
                        schedule,
                        out_ptr,
                        (lse_ptr, sinks_ptr),
                        geometry,
                        lens,
                        num_q_heads,
                        group_size,
                        num_m_blocks,
                        num_work_tiles,
                        qk_scale,
                        1,
                        WINDOW,
                        RETURN_LSE,
                        HAS_SINKS,
                        RAGGED,
                        PAGED,
                    ),
                ),
                (
                    _consumer_partition,
                    (
                        smem,
                        bars,
                        schedule,
                        out_ptr,
                        (lse_ptr, sinks_ptr),
                        geometry,
                        lens,
                        num_q_heads,
                        group_size,
                        num_m_blocks,
                        num_work_tiles,
                        qk_scale,
                        2,
                        WINDOW,
                        RETURN_LSE,
                        HAS_SINKS,
                        RAGGED,
                        PAGED,
                    ),
                ),
                (
                    _load_partition,
                    (
                        (q_desc, k_desc, v_desc),
                        smem,
                        bars,
                        v_landed,
                        schedule,
                        geometry,
                        lens,
                        pages,
                        num_q_heads,
                        group_size,
                        num_m_blocks,
                        num_work_tiles,
                        tile_counter,
                        WINDOW,
                        RAGGED,
                        PAGE_SIZE,
                    ),
                ),
            ],
            [4, 4, 1],
            [CONSUMER_REGS_3, CONSUMER_REGS_3, LOADER_REGS],
        )
    else:
        gl.warp_specialize(
            [
                (
                    _consumer_partition,
                    (
                        smem,
                        bars,
                        schedule,
                        out_ptr,
                        (lse_ptr, sinks_ptr),
                        geometry,
                        lens,
                        num_q_heads,
                        group_size,
                        num_m_blocks,
                        num_work_tiles,
                        qk_scale,
                        0,
                        WINDOW,
                        RETURN_LSE,
                        HAS_SINKS,
                        RAGGED,
                        PAGED,
                    ),
                ),
                (
                    _consumer_partition,
                    (
                        smem,
                        bars,
                        schedule,
                        out_ptr,
                        (lse_ptr, sinks_ptr),
                        geometry,
                        lens,
                        num_q_heads,
                        group_size,
                        num_m_blocks,
                        num_work_tiles,
                        qk_scale,
                        1,
                        WINDOW,
                        RETURN_LSE,
                        HAS_SINKS,
                        RAGGED,
                        PAGED,
                    ),
                ),
                (
                    _load_partition,
                    (
                        (q_desc, k_desc, v_desc),
                        smem,
                        bars,
                        v_landed,
                        schedule,
                        geometry,
                        lens,
                        pages,
                        num_q_heads,
                        group_size,
                        num_m_blocks,
                        num_work_tiles,
                        tile_counter,
                        WINDOW,
                        RAGGED,
                        PAGE_SIZE,
                    ),
                ),
            ],
            [4, 1],
            [CONSUMER_REGS, LOADER_REGS],
        )


def _nvmma_layout(block_shape, dtype=gl.bfloat16):
    return gl.NVMMASharedLayout.get_default_for(block_shape, dtype)


def descriptor_type(dtype: torch.dtype, block) -> str:
    """The Triton type of a tensor descriptor argument with this block (for an ahead-of-time compile)."""
    layout = _nvmma_layout(block, TILE_DTYPES[dtype])
    return f"tensordesc<{TYPE_NAMES[dtype]}[{', '.join(map(str, block))}],{layout!r}>"


def as_tma_ready(t: torch.Tensor) -> torch.Tensor:
    """``t``, or a contiguous copy in fresh (aligned) memory when TMA cannot read it in place: the kernel then
    sees the same values in the same order, so any view gives the bits of the contiguous call."""
    return t if tma_ready(t) else t.clone(memory_format=torch.contiguous_format)


def _work_tiles(batch: int, max_seqlen_q: int, num_q_heads: int) -> int:
    return triton.cdiv(max_seqlen_q, 2 * CONSUMER_ROWS) * batch * num_q_heads


def _fits(head_dim: int, work_tiles: int, softmax_scale: float, device: torch.device) -> bool:
    """What every layout asks beyond :func:`llmkernels.attention.check.check_attention`'s rules: an sm_90 GPU,
    ``D`` in {64, 128, 256}, at most 2**31 - 2**20 Q blocks of 128 rows (``work_tiles``) and a positive scale."""
    return (
        head_dim in HEAD_DIMS
        and work_tiles <= MAX_WORK_TILES
        and softmax_scale > 0
        and attention_config.runs_gluon(device)
    )


def gluon_eligible(call: CheckedCall, config: FA4Config) -> bool:
    """What both Gluon backends ask of a call: a config with ``warp_specialized``, an sm_90 GPU
    (:func:`config.runs_gluon`), and no key starts, chunked mask, mask_mod, mask tensor or score_mod."""
    spec = call.mask_spec
    return (
        config.warp_specialized
        and not call.kv_starts
        and not spec.has_chunk
        and spec.mask_mod is None
        and call.mask_kind == "none"
        and call.mod_spec.kind == SCORE_MOD_NONE
        and attention_config.runs_gluon(call.device)
    )


def _tensors_fit(q: torch.Tensor, kv: torch.Tensor, softmax_scale: float, work_tiles: int) -> bool:
    """:func:`_fits` for tensors: fp16/bf16 ``[B, Sq, Hq, D]`` q and 4-D keys/values ``kv`` of q's dtype and head
    dim, ``Hq`` a multiple of ``Hkv``."""
    if q.dtype not in DTYPES or kv.dtype != q.dtype or q.dim() != 4 or kv.dim() != 4 or kv.shape[3] != q.shape[3]:
        return False
    num_q_heads, num_kv_heads = q.shape[2], kv.shape[2]
    return (
        num_kv_heads >= 1 and num_q_heads % num_kv_heads == 0 and _fits(q.shape[3], work_tiles, softmax_scale, q.device)
    )


def supports(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float) -> bool:
    """Whether :func:`gluon_attention` runs this dense call: an sm_90 GPU, fp16/bf16 ``[B, S, H, D]`` q, k, v of
    one dtype with D in {64, 128, 256}, at least one key, fewer than 2**31 - 2**20 Q blocks of 128 rows
    (``cdiv(Sq, 128) * B * Hq``) and a positive scale (any strides: layouts TMA cannot read are copied)."""
    return (
        q.dim() == 4
        and _tensors_fit(q, k, softmax_scale, _work_tiles(q.shape[0], q.shape[1], q.shape[2]))
        and v.shape == k.shape
        and v.dtype == k.dtype
        and k.shape[0] == q.shape[0]
        and k.shape[1] >= 1
    )


def supports_paged(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, softmax_scale: float) -> bool:
    """Whether :func:`llmkernels.attention` may run dense ``q [B, Sq, Hq, D]`` over a paged cache on this kernel:
    what :func:`supports` asks of dtypes, heads and scale, and pages ``[num_pages, page_size, Hkv, D]`` (at least
    one) that TMA reads in place (:func:`tma_ready`: the cache is never copied)."""
    return (
        q.dim() == 4
        and _tensors_fit(q, k_pages, softmax_scale, _work_tiles(q.shape[0], q.shape[1], q.shape[2]))
        and v_pages.shape == k_pages.shape
        and v_pages.dtype == k_pages.dtype
        and k_pages.shape[0] >= 1
        and tma_ready(k_pages)
        and tma_ready(v_pages)
    )


def _descriptor(t: torch.Tensor, block_rows: int, block_cols: int | None = None) -> TensorDescriptor:
    """Per sequence ``[B, S, H * D]`` with t's own batch and token strides: a box past S is zero-filled, never
    the next sequence's rows. Boxes of ``block_rows`` tokens by ``block_cols`` elements (default: one head)."""
    batch, seqlen, heads, head_dim = t.shape
    shape = [batch, seqlen, heads * head_dim]
    block = [1, block_rows, block_cols or head_dim]
    layout = _nvmma_layout(block, TILE_DTYPES[t.dtype])
    return TensorDescriptor(t, shape, [t.stride(0), t.stride(1), 1], block, layout)


def sequence_rows(t: torch.Tensor) -> tuple:
    """``(t, shape, strides)`` of :func:`_descriptor` on ``t``: a descriptor slot whose shape varies per call."""
    batch, seqlen, heads, head_dim = t.shape
    return t, (batch, seqlen, heads * head_dim), (t.stride(0), t.stride(1), 1)


class GluonPrefill:
    """The warp-specialized prefill kernel (one pass): dense or ragged q and k/v, or a paged cache without key
    starts; no mask but causal / a sliding window, sinks or not, no score_mod or mask tensor; D 64, 128 or 256."""

    name = "gluon_prefill"
    kernel = _attention_fwd_kernel

    def supports(self, call: CheckedCall, tiles: Tiling) -> bool:
        """A config with ``warp_specialized`` (sm_90's default) on an sm_90 GPU (not the interpreter), one pass,
        :func:`gluon_eligible`, what :func:`_fits` asks, at least one key row (or page), and pages TMA
        reads in place (q, k, v in other layouts are copied); no FP8 input (this kernel reads 16-bit tiles only)."""
        return (
            not tiles.split
            and not call.fp8
            and gluon_eligible(call, tiles.config)
            and call.kv_rows >= 1
            and _fits(
                call.head_dim, _work_tiles(call.batch, call.q_bound, call.num_q_heads), call.softmax_scale, call.device
            )
            and (not call.paged or (call.tma_ready[1] and call.tma_ready[2]))
        )

    def consumers(self, call: CheckedCall, tiles: Tiling) -> int:
        return tiles.config.consumer_warpgroups or attention_config.gluon_prefill_consumers(
            call.head_dim, call.q_bound, call.mask_spec.has_window
        )

    def spec(self, call: CheckedCall, tiles: Tiling) -> KernelSpec:
        head_dim, dtype, paged, ragged = call.head_dim, call.dtype, call.paged, call.ragged
        window, consumers = call.mask_spec.has_window, self.consumers(call, tiles)
        block_n = attention_config.gluon_prefill_block_n(head_dim)
        box = min(call.page_size, block_n) if paged else block_n
        num_work_tiles = triton.cdiv(call.q_bound, consumers * CONSUMER_ROWS) * call.batch * call.num_q_heads
        constexprs = dict(
            WINDOW=window,
            RETURN_LSE=call.return_lse,
            HAS_SINKS=call.has_sinks,
            CONSUMERS=consumers,
            TILE_N=block_n,
            RAGGED=ragged,
            PAGE_SIZE=call.page_size if paged else 0,
            Q_LAYOUT=_nvmma_layout([CONSUMER_ROWS, head_dim], DTYPES[dtype]),
            KV_LAYOUT=_nvmma_layout([block_n, head_dim], DTYPES[dtype]),
        )
        data = "*" + TYPE_NAMES[dtype]
        unused = data  # the pointers a variant never reads are bound to out
        kv_type = descriptor_type(dtype, [1, box, head_dim])
        arg_types = dict(
            q_desc=descriptor_type(dtype, [1, CONSUMER_ROWS, head_dim]),
            k_desc=kv_type,
            v_desc=kv_type,
            out_ptr=data,
            lse_ptr="*fp32",
            sinks_ptr="*fp32" if call.has_sinks else unused,
            qk_scale="fp32",
            tile_counter="*i32" if window else unused,
            block_table_ptr="*i32" if paged else unused,
            seqlens_ptr="*i32" if paged else unused,
            cu_seqlens_q_ptr="*i32" if ragged else unused,
            cu_seqlens_k_ptr="*i32" if ragged and not paged else unused,
        )
        return KernelSpec(
            self.kernel,
            (min(num_work_tiles, num_programs_hint(call.device)),),
            constexprs,
            dict(num_warps=4, maxnreg=attention_config.GLUON_PREFILL_MAX_REGS[consumers]),
            arg_types,
            per_call=("seqlen_kv",) if call.dynamic_kv else (),
            divisible=("out_ptr",),
        )

    def launch(self, call: CheckedCall, tiles: Tiling) -> GluonPrefillLaunch:
        return GluonPrefillLaunch(call, self.spec(call, tiles))


BACKEND = GluonPrefill()


def launch_operands(q, k, v, kv_cache, cu_seqlens_q, cu_seqlens_k, copies, ragged: bool, paged: bool, unread):
    """What both Gluon prefills launch on: ``(q, k, v, cu_q, cu_k, block_table, seqlens)`` with a paged cache's
    pages as k / v and its metadata, the tensors TMA cannot read (``copies``) copied, ragged q (and k / v unless
    paged) as one ``[1, total, H, D]`` sequence; ``unread`` stands for the pointers a variant never reads."""
    block_table = seqlens = cu_q = cu_k = unread
    if paged:
        k, v = kv_cache.k_pages, kv_cache.v_pages
        block_table, seqlens = paged_metadata(kv_cache)
    if any(copies):  # the same values in a layout TMA reads: the contiguous call's bits
        q, k, v = (as_tma_ready(t) if copy else t for t, copy in zip((q, k, v), copies))
    if ragged:
        cu_q, q = cu_seqlens_q.contiguous(), q.unsqueeze(0)
        if not paged:
            cu_k, k, v = cu_seqlens_k.contiguous(), k.unsqueeze(0), v.unsqueeze(0)
    return q, k, v, cu_q, cu_k, block_table, seqlens


def kv_extents(q, k, block_table, ragged: bool, paged: bool, page_size: int) -> tuple:
    """``(total_q, total_k, stride_block_table, max_pages, num_pages, seqlen_kv)``: the scalars a Gluon prefill
    takes for :func:`launch_operands`' tensors (0 where a variant does not read them; ``seqlen_kv`` the dense or
    ragged K/V rows, or a paged table's ``max_pages * page_size``)."""
    total_q = total_k = stride_block_table = max_pages = num_pages = 0
    seqlen_kv = k.shape[1]
    if ragged:
        total_q = q.shape[1]
        if not paged:
            total_k = seqlen_kv = k.shape[1]
    if paged:
        num_pages = k.shape[0]
        max_pages, stride_block_table = block_table.shape[1], block_table.stride(0)
        seqlen_kv = max_pages * page_size
    return total_q, total_k, stride_block_table, max_pages, num_pages, seqlen_kv


class GluonPrefillLaunch:
    """The prefill kernel's launch for one plan: q, k, v TMA cannot read copied, the descriptors laid out, tile
    counters of its own per stream for masked calls, bound at the first call."""

    def __init__(self, call: CheckedCall, spec: KernelSpec):
        self.spec, self.bound = spec, None
        self.ragged, self.paged, self.dynamic = call.ragged, call.paged, call.dynamic_kv
        self.copies = tuple(not ready for ready in call.tma_ready)
        self.window = spec.constexprs["WINDOW"]
        mask = call.mask_spec
        self.sides = (mask.window_left, mask.window_right) if mask.has_window else (UNBOUNDED, UNBOUNDED)
        self.call, self.counters, self.lock = call, {}, threading.Lock()

    def __call__(
        self, q, k, v, kv_cache, cu_seqlens_q, cu_seqlens_k, sinks, slopes, attn_mask, out, lse, o_partial, lse_partial
    ) -> None:
        q, k, v, cu_q, cu_k, block_table, seqlens = launch_operands(
            q, k, v, kv_cache, cu_seqlens_q, cu_seqlens_k, self.copies, self.ragged, self.paged, out
        )
        k_desc, v_desc = (sequence_rows(k), sequence_rows(v)) if self.dynamic else (k, v)
        sinks = out if sinks is None else sinks.contiguous()  # float32 [Hq]
        values = (q, k_desc, v_desc, out, lse if lse is not None else out, sinks, out, cu_q, cu_k, block_table, seqlens)
        if self.dynamic:
            values = (*values, k.shape[1])
        if not self.window:
            (self.bound or self._bind(values, k, v))(*values)
            return
        with self.lock:
            values = (*values[:6], take_tile_counter(self.counters, out.device), *values[7:])
            (self.bound or self._bind(values, k, v))(*values)

    def _bind(self, values, k, v) -> BoundKernel:
        q, _, _, out, lse, sinks, counter, cu_q, cu_k, block_table, seqlens = values[:11]
        call, spec = self.call, self.spec
        block_n, page_size = spec.constexprs["TILE_N"], spec.constexprs["PAGE_SIZE"]
        box = min(page_size, block_n) if self.paged else block_n
        total_q, total_k, stride_block_table, max_pages, num_pages, seqlen_kv = kv_extents(
            q, k, block_table, self.ragged, self.paged, page_size
        )
        consumers = spec.constexprs["CONSUMERS"]
        num_m_blocks = triton.cdiv(call.q_bound, consumers * CONSUMER_ROWS)
        left, right = self.sides
        self.bound = spec.bind(
            _descriptor(q, CONSUMER_ROWS),
            _descriptor(k, box),
            _descriptor(v, box),
            out,
            lse,
            sinks,
            counter,
            cu_q,
            cu_k,
            total_q,
            total_k,
            block_table,
            seqlens,
            stride_block_table,
            max_pages,
            num_pages,
            call.q_bound,
            seqlen_kv,
            left,
            right,
            call.num_q_heads,
            call.group,
            num_m_blocks,
            num_m_blocks * call.batch * call.num_q_heads,
            float(call.softmax_scale) * LOG2E,
        )
        return self.bound


def gluon_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = False,
    softmax_scale: float | None = None,
    *,
    window: tuple[int, int] | None = None,
    return_lse: bool = False,
    consumers: int | None = None,
):
    """Attention forward ``softmax(scale * q k^T) v`` on an sm_90 GPU, warp-specialized (the kernel alone:
    :func:`llmkernels.attention` is the public entry, which takes this path when it can).

    q: fp16/bf16 ``[B, Sq, Hq, D]``; k, v: ``[B, Skv, Hkv, D]`` of q's dtype; ``D`` in {64, 128, 256}, ``Hq`` a
    multiple of ``Hkv`` (q head h reads KV head ``h // (Hq / Hkv)``); any strides (read in place when heads are
    contiguous within a token and the other strides are multiples of 16 bytes, else copied). Masks are bottom-right
    aligned (position ``i + Skv - Sq``
    of query i): causal sees keys ``j <= pos``; window ``(left, right)`` (flash-attn's ``window_size``, a negative
    side unbounded) keys ``pos - left <= j <= pos + right``; both together intersect. A query that sees no key
    gets output 0 and LSE -inf. softmax_scale: > 0, default ``1 / sqrt(D)``. consumers: consumer warpgroups
    per block (None: :func:`config.gluon_prefill_consumers`'s choice; 3 only at D = 64).
    Returns out ``[B, Sq, Hq, D]`` contiguous in q's dtype, or ``(out, lse)`` with float32 natural-log ``lse``
    ``[B, Hq, Sq]``.
    Raises TypeError / ValueError naming the argument when :func:`supports` refuses the call.
    """
    for name, tensor in (("q", q), ("k", k), ("v", v)):
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
        if tensor.dtype not in DTYPES:
            raise TypeError(f"{name} must be float16 or bfloat16, got {tensor.dtype}")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    if window is not None and (
        not isinstance(window, tuple)
        or len(window) != 2
        or not all(isinstance(side, int) and not isinstance(side, bool) for side in window)
    ):
        raise TypeError(f"window must be None or a (left, right) tuple of ints, got {window!r}")
    if softmax_scale is None:
        softmax_scale = q.shape[-1] ** -0.5 if q.dim() == 4 else 1.0
    elif isinstance(softmax_scale, bool) or not isinstance(softmax_scale, numbers.Real):
        raise TypeError(f"softmax_scale must be a real number or None, got {type(softmax_scale).__name__}")
    if not (math.isfinite(softmax_scale) and softmax_scale > 0):
        raise ValueError(f"softmax_scale must be finite and > 0, got {softmax_scale}")
    if consumers not in (None, 2, 3) or (consumers == 3 and q.shape[-1] != 64):
        raise ValueError(f"consumers must be None (the default), 2, or 3 at head dim 64, got {consumers!r}")
    if not supports(q, k, v, softmax_scale):
        raise ValueError(
            f"gluon_attention does not run q {tuple(q.shape)} {q.dtype} strides {q.stride()}, "
            f"k {tuple(k.shape)} {k.dtype} strides {k.stride()}, v strides {v.stride()} on {q.device} "
            "(see supports())"
        )
    sides = None  # the kernel's window, as given (unbounded sides included)
    if causal or window is not None:
        left, right = window if window is not None else (-1, -1)
        left = UNBOUNDED if left < 0 else min(left, UNBOUNDED)
        right = UNBOUNDED if right < 0 else min(right, UNBOUNDED)
        sides = (left, min(right, 0) if causal else right)
    batch, seqlen_q, num_q_heads, _ = q.shape
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty((batch, num_q_heads, seqlen_q), dtype=torch.float32, device=q.device) if return_lse else None
    if seqlen_q > 0 and batch > 0 and num_q_heads > 0:
        key, launch = _LAUNCHES.lookup(q, k, v, sides, float(softmax_scale), return_lse, consumers)
        if launch is None:
            call = check_attention(
                q,
                k,
                v,
                False,
                None,
                None,
                None,
                float(softmax_scale),
                None,
                None,
                None,
                None,
                None,
                None,
                return_lse,
                None,
                False,
            )
            if sides is not None:
                call = dataclasses.replace(call, mask_spec=MaskSpec(True, *sides))
            config = FA4Config(warp_specialized=True, consumer_warpgroups=consumers)
            tiles = attention_config.tiling(config, False, call.q_bound, call.group, call.batch, call.num_kv_heads)
            launch = _LAUNCHES.put(key, BACKEND.launch(call, tiles))
        launch(q, k, v, None, None, None, None, None, None, out, lse, None, None)
    return (out, lse) if return_lse else out


_LAUNCHES = PlanCache("gluon_attention")


def _prefill_call(
    head_dim: int, window: bool, return_lse: bool, page_size: int, ragged: bool, sinks: bool, device: torch.device
) -> CheckedCall:
    """A bf16 call of the prefill kernel's layout, without tensors (what an ahead-of-time compile needs)."""
    mask = MaskSpec(has_window=True, window_right=0) if window else MaskSpec()
    return CheckedCall(
        ragged,
        page_size > 0,
        1,
        8,
        8,
        head_dim,
        1,
        0,
        0,
        mask,
        ScoreModSpec(),
        1.0,
        device,
        dtype=torch.bfloat16,
        page_size=page_size,
        has_sinks=sinks,
        return_lse=return_lse,
        tma_ready=(True, True, True),
    )


def compile_for_sm90(
    head_dim: int,
    window: bool,
    *,
    return_lse: bool = False,
    consumers: int | None = None,
    page_size: int = 0,
    ragged: bool = False,
    sinks: bool = False,
) -> dict:
    """Compiles the kernel for sm_90a without a GPU (ptxas from the Triton wheel runs, nothing launches) and
    returns the compiled kernel's ``asm`` dict (``ttgir``, ``ptx``, ``cubin``, ...): the backend's
    :class:`KernelSpec` for a bf16 call of that layout (:meth:`GluonPrefill.spec`); ``window``: the masked variant
    (causal or a sliding window); ``page_size`` > 0: K/V in a paged cache of that page size; ``ragged``: q (and K/V
    unless paged) ragged; ``sinks``: with attention sinks; ``consumers`` None: the unmasked rule's count. Run it
    with ``TRITON_INTERPRET`` unset or 0 (e.g. in a subprocess, as ``tests/test_compile_targets.py`` does): in
    interpreter mode Triton turns gl's own ``@jit`` helpers into interpreted functions, which the compiler then
    refuses."""
    from triton.backends.compiler import GPUTarget

    if head_dim not in HEAD_DIMS:
        raise ValueError(f"head_dim must be one of {HEAD_DIMS}, got {head_dim}")
    consumers = consumers or attention_config.gluon_prefill_consumers(head_dim, 0, masked=False)
    config = FA4Config(warp_specialized=True, consumer_warpgroups=consumers)
    with pretend_gpu((9, 0)) as device:  # the spec's grid asks the device for its SMs
        spec = BACKEND.spec(
            _prefill_call(head_dim, window, return_lse, page_size, ragged, sinks, device),
            attention_config.tiling(config, False, 1, 1, 1, 1),
        )
    compiled = triton.compile(spec.ast_source(), target=GPUTarget("cuda", 90, 32), options=dict(spec.options))
    return compiled.asm
