"""Triton kernel of the grouped matmul on DeepSeek-style FP8 blocks (the portable ``fp8_blocks`` backend).

``out[rows of g] = epilogue(expert_scales[e] · Σ_kb (A_kb @ B[e]_kbᵀ) · a_scale[row, kb] · b_scale[e, n // 128, kb]
+ bias[e])`` with ``e = expert_ids[g]``: A e4m3 ``[T, K]`` with one float32 scale per token and 128 columns, B e4m3
``[E, N, K]`` with one float32 scale per 128 x 128 tile. Each 128-wide K step is one ``tl.dot`` of the raw e4m3
tiles into a fresh fp32 partial (the tensor core never accumulates more than 128 products in its reduced-precision
fp8 accumulator), then the *promotion* ``acc += partial · a_scale · b_scale``, an fp32 FFMA per element (DeepGEMM's
scheme). The group and tile lookup, the epilogue and the output rows are those of ``kernel.py``.
"""

import triton
import triton.language as tl

from .kernel import apply_epilogue, find_group, group_tiles

SCALE_BLOCK = tl.constexpr(128)  # the format's block side, along K and (weights) along N


@triton.jit
def _weight_tile(
    b_ptr,
    b_scales_ptr,
    expert,
    first_row,
    N,
    stride_b_expert,
    stride_b_row,
    stride_b_scale_expert,
    stride_b_scale_row,
    INTERLEAVED: tl.constexpr,
    UNIFORM_SCALES: tl.constexpr,
    SUB_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Pointers of one weight sub-tile, rows ``first_row + i`` (``first_row + 2i``: INTERLEAVED, i < SUB_N) of expert ``expert`` at K
    step 0: data ``[SUB_N, BLOCK_K]`` and scales (one scalar pointer with UNIFORM_SCALES, where the host knows the
    rows lie in one 128-row scale block; else one per row). Rows past N read row N - 1 (never stored): no masks in
    the K loop. A 64-bit base per sub-tile and 32-bit offsets inside it."""
    if INTERLEAVED:
        relative = 2 * tl.arange(0, SUB_N)
    else:
        relative = tl.arange(0, SUB_N)
    relative = tl.minimum(relative, N - 1 - first_row)
    base = b_ptr + expert * stride_b_expert + first_row.to(tl.int64) * stride_b_row
    tile_ptrs = base + (relative[:, None] * stride_b_row + tl.arange(0, BLOCK_K)[None, :])
    scale_base = b_scales_ptr + expert * stride_b_scale_expert
    if UNIFORM_SCALES:
        scale_ptrs = scale_base + (tl.minimum(first_row, N - 1) // SCALE_BLOCK) * stride_b_scale_row
    else:
        scale_ptrs = scale_base + ((first_row + relative) // SCALE_BLOCK) * stride_b_scale_row
    return tile_ptrs, scale_ptrs


@triton.jit
def _load_e4m3(ptrs, k_start, K, EVEN_K: tl.constexpr, BLOCK_K: tl.constexpr):
    """An e4m3 tile at K offset ``k_start``; a ragged last step reads zeros past K (a stray byte could be a NaN
    code)."""
    if EVEN_K:
        data = tl.load(ptrs + k_start)
    else:
        data = tl.load(ptrs + k_start, mask=(tl.arange(0, BLOCK_K) < K - k_start)[None, :], other=0)
    return data.to(tl.float8e4nv, bitcast=True)


@triton.jit
def _promoted_step(
    acc,
    a,
    a_scale,
    b_ptrs,
    b_scale_ptrs,
    k_step,
    stride_b_scale_k,
    K,
    UNIFORM_SCALES: tl.constexpr,
    SWAP_AB: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """One 128-wide K step of one weight sub-tile: the e4m3 product into a fresh fp32 partial, then
    ``acc += partial · a_scale · b_scale``. a ``[BLOCK_M, BLOCK_K]`` e4m3, a_scale ``[BLOCK_M]``; acc
    ``[BLOCK_M, SUB_N]``, or ``[SUB_N, BLOCK_M]`` with SWAP_AB (the weights on the MMA's M side)."""
    b = _load_e4m3(b_ptrs, k_step * BLOCK_K, K, EVEN_K, BLOCK_K)
    b_scale = tl.load(b_scale_ptrs + k_step * stride_b_scale_k)
    if SWAP_AB:
        partial = tl.dot(b, tl.trans(a))
        if UNIFORM_SCALES:
            return acc + partial * (a_scale * b_scale)[None, :]
        else:
            return acc + partial * (b_scale[:, None] * a_scale[None, :])
    else:
        partial = tl.dot(a, tl.trans(b))
        if UNIFORM_SCALES:
            return acc + partial * (a_scale * b_scale)[:, None]
        else:
            return acc + partial * (a_scale[:, None] * b_scale[None, :])


@triton.jit
def store_sub_tile(
    out_ptr,
    acc,
    up_acc,
    bias_ptr,
    expert,
    expert_ok,
    multiplier,
    rows,
    row_mask,
    out_row_base,
    out_rows,
    cols,
    gate_rows,
    up_rows,
    n_out,
    stride_out_row,
    stride_bias_expert,
    SWAP_AB: tl.constexpr,
    EPILOGUE: tl.constexpr,
    EPILOGUE_FN: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    GLU_ALPHA: tl.constexpr,
    GLU_LIMIT: tl.constexpr,
    GLU_UP_SHIFT: tl.constexpr,
):
    """The epilogue of ``kernel.py`` (:func:`apply_epilogue`) on one sub-tile's accumulators and its masked store
    into ``out[rows, cols]`` (zeros for a bad expert id); ``gate_rows`` / ``up_rows``: B's rows of its columns (the
    bias rows)."""
    if SWAP_AB:
        acc = tl.trans(acc)
        up_acc = tl.trans(up_acc)
    col_mask = cols < n_out
    bias = 0.0
    up_bias = 0.0
    if HAS_BIAS:
        bias_row = bias_ptr + expert * stride_bias_expert
        bias = tl.load(bias_row + gate_rows, mask=col_mask, other=0.0).to(tl.float32)[None, :]
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
    out_offsets = out_rows[:, None] * stride_out_row + cols[None, :]
    tl.store(out_row_base + out_offsets, acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


@triton.jit
def _fp8_tile(
    tile,
    group_ids,
    starts,
    ends,
    tiles,
    tiles_through,
    a_ptr,
    a_scales_ptr,
    b_ptr,
    b_scales_ptr,
    out_ptr,
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
    stride_b_scale_k,
    stride_out_row,
    stride_bias_expert,
    num_experts,
    N,
    n_out,
    K,
    HAS_EXPERT_SCALES: tl.constexpr,
    EPILOGUE: tl.constexpr,
    EPILOGUE_FN: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    GLU_ALPHA: tl.constexpr,
    GLU_LIMIT: tl.constexpr,
    GLU_UP_SHIFT: tl.constexpr,
    GLU_INTERLEAVED: tl.constexpr,
    SWAP_AB: tl.constexpr,
    EVEN_K: tl.constexpr,
    SPLIT_N: tl.constexpr,
    UNIFORM_SCALES: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """One output tile: ``BLOCK_M`` tokens of one group times ``BLOCK_N`` output columns, over all of K."""
    SUB_N: tl.constexpr = BLOCK_N // SPLIT_N
    group, group_start, group_end, tile_in_group = find_group(tile, group_ids, starts, ends, tiles, tiles_through)
    m_tiles = tl.cdiv(group_end - group_start, BLOCK_M)
    tile_m = tile_in_group % m_tiles
    tile_n = tile_in_group // m_tiles

    expert = tl.load(expert_ids_ptr + group)
    expert_ok = (expert >= 0) & (expert < num_experts)
    expert = tl.where(expert_ok, expert, 0).to(tl.int64)

    # A 64-bit base per tile, 32-bit offsets inside it. Rows past the group's end re-read its rows (never
    # stored), so the K loop's loads need no row masks; only a ragged K is masked.
    tile_start = group_start + tile_m * BLOCK_M
    tile_rows = (group_end - tile_start).to(tl.int32)
    local_rows = tl.arange(0, BLOCK_M)
    rows = tile_start + local_rows
    row_mask = local_rows < tile_rows
    load_rows = local_rows % tile_rows
    a_ptrs = (a_ptr + tile_start * stride_a_row) + (load_rows[:, None] * stride_a_row + tl.arange(0, BLOCK_K)[None, :])
    a_scale_ptrs = (a_scales_ptr + tile_start * stride_a_scale_row) + load_rows * stride_a_scale_row

    # Output columns of sub-tile j: first_col + j · SUB_N + i; their B rows are the columns (no SwiGLU), the
    # [gate | up] halves' rows c and n_out + c, or interleaved rows 2c and 2c + 1.
    first_col = (tile_n * BLOCK_N).to(tl.int32)
    if GLU_INTERLEAVED:
        gate0 = 2 * first_col
        up0 = gate0 + 1
        gate1 = gate0 + 2 * SUB_N
        row_offsets = 2 * tl.arange(0, SUB_N)
    else:
        gate0 = first_col
        up0 = first_col + n_out
        gate1 = gate0 + SUB_N
        row_offsets = tl.arange(0, SUB_N)
    up1 = up0 + (gate1 - gate0)
    g0_ptrs, g0_scale_ptrs = _weight_tile(
        b_ptr,
        b_scales_ptr,
        expert,
        gate0,
        N,
        stride_b_expert,
        stride_b_row,
        stride_b_scale_expert,
        stride_b_scale_row,
        GLU_INTERLEAVED,
        UNIFORM_SCALES,
        SUB_N,
        BLOCK_K,
    )
    u0_ptrs, u0_scale_ptrs = g0_ptrs, g0_scale_ptrs
    g1_ptrs, g1_scale_ptrs = g0_ptrs, g0_scale_ptrs
    u1_ptrs, u1_scale_ptrs = g0_ptrs, g0_scale_ptrs
    if EPILOGUE == "swiglu":
        u0_ptrs, u0_scale_ptrs = _weight_tile(
            b_ptr,
            b_scales_ptr,
            expert,
            up0,
            N,
            stride_b_expert,
            stride_b_row,
            stride_b_scale_expert,
            stride_b_scale_row,
            GLU_INTERLEAVED,
            UNIFORM_SCALES,
            SUB_N,
            BLOCK_K,
        )
    if SPLIT_N == 2:
        g1_ptrs, g1_scale_ptrs = _weight_tile(
            b_ptr,
            b_scales_ptr,
            expert,
            gate1,
            N,
            stride_b_expert,
            stride_b_row,
            stride_b_scale_expert,
            stride_b_scale_row,
            GLU_INTERLEAVED,
            UNIFORM_SCALES,
            SUB_N,
            BLOCK_K,
        )
        if EPILOGUE == "swiglu":
            u1_ptrs, u1_scale_ptrs = _weight_tile(
                b_ptr,
                b_scales_ptr,
                expert,
                up1,
                N,
                stride_b_expert,
                stride_b_row,
                stride_b_scale_expert,
                stride_b_scale_row,
                GLU_INTERLEAVED,
                UNIFORM_SCALES,
                SUB_N,
                BLOCK_K,
            )

    if SWAP_AB:
        acc0 = tl.zeros((SUB_N, BLOCK_M), dtype=tl.float32)
    else:
        acc0 = tl.zeros((BLOCK_M, SUB_N), dtype=tl.float32)
    up0_acc = acc0
    acc1 = acc0
    up1_acc = acc0
    for k_step in range(0, tl.where(expert_ok, tl.cdiv(K, BLOCK_K), 0)):
        a = _load_e4m3(a_ptrs, k_step * BLOCK_K, K, EVEN_K, BLOCK_K)
        a_scale = tl.load(a_scale_ptrs + k_step * stride_a_scale_k)
        acc0 = _promoted_step(
            acc0,
            a,
            a_scale,
            g0_ptrs,
            g0_scale_ptrs,
            k_step,
            stride_b_scale_k,
            K,
            UNIFORM_SCALES,
            SWAP_AB,
            EVEN_K,
            BLOCK_K,
        )
        if EPILOGUE == "swiglu":
            up0_acc = _promoted_step(
                up0_acc,
                a,
                a_scale,
                u0_ptrs,
                u0_scale_ptrs,
                k_step,
                stride_b_scale_k,
                K,
                UNIFORM_SCALES,
                SWAP_AB,
                EVEN_K,
                BLOCK_K,
            )
        if SPLIT_N == 2:
            acc1 = _promoted_step(
                acc1,
                a,
                a_scale,
                g1_ptrs,
                g1_scale_ptrs,
                k_step,
                stride_b_scale_k,
                K,
                UNIFORM_SCALES,
                SWAP_AB,
                EVEN_K,
                BLOCK_K,
            )
            if EPILOGUE == "swiglu":
                up1_acc = _promoted_step(
                    up1_acc,
                    a,
                    a_scale,
                    u1_ptrs,
                    u1_scale_ptrs,
                    k_step,
                    stride_b_scale_k,
                    K,
                    UNIFORM_SCALES,
                    SWAP_AB,
                    EVEN_K,
                    BLOCK_K,
                )

    multiplier = 1.0
    if HAS_EXPERT_SCALES:
        multiplier = tl.load(expert_scales_ptr + expert)
    out_row_base = out_ptr + tile_start * stride_out_row
    cols = first_col + tl.arange(0, SUB_N)
    store_sub_tile(
        out_ptr,
        acc0,
        up0_acc,
        bias_ptr,
        expert,
        expert_ok,
        multiplier,
        rows,
        row_mask,
        out_row_base,
        local_rows,
        cols,
        gate0 + row_offsets,
        up0 + row_offsets,
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
    if SPLIT_N == 2:
        store_sub_tile(
            out_ptr,
            acc1,
            up1_acc,
            bias_ptr,
            expert,
            expert_ok,
            multiplier,
            rows,
            row_mask,
            out_row_base,
            local_rows,
            cols + SUB_N,
            gate1 + row_offsets,
            up1 + row_offsets,
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


@triton.jit
def fp8_blocks_matmul_kernel(
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
    stride_b_scale_k,
    stride_out_row,
    stride_bias_expert,
    num_tokens,
    num_groups,
    num_experts,
    N,
    K,
    min_group_rows,
    max_group_rows,
    HAS_EXPERT_SCALES: tl.constexpr,
    EPILOGUE: tl.constexpr,
    EPILOGUE_FN: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    GLU_ALPHA: tl.constexpr,
    GLU_LIMIT: tl.constexpr,
    GLU_UP_SHIFT: tl.constexpr,
    GLU_INTERLEAVED: tl.constexpr,
    SWAP_AB: tl.constexpr,
    EVEN_K: tl.constexpr,
    SPLIT_N: tl.constexpr,
    UNIFORM_SCALES: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_GROUPS: tl.constexpr,
):
    """Grouped matmul on FP8 blocks with per-128-K promotion.

    a: e4m3 bytes ``[num_tokens, K]``, unit column stride; a_scales float32 ``[num_tokens, cdiv(K, 128)]``, any
    strides (row-major or token-major); b: e4m3 bytes ``[num_experts, N, K]``, unit column stride; b_scales float32
    ``[num_experts, cdiv(N, 128), cdiv(K, 128)]``, any strides; out ``[num_tokens, N_out]`` (``N_out = N / 2`` for
    SwiGLU, else N), unit column stride; bias (HAS_BIAS) ``[num_experts, N]`` in B's row order, unit column stride;
    a_offsets ``[G + 1]``; expert_ids int32 ``[G]``; expert_scales float32 ``[num_experts]``. SwiGLU reads gate and
    up rows as ``[gate | up]`` halves of B or alternating (GLU_INTERLEAVED).

    BLOCK_K is 128 (one scale block per step). The weight tile is SPLIT_N (1 or 2) sub-tiles of ``SUB_N = BLOCK_N /
    SPLIT_N`` rows, SUB_N a divisor of 128, each with its own accumulator (two under SwiGLU) and MMA; the A tile is
    loaded once per step for all of them. UNIFORM_SCALES: every sub-tile's weight rows lie in one 128-row scale
    block (the host checks), so its weight scale is one scalar per step; else a scale per row. SWAP_AB computes
    ``Cᵀ = B · Aᵀ`` per tile (decode: the weights on the MMA's M side).

    Tiles, groups, size classes (``min_group_rows < rows <= max_group_rows``), clamped offsets and the epilogue are
    those of :func:`~llmkernels.grouped_matmul.kernel.grouped_matmul_kernel`. Program p takes tiles p,
    p + num_programs, ...: one tile per program when the grid is the tile bound (extra programs exit), a persistent
    walk when it is smaller. A group whose expert id is outside ``[0, num_experts)`` runs no K step and is written
    as zeros.
    """
    tl.static_assert(BLOCK_K == SCALE_BLOCK, "one 128-wide scale block per K step")
    tl.static_assert(SPLIT_N == 1 or SPLIT_N == 2, "one or two weight sub-tiles")
    tl.static_assert(SCALE_BLOCK % (BLOCK_N // SPLIT_N) == 0, "a weight sub-tile's rows divide a scale block")
    n_out = N // 2 if EPILOGUE == "swiglu" else N
    n_tiles = tl.cdiv(n_out, BLOCK_N)
    group_ids, starts, ends, tiles, tiles_through, total_tiles = group_tiles(
        a_offsets_ptr, num_tokens, num_groups, min_group_rows, max_group_rows, n_tiles, BLOCK_M, BLOCK_GROUPS
    )
    # one tile per program when the grid is the tile bound (the loop runs at most once), else a persistent walk
    for tile in range(tl.program_id(0), total_tiles, tl.num_programs(0)):
        _fp8_tile(
            tile,
            group_ids,
            starts,
            ends,
            tiles,
            tiles_through,
            a_ptr,
            a_scales_ptr,
            b_ptr,
            b_scales_ptr,
            out_ptr,
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
            stride_b_scale_k,
            stride_out_row,
            stride_bias_expert,
            num_experts,
            N,
            n_out,
            K,
            HAS_EXPERT_SCALES,
            EPILOGUE,
            EPILOGUE_FN,
            HAS_BIAS,
            GLU_ALPHA,
            GLU_LIMIT,
            GLU_UP_SHIFT,
            GLU_INTERLEAVED,
            SWAP_AB,
            EVEN_K,
            SPLIT_N,
            UNIFORM_SCALES,
            BLOCK_M,
            BLOCK_N,
            BLOCK_K,
        )
