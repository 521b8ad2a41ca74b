"""Split-KV decode pass for Hopper (sm_90a) in Gluon, for the latency-bound regime: one query token per sequence
and few (sequence, KV head) pairs, where every split is a short run of key tiles and the portable kernel's
per-row address work and its two-warp programs leave most of the time in latency (lab/NOTES.md).

One program per (sequence, KV head, split) and one warpgroup: the q heads of the KV head are the rows of one
m64 ``wgmma`` block (rows past the group are zeros, never stored); K and V tiles of 64 keys come by TMA into a
2-stage ring, one box per page a tile spans (pages found in the block table, as in ``gluon_hopper``). Each
program writes the normalized partial O (float32) and base-2 LSE of its split, the portable split pass's
partials, which :func:`llmkernels.attention.split_kv.combine_splits_kernel` merges (sinks and the LSE there).
``attention`` takes this pass on an sm_90 GPU where :meth:`GluonDecode.supports` holds (:data:`BACKEND`, second in
the plan's list); everything else runs the portable kernel.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from ..launch import BoundKernel, KernelSpec
from ..runtime import unit_last_stride
from .check import CheckedCall
from .config import FA4Config, Tiling, tiling
from .gluon_hopper import (
    DTYPES,
    LOG2E,
    _descriptor,
    _load_kv_tile,
    _nvmma_layout,
    _softmax_tile,
    _store_layout,
    descriptor_type,
    gluon_eligible,
    sequence_rows,
)
from .layout import paged_metadata
from .masks import MaskSpec, ScoreModSpec
from .portable import TYPE_NAMES

__all__ = ["BACKEND", "GluonDecode", "compile_for_sm90", "TILE_N", "MAX_HEAD_PROGRAMS"]

TILE_N = 64  # keys per K / V tile (the portable decode's BN, so both split a sequence alike)
STAGES = 2  # K / V tiles in flight per program (three measured no faster at B = 1, H100)
ROWS = 64  # q heads of one KV head, as the rows of one m64 wgmma block
HEAD_DIMS = (64, 128)
# (sequences x KV heads) up to which this pass runs. H100, Hq 32 / Hkv 8, D 128, against the portable pass
# (lab/NOTES.md): 1.01-1.13x as fast at B = 1 and 2 (8 and 16 pairs, 1k-128k keys, pages 16 / 64,
# dense), 0.79-0.96x at B = 4 and 8, where two-warp programs keep more loads in flight per SM.
MAX_HEAD_PROGRAMS = 16
# A CTA-wide barrier: ``thread_barrier`` in Triton 3.6, ``barrier`` in later ones (3.9 removed the old name)
_cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier


@gluon.jit
def _decode_split_kernel(
    q_ptr,
    k_desc,
    v_desc,
    o_part_ptr,
    lse_part_ptr,
    block_table_ptr,
    seqlens_ptr,
    stride_qb,
    stride_qh,
    stride_block_table,
    max_pages,
    num_pages,
    seqlen_kv,
    num_kv_heads,
    group,
    num_splits,
    stride_ps,
    stride_pb,
    stride_ph,
    stride_ls,
    stride_lb,
    stride_lh,
    qk_scale,
    TILE: gl.constexpr,
    STAGES: gl.constexpr,
    PAGE_SIZE: gl.constexpr,
    Q_LAYOUT: gl.constexpr,
    KV_LAYOUT: gl.constexpr,
):
    """Program (``(batch, kv_head)``, split): key tiles ``[t0, t1)`` of that sequence's ``cdiv(seqlen, TILE)``,
    ``cdiv(tiles, num_splits)`` per split, through a ring of ``STAGES`` K and V tiles.

    q_ptr: ``[B, 1, Hq, D]`` (unit stride along D; q head h reads KV head ``h // group``, ``group <= 64``).
    k_desc, v_desc: dense ``[B, Skv, Hkv * D]`` (PAGE_SIZE 0; box ``[1, 64, D]``, zeros past Skv), or the pages
    ``[num_pages, PAGE_SIZE, Hkv * D]`` (box ``[1, min(PAGE_SIZE, 64), D]``) with int32 ``block_table``
    (``stride_block_table`` between rows of ``max_pages``) and ``seqlens`` ``[B]`` read clamped to
    ``[0, max_pages * PAGE_SIZE]``; dense: every sequence has ``seqlen_kv`` keys.
    o_part_ptr: float32 ``[splits, B, 1, Hq, D]`` (strides ``stride_ps``, ``stride_pb``, ``stride_ph``; D unit);
    lse_part_ptr: float32 base-2 ``[splits, B, Hq, 1]`` (``stride_ls``, ``stride_lb``, ``stride_lh``). A split
    with no key writes O = 0 and LSE -inf. qk_scale: ``softmax_scale * log2(e)``.
    """
    HEAD_DIM: gl.constexpr = k_desc.block_type.shape[2]
    dtype: gl.constexpr = k_desc.dtype
    TILE_BYTES: gl.constexpr = TILE * HEAD_DIM * 2
    head_program = gl.program_id(0)
    split = gl.program_id(1)
    batch = head_program // num_kv_heads
    kv_head = head_program % num_kv_heads
    if PAGE_SIZE > 0:
        seqlen = gl.minimum(gl.maximum(gl.load(seqlens_ptr + batch), 0), max_pages * PAGE_SIZE)
    else:
        seqlen = seqlen_kv + batch * 0
    num_tiles = gl.cdiv(seqlen, TILE)
    per_split = gl.cdiv(num_tiles, num_splits)
    t0 = gl.minimum(split * per_split, num_tiles)
    n = gl.minimum(t0 + per_split, num_tiles) - t0
    pages = (block_table_ptr, stride_block_table, max_pages, num_pages)

    k_smem = gl.allocate_shared_memory(dtype, [STAGES, TILE, HEAD_DIM], KV_LAYOUT)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, TILE, HEAD_DIM], KV_LAYOUT)
    q_smem = gl.allocate_shared_memory(dtype, [64, HEAD_DIM], Q_LAYOUT)
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
    for i in gl.static_range(STAGES):
        if i < n:
            key = (t0 + i) * TILE
            mbarrier.expect(k_ready.index(i), TILE_BYTES)
            _load_kv_tile(k_desc, k_smem.index(i), k_ready.index(i), batch, key, kv_head * HEAD_DIM, pages, PAGE_SIZE)
            mbarrier.expect(v_ready.index(i), TILE_BYTES)
            _load_kv_tile(v_desc, v_smem.index(i), v_ready.index(i), batch, key, kv_head * HEAD_DIM, pages, PAGE_SIZE)

    # Q: the group's heads as rows (zeros past the group), through registers into shared memory
    blocked: gl.constexpr = _store_layout(HEAD_DIM, 4)
    rows = gl.arange(0, 64, layout=gl.SliceLayout(1, blocked))
    dims = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, blocked))
    q_rows = batch.to(gl.int64) * stride_qb + (kv_head * group + rows).to(gl.int64) * stride_qh
    q = gl.load(
        q_ptr + gl.expand_dims(q_rows, 1) + gl.expand_dims(dims, 0), mask=gl.expand_dims(rows < group, 1), other=0.0
    )
    q_smem.store(q)
    fence_async_shared()

    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, TILE, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_DIM, 16]
    )
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    s_zero = gl.zeros([64, TILE], gl.float32, layout=s_layout)
    acc = gl.zeros([64, HEAD_DIM], gl.float32, layout=o_layout)
    m_i = gl.full([64], float("-inf"), gl.float32, layout=row_layout)
    l_i = gl.full([64], 0.0, gl.float32, layout=row_layout)
    geometry = (1, seqlen, seqlen - 1, 0, 0)  # one query, at the sequence's end; keys past seqlen masked, no window
    for i in range(n):
        stage = i % STAGES
        phase = (i // STAGES) & 1
        key = (t0 + i) * TILE
        mbarrier.wait(k_ready.index(stage), phase)
        s = warpgroup_mma(q_smem, k_smem.index(stage).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
        p, m_i, l_i, alpha = _softmax_tile(s, m_i, l_i, t0 + i, 0, geometry, qk_scale, True, False)
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
        mbarrier.wait(v_ready.index(stage), phase)
        if PAGE_SIZE > 0:
            if key + TILE > seqlen:  # page rows past the sequence hold stale values (NaN, say): P's zeros meet 0
                v_tile = v_smem.index(stage).load(blocked)
                v_rows = key + gl.arange(0, TILE, layout=gl.SliceLayout(1, blocked))
                v_smem.index(stage).store(gl.where(gl.expand_dims(v_rows < seqlen, 1), v_tile, gl.zeros_like(v_tile)))
                fence_async_shared()
                _cta_barrier()
        acc = warpgroup_mma(gl.convert_layout(p.to(dtype), p_layout), v_smem.index(stage), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        if i + STAGES < n:
            _cta_barrier()  # every warp is done with this stage before TMA overwrites it
            next_key = (t0 + i + STAGES) * TILE
            mbarrier.expect(k_ready.index(stage), TILE_BYTES)
            _load_kv_tile(
                k_desc, k_smem.index(stage), k_ready.index(stage), batch, next_key, kv_head * HEAD_DIM, pages, PAGE_SIZE
            )
            mbarrier.expect(v_ready.index(stage), TILE_BYTES)
            _load_kv_tile(
                v_desc, v_smem.index(stage), v_ready.index(stage), batch, next_key, kv_head * HEAD_DIM, pages, PAGE_SIZE
            )

    nonempty = l_i != 0.0
    lse = gl.where(nonempty, m_i * qk_scale + gl.log2(gl.where(nonempty, l_i, 1.0)), float("-inf"))
    inverse = gl.where(nonempty, 1.0 / gl.where(nonempty, l_i, 1.0), 0.0)
    out = gl.convert_layout(acc * gl.expand_dims(gl.convert_layout(inverse, gl.SliceLayout(1, o_layout)), 1), blocked)
    heads = (kv_head * group + rows).to(gl.int64)
    o_base = o_part_ptr + split.to(gl.int64) * stride_ps + batch.to(gl.int64) * stride_pb
    gl.store(
        o_base + gl.expand_dims(heads * stride_ph, 1) + gl.expand_dims(dims, 0),
        out,
        mask=gl.expand_dims(rows < group, 1),
    )
    lse_rows = gl.arange(0, 64, layout=row_layout)
    lse_base = lse_part_ptr + split.to(gl.int64) * stride_ls + batch.to(gl.int64) * stride_lb
    gl.store(lse_base + (kv_head * group + lse_rows).to(gl.int64) * stride_lh, lse, mask=lse_rows < group)


def _decode_call(head_dim: int, page_size: int) -> CheckedCall:
    """A bf16 call of the split pass's layout (one query, 8 q heads per KV head), without tensors."""
    return CheckedCall(
        False,
        page_size > 0,
        1,
        8,
        1,
        head_dim,
        8,
        1,
        0,
        MaskSpec(),
        ScoreModSpec(),
        1.0,
        torch.device("cuda", 0),
        dtype=torch.bfloat16,
        page_size=page_size,
        tma_ready=(True, True, True),
    )


class GluonDecode:
    """The Gluon split-KV pass: one query token per sequence, dense K/V or a paged cache TMA reads in place, D 64 or
    128, few (sequence, KV head) pairs; its partials go to the combine backend."""

    name = "gluon_decode"
    kernel = _decode_split_kernel

    def supports(self, call: CheckedCall, tiles: Tiling) -> bool:
        """A config with ``warp_specialized`` (sm_90's default) on an sm_90 GPU (not the interpreter), several
        splits, one query per sequence (dense q), no mask but a causal one (which that bottom-right query does not
        restrict), no score_mod or mask tensor, no key starts (:func:`gluon_hopper.gluon_eligible`), a positive
        scale, at most 64 q heads per KV head and ``MAX_HEAD_PROGRAMS`` (sequence, KV head) pairs (more fill the GPU
        without splits, where the portable pass measured faster), k and v (or the pages, at least one) read by TMA
        in place (never copied: a cache is large); no FP8 input (this kernel reads 16-bit tiles only)."""
        spec = call.mask_spec
        whole = not spec.has_window or (spec.window_left >= call.kv_bound and spec.window_right >= 0)
        return (
            tiles.partials
            and not call.fp8
            and not call.ragged
            and call.q_bound == 1
            and whole
            and gluon_eligible(call, tiles.config)
            and call.softmax_scale > 0
            and call.head_dim in HEAD_DIMS
            and call.group <= ROWS
            and not (call.paged and call.kv_rows == 0)
            and call.batch * call.num_kv_heads <= MAX_HEAD_PROGRAMS
            and call.tma_ready[1]
            and call.tma_ready[2]
        )

    def spec(self, call: CheckedCall, tiles: Tiling) -> KernelSpec:
        head_dim, dtype, paged = call.head_dim, call.dtype, call.paged
        page_size = call.page_size if paged else 0
        box = [1, min(page_size, TILE_N) if paged else TILE_N, head_dim]
        constexprs = dict(
            TILE=TILE_N,
            STAGES=STAGES,
            PAGE_SIZE=page_size,
            Q_LAYOUT=_nvmma_layout([ROWS, head_dim], DTYPES[dtype]),
            KV_LAYOUT=_nvmma_layout([TILE_N, head_dim], DTYPES[dtype]),
        )
        kv_type = descriptor_type(dtype, box)
        metadata = "*i32" if paged else "*fp32"  # dense: the LSE partials stand in for the unread block table
        arg_types = dict(
            q_ptr="*" + TYPE_NAMES[dtype],
            k_desc=kv_type,
            v_desc=kv_type,
            o_part_ptr="*fp32",
            lse_part_ptr="*fp32",
            block_table_ptr=metadata,
            seqlens_ptr=metadata,
            qk_scale="fp32",
        )
        return KernelSpec(
            self.kernel,
            (call.batch * call.num_kv_heads, tiles.num_splits),
            constexprs,
            dict(num_warps=4),
            arg_types,
            per_call=("seqlen_kv",) if call.dynamic_kv else (),
            divisible=(),
        )

    def launch(self, call: CheckedCall, tiles: Tiling) -> GluonDecodeLaunch:
        return GluonDecodeLaunch(call, self.spec(call, tiles))


BACKEND = GluonDecode()


class GluonDecodeLaunch:
    """The split pass's launch for one plan: bound at the first call on q, the K/V descriptors, the partials it
    writes and (paged) the block table and key counts; dense K/V: the LSE partials in those two slots."""

    def __init__(self, call: CheckedCall, spec: KernelSpec):
        self.spec, self.bound, self.call = spec, None, call
        self.paged, self.dynamic = call.paged, call.dynamic_kv

    def __call__(
        self, q, k, v, kv_cache, cu_seqlens_q, cu_seqlens_k, sinks, slopes, attn_mask, out, lse, o_partial, lse_partial
    ) -> None:
        q = unit_last_stride(q)
        if self.paged:
            k, v = kv_cache.k_pages, kv_cache.v_pages
            block_table, seqlens = paged_metadata(kv_cache)
        else:
            block_table = seqlens = lse_partial  # pointers the dense variant never reads
        k_desc, v_desc = (sequence_rows(k), sequence_rows(v)) if self.dynamic else (k, v)
        values = (q, k_desc, v_desc, o_partial, lse_partial, block_table, seqlens)
        if self.dynamic:
            values = (*values, k.shape[1])
        (self.bound or self._bind(values, k, v))(*values)

    def _bind(self, values, k, v) -> BoundKernel:
        q, _, _, o_partial, lse_partial, block_table, seqlens = values[:7]
        call = self.call
        if self.paged:
            num_pages, page_size = k.shape[:2]
            max_pages, stride_block_table, seqlen_kv = block_table.shape[1], block_table.stride(0), 0
            box = min(page_size, TILE_N)
        else:
            num_pages = max_pages = stride_block_table = 0
            seqlen_kv, box = k.shape[1], TILE_N
        self.bound = self.spec.bind(
            q,
            _descriptor(k, box),
            _descriptor(v, box),
            o_partial,
            lse_partial,
            block_table,
            seqlens,
            q.stride(0),
            q.stride(2),
            stride_block_table,
            max_pages,
            num_pages,
            seqlen_kv,
            call.num_kv_heads,
            call.group,
            o_partial.shape[0],
            o_partial.stride(0),
            o_partial.stride(1),
            o_partial.stride(3),
            lse_partial.stride(0),
            lse_partial.stride(1),
            lse_partial.stride(2),
            float(call.softmax_scale) * LOG2E,
        )
        return self.bound


def compile_for_sm90(head_dim: int, page_size: int = 0) -> dict:
    """Compiles the split pass for sm_90a without a GPU (ptxas from the Triton wheel runs, nothing launches) and
    returns the compiled kernel's ``asm`` dict: the backend's :class:`KernelSpec` for a bf16 call of that layout;
    ``page_size`` 0: dense K/V. Run it with ``TRITON_INTERPRET`` unset or 0 (see
    :func:`gluon_hopper.compile_for_sm90`)."""
    import triton
    from triton.backends.compiler import GPUTarget

    if head_dim not in HEAD_DIMS:
        raise ValueError(f"head_dim must be one of {HEAD_DIMS}, got {head_dim}")
    call = _decode_call(head_dim, page_size)
    spec = BACKEND.spec(call, tiling(FA4Config(warp_specialized=True), True, 1, call.group, 1, 1, num_splits=2))
    return triton.compile(spec.ast_source(), target=GPUTarget("cuda", 90, 32), options=dict(spec.options)).asm
