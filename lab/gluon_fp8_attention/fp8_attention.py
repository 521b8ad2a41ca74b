"""Lab prototype: FP8 (e4m3) attention forward for Hopper (sm_90a) in Gluon, FA3-style. Self-contained: nothing
in the library imports it.

    out = fp8_attention(q, k, v, q_descale, k_descale, v_descale, causal=False)   # bf16 [B, Sq, Hq, D]

q ``[B, Sq, Hq, D]``, k / v ``[B, Skv, Hkv, D]`` float8_e4m3fn (D = 64, 128 or 256; Hq a multiple of Hkv),
descales float32 ``[B, Hkv]`` (FA3's convention: the real tensors are ``q.float() * q_descale[b, h // group]``
and so on); softmax scale ``D ** -0.5``; causal is bottom-right aligned (query i sees keys
``j <= i + Skv - Sq``). Design, compile results and open points: NOTES.md next to this file.

Schedule (the structure of ``src/llmkernels/attention/gluon_hopper.py``, FP8 operands):

* persistent grid, one program per SM, work tiles = 128 query rows of one (batch, q head), head-major; causal
  tiles handed out longest first through an atomic counter;
* a **producer** warpgroup (4 warps, 24 registers) issues the TMA loads (Q once per tile, K and V tiles
  through rings of ``stages``) and **transposes V**: fp8 wgmma wants its B operand K-major, i.e. ``V^T`` with
  keys contiguous. V arrives by TMA as ``[TILE_N, 32]`` column boxes (``[64, 64]`` at D = 256, 64-key tiles),
  each is read into registers, relabelled ``[dims, keys]`` (``gl.permute``: no data moves) and stored into the
  ``[D, TILE_N]`` ``V^T`` stage; fence.proxy.async, a barrier of the producer's warps, then ``vt_ready``. The
  raw V ring is separate from the ``V^T`` ring, so that tile ``j + 1`` lands while ``j`` is transposed. With
  ``permute_keys`` (default) the keys are permuted within each 32-key block on the way (:func:`_to_operand`);
* two **consumer** warpgroups (240 registers), 64 query rows each: ``S = Q K^T`` as an e4m3 x e4m3 wgmma
  (both operands from shared memory, K-major), fp32 accumulate; online softmax on raw scores with
  ``c = q_descale * k_descale * D^-0.5 * log2(e)`` folded into the one FMA of the exp2 argument;
  ``P = exp2(s c - m c + 8)`` i.e. probabilities times 256, rounded to e4m3 (RNE, satfinite) and used from
  registers as the A operand of the e4m3 x e4m3 ``P V`` wgmma (B = ``V^T`` stage, permuted view). The factor
  256 keeps probabilities down to 2^-14 normal in e4m3 (2^-6 without it) and cancels in ``O / l``; ``l`` sums
  the unrounded fp32 probabilities. At the end ``O * v_descale / l`` is stored as bf16. Default order
  (``fused_pv``, :func:`_fused_step`): softmax of S_j, issue S_{j+1}, rescale O, issue P_j V_j, wait both;
  ``fused_pv=False``: FA3's order (S_j with P_{j-1} V_{j-1}, P loop-carried);
* softmax variants (FA4's, default off): ``cond_rescale`` moves the exponent reference only when some row of the
  warpgroup grew by more than ``rescale_threshold`` (4 log2 units; P then carries 2^(8 - 4) so that it stays
  <= 256), and skips O's rescale (64 FMUL per thread) and alpha otherwise (:func:`_softmax_cond`);
  ``poly_fraction`` (1/8, 1/4) computes that share of the exp2s with a polynomial on the FMA pipe
  (:func:`_exp2_mixed`, :func:`_exp2_poly`) instead of MUFU.EX2.

:func:`compile_for_sm90` builds the kernel without a GPU (``TRITON_INTERPRET`` must be unset / 0).
"""

from __future__ import annotations

import re

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

__all__ = ["fp8_attention", "compile_for_sm90", "reference_attention", "HEAD_DIMS"]

LOG2E = 1.4426950408889634
HEAD_DIMS = (64, 128, 256)
BLOCK_M = 128  # query rows per work tile: two consumer warpgroups of 64


def _tile_n(head_dim: int) -> int:
    """Keys per K/V tile: 128, or 64 at D = 256 (128 would need 262 KB of shared memory and spill)."""
    return 64 if head_dim == 256 else 128


def _v_chunk(head_dim: int) -> int:
    """V arrives as D / chunk column boxes of [TILE_N, chunk] for the in-register transpose: 32 (32-byte swizzle)
    with 128-key tiles, 64 (64-byte swizzle) with 64-key tiles (the transposer's layout covers 4 KB a box)."""
    return 64 if _tile_n(head_dim) == 64 else 32


P_SHIFT = gl.constexpr(8.0)  # P is stored times 2^8 in e4m3
# cond_rescale: the exponent reference moves only when some row of the warpgroup grew by more than the threshold
# T (log2 units of the scaled scores); P is then stored times 2^(8 - T) instead of 2^8, so that
# p <= 2^(T + 8 - T) = 256 < 448 (e4m3's largest finite). Right after a move p <= 2^(8 - T): with T = 4,
# probabilities stay e4m3-normal down to 2^-(6 + 4) = 2^-10 of the row max (subnormal to 2^-13), against 2^-14
# (2^-17) with the fixed 2^8. See NOTES.md, "Conditional rescaling".
RESCALE_THRESHOLD = 4.0  # the default T (rescale_threshold); 0 < T <= 8
POLY_FRACTIONS = (0.0, 0.125, 0.25)  # poly_fraction: the share of exp2s computed on the FMA units
# Registers: 12 warps (consumer 0 = default partition, consumer 1, producer warpgroup). maxnreg 168 = 65536 / 384
# rounded to 8; setmaxnreg then gives 2 x 128 x 240 + 128 x 24 = 64512 = 168 x 384.
MAX_REGS = 168
CONSUMER_REGS = gl.constexpr(240)
PRODUCER_REGS = gl.constexpr(24)
PRODUCER_WARPS = gl.constexpr(4)

# Names that differ between Triton 3.6 (the GPU machine) and 3.9 (the CPU machine).
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
_partition_barrier = getattr(gl, "thread_barrier", None) or gl.barrier


@gluon.jit
def _as_box(buffer):
    """A ``[rows, cols]`` shared tile as the ``[1, rows, cols]`` box of a per-sequence 3-D descriptor."""
    return buffer.reshape([1, buffer.shape[0], buffer.shape[1]])


@gluon.jit
def _tile_block(
    tile, seqlen_q, seqlen_kv, num_q_heads, group_size, num_m_blocks, CAUSAL: gl.constexpr, TILE_N: gl.constexpr
):
    """Work tile ``tile``: ``(batch, q head, kv head, first query row, number of key tiles)``. Head-major; causal
    blocks of a head run longest (last rows) first. At least one key tile, so that every block runs."""
    pid_bh = tile // num_m_blocks
    pid_m = tile % num_m_blocks
    if CAUSAL:
        pid_m = num_m_blocks - 1 - pid_m
    batch = pid_bh // num_q_heads
    head = pid_bh % num_q_heads
    q_start = pid_m * 128
    if CAUSAL:
        q_last = gl.minimum(q_start + 128, seqlen_q) - 1
        kv_hi = gl.minimum(q_last + seqlen_kv - seqlen_q + 1, seqlen_kv)
        num_tiles = gl.maximum(gl.cdiv(kv_hi, TILE_N), 1)
    else:
        num_tiles = gl.maximum(gl.cdiv(seqlen_kv, TILE_N), 1)
    return batch, head, head // group_size, q_start, num_tiles


@gluon.jit
def _publish_tile(tile, count, schedule):
    """The producer hands work tile ``tile`` (its ``count``-th) to the consumers through a 2-slot ring."""
    tile_smem, tile_ready, tile_empty = schedule
    slot = count % 2
    mbarrier.wait(tile_empty.index(slot), ((count // 2) & 1) ^ 1)
    tile_smem.index(slot).store(gl.full([1], tile, gl.int32, layout=gl.BlockedLayout([1], [32], [4], [0])))
    _partition_barrier()
    mbarrier.arrive(tile_ready.index(slot))


@gluon.jit
def _receive_tile(count, schedule):
    tile_smem, tile_ready, tile_empty = schedule
    slot = count % 2
    mbarrier.wait(tile_ready.index(slot), (count // 2) & 1)
    tile = gl.max(tile_smem.index(slot).load(gl.BlockedLayout([1], [32], [4], [0])), axis=0)
    mbarrier.arrive(tile_empty.index(slot))
    return tile


@gluon.jit
def _transpose_v(position, vraw_smem, vt_smem, vraw_ready, vt_ready, vt_empty, PERMUTE_KEYS: gl.constexpr):
    """Producer: V tile at ring position ``position``, landed in ``vraw_smem`` as ``[CHUNKS, TILE_N, CH]``,
    written transposed into ``vt_smem[stage]`` (``[D, TILE_N]``, keys contiguous) once the consumers released
    that stage; then ``vt_ready``."""
    STAGES: gl.constexpr = vt_smem.shape[0]
    CHUNKS: gl.constexpr = vraw_smem.shape[0] // STAGES
    CH: gl.constexpr = vraw_smem.shape[2]
    N: gl.constexpr = vraw_smem.shape[1]
    gl.static_assert((N == 128 and CH == 32) or (N == 64 and CH == 64))
    # the fourth warp bit: key bit 6 for [128 keys, 32 dims] boxes, dim bit 5 for [64 keys, 64 dims] (D = 256)
    WARP_BASE: gl.constexpr = [64, 0] if N == 128 else [0, 32]
    if PERMUTE_KEYS:
        # thread: keys {2c, 2c+1, 2c+8, 2c+9} (+16, +32...) x 8 dims: the keys whose P values one thread holds
        # in the S accumulator, which sigma sends to 4 consecutive P' columns (see _to_operand)
        load_layout: gl.constexpr = gl.DistributedLinearLayout(
            reg_bases=[[0, 1], [0, 2], [0, 4], [1, 0], [8, 0]],
            lane_bases=[[2, 0], [4, 0], [0, 8], [0, 16], [16, 0]],
            warp_bases=[[32, 0], WARP_BASE],
            block_bases=[],
            shape=[N, CH],
        )
    else:
        # thread: 4 keys x 8 dims (four 8-byte loads); after the permute 8 dims x 4 keys (eight 4-byte stores)
        load_layout: gl.constexpr = gl.BlockedLayout([4, 8], [32 // (CH // 8), CH // 8], [4, 1], [1, 0])
    stage = position % STAGES
    phase = (position // STAGES) & 1
    mbarrier.wait(vraw_ready.index(stage), phase)
    mbarrier.wait(vt_empty.index(stage), phase ^ 1)
    vt = vt_smem.index(stage)
    for c in gl.static_range(CHUNKS):
        x = vraw_smem.index(stage * CHUNKS + c).load(load_layout)
        if PERMUTE_KEYS:  # row x of the tile becomes key sigma(x): V'[x] = V[sigma(x)]
            x = x.reshape([N // 32, 2, 2, 4, 2, CH]).permute((0, 1, 3, 2, 4, 5)).reshape([N, CH])
        vt.slice(c * CH, CH, dim=0).store(gl.permute(x, (1, 0)))
    fence_async_shared()  # the generic-proxy stores, before wgmma (async proxy) reads them
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
    PERMUTE_KEYS: gl.constexpr,
):
    """Loads and transposes. Per work tile: publish it, load its two 64-row Q tiles once the consumers released
    the last ones, then for each key tile i: K_i into the K ring, V_i's column boxes into the raw ring, and
    transpose V_{i-1} meanwhile (the last one after the loop)."""
    q_desc, k_desc, v_desc = descs
    q_smem, k_smem, vraw_smem, vt_smem = smem
    q_ready, q_empty, k_ready, k_empty, vraw_ready, vt_ready, vt_empty = bars
    STAGES: gl.constexpr = k_smem.shape[0]
    N: gl.constexpr = k_smem.shape[1]
    HEAD_DIM: gl.constexpr = k_smem.shape[2]
    CHUNKS: gl.constexpr = vraw_smem.shape[0] // STAGES
    CH: gl.constexpr = vraw_smem.shape[2]
    TILE_BYTES: gl.constexpr = N * HEAD_DIM  # e4m3: one byte each
    tile = gl.program_id(0)
    count = 0
    loaded = 0
    while tile < num_work_tiles:
        batch, head, kv_head, q_start, num_tiles = _tile_block(
            tile, seqlen_q, seqlen_kv, num_q_heads, group_size, num_m_blocks, CAUSAL, N
        )
        _publish_tile(tile, count, schedule)
        for c in gl.static_range(2):
            mbarrier.wait(q_empty.index(c), (count & 1) ^ 1)
            mbarrier.expect(q_ready.index(c), q_desc.block_type.nbytes)
            _tma_load(q_desc, [batch, q_start + c * 64, head * HEAD_DIM], q_ready.index(c), _as_box(q_smem.index(c)))
        for i in range(num_tiles):
            position = loaded + i
            stage = position % STAGES
            phase = (position // STAGES) & 1
            key = i * N
            mbarrier.wait(k_empty.index(stage), phase ^ 1)
            mbarrier.expect(k_ready.index(stage), TILE_BYTES)
            _tma_load(k_desc, [batch, key, kv_head * HEAD_DIM], k_ready.index(stage), _as_box(k_smem.index(stage)))
            # The raw V stage was last read by this partition's transpose of position - STAGES, which ended in a
            # barrier of the producer's warps: it is free.
            mbarrier.expect(vraw_ready.index(stage), TILE_BYTES)
            for c in gl.static_range(CHUNKS):
                _tma_load(
                    v_desc,
                    [batch, key, kv_head * HEAD_DIM + c * CH],
                    vraw_ready.index(stage),
                    _as_box(vraw_smem.index(stage * CHUNKS + c)),
                )
            if i > 0:
                _transpose_v(position - 1, vraw_smem, vt_smem, vraw_ready, vt_ready, vt_empty, PERMUTE_KEYS)
        _transpose_v(loaded + num_tiles - 1, vraw_smem, vt_smem, vraw_ready, vt_ready, vt_empty, PERMUTE_KEYS)
        loaded += num_tiles
        count += 1
        if CAUSAL:
            tile = gl.num_programs(0) + gl.atomic_add(tile_counter, 1)
        else:
            tile += gl.num_programs(0)
    _publish_tile(num_work_tiles, count, schedule)  # no more work


@gluon.jit
def _exp2_poly(x):
    """``2^x`` for fp32 ``x <= 127`` without MUFU (FA4's emulation): ``2^floor(x)`` through the exponent bits
    times a degree-3 polynomial of the fraction (Horner, 3 FFMA; relative error 8.7e-5, far below e4m3's
    2^-4); ``x <= -127`` (and -inf) gives exactly +0. The floor is the magic-number add ``x + 1.5 * 2^23``
    rounded down (``add.rm``: FADD, not FRND, which is a quarter-rate conversion), whose low mantissa bits are
    then ``floor(x)``: FMNMX, 3 FADD, 3 FFMA, SHL + IADD (or one LEA) per value."""
    x = gl.maximum(x, -127.0)
    big = gl.inline_asm_elementwise(
        "add.rm.ftz.f32 $0, $1, 0f4B400000;", "=f,f", [x], dtype=gl.float32, is_pure=True, pack=1
    )
    frac = x - (big - 12582912.0)  # in [0, 1)
    poly = gl.fma(gl.fma(gl.fma(frac, 0.07705804610896776, 0.22764557917179307), frac, 0.69512289274036), frac, 1.0)
    bits = poly.to(gl.int32, bitcast=True) + (big.to(gl.int32, bitcast=True) << 23)  # floor(x) into the exponent
    return bits.to(gl.float32, bitcast=True)


@gluon.jit
def _exp2_mixed(x, POLY: gl.constexpr):
    """``2^x`` of an S-accumulator-layout tile ``[64, N]``, the fraction ``POLY`` (0, 1/8 or 1/4) of its columns
    by :func:`_exp2_poly`, the rest by ``gl.exp2`` (MUFU.EX2). Column ``32a + 16b + 8e + 2c + p``: ``p``, ``e``,
    ``b``, ``a`` are register bits of the accumulator layout, ``c`` the lane bit pair. The reshape / permute
    puts ``b, e, p`` last and ``gl.split`` peels register bits off, so no value moves: 1/4 = the columns with
    ``p = e = 1``, 1/8 those with ``b = 1`` too (every thread: 16 or 8 of its 64 values)."""
    if POLY == 0.0:
        return gl.exp2(x)
    else:
        gl.static_assert(POLY == 0.125 or POLY == 0.25)
        M: gl.constexpr = x.shape[0]
        N: gl.constexpr = x.shape[1]
        y = x.reshape([M, N // 32, 2, 2, 4, 2]).permute((0, 1, 4, 2, 3, 5)).reshape([M, N // 8, 2, 2, 2])
        p0, p1 = gl.split(y)  # [M, N / 8, 2 (b), 2 (e)]
        e0, e1 = gl.split(p1)  # [M, N / 8, 2 (b)]
        if POLY == 0.25:
            e1 = _exp2_poly(e1)
        else:
            b0, b1 = gl.split(e1)
            e1 = gl.join(gl.exp2(b0), _exp2_poly(b1))
        y = gl.join(gl.exp2(p0), gl.join(gl.exp2(e0), e1))
        y = y.reshape([M, N // 32, 4, 2, 2, 2]).permute((0, 1, 3, 4, 2, 5)).reshape([M, N])
        return gl.convert_layout(y, x.type.layout)  # the same linear layout, relabelled: no data moves


@gluon.jit
def _softmax_cond(
    s,
    m_i,
    l_i,
    acc,
    j,
    rows,
    seqlen_kv,
    shift,
    c,
    MASKED: gl.constexpr,
    CAUSAL: gl.constexpr,
    POLY: gl.constexpr,
    THRESHOLD: gl.constexpr,
):
    """cond_rescale's online softmax (FA4): ``(p * 2^(8 - THRESHOLD + delta), m, l, acc)`` with ``m`` the exponent
    reference (raw scores), which moves only when some row of the 64 grew by more than THRESHOLD (scaled, log2
    units; delta = (true max - m) c in [0, THRESHOLD], so p <= 256); then every row moves to its running max, and O and
    l are rescaled by alpha inside the branch (warpgroup-uniform: a reduced scalar). Otherwise no alpha, no
    ``acc * alpha`` (64 FMUL / thread) and no l rescale. O / l is unchanged whatever the reference. Called with
    no wgmma in flight (fused schedule): the branch touches O."""
    N: gl.constexpr = s.shape[1]
    if MASKED:
        cols = gl.expand_dims(j * N + gl.arange(0, N, layout=gl.SliceLayout(0, s.type.layout)), 0)
        valid = cols < seqlen_kv
        if CAUSAL:
            valid = valid & (cols <= gl.expand_dims(rows + shift, 1))
        s = gl.where(valid, s, float("-inf"))
    m_tile = gl.max(s, axis=1)
    # m_i = -inf (no key seen yet) and m_tile finite: inf > threshold; m_tile = -inf (nothing visible): -inf or NaN
    grown = gl.where((m_tile - m_i) * c > THRESHOLD, 1, 0)
    if gl.max(grown, axis=0) > 0:
        m_new = gl.maximum(m_i, m_tile)
        m_scaled = m_new * c
        if MASKED:
            m_scaled = gl.where(m_new == float("-inf"), 0.0, m_scaled)
        alpha = gl.exp2(m_i * c - m_scaled)
        l_i = l_i * alpha
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, acc.type.layout)), 1)
        m_i = m_new
    m_ref = m_i * c
    if MASKED:  # a row that has seen no key yet keeps m = -inf: p = exp2(-inf) = 0
        m_ref = gl.where(m_i == float("-inf"), 0.0, m_ref)
    P_SHIFT_COND: gl.constexpr = P_SHIFT - THRESHOLD
    p = _exp2_mixed(gl.fma(s, c, gl.expand_dims(P_SHIFT_COND - m_ref, 1)), POLY)
    l_i = l_i + gl.sum(p, axis=1)
    return p, m_i, l_i, acc


@gluon.jit
def _softmax_tile(
    s, m_i, l_i, j, rows, seqlen_kv, shift, c, MASKED: gl.constexpr, CAUSAL: gl.constexpr, POLY: gl.constexpr = 0.0
):
    """Online softmax of raw fp8-product scores ``s`` (key tile j): ``(p * 2^8, m, l, alpha)``; m is the running
    max of raw scores, ``c > 0`` the scale (descales, softmax scale, log2 e) folded into the exponent."""
    N: gl.constexpr = s.shape[1]
    if MASKED:
        cols = gl.expand_dims(j * N + gl.arange(0, N, layout=gl.SliceLayout(0, s.type.layout)), 0)
        valid = cols < seqlen_kv
        if CAUSAL:
            valid = valid & (cols <= gl.expand_dims(rows + shift, 1))
        s = gl.where(valid, s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, axis=1))
    m_scaled = m_new * c
    if MASKED:  # a row that has seen no key yet: alpha and p are exp2(-inf) = 0, not NaN
        m_scaled = gl.where(m_new == float("-inf"), 0.0, m_scaled)
    alpha = gl.exp2(m_i * c - m_scaled)
    p = _exp2_mixed(gl.fma(s, c, gl.expand_dims(P_SHIFT - m_scaled, 1)), POLY)
    l_new = l_i * alpha + gl.sum(p, axis=1)
    return p, m_new, l_new, alpha


@gluon.jit
def _to_operand(p, HEAD_DIM: gl.constexpr, PERMUTE_KEYS: gl.constexpr):
    """fp32 probabilities ``[64, 128]`` in the S accumulator layout -> e4m3 A operand of the P V wgmma.

    PERMUTE_KEYS: the columns are relabelled instead of moved. Per 32-key block, the accumulator gives lane
    ``c`` (= lane % 4) columns ``{2c, 2c+1, 8+2c, 9+2c, 16+2c, 17+2c, 24+2c, 25+2c}``; the e4m3 A fragment of
    ``m64nNk32`` wants ``{4c..4c+3, 16+4c..16+4c+3}``. With key = 32b + 16h + 8e + 2c + p and
    ``sigma^-1(key) = 32b + 16h + 4c + 2e + p``, column x of P' is column sigma(x) of P and is already in the
    thread that needs it: the reshape / permute below changes no data, and the convert_layout only reorders
    bytes within a thread (no shuffles). The transpose writes V' (row x = key sigma(x)) to match:
    P' V' = P V."""
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_DIM, 32]
    )
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=4)
    if PERMUTE_KEYS:  # relabel, move the fp32 values within the thread (free), then round in place
        N: gl.constexpr = p.shape[1]
        p = p.reshape([64, N // 32, 2, 2, 4, 2]).permute((0, 1, 2, 4, 3, 5)).reshape([64, N])
        return gl.convert_layout(p, p_layout).to(gl.float8e4nv)
    return gl.convert_layout(p.to(gl.float8e4nv), p_layout)


@gluon.jit
def _consumer_step(
    i,
    j,
    q,
    smem,
    bars,
    p,
    m_i,
    l_i,
    acc,
    rows,
    s_zero,
    seqlen_kv,
    shift,
    c,
    MASKED: gl.constexpr,
    CAUSAL: gl.constexpr,
    PERMUTE_KEYS: gl.constexpr,
    POLY: gl.constexpr,
):
    """Ring position i, key tile j: issue ``S_j = Q K_j^T`` and ``O += P_{j-1} V_{j-1}`` (both e4m3 wgmmas), the
    softmax of S_j once the first is done, then rescale O."""
    q_smem, k_smem, vraw_smem, vt_smem = smem
    q_ready, q_empty, k_ready, k_empty, vraw_ready, vt_ready, vt_empty = bars
    STAGES: gl.constexpr = k_smem.shape[0]
    stage = i % STAGES
    prev = (i - 1) % STAGES
    mbarrier.wait(k_ready.index(stage), (i // STAGES) & 1)
    s = warpgroup_mma(q, k_smem.index(stage).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    mbarrier.wait(vt_ready.index(prev), ((i - 1) // STAGES) & 1)
    acc = warpgroup_mma(p, vt_smem.index(prev).permute((1, 0)), acc, is_async=True)
    s = warpgroup_mma_wait(num_outstanding=1, deps=(s,))
    mbarrier.arrive(k_empty.index(stage))
    p_new, m_i, l_i, alpha = _softmax_tile(s, m_i, l_i, j, rows, seqlen_kv, shift, c, MASKED, CAUSAL, POLY)
    # The softmax's fp32 results pass through the wait (8-bit values cannot: Triton's wait lowering refuses them),
    # so that LLVM keeps the exponentials before it; the loop-carried e4m3 P (the in-flight wgmma's register
    # operand) is only written after the wait, never while the P V wgmma may still read its registers.
    acc, p_new, l_i, alpha = warpgroup_mma_wait(num_outstanding=0, deps=(acc, p_new, l_i, alpha))
    mbarrier.arrive(vt_empty.index(prev))
    p_new = _to_operand(p_new, acc.shape[1], PERMUTE_KEYS)
    acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, acc.type.layout)), 1)
    return p_new, m_i, l_i, acc


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
    c,
    turn,
    t,
    MASKED: gl.constexpr,
    CAUSAL: gl.constexpr,
    PERMUTE_KEYS: gl.constexpr,
    CONSUMER: gl.constexpr,
    PINGPONG: gl.constexpr,
    COND: gl.constexpr,
    THRESHOLD: gl.constexpr,
    POLY: gl.constexpr,
):
    """FUSED_PV schedule, ring position i, key tile j (not the block's last), ``s = S_j`` retired: softmax of S_j,
    issue ``S_{j+1}``, rescale O, round P_j and issue ``O += P_j V_j``, wait for both. P is produced and consumed
    in one step (not loop-carried): the e4m3 bytes go from the cvt straight into the wgmma's operand registers,
    and nothing runs between the P V wgmma and its wait, so its register operand cannot be overwritten in flight.
    The softmax overlaps the other consumer's wgmmas only. PINGPONG (FA3's warpgroup ping-pong): the consumers
    issue their wgmmas in turns (``turn``: this consumer waits for its turn, the ``t``-th, then hands it to the
    other), so that one's softmax runs while the other's products do. COND (cond_rescale): O is rescaled inside
    the softmax (:func:`_softmax_cond`), only when the reference moves, before S_{j+1} is issued (no wgmma in
    flight then)."""
    q_smem, k_smem, vraw_smem, vt_smem = smem
    q_ready, q_empty, k_ready, k_empty, vraw_ready, vt_ready, vt_empty = bars
    STAGES: gl.constexpr = k_smem.shape[0]
    HEAD_DIM: gl.constexpr = acc.shape[1]
    if COND:
        p, m_i, l_i, acc = _softmax_cond(
            s, m_i, l_i, acc, j, rows, seqlen_kv, shift, c, MASKED, CAUSAL, POLY, THRESHOLD
        )
    else:
        p, m_i, l_i, alpha = _softmax_tile(s, m_i, l_i, j, rows, seqlen_kv, shift, c, MASKED, CAUSAL, POLY)
    nxt = i + 1
    if PINGPONG:  # everything but the products first, then both products in this consumer's turn
        if not COND:
            acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, acc.type.layout)), 1)
        p8 = _to_operand(p, HEAD_DIM, PERMUTE_KEYS)
        mbarrier.wait(k_ready.index(nxt % STAGES), (nxt // STAGES) & 1)
        mbarrier.wait(vt_ready.index(i % STAGES), (i // STAGES) & 1)
        mbarrier.wait(turn.index(CONSUMER), t & 1)
        s_next = warpgroup_mma(q, k_smem.index(nxt % STAGES).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        acc = warpgroup_mma(p8, vt_smem.index(i % STAGES).permute((1, 0)), acc, is_async=True)
        mbarrier.arrive(turn.index(1 - CONSUMER))
    else:
        mbarrier.wait(k_ready.index(nxt % STAGES), (nxt // STAGES) & 1)
        s_next = warpgroup_mma(q, k_smem.index(nxt % STAGES).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        if not COND:
            acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, acc.type.layout)), 1)
        p8 = _to_operand(p, HEAD_DIM, PERMUTE_KEYS)
        mbarrier.wait(vt_ready.index(i % STAGES), (i // STAGES) & 1)
        acc = warpgroup_mma(p8, vt_smem.index(i % STAGES).permute((1, 0)), acc, is_async=True)
    s_next, acc = warpgroup_mma_wait(num_outstanding=0, deps=(s_next, acc))
    mbarrier.arrive(k_empty.index(nxt % STAGES))
    mbarrier.arrive(vt_empty.index(i % STAGES))
    return s_next, m_i, l_i, acc


@gluon.jit
def _consumer_block(
    tile,
    count,
    base,
    smem,
    bars,
    out_ptr,
    descales,
    seqlen_q,
    seqlen_kv,
    num_q_heads,
    num_kv_heads,
    group_size,
    num_m_blocks,
    sm_scale_log2,
    turn,
    t,
    CONSUMER: gl.constexpr,
    CAUSAL: gl.constexpr,
    PERMUTE_KEYS: gl.constexpr,
    FUSED_PV: gl.constexpr,
    PINGPONG: gl.constexpr,
    COND: gl.constexpr,
    THRESHOLD: gl.constexpr,
    POLY: gl.constexpr,
):
    """Consumer ``CONSUMER`` on work tile ``tile`` (this program's ``count``-th; its key tiles from ring position
    ``base``): query rows ``[q_start + 64 CONSUMER, + 64)``. Returns the number of key tiles of the block and the
    turns taken so far (PINGPONG: ``t`` turns before the block, one per wgmma issue: S of tile 0, each step, the
    last P V; both consumers take the same number, non-causal only)."""
    q_smem, k_smem, vraw_smem, vt_smem = smem
    q_ready, q_empty, k_ready, k_empty, vraw_ready, vt_ready, vt_empty = bars
    q_descale_ptr, k_descale_ptr, v_descale_ptr = descales
    N: gl.constexpr = k_smem.shape[1]
    HEAD_DIM: gl.constexpr = k_smem.shape[2]
    STAGES: gl.constexpr = k_smem.shape[0]
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, N, 32])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_DIM, 32]
    )
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)

    batch, head, kv_head, q_start, end_tile = _tile_block(
        tile, seqlen_q, seqlen_kv, num_q_heads, group_size, num_m_blocks, CAUSAL, N
    )
    shift = seqlen_kv - seqlen_q
    scale_index = batch * num_kv_heads + kv_head
    c = gl.load(q_descale_ptr + scale_index) * gl.load(k_descale_ptr + scale_index) * sm_scale_log2
    v_descale = gl.load(v_descale_ptr + scale_index)
    first_row = q_start + CONSUMER * 64
    rows = first_row + gl.arange(0, 64, layout=row_layout)
    # Tiles [1, band_hi): every row of this consumer sees all keys (no mask); [band_hi, my_end): masked; tiles
    # [my_end, end_tile) hold no key these rows see (the causal diagonal of the other consumer): only released.
    if CAUSAL:
        last_row = gl.minimum(first_row + 64, seqlen_q) - 1
        seen_hi = gl.minimum(last_row + shift + 1, seqlen_kv)
        my_end = gl.minimum(gl.maximum(gl.cdiv(seen_hi, N), 1), end_tile)
        full_hi = gl.minimum(first_row + shift + 1, seqlen_kv)
    else:
        my_end = end_tile
        full_hi = seqlen_kv
    band_hi = gl.maximum(gl.minimum(gl.maximum(full_hi, 0) // N, my_end), 1)
    offset = base  # ring position of key tile j: base + j

    q = q_smem.index(CONSUMER)
    mbarrier.wait(q_ready.index(CONSUMER), count & 1)
    s_zero = gl.zeros([64, N], gl.float32, layout=s_layout)
    acc = gl.zeros([64, HEAD_DIM], gl.float32, layout=o_layout)

    # Tile 0 alone: S and its softmax (masked).
    mbarrier.wait(k_ready.index(base % STAGES), (base // STAGES) & 1)
    if PINGPONG:
        mbarrier.wait(turn.index(CONSUMER), t & 1)
    s = warpgroup_mma(q, k_smem.index(base % STAGES).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    if PINGPONG:
        mbarrier.arrive(turn.index(1 - CONSUMER))
    t += 1
    s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
    mbarrier.arrive(k_empty.index(base % STAGES))
    m_i = gl.full([64], float("-inf"), gl.float32, layout=row_layout)
    l_i = gl.full([64], 0.0, gl.float32, layout=row_layout)
    if FUSED_PV:
        # tile j's P V in its own step (P not loop-carried): tile 0 (masked) if another follows, the unmasked
        # band, the masked tiles, then the last tile (masked, no next S)
        for j in range(0, gl.minimum(my_end - 1, 1)):
            s, m_i, l_i, acc = _fused_step(
                offset + j,
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
                c,
                turn,
                t + j,
                True,
                CAUSAL,
                PERMUTE_KEYS,
                CONSUMER,
                PINGPONG,
                COND,
                THRESHOLD,
                POLY,
            )
        for j in range(1, gl.minimum(band_hi, my_end - 1)):
            s, m_i, l_i, acc = _fused_step(
                offset + j,
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
                c,
                turn,
                t + j,
                False,
                CAUSAL,
                PERMUTE_KEYS,
                CONSUMER,
                PINGPONG,
                COND,
                THRESHOLD,
                POLY,
            )
        for j in range(gl.maximum(band_hi, 1), my_end - 1):
            s, m_i, l_i, acc = _fused_step(
                offset + j,
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
                c,
                turn,
                t + j,
                True,
                CAUSAL,
                PERMUTE_KEYS,
                CONSUMER,
                PINGPONG,
                COND,
                THRESHOLD,
                POLY,
            )
        mbarrier.arrive(q_empty.index(CONSUMER))  # every S of the block is done: the next Q may land
        last = offset + my_end - 1
        if COND:
            p, m_i, l_i, acc = _softmax_cond(
                s, m_i, l_i, acc, my_end - 1, rows, seqlen_kv, shift, c, True, CAUSAL, POLY, THRESHOLD
            )
        else:
            p, m_i, l_i, alpha = _softmax_tile(s, m_i, l_i, my_end - 1, rows, seqlen_kv, shift, c, True, CAUSAL, POLY)
            acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
        p = _to_operand(p, HEAD_DIM, PERMUTE_KEYS)
        mbarrier.wait(vt_ready.index(last % STAGES), (last // STAGES) & 1)
        t += my_end - 1  # the steps' turns
        if PINGPONG:
            mbarrier.wait(turn.index(CONSUMER), t & 1)
        acc = warpgroup_mma(p, vt_smem.index(last % STAGES).permute((1, 0)), acc, is_async=True)
        if PINGPONG:
            mbarrier.arrive(turn.index(1 - CONSUMER))
        t += 1
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(vt_empty.index(last % STAGES))
    else:
        gl.static_assert(not COND, "cond_rescale needs the fused schedule")
        p, m_i, l_i, alpha = _softmax_tile(s, m_i, l_i, 0, rows, seqlen_kv, shift, c, True, CAUSAL, POLY)
        p = _to_operand(p, HEAD_DIM, PERMUTE_KEYS)

        for j in range(1, band_hi):
            p, m_i, l_i, acc = _consumer_step(
                offset + j,
                j,
                q,
                smem,
                bars,
                p,
                m_i,
                l_i,
                acc,
                rows,
                s_zero,
                seqlen_kv,
                shift,
                c,
                False,
                CAUSAL,
                PERMUTE_KEYS,
                POLY,
            )
        for j in range(band_hi, my_end):
            p, m_i, l_i, acc = _consumer_step(
                offset + j,
                j,
                q,
                smem,
                bars,
                p,
                m_i,
                l_i,
                acc,
                rows,
                s_zero,
                seqlen_kv,
                shift,
                c,
                True,
                CAUSAL,
                PERMUTE_KEYS,
                POLY,
            )
        mbarrier.arrive(q_empty.index(CONSUMER))  # every S of the block is issued and done: the next Q may land

        last = offset + my_end - 1
        mbarrier.wait(vt_ready.index(last % STAGES), (last // STAGES) & 1)
        acc = warpgroup_mma(p, vt_smem.index(last % STAGES).permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(vt_empty.index(last % STAGES))
    for j in range(my_end, end_tile):  # tiles this consumer does not see: released once landed
        position = offset + j
        mbarrier.wait(k_ready.index(position % STAGES), (position // STAGES) & 1)
        mbarrier.arrive(k_empty.index(position % STAGES))
        mbarrier.wait(vt_ready.index(position % STAGES), (position // STAGES) & 1)
        mbarrier.arrive(vt_empty.index(position % STAGES))

    l_safe = gl.where(l_i == 0.0, 1.0, l_i)  # a row that saw no key: output 0
    factor = gl.convert_layout(v_descale / l_safe, gl.SliceLayout(1, o_layout))
    out = acc * gl.expand_dims(factor, 1)
    store_layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (HEAD_DIM // 8), HEAD_DIM // 8], [4, 1], [1, 0])
    out = gl.convert_layout(out.to(gl.bfloat16), store_layout)
    out_rows = first_row + gl.arange(0, 64, layout=gl.SliceLayout(1, store_layout))
    out_cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, store_layout))
    row_offsets = ((batch * seqlen_q + out_rows).to(gl.int64) * num_q_heads + head) * HEAD_DIM
    offsets = gl.expand_dims(row_offsets, 1) + gl.expand_dims(out_cols, 0)
    gl.store(out_ptr + offsets, out, mask=gl.expand_dims(out_rows < seqlen_q, 1))
    return end_tile, t


@gluon.jit
def _consumer_partition(
    smem,
    bars,
    schedule,
    out_ptr,
    descales,
    seqlen_q,
    seqlen_kv,
    num_q_heads,
    num_kv_heads,
    group_size,
    num_m_blocks,
    num_work_tiles,
    sm_scale_log2,
    turn,
    CONSUMER: gl.constexpr,
    CAUSAL: gl.constexpr,
    PERMUTE_KEYS: gl.constexpr,
    FUSED_PV: gl.constexpr,
    PINGPONG: gl.constexpr,
    COND: gl.constexpr,
    THRESHOLD: gl.constexpr,
    POLY: gl.constexpr,
):
    count = 0
    base = 0
    t = 0  # PINGPONG: this consumer's turns taken (consumer 0 opens the first)
    if PINGPONG and CONSUMER == 0:
        mbarrier.arrive(turn.index(0))
    tile = _receive_tile(count, schedule)
    while tile < num_work_tiles:
        tiles, t = _consumer_block(
            tile,
            count,
            base,
            smem,
            bars,
            out_ptr,
            descales,
            seqlen_q,
            seqlen_kv,
            num_q_heads,
            num_kv_heads,
            group_size,
            num_m_blocks,
            sm_scale_log2,
            turn,
            t,
            CONSUMER,
            CAUSAL,
            PERMUTE_KEYS,
            FUSED_PV,
            PINGPONG,
            COND,
            THRESHOLD,
            POLY,
        )
        base += tiles
        count += 1
        tile = _receive_tile(count, schedule)


@gluon.jit
def fp8_attention_kernel(
    q_desc,
    k_desc,
    v_desc,
    out_ptr,
    q_descale_ptr,
    k_descale_ptr,
    v_descale_ptr,
    tile_counter,
    seqlen_q,
    seqlen_kv,
    num_q_heads,
    num_kv_heads,
    group_size,
    num_m_blocks,
    num_work_tiles,
    sm_scale_log2,
    CAUSAL: gl.constexpr,
    Q_LAYOUT: gl.constexpr,
    K_LAYOUT: gl.constexpr,
    VRAW_LAYOUT: gl.constexpr,
    VT_LAYOUT: gl.constexpr,
    PERMUTE_KEYS: gl.constexpr,
    STAGES: gl.constexpr,
    FUSED_PV: gl.constexpr,
    PINGPONG: gl.constexpr,
    COND_RESCALE: gl.constexpr,
    THRESHOLD: gl.constexpr,
    POLY_FRACTION: gl.constexpr,
):
    """q_desc: e4m3 ``[B, Sq, Hq * D]`` block ``[1, 64, D]``; k_desc ``[B, Skv, Hkv * D]`` block ``[1, 128, D]``;
    v_desc the same tensor shape, block ``[1, 128, 32]``. out_ptr: bf16 ``[B, Sq, Hq, D]`` contiguous. Descales:
    float32 ``[B, Hkv]`` contiguous. tile_counter: int32 [1] zero (causal). sm_scale_log2: ``D^-0.5 log2(e)``.
    Grid ``(min(num_work_tiles, SMs),)``, num_warps 4, maxnreg 168."""
    HEAD_DIM: gl.constexpr = q_desc.block_type.shape[2]
    N: gl.constexpr = k_desc.block_type.shape[1]
    CH: gl.constexpr = v_desc.block_type.shape[2]
    CHUNKS: gl.constexpr = HEAD_DIM // CH
    dtype: gl.constexpr = q_desc.dtype
    q_smem = gl.allocate_shared_memory(dtype, [2, 64, HEAD_DIM], Q_LAYOUT)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, N, HEAD_DIM], K_LAYOUT)
    vraw_smem = gl.allocate_shared_memory(dtype, [STAGES * CHUNKS, N, CH], VRAW_LAYOUT)
    vt_smem = gl.allocate_shared_memory(dtype, [STAGES, HEAD_DIM, N], VT_LAYOUT)
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
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())  # PINGPONG: the consumers' turns
    for i in gl.static_range(2):
        mbarrier.init(turn.index(i), count=1)
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
    descales = (q_descale_ptr, k_descale_ptr, v_descale_ptr)
    gl.warp_specialize(
        [
            (
                _consumer_partition,
                (
                    smem,
                    bars,
                    schedule,
                    out_ptr,
                    descales,
                    seqlen_q,
                    seqlen_kv,
                    num_q_heads,
                    num_kv_heads,
                    group_size,
                    num_m_blocks,
                    num_work_tiles,
                    sm_scale_log2,
                    turn,
                    0,
                    CAUSAL,
                    PERMUTE_KEYS,
                    FUSED_PV,
                    PINGPONG,
                    COND_RESCALE,
                    THRESHOLD,
                    POLY_FRACTION,
                ),
            ),
            (
                _consumer_partition,
                (
                    smem,
                    bars,
                    schedule,
                    out_ptr,
                    descales,
                    seqlen_q,
                    seqlen_kv,
                    num_q_heads,
                    num_kv_heads,
                    group_size,
                    num_m_blocks,
                    num_work_tiles,
                    sm_scale_log2,
                    turn,
                    1,
                    CAUSAL,
                    PERMUTE_KEYS,
                    FUSED_PV,
                    PINGPONG,
                    COND_RESCALE,
                    THRESHOLD,
                    POLY_FRACTION,
                ),
            ),
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
                    PERMUTE_KEYS,
                ),
            ),
        ],
        [4, PRODUCER_WARPS],
        [CONSUMER_REGS, PRODUCER_REGS],
    )


# ---------------------------------------------------------------------------------------------------------------
# host side


def _layouts(head_dim: int) -> dict:
    fp8 = gl.float8e4nv
    return dict(
        Q_LAYOUT=gl.NVMMASharedLayout.get_default_for([64, head_dim], fp8),
        K_LAYOUT=gl.NVMMASharedLayout.get_default_for([_tile_n(head_dim), head_dim], fp8),
        VRAW_LAYOUT=gl.NVMMASharedLayout.get_default_for([_tile_n(head_dim), _v_chunk(head_dim)], fp8),
        VT_LAYOUT=gl.NVMMASharedLayout.get_default_for([head_dim, _tile_n(head_dim)], fp8),
    )


def _blocks(head_dim: int) -> dict:
    tile_n = _tile_n(head_dim)
    return dict(q_desc=[1, 64, head_dim], k_desc=[1, tile_n, head_dim], v_desc=[1, tile_n, _v_chunk(head_dim)])


def _descriptor(t: torch.Tensor, block) -> TensorDescriptor:
    """Per sequence ``[B, S, H * D]`` with t's batch and token strides: boxes past S read zeros."""
    batch, seqlen, heads, head_dim = t.shape
    layout = gl.NVMMASharedLayout.get_default_for(block, gl.float8e4nv)
    return TensorDescriptor(t, [batch, seqlen, heads * head_dim], [t.stride(0), t.stride(1), 1], block, layout)


def _tma_ready(t: torch.Tensor) -> torch.Tensor:
    ok = (
        t.stride(3) == 1
        and t.stride(2) == t.shape[3]
        and t.data_ptr() % 16 == 0
        and t.stride(0) % 16 == 0
        and t.stride(1) % 16 == 0
    )
    return t if ok else t.contiguous()


_SMS: dict = {}


def _num_sms(device: torch.device) -> int:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SMS:
        _SMS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SMS[index]


def fp8_attention(
    q,
    k,
    v,
    q_descale,
    k_descale,
    v_descale,
    causal: bool = False,
    permute_keys: bool = True,
    stages: int = 2,
    fused_pv: bool = True,
    pingpong: bool = False,
    cond_rescale: bool = False,
    poly_fraction: float = 0.0,
    rescale_threshold: float = RESCALE_THRESHOLD,
) -> torch.Tensor:
    """Attention forward on e4m3 inputs: ``softmax(D^-0.5 (q q_ds)(k k_ds)^T) (v v_ds)`` as bf16 ``[B, Sq, Hq, D]``
    (see the module docstring). Descales may be None (1.0). permute_keys: False reshuffles P across lanes instead
    (the first version, kept for comparison; only with fused_pv=False matters it little). stages: depth of the K,
    raw V and V^T rings (2 or 3). fused_pv (default): each tile's P V in the step of its softmax (P not
    loop-carried; see _fused_step); False: FA3's order (P_{j-1} V_{j-1} issued with S_j, P loop-carried).
    pingpong (non-causal, fused only): the consumers issue their wgmmas in turns. cond_rescale (fused only): the
    exponent reference moves only when a row grew by more than rescale_threshold (log2 units, 0 < T <= 8), O's
    rescale is skipped otherwise (P then carries 2^(8 - T) instead of 2^8). poly_fraction (0, 0.125, 0.25): that
    share of the exp2s on the FMA units (:func:`_exp2_poly`)."""
    if q.dtype != torch.float8_e4m3fn or k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError("q, k, v must be float8_e4m3fn")
    batch, seqlen_q, num_q_heads, head_dim = q.shape
    seqlen_kv, num_kv_heads = k.shape[1], k.shape[2]
    if head_dim not in HEAD_DIMS or k.shape != v.shape or k.shape[0] != batch or k.shape[3] != head_dim:
        raise ValueError(f"unsupported shapes q {tuple(q.shape)} k {tuple(k.shape)} v {tuple(v.shape)}")
    if num_q_heads % num_kv_heads or seqlen_kv < 1:
        raise ValueError("Hq must be a multiple of Hkv and Skv >= 1")
    _check_variant(fused_pv, cond_rescale, poly_fraction, rescale_threshold)

    def _scale(d):
        if d is None:
            return torch.ones(batch, num_kv_heads, dtype=torch.float32, device=q.device)
        return d.to(torch.float32).expand(batch, num_kv_heads).contiguous()

    q, k, v = _tma_ready(q), _tma_ready(k), _tma_ready(v)
    out = torch.empty(q.shape, dtype=torch.bfloat16, device=q.device)
    num_m_blocks = triton.cdiv(seqlen_q, BLOCK_M)
    num_work_tiles = num_m_blocks * batch * num_q_heads
    if num_work_tiles == 0:
        return out
    counter = torch.zeros(1, dtype=torch.int32, device=q.device)
    blocks = _blocks(head_dim)
    grid = (min(num_work_tiles, _num_sms(q.device)),)
    fp8_attention_kernel[grid](
        _descriptor(q, blocks["q_desc"]),
        _descriptor(k, blocks["k_desc"]),
        _descriptor(v, blocks["v_desc"]),
        out,
        _scale(q_descale),
        _scale(k_descale),
        _scale(v_descale),
        counter,
        seqlen_q,
        seqlen_kv,
        num_q_heads,
        num_kv_heads,
        num_q_heads // num_kv_heads,
        num_m_blocks,
        num_work_tiles,
        head_dim**-0.5 * LOG2E,
        CAUSAL=causal,
        PERMUTE_KEYS=permute_keys,
        STAGES=stages,
        FUSED_PV=fused_pv,
        PINGPONG=pingpong and fused_pv and not causal,  # turns need the same step count in both consumers
        COND_RESCALE=cond_rescale,
        THRESHOLD=float(rescale_threshold) if cond_rescale else 0.0,
        POLY_FRACTION=float(poly_fraction),
        **_layouts(head_dim),
        num_warps=4,
        maxnreg=MAX_REGS,
    )
    return out


def reference_attention(q, k, v, q_descale, k_descale, v_descale, causal: bool = False) -> torch.Tensor:
    """float64 attention on the dequantized inputs (the real tensors the fp8 ones stand for), ``[B, Sq, Hq, D]``.
    Memory: one float64 ``[Sq, Skv]`` score matrix per (batch, head) at a time."""
    batch, seqlen_q, num_q_heads, head_dim = q.shape
    seqlen_kv, num_kv_heads = k.shape[1], k.shape[2]
    group = num_q_heads // num_kv_heads
    out = torch.empty(q.shape, dtype=torch.float64, device=q.device)
    mask = None
    if causal:
        i = torch.arange(seqlen_q, device=q.device)[:, None]
        j = torch.arange(seqlen_kv, device=q.device)[None, :]
        mask = j <= i + seqlen_kv - seqlen_q
    for b in range(batch):
        for h in range(num_q_heads):
            g = h // group
            qd = q[b, :, h].double() * (1.0 if q_descale is None else float(q_descale[b, g]))
            kd = k[b, :, g].double() * (1.0 if k_descale is None else float(k_descale[b, g]))
            vd = v[b, :, g].double() * (1.0 if v_descale is None else float(v_descale[b, g]))
            s = (qd @ kd.T) * head_dim**-0.5
            if mask is not None:
                s = s.masked_fill(~mask, float("-inf"))
            p = torch.softmax(s, dim=-1)
            out[b, :, h] = torch.nan_to_num(p) @ vd
    return out


def _check_variant(fused_pv: bool, cond_rescale: bool, poly_fraction: float, threshold: float) -> None:
    if cond_rescale and not fused_pv:
        raise ValueError("cond_rescale needs fused_pv=True")
    if cond_rescale and not 0.0 < float(threshold) <= 8.0:
        raise ValueError("rescale_threshold must be in (0, 8]: P carries 2^(8 - threshold) and stays <= 256")
    if float(poly_fraction) not in POLY_FRACTIONS:
        raise ValueError(f"poly_fraction must be one of {POLY_FRACTIONS}")


def _descriptor_type(block) -> str:
    layout = gl.NVMMASharedLayout.get_default_for(block, gl.float8e4nv)
    return f"tensordesc<fp8e4nv[{', '.join(map(str, block))}],{layout!r}>"


def compile_for_sm90(
    head_dim: int = 128,
    causal: bool = False,
    permute_keys: bool = True,
    stages: int = 2,
    fused_pv: bool = True,
    pingpong: bool = False,
    cond_rescale: bool = False,
    poly_fraction: float = 0.0,
    rescale_threshold: float = RESCALE_THRESHOLD,
):
    """Compiles the kernel for sm_90a without a GPU (ptxas runs, nothing launches); returns the compiled kernel
    (``.asm`` dict: ttgir, ptx, cubin; ``.metadata``). Run with ``TRITON_INTERPRET`` unset or 0."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    _check_variant(fused_pv, cond_rescale, poly_fraction, rescale_threshold)
    fn = fp8_attention_kernel
    names = fn.arg_names
    constexprs = dict(
        CAUSAL=causal,
        PERMUTE_KEYS=permute_keys,
        STAGES=stages,
        FUSED_PV=fused_pv,
        PINGPONG=pingpong and fused_pv and not causal,
        COND_RESCALE=cond_rescale,
        THRESHOLD=float(rescale_threshold) if cond_rescale else 0.0,
        POLY_FRACTION=float(poly_fraction),
        **_layouts(head_dim),
    )
    signature, attrs = {}, {}
    types = {name: _descriptor_type(block) for name, block in _blocks(head_dim).items()}
    types.update(
        out_ptr="*bf16",
        q_descale_ptr="*fp32",
        k_descale_ptr="*fp32",
        v_descale_ptr="*fp32",
        tile_counter="*i32",
        sm_scale_log2="fp32",
    )
    for index, name in enumerate(names):
        if name in constexprs:
            signature[name] = "constexpr"
            continue
        signature[name] = types.get(name, "i32")
        if signature[name].startswith("*"):
            attrs[(index,)] = [["tt.divisibility", 16]]
    source = GluonASTSource(
        fn, signature, constexprs={(names.index(n),): v for n, v in constexprs.items()}, attrs=attrs
    )
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, maxnreg=MAX_REGS))


if __name__ == "__main__":  # quick compile of the default D = 128 kernel (compile_check.py for everything)
    compiled = compile_for_sm90(128, False)
    print(sorted(set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(\S+)", compiled.asm["ptx"]))))
    print("shared memory", compiled.metadata.shared)
