"""Attention forward in Gluon for Hopper (sm_90a): a first, single-warpgroup prototype.

Not part of the public API yet; it is the starting point of a warp-specialized FA3-style kernel.

* :func:`gluon_attention`: dense bf16 attention forward, non-causal or causal (``Sq == Skv``), head dim 64
  or 128, MHA/GQA/MQA, on q ``[B, Sq, Hq, D]`` and k/v ``[B, Skv, Hkv, D]``.
* :func:`compile_for_sm90`: compiles the kernel for sm_90a without a GPU and returns its ``asm`` dict
  (``ttgir``, ``ptx``, ``cubin``, ...), so CPU tests can inspect the generated code.

Kernel structure: one program (one warpgroup, 4 warps) per (128-row Q block, batch * q head). The Q tile is
loaded once by TMA; K/V tiles go through a 2-stage shared-memory ring fed by TMA, the next tile's loads
being issued before the current tile is computed. ``S = Q K^T`` is a ``wgmma`` with both operands in shared
memory; the online softmax runs in fp32 on ``exp2`` with ``softmax_scale * log2(e)`` folded into one
multiply; ``P`` (bf16) is the register A operand of the ``O += P V`` ``wgmma``.

Only the tiles a block sees in part (the causal diagonal, the last tile past Skv) are masked; causal blocks run
longest first. Known limits of the prototype: both wgmmas are waited for in every iteration (no overlap of softmax
with the next ``Q K^T``). TMA descriptors are per sequence (``[B, S, H·D]``), so a tile past ``S`` reads
zeros, never the next sequence's rows.
"""
from __future__ import annotations

import math
import numbers

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

__all__ = ["gluon_attention", "compile_for_sm90"]

LOG2E = 1.4426950408889634
BLOCK_M = 128  # query rows per program: two m64 wgmma row blocks of the one warpgroup
NUM_WARPS = 4  # one warpgroup
HEAD_DIMS = (64, 128)
MAX_GRID_Y = 65535  # CUDA's limit on grid dimension y, which holds batch * q heads
# The TMA global -> shared copy: ``async_copy_global_to_shared`` in Triton 3.6, renamed ``async_load`` later
# (3.9 removed the old name), so that the kernel also compiles with the newer Triton of a CPU test machine.
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared


def _block_n(head_dim: int) -> int:
    """Keys per K/V tile. With one warpgroup holding 128 rows, each thread keeps S (BLOCK_N / 2 fp32), P and
    O (head_dim / 2 fp32) in registers: 64 keys keep head dim 128 within the 255-register limit."""
    return 128 if head_dim <= 64 else 64


@gluon.constexpr_function
def _store_layout(head_dim, num_warps):
    """A blocked layout for ``[rows, head_dim]`` bf16 with 16-byte vectors per thread, so that the output
    store is coalesced (rows of one warp are contiguous in memory only within a head)."""
    vector = 8
    threads_per_row = head_dim // vector
    return gl.BlockedLayout([1, vector], [32 // threads_per_row, threads_per_row], [num_warps, 1], [1, 0])


@gluon.jit
def _as_box(buffer):
    """A ``[rows, D]`` shared-memory tile as the ``[1, rows, D]`` box of a per-sequence (3-D) TMA descriptor."""
    return buffer.reshape([1, buffer.shape[0], buffer.shape[1]])


@gluon.jit
def _attend_tile(j, num_tiles, k_desc, v_desc, k_smem, v_smem, kv_bars, q_smem, batch, kv_col, rows, m_i, l_i, acc,
                 s_zero, seqlen_kv, qk_scale, MASKED: gl.constexpr, CAUSAL: gl.constexpr, p_layout: gl.constexpr,
                 o_row_layout: gl.constexpr, s_col_layout: gl.constexpr):
    """K/V tile ``j`` of ``num_tiles``: prefetch tile j + 1, then ``S = Q K^T``, the online softmax update and
    ``O += P V``. Returns ``(m_i, l_i, acc)``. MASKED: apply the ``key < Skv`` (and causal) mask."""
    NUM_STAGES: gl.constexpr = k_smem.shape[0]
    BLOCK_N: gl.constexpr = k_smem.shape[1]
    stage = j % NUM_STAGES
    # Prefetch tile j + 1 into the other stage. Its previous tile (j - 1) is no longer read: both of that
    # iteration's wgmmas were waited for before it ended.
    if j + 1 < num_tiles:
        next_stage = (j + 1) % NUM_STAGES
        next_row = (j + 1) * BLOCK_N
        mbarrier.expect(kv_bars.index(next_stage), k_desc.block_type.nbytes + v_desc.block_type.nbytes)
        _tma_load(k_desc, [batch, next_row, kv_col], kv_bars.index(next_stage), _as_box(k_smem.index(next_stage)))
        _tma_load(v_desc, [batch, next_row, kv_col], kv_bars.index(next_stage), _as_box(v_smem.index(next_stage)))
    mbarrier.wait(kv_bars.index(stage), (j // NUM_STAGES) & 1)

    s = warpgroup_mma(q_smem, k_smem.index(stage).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))
    s = s * qk_scale
    if MASKED:
        cols = j * BLOCK_N + gl.arange(0, BLOCK_N, layout=s_col_layout)
        valid = gl.expand_dims(cols < seqlen_kv, 0)
        if CAUSAL:
            valid = valid & (gl.expand_dims(cols, 0) <= gl.expand_dims(rows, 1))
        s = gl.where(valid, s, float("-inf"))

    # Every row sees key 0 in the first tile (causal or not), so m_new is finite from then on and
    # exp2(-inf - m_new) is a clean 0 for masked keys and for the first alpha.
    m_new = gl.maximum(m_i, gl.max(s, axis=1))
    alpha = gl.exp2(m_i - m_new)
    p = gl.exp2(s - gl.expand_dims(m_new, 1))
    l_i = l_i * alpha + gl.sum(p, axis=1)

    acc = acc * gl.expand_dims(gl.convert_layout(alpha, o_row_layout), 1)
    p_op = gl.convert_layout(p.to(q_smem.dtype), p_layout)
    acc = warpgroup_mma(p_op, v_smem.index(stage), acc, is_async=True)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
    return m_new, l_i, acc


@gluon.jit
def _attention_fwd_kernel(q_desc, k_desc, v_desc, out_ptr, seqlen_q, seqlen_kv, num_q_heads, group_size,
                          qk_scale, CAUSAL: gl.constexpr, Q_LAYOUT: gl.constexpr, KV_LAYOUT: gl.constexpr):
    """One 128-row Q block of one (batch, q head).

    q_desc: TMA descriptor over q viewed as ``[B, Sq, Hq * D]`` bf16, block ``[1, BLOCK_M, D]``.
    k_desc, v_desc: TMA descriptors over k/v viewed as ``[B, Skv, Hkv * D]`` bf16, block ``[1, BLOCK_N, D]``
    (per sequence: rows past S are zero-filled).
    Q_LAYOUT, KV_LAYOUT: the shared layouts of the ``[BLOCK_M, D]`` and ``[BLOCK_N, D]`` tiles.
    out_ptr: bf16 ``[B, Sq, Hq, D]``, contiguous.
    seqlen_q, seqlen_kv, num_q_heads: Sq, Skv, Hq. group_size: Hq // Hkv (q heads per KV head).
    qk_scale: fp32, ``softmax_scale * log2(e)``.
    CAUSAL: mask key ``j > query i`` (top-left aligned; the host requires ``Sq == Skv``).
    Grid: ``(cdiv(Sq, BLOCK_M), B * Hq)``.
    """
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[1]
    HEAD_DIM: gl.constexpr = q_desc.block_type.shape[2]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[1]
    NUM_STAGES: gl.constexpr = 2
    dtype: gl.constexpr = q_desc.dtype
    gl.static_assert(gl.num_warps() == 4, "the prototype runs one warpgroup")

    # wgmma accumulator layouts: m64 per instruction, the 4 warps of the warpgroup stacked along M, one
    # instruction covering all N (BLOCK_N keys for S, HEAD_DIM for O); k is 16 for bf16.
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    s_row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    s_col_layout: gl.constexpr = gl.SliceLayout(0, s_layout)
    o_row_layout: gl.constexpr = gl.SliceLayout(1, o_layout)

    pid_m = gl.program_id(0)
    if CAUSAL:  # the longest rows (most key tiles) first, so that the last wave is of short ones
        pid_m = gl.num_programs(0) - 1 - pid_m
    pid_bh = gl.program_id(1)
    batch = pid_bh // num_q_heads
    head = pid_bh % num_q_heads
    q_start = pid_m * BLOCK_M
    q_col = head * HEAD_DIM
    kv_col = (head // group_size) * HEAD_DIM

    q_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, HEAD_DIM], Q_LAYOUT)
    k_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, HEAD_DIM], KV_LAYOUT)
    v_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, HEAD_DIM], KV_LAYOUT)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    kv_bars = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(kv_bars.index(i), count=1)

    # Keys this Q block attends to: all of them, or (causal, Sq == Skv) up to its last row.
    if CAUSAL:
        kv_end = gl.minimum(seqlen_kv, q_start + BLOCK_M)
    else:
        kv_end = seqlen_kv
    num_tiles = gl.cdiv(kv_end, BLOCK_N)

    # Query rows past Sq and keys past Skv arrive as zeros (per-sequence descriptors): the rows are computed and
    # never stored, the keys masked.
    mbarrier.expect(q_bar, q_desc.block_type.nbytes)
    _tma_load(q_desc, [batch, q_start, q_col], q_bar, _as_box(q_smem))
    kv_bytes: gl.constexpr = k_desc.block_type.nbytes + v_desc.block_type.nbytes
    mbarrier.expect(kv_bars.index(0), kv_bytes)
    _tma_load(k_desc, [batch, 0, kv_col], kv_bars.index(0), _as_box(k_smem.index(0)))
    _tma_load(v_desc, [batch, 0, kv_col], kv_bars.index(0), _as_box(v_smem.index(0)))

    rows = q_start + gl.arange(0, BLOCK_M, layout=s_row_layout)
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=s_row_layout)
    l_i = gl.full([BLOCK_M], 0.0, gl.float32, layout=s_row_layout)
    acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, layout=o_layout)
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)

    mbarrier.wait(q_bar, 0)
    # Tiles every row of the block sees whole (keys below the block's first row, or all keys inside Skv when not
    # causal) skip the mask; the rest (the diagonal, the partial last tile) take it.
    if CAUSAL:
        full_end = gl.minimum(q_start + 1, seqlen_kv)
    else:
        full_end = seqlen_kv
    num_full = full_end // BLOCK_N
    for j in range(num_full):
        m_i, l_i, acc = _attend_tile(j, num_tiles, k_desc, v_desc, k_smem, v_smem, kv_bars, q_smem, batch, kv_col,
                                     rows, m_i, l_i, acc, s_zero, seqlen_kv, qk_scale, False, CAUSAL, p_layout,
                                     o_row_layout, s_col_layout)
    for j in range(num_full, num_tiles):
        m_i, l_i, acc = _attend_tile(j, num_tiles, k_desc, v_desc, k_smem, v_smem, kv_bars, q_smem, batch, kv_col,
                                     rows, m_i, l_i, acc, s_zero, seqlen_kv, qk_scale, True, CAUSAL, p_layout,
                                     o_row_layout, s_col_layout)

    mbarrier.invalidate(q_bar)
    for i in gl.static_range(NUM_STAGES):
        mbarrier.invalidate(kv_bars.index(i))

    out = acc / gl.expand_dims(gl.convert_layout(l_i, o_row_layout), 1)
    store_layout: gl.constexpr = _store_layout(HEAD_DIM, 4)
    out = gl.convert_layout(out.to(dtype), store_layout)
    out_rows = q_start + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, store_layout))
    out_cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, store_layout))
    # int64: B * Sq * Hq * D can exceed 2**31 elements.
    row_offsets = ((batch * seqlen_q + out_rows).to(gl.int64) * num_q_heads + head) * HEAD_DIM
    offsets = gl.expand_dims(row_offsets, 1) + gl.expand_dims(out_cols, 0)
    gl.store(out_ptr + offsets, out, mask=gl.expand_dims(out_rows < seqlen_q, 1))


def _nvmma_layout(block_shape):
    return gl.NVMMASharedLayout.get_default_for(block_shape, gl.bfloat16)


def _check_inputs(q, k, v, causal, softmax_scale):
    for name, tensor in (("q", q), ("k", k), ("v", v)):
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
        if tensor.dtype != torch.bfloat16:
            raise TypeError(f"{name} must be bfloat16, got {tensor.dtype}")
        if tensor.dim() != 4:
            raise ValueError(f"{name} must have 4 dimensions [batch, seqlen, heads, head_dim], got shape "
                             f"{tuple(tensor.shape)}")
        if tensor.device.type != "cuda":
            raise ValueError(f"{name} must be on a CUDA device, got {tensor.device}")
        if tensor.device != q.device:
            raise ValueError(f"{name} is on {tensor.device} but q is on {q.device}")
        if not tensor.is_contiguous():
            raise ValueError(f"{name} must be contiguous, got strides {tensor.stride()}")
        if tensor.data_ptr() % 16:
            raise ValueError(f"{name} must start at a 16-byte aligned address (TMA)")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    if softmax_scale is not None:
        if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, numbers.Real):
            raise TypeError(f"softmax_scale must be a real number or None, got {type(softmax_scale).__name__}")
        if not math.isfinite(softmax_scale):
            raise ValueError(f"softmax_scale must be finite, got {softmax_scale}")

    batch, seqlen_q, num_q_heads, head_dim = q.shape
    if k.shape != v.shape:
        raise ValueError(f"v must have the shape of k {tuple(k.shape)}, got {tuple(v.shape)}")
    if k.shape[0] != batch:
        raise ValueError(f"k has batch size {k.shape[0]} but q has {batch}")
    if k.shape[3] != head_dim:
        raise ValueError(f"k has head dim {k.shape[3]} but q has {head_dim}")
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"q has head dim {head_dim}; supported: {HEAD_DIMS}")
    seqlen_kv, num_kv_heads = k.shape[1], k.shape[2]
    if num_kv_heads < 1 or num_q_heads % num_kv_heads:
        raise ValueError(f"q's {num_q_heads} heads must be a multiple of k's {num_kv_heads} heads")
    if seqlen_kv < 1:
        raise ValueError("k must have at least one key (seqlen dimension 1)")
    if causal and seqlen_q != seqlen_kv:
        raise ValueError(f"causal needs q and k of equal seqlen, got {seqlen_q} and {seqlen_kv}")
    if batch * num_q_heads > MAX_GRID_Y:
        raise ValueError(f"q has batch * heads = {batch * num_q_heads}; at most {MAX_GRID_Y} supported")


def gluon_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                    softmax_scale: float | None = None) -> torch.Tensor:
    """Attention forward ``softmax(scale * q k^T) v`` on an sm_90 GPU.

    q: bf16 ``[B, Sq, Hq, D]``; k, v: bf16 ``[B, Skv, Hkv, D]``; all contiguous, on one CUDA device, with
    ``D`` in {64, 128} and ``Hq`` a multiple of ``Hkv`` (q head ``h`` reads KV head ``h // (Hq // Hkv)``).
    causal: query ``i`` sees keys ``j <= i``; requires ``Sq == Skv``.
    softmax_scale: defaults to ``1 / sqrt(D)``.
    Returns bf16 ``[B, Sq, Hq, D]``.
    Raises TypeError / ValueError naming the offending argument, RuntimeError on a GPU other than sm_90.
    """
    _check_inputs(q, k, v, causal, softmax_scale)
    if torch.cuda.get_device_capability(q.device) != (9, 0):
        raise RuntimeError(f"gluon_attention needs an sm_90 GPU, got {torch.cuda.get_device_name(q.device)}")
    batch, seqlen_q, num_q_heads, head_dim = q.shape
    seqlen_kv, num_kv_heads = k.shape[1], k.shape[2]
    if softmax_scale is None:
        softmax_scale = head_dim ** -0.5
    out = torch.empty_like(q)
    if out.numel() == 0:
        return out

    block_n = _block_n(head_dim)

    def descriptor(x, seqlen, heads, block_rows):
        # per sequence [B, S, H * D]: a box past S is zero-filled, never the next sequence's rows
        shape = [x.shape[0], seqlen, heads * head_dim]
        block = [1, block_rows, head_dim]
        return TensorDescriptor(x.view(shape), shape, [seqlen * shape[2], shape[2], 1], block, _nvmma_layout(block))

    q_desc = descriptor(q, seqlen_q, num_q_heads, BLOCK_M)
    k_desc = descriptor(k, seqlen_kv, num_kv_heads, block_n)
    v_desc = descriptor(v, seqlen_kv, num_kv_heads, block_n)
    grid = (triton.cdiv(seqlen_q, BLOCK_M), batch * num_q_heads)
    with torch.cuda.device(q.device):
        _attention_fwd_kernel[grid](q_desc, k_desc, v_desc, out, seqlen_q, seqlen_kv, num_q_heads,
                                    num_q_heads // num_kv_heads, softmax_scale * LOG2E, CAUSAL=causal,
                                    Q_LAYOUT=_nvmma_layout([BLOCK_M, head_dim]),
                                    KV_LAYOUT=_nvmma_layout([block_n, head_dim]), num_warps=NUM_WARPS)
    return out


def compile_for_sm90(head_dim: int, causal: bool) -> dict:
    """Compiles the kernel for sm_90a (no GPU needed: ptxas from the Triton wheel runs, nothing launches)
    and returns the compiled kernel's ``asm`` dict (``source``, ``ttgir``, ``llir``, ``ptx``, ``cubin``; newer
    Tritons add ``glir``).

    The launch is specialized as a typical call is: 16-byte aligned output pointer, and descriptors over
    bf16 with the blocks :func:`gluon_attention` uses for ``head_dim``. Run it with ``TRITON_INTERPRET``
    unset or 0 (e.g. in a subprocess, as ``tests/test_compile_targets.py`` does): in interpreter mode
    Triton turns gl's own ``@jit`` helpers (``gl.max``, ``gl.sum``) into interpreted functions, which the
    compiler then refuses."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    if head_dim not in HEAD_DIMS:
        raise ValueError(f"head_dim must be one of {HEAD_DIMS}, got {head_dim}")

    def descriptor_type(block):
        return f"tensordesc<bf16[{', '.join(map(str, block))}],{_nvmma_layout(block)!r}>"

    block_n = _block_n(head_dim)
    q_type = descriptor_type([1, BLOCK_M, head_dim])
    kv_type = descriptor_type([1, block_n, head_dim])
    kinds = dict(q_desc=q_type, k_desc=kv_type, v_desc=kv_type, out_ptr="*bf16", qk_scale="fp32",
                 CAUSAL="constexpr", Q_LAYOUT="constexpr", KV_LAYOUT="constexpr")
    fn = _attention_fwd_kernel
    signature = {name: kinds.get(name, "i32") for name in fn.arg_names}
    constexprs = {(fn.arg_names.index("CAUSAL"), ): bool(causal),
                  (fn.arg_names.index("Q_LAYOUT"), ): _nvmma_layout([BLOCK_M, head_dim]),
                  (fn.arg_names.index("KV_LAYOUT"), ): _nvmma_layout([block_n, head_dim])}
    source = GluonASTSource(fn, signature, constexprs=constexprs,
                            attrs={(fn.arg_names.index("out_ptr"), ): [["tt.divisibility", 16]]})
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=NUM_WARPS))
    return compiled.asm
