"""FP8 attention prefill in Gluon for Hopper (sm_90a): e4m3 q, k, v through e4m3 x e4m3 wgmmas, warp-specialized.

The backend :data:`BACKEND` (:class:`GluonFp8Prefill`) takes the plan's FP8 calls that it can run: an sm_90 GPU,
float8_e4m3fn ``[B, S, H, D]`` q, k and v (dense, any strides: copied when TMA cannot read them), D 64 or 128,
full or causal (bottom-right aligned), MHA/GQA/MQA, FA3's float32 descales ``[B, Hkv]`` (``[1, 1]``, ``[B, 1]``
and ``[1, Hkv]`` broadcast, None is 1.0), the call's softmax scale, optionally the LSE; the output is bf16 (the
portable kernel's for an e4m3 q). Every other FP8 call (bf16 q over FP8 K/V, ragged, paged, windows, sinks,
score_mod, mask tensors, split-KV, D other than 64 and 128) runs the portable kernel. D = 256 compiles (64-key
tiles, in ``lab/gluon_fp8_attention``) but was never run on a GPU, so it stays with the portable kernel.

Measured on an H100 (Triton 3.6, through :func:`llmkernels.attention`, CUDA-graph replay): 714-717 TFLOP/s full
and 644-673 causal at D = 128 (4x16x4096 and 2x16x8192), 1.08-1.14x the bf16 Gluon prefill in the same run and
2.3-2.5x the portable kernel (128 x 128 tiles, 8 warps) on the same e4m3 inputs (it converts them to bf16 for bf16
MMAs). ``bench_attention_prefill --fp8`` (H100, one run): 0.80-0.83x cuDNN's FP8 SDPA and 1.03-1.17x its bf16
attention at D = 128, 0.86x / 0.96x cuDNN FP8 at D = 64 (full / causal). Relative error 2.0-2.6e-2 against
float64 on the dequantized inputs (randn), where cuDNN FP8's is 3.3-3.7e-2 (it also rounds O to e4m3).

The schedule is :mod:`.gluon_hopper`'s (the bf16 prefill) with e4m3 operands:

* persistent grid, one program per SM, work tiles of 128 query rows of one (batch, q head), head-major; causal
  tiles handed out longest first through an atomic counter (:func:`gluon_hopper.take_tile_counter`: zeroed
  without a sync);
* a **producer** warpgroup (4 warps, 24 registers) publishes the work tiles, TMA-loads Q once per tile, K and V
  tiles through two-stage rings, and **transposes V**: e4m3 wgmma takes its B operand K-major only, i.e.
  ``V^T`` with keys contiguous. V arrives as ``[128 keys, 32 dims]`` boxes; the producer reads each into
  registers, relabels it ``[dims, keys]`` (``gl.permute``: no data moves) and stores it into the ``[D, 128]``
  ``V^T`` stage while the next tile lands in a separate raw ring; ``fence.proxy.async``, a barrier of the
  producer's warps, then ``vt_ready``. On the way the keys are permuted within each 32-key block
  (:func:`_to_operand` says why);
* two **consumer** warpgroups (240 registers), 64 query rows each: ``S = Q K^T`` from shared memory, fp32
  accumulate; online softmax on the raw scores with ``c = q_descale * k_descale * softmax_scale * log2(e)``
  folded into the one FMA of the exp2 argument; ``P = exp2(s c - m c + 8)``, the probabilities times 256,
  rounded to e4m3 (RNE, satfinite) and used from registers as the A operand of the e4m3 ``P V`` wgmma. The 256
  keeps probabilities down to 2^-14 normal in e4m3 (2^-6 without it) and cancels in ``O / l``; ``l`` sums the
  unrounded fp32 probabilities. Per key tile j (:func:`_fused_step`): softmax of ``S_j``, issue ``S_{j+1}``,
  rescale O, issue ``P_j V_j``, wait for both: P is made and used in one step. (FA3's order, ``P_{j-1} V_{j-1}``
  issued with ``S_j`` and P loop-carried, measured 14-17% slower: Triton carries an e4m3 tensor as separate
  bytes and repacks them, ~200 integer instructions per tile and warp.) The end writes ``O * v_descale / l``
  as bf16.

The max is taken on raw scores: the descales must be positive (FA3's convention; their values are not checked,
which would need a sync). A query that sees no key (causal with Sq > Skv) gets output 0 and LSE -inf.
:func:`compile_for_sm90` builds the kernel without a GPU, so that CPU tests can inspect its PTX.
"""

from __future__ import annotations

import threading

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from ..launch import BoundKernel, KernelSpec
from ..runtime import num_programs_hint, pretend_gpu
from . import config as attention_config
from .check import FP8, CheckedCall
from .config import FA4Config, Tiling
from .gluon_hopper import (
    LN2,
    LOG2E,
    MAX_WORK_TILES,
    _as_box,
    _descriptor,
    _nvmma_layout,
    _receive_tile,
    _store_layout,
    _tma_load,
    as_tma_ready,
    descriptor_type,
    gluon_eligible,
    sequence_rows,
    take_tile_counter,
)
from .layout import dummy
from .masks import UNBOUNDED, MaskSpec, ScoreModSpec

__all__ = ["BACKEND", "GluonFp8Prefill", "compile_for_sm90", "HEAD_DIMS"]

HEAD_DIMS = (64, 128)
BLOCK_M = 128  # query rows per work tile: two consumer warpgroups of 64
TILE_N = 128  # keys per K / V tile
V_CHUNK = 32  # V arrives as [TILE_N, 32] boxes (32-byte swizzle) for the producer's transpose
P_SHIFT = gl.constexpr(8.0)  # P is stored times 2^8 in e4m3
# Registers: 12 warps (consumer 0 = the default partition, consumer 1, the producer warpgroup); the launch's
# maxnreg 168 = 65536 / 384 rounded to 8, and setmaxnreg gives 2 x 128 x 240 + 128 x 24 = 64512 = 168 x 384.
CONSUMER_REGS = gl.constexpr(240)
PRODUCER_REGS = gl.constexpr(24)
PRODUCER_WARPS = gl.constexpr(4)

# A barrier of one partition's warps: ``thread_barrier`` in Triton 3.9, ``barrier`` in 3.6.
_partition_barrier = getattr(gl, "thread_barrier", None) or gl.barrier


@gluon.jit
def _tile_block(
    tile,
    seqlen_q,
    seqlen_kv,
    num_q_heads,
    group_size,
    num_m_blocks,
    CAUSAL: gl.constexpr,
    BLOCK_M: gl.constexpr,
    TILE_N: gl.constexpr,
):
    """Work tile ``tile``: ``(batch, q head, kv head, first query row, number of key tiles)``. Head-major; causal
    blocks of a head run longest (last rows) first. At least one key tile, so that a block that sees no key still
    runs (and writes zeros)."""
    pid_bh = tile // num_m_blocks
    pid_m = tile % num_m_blocks
    if CAUSAL:
        pid_m = num_m_blocks - 1 - pid_m
    batch = pid_bh // num_q_heads
    head = pid_bh % num_q_heads
    q_start = pid_m * BLOCK_M
    if CAUSAL:
        q_last = gl.minimum(q_start + BLOCK_M, seqlen_q) - 1
        kv_hi = gl.minimum(q_last + seqlen_kv - seqlen_q + 1, seqlen_kv)
        num_tiles = gl.maximum(gl.cdiv(kv_hi, TILE_N), 1)
    else:
        num_tiles = gl.maximum(gl.cdiv(seqlen_kv, TILE_N), 1)
    return batch, head, head // group_size, q_start, num_tiles


@gluon.jit
def _publish_tile(tile, count, schedule):
    """The producer warpgroup hands work tile ``tile`` (its ``count``-th) to the consumers through a 2-slot ring."""
    tile_smem, tile_ready, tile_empty = schedule
    slot = count % 2
    mbarrier.wait(tile_empty.index(slot), ((count // 2) & 1) ^ 1)
    tile_smem.index(slot).store(gl.full([1], tile, gl.int32, layout=gl.BlockedLayout([1], [32], [4], [0])))
    _partition_barrier()  # every producer warp's store is done before the arrive
    mbarrier.arrive(tile_ready.index(slot))


@gluon.jit
def _transpose_v(position, vraw_smem, vt_smem, vraw_ready, vt_ready, vt_empty):
    """Producer: the V tile at ring position ``position``, landed in ``vraw_smem`` as ``[D / 32]`` boxes of
    ``[128 keys, 32 dims]``, written into ``vt_smem[stage]`` (``[D, 128]``, keys contiguous) with row x of the
    tile holding key ``sigma(x)`` (:func:`_to_operand`) once the consumers released that stage; then
    ``vt_ready``."""
    STAGES: gl.constexpr = vt_smem.shape[0]
    CHUNKS: gl.constexpr = vraw_smem.shape[0] // STAGES
    TILE_N: gl.constexpr = vraw_smem.shape[1]
    V_CHUNK: gl.constexpr = vraw_smem.shape[2]
    gl.static_assert(TILE_N == 128 and V_CHUNK == 32)  # what the load layout covers
    # Thread: keys {2c, 2c+1, 2c+8, 2c+9} (+16, +32, ...) x 8 dims: the keys whose probabilities one thread holds
    # in the S accumulator, which sigma sends to 4 consecutive columns of P' (its stores stay 4 contiguous bytes).
    load_layout: gl.constexpr = gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [0, 2], [0, 4], [1, 0], [8, 0]],
        lane_bases=[[2, 0], [4, 0], [0, 8], [0, 16], [16, 0]],
        warp_bases=[[32, 0], [64, 0]],
        block_bases=[],
        shape=[TILE_N, V_CHUNK],
    )
    stage = position % STAGES
    phase = (position // STAGES) & 1
    mbarrier.wait(vraw_ready.index(stage), phase)
    mbarrier.wait(vt_empty.index(stage), phase ^ 1)
    vt = vt_smem.index(stage)
    for c in gl.static_range(CHUNKS):
        x = vraw_smem.index(stage * CHUNKS + c).load(load_layout)
        # row x of the tile becomes key sigma(x): V'[x] = V[sigma(x)]
        x = x.reshape([TILE_N // 32, 2, 2, 4, 2, V_CHUNK]).permute((0, 1, 3, 2, 4, 5)).reshape([TILE_N, V_CHUNK])
        vt.slice(c * V_CHUNK, V_CHUNK, dim=0).store(gl.permute(x, (1, 0)))
    fence_async_shared()  # the generic-proxy stores, before the wgmmas (async proxy) read them
    _partition_barrier()  # every producer warp's part is written (and its raw reads done) before the arrive
    mbarrier.arrive(vt_ready.index(stage))


@gluon.jit
def _producer_partition(
    descs,
    smem,
    bars,
    schedule,
    seqlen_q,
    seqlen_kv,
    num_q_heads,
    group_size,
    num_m_blocks,
    num_work_tiles,
    tile_counter,
    CAUSAL: gl.constexpr,
):
    """Loads and transposes. Per work tile: publish it, load its two 64-row Q tiles once the consumers released
    the last ones, then for each key tile i: K_i into the K ring, V_i's column boxes into the raw ring, and
    transpose V_{i-1} meanwhile (the last one after the loop). The next work tile comes from ``tile_counter``
    (CAUSAL: blocks differ in length, so the first program to ask gets the next one) or by striding the grid."""
    q_desc, k_desc, v_desc = descs
    q_smem, k_smem, vraw_smem, vt_smem = smem
    q_ready, q_empty, k_ready, k_empty, vraw_ready, vt_ready, vt_empty = bars
    STAGES: gl.constexpr = k_smem.shape[0]
    TILE_N: gl.constexpr = k_smem.shape[1]
    HEAD_DIM: gl.constexpr = k_smem.shape[2]
    V_CHUNK: gl.constexpr = vraw_smem.shape[2]
    CHUNKS: gl.constexpr = HEAD_DIM // V_CHUNK
    BLOCK_M: gl.constexpr = q_smem.shape[0] * q_smem.shape[1]
    TILE_BYTES: gl.constexpr = TILE_N * HEAD_DIM  # e4m3: one byte each
    tile = gl.program_id(0)
    count = 0
    loaded = 0  # key tiles loaded by this program so far: the rings' position
    while tile < num_work_tiles:
        batch, head, kv_head, q_start, num_tiles = _tile_block(
            tile, seqlen_q, seqlen_kv, num_q_heads, group_size, num_m_blocks, CAUSAL, BLOCK_M, TILE_N
        )
        _publish_tile(tile, count, schedule)
        for c in gl.static_range(2):
            # Fresh mbarriers count as having completed the phase before 0: the first lap does not wait.
            mbarrier.wait(q_empty.index(c), (count & 1) ^ 1)
            mbarrier.expect(q_ready.index(c), q_desc.block_type.nbytes)
            _tma_load(q_desc, [batch, q_start + c * 64, head * HEAD_DIM], q_ready.index(c), _as_box(q_smem.index(c)))
        for i in range(num_tiles):
            position = loaded + i
            stage = position % STAGES
            phase = (position // STAGES) & 1
            key = i * TILE_N
            mbarrier.wait(k_empty.index(stage), phase ^ 1)
            mbarrier.expect(k_ready.index(stage), TILE_BYTES)
            _tma_load(k_desc, [batch, key, kv_head * HEAD_DIM], k_ready.index(stage), _as_box(k_smem.index(stage)))
            # The raw V stage was last read by this partition's transpose of position - STAGES, which ended in a
            # barrier of the producer's warps: it is free.
            mbarrier.expect(vraw_ready.index(stage), TILE_BYTES)
            for c in gl.static_range(CHUNKS):
                _tma_load(
                    v_desc,
                    [batch, key, kv_head * HEAD_DIM + c * V_CHUNK],
                    vraw_ready.index(stage),
                    _as_box(vraw_smem.index(stage * CHUNKS + c)),
                )
            if i > 0:
                _transpose_v(position - 1, vraw_smem, vt_smem, vraw_ready, vt_ready, vt_empty)
        _transpose_v(loaded + num_tiles - 1, vraw_smem, vt_smem, vraw_ready, vt_ready, vt_empty)
        loaded += num_tiles
        count += 1
        if CAUSAL:
            tile = gl.num_programs(0) + gl.atomic_add(tile_counter, 1)
        else:
            tile += gl.num_programs(0)
    _publish_tile(num_work_tiles, count, schedule)  # no more work


@gluon.jit
def _softmax_tile(s, m_i, l_i, j, rows, seqlen_kv, shift, scale, MASKED: gl.constexpr, CAUSAL: gl.constexpr):
    """Online softmax of the raw e4m3-product scores ``s`` ``[64, 128]`` of key tile j: ``(p * 2^8, m, l, alpha)``;
    m is the running max of raw scores, ``scale > 0`` the descales, softmax scale and log2 e, folded into the
    exponent. Query row r sees keys ``< seqlen_kv`` (and ``<= r + shift`` when CAUSAL)."""
    TILE_N: gl.constexpr = s.shape[1]
    if MASKED:
        cols = gl.expand_dims(j * TILE_N + gl.arange(0, TILE_N, layout=gl.SliceLayout(0, s.type.layout)), 0)
        valid = cols < seqlen_kv
        if CAUSAL:
            valid = valid & (cols <= gl.expand_dims(rows + shift, 1))
        s = gl.where(valid, s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, axis=1))
    m_scaled = m_new * scale
    if MASKED:  # a row that has seen no key yet: alpha and p are exp2(-inf) = 0, not NaN
        m_scaled = gl.where(m_new == float("-inf"), 0.0, m_scaled)
    alpha = gl.exp2(m_i * scale - m_scaled)
    p = gl.exp2(gl.fma(s, scale, gl.expand_dims(P_SHIFT - m_scaled, 1)))
    l_new = l_i * alpha + gl.sum(p, axis=1)
    return p, m_new, l_new, alpha


@gluon.jit
def _to_operand(p, HEAD_DIM: gl.constexpr):
    """fp32 probabilities ``[64, 128]`` in the S accumulator layout -> the e4m3 A operand of the P V wgmma, with the
    columns relabelled instead of moved.

    Per 32-key block, the accumulator gives lane ``c`` (= lane % 4) columns ``{2c, 2c+1, 8+2c, 9+2c, 16+2c, 17+2c,
    24+2c, 25+2c}``; the e4m3 A fragment of ``m64nNk32`` wants ``{4c..4c+3, 16+4c..16+4c+3}``. With
    ``key = 32b + 16h + 8e + 2c + p`` and ``sigma^-1(key) = 32b + 16h + 4c + 2e + p``, column x of P' is column
    sigma(x) of P and is already in the thread that needs it: the reshape / permute changes no data, and the
    convert_layout only reorders values within a thread (no shuffles: moving them across lanes cost 3-10% in the
    lab). :func:`_transpose_v` writes V' (row x = key sigma(x)) with the same reshape / permute, so that
    ``P' V' = P V`` whatever layouts the compiler picks."""
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_DIM, 32]
    )
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=4)
    TILE_N: gl.constexpr = p.shape[1]
    p = p.reshape([64, TILE_N // 32, 2, 2, 4, 2]).permute((0, 1, 2, 4, 3, 5)).reshape([64, TILE_N])
    return gl.convert_layout(p, p_layout).to(gl.float8e4nv)


@gluon.jit
def _fused_step(
    i,
    j,
    q,
    smem,
    bars,
    s,
    m_i,
    l_i,
    acc,
    rows,
    s_zero,
    seqlen_kv,
    shift,
    scale,
    MASKED: gl.constexpr,
    CAUSAL: gl.constexpr,
):
    """Ring position i, key tile j (not the block's last), ``s = S_j`` retired: softmax of S_j, issue ``S_{j+1}``,
    rescale O, round P_j and issue ``O += P_j V_j``, wait for both. Nothing runs between the P V wgmma and its wait,
    so its register operand cannot be overwritten in flight. The softmax overlaps the other consumer's wgmmas."""
    q_smem, k_smem, vraw_smem, vt_smem = smem
    q_ready, q_empty, k_ready, k_empty, vraw_ready, vt_ready, vt_empty = bars
    STAGES: gl.constexpr = k_smem.shape[0]
    HEAD_DIM: gl.constexpr = acc.shape[1]
    p, m_i, l_i, alpha = _softmax_tile(s, m_i, l_i, j, rows, seqlen_kv, shift, scale, MASKED, CAUSAL)
    nxt = i + 1
    mbarrier.wait(k_ready.index(nxt % STAGES), (nxt // STAGES) & 1)
    s_next = warpgroup_mma(q, k_smem.index(nxt % STAGES).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, acc.type.layout)), 1)
    p8 = _to_operand(p, HEAD_DIM)
    mbarrier.wait(vt_ready.index(i % STAGES), (i // STAGES) & 1)
    acc = warpgroup_mma(p8, vt_smem.index(i % STAGES).permute((1, 0)), acc, is_async=True)
    s_next, acc = warpgroup_mma_wait(num_outstanding=0, deps=(s_next, acc))
    mbarrier.arrive(k_empty.index(nxt % STAGES))
    mbarrier.arrive(vt_empty.index(i % STAGES))
    return s_next, m_i, l_i, acc


@gluon.jit
def _descale(descale_ptr, stride_b, stride_h, batch, kv_head, value, GIVEN: gl.constexpr):
    """``value`` times the descale of (batch, kv head) when GIVEN (float32, broadcast dims with stride 0)."""
    if GIVEN:
        value = value * gl.load(descale_ptr + batch * stride_b + kv_head * stride_h)
    return value


@gluon.jit
def _consumer_block(
    tile,
    count,
    base,
    smem,
    bars,
    out_ptr,
    lse_ptr,
    descales,
    seqlen_q,
    seqlen_kv,
    num_q_heads,
    group_size,
    num_m_blocks,
    qk_scale,
    CONSUMER: gl.constexpr,
    CAUSAL: gl.constexpr,
    RETURN_LSE: gl.constexpr,
    Q_DESCALE: gl.constexpr,
    K_DESCALE: gl.constexpr,
    V_DESCALE: gl.constexpr,
):
    """Consumer ``CONSUMER`` on work tile ``tile`` (this program's ``count``-th; its key tiles from ring position
    ``base``): query rows ``[q_start + 64 CONSUMER, + 64)``. Returns the number of key tiles of the block."""
    q_smem, k_smem, vraw_smem, vt_smem = smem
    q_ready, q_empty, k_ready, k_empty, vraw_ready, vt_ready, vt_empty = bars
    (
        q_descale_ptr,
        k_descale_ptr,
        v_descale_ptr,
        stride_qd_b,
        stride_qd_h,
        stride_kd_b,
        stride_kd_h,
        stride_vd_b,
        stride_vd_h,
    ) = descales
    STAGES: gl.constexpr = k_smem.shape[0]
    TILE_N: gl.constexpr = k_smem.shape[1]
    HEAD_DIM: gl.constexpr = k_smem.shape[2]
    BLOCK_M: gl.constexpr = q_smem.shape[0] * q_smem.shape[1]
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, TILE_N, 32]
    )
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_DIM, 32]
    )
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)

    batch, head, kv_head, q_start, end_tile = _tile_block(
        tile, seqlen_q, seqlen_kv, num_q_heads, group_size, num_m_blocks, CAUSAL, BLOCK_M, TILE_N
    )
    shift = seqlen_kv - seqlen_q
    scale = _descale(q_descale_ptr, stride_qd_b, stride_qd_h, batch, kv_head, qk_scale, Q_DESCALE)
    scale = _descale(k_descale_ptr, stride_kd_b, stride_kd_h, batch, kv_head, scale, K_DESCALE)
    first_row = q_start + CONSUMER * 64
    rows = first_row + gl.arange(0, 64, layout=row_layout)
    # Tiles [1, band_hi): every row of this consumer sees all keys (no mask); [band_hi, my_end): masked; tiles
    # [my_end, end_tile) hold no key these rows see (the causal diagonal of the other consumer): only released.
    if CAUSAL:
        last_row = gl.minimum(first_row + 64, seqlen_q) - 1
        seen_hi = gl.minimum(last_row + shift + 1, seqlen_kv)
        my_end = gl.minimum(gl.maximum(gl.cdiv(seen_hi, TILE_N), 1), end_tile)
        full_hi = gl.minimum(first_row + shift + 1, seqlen_kv)
    else:
        my_end = end_tile
        full_hi = seqlen_kv
    band_hi = gl.maximum(gl.minimum(gl.maximum(full_hi, 0) // TILE_N, my_end), 1)
    offset = base  # ring position of key tile j: base + j

    q = q_smem.index(CONSUMER)
    mbarrier.wait(q_ready.index(CONSUMER), count & 1)
    s_zero = gl.zeros([64, TILE_N], gl.float32, layout=s_layout)
    acc = gl.zeros([64, HEAD_DIM], gl.float32, layout=o_layout)

    # Tile 0: its S alone; its softmax (masked) and P V in the first step.
    mbarrier.wait(k_ready.index(base % STAGES), (base // STAGES) & 1)
    s = warpgroup_mma(q, k_smem.index(base % STAGES).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
    mbarrier.arrive(k_empty.index(base % STAGES))
    m_i = gl.full([64], float("-inf"), gl.float32, layout=row_layout)
    l_i = gl.full([64], 0.0, gl.float32, layout=row_layout)
    # Tile 0 (masked) if another follows, the unmasked band, the masked tiles, then the last tile (masked, no next S).
    for j in range(0, gl.minimum(my_end - 1, 1)):
        s, m_i, l_i, acc = _fused_step(
            offset + j, j, q, smem, bars, s, m_i, l_i, acc, rows, s_zero, seqlen_kv, shift, scale, True, CAUSAL
        )
    for j in range(1, gl.minimum(band_hi, my_end - 1)):
        s, m_i, l_i, acc = _fused_step(
            offset + j, j, q, smem, bars, s, m_i, l_i, acc, rows, s_zero, seqlen_kv, shift, scale, False, CAUSAL
        )
    for j in range(gl.maximum(band_hi, 1), my_end - 1):
        s, m_i, l_i, acc = _fused_step(
            offset + j, j, q, smem, bars, s, m_i, l_i, acc, rows, s_zero, seqlen_kv, shift, scale, True, CAUSAL
        )
    mbarrier.arrive(q_empty.index(CONSUMER))  # every S of the block is done: the next Q may land
    last = offset + my_end - 1
    p, m_i, l_i, alpha = _softmax_tile(s, m_i, l_i, my_end - 1, rows, seqlen_kv, shift, scale, True, CAUSAL)
    acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
    p = _to_operand(p, HEAD_DIM)
    mbarrier.wait(vt_ready.index(last % STAGES), (last // STAGES) & 1)
    acc = warpgroup_mma(p, vt_smem.index(last % STAGES).permute((1, 0)), acc, is_async=True)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    mbarrier.arrive(vt_empty.index(last % STAGES))
    # Tiles this consumer does not see, released once landed (an early arrive would count towards the phase of
    # the tile two before).
    for j in range(my_end, end_tile):
        position = offset + j
        mbarrier.wait(k_ready.index(position % STAGES), (position // STAGES) & 1)
        mbarrier.arrive(k_empty.index(position % STAGES))
        mbarrier.wait(vt_ready.index(position % STAGES), (position // STAGES) & 1)
        mbarrier.arrive(vt_empty.index(position % STAGES))

    if RETURN_LSE:  # natural log, [B, Hq, Sq] contiguous; -inf for a row that saw no key (l = 0)
        lse = (m_i * scale + gl.log2(l_i) - P_SHIFT) * LN2
        lse_base = (batch * num_q_heads + head).to(gl.int64) * seqlen_q
        gl.store(lse_ptr + lse_base + rows, lse, mask=rows < seqlen_q)
    l_safe = gl.where(l_i == 0.0, 1.0, l_i)  # a row that saw no key: output 0
    factor = _descale(v_descale_ptr, stride_vd_b, stride_vd_h, batch, kv_head, 1.0 / l_safe, V_DESCALE)
    out = acc * gl.expand_dims(gl.convert_layout(factor, gl.SliceLayout(1, o_layout)), 1)
    store_layout: gl.constexpr = _store_layout(HEAD_DIM, 4)
    out = gl.convert_layout(out.to(gl.bfloat16), store_layout)
    out_rows = first_row + gl.arange(0, 64, layout=gl.SliceLayout(1, store_layout))
    out_cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, store_layout))
    # int64: B * Sq * Hq * D can exceed 2**31 elements.
    row_offsets = ((batch * seqlen_q + out_rows).to(gl.int64) * num_q_heads + head) * HEAD_DIM
    offsets = gl.expand_dims(row_offsets, 1) + gl.expand_dims(out_cols, 0)
    gl.store(out_ptr + offsets, out, mask=gl.expand_dims(out_rows < seqlen_q, 1))
    return end_tile


@gluon.jit
def _consumer_partition(
    args,
    CONSUMER: gl.constexpr,
    CAUSAL: gl.constexpr,
    RETURN_LSE: gl.constexpr,
    Q_DESCALE: gl.constexpr,
    K_DESCALE: gl.constexpr,
    V_DESCALE: gl.constexpr,
):
    """One consumer warpgroup: every work tile the producer hands this program, in turn. ``args``: what both
    consumers take (see the kernel)."""
    (
        smem,
        bars,
        schedule,
        out_ptr,
        lse_ptr,
        descales,
        seqlen_q,
        seqlen_kv,
        num_q_heads,
        group_size,
        num_m_blocks,
        num_work_tiles,
        qk_scale,
    ) = args
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
            lse_ptr,
            descales,
            seqlen_q,
            seqlen_kv,
            num_q_heads,
            group_size,
            num_m_blocks,
            qk_scale,
            CONSUMER,
            CAUSAL,
            RETURN_LSE,
            Q_DESCALE,
            K_DESCALE,
            V_DESCALE,
        )
        count += 1
        tile = _receive_tile(count, schedule)


@gluon.jit
def _fp8_attention_fwd_kernel(
    q_desc,
    k_desc,
    v_desc,
    out_ptr,
    lse_ptr,
    q_descale_ptr,
    k_descale_ptr,
    v_descale_ptr,
    tile_counter,
    stride_q_descale_b,
    stride_q_descale_h,
    stride_k_descale_b,
    stride_k_descale_h,
    stride_v_descale_b,
    stride_v_descale_h,
    seqlen_q,
    seqlen_kv,
    num_q_heads,
    group_size,
    num_m_blocks,
    num_work_tiles,
    qk_scale,
    CAUSAL: gl.constexpr,
    RETURN_LSE: gl.constexpr,
    Q_DESCALE: gl.constexpr,
    K_DESCALE: gl.constexpr,
    V_DESCALE: gl.constexpr,
    Q_LAYOUT: gl.constexpr,
    K_LAYOUT: gl.constexpr,
    VRAW_LAYOUT: gl.constexpr,
    VT_LAYOUT: gl.constexpr,
):
    """Persistent: each program runs work tiles (128 query rows of one (batch, q head)) until none is left.

    q_desc: TMA descriptor over e4m3 q viewed as ``[B, Sq, Hq * D]``, block ``[1, 64, D]``; k_desc over k as
    ``[B, Skv, Hkv * D]``, block ``[1, 128, D]``; v_desc over v alike, block ``[1, 128, 32]``. out_ptr: bf16
    ``[B, Sq, Hq, D]`` contiguous. lse_ptr: float32 ``[B, Hq, Sq]`` contiguous (RETURN_LSE). Descales: float32,
    element ``(b, h)`` at ``b * stride_*_descale_b + h * stride_*_descale_h`` (0 for a broadcast dim), read
    only where Q_DESCALE / K_DESCALE / V_DESCALE (else 1.0); must be > 0. tile_counter: int32 ``[1]`` zero
    (CAUSAL). CAUSAL: query i sees keys ``j <= i + Skv - Sq``. group_size: Hq // Hkv. num_m_blocks:
    ``cdiv(Sq, 128)``; num_work_tiles: ``num_m_blocks * B * Hq``. qk_scale: ``softmax_scale * log2(e)`` (> 0).
    Layouts: the shared layouts of the ``[64, D]`` Q, ``[128, D]`` K, ``[128, 32]`` raw V and ``[D, 128]``
    ``V^T`` tiles. Grid ``(min(num_work_tiles, SMs),)``, num_warps 4 (the default partition, consumer 0), maxnreg
    168."""
    HEAD_DIM: gl.constexpr = q_desc.block_type.shape[2]
    TILE_N: gl.constexpr = k_desc.block_type.shape[1]
    V_CHUNK: gl.constexpr = v_desc.block_type.shape[2]
    CHUNKS: gl.constexpr = HEAD_DIM // V_CHUNK
    STAGES: gl.constexpr = 2  # depth of the K, raw V and V^T rings (3 measured +1-3%, within one run's noise)
    dtype: gl.constexpr = q_desc.dtype
    q_smem = gl.allocate_shared_memory(dtype, [2, 64, HEAD_DIM], Q_LAYOUT)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, TILE_N, HEAD_DIM], K_LAYOUT)
    vraw_smem = gl.allocate_shared_memory(dtype, [STAGES * CHUNKS, TILE_N, V_CHUNK], VRAW_LAYOUT)
    vt_smem = gl.allocate_shared_memory(dtype, [STAGES, HEAD_DIM, TILE_N], VT_LAYOUT)
    tile_smem = gl.allocate_shared_memory(gl.int32, [2, 1], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    q_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    vraw_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    vt_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    vt_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    tile_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    tile_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(q_empty.index(i), count=1)
        mbarrier.init(tile_ready.index(i), count=1)
        mbarrier.init(tile_empty.index(i), count=2)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=2)  # both consumers release a tile
        mbarrier.init(vraw_ready.index(i), count=1)
        mbarrier.init(vt_ready.index(i), count=1)
        mbarrier.init(vt_empty.index(i), count=2)
    smem = (q_smem, k_smem, vraw_smem, vt_smem)
    bars = (q_ready, q_empty, k_ready, k_empty, vraw_ready, vt_ready, vt_empty)
    schedule = (tile_smem, tile_ready, tile_empty)
    descales = (
        q_descale_ptr,
        k_descale_ptr,
        v_descale_ptr,
        stride_q_descale_b,
        stride_q_descale_h,
        stride_k_descale_b,
        stride_k_descale_h,
        stride_v_descale_b,
        stride_v_descale_h,
    )
    consumer_args = (
        smem,
        bars,
        schedule,
        out_ptr,
        lse_ptr,
        descales,
        seqlen_q,
        seqlen_kv,
        num_q_heads,
        group_size,
        num_m_blocks,
        num_work_tiles,
        qk_scale,
    )
    gl.warp_specialize(
        [
            (_consumer_partition, (consumer_args, 0, CAUSAL, RETURN_LSE, Q_DESCALE, K_DESCALE, V_DESCALE)),
            (_consumer_partition, (consumer_args, 1, CAUSAL, RETURN_LSE, Q_DESCALE, K_DESCALE, V_DESCALE)),
            (
                _producer_partition,
                (
                    (q_desc, k_desc, v_desc),
                    smem,
                    bars,
                    schedule,
                    seqlen_q,
                    seqlen_kv,
                    num_q_heads,
                    group_size,
                    num_m_blocks,
                    num_work_tiles,
                    tile_counter,
                    CAUSAL,
                ),
            ),
        ],
        [4, PRODUCER_WARPS],
        [CONSUMER_REGS, PRODUCER_REGS],
    )


# ---------------------------------------------------------------------------------------------------------------
# host side


def _shared_layouts(head_dim: int) -> dict:
    """The shared layouts of the kernel's Q, K, raw V and V^T tiles (the descriptors' boxes match the first three)."""
    fp8 = gl.float8e4nv
    return dict(
        Q_LAYOUT=_nvmma_layout([64, head_dim], fp8),
        K_LAYOUT=_nvmma_layout([TILE_N, head_dim], fp8),
        VRAW_LAYOUT=_nvmma_layout([TILE_N, V_CHUNK], fp8),
        VT_LAYOUT=_nvmma_layout([head_dim, TILE_N], fp8),
    )


def _causal_only(mask: MaskSpec) -> bool:
    """No mask, or causal alone (no window side that binds but ``right = 0``)."""
    return not mask.has_window or (mask.window_left >= UNBOUNDED and mask.window_right == 0)


class GluonFp8Prefill:
    """The FP8 prefill kernel (one pass): e4m3 q, k, v, dense, D 64 or 128, full or causal, no window, sinks,
    score_mod or mask tensor."""

    name = "gluon_fp8_prefill"
    kernel = _fp8_attention_fwd_kernel
    reads_fp8 = True

    def supports(self, call: CheckedCall, tiles: Tiling) -> bool:
        """A config with ``warp_specialized`` (sm_90's default) on an sm_90 GPU (not the interpreter), one pass,
        q, k and v all float8_e4m3fn, dense ``[B, S, H, D]`` (not ragged or paged) with at least one key, D 64 or
        128 (D = 256 was never run on a GPU), no mask but causal, no sinks (:func:`gluon_hopper.gluon_eligible`:
        no score_mod, mask tensor, chunk or mask_mod), a positive scale and at most 2**31 - 2**20 Q blocks of 128
        rows. Layouts TMA cannot read are copied."""
        return (
            call.fp8_q
            and call.fp8_kv
            and not tiles.split
            and not call.ragged
            and not call.paged
            and not call.has_sinks
            and call.dynamic_kv
            and call.kv_rows >= 1
            and call.head_dim in HEAD_DIMS
            and call.softmax_scale > 0
            and _causal_only(call.mask_spec)
            and triton.cdiv(call.q_bound, BLOCK_M) * call.batch * call.num_q_heads <= MAX_WORK_TILES
            and gluon_eligible(call, tiles.config)
        )

    def spec(self, call: CheckedCall, tiles: Tiling) -> KernelSpec:
        head_dim = call.head_dim
        causal = call.mask_spec.has_window
        num_work_tiles = triton.cdiv(call.q_bound, BLOCK_M) * call.batch * call.num_q_heads
        q_descale, k_descale, v_descale = call.descales
        constexprs = dict(
            CAUSAL=causal,
            RETURN_LSE=call.return_lse,
            Q_DESCALE=q_descale,
            K_DESCALE=k_descale,
            V_DESCALE=v_descale,
            **_shared_layouts(head_dim),
        )
        arg_types = dict(
            q_desc=descriptor_type(FP8, [1, 64, head_dim]),
            k_desc=descriptor_type(FP8, [1, TILE_N, head_dim]),
            v_desc=descriptor_type(FP8, [1, TILE_N, V_CHUNK]),
            out_ptr="*bf16",
            lse_ptr="*fp32",
            q_descale_ptr="*fp32",
            k_descale_ptr="*fp32",
            v_descale_ptr="*fp32",
            tile_counter="*i32",
            qk_scale="fp32",
        )
        return KernelSpec(
            self.kernel,
            (max(1, min(num_work_tiles, num_programs_hint(call.device))),),
            constexprs,
            dict(num_warps=4, maxnreg=attention_config.GLUON_PREFILL_MAX_REGS[2]),
            arg_types,
            per_call=("seqlen_kv",),
            divisible=("out_ptr",),
        )

    def launch(self, call: CheckedCall, tiles: Tiling) -> GluonFp8PrefillLaunch:
        return GluonFp8PrefillLaunch(call, self.spec(call, tiles))


BACKEND = GluonFp8Prefill()


def _descale_strides(descale: torch.Tensor | None) -> tuple[int, int]:
    """(batch, kv head) strides of a float32 ``[B|1, Hkv|1]`` descale: 0 along a broadcast (size-1) dim."""
    if descale is None:
        return 0, 0
    return tuple(0 if size == 1 else stride for size, stride in zip(descale.shape, descale.stride()))


class GluonFp8PrefillLaunch:
    """The FP8 prefill kernel's launch for one plan: q, k, v TMA cannot read copied, K/V descriptors of the call's
    key count, the descales as given (any strides: the plan's key holds them), a tile counter of its own per
    stream for causal calls; bound at the first call."""

    def __init__(self, call: CheckedCall, spec: KernelSpec):
        self.spec, self.bound, self.call = spec, None, call
        self.copies = tuple(not ready for ready in call.tma_ready)
        self.causal = spec.constexprs["CAUSAL"]
        self.counters, self.lock = {}, threading.Lock()

    def __call__(
        self,
        q,
        k,
        v,
        kv_cache,
        cu_seqlens_q,
        cu_seqlens_k,
        sinks,
        slopes,
        attn_mask,
        out,
        lse,
        o_partial,
        lse_partial,
        descales=(None, None, None),
    ) -> None:
        if any(self.copies):  # the same values in a layout TMA reads: the contiguous call's bits
            q, k, v = (as_tma_ready(t) if copy else t for t, copy in zip((q, k, v), self.copies))
        unread = dummy(out.device, torch.float32)  # pointers a variant never reads
        q_descale, k_descale, v_descale = (unread if descale is None else descale for descale in descales)
        values = (q, sequence_rows(k), sequence_rows(v), out, unread if lse is None else lse)
        values = (*values, q_descale, k_descale, v_descale)
        if not self.causal:
            values = (*values, dummy(out.device, torch.int32), k.shape[1])
            (self.bound or self._bind(values, k, v, descales))(*values)
            return
        with self.lock:
            values = (*values, take_tile_counter(self.counters, out.device), k.shape[1])
            (self.bound or self._bind(values, k, v, descales))(*values)

    def _bind(self, values, k, v, descales) -> BoundKernel:
        q, _, _, out, lse, q_descale, k_descale, v_descale, counter, seqlen_kv = values
        call = self.call
        num_m_blocks = triton.cdiv(call.q_bound, BLOCK_M)
        strides = [stride for descale in descales for stride in _descale_strides(descale)]
        self.bound = self.spec.bind(
            _descriptor(q, 64),
            _descriptor(k, TILE_N),
            _descriptor(v, TILE_N, V_CHUNK),
            out,
            lse,
            q_descale,
            k_descale,
            v_descale,
            counter,
            *strides,
            call.q_bound,
            seqlen_kv,
            call.num_q_heads,
            call.group,
            num_m_blocks,
            num_m_blocks * call.batch * call.num_q_heads,
            float(call.softmax_scale) * LOG2E,
        )
        return self.bound


def _prefill_call(head_dim: int, causal: bool, return_lse: bool, descales: bool, device: torch.device) -> CheckedCall:
    """An e4m3 call of the kernel's layout, without tensors (what an ahead-of-time compile needs)."""
    mask = MaskSpec(has_window=True, window_right=0) if causal else MaskSpec()
    return CheckedCall(
        False,
        False,
        1,
        8,
        2,
        head_dim,
        4,
        4096,
        4096,
        mask,
        ScoreModSpec(),
        head_dim**-0.5,
        device,
        dtype=torch.bfloat16,
        q_rows=4096,
        kv_rows=4096,
        return_lse=return_lse,
        kv_token_rows=True,
        tma_ready=(True, True, True),
        fp8_q=True,
        fp8_kv=True,
        descales=(descales,) * 3,
    )


def compile_for_sm90(head_dim: int, causal: bool, *, return_lse: bool = False, descales: bool = True) -> dict:
    """Compiles the kernel for sm_90a without a GPU (ptxas from the Triton wheel runs, nothing launches) and
    returns the compiled kernel's ``asm`` dict (``ttgir``, ``ptx``, ``cubin``, ...): the backend's
    :class:`KernelSpec` for an e4m3 call of that layout. Run it with ``TRITON_INTERPRET`` unset or 0 (see
    :func:`gluon_hopper.compile_for_sm90`)."""
    from triton.backends.compiler import GPUTarget

    if head_dim not in HEAD_DIMS:
        raise ValueError(f"head_dim must be one of {HEAD_DIMS}, got {head_dim}")
    config = FA4Config(warp_specialized=True)
    with pretend_gpu((9, 0)) as device:  # the spec's grid asks the device for its SMs
        spec = BACKEND.spec(
            _prefill_call(head_dim, causal, return_lse, descales, device),
            attention_config.tiling(config, False, 1, 1, 1, 1),
        )
    compiled = triton.compile(spec.ast_source(), target=GPUTarget("cuda", 90, 32), options=dict(spec.options))
    return compiled.asm
