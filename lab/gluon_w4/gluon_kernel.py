"""LAB Gluon kernel: grouped matmul of bf16 activations x MXFP4 expert weights on Hopper (sm_90a), the weights
decoded in registers straight into wgmma's A operand, warp-specialized so the decode of the next 64-wide K chunk
runs while the current chunk's wgmma holds the tensor cores. Not the product (see NOTES.md).

Schedule (swap-AB, ``Cᵀ = W · Aᵀ``: weight rows are the MMA's M side, tokens its N side):

* persistent grid of ``min(SMs, tile bound)`` programs; work tiles (group, ``block_t``-token tile, 128-weight-row
  tile) found on the device by the product's ``_find_tile`` (with a tile height),
  published to the consumers through the product's ``_publish`` / ``_receive`` shared-memory ring;
* 1 load warp: per 128-K step one TMA box of packed weights ``[8 fragment blocks, 4, 64]`` int32 (128 weight
  rows x 128 K in the library's "hopper" fragment layout, 8 KB) and two activation boxes ``[block_t, 64 K]`` bf16
  (128B swizzle) into a ``STAGES``-deep ring;
* 2 consumer warpgroups, consumer c owns weight rows ``[64c, 64c + 64)`` of the tile. Per 64-K chunk each thread
  reads its 4 packed words from shared memory (one 16-byte ``ld.shared``), decodes them with their bf16 scale
  words (loaded from global memory one K step ahead) by masks, shifts and two bf16x2 multiplies per value pair
  (PTX; exact), and the result's register order is wgmma's A fragment: the conversion to
  ``DotOperandLayout(0, NVMMA v3, k_width=2)`` only relabels registers (no shuffle, no shared memory in SASS).
  ``wgmma m64n{block_t}k16 bf16`` (A from registers, B = the activation chunk, K-major in shared memory) is
  issued asynchronously; chunk 1 is decoded while chunk 0's wgmmas run, and the step ends with a full wait
  (``CROSS_STEP`` keeps one wgmma in flight across steps instead: ptxas serializes that, see NOTES.md);
* epilogue: the fp32 accumulator ``[64 weight rows, block_t tokens]`` transposed and stored with masked 16-byte
  stores (tokens past the group's end are not stored; -1 experts write zeros).

Weights: a ScaledTensor MXFP4 ``[E, N, K]``; :func:`prepare_weights` (once, outside timing) converts it to the
hopper layout and rearranges its e8m0 scales into bf16 factor words (``[bf16 2^(s_g - 127), bf16 2^(s_g+8 -
127)]`` per fragment block, chunk, g and 32-K half: one 32-bit word per decoded data word, 2 bytes per 32
weights instead of 1). e4m3 mode (w4a8): ``gluon_w4a8.py``, reached through ``mode="e4m3"`` of
:func:`prepare_weights` and :func:`w4_grouped_matmul_gluon`.
"""

from __future__ import annotations

from dataclasses import dataclass

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

from llmkernels.grouped_matmul.gluon_fp8_kernel import _find_tile, _publish, _receive

# the schedule, the packed words' layouts and the tile search are the product's w4a8 kernel's (moved there from here)
from llmkernels.grouped_matmul.gluon_w4a8_kernel import (  # noqa: F401 - BLOCK_W, MAX_REGS: the bench's names
    _CHUNK_L,
    _SMEM_CHUNK_L,
    _STOP,
    BLOCK_W,
    CONSUMER_REGS,
    LOADER_REGS,
    MAX_REGS,
    W_BOX,
    _index4,
    _tma_load,
    w_layout_shared,
)

BLOCK_K = 128  # one TMA stage
# the activation box of one 64-K chunk is [block_t, 64] (128 bytes a row: the 128B swizzle's limit)

# $4: one data word (eight e2m1 values in the hopper layout's SLOT_BITS positions), $5: the scale word [bf16 row
# g | bf16 row g + 8]. Masks and shifts put each value's sign, exponent and mantissa at bf16 bits 15, 8-7 and 6
# (that bf16 times 2^126 is the e2m1 value, 0.5 included), then x 2^126, then x scale: two exact FMAs per pair.
# Out: $0-$1 row g (k = 2t, 2t+1, 2t+8, 2t+9), $2-$3 row g + 8.
_DECODE_PTX = gl.constexpr("""
{
.reg .b32 mask, bias, mz, v0, v1, v2, v3, a, b, c, sg, sh;
mov.b32 mask, 0x81C081C0;
mov.b32 bias, 0x7E807E80;
mov.b32 mz, 0x80008000;
prmt.b32 sg, $5, 0, 0x1010;
prmt.b32 sh, $5, 0, 0x3232;
and.b32 v0, $4, mask;
shl.b32 a, $4, 3;
and.b32 v1, a, mask;
shl.b32 a, $4, 6;
and.b32 v2, a, mask;
shl.b32 a, $4, 1;
and.b32 a, a, 0x80008000;
shr.u32 b, $4, 5;
and.b32 b, b, 0x01000100;
shr.u32 c, $4, 4;
and.b32 c, c, 0x00C000C0;
or.b32 v3, a, b;
or.b32 v3, v3, c;
fma.rn.bf16x2 v0, v0, bias, mz;
fma.rn.bf16x2 v1, v1, bias, mz;
fma.rn.bf16x2 v2, v2, bias, mz;
fma.rn.bf16x2 v3, v3, bias, mz;
fma.rn.bf16x2 $0, v0, sg, mz;
fma.rn.bf16x2 $1, v1, sg, mz;
fma.rn.bf16x2 $2, v2, sh, mz;
fma.rn.bf16x2 $3, v3, sh, mz;
}
""")


@gluon.jit
def _halves(word):
    """int32 → its low and high 16 bits as bf16 (register relabelling once packed back into a bf16x2)."""
    low = word.to(gl.int16).to(gl.bfloat16, bitcast=True)
    high = (word >> 16).to(gl.int16).to(gl.bfloat16, bitcast=True)
    return gl.join(low, high)


@gluon.jit
def _decode_chunk(w_tile, scale_words, CHUNK: gl.constexpr, CONSUMER: gl.constexpr, a_layout: gl.constexpr):
    """Packed words of chunk CHUNK of this consumer's 64 rows (shared int32 ``[8, 4, 64]`` tile) and their scale
    words (int32 ``[4, 8, 4, 4]``) → bf16 ``[64, 64]`` in wgmma's A-operand layout."""
    view = w_tile.slice(4 * CONSUMER, 4, dim=0).slice(2 * CHUNK, 2, dim=1)
    data = gl.convert_layout(gl.reshape(view.load(_SMEM_CHUNK_L), [4, 8, 4, 4]), _CHUNK_L)
    v0, v1, v2, v3 = gl.inline_asm_elementwise(
        _DECODE_PTX,
        "=r,=r,=r,=r,r,r",
        [data, scale_words],
        dtype=(gl.int32, gl.int32, gl.int32, gl.int32),
        is_pure=True,
        pack=1,
    )
    row_g = gl.join(_halves(v0), _halves(v1))  # (block, g, t, j, bl, bh): k = 16j + 8bh + 2t + bl
    row_g8 = gl.join(_halves(v2), _halves(v3))
    both = gl.permute(gl.join(row_g, row_g8), (0, 6, 1, 3, 5, 2, 4))  # (block, h, g, j, bh, t, bl)
    return gl.convert_layout(gl.reshape(both, [64, 64]), a_layout)


@gluon.jit
def _load_partition(
    a_desc,
    w_desc,
    a_smem,
    w_smem,
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
    """The load warp: finds this program's tiles, publishes each, TMA-loads its K steps into the ring."""
    STAGES: gl.constexpr = w_smem.shape[0]
    TOKENS: gl.constexpr = a_desc.block_type.shape[0]
    STAGE_BYTES: gl.constexpr = 2 * a_desc.block_type.nbytes + w_desc.block_type.nbytes
    k_steps = gl.cdiv(K, 128)  # K a multiple of 64: the last step's second chunk reads zeros
    blocks_per_expert = N // 16
    tile = gl.program_id(0)
    programs = gl.num_programs(0)
    cursor = (tile * 0, tile * 0, gl.load(a_offsets_ptr).to(gl.int32))
    count = 0
    loaded = 0
    found, group, group_start, group_end, tile_m, tile_n, cursor = _find_tile(
        tile, cursor, a_offsets_ptr, num_groups, num_tokens, n_tiles, 0, num_tokens, TOKENS
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
                mbarrier.expect(ready.index(stage), STAGE_BYTES)
                _tma_load(w_desc, [block0, 4 * kb, 0], ready.index(stage), w_smem.index(stage))
                _tma_load(a_desc, [first_row, kb * 128], ready.index(stage), a_smem.index(2 * stage))
                _tma_load(a_desc, [first_row, kb * 128 + 64], ready.index(stage), a_smem.index(2 * stage + 1))
                loaded += 1
        count += 1
        tile += programs
        found, group, group_start, group_end, tile_m, tile_n, cursor = _find_tile(
            tile, cursor, a_offsets_ptr, num_groups, num_tokens, n_tiles, 0, num_tokens, TOKENS
        )
    _publish(count, (tile * 0, tile * 0, tile * 0, tile * 0 + _STOP), schedule)


@gluon.jit
def _consumer_partition(
    a_smem,
    w_smem,
    ready,
    empty,
    schedule,
    scales_ptr,
    out_ptr,
    stride_out_row,
    N,
    K,
    CONSUMER: gl.constexpr,
    CROSS_STEP: gl.constexpr,
):
    """Consumer warpgroup CONSUMER: weight rows ``[64·CONSUMER, 64·CONSUMER + 64)`` of each tile it is handed."""
    STAGES: gl.constexpr = w_smem.shape[0]
    TOKENS: gl.constexpr = a_smem.shape[1]
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, TOKENS, 16]
    )
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_layout, k_width=2)
    store_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    k_steps = gl.cdiv(K, 128)  # K a multiple of 64: the last step's second chunk reads zeros
    blocks_per_expert = N // 16
    # word offsets of this thread's scale words of chunk 0 of K step 0: ((block·steps + step)·8 + g)·4 + chunk·2 +
    # (32-K half); data word j uses half j // 2
    scale_offsets = (
        _index4(4, 0, _CHUNK_L) * (k_steps * 32)
        + _index4(8, 1, _CHUNK_L) * 4
        + _index4(4, 2, _CHUNK_L) * 0
        + _index4(4, 3, _CHUNK_L) // 2
    )
    zero = gl.zeros([64, TOKENS], gl.float32, layout=mma_layout)
    count = 0
    consumed = 0
    first_row, rows, first_col, expert = _receive(count, schedule)
    while expert != _STOP:
        acc = zero
        if expert >= 0:
            block0 = expert.to(gl.int64) * blocks_per_expert + (first_col // 16) + 4 * CONSUMER
            scale_base = scales_ptr + block0 * (k_steps * 32)
            s0 = gl.load(scale_base + scale_offsets)
            s1 = gl.load(scale_base + scale_offsets + 2)
            for kb in range(k_steps):
                position = consumed + kb
                stage = position % STAGES
                ahead = gl.minimum(kb + 1, k_steps - 1) * 32
                next0 = gl.load(scale_base + scale_offsets + ahead)
                next1 = gl.load(scale_base + scale_offsets + ahead + 2)
                mbarrier.wait(ready.index(stage), (position // STAGES) & 1)
                w_tile = w_smem.index(stage)
                if CROSS_STEP:
                    # chunk 0's decode runs while the previous step's chunk-1 wgmma is in flight
                    a0 = _decode_chunk(w_tile, s0, 0, CONSUMER, a_layout)
                    acc = warpgroup_mma(a0, a_smem.index(2 * stage).permute((1, 0)), acc, is_async=True)
                    acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
                    if kb > 0:  # the previous step's wgmmas are done: its stage is free
                        mbarrier.arrive(empty.index((position - 1) % STAGES))
                    a1 = _decode_chunk(w_tile, s1, 1, CONSUMER, a_layout)
                    acc = warpgroup_mma(a1, a_smem.index(2 * stage + 1).permute((1, 0)), acc, is_async=True)
                    acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
                else:
                    # nothing in flight across the loop's back edge: chunk 1's decode overlaps chunk 0's wgmma,
                    # chunk 0's decode overlaps the other consumer's wgmmas
                    a0 = _decode_chunk(w_tile, s0, 0, CONSUMER, a_layout)
                    acc = warpgroup_mma(a0, a_smem.index(2 * stage).permute((1, 0)), acc, is_async=True)
                    a1 = _decode_chunk(w_tile, s1, 1, CONSUMER, a_layout)
                    acc = warpgroup_mma(a1, a_smem.index(2 * stage + 1).permute((1, 0)), acc, is_async=True)
                    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
                    mbarrier.arrive(empty.index(stage))
                s0 = next0
                s1 = next1
            if CROSS_STEP:
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
                mbarrier.arrive(empty.index((consumed + k_steps - 1) % STAGES))
            consumed += k_steps
        # out[first_row + t, first_col + 64·CONSUMER + r] = acc[r, t]
        values = gl.where(expert >= 0, acc, 0.0).to(out_ptr.dtype.element_ty)
        values = gl.convert_layout(gl.permute(values, (1, 0)), store_layout)
        tokens = gl.arange(0, TOKENS, layout=gl.SliceLayout(1, store_layout))
        cols = first_col + 64 * CONSUMER + gl.arange(0, 64, layout=gl.SliceLayout(0, store_layout))
        offsets = gl.expand_dims((first_row + tokens).to(gl.int64) * stride_out_row, 1) + gl.expand_dims(cols, 0)
        mask = gl.expand_dims(tokens < rows, 1) & gl.expand_dims(cols < N, 0)
        gl.store(out_ptr + offsets, values, mask=mask)
        count += 1
        first_row, rows, first_col, expert = _receive(count, schedule)


@gluon.jit
def w4_bf16_gluon_kernel(
    a_desc,
    w_desc,
    scales_ptr,
    out_ptr,
    a_offsets_ptr,
    expert_ids_ptr,
    stride_out_row,
    num_tokens,
    num_groups,
    num_experts,
    N,
    K,
    n_tiles,
    STAGES: gl.constexpr,
    CROSS_STEP: gl.constexpr,
):
    """a_desc: TMA descriptor over bf16 A ``[T, K]``, box ``[block_t, 64]`` (block_t 16, 64, 128 or 256: the tile's
    tokens); w_desc: over the hopper-layout data viewed as int32 ``[E·N/16, K/32, 64]``, box :data:`W_BOX`;
    scales_ptr: :func:`prepare_weights`' scale words; out_ptr bf16 ``[T, N]`` (unit column stride); a_offsets_ptr
    int32 ``[G + 1]``; expert_ids_ptr int32 ``[G]``; n_tiles = N / 128. Grid ``(min(SMs, tile bound),)``,
    ``num_warps=4`` + consumer 1 (4 warps) + the load warp."""
    TOKENS: gl.constexpr = a_desc.block_type.shape[0]
    a_smem = gl.allocate_shared_memory(a_desc.dtype, [2 * STAGES, TOKENS, 64], a_desc.layout)
    w_smem = gl.allocate_shared_memory(w_desc.dtype, [STAGES, 8, 4, 64], w_desc.layout)
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
                (a_smem, w_smem, ready, empty, schedule, scales_ptr, out_ptr, stride_out_row, N, K, 0, CROSS_STEP),
            ),
            (
                _consumer_partition,
                (a_smem, w_smem, ready, empty, schedule, scales_ptr, out_ptr, stride_out_row, N, K, 1, CROSS_STEP),
            ),
            (
                _load_partition,
                (
                    a_desc,
                    w_desc,
                    a_smem,
                    w_smem,
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
class W4GluonConfig:
    """``stages``: the TMA ring's depth (40 KB a stage); ``mode``: "bf16" (e4m3 mode: ``gluon_w4a8.W4A8Config``)."""

    stages: int = 4
    cross_step: bool = False  # keep chunk 1's wgmma in flight across the K loop's back edge
    mode: str = "bf16"
    block_t: int = 128  # tokens per tile: wgmma's N (16, 64, 128 or 256)

    @property
    def a_box(self) -> list:
        return [self.block_t, 64]

    @property
    def label(self) -> str:
        return f"gluon-w4 {self.mode} 128x{self.block_t}x128 s{self.stages}" + (" cross" if self.cross_step else "")


# the default first; shared memory: (2 x block_t x 64 x 2 + 8192) bytes a stage + the epilogue's transpose
CONFIGS = [
    W4GluonConfig(4),
    W4GluonConfig(3),
    W4GluonConfig(3, block_t=256),
    W4GluonConfig(2, block_t=256),
    W4GluonConfig(4, block_t=64),
    W4GluonConfig(6, block_t=16),
    W4GluonConfig(4, cross_step=True),
]
LAST_COMPILED = {}


def a_layout_shared(a_box):
    return gl.NVMMASharedLayout.get_default_for(a_box, gl.bfloat16)


def descriptor_types(config: W4GluonConfig) -> dict:
    """Type strings of the two descriptor arguments (ahead-of-time compiles)."""
    return dict(
        a_desc=f"tensordesc<bf16[{', '.join(map(str, config.a_box))}],{a_layout_shared(config.a_box)!r}>",
        w_desc=f"tensordesc<i32[{', '.join(map(str, W_BOX))}],{w_layout_shared()!r}>",
    )


def compile_signature(config: W4GluonConfig):
    names = w4_bf16_gluon_kernel.arg_names
    types = dict(
        descriptor_types(config), scales_ptr="*i32", out_ptr="*bf16", a_offsets_ptr="*i32", expert_ids_ptr="*i32"
    )
    constexprs = dict(STAGES=config.stages, CROSS_STEP=config.cross_step)
    signature = {name: ("constexpr" if name in constexprs else types.get(name, "i32")) for name in names}
    return signature, constexprs


@dataclass(frozen=True)
class PreparedWeights:
    """:func:`prepare_weights`' result: hopper-layout data as int32 words ``[E, N/16, K'/64, 8, 4, 4]`` and scale
    words int32 ``[E, N/16, K'/128, 8 (g), 2 (chunk), 2 (32-K half)]`` (low 16 bits: bf16 scale of row g, high:
    row g + 8); K' = K rounded up to 128; logical shape ``(E, N, K)``."""

    data: torch.Tensor
    scale_words: torch.Tensor
    shape: tuple


def scale_words(hopper_scales: torch.Tensor) -> torch.Tensor:
    """Hopper-layout e8m0 scales ``[E, N/16, K/64, 8, 2 (h), 2 (s)]`` → bf16 ``2^(e - 127)`` words int32
    ``[E, N/16, K/128, 8, 2 (chunk), 2 (s)]``, each ``[bf16 row g | bf16 row g + 8]`` (e = 0 → the subnormal
    2^-127, e = 255 → NaN). Exact; one 16-byte run per thread and K step."""
    e = hopper_scales.view(torch.uint8).to(torch.int32)
    bits = torch.where(e == 0, 0x0040, torch.where(e == 255, 0x7FC0, e << 7))
    num_experts, blocks, chunks = bits.shape[:3]
    bits = bits.reshape(num_experts, blocks, chunks // 2, 2, 8, 2, 2)  # (e, block, step, chunk, g, h, s)
    words = bits[..., 0, :] | (bits[..., 1, :] << 16)  # (e, block, step, chunk, g, s)
    return words.permute(0, 1, 2, 4, 3, 5).contiguous().to(torch.int32)


def prepare_weights(w, mode: str = "bf16", **options):
    """The one-time weight conversion (outside timing): an MXFP4 ScaledTensor ``[E, N, K]`` (any scale layout) →
    :class:`PreparedWeights` (``mode="e4m3"``: ``gluon_w4a8.prepare_weights(w, **options)``). N a multiple of 128
    and K of 64 (padded here to whole 128-K steps with zero codes under unit scales); raises ValueError otherwise."""
    if mode == "e4m3":
        from gluon_w4a8 import prepare_weights as prepare_e4m3

        return prepare_e4m3(w, **options)
    if mode != "bf16" or options:
        raise ValueError(f"mode: must be 'bf16' or 'e4m3' (options only for e4m3), got {mode!r} {options}")
    if getattr(w, "spec", None) is None or w.spec.name != "mxfp4":
        raise ValueError("w: must be an MXFP4 ScaledTensor")
    shape = tuple(w.shape)
    if len(shape) != 3 or shape[1] % 128 or shape[2] % 64:
        raise ValueError(f"w: must be [E, N, K] with N a multiple of 128 and K of 64, got {shape}")
    hopper = w if str(w.scale_layout) == "hopper" else w.to_layout("hopper")
    data, scales = hopper.data.view(torch.uint8), hopper.scales.view(torch.uint8)
    if data.shape[2] % 2:  # K an odd number of 64-K chunks: one more chunk of zero codes under unit scales
        data = torch.cat([data, data.new_zeros(*data.shape[:2], 1, *data.shape[3:])], dim=2)
        scales = torch.cat([scales, scales.new_full((*scales.shape[:2], 1, *scales.shape[3:]), 127)], dim=2)
    return PreparedWeights(data.contiguous().view(torch.int32), scale_words(scales), shape)


def w4_grouped_matmul_gluon(a, w, a_offsets, expert_ids, out=None, mode="bf16", config=None):
    """``out[rows of g] = a[rows of g] @ dequantize(w)[expert_ids[g]]ᵀ`` on an sm_90 GPU.

    a: bf16 ``[T, K]``; w: :class:`PreparedWeights` (or an MXFP4 ScaledTensor ``[E, N, K]``, prepared here);
    a_offsets int32 ``[G + 1]`` (non-decreasing, a_offsets[0] = 0), expert_ids int32 ``[G]`` (-1 → zero rows);
    out bf16 ``[T, N]`` (rows past ``a_offsets[G]`` untouched). K a multiple of 64, N of 128. ``mode="e4m3"``: a
    is an FP8 (1, 128) ScaledTensor, see ``gluon_w4a8.w4a8_grouped_matmul_gluon``. Raises ValueError on other
    shapes, dtypes or modes."""
    if mode == "e4m3":
        from gluon_w4a8 import w4a8_grouped_matmul_gluon

        return w4a8_grouped_matmul_gluon(a, w, a_offsets, expert_ids, out=out, config=config)
    config = config or CONFIGS[0]
    if mode != "bf16" or config.mode != "bf16":
        raise ValueError(f"mode: must be 'bf16' or 'e4m3', got {mode!r} (config mode {config.mode!r})")
    if config.block_t not in (16, 64, 128, 256) or config.stages < 2:
        raise ValueError(f"config: block_t must be 16, 64, 128 or 256 and stages >= 2, got {config}")
    if not isinstance(w, PreparedWeights):
        w = prepare_weights(w)
    if not isinstance(a, torch.Tensor) or a.dim() != 2 or a.dtype != torch.bfloat16:
        raise ValueError("a: must be a bf16 [T, K] tensor")
    num_experts, n, k = w.shape
    num_tokens = a.shape[0]
    if a.shape[1] != k or k % 64 or n % 128:
        raise ValueError(f"a: K must be w's K ({k}) and a multiple of 64 (N of 128), got a {tuple(a.shape)}")
    num_groups = expert_ids.numel()
    if a_offsets.numel() != num_groups + 1 or a_offsets.dtype != torch.int32 or expert_ids.dtype != torch.int32:
        raise ValueError("a_offsets: must be int32 [G + 1] with expert_ids int32 [G]")
    if out is None:
        out = torch.empty(num_tokens, n, dtype=torch.bfloat16, device=a.device)
    if out.dtype != torch.bfloat16 or tuple(out.shape) != (num_tokens, n):
        raise ValueError("out: must be bf16 [T, N]")
    if num_groups == 0 or num_tokens == 0:
        return out
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    a_data = a if (a.stride(1) == 1 and a.stride(0) % 8 == 0 and a.data_ptr() % 16 == 0) else a.contiguous()
    a_desc = TensorDescriptor(
        a_data, [num_tokens, k], [a_data.stride(0), 1], config.a_box, a_layout_shared(config.a_box)
    )
    k_padded = triton.cdiv(k, 128) * 128  # prepare_weights' data holds whole 128-K steps
    w_view = w.data.view(num_experts * (n // 16), k_padded // 32, 64)
    w_desc = TensorDescriptor(w_view, list(w_view.shape), [w_view.stride(0), 64, 1], W_BOX, w_layout_shared())
    target = out if out.stride(1) == 1 else out.contiguous()
    n_tiles = n // 128
    bound = (triton.cdiv(num_tokens, config.block_t) + num_groups) * n_tiles
    grid = (max(1, min(bound, torch.cuda.get_device_properties(a.device).multi_processor_count)),)
    LAST_COMPILED[config] = w4_bf16_gluon_kernel[grid](
        a_desc,
        w_desc,
        w.scale_words,
        target,
        a_offsets.contiguous(),
        expert_ids.contiguous(),
        target.stride(0),
        num_tokens,
        num_groups,
        num_experts,
        n,
        k,
        n_tiles,
        STAGES=config.stages,
        CROSS_STEP=config.cross_step,
        num_warps=4,
        maxnreg=MAX_REGS,
    )
    if target is not out:
        out.copy_(target)
    return out


def emulate_decode(w: PreparedWeights) -> torch.Tensor:
    """float32 ``[E, N, K]`` weights as the kernel decodes them from ``w`` (the PTX's masks and shifts on each data
    word, x 2^126, x the bf16 scale of the word's row from its scale word), in torch on any device: a CPU check of
    :func:`prepare_weights`' data and scale words against ``llmkernels.dequantize``."""
    num_experts, n, k_logical = w.shape
    k = -(-k_logical // 128) * 128  # the data's padded K
    words = w.data.view(num_experts, n // 16, k // 64, 8, 4, 4).to(torch.int64) & 0xFFFFFFFF
    mask = 0x81C081C0
    v0 = words & mask
    v1 = (words << 3) & mask
    v2 = (words << 6) & mask
    v3 = ((words << 1) & 0x80008000) | ((words >> 5) & 0x01000100) | ((words >> 4) & 0x00C000C0)

    def halves(v):  # (..., g, t, j) -> (..., g, t, j, 2): bf16 values of the low and high 16 bits
        bits = torch.stack([v & 0xFFFF, (v >> 16) & 0xFFFF], -1)
        return (bits << 16).to(torch.int32).view(torch.float32) * 2.0**126

    scale = w.scale_words.view(num_experts, n // 16, k // 128, 8, 2, 2).to(torch.int64) & 0xFFFFFFFF
    scale = scale.permute(0, 1, 2, 4, 3, 5).reshape(num_experts, n // 16, k // 64, 8, 2)  # (e, block, chunk, g, s)
    scale_g = ((scale & 0xFFFF) << 16).to(torch.int32).view(torch.float32)
    scale_g8 = ((scale >> 16) << 16).to(torch.int32).view(torch.float32)
    # word j uses 32-K half s = j // 2: (e, block, chunk, g, 1, j, 1)
    scale_g = scale_g.repeat_interleave(2, -1)[:, :, :, :, None, :, None]
    scale_g8 = scale_g8.repeat_interleave(2, -1)[:, :, :, :, None, :, None]
    row_g = torch.stack([halves(v0), halves(v1)], -2) * scale_g[..., None]  # (e, b, c, g, t, j, bh, bl)
    row_g8 = torch.stack([halves(v2), halves(v3)], -2) * scale_g8[..., None]
    both = torch.stack([row_g, row_g8], 3)  # (e, block, chunk, h, g, t, j, bh, bl)
    # row = 16 block + 8h + g, k = 64 chunk + 16j + 8bh + 2t + bl
    both = both.permute(0, 1, 3, 4, 2, 6, 7, 5, 8)
    return both.reshape(num_experts, n, k)[..., :k_logical]
