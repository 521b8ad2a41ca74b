"""The grouped matmul for MXFP4 and NVFP4 weights in the Hopper layout (:mod:`llmkernels.formats.layouts.hopper`).

Each thread loads 16 bytes of weights that, decoded in registers (masks, shifts and bf16x2 multiplies), are
exactly its part of wgmma's register operand: no shared-memory round trip between decode and MMA. The
product is computed swapped, ``Cᵀ = W · Aᵀ``: the weight tile is the MMA's M side (``BLOCK_N`` rows), the
group's tokens its N side (``BLOCK_M``). Activations are bf16 (a quantized A is decoded ahead by the host
layer), or fp8 ``block=(1, 128)`` (A_FP8_BLOCKS: e4m3 with a float32 scale per token and 128 K; the w4a8 pair), whose
e4m3 tile the kernel converts to bf16 (exact) and whose scales it applies to each 128-wide K step's fp32 partial.
What each choice measured: ``lab/NOTES.md``.
"""

import triton
import triton.language as tl

from ..formats.layouts.hopper import load_fragment_tile
from .kernel import apply_epilogue, find_group, group_tiles, retire_mma


@triton.jit
def hopper_fp4_matmul_kernel(
    a_ptr,
    a_global_scale_ptr,
    b_ptr,
    b_scales_ptr,
    b_global_scale_ptr,
    out_ptr,
    a_offsets_ptr,
    expert_ids_ptr,
    expert_scales_ptr,
    bias_ptr,
    a_scales_ptr,
    stride_a_row,
    stride_b_expert,
    stride_b_scale_expert,
    stride_out_row,
    stride_bias_expert,
    num_tokens,
    num_groups,
    num_experts,
    N,
    K,
    min_group_rows,
    max_group_rows,
    stride_a_scale_row,
    stride_a_scale_k,
    B_SCALE: tl.constexpr,
    A_FP8_BLOCKS: tl.constexpr,
    A_GLOBAL_SCALE: tl.constexpr,
    B_GLOBAL_SCALE: tl.constexpr,
    HAS_EXPERT_SCALES: tl.constexpr,
    EPILOGUE: tl.constexpr,
    EPILOGUE_FN: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    GLU_ALPHA: tl.constexpr,
    GLU_LIMIT: tl.constexpr,
    GLU_UP_SHIFT: tl.constexpr,
    EVEN_K: tl.constexpr,
    PACKED_DECODE: tl.constexpr,
    RETIRE_MMA: tl.constexpr,
    COMPUTE_DTYPE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_GROUPS: tl.constexpr,
):
    """``out[rows of g] = epilogue(a_global · b_global · expert_scales[e] · A[rows of g] @ B[e]ᵀ + bias[e])``,
    ``e = expert_ids[g]``.

    a: bf16 ``[num_tokens, K]`` (float32 in the interpreter), unit column stride; or with A_FP8_BLOCKS e4m3 bytes
    ``[num_tokens, K]``, unit column stride, and a_scales float32 ``[num_tokens, cdiv(K, 128)]`` of any strides
    (``stride_a_scale_row`` / ``stride_a_scale_k``; unread otherwise), BLOCK_K 128: each K step's product of A's tile in
    COMPUTE_DTYPE (every e4m3 value is exact in bf16) goes into a fresh fp32 partial, added to the accumulator times the
    step's scale of each token, ``acc += partial · a_scale[row, k / 128]``; the products are exact (e4m3 x e2m1 · 2^e),
    so the result is the portable w4a8 kernel's up to the fp32 summation order. b: uint8 ``[E, ceil(N/16), ceil(K/64),
    8, 4, 16]`` and b_scales uint8 ``[E, ceil(N/16), ceil(K/64), 8, 2, S]`` (:mod:`llmkernels.formats.layouts.hopper`;
    B_SCALE ``"e8m0"`` with S = 2 for MXFP4, ``"e4m3"`` with S = 4 for NVFP4), each expert's blocks contiguous;
    a_global_scale / b_global_scale: float32 scalars (NVFP4's decode scales) read when A_GLOBAL_SCALE / B_GLOBAL_SCALE;
    out ``[num_tokens, N_out]`` (N_out = N / 2 for SwiGLU, whose up rows start at fragment block ``N_out / 16``); bias
    ``[E, N]`` (HAS_BIAS) in B's row order, unit column stride; a_offsets ``[G + 1]``, expert_ids int32 ``[G]``.

    Non-persistent: program ``p`` takes output tile ``p // n_tiles`` of the launch's (group, M tile) order
    and weight columns ``p % n_tiles``; the host launches an upper bound of programs and the ones past the
    last tile return. Metadata is read as :func:`group_tiles` clamps it; an expert id outside
    ``[0, num_experts)`` writes zeros. Rows of the last M tile past the group's end are not stored (16-row
    tiles do not load them; taller ones read the group's rows again).
    """
    NB: tl.constexpr = BLOCK_N // 16
    C: tl.constexpr = BLOCK_K // 64
    n_out = N // 2 if EPILOGUE == "swiglu" else N
    n_tiles = tl.cdiv(n_out, BLOCK_N)
    pid = tl.program_id(0)
    tile_n = pid % n_tiles
    group_ids, starts, ends, tiles, tiles_through, total_tiles = group_tiles(
        a_offsets_ptr, num_tokens, num_groups, min_group_rows, max_group_rows, 1, BLOCK_M, BLOCK_GROUPS
    )
    tile = pid // n_tiles
    if tile >= total_tiles:
        return
    group, group_start, group_end, tile_m = find_group(tile, group_ids, starts, ends, tiles, tiles_through)
    expert = tl.load(expert_ids_ptr + group)
    expert_ok = (expert >= 0) & (expert < num_experts)
    expert = tl.where(expert_ok, expert, 0).to(tl.int64)

    tile_start = group_start + tile_m * BLOCK_M
    rows = tile_start + tl.arange(0, BLOCK_M)
    row_mask = rows < group_end
    load_rows = tile_start + tl.arange(0, BLOCK_M) % (group_end - tile_start)
    cols = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    num_blocks = tl.cdiv(N, 16)
    num_chunks = tl.cdiv(K, 64)
    # Blocks past N's last (a partial last tile) read the last block again: their columns are not stored.
    gate_blocks = tl.minimum(tile_n * NB + tl.arange(0, NB), num_blocks - 1)
    up_blocks = tl.minimum(n_out // 16 + tile_n * NB + tl.arange(0, NB), num_blocks - 1)
    data_base = b_ptr + expert * stride_b_expert
    scale_base = b_scales_ptr + expert * stride_b_scale_expert

    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    up_acc = acc
    ks = tl.arange(0, BLOCK_K)
    a_rows = a_ptr + load_rows[:, None].to(tl.int64) * stride_a_row
    if A_FP8_BLOCKS:
        tl.static_assert(BLOCK_K == 128, "a K step is one scale block of A")
        a_scale_rows = a_scales_ptr + load_rows.to(tl.int64) * stride_a_scale_row
    # 16-row tiles load no row past the group's end: with one token per expert the other 15 rows would stream
    # from L2 half as many bytes as the weights (ncu, E128 x 1 token). Taller tiles (groups of 17 rows and
    # more) load them again unmasked: a mask per row costs their pipeline 40 registers or a spill.
    a_row_ok = row_mask if BLOCK_M <= 16 else tl.full((BLOCK_M,), 1, tl.int1)
    k_end = tl.where(expert_ok, num_chunks * 64, 0)
    # At least one step, whose loads are masked off when there is nothing to multiply (K = 0 or a bad expert
    # id). A loop the compiler cannot prove runs makes ptxas serialize every wgmma on Hopper (its C7515: the
    # zero-trip path defines the accumulators before the pipeline's last wait); see lab/NOTES.md.
    for k_start in range(0, tl.maximum(k_end, 1), BLOCK_K):
        live = tl.full((1,), k_start, tl.int32) < k_end  # [1]: the interpreter takes no scalar mask
        if EVEN_K:
            a = tl.load(a_rows + (k_start + ks)[None, :], mask=a_row_ok[:, None] & live, other=0.0)
        else:
            a = tl.load(
                a_rows + (k_start + ks)[None, :], mask=a_row_ok[:, None] & (k_start + ks < K)[None, :] & live, other=0.0
            )
        if A_FP8_BLOCKS:
            a_t = tl.trans(a.to(tl.float8e4nv, bitcast=True).to(tl.float32).to(COMPUTE_DTYPE))
            # rows and steps past the ends read scale 0: their (zero) partials stay zero
            a_scale = tl.load(a_scale_rows + (k_start // 128) * stride_a_scale_k, mask=a_row_ok & live, other=0.0)
        else:
            a_t = tl.trans(a.to(COMPUTE_DTYPE))
        w = load_fragment_tile(
            data_base,
            scale_base,
            gate_blocks,
            k_start,
            num_chunks,
            live,
            EVEN_K,
            NB,
            C,
            B_SCALE,
            PACKED_DECODE,
            COMPUTE_DTYPE,
        )
        if A_FP8_BLOCKS:
            acc = acc + tl.dot(w, a_t) * a_scale[None, :]
        else:
            acc = tl.dot(w, a_t, acc)
        if EPILOGUE == "swiglu":
            w_up = load_fragment_tile(
                data_base,
                scale_base,
                up_blocks,
                k_start,
                num_chunks,
                live,
                EVEN_K,
                NB,
                C,
                B_SCALE,
                PACKED_DECODE,
                COMPUTE_DTYPE,
            )
            if A_FP8_BLOCKS:
                up_acc = retire_mma(up_acc + tl.dot(w_up, a_t) * a_scale[None, :], RETIRE_MMA)
            else:
                up_acc = retire_mma(tl.dot(w_up, a_t, up_acc), RETIRE_MMA)
        acc = retire_mma(acc, RETIRE_MMA)

    multiplier = 1.0
    if A_GLOBAL_SCALE:
        multiplier = multiplier * tl.load(a_global_scale_ptr)
    if B_GLOBAL_SCALE:
        multiplier = multiplier * tl.load(b_global_scale_ptr)
    if HAS_EXPERT_SCALES:
        multiplier = multiplier * tl.load(expert_scales_ptr + expert)
    bias = 0.0
    up_bias = 0.0
    if HAS_BIAS:
        bias_row = bias_ptr + expert * stride_bias_expert
        bias = tl.load(bias_row + cols, mask=cols < n_out, other=0.0).to(tl.float32)
        if EPILOGUE == "user":  # along the transposed tile's columns
            bias = bias[None, :]
        else:
            bias = bias[:, None]
        if EPILOGUE == "swiglu":
            up_bias = tl.load(bias_row + n_out + cols, mask=cols < n_out, other=0.0).to(tl.float32)[:, None]
    if EPILOGUE == "user":  # the user's function sees the [BLOCK_M, BLOCK_N] tile it is documented to
        result = tl.trans(
            apply_epilogue(
                tl.trans(acc),
                acc,
                multiplier,
                bias,
                up_bias,
                rows[:, None],
                cols[None, :],
                EPILOGUE,
                EPILOGUE_FN,
                HAS_BIAS,
                GLU_ALPHA,
                GLU_LIMIT,
                GLU_UP_SHIFT,
            )
        )
    else:
        result = apply_epilogue(
            acc,
            up_acc,
            multiplier,
            bias,
            up_bias,
            rows[None, :],
            cols[:, None],
            EPILOGUE,
            EPILOGUE_FN,
            HAS_BIAS,
            GLU_ALPHA,
            GLU_LIMIT,
            GLU_UP_SHIFT,
        )
    result = tl.where(expert_ok, result, 0.0)
    out_offsets = rows[None, :].to(tl.int64) * stride_out_row + cols[:, None]
    tl.store(
        out_ptr + out_offsets, result.to(out_ptr.dtype.element_ty), mask=row_mask[None, :] & (cols < n_out)[:, None]
    )
