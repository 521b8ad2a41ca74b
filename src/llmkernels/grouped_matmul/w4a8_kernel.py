"""Triton kernel of the grouped matmul on fp8 ``block=(1, 128)`` activations and MXFP4 weights (w4a8; the portable
``w4a8_blocks`` backend).

``out[rows of g] = epilogue(expert_scales[e] · Σ_kb (A_kb @ dequant(B[e])_kbᵀ) · a_scale[row, kb] + bias[e])`` with
``e = expert_ids[g]``: A e4m3 ``[T, K]`` with one float32 scale per token and 128 columns, B packed e2m1
``[E, N, K / 2]`` bytes with one e8m0 scale per 32 columns (row or 128x4 scale layout). Each K step (``BLOCK_K``
a divisor of 128, so a step lies in one scale block of A) is one ``tl.dot`` into a fresh fp32 partial of A's e4m3
tile in bf16 (exact) and B's tile decoded to bf16 (e2m1 · 2^e: exact), then the promotion
``acc += partial · a_scale`` (an fp32 FFMA per element). The products are exact; what is left is the fp32
accumulation. The group and tile lookup, the epilogue and the output rows are those of ``kernel.py`` /
``fp8_kernel.py``.
"""

import triton
import triton.language as tl

from ..formats.kernel import dequantize_tile, load_operand_tile, load_scales
from .fp8_kernel import store_sub_tile
from .kernel import find_group, group_tiles

A_SCALE_BLOCK = tl.constexpr(128)  # A's scale block along K
B_SCALE_BLOCK = tl.constexpr(32)  # MXFP4's


@triton.jit
def _promoted_step(
    acc,
    a,
    a_scale,
    b_ptr,
    b_row_offsets,
    b_scales_ptr,
    b_scale_rows,
    b_mask,
    k_start,
    K,
    B_SCALE_COLS: tl.constexpr,
    SWAP_AB: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    COMPUTE_DTYPE: tl.constexpr,
    PACKED_DECODE: tl.constexpr,
):
    """One K step of one weight tile: B's rows (``b_row_offsets``, bytes; ``b_scale_rows``: their first scales)
    decoded to COMPUTE_DTYPE, the product with ``a`` (``[BLOCK_M, BLOCK_K]`` in COMPUTE_DTYPE) into a fresh fp32
    partial, then ``acc += partial · a_scale`` (``a_scale`` ``[BLOCK_M]``); acc ``[BLOCK_M, BLOCK_N]``, or
    ``[BLOCK_N, BLOCK_M]`` with SWAP_AB (the weights on the MMA's M side). The partial's use outside the MMA makes
    each step wait for its MMAs (no register-operand wgmma is left in flight into the next step's decode)."""
    data = load_operand_tile(b_ptr, b_row_offsets, b_mask, k_start, K, "e2m1", BLOCK_K)
    scale_bits = load_scales(
        b_scales_ptr, b_scale_rows, b_mask, k_start, K, "e8m0", B_SCALE_BLOCK, B_SCALE_COLS, False, BLOCK_K
    )
    b = dequantize_tile(data, scale_bits, "e2m1", "e8m0", B_SCALE_BLOCK, BLOCK_N, BLOCK_K, COMPUTE_DTYPE, PACKED_DECODE)
    if SWAP_AB:
        partial = tl.dot(b, tl.trans(a))
        return acc + partial * a_scale[None, :]
    else:
        partial = tl.dot(a, tl.trans(b))
        return acc + partial * a_scale[:, None]


@triton.jit
def w4a8_matmul_kernel(
    a_ptr,
    a_scales_ptr,
    b_ptr,
    b_scales_ptr,
    out_ptr,
    a_offsets_ptr,
    expert_ids_ptr,
    expert_scales_ptr,
    bias_ptr,
    stride_a_row,
    stride_a_scale_row,
    stride_a_scale_k,
    stride_b_expert,
    stride_b_row,
    stride_b_scale_expert,
    stride_b_scale_row,
    stride_out_row,
    stride_bias_expert,
    num_tokens,
    num_groups,
    num_experts,
    N,
    K,
    min_group_rows,
    max_group_rows,
    B_SCALE_ROWS: tl.constexpr,
    B_SCALE_COLS: tl.constexpr,
    HAS_EXPERT_SCALES: tl.constexpr,
    EPILOGUE: tl.constexpr,
    EPILOGUE_FN: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    GLU_ALPHA: tl.constexpr,
    GLU_LIMIT: tl.constexpr,
    GLU_UP_SHIFT: tl.constexpr,
    GLU_INTERLEAVED: tl.constexpr,
    SWAP_AB: tl.constexpr,
    PACKED_DECODE: tl.constexpr,
    COMPUTE_DTYPE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_GROUPS: tl.constexpr,
):
    """Grouped matmul of fp8 ``(1, 128)`` activations and MXFP4 weights, per-step promotion by A's scales.

    a: e4m3 bytes ``[num_tokens, K]``, unit column stride; a_scales float32 ``[num_tokens, cdiv(K, 128)]``, any
    strides; b: packed e2m1 bytes ``[num_experts, N, K / 2]``, unit column stride; b_scales e8m0 bytes addressed by
    the layout's ``B_SCALE_ROWS`` / ``B_SCALE_COLS`` (its ``expert_scale_rows`` / ``scale_cols``); out
    ``[num_tokens, N_out]`` (``N_out = N / 2`` for SwiGLU, else N), unit column stride; bias (HAS_BIAS)
    ``[num_experts, N]`` in B's row order, unit column stride; a_offsets ``[G + 1]``; expert_ids int32 ``[G]``;
    expert_scales float32 ``[num_experts]``. SwiGLU reads gate and up rows as ``[gate | up]`` halves of B or
    alternating (GLU_INTERLEAVED). BLOCK_K divides 128 (each step reads one scale of A per row).

    Tiles, groups, size classes (``min_group_rows < rows <= max_group_rows``), clamped offsets and the epilogue are
    those of :func:`~llmkernels.grouped_matmul.kernel.grouped_matmul_kernel`. Program p takes tiles p,
    p + num_programs, ... A group whose expert id is outside ``[0, num_experts)`` runs no K step and is written as
    zeros.
    """
    tl.static_assert(A_SCALE_BLOCK % BLOCK_K == 0, "a K step lies in one scale block of A")
    n_out = N // 2 if EPILOGUE == "swiglu" else N
    n_tiles = tl.cdiv(n_out, BLOCK_N)
    group_ids, starts, ends, tiles, tiles_through, total_tiles = group_tiles(
        a_offsets_ptr, num_tokens, num_groups, min_group_rows, max_group_rows, n_tiles, BLOCK_M, BLOCK_GROUPS
    )
    for tile in range(tl.program_id(0), total_tiles, tl.num_programs(0)):
        group, group_start, group_end, tile_in_group = find_group(tile, group_ids, starts, ends, tiles, tiles_through)
        m_tiles = tl.cdiv(group_end - group_start, BLOCK_M)
        tile_m = tile_in_group % m_tiles
        tile_n = tile_in_group // m_tiles

        expert = tl.load(expert_ids_ptr + group)
        expert_ok = (expert >= 0) & (expert < num_experts)
        expert = tl.where(expert_ok, expert, 0).to(tl.int64)

        # a 64-bit base per tile, 32-bit offsets inside it
        tile_start = group_start + tile_m * BLOCK_M
        local_rows = tl.arange(0, BLOCK_M)
        rows = tile_start + local_rows
        row_mask = rows < group_end
        a_tile_ptr = a_ptr + tile_start * stride_a_row
        a_row_offsets = local_rows * stride_a_row
        a_scale_ptrs = (a_scales_ptr + tile_start * stride_a_scale_row) + local_rows * stride_a_scale_row

        cols = (tile_n * BLOCK_N).to(tl.int32) + tl.arange(0, BLOCK_N)
        col_mask = cols < n_out
        gate_rows = cols
        up_rows = cols + n_out  # SwiGLU: B's rows are [gate | up] halves ...
        if GLU_INTERLEAVED:  # ... or alternate gate and up
            gate_rows = 2 * cols
            up_rows = gate_rows + 1
        gate_offsets = expert * stride_b_expert + gate_rows * stride_b_row
        gate_scale_rows = B_SCALE_ROWS(expert, gate_rows, stride_b_scale_expert, stride_b_scale_row, N, K, 32)
        up_offsets = gate_offsets
        up_scale_rows = gate_scale_rows
        if EPILOGUE == "swiglu":
            up_offsets = expert * stride_b_expert + up_rows * stride_b_row
            up_scale_rows = B_SCALE_ROWS(expert, up_rows, stride_b_scale_expert, stride_b_scale_row, N, K, 32)

        if SWAP_AB:
            acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        up_acc = acc
        for k_step in range(0, tl.where(expert_ok, tl.cdiv(K, BLOCK_K), 0)):
            k_start = k_step * BLOCK_K
            a_bits = load_operand_tile(a_tile_ptr, a_row_offsets, row_mask, k_start, K, "e4m3", BLOCK_K)
            a = a_bits.to(tl.float8e4nv, bitcast=True).to(tl.float32).to(COMPUTE_DTYPE)
            a_scale = tl.load(a_scale_ptrs + (k_start // A_SCALE_BLOCK) * stride_a_scale_k, mask=row_mask, other=0.0)
            acc = _promoted_step(
                acc,
                a,
                a_scale,
                b_ptr,
                gate_offsets,
                b_scales_ptr,
                gate_scale_rows,
                col_mask,
                k_start,
                K,
                B_SCALE_COLS,
                SWAP_AB,
                BLOCK_N,
                BLOCK_K,
                COMPUTE_DTYPE,
                PACKED_DECODE,
            )
            if EPILOGUE == "swiglu":
                up_acc = _promoted_step(
                    up_acc,
                    a,
                    a_scale,
                    b_ptr,
                    up_offsets,
                    b_scales_ptr,
                    up_scale_rows,
                    col_mask,
                    k_start,
                    K,
                    B_SCALE_COLS,
                    SWAP_AB,
                    BLOCK_N,
                    BLOCK_K,
                    COMPUTE_DTYPE,
                    PACKED_DECODE,
                )

        multiplier = 1.0
        if HAS_EXPERT_SCALES:
            multiplier = tl.load(expert_scales_ptr + expert)
        store_sub_tile(
            out_ptr,
            acc,
            up_acc,
            bias_ptr,
            expert,
            expert_ok,
            multiplier,
            rows,
            row_mask,
            out_ptr + tile_start * stride_out_row,
            local_rows,
            cols,
            gate_rows,
            up_rows,
            n_out,
            stride_out_row,
            stride_bias_expert,
            SWAP_AB,
            EPILOGUE,
            EPILOGUE_FN,
            HAS_BIAS,
            GLU_ALPHA,
            GLU_LIMIT,
            GLU_UP_SHIFT,
        )
