"""LAB Gluon kernel, e4m3 mode (w4a8): FP8 (1, 128)-block activations x MXFP4 expert weights on Hopper's FP8 tensor
cores, the weights decoded in registers straight into the e4m3 A operand of ``wgmma m64nNk32 f32.e4m3.e4m3``. Not
the product (see NOTES.md, "e4m3 mode"). The schedule is the bf16 mode's (``gluon_kernel.py``: swap-AB, persistent
grid, device tile search, two consumer warpgroups of 64 weight rows, one TMA load warp that here also brings each
step's token scales); what differs is the consumer:

* **Decode by table**: for each weight row a reference exponent ``R`` (over all of K, or per 128-K step with
  ``reference="step"``; :func:`prepare_weights`), and for each 32-K block of that row (e8m0 exponent ``s``) the
  eight e4m3 bytes of ``{0, 0.5, 1, 1.5, 2, 3, 4, 6} x 2^(s - R)`` (two int32 words, precomputed). A packed data
  word holds 8 codes (3 magnitude bits as PRMT selector nibbles, the signs at the e4m3 sign bits); ``prmt`` looks
  up four magnitudes at once: 7 instructions per 8 weights (``and, prmt, lop3, shr, prmt, shl, lop3``), against
  2.6 a weight for the bf16 mode's decode.
* **Exact range**: ``e2m1 x 2^-d`` is an e4m3 value for every ``-6 <= d <= 8`` (384 = 1.5 x 2^8 on top, 2^-9 the
  smallest subnormal at the bottom). With ``R = max s - 6`` over the domain's blocks that matter (codes not all
  zero, scale not NaN), every block is exact while the domain's exponents spread by at most 14. A block further
  below (``d > 8``) is rounded to nearest e4m3: each such weight is off by at most ``2^(R - 127 - 10) = 2^(max s -
  127 - 16)``; :func:`prepare_weights` counts these blocks and raises unless ``allow_rounding=True``.
* **Promotion**: a fresh fp32 partial per 128-K step (``use_acc=False`` on its first wgmma), then ``acc +=
  partial x a_scale[token]``: one FFMA per accumulator element and step; the row factor ``2^(R - 127)`` (R one
  per row over all of K, ``reference="row"``, the default) multiplies the accumulator once, in the epilogue. With
  ``reference="step"`` (R per row and 128-K step: exact for wider spreads along K) the promotion is ``acc +=
  partial x (2^(R - 127) x a_scale)``: one FMUL (the outer product) and one FFMA per element and step.

Shapes: a ``float8_e4m3fn [T, K]`` with fp32 scales ``[T, ceil(K/128)]`` (any strides), K a multiple of 64, N of 128;
out bf16 ``[T, N]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
from gluon_kernel import (
    _CHUNK_L,
    _SMEM_CHUNK_L,
    CONSUMER_REGS,
    LOADER_REGS,
    W_BOX,
    _find_token_tile,
    _index4,
    _tma_load,
    w_layout_shared,
)
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from llmkernels.grouped_matmul.gluon_fp8_kernel import _publish, _receive

# magnitudes of the e2m1 codes 0..7
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
D_MIN, D_MAX = -6, 8  # e2m1 x 2^-d is an e4m3 value for every d in [D_MIN, D_MAX]
_NAN_TABLE = 0x7F7F7F7F  # e4m3fn NaN in every byte: a block with scale 255 decodes to NaN, as dequantize does
MAX_REGS = 168
_STOP = gl.constexpr(-2)

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
    found, group, group_start, group_end, tile_m, tile_n, cursor = _find_token_tile(
        tile, cursor, a_offsets_ptr, num_groups, num_tokens, n_tiles, TOKENS
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
        found, group, group_start, group_end, tile_m, tile_n, cursor = _find_token_tile(
            tile, cursor, a_offsets_ptr, num_groups, num_tokens, n_tiles, TOKENS
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
def w4a8_gluon_kernel(
    a_desc,
    w_desc,
    scales_ptr,
    tables_ptr,
    factors_ptr,
    out_ptr,
    a_offsets_ptr,
    expert_ids_ptr,
    stride_out_row,
    stride_s_row,
    stride_s_col,
    num_tokens,
    num_groups,
    num_experts,
    N,
    K,
    n_tiles,
    STAGES: gl.constexpr,
    STEP_REFERENCE: gl.constexpr,
):
    """a_desc: TMA descriptor over e4m3 A ``[T, K]``, box ``[block_t, 64]`` (64B swizzle); w_desc: over
    :class:`PreparedW4A8`'s data viewed as int32 ``[E·N/16, K'/32, 64]``, box :data:`W_BOX`; tables_ptr int32 and
    factors_ptr float32 (:class:`PreparedW4A8`); scales_ptr: A's fp32 scales ``[T, ceil(K/128)]`` (strides
    ``stride_s_row``, ``stride_s_col``); out_ptr
    bf16 ``[T, N]`` (unit column stride); a_offsets_ptr int32 ``[G + 1]``; expert_ids_ptr int32 ``[G]``; n_tiles =
    N / 128. Grid ``(min(SMs, tile bound),)``, ``num_warps=4`` + consumer 1 (4 warps) + the load warp."""
    TOKENS: gl.constexpr = a_desc.block_type.shape[0]
    a_smem = gl.allocate_shared_memory(a_desc.dtype, [2 * STAGES, TOKENS, 64], a_desc.layout)
    w_smem = gl.allocate_shared_memory(w_desc.dtype, [STAGES, 8, 4, 64], w_desc.layout)
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
                    tables_ptr,
                    factors_ptr,
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
                    tables_ptr,
                    factors_ptr,
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
                ),
            ),
        ],
        [4, 1],
        [CONSUMER_REGS, LOADER_REGS],
    )


# ------------------------------------------------------------------------------------------------------ host side


@dataclass(frozen=True)
class W4A8Config:
    """``stages``: the TMA ring's depth (24 KB a stage at 128 tokens: 16 KB of e4m3 activations + 8 KB of packed
    weights); ``block_t``: tokens per tile (wgmma's N: 64 or 128; 256 would need 256 accumulator registers);
    ``reference``: the :func:`prepare_weights` reference the weights were prepared with."""

    stages: int = 6
    block_t: int = 128
    reference: str = "row"
    mode: str = "e4m3"

    @property
    def a_box(self) -> list:
        return [self.block_t, 64]

    @property
    def label(self) -> str:
        return f"gluon-w4 e4m3 128x{self.block_t}x128 s{self.stages} {self.reference}-ref"


CONFIGS = [
    W4A8Config(6),
    W4A8Config(4),
    W4A8Config(6, reference="step"),
    W4A8Config(8, block_t=64),
]
LAST_COMPILED = {}


def a_layout_shared(a_box):
    return gl.NVMMASharedLayout.get_default_for(a_box, gl.float8e4nv)


def descriptor_types(config: W4A8Config) -> dict:
    return dict(
        a_desc=f"tensordesc<fp8e4nv[{', '.join(map(str, config.a_box))}],{a_layout_shared(config.a_box)!r}>",
        w_desc=f"tensordesc<i32[{', '.join(map(str, W_BOX))}],{w_layout_shared()!r}>",
    )


def compile_signature(config: W4A8Config):
    names = w4a8_gluon_kernel.arg_names
    types = dict(
        descriptor_types(config),
        scales_ptr="*fp32",
        tables_ptr="*i32",
        factors_ptr="*fp32",
        out_ptr="*bf16",
        a_offsets_ptr="*i32",
        expert_ids_ptr="*i32",
    )
    constexprs = dict(STAGES=config.stages, STEP_REFERENCE=config.reference == "step")
    signature = {name: ("constexpr" if name in constexprs else types.get(name, "i32")) for name in names}
    return signature, constexprs


@dataclass(frozen=True)
class PreparedW4A8:
    """:func:`prepare_weights`' result.

    data: int32 ``[E, N/16, K'/64, 8 (g), 4 (t), 4 (j)]`` (K' = K rounded up to 128): lane ``4g + t``'s four words of
    a 16-row fragment block and 64-K chunk; word ``j = 2i + h`` holds row ``g + 8h`` at ``k = 32i + 4t + n`` (low
    output word) and ``k = 32i + 16 + 4t + n`` (high output word), n = 0..3: magnitude of low byte n in bits
    ``4n..4n+2``, of high byte n in ``16+4n..18+4n``, sign of low byte n at bit ``8n+7``, of high byte n at ``8n+3``.
    tables: int32 ``[E, N/16, K'/128, 8 (g), 2 (chunk), 4 (j), 2]``: the e4m3 bytes of magnitudes 0..3 and 4..7 for
    word j's row and 32-K block. row_factors: float32 ``[E, N, K'/128]`` = ``2^(R - 127)``.
    rounded_blocks: how many (row, 32-K) blocks have ``d > 8`` (rounded, see the module docstring)."""

    data: torch.Tensor
    tables: torch.Tensor
    row_factors: torch.Tensor
    shape: tuple
    reference: str
    rounded_blocks: int
    max_spread: int


def _codes_and_exponents(w):
    """MXFP4 ScaledTensor ``[E, N, K]`` → uint8 codes ``[E, N, K']`` and e8m0 exponents int32 ``[E, N, K'/32]``,
    K' = K rounded up to 128 (zero codes, exponent 127 past K)."""
    packed = w.row_data().view(torch.uint8)
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2)
    exps = w.row_scales().view(torch.uint8).to(torch.int32)
    k = codes.shape[-1]
    pad = -k % 128
    if pad:
        codes = torch.cat([codes, codes.new_zeros(*codes.shape[:-1], pad)], dim=-1)
        exps = torch.cat([exps, exps.new_full((*exps.shape[:-1], pad // 32), 127)], dim=-1)
    return codes, exps


def _references(codes, exps, reference):
    """Reference exponent R ``[E, N, K'/128]`` (int64), the per-block shift d ``[E, N, K'/32]`` and the mask of the
    blocks that matter (not NaN, codes not all zero)."""
    num_experts, n, kp = codes.shape
    relevant = ((codes & 7).reshape(num_experts, n, kp // 32, 32).amax(-1) > 0) & (exps != 255)
    masked = torch.where(relevant, exps, -1).to(torch.int64)  # [E, N, K'/32]
    step_max = masked.reshape(num_experts, n, kp // 128, 4).amax(-1)  # [E, N, steps]
    if reference == "row":  # one R per row over all of K
        step_max = step_max.amax(-1, keepdim=True).expand(-1, -1, kp // 128)
    r = torch.where(step_max >= 0, step_max - 6, 127)
    d = r.repeat_interleave(4, dim=-1) - exps
    return r, d, relevant


def _tables(exps, d):
    """Per (row, 32-K block): int32 ``[..., 2]``, the e4m3 bytes of magnitudes 0..3 and 4..7 times 2^-d (RNE)."""
    mags = torch.tensor(_E2M1, dtype=torch.float32, device=exps.device)
    factor = torch.ldexp(torch.ones_like(d, dtype=torch.float32), -d.clamp(max=60).to(torch.float32))
    values = (mags * factor[..., None]).to(torch.float8_e4m3fn).view(torch.uint8).to(torch.int64)
    words = values.reshape(*values.shape[:-1], 2, 4)
    words = words[..., 0] | (words[..., 1] << 8) | (words[..., 2] << 16) | (words[..., 3] << 24)
    words = torch.where((exps == 255)[..., None], _NAN_TABLE, words)
    return (words - ((words >> 31) << 32)).to(torch.int32)  # as signed int32


def prepare_weights(w, reference: str = "row", allow_rounding: bool = False) -> PreparedW4A8:
    """The one-time weight conversion for the e4m3 mode (outside timing): MXFP4 ScaledTensor ``[E, N, K]`` (any
    scale layout) → :class:`PreparedW4A8`. N a multiple of 128, K of 64 (padded to whole 128-K steps with zero
    codes). ``reference``: "row" (one R per row over all of K: the row factor goes to the epilogue, the promotion is
    one FFMA an element; exact while the row's K/32 exponents spread by <= 14) or "step" (one R per row and 128-K
    step: exact while a row's four exponents of a step spread by <= 14; one more FMUL an element and step). Raises
    ValueError on other shapes or formats, and when a block would be rounded unless ``allow_rounding`` (then each
    rounded weight is within ``2^(R - 137)`` of its value)."""
    if getattr(w, "spec", None) is None or w.spec.name != "mxfp4":
        raise ValueError("w: must be an MXFP4 ScaledTensor")
    shape = tuple(w.shape)
    if len(shape) != 3 or shape[1] % 128 or shape[2] % 64:
        raise ValueError(f"w: must be [E, N, K] with N a multiple of 128 and K of 64, got {shape}")
    if reference not in ("row", "step"):
        raise ValueError(f"reference: must be 'row' or 'step', got {reference!r}")
    codes, exps = _codes_and_exponents(w)
    num_experts, n, kp = codes.shape
    r, d, relevant = _references(codes, exps, reference)
    rounded = relevant & (d > D_MAX)
    rounded_blocks = int(rounded.sum())
    spread = torch.where(relevant, d, D_MIN).amax() - D_MIN if relevant.any() else torch.tensor(0)
    if rounded_blocks and not allow_rounding:
        raise ValueError(
            f"w: {rounded_blocks} 32-K blocks lie more than 14 binades below their reference (spread "
            f"{int(spread)}): they would be rounded; pass allow_rounding=True to accept the stated bound"
        )
    mags = (codes & 7).to(torch.int64)
    signs = (codes >> 3).to(torch.int64)
    # [E, block, h, g, chunk, i, half, t, n]: row = 16 block + 8h + g, k = 64 chunk + 32i + 16 half + 4t + n
    view = (num_experts, n // 16, 2, 8, kp // 64, 2, 2, 4, 4)
    mags, signs = mags.reshape(view), signs.reshape(view)
    nib = torch.arange(4, device=codes.device)
    words = (
        (mags[..., 0, :, :] << (4 * nib)).sum(-1)
        | (mags[..., 1, :, :] << (16 + 4 * nib)).sum(-1)
        | (signs[..., 0, :, :] << (8 * nib + 7)).sum(-1)
        | (signs[..., 1, :, :] << (8 * nib + 3)).sum(-1)
    )  # [E, block, h, g, chunk, i, t]
    words = words.permute(0, 1, 4, 3, 6, 5, 2).reshape(num_experts, n // 16, kp // 64, 8, 4, 4)
    data = (words - ((words >> 31) << 32)).to(torch.int32).contiguous()
    tables = _tables(exps, d)  # [E, N, K'/32, 2]
    tables = tables.reshape(num_experts, n // 16, 2, 8, kp // 128, 2, 2, 2)  # (e, block, h, g, step, chunk, i, w)
    tables = tables.permute(0, 1, 4, 3, 5, 6, 2, 7).reshape(num_experts, n // 16, kp // 128, 8, 2, 4, 2)
    factors = torch.ldexp(torch.ones_like(r, dtype=torch.float32), (r - 127).to(torch.float32))
    return PreparedW4A8(data, tables.contiguous(), factors.contiguous(), shape, reference, rounded_blocks, int(spread))


def emulate_decode(w: PreparedW4A8) -> torch.Tensor:
    """float32 ``[E, N, K]``: the weights as the kernel decodes them from ``w`` (the PTX's and / prmt / shifts on
    each data word and its table words, the e4m3 bytes' values, x the row factor), in torch on any device."""
    num_experts, n, k_logical = w.shape
    kp = -(-k_logical // 128) * 128
    words = w.data.to(torch.int64) & 0xFFFFFFFF  # [E, block, chunk, g, t, j]
    tables = w.tables.to(torch.int64) & 0xFFFFFFFF  # [E, block, step, g, chunk, j, 2]
    tables = tables.permute(0, 1, 2, 4, 3, 5, 6).reshape(num_experts, n // 16, kp // 64, 8, 1, 4, 2)
    table64 = tables[..., 0] | (tables[..., 1] << 32)  # prmt's 8 source bytes

    def prmt(selector):  # default mode: four selector nibbles (bit 3 clear) → four bytes of table64
        out = torch.zeros_like(selector)
        for b in range(4):
            index = (selector >> (4 * b)) & 0xF
            out |= ((table64 >> (8 * index)) & 0xFF) << (8 * b)
        return out

    m = words & 0x77777777
    low = prmt(m & 0xFFFF) | (words & 0x80808080)
    high = prmt(m >> 16) | ((words << 4) & 0x80808080)

    def values(word):  # [..., j] → [..., j, 4] float32 of the e4m3 bytes
        b = torch.stack([(word >> (8 * i)) & 0xFF for i in range(4)], -1).to(torch.uint8)
        return b.view(torch.float8_e4m3fn).to(torch.float32)

    both = torch.stack([values(low), values(high)], -2)  # [E, block, chunk, g, t, j, half, n]
    both = both.reshape(num_experts, n // 16, kp // 64, 8, 4, 2, 2, 2, 4)  # j → (i, h)
    # row = 16 block + 8h + g, k = 64 chunk + 32 i + 16 half + 4 t + n
    both = both.permute(0, 1, 6, 3, 2, 5, 7, 4, 8).reshape(num_experts, n, kp)
    factors = w.row_factors.repeat_interleave(128, dim=-1)
    return (both * factors)[..., :k_logical]


def reference_matmul(a, w: PreparedW4A8, a_offsets, expert_ids, out_rows=None):
    """float64 ``[T, N]``: the fp8 activations (dequantized) times :func:`emulate_decode` per group; zero rows for
    expert -1 and rows past ``a_offsets[G]``."""
    from llmkernels import dequantize

    a64 = dequantize(a).double()
    weights = emulate_decode(w).double()
    out = torch.zeros(a64.shape[0], w.shape[1], dtype=torch.float64, device=a64.device)
    offsets = a_offsets.tolist()
    for g, e in enumerate(expert_ids.tolist()):
        if e >= 0:
            out[offsets[g] : offsets[g + 1]] = a64[offsets[g] : offsets[g + 1]] @ weights[e].T
    return out


def w4a8_grouped_matmul_gluon(a, w, a_offsets, expert_ids, out=None, config=None):
    """``out[rows of g] = dequantize(a)[rows of g] @ W[expert_ids[g]]ᵀ`` on an sm_90 GPU, W the weights as
    :func:`emulate_decode` gives them (``dequantize(w)`` exactly unless ``prepare_weights`` rounded blocks).

    a: FP8 ScaledTensor ``[T, K]`` (float8_e4m3fn data, fp32 scales ``[T, ceil(K/128)]``, block (1, 128)); w:
    :class:`PreparedW4A8` (or an MXFP4 ScaledTensor ``[E, N, K]``, prepared here with the config's reference);
    a_offsets int32 ``[G + 1]`` (non-decreasing, a_offsets[0] = 0), expert_ids int32 ``[G]`` (-1 → zero rows); out
    bf16 ``[T, N]`` (rows past ``a_offsets[G]`` untouched). K a multiple of 64, N of 128. Raises ValueError on
    other shapes, dtypes or blocks, before any launch."""
    config = config or CONFIGS[0]
    if config.block_t not in (64, 128) or config.stages < 2:
        raise ValueError(f"config: block_t must be 64 or 128 and stages >= 2, got {config}")
    if not isinstance(w, PreparedW4A8):
        w = prepare_weights(w, reference=config.reference)
    if w.reference != config.reference:
        raise ValueError(f"w: prepared with reference {w.reference!r}, config wants {config.reference!r}")
    if getattr(a, "spec", None) is None or a.spec.name != "fp8" or tuple(a.block) != (1, 128) or a.dim() != 2:
        raise ValueError("a: must be an FP8 ScaledTensor [T, K] with block (1, 128)")
    num_experts, n, k = w.shape
    data, scales = a.data, a.scales
    num_tokens = data.shape[0]
    if data.shape[1] != k or k % 64 or n % 128:
        raise ValueError(f"a: K must be w's K ({k}) and a multiple of 64 (N of 128), got a {tuple(data.shape)}")
    num_groups = expert_ids.numel()
    if a_offsets.numel() != num_groups + 1 or a_offsets.dtype != torch.int32 or expert_ids.dtype != torch.int32:
        raise ValueError("a_offsets: must be int32 [G + 1] with expert_ids int32 [G]")
    if out is None:
        out = torch.empty(num_tokens, n, dtype=torch.bfloat16, device=data.device)
    if out.dtype != torch.bfloat16 or tuple(out.shape) != (num_tokens, n):
        raise ValueError("out: must be bf16 [T, N]")
    if num_groups == 0 or num_tokens == 0:
        return out
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    a_data = data if (data.stride(1) == 1 and data.stride(0) % 16 == 0 and data.data_ptr() % 16 == 0) else None
    a_data = a_data if a_data is not None else data.contiguous()
    a_desc = TensorDescriptor(
        a_data, [num_tokens, k], [a_data.stride(0), 1], config.a_box, a_layout_shared(config.a_box)
    )
    k_padded = triton.cdiv(k, 128) * 128
    w_view = w.data.view(num_experts * (n // 16), k_padded // 32, 64)
    w_desc = TensorDescriptor(w_view, list(w_view.shape), [w_view.stride(0), 64, 1], W_BOX, w_layout_shared())
    target = out if out.stride(1) == 1 else out.contiguous()
    n_tiles = n // 128
    bound = (triton.cdiv(num_tokens, config.block_t) + num_groups) * n_tiles
    grid = (max(1, min(bound, torch.cuda.get_device_properties(data.device).multi_processor_count)),)
    LAST_COMPILED[config] = w4a8_gluon_kernel[grid](
        a_desc,
        w_desc,
        scales,
        w.tables,
        w.row_factors,
        target,
        a_offsets.contiguous(),
        expert_ids.contiguous(),
        target.stride(0),
        scales.stride(0),
        scales.stride(1),
        num_tokens,
        num_groups,
        num_experts,
        n,
        k,
        n_tiles,
        STAGES=config.stages,
        STEP_REFERENCE=config.reference == "step",
        num_warps=4,
        maxnreg=MAX_REGS,
    )
    if target is not out:
        out.copy_(target)
    return out
