"""FP8 attention prefill in Gluon for Hopper (sm_90a): e4m3 K/V through e4m3 x e4m3 wgmmas, warp-specialized.

The backend :data:`BACKEND` (:class:`GluonFp8Prefill`) takes the plan's FP8 calls that it can run: an sm_90 GPU,
float8_e4m3fn K/V, dense ``[B, S, Hkv, D]`` (any strides: copied when TMA cannot read them), ragged
(``cu_seqlens``) or a paged cache (pages TMA reads in place, in any order), with an e4m3 q or a bf16 / fp16 q,
dense or ragged; D 64, 128 or 256; full, causal or a sliding window (bottom-right aligned); MHA/GQA/MQA; FA3's
float32 descales ``[B, Hkv]`` (``[1, 1]``, ``[B, 1]`` and ``[1, Hkv]`` broadcast, None is 1.0); the call's softmax
scale; attention sinks; optionally the LSE. The output is bf16 for an e4m3 q, q's dtype otherwise. score_mod, mask
tensors and split-KV (decode) run the portable kernel.

A 16-bit q is rounded to e4m3 per (token, head) row first (:func:`fp8_rows.quantize_rows`, one small kernel: the
row's amax becomes ±448, its scale joins the descales in the exponent), so that chunked prefill over an FP8 cache
runs on the FP8 tensor cores as FA3 and vLLM do; it moves a randn row by 2.6%, and the output by about as much as
P's own rounding (the GPU tests state the measured errors).

Measured on an H100 (Triton 3.6, CUDA-graph replay, one run each): ``bench_attention_prefill --fp8``, e4m3 q/k/v:
0.91-0.97x cuDNN's FP8 SDPA and 1.17-1.37x our bf16 prefill at D = 128, 0.88-0.90x cuDNN FP8 at D = 64, 0.92-0.98x
at D = 256 (0.77-0.88x, 0.88x and 0.76-0.81x before V was transposed in memory); relative error 2.0-2.7e-2 against
float64 on the dequantized inputs (randn), where cuDNN FP8's is 3.3-3.7e-2 (it also rounds O to e4m3).
``bench_attention_chunked --fp8``, bf16 chunks over an FP8 paged cache (8k-32k keys): 0.79-0.96x the same over a
bf16 cache at 16-key pages, 1.02-1.16x at 64-key pages. FA4's conditional rescaling with an eighth of the exp2s on
the FMA units measured 2-18% slower (lab/gluon_fp8_attention).

The schedule is :mod:`.gluon_hopper`'s (the bf16 prefill, whose work-tile geometry and K/V loads it shares) with
e4m3 operands:

* persistent grid, one program per SM, work tiles of 128 query rows of one (batch, q head), head-major; masked
  tiles handed out longest first through an atomic counter (:func:`llmkernels.launch.take_tile_counter`: zeroed
  without a sync);
* a **producer** warpgroup (4 warps, 24 registers) publishes the work tiles, TMA-loads Q once per tile, K and V
  tiles through three-stage rings (paged: one box per page). e4m3 wgmma takes its B operand K-major only, i.e.
  ``V^T`` with keys contiguous. Dense K/V read by at least :data:`V_READS` work tiles per KV head come as ``V^T``
  transposed in memory first (:func:`fp8_vt.transposed_v`, in the key order below), whose tiles land in the ``V^T``
  ring as they are: 1.02-1.17x the producer's transpose on an H100 with the pass counted, 0.81-0.97x below 16
  reads (``lab/fp8_prefill_ablation``). Otherwise the producer **transposes V**: V arrives in a separate raw ring
  as boxes of ``min(D, 128)`` columns (one a page); the producer reads ``[128 keys, 32 dims]`` pieces (``[64,
  64]`` at D = 256) into registers, relabels each ``[dims, keys]`` (``gl.permute``: no data moves) and stores it
  into the ``[D, TILE_N]`` ``V^T`` stage while the next tile lands;
  ``fence.proxy.async``, a barrier of the producer's warps, then ``vt_ready``. On the way the keys are permuted
  within each 32-key block (:func:`_to_operand` says why), and the rows of a ragged or paged sequence's last tile
  past its keys (another sequence's values, NaN say) are zeroed;
* two **consumer** warpgroups (240 registers), 64 query rows each: ``S = Q K^T`` from shared memory, fp32
  accumulate; online softmax on the raw scores with ``c = q_descale * k_descale * softmax_scale * log2(e)`` (times
  the row's q scale) folded into the one FMA of the exp2 argument; ``P = exp2(s c - m c + 8)``, the
  probabilities times 256, rounded to e4m3 (RNE, satfinite) and used from registers as the A operand of the e4m3
  ``P V`` wgmma. The 256 keeps probabilities down to 2^-14 normal in e4m3 (2^-6 without it) and cancels in ``O /
  l``; ``l`` sums the unrounded fp32 probabilities. Per key tile j (:func:`_fused_step`): softmax of ``S_j``, issue
  ``S_{j+1}``, rescale O, issue ``P_j V_j``, wait for both: P is made and used in one step. (FA3's order,
  ``P_{j-1} V_{j-1}`` issued with ``S_j`` and P loop-carried, measured 14-17% slower: Triton carries an e4m3
  tensor as separate bytes and repacks them, ~200 integer instructions per tile and warp; FA3's consumer
  ping-pong measured +2.5% at most, within a run's spread: lab/gluon_fp8_attention.) The end writes ``O *
  v_descale / l``.

The max is taken on raw scores: the descales must be positive (FA3's convention; ``validate=True`` checks them,
which costs a sync). A query that sees no key (causal with Sq > Skv) gets output 0 and LSE -inf.
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
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from ..launch import BoundKernel, KernelSpec, take_tile_counter
from ..runtime import num_programs_hint, pretend_gpu
from . import config as attention_config
from .check import FP8, CheckedCall
from .config import FA4Config, Tiling
from .fp8_rows import quantize_rows
from .fp8_vt import transposed_v
from .gluon_hopper import (
    LN2,
    LOG2E,
    MAX_WORK_TILES,
    _as_box,
    _descriptor,
    _nvmma_layout,
    _receive_tile,
    _tile_block,
    _tma_load,
    consumer_bands,
    descriptor_type,
    fold_sink,
    gluon_eligible,
    kv_extents,
    launch_operands,
    page_of,
    partition_barrier,
    publish_tile,
    sequence_rows,
    store_rows,
)
from .layout import dummy
from .masks import UNBOUNDED, MaskSpec, ScoreModSpec
from .portable import TYPE_NAMES

__all__ = ["BACKEND", "GluonFp8Prefill", "compile_for_sm90", "HEAD_DIMS"]

HEAD_DIMS = (64, 128, 256)
BLOCK_M = 128  # query rows per work tile: two consumer warpgroups of 64
STAGES = 3  # depth of the K, raw V and V^T rings (2 stages: 1-4% slower at D 128 and 256)
P_SHIFT = gl.constexpr(8.0)  # P is stored times 2^8 in e4m3
# Registers: 12 warps (consumer 0 = the default partition, consumer 1, the producer warpgroup); the launch's
# maxnreg 168 = 65536 / 384 rounded to 8, and setmaxnreg gives 2 x 128 x 240 + 128 x 24 = 64512 = 168 x 384.
CONSUMER_REGS = gl.constexpr(240)
V_READS = 16  # work tiles per KV head from which V is transposed in memory first (:func:`transposes_v`)
PRODUCER_REGS = gl.constexpr(24)
PRODUCER_WARPS = gl.constexpr(4)


@gluon.jit
def _transpose_v(position, vraw_smem, vt_smem, vraw_ready, vt_ready, vt_empty, keys, V_CHUNK: gl.constexpr):
    """Producer: the V tile at ring position ``position``, landed in ``vraw_smem`` as ``[D / W]`` boxes of
    ``[TILE_N keys, W dims]`` (W = min(D, 128)), written into ``vt_smem[stage]`` (``[D, TILE_N]``, keys contiguous)
    ``[TILE_N, V_CHUNK]`` at a time (``[128, 32]``, or ``[64, 64]`` at D = 256) with row x of the tile holding key
    ``sigma(x)`` (:func:`_to_operand`) once the consumers released that stage; then ``vt_ready``. Keys ``>= keys``
    (a sequence's last tile of ragged or paged K/V, whose rows hold other values, NaN say, that P V would multiply
    by P's zeros) are written as zeros."""
    STAGES: gl.constexpr = vt_smem.shape[0]
    HEAD_DIM: gl.constexpr = vt_smem.shape[1]
    BOXES: gl.constexpr = vraw_smem.shape[0] // STAGES
    TILE_N: gl.constexpr = vraw_smem.shape[1]
    V_BOX: gl.constexpr = vraw_smem.shape[2]
    gl.static_assert((TILE_N == 128 and V_CHUNK == 32) or (TILE_N == 64 and V_CHUNK == 64))
    # Thread: keys {2c, 2c+1, 2c+8, 2c+9} (+16, +32, ...) x 8 dims: the keys whose probabilities one thread holds
    # in the S accumulator, which sigma sends to 4 consecutive columns of P' (its stores stay 4 contiguous bytes).
    # The last warp bit: key bit 6 of a [128, 32] box, dim bit 5 of a [64, 64] one.
    WARP_BIT: gl.constexpr = [64, 0] if TILE_N == 128 else [0, 32]
    load_layout: gl.constexpr = gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [0, 2], [0, 4], [1, 0], [8, 0]],
        lane_bases=[[2, 0], [4, 0], [0, 8], [0, 16], [16, 0]],
        warp_bases=[[32, 0], WARP_BIT],
        block_bases=[],
        shape=[TILE_N, V_CHUNK],
    )
    stage = position % STAGES
    phase = (position // STAGES) & 1
    mbarrier.wait(vraw_ready.index(stage), phase)
    mbarrier.wait(vt_empty.index(stage), phase ^ 1)
    vt = vt_smem.index(stage)
    for c in gl.static_range(HEAD_DIM // V_CHUNK):
        box = vraw_smem.index(stage * BOXES + c * V_CHUNK // V_BOX)
        x = box.slice(c * V_CHUNK % V_BOX, V_CHUNK, dim=1).load(load_layout)
        if keys < TILE_N:
            key = gl.expand_dims(gl.arange(0, TILE_N, layout=gl.SliceLayout(1, load_layout)), 1)
            x = gl.where(key < keys, x, gl.zeros_like(x))
        # row x of the tile becomes key sigma(x): V'[x] = V[sigma(x)]
        x = x.reshape([TILE_N // 32, 2, 2, 4, 2, V_CHUNK]).permute((0, 1, 3, 2, 4, 5)).reshape([TILE_N, V_CHUNK])
        vt.slice(c * V_CHUNK, V_CHUNK, dim=0).store(gl.permute(x, (1, 0)))
    fence_async_shared()  # the generic-proxy stores, before the wgmmas (async proxy) read them
    partition_barrier()  # every producer warp's part is written (and its raw reads done) before the arrive
    mbarrier.arrive(vt_ready.index(stage))


@gluon.jit
def _load_kv_tiles(descs, k_buffer, vraw_smem, first_box, bars, batch, key, column, pages, PAGE_SIZE: gl.constexpr):
    """TMA loads of keys ``[key, key + TILE_N)`` of sequence ``batch``, head columns from ``column``: K into
    ``k_buffer`` (arriving on ``bars[0]``), V's ``[TILE_N, V_BOX]`` column boxes into ``vraw_smem[first_box:]``
    (on ``bars[1]``). Paged, per page the tile spans: its K box and V's column boxes, the page looked up once."""
    k_desc, v_desc = descs
    k_ready, v_ready = bars
    V_BOX: gl.constexpr = v_desc.block_type.shape[2]
    BOXES: gl.constexpr = k_buffer.shape[1] // V_BOX
    if PAGE_SIZE == 0:
        _tma_load(k_desc, [batch, key, column], k_ready, _as_box(k_buffer))
        for c in gl.static_range(BOXES):
            _tma_load(v_desc, [batch, key, column + c * V_BOX], v_ready, _as_box(vraw_smem.index(first_box + c)))
    else:
        BOX: gl.constexpr = k_desc.block_type.shape[1]
        for r in gl.static_range(k_buffer.shape[0] // BOX):
            box_key = key + r * BOX
            page = page_of(pages, batch, box_key, PAGE_SIZE)
            row = box_key % PAGE_SIZE
            _tma_load(k_desc, [page, row, column], k_ready, _as_box(k_buffer).slice(r * BOX, BOX, dim=1))
            for c in gl.static_range(BOXES):
                box = _as_box(vraw_smem.index(first_box + c)).slice(r * BOX, BOX, dim=1)
                _tma_load(v_desc, [page, row, column + c * V_BOX], v_ready, box)


@gluon.jit
def _load_k_and_vt(descs, smem, bars, stage, phase, batch, key, column, TILE_BYTES: gl.constexpr):
    """Dense K/V with V transposed in memory: K's tile ``[key, key + TILE_N)`` into the K ring and V^T's ``[D,
    TILE_N]`` tile of the same keys into the V^T ring at ``stage``, each once the consumers released it."""
    k_desc, vt_desc = descs
    q_smem, k_smem, vraw_smem, vt_smem = smem
    q_ready, q_empty, k_ready, k_empty, vraw_ready, vt_ready, vt_empty = bars
    mbarrier.wait(k_empty.index(stage), phase ^ 1)
    mbarrier.expect(k_ready.index(stage), TILE_BYTES)
    _tma_load(k_desc, [batch, key, column], k_ready.index(stage), _as_box(k_smem.index(stage)))
    mbarrier.wait(vt_empty.index(stage), phase ^ 1)
    mbarrier.expect(vt_ready.index(stage), TILE_BYTES)
    _tma_load(vt_desc, [batch, column, key], vt_ready.index(stage), _as_box(vt_smem.index(stage)))


@gluon.jit
def _producer_partition(
    descs,
    smem,
    bars,
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
    V_TRANSPOSED: gl.constexpr,
):
    """Loads and transposes. Per work tile (ragged blocks past their sequence skipped): publish it, load its two
    64-row Q tiles once the consumers released the last ones, then for each key tile i: K_i into the K ring, V_i's
    column boxes into the raw ring (paged: one box per page and column box), and transpose V_{i-1} meanwhile (the
    last one after the loop). The next work tile comes from ``tile_counter`` (WINDOW: blocks differ in length, so
    the first program to ask gets the next one) or by striding the grid. V_TRANSPOSED (dense K/V): ``v_desc`` is
    over :func:`fp8_vt.transposed_v`'s ``V^T``, whose tiles land in the ``V^T`` ring as they are."""
    q_desc, k_desc, v_desc = descs
    q_smem, k_smem, vraw_smem, vt_smem = smem
    q_ready, q_empty, k_ready, k_empty, vraw_ready, vt_ready, vt_empty = bars
    STAGES: gl.constexpr = k_smem.shape[0]
    TILE_N: gl.constexpr = k_smem.shape[1]
    HEAD_DIM: gl.constexpr = k_smem.shape[2]
    BOXES: gl.constexpr = HEAD_DIM // vraw_smem.shape[2]
    V_CHUNK: gl.constexpr = 64 if TILE_N == 64 else 32  # the transposer's [TILE_N, V_CHUNK] pieces
    TILE_BYTES: gl.constexpr = TILE_N * HEAD_DIM  # e4m3: one byte each
    ZERO_TAILS: gl.constexpr = RAGGED or PAGE_SIZE > 0  # dense K/V: a per-sequence descriptor reads zeros there
    tile = gl.program_id(0)
    count = 0
    loaded = 0  # key tiles loaded by this program so far: the rings' position
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
            2,
            RAGGED,
            PAGE_SIZE > 0,
            PRODUCER_WARPS,
        )
        seqlen_q = tile_geometry[0]
        keys = TILE_N * (first_tile + num_tiles)  # the keys of the block's last tile that P V may read
        if ZERO_TAILS:
            keys = tile_geometry[1]
        q_batch, q_row0, kv_batch, kv_row0, _, _ = place
        if (q_start >= 0) & (q_start < seqlen_q):
            publish_tile(tile, count, schedule, PRODUCER_WARPS)
            for c in gl.static_range(2):
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
                position = loaded + i
                stage = position % STAGES
                phase = (position // STAGES) & 1
                key = (first_tile + i) * TILE_N
                if V_TRANSPOSED:
                    _load_k_and_vt(
                        (k_desc, v_desc), smem, bars, stage, phase, kv_batch, key, kv_head * HEAD_DIM, TILE_BYTES
                    )
                else:
                    mbarrier.wait(k_empty.index(stage), phase ^ 1)
                    # The raw V stage was last read by this partition's transpose of position - STAGES, which ended
                    # in a barrier of the producer's warps: it is free.
                    mbarrier.expect(k_ready.index(stage), TILE_BYTES)
                    mbarrier.expect(vraw_ready.index(stage), TILE_BYTES)
                    _load_kv_tiles(
                        (k_desc, v_desc),
                        k_smem.index(stage),
                        vraw_smem,
                        stage * BOXES,
                        (k_ready.index(stage), vraw_ready.index(stage)),
                        kv_batch,
                        kv_row0 + key,
                        kv_head * HEAD_DIM,
                        pages,
                        PAGE_SIZE,
                    )
                    if i > 0:
                        _transpose_v(position - 1, vraw_smem, vt_smem, vraw_ready, vt_ready, vt_empty, TILE_N, V_CHUNK)
            if not V_TRANSPOSED:
                last_key = (first_tile + num_tiles - 1) * TILE_N
                _transpose_v(
                    loaded + num_tiles - 1, vraw_smem, vt_smem, vraw_ready, vt_ready, vt_empty, keys - last_key, V_CHUNK
                )
            loaded += num_tiles
            count += 1
        if WINDOW:
            tile = gl.num_programs(0) + gl.atomic_add(tile_counter, 1)
        else:
            tile += gl.num_programs(0)
    publish_tile(num_work_tiles, count, schedule, PRODUCER_WARPS)  # no more work


@gluon.jit
def _softmax_tile(s, m_i, l_i, j, rows, geometry, scale, MASKED: gl.constexpr, WINDOW: gl.constexpr):
    """Online softmax of the raw e4m3-product scores ``s`` ``[64, TILE_N]`` of key tile j: ``(p * 2^8, m, l,
    alpha)``; m is the running max of raw scores, ``scale > 0`` (a scalar, or ``[64]`` per row with a q quantized
    per row) the descales, softmax scale and log2 e, folded into the exponent. Query row r sees keys
    ``< seqlen_kv`` (and, with WINDOW, ``[r + shift - left, r + shift + right]``)."""
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
    m_scaled = m_new * scale
    if MASKED:  # a row that has seen no key yet: alpha and p are exp2(-inf) = 0, not NaN
        m_scaled = gl.where(m_new == float("-inf"), 0.0, m_scaled)
    alpha = gl.exp2(m_i * scale - m_scaled)
    if scale.type.is_block():
        p = gl.exp2(gl.fma(s, gl.expand_dims(scale, 1), gl.expand_dims(P_SHIFT - m_scaled, 1)))
    else:
        p = gl.exp2(gl.fma(s, scale, gl.expand_dims(P_SHIFT - m_scaled, 1)))
    l_new = l_i * alpha + gl.sum(p, axis=1)
    return p, m_new, l_new, alpha


@gluon.jit
def _to_operand(p, HEAD_DIM: gl.constexpr):
    """fp32 probabilities ``[64, TILE_N]`` in the S accumulator layout -> the e4m3 A operand of the P V wgmma, with
    the columns relabelled instead of moved.

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
    geometry,
    scale,
    MASKED: gl.constexpr,
    WINDOW: gl.constexpr,
):
    """Ring position i, key tile j (not the block's last), ``s = S_j`` retired: softmax of S_j, issue ``S_{j+1}``,
    rescale O, round P_j and issue ``O += P_j V_j``, wait for both. Nothing runs between the P V wgmma and its wait,
    so its register operand cannot be overwritten in flight. The softmax overlaps the other consumer's wgmmas."""
    q_smem, k_smem, vraw_smem, vt_smem = smem
    q_ready, q_empty, k_ready, k_empty, vraw_ready, vt_ready, vt_empty = bars
    STAGES: gl.constexpr = k_smem.shape[0]
    HEAD_DIM: gl.constexpr = acc.shape[1]
    p, m_i, l_i, alpha = _softmax_tile(s, m_i, l_i, j, rows, geometry, scale, MASKED, WINDOW)
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
    lse_and_sinks,
    q_scale_ptr,
    descales,
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
    Q_ROWS: gl.constexpr,
    Q_DESCALE: gl.constexpr,
    K_DESCALE: gl.constexpr,
    V_DESCALE: gl.constexpr,
    RAGGED: gl.constexpr,
    PAGED: gl.constexpr,
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
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, TILE_N, 32]
    )
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_DIM, 32]
    )
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)

    batch, head, kv_head, q_start, first_tile, num_tiles, geometry, place = _tile_block(
        tile, geometry, lens, num_q_heads, group_size, num_m_blocks, WINDOW, TILE_N, 2, RAGGED, PAGED, 4
    )
    seqlen_q, seqlen_kv, shift, window_left, window_right = geometry
    out_token0 = place[4]
    lse_base = place[5]
    first_row = q_start + CONSUMER * 64
    rows = first_row + gl.arange(0, 64, layout=row_layout)
    scale = _descale(q_descale_ptr, stride_qd_b, stride_qd_h, batch, kv_head, qk_scale, Q_DESCALE)
    scale = _descale(k_descale_ptr, stride_kd_b, stride_kd_h, batch, kv_head, scale, K_DESCALE)
    if Q_ROWS:  # q quantized per (token, head) row: its scales, float32 [tokens, Hq]
        q_scales = gl.load(
            q_scale_ptr + (out_token0 + rows).to(gl.int64) * num_q_heads + head, mask=rows < seqlen_q, other=1.0
        )
        scale = scale * q_scales
    end_tile = first_tile + num_tiles
    # Tiles [band_lo, band_hi): every row of this consumer sees all their keys (no mask); the others are masked;
    # tiles [my_end, end_tile) hold no key these rows see (the causal diagonal of the other consumer): only
    # released.
    my_end, band_lo, band_hi = consumer_bands(first_row, first_tile, end_tile, geometry, WINDOW, TILE_N)
    offset = base - first_tile  # ring position of key tile j: offset + j

    q = q_smem.index(CONSUMER)
    mbarrier.wait(q_ready.index(CONSUMER), count & 1)
    s_zero = gl.zeros([64, TILE_N], gl.float32, layout=s_layout)
    acc = gl.zeros([64, HEAD_DIM], gl.float32, layout=o_layout)

    # The first tile's S alone; its softmax (masked) and P V in the first step.
    mbarrier.wait(k_ready.index(base % STAGES), (base // STAGES) & 1)
    s = warpgroup_mma(q, k_smem.index(base % STAGES).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
    mbarrier.arrive(k_empty.index(base % STAGES))
    m_i = gl.full([64], float("-inf"), gl.float32, layout=row_layout)
    l_i = gl.full([64], 0.0, gl.float32, layout=row_layout)
    # Masked tiles up to the band, the unmasked band, masked tiles after it; the last tile (masked, no next S) alone.
    for j in range(first_tile, gl.minimum(band_lo, my_end - 1)):
        s, m_i, l_i, acc = _fused_step(
            offset + j, j, q, smem, bars, s, m_i, l_i, acc, rows, s_zero, geometry, scale, True, WINDOW
        )
    for j in range(band_lo, gl.minimum(band_hi, my_end - 1)):
        s, m_i, l_i, acc = _fused_step(
            offset + j, j, q, smem, bars, s, m_i, l_i, acc, rows, s_zero, geometry, scale, False, WINDOW
        )
    for j in range(band_hi, my_end - 1):
        s, m_i, l_i, acc = _fused_step(
            offset + j, j, q, smem, bars, s, m_i, l_i, acc, rows, s_zero, geometry, scale, True, WINDOW
        )
    mbarrier.arrive(q_empty.index(CONSUMER))  # every S of the block is done: the next Q may land
    last = offset + my_end - 1
    p, m_i, l_i, alpha = _softmax_tile(s, m_i, l_i, my_end - 1, rows, geometry, scale, True, WINDOW)
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

    lse_ptr, sinks_ptr = lse_and_sinks
    m_log2 = m_i * scale - P_SHIFT  # acc and l_i are relative to 2^m_log2 (P is stored times 2^P_SHIFT)
    if HAS_SINKS:
        acc, l_i, m_log2 = fold_sink(acc, l_i, m_log2, sinks_ptr, head)
    if RETURN_LSE:  # natural log, [B, Hq, Sq] ([Hq, total_q] ragged) contiguous; -inf for a row that saw no key
        lse = (m_log2 + gl.log2(l_i)) * LN2
        gl.store(lse_ptr + lse_base + rows, lse, mask=rows < seqlen_q)
    l_safe = gl.where(l_i == 0.0, 1.0, l_i)  # a row that saw no key (and no sink): output 0
    factor = _descale(v_descale_ptr, stride_vd_b, stride_vd_h, batch, kv_head, 1.0 / l_safe, V_DESCALE)
    out = acc * gl.expand_dims(gl.convert_layout(factor, gl.SliceLayout(1, o_layout)), 1)
    store_rows(out_ptr, out, out_token0, first_row, seqlen_q, num_q_heads, head)
    return num_tiles


@gluon.jit
def _consumer_partition(
    args,
    CONSUMER: gl.constexpr,
    WINDOW: gl.constexpr,
    RETURN_LSE: gl.constexpr,
    HAS_SINKS: gl.constexpr,
    Q_ROWS: gl.constexpr,
    Q_DESCALE: gl.constexpr,
    K_DESCALE: gl.constexpr,
    V_DESCALE: gl.constexpr,
    RAGGED: gl.constexpr,
    PAGED: gl.constexpr,
):
    """One consumer warpgroup: every work tile the producer hands this program, in turn. ``args``: what both
    consumers take (see the kernel)."""
    (
        smem,
        bars,
        schedule,
        out_ptr,
        lse_and_sinks,
        q_scale_ptr,
        descales,
        geometry,
        lens,
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
            lse_and_sinks,
            q_scale_ptr,
            descales,
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
            Q_ROWS,
            Q_DESCALE,
            K_DESCALE,
            V_DESCALE,
            RAGGED,
            PAGED,
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
    q_scale_ptr,
    q_descale_ptr,
    k_descale_ptr,
    v_descale_ptr,
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
    stride_q_descale_b,
    stride_q_descale_h,
    stride_k_descale_b,
    stride_k_descale_h,
    stride_v_descale_b,
    stride_v_descale_h,
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
    Q_ROWS: gl.constexpr,
    Q_DESCALE: gl.constexpr,
    K_DESCALE: gl.constexpr,
    V_DESCALE: gl.constexpr,
    RAGGED: gl.constexpr,
    PAGE_SIZE: gl.constexpr,
    STAGES: gl.constexpr,
    TILE_N: gl.constexpr,
    V_TRANSPOSED: gl.constexpr,
    Q_LAYOUT: gl.constexpr,
    K_LAYOUT: gl.constexpr,
    VRAW_LAYOUT: gl.constexpr,
    VT_LAYOUT: gl.constexpr,
):
    """Persistent: each program runs work tiles (128 query rows of one (batch, q head)) until none is left.

    q_desc: TMA descriptor over e4m3 q viewed as ``[B, Sq, Hq * D]``, block ``[1, 64, D]``. k_desc over k as
    ``[B, Skv, Hkv * D]``, block ``[1, TILE_N, D]`` (TILE_N: 128 keys, 64 at D = 256); v_desc over v alike, block
    ``[1, TILE_N, V_CHUNK]`` (32, or 64 at D = 256). Paged (PAGE_SIZE > 0): over the pages ``[num_pages,
    PAGE_SIZE, Hkv * D]``, blocks of ``min(PAGE_SIZE, TILE_N)`` rows, sequence b's key i in page ``block_table[b, i
    // PAGE_SIZE]`` (int32, rows ``stride_block_table`` apart, ``max_pages`` per row) with ``seqlens[b]`` keys
    (int32, clamped to ``[0, seqlen_kv]``; ``seqlen_kv`` is then ``max_pages * PAGE_SIZE``). RAGGED: q ``[total_q,
    Hq, D]`` (descriptor over ``[1, total_q, Hq * D]``), sequence b's rows from int32 ``cu_seqlens_q`` ``[B + 1]``,
    and unless paged k / v ``[total_k, Hkv, D]`` likewise from ``cu_seqlens_k``; ``seqlen_q`` (``seqlen_kv``) are
    then host bounds on one sequence's queries (keys). out_ptr: bf16 / fp16 ``[B, Sq, Hq, D]`` (ragged ``[total_q,
    Hq, D]``) contiguous. lse_ptr: float32 ``[B, Hq, Sq]`` (ragged ``[Hq, total_q]``) contiguous (RETURN_LSE).
    q_scale_ptr: float32 ``[tokens, Hq]`` contiguous (Q_ROWS: q is a 16-bit q quantized per row,
    :func:`fp8_rows.quantize_rows`). Descales: float32, element ``(b, h)`` at ``b * stride_*_descale_b + h *
    stride_*_descale_h`` (0 for a broadcast dim), read only where Q_DESCALE / K_DESCALE / V_DESCALE (else 1.0);
    must be > 0. sinks_ptr: float32 ``[Hq]`` contiguous attention-sink logits (HAS_SINKS:
    :func:`gluon_hopper.fold_sink`). tile_counter: int32 ``[1]`` zero (WINDOW). WINDOW: query i sees keys ``i + Skv
    - Sq - left <= j <= i + Skv - Sq + right`` (bottom-right aligned; causal is ``(2**30, 0)``). group_size: Hq //
    Hkv. num_m_blocks: ``cdiv(Sq, 128)``; num_work_tiles: ``num_m_blocks * B * Hq``. qk_scale: ``softmax_scale *
    log2(e)`` (> 0). STAGES: depth of the K, raw V and V^T rings. V_TRANSPOSED: ``v_desc`` is over
    :func:`fp8_vt.transposed_v`'s ``[B, Hkv * D, S']``, block ``[1, D, TILE_N]`` (dense K/V; the raw V ring is then
    unused). Layouts: the shared layouts of the ``[64, D]`` Q, ``[TILE_N, D]`` K, ``[TILE_N, V_CHUNK]`` raw V and
    ``[D, TILE_N]`` ``V^T`` tiles. Grid ``(min(num_work_tiles, SMs),)``, num_warps 4 (the default partition,
    consumer 0), maxnreg 168."""
    HEAD_DIM: gl.constexpr = q_desc.block_type.shape[2]
    V_BOX: gl.constexpr = HEAD_DIM if HEAD_DIM < 128 else 128  # v_box(HEAD_DIM)
    RAW_BOXES: gl.constexpr = 1 if V_TRANSPOSED else STAGES * (HEAD_DIM // V_BOX)  # V_TRANSPOSED: unused
    dtype: gl.constexpr = q_desc.dtype
    q_smem = gl.allocate_shared_memory(dtype, [2, 64, HEAD_DIM], Q_LAYOUT)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, TILE_N, HEAD_DIM], K_LAYOUT)
    vraw_smem = gl.allocate_shared_memory(dtype, [RAW_BOXES, TILE_N, V_BOX], VRAW_LAYOUT)
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
    geometry = (seqlen_q, seqlen_kv, seqlen_kv - seqlen_q, window_left, window_right)
    lens = (cu_seqlens_q_ptr, cu_seqlens_k_ptr, seqlens_ptr, total_q, total_k)
    pages = (block_table_ptr, stride_block_table, max_pages, num_pages)
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
        (lse_ptr, sinks_ptr),
        q_scale_ptr,
        descales,
        geometry,
        lens,
        num_q_heads,
        group_size,
        num_m_blocks,
        num_work_tiles,
        qk_scale,
    )
    PAGED: gl.constexpr = PAGE_SIZE > 0
    gl.warp_specialize(
        [
            (
                _consumer_partition,
                (
                    consumer_args,
                    0,
                    WINDOW,
                    RETURN_LSE,
                    HAS_SINKS,
                    Q_ROWS,
                    Q_DESCALE,
                    K_DESCALE,
                    V_DESCALE,
                    RAGGED,
                    PAGED,
                ),
            ),
            (
                _consumer_partition,
                (
                    consumer_args,
                    1,
                    WINDOW,
                    RETURN_LSE,
                    HAS_SINKS,
                    Q_ROWS,
                    Q_DESCALE,
                    K_DESCALE,
                    V_DESCALE,
                    RAGGED,
                    PAGED,
                ),
            ),
            (
                _producer_partition,
                (
                    (q_desc, k_desc, v_desc),
                    smem,
                    bars,
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
                    V_TRANSPOSED,
                ),
            ),
        ],
        [4, PRODUCER_WARPS],
        [CONSUMER_REGS, PRODUCER_REGS],
    )


# ---------------------------------------------------------------------------------------------------------------
# host side


def tile_n(head_dim: int) -> int:
    """Keys per K / V tile: 128, or 64 at D = 256 (128 would need more shared memory than an SM has)."""
    return 64 if head_dim == 256 else 128


def transposes_v(call: CheckedCall) -> bool:
    """Whether V is transposed in memory first (:func:`fp8_vt.transposed_v`) rather than tile by tile by the producer:
    dense K/V (not ragged, not paged) read by at least :data:`V_READS` work tiles per KV head (query blocks of 128
    times q heads per KV head). The pass moves V twice through HBM and holds a transient copy of V's size; the
    producer's transposes cost ~15% of the kernel (see :mod:`.fp8_vt`), so the pass pays once that share of the
    kernel outweighs it. Ragged and paged K/V keep the producer's transpose: a per-sequence ``V^T`` would need a
    host bound on each sequence's keys (a paged table's width can be far past them)."""
    reads = triton.cdiv(call.q_bound, BLOCK_M) * call.group
    return not call.ragged and not call.paged and reads >= V_READS


def v_box(head_dim: int) -> int:
    """V arrives as ``[TILE_N, W]`` boxes of W = min(D, 128) columns (128 bytes, the widest swizzle): one box a page
    at D <= 128, so that a tile of 16-key pages takes 16 TMA loads (K and V), not 40 (the transposer's
    ``[TILE_N, 32]`` pieces: 0.63-0.69x the bf16 cache's speed at 16-key pages)."""
    return min(head_dim, 128)


def _shared_layouts(head_dim: int) -> dict:
    """The shared layouts of the kernel's Q, K, raw V and V^T tiles (the descriptors' boxes match the first three)."""
    fp8, block_n = gl.float8e4nv, tile_n(head_dim)
    return dict(
        Q_LAYOUT=_nvmma_layout([64, head_dim], fp8),
        K_LAYOUT=_nvmma_layout([block_n, head_dim], fp8),
        VRAW_LAYOUT=_nvmma_layout([block_n, v_box(head_dim)], fp8),
        VT_LAYOUT=_nvmma_layout([head_dim, block_n], fp8),
    )


class GluonFp8Prefill:
    """The FP8 prefill kernel (one pass): e4m3 K/V (dense, ragged or paged) with an e4m3 q, or a 16-bit q
    quantized per row; D 64, 128 or 256; no mask but causal / a sliding window; sinks or not; no score_mod or mask
    tensor."""

    name = "gluon_fp8_prefill"
    kernel = _fp8_attention_fwd_kernel
    reads_fp8 = True

    def supports(self, call: CheckedCall, tiles: Tiling) -> bool:
        """A config with ``warp_specialized`` (sm_90's default) on an sm_90 GPU (not the interpreter), one pass,
        float8_e4m3fn k and v (or pages TMA reads in place) with at least one key row (or page), D 64, 128 or
        256 (:func:`gluon_hopper.gluon_eligible`: no score_mod, mask tensor, chunk or mask_mod), a
        positive scale and at most 2**31 - 2**20 Q blocks of 128 rows. q, k, v TMA cannot read are copied; a
        16-bit q is quantized per row."""
        return (
            call.fp8_kv
            and not tiles.split
            and call.kv_rows >= 1
            and call.head_dim in HEAD_DIMS
            and call.softmax_scale > 0
            and triton.cdiv(call.q_bound, BLOCK_M) * call.batch * call.num_q_heads <= MAX_WORK_TILES
            and gluon_eligible(call, tiles.config)
            and (not call.paged or (call.tma_ready[1] and call.tma_ready[2]))
        )

    def spec(self, call: CheckedCall, tiles: Tiling) -> KernelSpec:
        head_dim, paged, ragged, window = call.head_dim, call.paged, call.ragged, call.mask_spec.has_window
        block_n, v_transposed = tile_n(head_dim), transposes_v(call)
        box = min(call.page_size, block_n) if paged else block_n
        num_work_tiles = triton.cdiv(call.q_bound, BLOCK_M) * call.batch * call.num_q_heads
        q_descale, k_descale, v_descale = call.descales
        constexprs = dict(
            WINDOW=window,
            RETURN_LSE=call.return_lse,
            HAS_SINKS=call.has_sinks,
            Q_ROWS=not call.fp8_q,
            Q_DESCALE=q_descale,
            K_DESCALE=k_descale,
            V_DESCALE=v_descale,
            RAGGED=ragged,
            PAGE_SIZE=call.page_size if paged else 0,
            STAGES=STAGES,
            TILE_N=block_n,
            V_TRANSPOSED=v_transposed,
            **_shared_layouts(head_dim),
        )
        unused = "*fp32"  # the pointers a variant never reads
        arg_types = dict(
            q_desc=descriptor_type(FP8, [1, 64, head_dim]),
            k_desc=descriptor_type(FP8, [1, box, head_dim]),
            v_desc=descriptor_type(FP8, [1, head_dim, block_n] if v_transposed else [1, box, v_box(head_dim)]),
            out_ptr="*" + TYPE_NAMES[call.dtype],
            lse_ptr="*fp32",
            q_scale_ptr="*fp32",
            q_descale_ptr="*fp32",
            k_descale_ptr="*fp32",
            v_descale_ptr="*fp32",
            sinks_ptr="*fp32",
            tile_counter="*i32" if window else unused,
            block_table_ptr="*i32" if paged else unused,
            seqlens_ptr="*i32" if paged else unused,
            cu_seqlens_q_ptr="*i32" if ragged else unused,
            cu_seqlens_k_ptr="*i32" if ragged and not paged else unused,
            qk_scale="fp32",
        )
        return KernelSpec(
            self.kernel,
            (max(1, min(num_work_tiles, num_programs_hint(call.device))),),
            constexprs,
            dict(num_warps=4, maxnreg=attention_config.GLUON_PREFILL_MAX_REGS[2]),
            arg_types,
            per_call=("seqlen_kv",) if call.dynamic_kv else (),
            divisible=("out_ptr",),
        )

    def launch(self, call: CheckedCall, tiles: Tiling) -> GluonFp8PrefillLaunch:
        return GluonFp8PrefillLaunch(call, self.spec(call, tiles))


BACKEND = GluonFp8Prefill()


def _vt_descriptor(vt: torch.Tensor, head_dim: int, block_n: int) -> TensorDescriptor:
    """Over :func:`fp8_vt.transposed_v`'s ``[B, Hkv * D, S']``: boxes of one KV head's D rows by ``block_n`` keys (a
    box past S' reads zeros)."""
    block = [1, head_dim, block_n]
    return TensorDescriptor(vt, list(vt.shape), list(vt.stride()), block, _nvmma_layout(block, gl.float8e4nv))


def _descale_strides(descale: torch.Tensor | None) -> tuple[int, int]:
    """(batch, kv head) strides of a float32 ``[B|1, Hkv|1]`` descale: 0 along a broadcast (size-1) dim."""
    if descale is None:
        return 0, 0
    return tuple(0 if size == 1 else stride for size, stride in zip(descale.shape, descale.stride()))


class GluonFp8PrefillLaunch:
    """The FP8 prefill kernel's launch for one plan: a 16-bit q quantized per row, q, k, v TMA cannot read copied,
    the descriptors laid out, the descales as given (any strides: the plan's key holds them), tile counters of its
    own per stream for masked calls; bound at the first call."""

    def __init__(self, call: CheckedCall, spec: KernelSpec):
        self.spec, self.bound, self.call = spec, None, call
        self.ragged, self.paged, self.dynamic = call.ragged, call.paged, call.dynamic_kv
        self.quantize_q = spec.constexprs["Q_ROWS"]
        self.v_transposed = spec.constexprs["V_TRANSPOSED"]
        self.copies = tuple(not ready for ready in call.tma_ready)
        if self.v_transposed:  # read through pointers: any strides
            self.copies = (*self.copies[:2], False)
        self.window = spec.constexprs["WINDOW"]
        mask = call.mask_spec
        self.sides = (mask.window_left, mask.window_right) if mask.has_window else (UNBOUNDED, UNBOUNDED)
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
        unread = dummy(out.device, torch.float32)  # pointers a variant never reads
        q_scales, copies = unread, self.copies
        if self.quantize_q:  # a fresh contiguous e4m3 q and its row scales
            q, q_scales = quantize_rows(q)
            copies = (False, *copies[1:])
        q, k, v, cu_q, cu_k, block_table, seqlens = launch_operands(
            q, k, v, kv_cache, cu_seqlens_q, cu_seqlens_k, copies, self.ragged, self.paged, unread
        )
        q_descale, k_descale, v_descale = (unread if descale is None else descale for descale in descales)
        k_desc, v_desc = (sequence_rows(k), sequence_rows(v)) if self.dynamic else (k, v)
        if self.v_transposed:  # [B, Hkv * D, S'], fresh per call
            vt = transposed_v(v)
            v_desc = (vt, vt.shape, vt.stride())
        values = (q, k_desc, v_desc, out, unread if lse is None else lse, q_scales, q_descale, k_descale, v_descale)
        values = (*values, unread if sinks is None else sinks.contiguous())  # float32 [Hq]
        counter = dummy(out.device, torch.int32)
        values = (*values, counter, cu_q, cu_k, block_table, seqlens)
        if self.dynamic:
            values = (*values, k.shape[1])
        if not self.window:
            (self.bound or self._bind(values, k, v, descales))(*values)
            return
        with self.lock:
            values = (*values[:10], take_tile_counter(self.counters, out.device), *values[11:])
            (self.bound or self._bind(values, k, v, descales))(*values)

    def _bind(self, values, k, v, descales) -> BoundKernel:
        (
            q,
            _,
            v_desc,
            out,
            lse,
            q_scales,
            q_descale,
            k_descale,
            v_descale,
            sinks,
            counter,
            cu_q,
            cu_k,
            block_table,
            seqlens,
        ) = values[:15]
        call, spec = self.call, self.spec
        block_n, page_size = spec.constexprs["TILE_N"], spec.constexprs["PAGE_SIZE"]
        head_dim = call.head_dim
        box = min(page_size, block_n) if self.paged else block_n
        total_q, total_k, stride_block_table, max_pages, num_pages, seqlen_kv = kv_extents(
            q, k, block_table, self.ragged, self.paged, page_size
        )
        num_m_blocks = triton.cdiv(call.q_bound, BLOCK_M)
        strides = [stride for descale in descales for stride in _descale_strides(descale)]
        left, right = self.sides
        self.bound = spec.bind(
            _descriptor(q, 64),
            _descriptor(k, box),
            _vt_descriptor(v_desc[0], head_dim, block_n) if self.v_transposed else _descriptor(v, box, v_box(head_dim)),
            out,
            lse,
            q_scales,
            q_descale,
            k_descale,
            v_descale,
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
            *strides,
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


def _prefill_call(
    head_dim: int,
    causal: bool,
    return_lse: bool,
    descales: bool,
    fp8_q: bool,
    page_size: int,
    ragged: bool,
    seqlen_q: int,
    sinks: bool,
    device: torch.device,
) -> CheckedCall:
    """An FP8 call of the kernel's layout, without tensors (what an ahead-of-time compile needs)."""
    mask = MaskSpec(has_window=True, window_right=0) if causal else MaskSpec()
    return CheckedCall(
        ragged,
        page_size > 0,
        1,
        8,
        2,
        head_dim,
        4,
        seqlen_q,
        4096,
        mask,
        ScoreModSpec(),
        head_dim**-0.5,
        device,
        dtype=torch.bfloat16,
        q_rows=seqlen_q,
        kv_rows=4096,
        page_size=page_size,
        has_sinks=sinks,
        return_lse=return_lse,
        kv_token_rows=True,
        tma_ready=(True, True, True),
        fp8_q=fp8_q,
        fp8_kv=True,
        descales=(descales and fp8_q, descales, descales),
    )


def compile_for_sm90(
    head_dim: int,
    causal: bool,
    *,
    return_lse: bool = False,
    descales: bool = True,
    fp8_q: bool = True,
    page_size: int = 0,
    ragged: bool = False,
    seqlen_q: int = 4096,
    sinks: bool = False,
) -> dict:
    """Compiles the kernel for sm_90a without a GPU (ptxas from the Triton wheel runs, nothing launches) and
    returns the compiled kernel's ``asm`` dict (``ttgir``, ``ptx``, ``cubin``, ...): the backend's
    :class:`KernelSpec` for an FP8 call of that layout: ``fp8_q`` False: a bf16 q quantized per row;
    ``page_size`` > 0: K/V in a paged cache of that page size; ``ragged``: q (and K/V unless paged) ragged;
    ``sinks``: with attention sinks; ``seqlen_q``: the call's queries (over 4096 keys; dense K/V are transposed in
    memory first from :data:`V_READS` work tiles per KV head, :func:`transposes_v`). Run it with
    ``TRITON_INTERPRET`` unset or 0 (see :func:`gluon_hopper.compile_for_sm90`)."""
    from triton.backends.compiler import GPUTarget

    if head_dim not in HEAD_DIMS:
        raise ValueError(f"head_dim must be one of {HEAD_DIMS}, got {head_dim}")
    config = FA4Config(warp_specialized=True)
    with pretend_gpu((9, 0)) as device:  # the spec's grid asks the device for its SMs
        spec = BACKEND.spec(
            _prefill_call(head_dim, causal, return_lse, descales, fp8_q, page_size, ragged, seqlen_q, sinks, device),
            attention_config.tiling(config, False, 1, 1, 1, 1),
        )
    compiled = triton.compile(spec.ast_source(), target=GPUTarget("cuda", 90, 32), options=dict(spec.options))
    return compiled.asm
