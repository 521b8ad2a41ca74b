"""Triton kernel of the grouped 1D-1D block-scaled matmul (the seed's Grouped1D1DMatmulKernel).

``out[rows of g] = epilogue(expert_scales[e] · global scales · A[rows of g] @ B[e].T + bias[e])`` with
``e = expert_ids[g]``, for all groups in one persistent launch. Operands are plain bf16/fp16,
MX (e4m3 or packed e2m1 data with e8m0 scales per 32) or NVFP4 (packed e2m1, e4m3 scales per 16,
a float32 global scale). Each operand's scale layout comes as constexpr functions of its layout module
(``formats/layouts/``): ``*_SCALE_ROWS`` finds a row's first scale, ``*_SCALE_COLS`` a column from there.
"""

import triton
import triton.language as tl

from ..formats.kernel import dequantize_tile, load_operand_tile, load_scales


@triton.jit
def _maximum(a, b):
    return tl.maximum(a, b)


@triton.jit
def _pick(values, ids, index):
    """values[index] of a small register vector."""
    return tl.sum(tl.where(ids == index, values, 0))


@triton.jit
def group_tiles(
    a_offsets_ptr,
    num_tokens,
    num_groups,
    min_group_rows,
    max_group_rows,
    n_tiles,
    BLOCK_M: tl.constexpr,
    BLOCK_GROUPS: tl.constexpr,
):
    """The tiles of a launch, read from the offsets on the device: ``(group_ids, starts, ends, tiles,
    tiles_through, total_tiles)``, per group (a ``[BLOCK_GROUPS]`` vector) its clamped row range, its tile
    count (``cdiv(rows, BLOCK_M) · n_tiles`` for groups of this launch's size class, else 0) and the running
    sum of those. Offsets are clamped to [0, num_tokens] and made non-decreasing (running maximum): whatever
    the metadata, each row belongs to at most one group and every write lands inside ``out``. The launch
    takes the groups of ``min_group_rows < rows <= max_group_rows`` (a size class)."""
    group_ids = tl.arange(0, BLOCK_GROUPS)
    in_range = group_ids < num_groups
    first_offset = tl.load(a_offsets_ptr).to(tl.int64)
    starts = tl.load(a_offsets_ptr + group_ids, mask=in_range, other=0).to(tl.int64)
    ends = tl.load(a_offsets_ptr + group_ids + 1, mask=in_range, other=0).to(tl.int64)
    starts = tl.minimum(tl.maximum(tl.associative_scan(starts, 0, _maximum), 0), num_tokens)
    ends = tl.maximum(tl.associative_scan(ends, 0, _maximum), first_offset)
    ends = tl.minimum(tl.maximum(ends, 0), num_tokens)
    rows_in_group = ends - starts
    mine = in_range & (rows_in_group > min_group_rows) & (rows_in_group <= max_group_rows)
    tiles = tl.where(mine, tl.cdiv(rows_in_group, BLOCK_M) * n_tiles, 0)
    return group_ids, starts, ends, tiles, tl.cumsum(tiles, 0), tl.sum(tiles)


@triton.jit
def find_group(tile, group_ids, starts, ends, tiles, tiles_through):
    """``(group, group_start, group_end, tile_in_group)`` of a tile numbered as :func:`group_tiles` counts."""
    group = tl.sum((tiles_through <= tile).to(tl.int32))
    group_start = _pick(starts, group_ids, group)
    group_end = _pick(ends, group_ids, group)
    tile_in_group = tile - (_pick(tiles_through, group_ids, group) - _pick(tiles, group_ids, group))
    return group, group_start, group_end, tile_in_group


@triton.jit
def apply_epilogue(
    acc,
    up_acc,
    multiplier,
    bias,
    up_bias,
    rows,
    cols,
    EPILOGUE: tl.constexpr,
    EPILOGUE_FN: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    GLU_ALPHA: tl.constexpr,
    GLU_LIMIT: tl.constexpr,
    GLU_UP_SHIFT: tl.constexpr,
):
    """The epilogue on the fp32 accumulator: ``multiplier`` (global and expert scales), the bias (``bias`` and,
    for SwiGLU, ``up_bias`` broadcast against ``acc``), then the activation (SwiGLU's parameters as
    :class:`SwiGLU` holds them, GLU_LIMIT None for no clamp). ``rows`` and ``cols`` broadcast against ``acc``
    (the user function's row and column indices)."""
    acc = acc * multiplier
    if HAS_BIAS:
        acc = acc + bias
    if EPILOGUE == "silu":
        acc = acc * tl.sigmoid(acc)
    elif EPILOGUE == "gelu":
        acc = 0.5 * acc * (1.0 + tl.erf(acc * 0.7071067811865476))
    elif EPILOGUE == "swiglu":
        up = up_acc * multiplier
        if HAS_BIAS:
            up = up + up_bias
        if GLU_LIMIT is not None:  # NaN stays NaN, as torch.clamp keeps it
            acc = tl.minimum(acc, GLU_LIMIT, propagate_nan=tl.PropagateNan.ALL)
            up = tl.minimum(
                tl.maximum(up, -GLU_LIMIT, propagate_nan=tl.PropagateNan.ALL),
                GLU_LIMIT,
                propagate_nan=tl.PropagateNan.ALL,
            )
        if GLU_UP_SHIFT != 0.0:
            up = up + GLU_UP_SHIFT
        slope = acc
        if GLU_ALPHA != 1.0:
            slope = acc * GLU_ALPHA
        acc = acc * tl.sigmoid(slope) * up
    elif EPILOGUE == "user":
        acc = EPILOGUE_FN(acc, rows, cols)
    return acc


@triton.jit
def _load_scales_if(
    scales_ptr,
    scale_row_base,
    row_mask,
    k_start,
    K,
    SCALE: tl.constexpr,
    SCALE_BLOCK: tl.constexpr,
    SCALE_COLS: tl.constexpr,
    SCALE_WORDS: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """:func:`load_scales`, or 0 (never read) for an operand without scales."""
    if SCALE == "none":
        return 0
    else:
        return load_scales(
            scales_ptr, scale_row_base, row_mask, k_start, K, SCALE, SCALE_BLOCK, SCALE_COLS, SCALE_WORDS, BLOCK_K
        )


@triton.jit
def _step_scales(
    a_scales_ptr,
    a_scale_rows,
    row_mask,
    b_scales_ptr,
    b_scale_rows,
    up_scale_rows,
    col_mask,
    k_start,
    K,
    A_SCALE: tl.constexpr,
    A_SCALE_BLOCK: tl.constexpr,
    A_SCALE_COLS: tl.constexpr,
    B_SCALE: tl.constexpr,
    B_SCALE_BLOCK: tl.constexpr,
    B_SCALE_COLS: tl.constexpr,
    EPILOGUE: tl.constexpr,
    SCALE_WORDS: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """The scale bits of one K step: A's, B's and (SwiGLU) the up rows' of B; 0 for unscaled operands."""
    a = _load_scales_if(
        a_scales_ptr, a_scale_rows, row_mask, k_start, K, A_SCALE, A_SCALE_BLOCK, A_SCALE_COLS, SCALE_WORDS, BLOCK_K
    )
    b = _load_scales_if(
        b_scales_ptr, b_scale_rows, col_mask, k_start, K, B_SCALE, B_SCALE_BLOCK, B_SCALE_COLS, SCALE_WORDS, BLOCK_K
    )
    up = b
    if EPILOGUE == "swiglu":
        up = _load_scales_if(
            b_scales_ptr,
            up_scale_rows,
            col_mask,
            k_start,
            K,
            B_SCALE,
            B_SCALE_BLOCK,
            B_SCALE_COLS,
            SCALE_WORDS,
            BLOCK_K,
        )
    return a, b, up


@triton.jit
def _dot_scales(scale_bits, SCALE: tl.constexpr):
    """Scale bits as ``tl.dot_scaled`` takes them: e8m0 as uint8, NVFP4's e4m3 as float8e4nv (one scale per
    16 elements: Blackwell's ``kind::mxf4nvf4``)."""
    if SCALE == "e4m3":
        return scale_bits.to(tl.float8e4nv, bitcast=True)
    else:
        return scale_bits


@triton.jit
def retire_mma(acc, RETIRE_MMA: tl.constexpr):
    """``acc`` once the MMAs that wrote it have finished, where ``RETIRE_MMA`` (Triton < 3.9 on Hopper).

    Triton 3.6's pipeliner leaves a K step's register-operand wgmmas in flight into the next step, whose
    decode then writes registers ptxas may have given to their A fragments (undefined in PTX,
    triton-lang/triton#9433): results that change from run to run. A use of ``acc`` outside an MMA makes
    Triton wait for them at the end of the step; the empty asm is that use, at no instruction. Found by
    ``tools/sass_hazards.py``; see lab/NOTES.md."""
    if RETIRE_MMA:
        return tl.inline_asm_elementwise("", "=f,0", [acc], dtype=tl.float32, is_pure=True, pack=1)
    else:
        return acc


@triton.jit
def _mma_step(
    acc,
    a_data,
    a_scale_bits,
    b_data,
    b_scale_bits,
    A_ELEMENT: tl.constexpr,
    A_SCALE: tl.constexpr,
    A_SCALE_BLOCK: tl.constexpr,
    B_ELEMENT: tl.constexpr,
    B_SCALE: tl.constexpr,
    B_SCALE_BLOCK: tl.constexpr,
    USE_DOT_SCALED: tl.constexpr,
    SWAP_AB: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    COMPUTE_DTYPE: tl.constexpr,
    PACKED_DECODE: tl.constexpr,
):
    """One K step: acc ``[BLOCK_M, BLOCK_N]`` += A tile ``[BLOCK_M, BLOCK_K]`` @ B tile ``[BLOCK_N, BLOCK_K]``ᵀ,
    or with SWAP_AB acc ``[BLOCK_N, BLOCK_M]`` += B tile @ A tileᵀ (the weights are then the MMA's
    left operand, which Hopper's wgmma can read from registers right after decoding)."""
    if USE_DOT_SCALED:  # B is block-scaled here; A may be plain (a None scale must be a literal in 3.6)
        b_scale = _dot_scales(b_scale_bits, B_SCALE)
        if A_SCALE == "none":
            if SWAP_AB:
                return tl.dot_scaled(b_data, b_scale, B_ELEMENT, tl.trans(a_data), None, A_ELEMENT, acc)
            else:
                return tl.dot_scaled(a_data, None, A_ELEMENT, tl.trans(b_data), b_scale, B_ELEMENT, acc)
        else:
            a_scale = _dot_scales(a_scale_bits, A_SCALE)
            if SWAP_AB:
                return tl.dot_scaled(b_data, b_scale, B_ELEMENT, tl.trans(a_data), a_scale, A_ELEMENT, acc)
            else:
                return tl.dot_scaled(a_data, a_scale, A_ELEMENT, tl.trans(b_data), b_scale, B_ELEMENT, acc)
    else:
        a = dequantize_tile(
            a_data, a_scale_bits, A_ELEMENT, A_SCALE, A_SCALE_BLOCK, BLOCK_M, BLOCK_K, COMPUTE_DTYPE, PACKED_DECODE
        )
        b = dequantize_tile(
            b_data, b_scale_bits, B_ELEMENT, B_SCALE, B_SCALE_BLOCK, BLOCK_N, BLOCK_K, COMPUTE_DTYPE, PACKED_DECODE
        )
        if SWAP_AB:
            return tl.dot(b, tl.trans(a), acc)
        else:
            return tl.dot(a, tl.trans(b), acc)


@triton.jit
def grouped_matmul_kernel(
    a_ptr,
    a_scales_ptr,
    a_global_scale_ptr,
    b_ptr,
    b_scales_ptr,
    b_global_scale_ptr,
    out_ptr,
    a_offsets_ptr,
    a_scale_offsets_ptr,
    expert_ids_ptr,
    expert_scales_ptr,
    bias_ptr,
    stride_a_row,
    stride_a_scale_row,
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
    num_a_scale_tile_rows,
    A_ELEMENT: tl.constexpr,
    A_SCALE: tl.constexpr,
    A_SCALE_BLOCK: tl.constexpr,
    A_SCALE_ROWS: tl.constexpr,
    A_SCALE_COLS: tl.constexpr,
    A_SCALES_MAY_MISS: tl.constexpr,
    B_ELEMENT: tl.constexpr,
    B_SCALE: tl.constexpr,
    B_SCALE_BLOCK: tl.constexpr,
    B_SCALE_ROWS: tl.constexpr,
    B_SCALE_COLS: tl.constexpr,
    A_GLOBAL_SCALE: tl.constexpr,
    B_GLOBAL_SCALE: tl.constexpr,
    HAS_EXPERT_SCALES: tl.constexpr,
    EPILOGUE: tl.constexpr,
    EPILOGUE_FN: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    GLU_ALPHA: tl.constexpr,
    GLU_LIMIT: tl.constexpr,
    GLU_UP_SHIFT: tl.constexpr,
    GLU_INTERLEAVED: tl.constexpr,
    USE_DOT_SCALED: tl.constexpr,
    SWAP_AB: tl.constexpr,
    PREFETCH_SCALES: tl.constexpr,
    SCALE_WORDS: tl.constexpr,
    PACKED_DECODE: tl.constexpr,
    RETIRE_MMA: tl.constexpr,
    COMPUTE_DTYPE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_GROUPS: tl.constexpr,
):
    """Persistent grouped matmul.

    a: ``[num_tokens, K]`` (bytes ``[num_tokens, K/2]`` for e2m1); b: ``[num_experts, N, K]``;
    out: ``[num_tokens, N_out]`` with ``N_out = N / 2`` for SwiGLU, else N; bias (HAS_BIAS): ``[num_experts, N]``
    in B's row order, unit column stride. SwiGLU reads gate and up rows as ``[gate | up]`` halves of B, or
    alternating (GLU_INTERLEAVED; row scales only). a_offsets: ``[G + 1]``,
    expert_ids: int32 ``[G]``, a_scale_offsets: int32 ``[G]`` (grouped 128x4 A scales only).
    Element types: ``"bf16" | "fp16" | "e4m3" | "e2m1"``; scales ``"none" | "e8m0" | "e4m3"``;
    A's scale layout: ``A_SCALE_ROWS`` / ``A_SCALE_COLS`` (its layout's ``token_scale_rows`` / ``scale_cols``) with
    A_SCALES_MAY_MISS where rows can lack scales; B's: ``B_SCALE_ROWS`` / ``B_SCALE_COLS`` (``expert_scale_rows`` /
    ``scale_cols``). ``*_GLOBAL_SCALE``:
    a float32 per-tensor scale (NVFP4) multiplies the accumulator; it stays here when A was decoded
    ahead by :func:`upcast_rows_kernel` (which applies only the block scales).

    Tiles are numbered group after group, M-tiles fastest inside a group; program p takes tiles
    p, p + num_programs, ... Only groups of ``min_group_rows < rows <= max_group_rows`` are this
    launch's: the host may split a call into size classes, each with its own tile height. Each program
    derives every tile's group from a_offsets on the device.

    No metadata value can move a load or store outside its tensor: offsets are clamped to [0, num_tokens]
    and to their running maximum (so no row is written twice); a group whose expert id is outside
    [0, num_experts) is written as zeros; with A scales whose rows can lack scales (grouped 128x4: a row whose
    scale tile-row ``group_start // 128 + a_scale_offsets[g] + local_row // 128`` falls outside the
    ``num_a_scale_tile_rows`` tile-rows of A's scales) such a row reads no scales and is written as NaN.
    """
    n_out = N // 2 if EPILOGUE == "swiglu" else N
    n_tiles = tl.cdiv(n_out, BLOCK_N)

    group_ids, starts, ends, tiles, tiles_through, total_tiles = group_tiles(
        a_offsets_ptr, num_tokens, num_groups, min_group_rows, max_group_rows, n_tiles, BLOCK_M, BLOCK_GROUPS
    )

    a_global_scale = 1.0
    if A_GLOBAL_SCALE:
        a_global_scale = tl.load(a_global_scale_ptr)
    b_global_scale = 1.0
    if B_GLOBAL_SCALE:
        b_global_scale = tl.load(b_global_scale_ptr)
    num_k_tiles = tl.cdiv(K, BLOCK_K)

    for tile in range(tl.program_id(0), total_tiles, tl.num_programs(0)):
        group, group_start, group_end, tile_in_group = find_group(tile, group_ids, starts, ends, tiles, tiles_through)
        m_tiles = tl.cdiv(group_end - group_start, BLOCK_M)
        tile_m = tile_in_group % m_tiles
        tile_n = tile_in_group // m_tiles

        expert = tl.load(expert_ids_ptr + group)
        expert_ok = (expert >= 0) & (expert < num_experts)
        expert = tl.where(expert_ok, expert, 0).to(tl.int64)

        rows = group_start + tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
        row_mask = rows < group_end
        cols = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
        col_mask = cols < n_out

        a_row_offsets = rows * stride_a_row
        a_scale_rows, a_scale_mask = A_SCALE_ROWS(
            rows,
            row_mask,
            group,
            group_start,
            a_scale_offsets_ptr,
            stride_a_scale_row,
            num_a_scale_tile_rows,
            K,
            A_SCALE_BLOCK,
        )

        b_rows = cols
        up_rows = cols + n_out  # SwiGLU: B's rows are [gate | up] halves ...
        if GLU_INTERLEAVED:  # ... or alternate gate and up
            b_rows = 2 * cols
            up_rows = b_rows + 1
        b_row_offsets = expert * stride_b_expert + b_rows * stride_b_row
        b_scale_rows = B_SCALE_ROWS(expert, b_rows, stride_b_scale_expert, stride_b_scale_row, N, K, B_SCALE_BLOCK)
        up_scale_rows = b_scale_rows
        if EPILOGUE == "swiglu":
            up_row_offsets = expert * stride_b_expert + up_rows * stride_b_row
            up_scale_rows = B_SCALE_ROWS(
                expert, up_rows, stride_b_scale_expert, stride_b_scale_row, N, K, B_SCALE_BLOCK
            )

        if SWAP_AB:
            acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        up_acc = acc
        # Byte-wide scale loads are not software-pipelined by Triton 3.6 (word loads are, SCALE_WORDS):
        # with PREFETCH_SCALES each K step's scales are loaded one step ahead, into registers, so that
        # their latency hides behind a step of decode and MMA (the prefetch past K is masked off).
        # Without it (the ablation's baseline) each step loads its own scales.
        if PREFETCH_SCALES:
            a_scale_next, b_scale_next, up_scale_next = _step_scales(
                a_scales_ptr,
                a_scale_rows,
                a_scale_mask,
                b_scales_ptr,
                b_scale_rows,
                up_scale_rows,
                col_mask,
                0,
                K,
                A_SCALE,
                A_SCALE_BLOCK,
                A_SCALE_COLS,
                B_SCALE,
                B_SCALE_BLOCK,
                B_SCALE_COLS,
                EPILOGUE,
                SCALE_WORDS,
                BLOCK_K,
            )
        for k_tile in range(0, tl.where(expert_ok, num_k_tiles, 0)):
            k_start = k_tile * BLOCK_K
            loaded = _step_scales(
                a_scales_ptr,
                a_scale_rows,
                a_scale_mask,
                b_scales_ptr,
                b_scale_rows,
                up_scale_rows,
                col_mask,
                k_start + BLOCK_K if PREFETCH_SCALES else k_start,
                K,
                A_SCALE,
                A_SCALE_BLOCK,
                A_SCALE_COLS,
                B_SCALE,
                B_SCALE_BLOCK,
                B_SCALE_COLS,
                EPILOGUE,
                SCALE_WORDS,
                BLOCK_K,
            )
            if PREFETCH_SCALES:
                a_scale_bits, b_scale_bits, up_scale_bits = a_scale_next, b_scale_next, up_scale_next
                a_scale_next, b_scale_next, up_scale_next = loaded
            else:  # this step's own scales, just loaded
                a_scale_bits, b_scale_bits, up_scale_bits = loaded
            a_data = load_operand_tile(a_ptr, a_row_offsets, row_mask, k_start, K, A_ELEMENT, BLOCK_K)
            b_data = load_operand_tile(b_ptr, b_row_offsets, col_mask, k_start, K, B_ELEMENT, BLOCK_K)
            acc = _mma_step(
                acc,
                a_data,
                a_scale_bits,
                b_data,
                b_scale_bits,
                A_ELEMENT,
                A_SCALE,
                A_SCALE_BLOCK,
                B_ELEMENT,
                B_SCALE,
                B_SCALE_BLOCK,
                USE_DOT_SCALED,
                SWAP_AB,
                BLOCK_M,
                BLOCK_N,
                BLOCK_K,
                COMPUTE_DTYPE,
                PACKED_DECODE,
            )
            if EPILOGUE == "swiglu":
                up_data = load_operand_tile(b_ptr, up_row_offsets, col_mask, k_start, K, B_ELEMENT, BLOCK_K)
                up_acc = _mma_step(
                    up_acc,
                    a_data,
                    a_scale_bits,
                    up_data,
                    up_scale_bits,
                    A_ELEMENT,
                    A_SCALE,
                    A_SCALE_BLOCK,
                    B_ELEMENT,
                    B_SCALE,
                    B_SCALE_BLOCK,
                    USE_DOT_SCALED,
                    SWAP_AB,
                    BLOCK_M,
                    BLOCK_N,
                    BLOCK_K,
                    COMPUTE_DTYPE,
                    PACKED_DECODE,
                )
                up_acc = retire_mma(up_acc, RETIRE_MMA)
            acc = retire_mma(acc, RETIRE_MMA)

        if SWAP_AB:
            acc = tl.trans(acc)
            up_acc = tl.trans(up_acc)
        multiplier = a_global_scale * b_global_scale
        if HAS_EXPERT_SCALES:
            multiplier = multiplier * tl.load(expert_scales_ptr + expert)
        bias = 0.0
        up_bias = 0.0
        if HAS_BIAS:
            bias_row = bias_ptr + expert * stride_bias_expert
            bias = tl.load(bias_row + b_rows, mask=col_mask, other=0.0).to(tl.float32)[None, :]
            if EPILOGUE == "swiglu":
                up_bias = tl.load(bias_row + up_rows, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        acc = apply_epilogue(
            acc,
            up_acc,
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
        acc = tl.where(expert_ok, acc, 0.0)
        if A_SCALES_MAY_MISS:  # rows whose scales lie outside A's scale tensor
            acc = tl.where(a_scale_mask[:, None] | ~row_mask[:, None], acc, float("nan"))
        out_offsets = rows[:, None] * stride_out_row + cols[None, :]
        tl.store(out_ptr + out_offsets, acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])
