"""Gluon kernel of the grouped matmul on fp8 ``block=(1, 128)`` activations and MXFP4 weights for Hopper's FP8
tensor cores (the ``w4a8_hopper`` backend; sm_90a only, not the interpreter): the weights, prepared once
(:mod:`~llmkernels.grouped_matmul.w4a8_prepare`), are decoded in registers straight into the e4m3 A operand of
``wgmma m64nNk32 f32.e4m3.e4m3`` (swap-AB: weight rows are the MMA's M side, tokens its N side).

* **Schedule**: persistent grid, work tiles (group, token tile, 128-row weight tile) found on the device by
  ``_find_tile`` (the groups of the launch's size class, token tiles of ``TOKENS`` rows), handed by one load warp (TMA boxes of the
  prepared weights and of A, plain loads of the tile's token scales into shared memory) to two consumer warpgroups
  of 64 weight rows each through the ``_publish`` / ``_receive`` ring of
  :mod:`~llmkernels.grouped_matmul.gluon_fp8_kernel`.
* **Decode by table**: for each weight row a reference exponent ``R`` (over all of K, or per 128-K step with
  STEP_REFERENCE) and for each 32-K block (e8m0 exponent ``s``) the eight e4m3 bytes of ``{0, 0.5, 1, 1.5, 2, 3, 4,
  6} x 2^(s - R)``; ``prmt`` looks up four magnitudes at once: 7 instructions per 8 weights. Exact while the
  domain's exponents spread by at most 14 (the preparation checks it; other weights take the portable path).
* **Promotion**: a fresh fp32 partial per 128-K step (``use_acc=False`` on its first wgmma), then ``acc += partial
  x a_scale[token]`` (one FFMA per element); the row factor ``2^(R - 127)`` multiplies the accumulator once, in the
  epilogue (STEP_REFERENCE: per step).

Moved from ``lab/gluon_w4`` (its NOTES.md: design, instruction counts, H200 measurements: 706 TFLOP/s at E8x2048
N4096 K7168, 1.38x the bf16 x MXFP4 Hopper-layout path).
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

from .gluon_fp8_kernel import _find_tile, _publish, _receive

_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared

BLOCK_W = 128  # weight rows per tile (two consumers of 64)
W_BOX = [8, 4, 64]  # packed weight words of one stage: 8 fragment blocks x (2 chunks x 128 int32)
# the activation box of one 64-K chunk is [block_t, 64]
CONSUMER_REGS = gl.constexpr(232)
LOADER_REGS = gl.constexpr(40)
MAX_REGS = 168
_STOP = gl.constexpr(-2)


def a_layout_shared(a_box):
    """The shared layout of A's TMA box ``a_box`` (e4m3)."""
    return gl.NVMMASharedLayout.get_default_for(a_box, gl.float8e4nv)


def w_layout_shared():
    """The shared layout of the prepared weights' TMA box (:data:`W_BOX`, int32, no swizzle)."""
    return gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=3)


# Register layout of one consumer's packed chunk, int32 words [4 blocks, 8 g, 4 t, 4 j]: warp w holds fragment
# block w, lane 4g + t its 4 words (wgmma's A fragment of rows 16w + g and 16w + g + 8, K steps j).
_CHUNK_L = gl.constexpr(
    gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 0, 1], [0, 0, 0, 2]],
        lane_bases=[[0, 0, 1, 0], [0, 0, 2, 0], [0, 1, 0, 0], [0, 2, 0, 0], [0, 4, 0, 0]],
        warp_bases=[[1, 0, 0, 0], [2, 0, 0, 0]],
        block_bases=[],
        shape=[4, 8, 4, 4],
    )
)
# The same words as the shared tile's [4 blocks, 2 halves, 64] view (half = g // 4).
_SMEM_CHUNK_L = gl.constexpr(
    gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 1], [0, 0, 2]],
        lane_bases=[[0, 0, 4], [0, 0, 8], [0, 0, 16], [0, 0, 32], [0, 1, 0]],
        warp_bases=[[1, 0, 0], [2, 0, 0]],
        block_bases=[],
        shape=[4, 2, 64],
    )
)


@gluon.jit
def _index4(n: gl.constexpr, DIM: gl.constexpr, layout: gl.constexpr):
    """``arange(n)`` along dim DIM of a rank-4 ``layout``, expanded to rank 4."""
    if DIM == 0:
        sliced: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, layout)))
        x = gl.arange(0, n, layout=sliced)
        return gl.expand_dims(gl.expand_dims(gl.expand_dims(x, 1), 2), 3)
    elif DIM == 1:
        sliced: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, layout)))
        x = gl.arange(0, n, layout=sliced)
        return gl.expand_dims(gl.expand_dims(gl.expand_dims(x, 0), 2), 3)
    elif DIM == 2:
        sliced: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, layout)))
        x = gl.arange(0, n, layout=sliced)
        return gl.expand_dims(gl.expand_dims(gl.expand_dims(x, 0), 1), 3)
    else:
        sliced: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, layout)))
        x = gl.arange(0, n, layout=sliced)
        return gl.expand_dims(gl.expand_dims(gl.expand_dims(x, 0), 1), 2)


# $2: a data word, $3 / $4: its table words (e4m3 bytes of magnitudes 0..3 / 4..7). Out: $0 the low e4m3 word
# (k = 4t + 0..3 of its 32-K block), $1 the high one (k = 16 + 4t + 0..3). prmt's default mode reads four selector
# nibbles from the low 16 bits (bit 3 of each must be clear: it would replicate the byte's sign); the signs are
# placed at the output bytes' bit 7 by one mask each.
_DECODE_PTX = gl.constexpr("""
{
.reg .b32 m, lo, hi, s;
and.b32 m, $2, 0x77777777;
prmt.b32 lo, $3, $4, m;
and.b32 s, $2, 0x80808080;
or.b32 $0, lo, s;
shr.u32 m, m, 16;
prmt.b32 hi, $3, $4, m;
shl.b32 s, $2, 4;
and.b32 s, s, 0x80808080;
or.b32 $1, hi, s;
}
""")

# One consumer's table words of one 64-K chunk, int32 [4 blocks, 8 g, 4 t, 8 (j, low/high)]: 32 contiguous bytes a
# thread (two 16-byte loads); lanes 4g + t share g's words.
_TABLE_L = gl.constexpr(
    gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 0, 1], [0, 0, 0, 2], [0, 0, 0, 4]],
        lane_bases=[[0, 0, 1, 0], [0, 0, 2, 0], [0, 1, 0, 0], [0, 2, 0, 0], [0, 4, 0, 0]],
        warp_bases=[[1, 0, 0, 0], [2, 0, 0, 0]],
        block_bases=[],
        shape=[4, 8, 4, 8],
    )
)


@gluon.jit
def _bytes(word):
    """int32 ``[4, 8, 4, 4]`` → its four bytes as e4m3 along a new last dim (a register relabelling once
    repacked)."""
    b0 = word.to(gl.int8).to(gl.float8e4nv, bitcast=True)
    b1 = (word >> 8).to(gl.int8).to(gl.float8e4nv, bitcast=True)
    b2 = (word >> 16).to(gl.int8).to(gl.float8e4nv, bitcast=True)
    b3 = (word >> 24).to(gl.int8).to(gl.float8e4nv, bitcast=True)
    both = gl.join(gl.join(b0, b2), gl.join(b1, b3))  # [..., p, q]: byte 2p + q
    return gl.reshape(both, [4, 8, 4, 4, 4])


@gluon.jit
def _decode_chunk(w_tile, tables, CHUNK: gl.constexpr, CONSUMER: gl.constexpr, a_layout: gl.constexpr):
    """Packed words of chunk CHUNK of this consumer's 64 rows (shared int32 ``[8, 4, 64]`` tile) and their table
    words (int32 ``[4, 8, 4, 8]``) → e4m3 ``[64, 64]`` in wgmma's A-operand layout (k_width 4)."""
    view = w_tile.slice(4 * CONSUMER, 4, dim=0).slice(2 * CHUNK, 2, dim=1)
    data = gl.convert_layout(gl.reshape(view.load(_SMEM_CHUNK_L), [4, 8, 4, 4]), _CHUNK_L)
    t_low, t_high = gl.split(gl.reshape(tables, [4, 8, 4, 4, 2]))
    t_low = gl.convert_layout(t_low, _CHUNK_L)
    t_high = gl.convert_layout(t_high, _CHUNK_L)
    low, high = gl.inline_asm_elementwise(
        _DECODE_PTX,
        "=r,=r,r,r,r",
        [data, t_low, t_high],
        dtype=(gl.int32, gl.int32),
        is_pure=True,
        pack=1,
    )
    both = gl.join(_bytes(low), _bytes(high))  # (block, g, t, j, n, half)
    both = gl.reshape(both, [4, 8, 4, 2, 2, 4, 2])  # (block, g, t, i, h, n, half)
    # row = 16 block + 8h + g, k = 32i + 16 half + 4t + n
    both = gl.permute(both, (0, 4, 1, 3, 6, 2, 5))
    return gl.convert_layout(gl.reshape(both, [64, 64]), a_layout)


@gluon.jit
def _load_partition(
    a_desc,
    w_desc,
    scales_ptr,
    stride_s_row,
    stride_s_col,
    a_smem,
    w_smem,
    s_smem,
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
    min_group_rows,
    max_group_rows,
):
    """The load warp (the bf16 mode's, plus the tile's token scales of each K step: ``block_t`` fp32 values loaded by
    the warp and stored to shared memory before the stage's arrive, whose release orders them for the consumers;
    zero past T). A TMA box ``[1, block_t]`` of a token-major copy was an illegal instruction on the H200 (Triton
    3.6; compute-sanitizer at the box's load), and plain loads need no copy of the scales."""
    STAGES: gl.constexpr = w_smem.shape[0]
    TOKENS: gl.constexpr = a_desc.block_type.shape[0]
    STAGE_BYTES: gl.constexpr = 2 * a_desc.block_type.nbytes + w_desc.block_type.nbytes
    token_layout: gl.constexpr = gl.BlockedLayout([TOKENS // 32], [32], [1], [0])
    tokens = gl.arange(0, TOKENS, layout=token_layout)
    k_steps = gl.cdiv(K, 128)
    blocks_per_expert = N // 16
    tile = gl.program_id(0)
    programs = gl.num_programs(0)
    cursor = (tile * 0, tile * 0, gl.load(a_offsets_ptr).to(gl.int32))
    count = 0
    loaded = 0
    found, group, group_start, group_end, tile_m, tile_n, cursor = _find_tile(
        tile, cursor, a_offsets_ptr, num_groups, num_tokens, n_tiles, min_group_rows, max_group_rows, TOKENS
    )
    while found:
        first_row = group_start + tile_m * TOKENS
        first_col = tile_n * 128
        expert = gl.load(expert_ids_ptr + group)
        expert_ok = (expert >= 0) & (expert < num_experts)
        expert = gl.where(expert_ok, expert, -1)
        _publish(count, (first_row, gl.minimum(group_end - first_row, TOKENS), first_col, expert), schedule)
        if expert_ok:
            block0 = expert * blocks_per_expert + tile_n * 8
            for kb in range(k_steps):
                stage = loaded % STAGES
                mbarrier.wait(empty.index(stage), ((loaded // STAGES) & 1) ^ 1)
                token_rows = first_row + tokens
                a_scales = gl.load(
                    scales_ptr + token_rows.to(gl.int64) * stride_s_row + kb * stride_s_col,
                    mask=token_rows < num_tokens,
                    other=0.0,
                )
                s_smem.index(stage).store(a_scales)
                mbarrier.expect(ready.index(stage), STAGE_BYTES)
                _tma_load(w_desc, [block0, 4 * kb, 0], ready.index(stage), w_smem.index(stage))
                _tma_load(a_desc, [first_row, kb * 128], ready.index(stage), a_smem.index(2 * stage))
                _tma_load(a_desc, [first_row, kb * 128 + 64], ready.index(stage), a_smem.index(2 * stage + 1))
                loaded += 1
        count += 1
        tile += programs
        found, group, group_start, group_end, tile_m, tile_n, cursor = _find_tile(
            tile, cursor, a_offsets_ptr, num_groups, num_tokens, n_tiles, min_group_rows, max_group_rows, TOKENS
        )
    _publish(count, (tile * 0, tile * 0, tile * 0, tile * 0 + _STOP), schedule)


@gluon.jit
def _consumer_partition(
    a_smem,
    w_smem,
    s_smem,
    ready,
    empty,
    schedule,
    tables_ptr,
    factors_ptr,
    out_ptr,
    stride_out_row,
    N,
    K,
    CONSUMER: gl.constexpr,
    STEP_REFERENCE: gl.constexpr,
):
    """Consumer warpgroup CONSUMER: weight rows ``[64·CONSUMER, 64·CONSUMER + 64)`` of each tile it is handed.
    Per 128-K step: chunk 0 decoded, its two k32 wgmmas into a fresh partial (async), chunk 1 decoded under them,
    its wgmmas, a full wait, the stage released, then ``acc += partial x factor`` (the promotion runs while the
    other consumer's wgmmas hold the tensor cores)."""
    STAGES: gl.constexpr = w_smem.shape[0]
    TOKENS: gl.constexpr = a_smem.shape[1]
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, TOKENS, 32]
    )
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_layout, k_width=4)
    token_layout: gl.constexpr = gl.SliceLayout(0, mma_layout)
    row_layout: gl.constexpr = gl.SliceLayout(1, mma_layout)
    store_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    k_steps = gl.cdiv(K, 128)
    blocks_per_expert = N // 16
    # int32 offsets of this thread's table words of chunk 0, K step 0: ((block·steps + step)·8 + g)·16 + chunk·8 + r
    table_offsets = (
        _index4(4, 0, _TABLE_L) * (k_steps * 128)
        + _index4(8, 1, _TABLE_L) * 16
        + _index4(4, 2, _TABLE_L) * 0
        + _index4(8, 3, _TABLE_L)
    )
    zero = gl.zeros([64, TOKENS], gl.float32, layout=mma_layout)
    partial = zero
    count = 0
    consumed = 0
    first_row, rows, first_col, expert = _receive(count, schedule)
    while expert != _STOP:
        acc = zero
        if expert >= 0:
            block0 = expert.to(gl.int64) * blocks_per_expert + (first_col // 16) + 4 * CONSUMER
            table_base = tables_ptr + block0 * (k_steps * 128)
            row0 = expert.to(gl.int64) * N + first_col + 64 * CONSUMER
            t0 = gl.load(table_base + table_offsets)
            t1 = gl.load(table_base + table_offsets + 8)
            for kb in range(k_steps):
                position = consumed + kb
                stage = position % STAGES
                if STEP_REFERENCE:
                    factor_rows = gl.load(factors_ptr + (row0 + gl.arange(0, 64, layout=row_layout)) * k_steps + kb)
                mbarrier.wait(ready.index(stage), (position // STAGES) & 1)
                w_tile = w_smem.index(stage)
                a0 = _decode_chunk(w_tile, t0, 0, CONSUMER, a_layout)
                partial = warpgroup_mma(
                    a0, a_smem.index(2 * stage).permute((1, 0)), partial, use_acc=False, is_async=True
                )
                a1 = _decode_chunk(w_tile, t1, 1, CONSUMER, a_layout)
                # the next step's tables, into the registers this step's just freed (loading them before the
                # decode cost 16 register moves a step)
                ahead = gl.minimum(kb + 1, k_steps - 1) * 128
                t0 = gl.load(table_base + table_offsets + ahead)
                t1 = gl.load(table_base + table_offsets + ahead + 8)
                partial = warpgroup_mma(a1, a_smem.index(2 * stage + 1).permute((1, 0)), partial, is_async=True)
                partial = warpgroup_mma_wait(num_outstanding=0, deps=(partial,))
                a_scale = s_smem.index(stage).load(token_layout)
                mbarrier.arrive(empty.index(stage))
                if STEP_REFERENCE:
                    factor = gl.expand_dims(factor_rows, 1) * gl.expand_dims(a_scale, 0)
                    acc = gl.fma(partial, factor, acc)
                else:
                    acc = gl.fma(partial, gl.expand_dims(a_scale, 0), acc)
            consumed += k_steps
            if not STEP_REFERENCE:  # the row factor, once per tile
                factor_rows = gl.load(factors_ptr + (row0 + gl.arange(0, 64, layout=row_layout)) * k_steps)
                acc = acc * gl.expand_dims(factor_rows, 1)
        # out[first_row + t, first_col + 64·CONSUMER + r] = acc[r, t]
        values = gl.where(expert >= 0, acc, 0.0).to(out_ptr.dtype.element_ty)
        values = gl.convert_layout(gl.permute(values, (1, 0)), store_layout)
        out_tokens = gl.arange(0, TOKENS, layout=gl.SliceLayout(1, store_layout))
        cols = first_col + 64 * CONSUMER + gl.arange(0, 64, layout=gl.SliceLayout(0, store_layout))
        offsets = gl.expand_dims((first_row + out_tokens).to(gl.int64) * stride_out_row, 1) + gl.expand_dims(cols, 0)
        mask = gl.expand_dims(out_tokens < rows, 1) & gl.expand_dims(cols < N, 0)
        gl.store(out_ptr + offsets, values, mask=mask)
        count += 1
        first_row, rows, first_col, expert = _receive(count, schedule)


@gluon.jit
def w4a8_hopper_kernel(
    a_ptr,
    b_ptr,
    a_scales_ptr,
    b_scales_ptr,
    b_global_scale_ptr,
    out_ptr,
    a_offsets_ptr,
    expert_ids_ptr,
    stride_out_row,
    stride_a_scale_row,
    stride_a_scale_k,
    num_tokens,
    num_groups,
    num_experts,
    N,
    K,
    n_tiles,
    min_group_rows,
    max_group_rows,
    STAGES: gl.constexpr,
    STEP_REFERENCE: gl.constexpr,
):
    """Grouped w4a8 matmul, plain epilogue: ``out[rows of g] = (A[rows] @ W[e]ᵀ)`` in bf16, W the prepared weights'
    values (``dequantize(b)`` exactly). The pointer arguments carry the names of the call's tensors (what a plan hands
    its launches); the backend's bound launch passes the prepared copy of ``b`` in their place:

    a_ptr: TMA descriptor over e4m3 A ``[T, K]``, box ``[block_t, 64]``; b_ptr: over the prepared data
    (:class:`~llmkernels.grouped_matmul.w4a8_prepare.PreparedW4A8`) viewed as int32 ``[E·N/16, K'/32, 64]``, box
    :data:`W_BOX`; b_scales_ptr: the prepared tables (int32); b_global_scale_ptr: the prepared row factors (float32);
    a_scales_ptr: A's fp32 scales ``[T, cdiv(K, 128)]`` (strides ``stride_a_scale_row``, ``stride_a_scale_k``);
    out_ptr bf16 ``[T, N]`` (unit column stride); a_offsets_ptr int32 ``[G + 1]``; expert_ids_ptr int32 ``[G]`` (an
    id outside ``[0, num_experts)``: zero rows); n_tiles = N / 128; only the groups of ``min_group_rows < rows <=
    max_group_rows`` (the launch's size class). K a multiple of 64, N of 128. Grid
    ``(min(SMs, tile bound),)``, ``num_warps=4`` + consumer 1 (4 warps) + the load warp."""
    TOKENS: gl.constexpr = a_ptr.block_type.shape[0]
    a_smem = gl.allocate_shared_memory(a_ptr.dtype, [2 * STAGES, TOKENS, 64], a_ptr.layout)
    w_smem = gl.allocate_shared_memory(b_ptr.dtype, [STAGES, 8, 4, 64], b_ptr.layout)
    s_smem = gl.allocate_shared_memory(gl.float32, [STAGES, TOKENS], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    info_smem = gl.allocate_shared_memory(gl.int32, [2, 4], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    info_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    info_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)
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
                    w_smem,
                    s_smem,
                    ready,
                    empty,
                    schedule,
                    b_scales_ptr,
                    b_global_scale_ptr,
                    out_ptr,
                    stride_out_row,
                    N,
                    K,
                    0,
                    STEP_REFERENCE,
                ),
            ),
            (
                _consumer_partition,
                (
                    a_smem,
                    w_smem,
                    s_smem,
                    ready,
                    empty,
                    schedule,
                    b_scales_ptr,
                    b_global_scale_ptr,
                    out_ptr,
                    stride_out_row,
                    N,
                    K,
                    1,
                    STEP_REFERENCE,
                ),
            ),
            (
                _load_partition,
                (
                    a_ptr,
                    b_ptr,
                    a_scales_ptr,
                    stride_a_scale_row,
                    stride_a_scale_k,
                    a_smem,
                    w_smem,
                    s_smem,
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
                    min_group_rows,
                    max_group_rows,
                ),
            ),
        ],
        [4, 1],
        [CONSUMER_REGS, LOADER_REGS],
    )
