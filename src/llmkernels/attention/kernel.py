"""FA4-style attention forward in Triton: ``@triton.jit`` code only (launched by the portable backend, ``portable.py``).

One program owns ``NUM_Q_TILES`` Q tiles of ``BLOCK_M = BLOCK_Q * HEADS_PER_TILE`` rows of one
(batch, KV head) pair; a row is a (query, q head) pair, so ``HEADS_PER_TILE > 1`` packs the q heads
of one KV head into a tile (GQA decode: K/V are read once for the whole group). Its KV range is cut
in three phases by the mask bounds: tiles that need per-element masking on the left, fully visible
tiles (no masking work at all), masked tiles on the right; tiles outside the bounds are never
visited. With ``SPLIT`` the range is further cut into ``num_splits`` parts (program axis 2) that each
write a partial O and base-2 LSE, merged by ``decode.combine_splits_kernel``.

FA4 pieces:
* online softmax in base 2, ``softmax_scale * log2(e)`` folded into the QK^T scale;
* ``NUM_Q_TILES = 2``: both Q tiles consume each K/V tile load (the seed's "2Q");
* conditional rescale: the running max used as exponent reference only moves when some row's max
  grew by more than ``RESCALE_THRESHOLD`` (log2 units), so ``p = exp2(s - reference) <= 2**threshold``;
  the final ``O / l`` and ``lse = reference + log2(l)`` are exact whatever the reference;
* ``exp2_poly``: Cody-Waite ``2**x = 2**floor(x) * P(frac(x))`` on FMA units, for a
  ``POLY_EXP2_FRACTION`` of the score columns.
"""

import triton
import triton.language as tl

from .masks import apply_score_mod, visible_mask

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)
BLOCK_BATCH = tl.constexpr(256)  # cu_seqlens entries per load in ragged_bounds


@triton.jit
def e4m3_to(x, dtype: tl.constexpr, ASM: tl.constexpr):
    """float8_e4m3fn ``x`` as ``dtype`` (bf16 / fp16 / fp32), exactly (every e4m3 value is one of theirs).

    ``ASM`` (bf16 on an sm_89+ GPU): e4m3 pairs to f16x2, f32 and bf16x2 in PTX, all on full-rate pipes. Triton's
    own cast takes f16 to bf16 one element at a time (``F2F.BF16.F16``, a quarter-rate unit on sm_90), which held
    paged decode over an FP8 cache to 0.96-1.38x the bf16 cache's speed on an H100; this one gives 1.22-1.63x
    (``lab/NOTES.md``)."""
    if ASM:
        converted = tl.inline_asm_elementwise(
            """
            {
            .reg .b16 lo, hi;
            .reg .b32 a, b;
            .reg .f16 h0, h1, h2, h3;
            .reg .f32 f0, f1, f2, f3;
            mov.b32 {lo, hi}, $2;
            cvt.rn.f16x2.e4m3x2 a, lo;
            cvt.rn.f16x2.e4m3x2 b, hi;
            mov.b32 {h0, h1}, a;
            mov.b32 {h2, h3}, b;
            cvt.f32.f16 f0, h0;
            cvt.f32.f16 f1, h1;
            cvt.f32.f16 f2, h2;
            cvt.f32.f16 f3, h3;
            cvt.rn.bf16x2.f32 $0, f1, f0;
            cvt.rn.bf16x2.f32 $1, f3, f2;
            }
            """,
            "=r,=r,r",
            [x],
            dtype=tl.bfloat16,
            is_pure=True,
            pack=4,
        )
    else:
        converted = x.to(dtype)
    return converted


@triton.jit
def mma(a, b, acc, UPCAST: tl.constexpr):
    """``a @ b (+ acc)`` with float32 accumulation. ``UPCAST`` (interpreter only): Triton 3.9's interpreter
    multiplies bf16 operands wrongly, so there the operands go to float32 first (same products)."""
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    if acc is None:
        return tl.dot(a, b)
    else:
        return tl.dot(a, b, acc)


@triton.jit
def exp2_poly(x):
    """``2**x`` for float32 ``x <= 127`` without MUFU: exponent bits for ``floor(x)`` times a degree-3
    polynomial of the fraction (relative error 8.7e-5, far below the bf16/fp16 rounding of P);
    ``x < -126`` (and -inf) gives exactly 0."""
    clamped = tl.maximum(x, -127.0)
    whole = tl.floor(clamped)
    frac = clamped - whole
    poly = 1.0 + frac * (0.69512289274036 + frac * (0.22764557917179307 + frac * 0.07705804610896776))
    bits = poly.to(tl.int32, bitcast=True) + whole.to(tl.int32) * 8388608  # add floor(x) to the exponent
    return tl.where(clamped >= -126.0, bits.to(tl.float32, bitcast=True), 0.0)


@triton.jit
def exp2_mixed(x, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, POLY_EXP2_FRACTION: tl.constexpr):
    """``2**x`` of a ``[BLOCK_M, BLOCK_N]`` tile, ``POLY_EXP2_FRACTION`` of its columns by ``exp2_poly``.

    The columns are split by parity (reshape + split, no wasted work): 0.5 = odd columns, 0.25 = columns
    3 mod 4, 0.75 = all but columns 0 mod 4.
    """
    if POLY_EXP2_FRACTION == 0.0:
        return tl.exp2(x)
    elif POLY_EXP2_FRACTION == 1.0:
        return exp2_poly(x)
    else:
        even, odd = tl.split(tl.reshape(x, [BLOCK_M, BLOCK_N // 2, 2]))
        if POLY_EXP2_FRACTION == 0.5:
            even = tl.exp2(even)
            odd = exp2_poly(odd)
        else:
            even0, even1 = tl.split(tl.reshape(even, [BLOCK_M, BLOCK_N // 4, 2]))
            odd0, odd1 = tl.split(tl.reshape(odd, [BLOCK_M, BLOCK_N // 4, 2]))
            even0 = tl.exp2(even0)
            odd1 = exp2_poly(odd1)
            if POLY_EXP2_FRACTION == 0.25:
                even1 = tl.exp2(even1)
                odd0 = tl.exp2(odd0)
            else:
                even1 = exp2_poly(even1)
                odd0 = exp2_poly(odd0)
            even = tl.reshape(tl.join(even0, even1), [BLOCK_M, BLOCK_N // 2])
            odd = tl.reshape(tl.join(odd0, odd1), [BLOCK_M, BLOCK_N // 2])
        return tl.reshape(tl.join(even, odd), [BLOCK_M, BLOCK_N])


@triton.jit
def online_softmax_update(
    acc,
    row_sum,
    row_max,
    scores,
    v,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    RESCALE_THRESHOLD: tl.constexpr,
    POLY_EXP2_FRACTION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """One KV tile of base-2 online softmax. ``scores`` ``[M, N]`` are log2-scaled (masked = -inf);
    ``row_max`` is the exponent reference (-inf until the row saw a visible key)."""
    tile_max = tl.max(scores, 1)
    new_max = tl.maximum(row_max, tile_max)
    if RESCALE_THRESHOLD == 0.0:
        alpha = tl.exp2(row_max - tl.where(new_max == float("-inf"), 0.0, new_max))
        acc = acc * alpha[:, None]
        row_sum = row_sum * alpha
        row_max = new_max
    else:
        # Rescale only when some row's max grew past the threshold; then move every row's
        # reference (a block-uniform branch: the [M, D] multiply is skipped entirely otherwise).
        growth = tl.where(new_max > row_max, new_max - row_max, 0.0)
        if tl.max(growth, 0) > RESCALE_THRESHOLD:
            alpha = tl.exp2(row_max - tl.where(new_max == float("-inf"), 0.0, new_max))
            acc = acc * alpha[:, None]
            row_sum = row_sum * alpha
            row_max = new_max
    reference = tl.where(row_max == float("-inf"), 0.0, row_max)
    p = exp2_mixed(scores - reference[:, None], BLOCK_M, BLOCK_N, POLY_EXP2_FRACTION)
    row_sum = row_sum + tl.sum(p, 1)
    acc = mma(p.to(v.dtype), v, acc, UPCAST)
    return acc, row_sum, row_max


@triton.jit
def page_aligned_tile_ptrs(
    base_ptr,
    start_n,
    head_offset,
    stride_page,
    stride_row,
    block_table_row,
    num_pages,
    dims,
    BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    PAGE_OFFSETS_64: tl.constexpr,
):
    """Pointers ``[BLOCK_N, HEAD_DIM_PAD]`` to paged keys ``[start_n, start_n + BLOCK_N)`` when the tile lies inside
    one page (``PAGE_SIZE >= BLOCK_N``, key 0 at the start of the sequence's first page, ``start_n`` a multiple
    of ``BLOCK_N``): one page id per tile, a scalar, instead of :func:`load_kv_tile`'s per-row gather of page
    ids (whose addresses cost instructions and registers); the same addresses."""
    page = tl.load(block_table_row + start_n // PAGE_SIZE)  # start_n < seqlen_k <= the table's width in keys
    page = tl.minimum(tl.maximum(page, 0), num_pages - 1)
    if PAGE_OFFSETS_64:
        page = page.to(tl.int64)
    tile_base = page * stride_page + (start_n % PAGE_SIZE) * stride_row + head_offset  # a scalar
    offsets = tl.arange(0, BLOCK_N)[:, None] * stride_row + dims[None, :]  # the same for every tile
    return base_ptr + tile_base + offsets


@triton.jit
def load_kv_tile(
    base_ptr,
    batch_offset,
    kv_start,
    start_n,
    seqlen_k,
    head_offset,
    stride_page,
    stride_row,
    block_table_row,
    num_pages,
    dims,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGED: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    MASKED: tl.constexpr,
    PAGE_OFFSETS_64: tl.constexpr = True,
    PAGE_ALIGNED: tl.constexpr = False,
):
    """K or V keys ``[start_n, start_n + BLOCK_N)`` of one KV head -> ``[BLOCK_N, HEAD_DIM_PAD]`` (zeros past
    seqlen_k / HEAD_DIM).

    ``PAGED``: key ``i`` sits at cache position ``kv_start + i``; block-table entries are clamped to
    ``[0, num_pages - 1]`` (``kv_start + seqlen_k`` is already clamped to the table's width), so no table content
    can make the load leave the pages. ``PAGE_OFFSETS_64``: page offsets in int64 (False: every element offset
    of the pages fits in int32, which halves the gather's address registers). ``PAGE_ALIGNED``: ``kv_start``
    is 0 and ``start_n`` a multiple of ``BLOCK_N``, so with pages of at least ``BLOCK_N`` keys
    :func:`page_aligned_tile_ptrs` forms the tile's addresses."""
    kv_raw = start_n + tl.arange(0, BLOCK_N)
    in_range = kv_raw < seqlen_k
    if PAGED and PAGE_ALIGNED and PAGE_SIZE >= BLOCK_N:
        ptrs = page_aligned_tile_ptrs(
            base_ptr,
            start_n,
            head_offset,
            stride_page,
            stride_row,
            block_table_row,
            num_pages,
            dims,
            BLOCK_N,
            PAGE_SIZE,
            PAGE_OFFSETS_64,
        )
    else:
        if PAGED:
            position = kv_start + kv_raw
            page = tl.load(block_table_row + position // PAGE_SIZE, mask=in_range, other=0)
            page = tl.minimum(tl.maximum(page, 0), num_pages - 1)
            if PAGE_OFFSETS_64:
                rows = page.to(tl.int64) * stride_page + (position % PAGE_SIZE) * stride_row
            else:
                rows = page * stride_page + (position % PAGE_SIZE) * stride_row
        else:
            rows = batch_offset + (kv_start.to(tl.int64) + kv_raw) * stride_row
        ptrs = base_ptr + rows[:, None] + head_offset + dims[None, :]
    if MASKED:
        tile = tl.load(ptrs, mask=in_range[:, None] & (dims < HEAD_DIM)[None, :], other=0.0)
    elif HEAD_DIM != HEAD_DIM_PAD:
        tile = tl.load(ptrs, mask=(dims < HEAD_DIM)[None, :], other=0.0)
    else:
        tile = tl.load(ptrs)
    return tile


@triton.jit
def log2_scores(
    qk,
    batch,
    heads,
    q_idx_mod,
    q_pos,
    alibi_slopes,
    kv_mod,
    softmax_scale,
    qk_scale_log2,
    softcap_value,
    SCORE_MOD_KIND: tl.constexpr,
    SCORE_MOD: tl.constexpr,
):
    """Raw ``Q K^T`` ``[M, N]`` -> ``log2(e) * score_mod(softmax_scale * QK^T)``."""
    if SCORE_MOD_KIND == "none":
        return qk * qk_scale_log2
    else:
        scores = apply_score_mod(
            qk * softmax_scale,
            batch,
            heads[:, None],
            q_idx_mod[:, None],
            kv_mod[None, :],
            q_pos[:, None],
            softcap_value,
            alibi_slopes[:, None],
            SCORE_MOD_KIND,
            SCORE_MOD,
        )
        return scores * LOG2E


@triton.jit
def update_q_tile(
    acc,
    row_sum,
    row_max,
    q,
    k,
    v,
    batch,
    heads,
    q_idx_mod,
    q_pos,
    alibi_slopes,
    kv_raw,
    kv_mod,
    seqlen_k,
    softmax_scale,
    qk_scale_log2,
    window_left,
    window_right,
    chunk_size,
    softcap_value,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_CHUNK: tl.constexpr,
    HAS_MASK_MOD: tl.constexpr,
    MASK_MOD: tl.constexpr,
    SCORE_MOD_KIND: tl.constexpr,
    SCORE_MOD: tl.constexpr,
    RESCALE_THRESHOLD: tl.constexpr,
    POLY_EXP2_FRACTION: tl.constexpr,
    UPCAST: tl.constexpr,
    mask_tile=0.0,
    MASK_TENSOR: tl.constexpr = "none",
):
    """QK^T, score mod, mask, online softmax and PV of one Q tile against one K/V tile (``mask_tile``
    ``[M, N]``: the materialized mask's values, ``MASK_TENSOR`` ``"bool"`` or ``"additive"``)."""
    scores = log2_scores(
        mma(q, tl.trans(k), None, UPCAST),
        batch,
        heads,
        q_idx_mod,
        q_pos,
        alibi_slopes,
        kv_mod,
        softmax_scale,
        qk_scale_log2,
        softcap_value,
        SCORE_MOD_KIND,
        SCORE_MOD,
    )
    if MASK_TENSOR == "additive":  # natural-log bias on the scaled score, as SDPA's float attn_mask
        scores = scores + mask_tile.to(tl.float32) * LOG2E
    if MASKED:
        visible = visible_mask(
            batch,
            heads[:, None],
            q_idx_mod[:, None],
            kv_mod[None, :],
            q_pos[:, None],
            kv_raw[None, :],
            seqlen_k,
            window_left,
            window_right,
            chunk_size,
            HAS_WINDOW,
            HAS_CHUNK,
            HAS_MASK_MOD,
            MASK_MOD,
        )
        if MASK_TENSOR == "bool":
            visible = visible & (mask_tile != 0)
        scores = tl.where(visible, scores, float("-inf"))
    return online_softmax_update(
        acc, row_sum, row_max, scores, v, BLOCK_M, BLOCK_N, RESCALE_THRESHOLD, POLY_EXP2_FRACTION, UPCAST
    )


@triton.jit
def load_band_tile(
    base_ptr,
    desc,
    batch_offset,
    kv_start,
    kv_row_base,
    kv_col,
    start_n,
    seqlen_k,
    head_offset,
    stride_page,
    stride_row,
    block_table_row,
    num_pages,
    dims,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGED: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    TMA_KV: tl.constexpr,
    PAGE_OFFSETS_64: tl.constexpr = True,
    PAGE_ALIGNED: tl.constexpr = False,
):
    """One K or V tile of the fully visible band (every key in the sequence): descriptor or pointer load."""
    if TMA_KV:
        return desc.load([kv_row_base + start_n, kv_col])
    else:
        return load_kv_tile(
            base_ptr,
            batch_offset,
            kv_start,
            start_n,
            seqlen_k,
            head_offset,
            stride_page,
            stride_row,
            block_table_row,
            num_pages,
            dims,
            HEAD_DIM,
            HEAD_DIM_PAD,
            BLOCK_N,
            PAGED,
            PAGE_SIZE,
            False,
            PAGE_OFFSETS_64,
            PAGE_ALIGNED,
        )


@triton.jit
def attend_kv_range(
    acc_a,
    sum_a,
    max_a,
    acc_b,
    sum_b,
    max_b,
    q_a,
    q_b,
    q_idx_mod_a,
    q_idx_mod_b,
    q_pos_a,
    q_pos_b,
    heads,
    alibi_slopes,
    k_ptr,
    v_ptr,
    k_desc,
    v_desc,
    k_batch_offset,
    v_batch_offset,
    k_head_offset,
    v_head_offset,
    stride_kb,
    stride_ks,
    stride_vb,
    stride_vs,
    block_table_row,
    num_pages,
    kv_start,
    kv_row_base,
    kv_col,
    seqlen_k,
    batch,
    kv_lo,
    kv_hi,
    softmax_scale,
    qk_scale_log2,
    window_left,
    window_right,
    chunk_size,
    softcap_value,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_Q_TILES: tl.constexpr,
    PAGED: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    MASKED: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_CHUNK: tl.constexpr,
    HAS_MASK_MOD: tl.constexpr,
    MASK_MOD: tl.constexpr,
    SCORE_MOD_KIND: tl.constexpr,
    SCORE_MOD: tl.constexpr,
    RESCALE_THRESHOLD: tl.constexpr,
    POLY_EXP2_FRACTION: tl.constexpr,
    TMA_KV: tl.constexpr,
    UPCAST: tl.constexpr,
    mask_rows_a=0,
    mask_rows_b=0,
    stride_mask_k=0,
    MASK_TENSOR: tl.constexpr = "none",
    PAGE_OFFSETS_64: tl.constexpr = True,
    PAGE_ALIGNED: tl.constexpr = False,
    FP8_KV: tl.constexpr = False,
    E4M3_ASM: tl.constexpr = False,
):
    """Keys ``[kv_lo, kv_hi)`` (kv_lo a multiple of BLOCK_N): each K/V tile is loaded once for both Q tiles.
    ``MASK_TENSOR``: row pointers ``mask_rows_a`` / ``_b`` ``[BLOCK_M]`` into the materialized mask, whose
    key stride is ``stride_mask_k``; keys past ``seqlen_k`` are not read.

    ``TMA_KV`` and not ``MASKED`` (the fully visible band, whose tiles lie inside the sequence): K/V
    tiles come through the tensor descriptors ``k_desc`` / ``v_desc`` over ``[tokens, Hkv * D]``, at row
    ``kv_row_base + key`` and column ``kv_col``. ``FP8_KV``: K/V are float8_e4m3fn, converted to q's dtype (the
    compute dtype) in registers after the load (exact: every e4m3 value is a bf16 and an fp16 value)."""
    dims = tl.arange(0, HEAD_DIM_PAD)
    CLAMP_KV: tl.constexpr = HAS_MASK_MOD or SCORE_MOD_KIND == "user"
    for start_n in tl.range(kv_lo, kv_hi, BLOCK_N):
        kv_raw = start_n + tl.arange(0, BLOCK_N)
        if MASKED:
            k = load_kv_tile(
                k_ptr,
                k_batch_offset,
                kv_start,
                start_n,
                seqlen_k,
                k_head_offset,
                stride_kb,
                stride_ks,
                block_table_row,
                num_pages,
                dims,
                HEAD_DIM,
                HEAD_DIM_PAD,
                BLOCK_N,
                PAGED,
                PAGE_SIZE,
                True,
                PAGE_OFFSETS_64,
                PAGE_ALIGNED,
            )
            v = load_kv_tile(
                v_ptr,
                v_batch_offset,
                kv_start,
                start_n,
                seqlen_k,
                v_head_offset,
                stride_vb,
                stride_vs,
                block_table_row,
                num_pages,
                dims,
                HEAD_DIM,
                HEAD_DIM_PAD,
                BLOCK_N,
                PAGED,
                PAGE_SIZE,
                True,
                PAGE_OFFSETS_64,
                PAGE_ALIGNED,
            )
        else:
            k = load_band_tile(
                k_ptr,
                k_desc,
                k_batch_offset,
                kv_start,
                kv_row_base,
                kv_col,
                start_n,
                seqlen_k,
                k_head_offset,
                stride_kb,
                stride_ks,
                block_table_row,
                num_pages,
                dims,
                HEAD_DIM,
                HEAD_DIM_PAD,
                BLOCK_N,
                PAGED,
                PAGE_SIZE,
                TMA_KV,
                PAGE_OFFSETS_64,
                PAGE_ALIGNED,
            )
            v = load_band_tile(
                v_ptr,
                v_desc,
                v_batch_offset,
                kv_start,
                kv_row_base,
                kv_col,
                start_n,
                seqlen_k,
                v_head_offset,
                stride_vb,
                stride_vs,
                block_table_row,
                num_pages,
                dims,
                HEAD_DIM,
                HEAD_DIM_PAD,
                BLOCK_N,
                PAGED,
                PAGE_SIZE,
                TMA_KV,
                PAGE_OFFSETS_64,
                PAGE_ALIGNED,
            )
        if FP8_KV:
            k = e4m3_to(k, q_a.dtype, E4M3_ASM)
            v = e4m3_to(v, q_a.dtype, E4M3_ASM)
        if CLAMP_KV:
            kv_mod = tl.minimum(kv_raw, tl.maximum(seqlen_k - 1, 0))
        else:
            kv_mod = kv_raw
        mask_a = 0.0
        mask_b = 0.0
        if MASK_TENSOR != "none":
            key_offsets = (kv_raw.to(tl.int64) * stride_mask_k)[None, :]
            key_ok = (kv_raw < seqlen_k)[None, :]
            mask_a = tl.load(mask_rows_a[:, None] + key_offsets, mask=key_ok, other=0)
            if NUM_Q_TILES == 2:
                mask_b = tl.load(mask_rows_b[:, None] + key_offsets, mask=key_ok, other=0)
        acc_a, sum_a, max_a = update_q_tile(
            acc_a,
            sum_a,
            max_a,
            q_a,
            k,
            v,
            batch,
            heads,
            q_idx_mod_a,
            q_pos_a,
            alibi_slopes,
            kv_raw,
            kv_mod,
            seqlen_k,
            softmax_scale,
            qk_scale_log2,
            window_left,
            window_right,
            chunk_size,
            softcap_value,
            BLOCK_M,
            BLOCK_N,
            MASKED,
            HAS_WINDOW,
            HAS_CHUNK,
            HAS_MASK_MOD,
            MASK_MOD,
            SCORE_MOD_KIND,
            SCORE_MOD,
            RESCALE_THRESHOLD,
            POLY_EXP2_FRACTION,
            UPCAST,
            mask_a,
            MASK_TENSOR,
        )
        if NUM_Q_TILES == 2:
            acc_b, sum_b, max_b = update_q_tile(
                acc_b,
                sum_b,
                max_b,
                q_b,
                k,
                v,
                batch,
                heads,
                q_idx_mod_b,
                q_pos_b,
                alibi_slopes,
                kv_raw,
                kv_mod,
                seqlen_k,
                softmax_scale,
                qk_scale_log2,
                window_left,
                window_right,
                chunk_size,
                softcap_value,
                BLOCK_M,
                BLOCK_N,
                MASKED,
                HAS_WINDOW,
                HAS_CHUNK,
                HAS_MASK_MOD,
                MASK_MOD,
                SCORE_MOD_KIND,
                SCORE_MOD,
                RESCALE_THRESHOLD,
                POLY_EXP2_FRACTION,
                UPCAST,
                mask_b,
                MASK_TENSOR,
            )
    return acc_a, sum_a, max_a, acc_b, sum_b, max_b


@triton.jit
def load_q_tile(
    q_ptr, batch_offset, q_start, q_idx, heads, row_valid, dims, stride_qs, stride_qh, HEAD_DIM: tl.constexpr
):
    rows = (q_start.to(tl.int64) + q_idx) * stride_qs + heads * stride_qh
    ptrs = q_ptr + batch_offset + rows[:, None] + dims[None, :]
    return tl.load(ptrs, mask=row_valid[:, None] & (dims < HEAD_DIM)[None, :], other=0.0)


@triton.jit
def store_q_tile(
    acc,
    row_sum,
    row_max,
    out_ptr,
    lse_ptr,
    sinks_ptr,
    batch,
    split,
    q_start,
    q_idx,
    heads,
    row_valid,
    dims,
    stride_ob,
    stride_os,
    stride_oh,
    stride_o_split,
    stride_lse_b,
    stride_lse_h,
    stride_lse_s,
    stride_lse_split,
    HEAD_DIM: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    SPLIT: tl.constexpr,
    RETURN_LSE: tl.constexpr,
):
    """Normalizes and stores one Q tile: final O (q dtype) + natural-log LSE, or with ``SPLIT`` the
    partial O (float32) + base-2 LSE of this split (sinks are the combine's then). Rows that saw no
    key (and no sink): O = 0, LSE = -inf. As in the reference, a sink of +inf takes all the weight
    (O = 0, LSE = +inf), -inf is no sink, and a NaN sink (or score) gives NaN."""
    if HAS_SINKS:
        if not SPLIT:
            sink = tl.load(sinks_ptr + heads, mask=row_valid, other=0.0) * LOG2E
            final_max = tl.maximum(row_max, sink)
            final_max = tl.where(final_max == float("-inf"), 0.0, final_max)
            alpha = tl.exp2(row_max - final_max)
            # a sink at the max adds exactly 1, also a sink of +inf (where inf - inf would be NaN)
            row_sum = row_sum * alpha + tl.exp2(tl.where(sink == final_max, 0.0, sink - final_max))
            acc = acc * alpha[:, None]
            row_max = final_max
    nonempty = row_sum != 0.0  # 0: no key and no sink; NaN goes on into O and the LSE
    inverse = 1.0 / tl.where(nonempty, row_sum, 1.0)
    inverse = tl.where(nonempty, inverse, 0.0)
    out = acc * inverse[:, None]
    lse_log2 = tl.where(nonempty, row_max + tl.log2(tl.where(nonempty, row_sum, 1.0)), float("-inf"))
    tokens = q_start.to(tl.int64) + q_idx
    batch64 = batch.to(tl.int64)
    o_ptrs = out_ptr + batch64 * stride_ob + tokens[:, None] * stride_os + (heads * stride_oh)[:, None] + dims[None, :]
    lse_ptrs = lse_ptr + batch64 * stride_lse_b + heads.to(tl.int64) * stride_lse_h + tokens * stride_lse_s
    o_mask = row_valid[:, None] & (dims < HEAD_DIM)[None, :]
    if SPLIT:
        o_ptrs += split.to(tl.int64) * stride_o_split
        tl.store(o_ptrs, out, mask=o_mask)
        tl.store(lse_ptrs + split.to(tl.int64) * stride_lse_split, lse_log2, mask=row_valid)
    else:
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=o_mask)
        if RETURN_LSE:
            tl.store(lse_ptrs, lse_log2 * LN2, mask=row_valid)


@triton.jit
def ragged_bounds(cu_seqlens_ptr, batch, total, BLOCK_BATCH: tl.constexpr):
    """``(start, length)`` of sequence ``batch`` of a ragged tensor with ``total`` rows, read as if
    ``cu_seqlens`` were ``clamp(cummax(cu_seqlens), 0, total)``: valid prefix sums are unchanged; for bad
    ones the rows stay inside the tensor, a decreasing entry gives length 0 and no row belongs to two
    sequences (no two programs of different sequences write one row). Costs one pass over
    ``cu_seqlens[0 : batch + 1]`` (``BLOCK_BATCH`` entries per load)."""
    prefix_max = batch * 0  # the 0 that the clamp adds anyway
    for first in tl.range(0, batch + 1, BLOCK_BATCH):
        entries = first + tl.arange(0, BLOCK_BATCH)
        values = tl.load(cu_seqlens_ptr + entries, mask=entries <= batch, other=0)
        prefix_max = tl.maximum(prefix_max, tl.max(values, 0))
    start = tl.minimum(prefix_max, total)
    end = tl.minimum(tl.maximum(tl.load(cu_seqlens_ptr + batch + 1), start), total)
    return start, end - start


@triton.jit
def attention_fwd_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    lse_ptr,
    cu_seqlens_q_ptr,
    cu_seqlens_k_ptr,
    seqlens_k_ptr,
    kv_starts_ptr,
    block_table_ptr,
    sinks_ptr,
    alibi_slopes_ptr,
    attn_mask_ptr,
    k_desc,
    v_desc,
    q_descale_ptr,
    k_descale_ptr,
    v_descale_ptr,
    stride_qb,
    stride_qs,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_ob,
    stride_os,
    stride_oh,
    stride_o_split,
    stride_lse_b,
    stride_lse_h,
    stride_lse_s,
    stride_lse_split,
    stride_block_table,
    stride_mask_b,
    stride_mask_h,
    stride_mask_q,
    stride_mask_k,
    stride_q_descale_b,
    stride_q_descale_h,
    stride_k_descale_b,
    stride_k_descale_h,
    stride_v_descale_b,
    stride_v_descale_h,
    seqlen_q_dense,
    seqlen_k_dense,
    total_q,
    total_k,
    num_pages,
    paged_seqlen_bound,
    num_kv_heads,
    group,
    num_splits,
    num_head_programs,
    softmax_scale,
    window_left,
    window_right,
    chunk_size,
    softcap_value,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    HEADS_PER_TILE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_Q_TILES: tl.constexpr,
    RAGGED_Q: tl.constexpr,
    RAGGED_K: tl.constexpr,
    PAGED: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_CHUNK: tl.constexpr,
    HAS_MASK_MOD: tl.constexpr,
    MASK_MOD: tl.constexpr,
    SCORE_MOD_KIND: tl.constexpr,
    SCORE_MOD: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    SPLIT: tl.constexpr,
    RETURN_LSE: tl.constexpr,
    REVERSE_Q_BLOCKS: tl.constexpr,
    RESCALE_THRESHOLD: tl.constexpr,
    POLY_EXP2_FRACTION: tl.constexpr,
    TMA_KV: tl.constexpr,
    UPCAST: tl.constexpr,
    KV_STARTS: tl.constexpr = False,
    MASK_TENSOR: tl.constexpr = "none",
    PAGE_OFFSETS_64: tl.constexpr = True,
    FP8_Q: tl.constexpr = False,
    FP8_KV: tl.constexpr = False,
    E4M3_ASM: tl.constexpr = False,
    Q_DESCALE: tl.constexpr = False,
    K_DESCALE: tl.constexpr = False,
    V_DESCALE: tl.constexpr = False,
):
    """Attention forward for one (Q block, batch x KV head x head tile) pair and one split.

    Layouts (element strides; ``*_b`` is 0 for ragged tensors whose rows are tokens):
      q ``[B, Sq, Hq, D]`` / ``[total_q, Hq, D]``; k, v ``[B, Skv, Hkv, D]`` / ``[total_k, Hkv, D]`` or,
      ``PAGED``, pages ``[num_pages, PAGE_SIZE, Hkv, D]`` (``stride_kb`` = page stride) with
      ``block_table`` int32 ``[B, max_pages]`` and ``seqlens_k`` int32 ``[B]`` (the end position of sequence b;
      with ``KV_STARTS`` its keys start at position ``kv_starts[b]``, int32 ``[B]``, else at 0;
      ``PAGE_OFFSETS_64`` False when every element offset of the pages fits in int32);
      out like q (``SPLIT``: float32 with a leading split dim, ``stride_o_split``);
      lse ``[B, Hq, Sq]`` / ``[Hq, total_q]`` (``SPLIT``: float32 base-2 with a leading split dim).
      ``TMA_KV`` (dense or ragged K/V, not paged, ``HEAD_DIM == HEAD_DIM_PAD``): ``k_desc`` / ``v_desc`` are
      tensor descriptors over K / V seen as ``[B * Skv or total_k, Hkv * D]`` with ``[BLOCK_N, D]`` blocks;
      otherwise unused.
      FP8 (FlashAttention-3's convention): ``FP8_Q`` / ``FP8_KV``: q / k and v (or the pages) are float8_e4m3fn,
      converted in registers to bf16 (q) or q's dtype (K/V); ``*_DESCALE``: float32 factors ``[B, Hkv]`` (element
      strides ``stride_*_descale_b`` / ``_h``, 0 where a dim broadcasts) that multiply the stored values, read once
      per program: ``q_descale * k_descale`` folds into the softmax scale (scores are linear in q and k) and
      ``v_descale`` into the accumulator before the store (O and the split partials are linear in v).

    Metadata is never trusted with an address: ragged bounds come from :func:`ragged_bounds` (rows
    ``total_q`` / ``total_k``), ``seqlens_k[b]`` is clamped to ``[0, paged_seqlen_bound]`` (the block
    table's width in keys, 0 without pages), ``kv_starts[b]`` to ``[0, seqlens_k[b]]`` and page ids to
    ``[0, num_pages - 1]``.
    """
    BLOCK_M: tl.constexpr = BLOCK_Q * HEADS_PER_TILE
    # axis 0 = (q block, batch x KV head x head tile) with the q block slowest, axis 1 = split
    q_block = tl.program_id(0) // num_head_programs
    head_program = tl.program_id(0) % num_head_programs
    if REVERSE_Q_BLOCKS:  # causal: the longest KV ranges first
        q_block = tl.num_programs(0) // num_head_programs - 1 - q_block
    head_tiles_per_kv = tl.cdiv(group, HEADS_PER_TILE)
    tiles_per_batch = num_kv_heads * head_tiles_per_kv
    batch = head_program // tiles_per_batch
    kv_head = (head_program % tiles_per_batch) // head_tiles_per_kv
    head_tile = head_program % head_tiles_per_kv
    split = tl.program_id(1)

    if RAGGED_Q:
        q_start, seqlen_q = ragged_bounds(cu_seqlens_q_ptr, batch, total_q, BLOCK_BATCH)
    else:
        q_start = batch * 0
        seqlen_q = seqlen_q_dense
    if PAGED:
        kv_start = batch * 0
        seqlen_k = tl.minimum(tl.maximum(tl.load(seqlens_k_ptr + batch), 0), paged_seqlen_bound)
        if KV_STARTS:  # keys from position kv_starts[b] (clamped to the end) on
            kv_start = tl.minimum(tl.maximum(tl.load(kv_starts_ptr + batch), 0), seqlen_k)
            seqlen_k = seqlen_k - kv_start
    elif RAGGED_K:
        kv_start, seqlen_k = ragged_bounds(cu_seqlens_k_ptr, batch, total_k, BLOCK_BATCH)
    else:
        kv_start = batch * 0
        seqlen_k = seqlen_k_dense
    shift = seqlen_k - seqlen_q  # bottom-right alignment: pos = q_idx + shift

    # ---- KV bounds of the whole block: [kv_lo, kv_hi) visible to some row, [full_lo, full_hi) to all.
    # int32 is enough: window sides and chunk size are <= UNBOUNDED = 2**30 (resolve_mask clamps them) and
    # sequences are shorter than 2**30, so a non-empty block has |pos| < 2**30 and pos_last + window_right
    # + 1 <= 2**31 - 1; an empty block (q_first past seqlen_q) gets kv_hi <= 0, so lo == hi whatever wraps.
    q_first = q_block * (BLOCK_Q * NUM_Q_TILES)
    q_last = tl.minimum(q_first + BLOCK_Q * NUM_Q_TILES, seqlen_q) - 1
    pos_first = q_first + shift
    pos_last = q_last + shift
    zero = q_last * 0
    kv_lo = zero
    kv_hi = tl.where(q_last >= q_first, seqlen_k, 0)  # blocks past the sequence end: nothing to do
    full_lo = zero
    full_hi = zero + seqlen_k
    if HAS_WINDOW:
        kv_lo = tl.maximum(kv_lo, pos_first - window_left)
        kv_hi = tl.minimum(kv_hi, pos_last + window_right + 1)
        full_lo = tl.maximum(full_lo, pos_last - window_left)
        full_hi = tl.minimum(full_hi, pos_first + window_right + 1)
    if HAS_CHUNK:
        chunk_first = tl.maximum(pos_first, 0) // chunk_size
        chunk_last = tl.maximum(pos_last, 0) // chunk_size
        kv_lo = tl.maximum(kv_lo, chunk_first * chunk_size)
        kv_hi = tl.minimum(kv_hi, (chunk_last + 1) * chunk_size)
        full_lo = tl.maximum(full_lo, chunk_last * chunk_size)
        full_hi = tl.minimum(full_hi, tl.where(pos_first >= 0, (chunk_first + 1) * chunk_size, 0))
    if HAS_MASK_MOD or MASK_TENSOR != "none":
        full_hi = tl.minimum(full_hi, 0)  # opaque mask: every tile is masked per element
    lo = (kv_lo // BLOCK_N) * BLOCK_N
    hi = tl.maximum(kv_hi, lo)
    full_lo = tl.minimum(tl.maximum(tl.cdiv(tl.maximum(full_lo, 0), BLOCK_N) * BLOCK_N, lo), hi)
    full_hi = tl.maximum(tl.minimum((tl.maximum(full_hi, 0) // BLOCK_N) * BLOCK_N, hi), full_lo)
    # ---- this split's share of whole tiles
    tiles_per_split = tl.cdiv(tl.cdiv(hi - lo, BLOCK_N), num_splits)
    split_lo = tl.minimum(lo + split * tiles_per_split * BLOCK_N, hi)
    split_hi = tl.minimum(split_lo + tiles_per_split * BLOCK_N, hi)

    # ---- rows: (query, head) pairs
    rows = tl.arange(0, BLOCK_M)
    dims = tl.arange(0, HEAD_DIM_PAD)
    head_in_group = head_tile * HEADS_PER_TILE + rows % HEADS_PER_TILE
    heads = kv_head * group + head_in_group
    head_valid = head_in_group < group
    q_idx_a = q_first + rows // HEADS_PER_TILE
    q_idx_b = q_idx_a + BLOCK_Q
    valid_a = (q_idx_a < seqlen_q) & head_valid
    valid_b = (q_idx_b < seqlen_q) & head_valid
    q_batch_offset = batch.to(tl.int64) * stride_qb
    q_a = load_q_tile(q_ptr, q_batch_offset, q_start, q_idx_a, heads, valid_a, dims, stride_qs, stride_qh, HEAD_DIM)
    if NUM_Q_TILES == 2:
        q_b = load_q_tile(q_ptr, q_batch_offset, q_start, q_idx_b, heads, valid_b, dims, stride_qs, stride_qh, HEAD_DIM)
    else:
        q_b = q_a
    if FP8_Q:
        q_a = q_a.to(tl.bfloat16)
        q_b = q_b.to(tl.bfloat16)
    q_idx_mod_a = tl.minimum(q_idx_a, tl.maximum(seqlen_q - 1, 0))
    q_idx_mod_b = tl.minimum(q_idx_b, tl.maximum(seqlen_q - 1, 0))
    mask_rows_a = attn_mask_ptr
    mask_rows_b = attn_mask_ptr
    if MASK_TENSOR != "none":  # rows clamped into the mask: a padded row reads a real one, never stored
        mask_row_base = (
            attn_mask_ptr
            + batch.to(tl.int64) * stride_mask_b
            + tl.minimum(heads, kv_head * group + group - 1).to(tl.int64) * stride_mask_h
        )
        mask_rows_a = mask_row_base + q_idx_mod_a.to(tl.int64) * stride_mask_q
        mask_rows_b = mask_row_base + q_idx_mod_b.to(tl.int64) * stride_mask_q
    if SCORE_MOD_KIND == "alibi":
        alibi_slopes = tl.load(alibi_slopes_ptr + heads, mask=head_valid, other=0.0)
    else:
        alibi_slopes = tl.zeros([BLOCK_M], dtype=tl.float32)

    if PAGED:
        k_batch_offset = 0
        v_batch_offset = 0
    else:
        k_batch_offset = batch.to(tl.int64) * stride_kb
        v_batch_offset = batch.to(tl.int64) * stride_vb
    block_table_row = block_table_ptr + batch.to(tl.int64) * stride_block_table
    k_head_offset = kv_head * stride_kh
    v_head_offset = kv_head * stride_vh
    kv_row_base = kv_start if RAGGED_K else batch * seqlen_k_dense  # descriptor row of key 0
    kv_col = kv_head * HEAD_DIM
    if Q_DESCALE:
        softmax_scale = softmax_scale * tl.load(
            q_descale_ptr + batch.to(tl.int64) * stride_q_descale_b + kv_head * stride_q_descale_h
        )
    if K_DESCALE:
        softmax_scale = softmax_scale * tl.load(
            k_descale_ptr + batch.to(tl.int64) * stride_k_descale_b + kv_head * stride_k_descale_h
        )
    qk_scale_log2 = softmax_scale * LOG2E

    acc_a = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    sum_a = tl.zeros([BLOCK_M], dtype=tl.float32)
    max_a = tl.zeros([BLOCK_M], dtype=tl.float32) - float("inf")
    acc_b = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    sum_b = tl.zeros([BLOCK_M], dtype=tl.float32)
    max_b = tl.zeros([BLOCK_M], dtype=tl.float32) - float("inf")

    # Three phases over this program's KV range [split_lo, split_hi): masked tiles left of the fully
    # visible band (sliding window / chunk start), the band itself with no per-element masking, and
    # masked tiles right of it (causal diagonal, window end, sequence end).
    for phase in tl.static_range(3):
        if phase == 0:
            lo = split_lo
            hi = tl.minimum(full_lo, split_hi)
        elif phase == 1:
            lo = tl.maximum(full_lo, split_lo)
            hi = tl.minimum(full_hi, split_hi)
        else:
            lo = tl.maximum(full_hi, split_lo)
            hi = split_hi
        acc_a, sum_a, max_a, acc_b, sum_b, max_b = attend_kv_range(
            acc_a,
            sum_a,
            max_a,
            acc_b,
            sum_b,
            max_b,
            q_a,
            q_b,
            q_idx_mod_a,
            q_idx_mod_b,
            q_idx_a + shift,
            q_idx_b + shift,
            heads,
            alibi_slopes,
            k_ptr,
            v_ptr,
            k_desc,
            v_desc,
            k_batch_offset,
            v_batch_offset,
            k_head_offset,
            v_head_offset,
            stride_kb,
            stride_ks,
            stride_vb,
            stride_vs,
            block_table_row,
            num_pages,
            kv_start,
            kv_row_base,
            kv_col,
            seqlen_k,
            batch,
            lo,
            hi,
            softmax_scale,
            qk_scale_log2,
            window_left,
            window_right,
            chunk_size,
            softcap_value,
            HEAD_DIM,
            HEAD_DIM_PAD,
            BLOCK_M,
            BLOCK_N,
            NUM_Q_TILES,
            PAGED,
            PAGE_SIZE,
            phase != 1,
            HAS_WINDOW,
            HAS_CHUNK,
            HAS_MASK_MOD,
            MASK_MOD,
            SCORE_MOD_KIND,
            SCORE_MOD,
            RESCALE_THRESHOLD,
            POLY_EXP2_FRACTION,
            TMA_KV,
            UPCAST,
            mask_rows_a,
            mask_rows_b,
            stride_mask_k,
            MASK_TENSOR,
            PAGE_OFFSETS_64,
            PAGED and not KV_STARTS,
            FP8_KV,
            E4M3_ASM,
        )

    if V_DESCALE:
        v_factor = tl.load(v_descale_ptr + batch.to(tl.int64) * stride_v_descale_b + kv_head * stride_v_descale_h)
        acc_a = acc_a * v_factor
        acc_b = acc_b * v_factor

    store_q_tile(
        acc_a,
        sum_a,
        max_a,
        out_ptr,
        lse_ptr,
        sinks_ptr,
        batch,
        split,
        q_start,
        q_idx_a,
        heads,
        valid_a,
        dims,
        stride_ob,
        stride_os,
        stride_oh,
        stride_o_split,
        stride_lse_b,
        stride_lse_h,
        stride_lse_s,
        stride_lse_split,
        HEAD_DIM,
        HAS_SINKS,
        SPLIT,
        RETURN_LSE,
    )
    if NUM_Q_TILES == 2:
        store_q_tile(
            acc_b,
            sum_b,
            max_b,
            out_ptr,
            lse_ptr,
            sinks_ptr,
            batch,
            split,
            q_start,
            q_idx_b,
            heads,
            valid_b,
            dims,
            stride_ob,
            stride_os,
            stride_oh,
            stride_o_split,
            stride_lse_b,
            stride_lse_h,
            stride_lse_s,
            stride_lse_split,
            HEAD_DIM,
            HAS_SINKS,
            SPLIT,
            RETURN_LSE,
        )
