"""Warp-specialized attention forward in Gluon for Hopper (sm_90a), FA3's schedule.

One program computes a 128-row Q block of one (batch, q head) with three roles (``gl.warp_specialize``):

* a **load warp** issues the TMA loads: the two 64-row Q halves once, then K and V tiles through two
  separate ``NUM_STAGES``-deep shared-memory rings (``*_ready`` / ``*_empty`` mbarriers), so that K tile
  ``j + 1`` can land while V tile ``j`` is still read;
* two **consumer warpgroups** (the default partition and one worker), each owning 64 Q rows. Each runs
  ``S_j = Q K_j^T`` and ``O += P_{j-1} V_{j-1}`` as asynchronous wgmmas, and the online softmax of ``S_j``
  while ``P_{j-1} V_{j-1}`` is still on the tensor cores (intra-warpgroup overlap);
* **ping-pong** (``PINGPONG``): the consumers take turns issuing their pair of wgmmas (two ``turn``
  mbarriers), so that one warpgroup's softmax runs while the other's matmuls occupy the tensor cores.

Scores stay unscaled until the exponent: ``p = exp2(s * c - m * c)`` with ``c = softmax_scale * log2(e)``
is one FMA per score (``c > 0`` is required). Only tiles a consumer sees in part (the causal diagonal, the
last tile past Skv) are masked; causal blocks run longest first. TMA descriptors are per sequence
(``[B, S, H·D]``), so tiles past ``S`` read zeros, never the next sequence's rows.
"""
from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from .gluon_hopper import LOG2E, MAX_GRID_Y, _as_box, _check_inputs, _nvmma_layout, _store_layout

__all__ = ["gluon_attention_ws", "compile_ws_for_sm90"]

CONSUMER_ROWS = 64  # Q rows per consumer warpgroup: one m64 wgmma row block
BLOCK_M = 2 * CONSUMER_ROWS
NUM_STAGES = 2
HEAD_DIMS = (64, 128)
# Registers per thread: the consumer warpgroups get 240 each, the load warp's warpgroup 24-32; 12 warps in
# all (4 + 4 + 1 rounded up to warpgroups) share the SM's 64K registers.
CONSUMER_REGS = gl.constexpr(240)
LOADER_REGS = gl.constexpr(24)
MAX_REGS = 168  # 65536 / (12 * 32) rounded down to a multiple of 8; the default partition gets the rest

_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared


def _block_n(head_dim: int) -> int:
    """Keys per K/V tile: S (BLOCK_N / 2 fp32 per thread), P and O (head_dim / 2 fp32) fit 240 registers."""
    return 128


@gluon.jit
def _program_block(seqlen_kv, num_q_heads, group_size, CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr):
    """(batch, q head, kv head, first Q row, number of K/V tiles) of this program; every role computes it."""
    pid_m = gl.program_id(0)
    if CAUSAL:  # the longest rows (most key tiles) first, so that the last wave is of short ones
        pid_m = gl.num_programs(0) - 1 - pid_m
    pid_bh = gl.program_id(1)
    batch = pid_bh // num_q_heads
    head = pid_bh % num_q_heads
    q_start = pid_m * (2 * 64)
    if CAUSAL:  # Sq == Skv: keys up to the block's last row
        kv_end = gl.minimum(seqlen_kv, q_start + 2 * 64)
    else:
        kv_end = seqlen_kv
    return batch, head, head // group_size, q_start, gl.cdiv(kv_end, BLOCK_N)


@gluon.jit
def _load_partition(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, k_ready, k_empty, v_ready, v_empty,
                    seqlen_kv, num_q_heads, group_size, CAUSAL: gl.constexpr):
    """The load warp: Q's two halves, then K_j and V_j for every tile, each into its ring once released."""
    BLOCK_N: gl.constexpr = k_smem.shape[1]
    HEAD_DIM: gl.constexpr = k_smem.shape[2]
    STAGES: gl.constexpr = k_smem.shape[0]
    batch, head, kv_head, q_start, num_tiles = _program_block(seqlen_kv, num_q_heads, group_size, CAUSAL, BLOCK_N)
    for c in gl.static_range(2):
        mbarrier.expect(q_ready.index(c), q_desc.block_type.nbytes)
        _tma_load(q_desc, [batch, q_start + c * 64, head * HEAD_DIM], q_ready.index(c), _as_box(q_smem.index(c)))
    for j in range(num_tiles):
        stage = j % STAGES
        phase = (j // STAGES) & 1
        # Fresh mbarriers count as having completed the phase before 0: the first lap does not wait.
        mbarrier.wait(k_empty.index(stage), phase ^ 1)
        mbarrier.expect(k_ready.index(stage), k_desc.block_type.nbytes)
        _tma_load(k_desc, [batch, j * BLOCK_N, kv_head * HEAD_DIM], k_ready.index(stage), _as_box(k_smem.index(stage)))
        mbarrier.wait(v_empty.index(stage), phase ^ 1)
        mbarrier.expect(v_ready.index(stage), v_desc.block_type.nbytes)
        _tma_load(v_desc, [batch, j * BLOCK_N, kv_head * HEAD_DIM], v_ready.index(stage), _as_box(v_smem.index(stage)))


@gluon.jit
def _softmax_tile(s, m_i, l_i, j, rows, seqlen_kv, qk_scale, MASKED: gl.constexpr, CAUSAL: gl.constexpr):
    """Online softmax of the raw scores ``s`` of tile ``j``: returns ``(p, m_new, l_new, alpha)``, with ``m``
    the running max of raw scores and ``alpha = exp2((m_i - m_new) * qk_scale)`` the factor for O."""
    BLOCK_N: gl.constexpr = s.shape[1]
    if MASKED:
        cols = j * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s.type.layout))
        valid = gl.expand_dims(cols < seqlen_kv, 0)
        if CAUSAL:
            valid = valid & (gl.expand_dims(cols, 0) <= gl.expand_dims(rows, 1))
        s = gl.where(valid, s, float("-inf"))
    # Tile 0 holds key 0, which every row sees: m_new is finite from then on, and exp2 of -inf (a masked
    # key, or the first alpha) is a clean 0.
    m_new = gl.maximum(m_i, gl.max(s, axis=1))
    m_scaled = m_new * qk_scale
    alpha = gl.exp2(m_i * qk_scale - m_scaled)
    p = gl.exp2(gl.fma(s, qk_scale, -gl.expand_dims(m_scaled, 1)))
    l_new = l_i * alpha + gl.sum(p, axis=1)
    return p, m_new, l_new, alpha


@gluon.jit
def _consumer_step(j, q, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, my_turn, other_turn, turn, p, m_i, l_i,
                   acc, rows, s_zero, seqlen_kv, qk_scale, MASKED: gl.constexpr, CAUSAL: gl.constexpr,
                   PINGPONG: gl.constexpr):
    """Tile j >= 1: issue ``S_j = Q K_j^T`` and ``O += P_{j-1} V_{j-1}``, run the softmax of ``S_j`` while the
    second wgmma runs, then rescale O. Returns ``(p_j, m, l, acc, turn)``."""
    STAGES: gl.constexpr = k_smem.shape[0]
    stage = j % STAGES
    prev = (j - 1) % STAGES
    mbarrier.wait(k_ready.index(stage), (j // STAGES) & 1)
    if PINGPONG:
        mbarrier.wait(my_turn, turn & 1)
    s = warpgroup_mma(q, k_smem.index(stage).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    mbarrier.wait(v_ready.index(prev), ((j - 1) // STAGES) & 1)
    acc = warpgroup_mma(p, v_smem.index(prev), acc, is_async=True)
    if PINGPONG:
        mbarrier.arrive(other_turn)
    s = warpgroup_mma_wait(num_outstanding=1, deps=(s, ))
    mbarrier.arrive(k_empty.index(stage))
    p_new, m_i, l_i, alpha = _softmax_tile(s, m_i, l_i, j, rows, seqlen_kv, qk_scale, MASKED, CAUSAL)
    p_new = gl.convert_layout(p_new.to(p.dtype), p.type.layout)
    # The softmax's results pass through the wait: without them as operands, LLVM is free to schedule the wait
    # before the exponentials, and the softmax would no longer overlap P_{j-1} V_{j-1}.
    acc, p_new, l_i, alpha = warpgroup_mma_wait(num_outstanding=0, deps=(acc, p_new, l_i, alpha))
    mbarrier.arrive(v_empty.index(prev))
    acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, acc.type.layout)), 1)
    return p_new, m_i, l_i, acc, turn + 1


@gluon.jit
def _consumer_partition(q_smem, k_smem, v_smem, q_ready, k_ready, k_empty, v_ready, v_empty, turns, out_ptr, seqlen_q,
                        seqlen_kv, num_q_heads, group_size, qk_scale, CONSUMER: gl.constexpr, CAUSAL: gl.constexpr,
                        PINGPONG: gl.constexpr):
    """One consumer warpgroup: 64 Q rows (half ``CONSUMER`` of the block) against every K/V tile."""
    BLOCK_N: gl.constexpr = k_smem.shape[1]
    HEAD_DIM: gl.constexpr = k_smem.shape[2]
    STAGES: gl.constexpr = k_smem.shape[0]
    dtype: gl.constexpr = q_smem.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)

    batch, head, kv_head, q_start, num_tiles = _program_block(seqlen_kv, num_q_heads, group_size, CAUSAL, BLOCK_N)
    first_row = q_start + CONSUMER * 64
    rows = first_row + gl.arange(0, 64, layout=gl.SliceLayout(1, s_layout))
    my_turn = turns.index(CONSUMER)
    other_turn = turns.index(1 - CONSUMER)
    # Consumer 0 issues first: its first wait is on the phase before 0, which a fresh mbarrier has completed.
    turn = 1 - CONSUMER

    q = q_smem.index(CONSUMER)
    mbarrier.wait(q_ready.index(CONSUMER), 0)
    s_zero = gl.zeros([64, BLOCK_N], gl.float32, layout=s_layout)
    acc = gl.zeros([64, HEAD_DIM], gl.float32, layout=o_layout)

    # Tile 0 alone: S_0 and its softmax (masked: it may be the diagonal or the last tile).
    mbarrier.wait(k_ready.index(0), 0)
    if PINGPONG:
        mbarrier.wait(my_turn, turn & 1)
    s = warpgroup_mma(q, k_smem.index(0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    if PINGPONG:
        mbarrier.arrive(other_turn)
    turn += 1
    s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))
    mbarrier.arrive(k_empty.index(0))
    m_i = gl.full([64], float("-inf"), gl.float32, layout=gl.SliceLayout(1, s_layout))
    l_i = gl.full([64], 0.0, gl.float32, layout=gl.SliceLayout(1, s_layout))
    p, m_i, l_i, alpha = _softmax_tile(s, m_i, l_i, 0, rows, seqlen_kv, qk_scale, True, CAUSAL)
    p = gl.convert_layout(p.to(dtype), p_layout)

    # Tiles every row of this consumer sees whole skip the mask.
    if CAUSAL:
        full_end = gl.minimum(first_row + 1, seqlen_kv)
    else:
        full_end = seqlen_kv
    num_full = gl.maximum(full_end // BLOCK_N, 1)
    for j in range(1, num_full):
        p, m_i, l_i, acc, turn = _consumer_step(j, q, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, my_turn,
                                                other_turn, turn, p, m_i, l_i, acc, rows, s_zero, seqlen_kv, qk_scale,
                                                False, CAUSAL, PINGPONG)
    for j in range(num_full, num_tiles):
        p, m_i, l_i, acc, turn = _consumer_step(j, q, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, my_turn,
                                                other_turn, turn, p, m_i, l_i, acc, rows, s_zero, seqlen_kv, qk_scale,
                                                True, CAUSAL, PINGPONG)

    # The last tile's P V.
    last = num_tiles - 1
    mbarrier.wait(v_ready.index(last % STAGES), (last // STAGES) & 1)
    if PINGPONG:
        mbarrier.wait(my_turn, turn & 1)
    acc = warpgroup_mma(p, v_smem.index(last % STAGES), acc, is_async=True)
    if PINGPONG:
        mbarrier.arrive(other_turn)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
    mbarrier.arrive(v_empty.index(last % STAGES))

    out = acc / gl.expand_dims(gl.convert_layout(l_i, gl.SliceLayout(1, o_layout)), 1)
    store_layout: gl.constexpr = _store_layout(HEAD_DIM, 4)
    out = gl.convert_layout(out.to(dtype), store_layout)
    out_rows = first_row + gl.arange(0, 64, layout=gl.SliceLayout(1, store_layout))
    out_cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, store_layout))
    # int64: B * Sq * Hq * D can exceed 2**31 elements.
    row_offsets = ((batch * seqlen_q + out_rows).to(gl.int64) * num_q_heads + head) * HEAD_DIM
    offsets = gl.expand_dims(row_offsets, 1) + gl.expand_dims(out_cols, 0)
    gl.store(out_ptr + offsets, out, mask=gl.expand_dims(out_rows < seqlen_q, 1))


@gluon.jit
def _attention_ws_kernel(q_desc, k_desc, v_desc, out_ptr, seqlen_q, seqlen_kv, num_q_heads, group_size, qk_scale,
                         CAUSAL: gl.constexpr, PINGPONG: gl.constexpr, STAGES: gl.constexpr, Q_LAYOUT: gl.constexpr,
                         KV_LAYOUT: gl.constexpr):
    """One 128-row Q block of one (batch, q head).

    q_desc: TMA descriptor over q viewed as ``[B, Sq, Hq * D]`` bf16, block ``[1, 64, D]``.
    k_desc, v_desc: over k/v viewed as ``[B, Skv, Hkv * D]`` bf16, block ``[1, BLOCK_N, D]``.
    out_ptr: bf16 ``[B, Sq, Hq, D]``, contiguous. group_size: Hq // Hkv. qk_scale: ``softmax_scale * log2(e)``
    (> 0). CAUSAL: key ``j`` masked for query ``i < j`` (the host requires ``Sq == Skv``).
    Q_LAYOUT, KV_LAYOUT: the shared layouts of the ``[64, D]`` and ``[BLOCK_N, D]`` tiles.
    Grid: ``(cdiv(Sq, 128), B * Hq)``; ``num_warps=4`` (the default partition, consumer 0).
    """
    HEAD_DIM: gl.constexpr = q_desc.block_type.shape[2]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[1]
    dtype: gl.constexpr = q_desc.dtype
    q_smem = gl.allocate_shared_memory(dtype, [2, 64, HEAD_DIM], Q_LAYOUT)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], KV_LAYOUT)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], KV_LAYOUT)
    q_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    turns = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(turns.index(i), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=2)  # both consumers release a tile
        mbarrier.init(v_empty.index(i), count=2)

    gl.warp_specialize([
        (_consumer_partition, (q_smem, k_smem, v_smem, q_ready, k_ready, k_empty, v_ready, v_empty, turns, out_ptr,
                               seqlen_q, seqlen_kv, num_q_heads, group_size, qk_scale, 0, CAUSAL, PINGPONG)),
        (_consumer_partition, (q_smem, k_smem, v_smem, q_ready, k_ready, k_empty, v_ready, v_empty, turns, out_ptr,
                               seqlen_q, seqlen_kv, num_q_heads, group_size, qk_scale, 1, CAUSAL, PINGPONG)),
        (_load_partition, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, k_ready, k_empty, v_ready,
                           v_empty, seqlen_kv, num_q_heads, group_size, CAUSAL)),
    ], [4, 1], [CONSUMER_REGS, LOADER_REGS])


def _descriptor(x, seqlen, heads, head_dim, block_rows):
    """Per sequence ``[B, S, H * D]``: a box past S is zero-filled, never the next sequence's rows."""
    shape = [x.shape[0], seqlen, heads * head_dim]
    block = [1, block_rows, head_dim]
    return TensorDescriptor(x.view(shape), shape, [seqlen * shape[2], shape[2], 1], block, _nvmma_layout(block))


def gluon_attention_ws(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                       softmax_scale: float | None = None, *, pingpong: bool = True,
                       stages: int = NUM_STAGES) -> torch.Tensor:
    """Attention forward ``softmax(scale * q k^T) v`` on an sm_90 GPU, warp-specialized.

    q: bf16 ``[B, Sq, Hq, D]``; k, v: bf16 ``[B, Skv, Hkv, D]``; contiguous, on one CUDA device, ``D`` in
    {64, 128}, ``Hq`` a multiple of ``Hkv``. causal: query ``i`` sees keys ``j <= i`` (``Sq == Skv``).
    softmax_scale: > 0, defaults to ``1 / sqrt(D)``. Returns bf16 ``[B, Sq, Hq, D]``.
    """
    _check_inputs(q, k, v, causal, softmax_scale)
    if softmax_scale is not None and softmax_scale <= 0:
        raise ValueError(f"softmax_scale must be > 0, got {softmax_scale}")
    if torch.cuda.get_device_capability(q.device) != (9, 0):
        raise RuntimeError(f"gluon_attention_ws needs an sm_90 GPU, got {torch.cuda.get_device_name(q.device)}")
    batch, seqlen_q, num_q_heads, head_dim = q.shape
    seqlen_kv, num_kv_heads = k.shape[1], k.shape[2]
    if softmax_scale is None:
        softmax_scale = head_dim ** -0.5
    out = torch.empty_like(q)
    if out.numel() == 0:
        return out
    block_n = _block_n(head_dim)
    q_desc = _descriptor(q, seqlen_q, num_q_heads, head_dim, CONSUMER_ROWS)
    k_desc = _descriptor(k, seqlen_kv, num_kv_heads, head_dim, block_n)
    v_desc = _descriptor(v, seqlen_kv, num_kv_heads, head_dim, block_n)
    grid = (triton.cdiv(seqlen_q, BLOCK_M), batch * num_q_heads)
    assert grid[1] <= MAX_GRID_Y
    with torch.cuda.device(q.device):
        _attention_ws_kernel[grid](q_desc, k_desc, v_desc, out, seqlen_q, seqlen_kv, num_q_heads,
                                   num_q_heads // num_kv_heads, softmax_scale * LOG2E, CAUSAL=causal,
                                   PINGPONG=pingpong, STAGES=stages, Q_LAYOUT=_nvmma_layout([CONSUMER_ROWS, head_dim]),
                                   KV_LAYOUT=_nvmma_layout([block_n, head_dim]), num_warps=4, maxnreg=MAX_REGS)
    return out


def compile_ws_for_sm90(head_dim: int, causal: bool, pingpong: bool = True, stages: int = NUM_STAGES) -> dict:
    """Compiles the kernel for sm_90a without a GPU and returns its ``asm`` dict (see
    :func:`llmkernels.attention.gluon_hopper.compile_for_sm90`; run with ``TRITON_INTERPRET`` unset)."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    if head_dim not in HEAD_DIMS:
        raise ValueError(f"head_dim must be one of {HEAD_DIMS}, got {head_dim}")

    def descriptor_type(block):
        return f"tensordesc<bf16[{', '.join(map(str, block))}],{_nvmma_layout(block)!r}>"

    kv_type = descriptor_type([1, _block_n(head_dim), head_dim])
    kinds = dict(q_desc=descriptor_type([1, CONSUMER_ROWS, head_dim]), k_desc=kv_type, v_desc=kv_type,
                 out_ptr="*bf16", qk_scale="fp32", CAUSAL="constexpr", PINGPONG="constexpr", STAGES="constexpr",
                 Q_LAYOUT="constexpr", KV_LAYOUT="constexpr")
    fn = _attention_ws_kernel
    signature = {name: kinds.get(name, "i32") for name in fn.arg_names}
    constexprs = {(fn.arg_names.index("CAUSAL"), ): bool(causal), (fn.arg_names.index("PINGPONG"), ): bool(pingpong),
                  (fn.arg_names.index("STAGES"), ): int(stages),
                  (fn.arg_names.index("Q_LAYOUT"), ): _nvmma_layout([CONSUMER_ROWS, head_dim]),
                  (fn.arg_names.index("KV_LAYOUT"), ): _nvmma_layout([_block_n(head_dim), head_dim])}
    source = GluonASTSource(fn, signature, constexprs=constexprs,
                            attrs={(fn.arg_names.index("out_ptr"), ): [["tt.divisibility", 16]]})
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, maxnreg=MAX_REGS))
    return compiled.asm
