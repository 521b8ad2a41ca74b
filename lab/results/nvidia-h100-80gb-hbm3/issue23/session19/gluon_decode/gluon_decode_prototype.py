"""Session 19 prototype: a Gluon split-KV decode pass for Hopper (one query token, GQA heads packed into one
m64 wgmma row block, K/V by TMA with one box per page), writing the portable kernel's partials so that the
existing combine kernel merges them. Not in the product; measured against the portable split pass."""
import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                              warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from llmkernels._runtime import cdiv, num_programs_hint, next_power_of_2
from llmkernels.attention import split_kv
from llmkernels.attention.gluon_hopper import DTYPES, _load_kv_tile, _nvmma_layout, _store_layout

LOG2E = 1.4426950408889634


@gluon.jit
def _decode_split_kernel(q_ptr, k_desc, v_desc, o_part_ptr, lse_part_ptr, block_table_ptr, seqlens_ptr,
                         stride_qb, stride_qh, stride_bt, max_pages, num_pages, num_kv_heads, group, num_splits,
                         stride_ps, stride_pb, stride_ph, stride_ls, stride_lb, stride_lh, qk_scale,
                         TILE_N: gl.constexpr, STAGES: gl.constexpr, PAGE_SIZE: gl.constexpr,
                         Q_LAYOUT: gl.constexpr, KV_LAYOUT: gl.constexpr):
    HEAD_DIM: gl.constexpr = k_desc.block_type.shape[2]
    dtype: gl.constexpr = k_desc.dtype
    TILE_BYTES: gl.constexpr = TILE_N * HEAD_DIM * 2
    head_program = gl.program_id(0)
    split = gl.program_id(1)
    batch = head_program // num_kv_heads
    kv_head = head_program % num_kv_heads
    seqlen = gl.minimum(gl.maximum(gl.load(seqlens_ptr + batch), 0), max_pages * PAGE_SIZE)
    num_tiles = gl.cdiv(seqlen, TILE_N)
    per_split = gl.cdiv(num_tiles, num_splits)
    t0 = gl.minimum(split * per_split, num_tiles)
    n = gl.minimum(t0 + per_split, num_tiles) - t0
    pages = (block_table_ptr, stride_bt, max_pages, num_pages)

    k_smem = gl.allocate_shared_memory(dtype, [STAGES, TILE_N, HEAD_DIM], KV_LAYOUT)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, TILE_N, HEAD_DIM], KV_LAYOUT)
    q_smem = gl.allocate_shared_memory(dtype, [64, HEAD_DIM], Q_LAYOUT)
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
    for i in gl.static_range(STAGES):
        if i < n:
            key = (t0 + i) * TILE_N
            mbarrier.expect(k_ready.index(i), TILE_BYTES)
            _load_kv_tile(k_desc, k_smem.index(i), k_ready.index(i), batch, key, kv_head, pages, PAGE_SIZE)
            mbarrier.expect(v_ready.index(i), TILE_BYTES)
            _load_kv_tile(v_desc, v_smem.index(i), v_ready.index(i), batch, key, kv_head, pages, PAGE_SIZE)

    # Q: the group's heads as rows (zeros past the group), through registers into shared memory
    q_layout: gl.constexpr = _store_layout(HEAD_DIM, 4)
    rows = gl.arange(0, 64, layout=gl.SliceLayout(1, q_layout))
    cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, q_layout))
    q_rows = batch.to(gl.int64) * stride_qb + (kv_head * group + rows).to(gl.int64) * stride_qh
    q = gl.load(q_ptr + gl.expand_dims(q_rows, 1) + gl.expand_dims(cols, 0), mask=gl.expand_dims(rows < group, 1),
                other=0.0)
    q_smem.store(q)
    fence_async_shared()

    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, TILE_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    s_zero = gl.zeros([64, TILE_N], gl.float32, layout=s_layout)
    acc = gl.zeros([64, HEAD_DIM], gl.float32, layout=o_layout)
    m_i = gl.full([64], float("-inf"), gl.float32, layout=row_layout)
    l_i = gl.full([64], 0.0, gl.float32, layout=row_layout)
    key_cols = gl.arange(0, TILE_N, layout=gl.SliceLayout(0, s_layout))
    for i in range(n):
        stage = i % STAGES
        phase = (i // STAGES) & 1
        key = (t0 + i) * TILE_N
        mbarrier.wait(k_ready.index(stage), phase)
        s = warpgroup_mma(q_smem, k_smem.index(stage).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))
        s = gl.where(gl.expand_dims(key + key_cols < seqlen, 0), s, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, axis=1))
        m_scaled = gl.where(m_new == float("-inf"), 0.0, m_new * qk_scale)
        alpha = gl.exp2(m_i * qk_scale - m_scaled)
        p = gl.exp2(gl.fma(s, qk_scale, -gl.expand_dims(m_scaled, 1)))
        l_i = l_i * alpha + gl.sum(p, axis=1)
        m_i = m_new
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
        mbarrier.wait(v_ready.index(stage), phase)
        if PAGE_SIZE > 0:
            if key + TILE_N > seqlen:  # stale page rows past the sequence: P's zeros must not meet NaN
                v_layout: gl.constexpr = _store_layout(HEAD_DIM, 4)
                v_tile = v_smem.index(stage).load(v_layout)
                v_rows = key + gl.arange(0, TILE_N, layout=gl.SliceLayout(1, v_layout))
                v_smem.index(stage).store(gl.where(gl.expand_dims(v_rows < seqlen, 1), v_tile, gl.zeros_like(v_tile)))
                fence_async_shared()
                gl.thread_barrier()
        acc = warpgroup_mma(gl.convert_layout(p.to(dtype), p_layout), v_smem.index(stage), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        if i + STAGES < n:
            gl.thread_barrier()  # every warp is done with this stage before TMA overwrites it
            next_key = (t0 + i + STAGES) * TILE_N
            mbarrier.expect(k_ready.index(stage), TILE_BYTES)
            _load_kv_tile(k_desc, k_smem.index(stage), k_ready.index(stage), batch, next_key, kv_head, pages,
                          PAGE_SIZE)
            mbarrier.expect(v_ready.index(stage), TILE_BYTES)
            _load_kv_tile(v_desc, v_smem.index(stage), v_ready.index(stage), batch, next_key, kv_head, pages,
                          PAGE_SIZE)

    # partial O (normalized, float32) and base-2 LSE of the group's rows, as the portable split pass stores them
    nonempty = l_i != 0.0
    lse = gl.where(nonempty, m_i * qk_scale + gl.log2(gl.where(nonempty, l_i, 1.0)), float("-inf"))
    inverse = gl.where(nonempty, 1.0 / gl.where(nonempty, l_i, 1.0), 0.0)
    out = acc * gl.expand_dims(gl.convert_layout(inverse, gl.SliceLayout(1, o_layout)), 1)
    out_layout: gl.constexpr = gl.BlockedLayout([1, 4], [32 // (HEAD_DIM // 4), HEAD_DIM // 4], [4, 1], [1, 0])
    out = gl.convert_layout(out, out_layout)
    o_rows = gl.arange(0, 64, layout=gl.SliceLayout(1, out_layout))
    o_cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, out_layout))
    heads = kv_head * group + o_rows
    base = split.to(gl.int64) * stride_ps + batch.to(gl.int64) * stride_pb
    gl.store(o_part_ptr + base + gl.expand_dims(heads.to(gl.int64) * stride_ph, 1) + gl.expand_dims(o_cols, 0), out,
             mask=gl.expand_dims(o_rows < group, 1))
    lse_rows = gl.arange(0, 64, layout=row_layout)
    lse_heads = kv_head * group + lse_rows
    gl.store(lse_part_ptr + split.to(gl.int64) * stride_ls + batch.to(gl.int64) * stride_lb
             + lse_heads.to(gl.int64) * stride_lh, lse, mask=lse_rows < group)


class GluonDecode:
    """One decode step (q ``[B, 1, Hq, D]``, a PagedKVCache) with the Gluon split pass + the product's combine."""

    def __init__(self, q, cache, *, tile_n=64, stages=2, num_splits=None, fill=2):
        batch, _, num_q_heads, head_dim = q.shape
        self.num_kv_heads = cache.num_kv_heads
        self.group = num_q_heads // self.num_kv_heads
        assert self.group <= 64 and q.shape[1] == 1
        self.page_size = cache.page_size
        box = min(cache.page_size, tile_n)
        dtype = DTYPES[q.dtype]
        block = [1, box, head_dim]
        layout = _nvmma_layout(block, dtype)

        def desc(pages):
            n, p, h, d = pages.shape
            return TensorDescriptor(pages, [n, p, h * d], [pages.stride(0), pages.stride(1), 1], block, layout)

        self.k_desc, self.v_desc = desc(cache.k_pages), desc(cache.v_pages)
        self.tile_n, self.stages = tile_n, stages
        tiles = cdiv(cache.max_seqlen_bound, tile_n)
        programs = batch * self.num_kv_heads
        if num_splits is None:
            num_splits = max(1, min(cdiv(fill * num_programs_hint(q.device), programs), tiles, 256))
        self.num_splits = num_splits
        self.o_part = torch.empty(num_splits, batch, 1, num_q_heads, head_dim, dtype=torch.float32, device=q.device)
        self.lse_part = torch.empty(num_splits, batch, num_q_heads, 1, dtype=torch.float32, device=q.device)
        self.out = torch.empty_like(q)
        self.q, self.cache = q, cache
        self.layouts = (_nvmma_layout([64, head_dim], dtype), _nvmma_layout([tile_n, head_dim], dtype))
        self.scale = head_dim ** -0.5 * LOG2E

    def split_pass(self):
        q, cache, o, l = self.q, self.cache, self.o_part, self.lse_part
        bt = cache.block_table
        _decode_split_kernel[(q.shape[0] * self.num_kv_heads, self.num_splits)](
            q, self.k_desc, self.v_desc, o, l, bt, cache.seqlens, q.stride(0), q.stride(2), bt.stride(0),
            bt.shape[1], cache.num_pages, self.num_kv_heads, self.group, self.num_splits,
            o.stride(0), o.stride(1), o.stride(3), l.stride(0), l.stride(1), l.stride(2), self.scale,
            TILE_N=self.tile_n, STAGES=self.stages, PAGE_SIZE=self.page_size, Q_LAYOUT=self.layouts[0],
            KV_LAYOUT=self.layouts[1], num_warps=4)

    def __call__(self):
        self.split_pass()
        o, l, out = self.o_part, self.lse_part, self.out
        split_kv.combine_splits_kernel[(out.shape[0], out.shape[2])](
            o, l, out, l, l,
            o.stride(0), o.stride(1), o.stride(2), o.stride(3),
            l.stride(0), l.stride(1), l.stride(2), l.stride(3),
            out.stride(0), out.stride(1), out.stride(2), 0, 0, 0,
            1, self.num_splits, HEAD_DIM=out.shape[3], HEAD_DIM_PAD=out.shape[3],
            BLOCK_SPLITS=min(next_power_of_2(self.num_splits), 64), HAS_SINKS=False, RETURN_LSE=False,
            ONE_BLOCK=self.num_splits <= 64, num_warps=4)
        return out
