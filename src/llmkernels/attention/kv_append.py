"""Rotary embedding and KV-cache append: what flash-attn's ``flash_attn_with_kvcache`` does before attending.

* :func:`apply_rotary`: q rotated at per-sequence positions, into a new tensor.
* :func:`append_to_cache`: new keys (rotated) or values written into a dense ``[B_cache, S, Hkv, D]`` or paged
  ``[num_pages, page_size, Hkv, D]`` cache in place, at positions ``start[b] + i``.

Rotary follows flash-attn's ``apply_rotary_emb``: ``cos`` / ``sin`` ``[seqlen_ro, rotary_dim / 2]``; the first
``rotary_dim`` features rotate in pairs, ``(x[2j], x[2j + 1])`` when interleaved (GPT-J), ``(x[j], x[j +
rotary_dim / 2])`` otherwise (GPT-NeoX); the rest pass through. Computed in float32, rounded once. No host sync:
positions come from device tensors, and a write past the cache's capacity is dropped, never made.

Every tensor may be any view: all strides go to the kernel (no copy). The shape checks here are a backstop that
runs before the launch; :mod:`llmkernels.flash_attn` checks its whole call first, with flash-attn's names.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..launch import BoundKernel, PlanCache, bind
from ..runtime import interpreting
from .check import check_fp8_capability

__all__ = ["apply_rotary", "append_to_cache", "check_rotary_tables", "check_append_descale"]

FP8 = torch.float8_e4m3fn


@triton.jit
def _bf16_nearest_even(x):
    """float32 → bfloat16 rounded to nearest, ties to even (NaN stays NaN): what the GPU's conversion does, and
    the interpreter's (which truncates) does not."""
    bits = x.to(tl.uint32, bitcast=True)
    upper = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    upper = tl.where(x != x, (bits >> 16) | 0x40, upper)
    return upper.to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _e4m3_nearest_even(x):
    """float32 ``x`` (already saturated to ``[-448, 448]``) → the bits of its float8_e4m3fn rounding to nearest, ties
    to even, as uint8 (NaN → 0x7F with x's sign): what the GPU's conversion does and the interpreter's does not (it
    rounds ties away and mis-rounds some values). Normals: the float32 mantissa rounded to 3 bits and the exponent
    rebiased (127 → 7); below 2**-6, multiples of 2**-9 (an exact scaling and the 2**23 rounding trick)."""
    bits = x.to(tl.uint32, bitcast=True)
    sign = (bits >> 24) & 0x80
    magnitude = tl.abs(x)
    magnitude_bits = magnitude.to(tl.uint32, bitcast=True)
    normal = ((magnitude_bits + 0x7FFFF + ((magnitude_bits >> 20) & 1)) >> 20) - (120 << 3)
    subnormal = ((magnitude * 512.0 + 8388608.0) - 8388608.0).to(tl.uint32)
    code = tl.where(magnitude >= 0.015625, normal, subnormal)
    code = tl.where(x != x, 0x7F, code)
    return (code | sign).to(tl.uint8)


@triton.jit
def _rotary_copy_kernel(
    src_ptr,
    dst_ptr,
    cos_ptr,
    sin_ptr,
    start_ptr,
    dst_batch_ptr,
    block_table_ptr,
    descale_ptr,
    stride_src_b,
    stride_src_s,
    stride_src_h,
    stride_src_d,
    stride_dst_b,
    stride_dst_s,
    stride_dst_h,
    stride_dst_d,
    stride_cos_s,
    stride_cos_d,
    stride_sin_s,
    stride_sin_d,
    stride_start,
    stride_dst_batch,
    stride_block_table_b,
    stride_block_table_p,
    stride_descale_b,
    stride_descale_h,
    seqlen_new,
    num_heads,
    head_dim,
    rotary_seqlen,
    capacity,
    num_pages,
    ROTARY_DIM: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    PER_TOKEN: tl.constexpr,
    TO_CACHE: tl.constexpr,
    PAGED: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    HAS_DST_BATCH: tl.constexpr,
    BF16_BY_HAND: tl.constexpr,
    DESCALE: tl.constexpr,
    E4M3: tl.constexpr,
    E4M3_BY_HAND: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """One (sequence b, new token i) row of every head: ``src[b, i]`` ``[H, D]``, rotated at position
    ``start[b] + i`` (``start[b]`` without PER_TOKEN) over its first ROTARY_DIM features, stored to ``dst[b, i]``
    or, TO_CACHE, to cache position ``p = start[b] + i`` of sequence ``dst_batch[b]`` (dense) or of the pages
    ``block_table[b, p // PAGE_SIZE]`` (PAGED; entries clamped to ``[0, num_pages - 1]``, and so is
    ``dst_batch[b]`` to the dense cache's ``num_pages`` sequences); ``p`` outside ``[0, capacity)`` is not
    stored. Rotary positions outside ``[0, rotary_seqlen)`` read its first / last row. No load reads past
    ``head_dim`` features of a row nor past ``ROTARY_DIM / 2`` columns of cos / sin (ROTARY_DIM <= head_dim).
    Computed in float32 and rounded once to nearest even (BF16_BY_HAND: a bfloat16 ``dst`` in the interpreter).
    ``E4M3``: ``dst`` is float8_e4m3fn: the value (divided by ``descale[b, head]`` with ``DESCALE``, float32 ``[B,
    Hkv]``, IEEE division) saturates to ``[-448, 448]`` (NaN stays NaN) and rounds to nearest even; ``E4M3_BY_HAND``
    (the interpreter): ``dst`` is the cache's bytes and the bits are made by :func:`_e4m3_nearest_even`."""
    row = tl.program_id(0)
    b = row // seqlen_new
    i = row % seqlen_new
    start = tl.load(start_ptr + b.to(tl.int64) * stride_start)
    position = start + i if PER_TOKEN else start
    heads = tl.arange(0, BLOCK_H)[:, None].to(tl.int64)
    dims = tl.arange(0, BLOCK_D)[None, :]
    valid = (heads < num_heads) & (dims < head_dim)
    src_row = src_ptr + b.to(tl.int64) * stride_src_b + i.to(tl.int64) * stride_src_s + heads * stride_src_h
    x = tl.load(src_row + dims.to(tl.int64) * stride_src_d, mask=valid, other=0.0).to(tl.float32)
    if ROTARY_DIM > 0:
        HALF: tl.constexpr = ROTARY_DIM // 2
        if INTERLEAVED:
            partner = dims ^ 1
            frequency = dims // 2
            sign = tl.where(dims % 2 == 0, -1.0, 1.0)
        else:
            partner = tl.where(dims < HALF, dims + HALF, dims - HALF)
            frequency = tl.where(dims < HALF, dims, dims - HALF)
            sign = tl.where(dims < HALF, -1.0, 1.0)
        rotates = (dims < ROTARY_DIM) & (dims < head_dim)
        table_row = tl.minimum(tl.maximum(position, 0), rotary_seqlen - 1).to(tl.int64)
        column = frequency.to(tl.int64)
        cos = tl.load(cos_ptr + table_row * stride_cos_s + column * stride_cos_d, mask=rotates, other=1.0)
        sin = tl.load(sin_ptr + table_row * stride_sin_s + column * stride_sin_d, mask=rotates, other=0.0)
        x_partner = tl.load(
            src_row + partner.to(tl.int64) * stride_src_d, mask=valid & rotates & (partner < head_dim), other=0.0
        ).to(tl.float32)
        x = x * cos.to(tl.float32) + sign * x_partner * sin.to(tl.float32)
    if DESCALE:
        descale = tl.load(
            descale_ptr + b.to(tl.int64) * stride_descale_b + heads * stride_descale_h,
            mask=heads < num_heads,
            other=1.0,
        )
        x = tl.div_rn(x, descale)
    if E4M3:
        x = tl.where(x != x, x, tl.minimum(tl.maximum(x, -448.0), 448.0))
    if TO_CACHE:
        positions = tl.zeros((1, 1), tl.int32) + position  # [1, 1]: the interpreter takes no scalar mask
        in_cache = (positions < capacity) & (positions >= 0)
        keep = valid & in_cache
        if PAGED:
            page_slot = (positions // PAGE_SIZE).to(tl.int64)
            page = tl.load(
                block_table_ptr + b.to(tl.int64) * stride_block_table_b + page_slot * stride_block_table_p,
                mask=in_cache,
                other=0,
            )
            page = tl.minimum(tl.maximum(page, 0), num_pages - 1)
            dst_row = dst_ptr + page.to(tl.int64) * stride_dst_b + (positions % PAGE_SIZE).to(tl.int64) * stride_dst_s
        else:
            cache_b = tl.load(dst_batch_ptr + b.to(tl.int64) * stride_dst_batch) if HAS_DST_BATCH else b
            cache_b = tl.minimum(tl.maximum(cache_b, 0), num_pages - 1)  # num_pages: the cache's sequences
            dst_row = dst_ptr + cache_b.to(tl.int64) * stride_dst_b + position.to(tl.int64) * stride_dst_s
    else:
        keep = valid
        dst_row = dst_ptr + b.to(tl.int64) * stride_dst_b + i.to(tl.int64) * stride_dst_s
    if E4M3_BY_HAND:
        rounded = _e4m3_nearest_even(x)
    elif BF16_BY_HAND:
        rounded = _bf16_nearest_even(x)
    else:
        rounded = x.to(dst_ptr.dtype.element_ty)
    tl.store(dst_row + heads * stride_dst_h + dims.to(tl.int64) * stride_dst_d, rounded, mask=keep)


_PLANS = PlanCache("kv_append")


def _launch(
    src,
    dst,
    cos,
    sin,
    start,
    dst_batch,
    block_table,
    interleaved,
    per_token,
    to_cache,
    paged,
    page_size,
    capacity,
    num_pages,
    descale=None,
):
    batch, seqlen_new, num_heads, head_dim = src.shape
    if batch * seqlen_new == 0 or num_heads * head_dim == 0:
        return
    if to_cache and (capacity <= 0 or num_pages <= 0):  # every position is past the cache: nothing is written
        return
    dummy = start  # pointers the compiled variant never reads
    if dst.dtype == FP8 and interpreting():  # the interpreter's e4m3 conversion does not round to nearest even
        dst = dst.view(torch.uint8)
    tensors = (
        src,
        dst,
        cos if cos is not None else dummy,
        sin if sin is not None else dummy,
        start,
        dst_batch if dst_batch is not None else dummy,
        block_table if block_table is not None else dummy,
        descale if descale is not None else dummy,
    )
    key, bound = _PLANS.lookup(
        src,
        dst,
        cos,
        sin,
        start,
        dst_batch,
        block_table,
        interleaved,
        per_token,
        to_cache,
        paged,
        page_size,
        capacity,
        num_pages,
        descale,
    )
    if bound is None:
        bound = _PLANS.put(
            key,
            _bind(
                tensors,
                cos,
                sin,
                dst_batch,
                block_table,
                interleaved,
                per_token,
                to_cache,
                paged,
                page_size,
                capacity,
                num_pages,
                descale,
            ),
        )
    bound(*tensors)


def _bind(
    tensors,
    cos,
    sin,
    dst_batch,
    block_table,
    interleaved,
    per_token,
    to_cache,
    paged,
    page_size,
    capacity,
    num_pages,
    descale,
) -> BoundKernel:
    """The copy kernel's launch for the signature of ``tensors`` (its eight pointer arguments), compiled once."""
    src, dst, _, _, start, _, _, _ = tensors
    batch, seqlen_new, num_heads, head_dim = src.shape
    rotary_dim = 0 if cos is None else 2 * cos.shape[1]
    table_strides = (0, 0, 0, 0) if cos is None else (*cos.stride(), *sin.stride())
    return bind(
        _rotary_copy_kernel,
        (batch * seqlen_new,),
        *tensors,
        *src.stride(),
        *dst.stride(),
        *table_strides,
        start.stride(0),
        dst_batch.stride(0) if dst_batch is not None else 0,
        *(block_table.stride() if block_table is not None else (0, 0)),
        *(0 if size == 1 else stride for size, stride in zip(descale.shape, descale.stride()))
        if descale is not None
        else (0, 0),
        seqlen_new,
        num_heads,
        head_dim,
        cos.shape[0] if cos is not None else 1,
        capacity,
        num_pages,
        ROTARY_DIM=rotary_dim,
        INTERLEAVED=interleaved,
        PER_TOKEN=per_token,
        TO_CACHE=to_cache,
        PAGED=paged,
        PAGE_SIZE=page_size,
        HAS_DST_BATCH=dst_batch is not None,
        BF16_BY_HAND=interpreting() and dst.dtype == torch.bfloat16,
        DESCALE=descale is not None,
        E4M3=dst.dtype in (FP8, torch.uint8),  # uint8: the bytes of an e4m3 cache (_launch)
        E4M3_BY_HAND=dst.dtype == torch.uint8,
        BLOCK_H=triton.next_power_of_2(num_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        num_warps=1 if interpreting() else 4,
    )


def check_rotary_tables(cos, sin, head_dim: int, cos_name: str = "cos", sin_name: str = "sin") -> None:
    """``cos`` / ``sin``: float16 / bfloat16 / float32 tensors of one shape ``[seqlen_ro, rotary_dim / 2]``,
    ``rotary_dim <= head_dim``, at least one row when ``rotary_dim > 0``.

    Raises:
        TypeError: not a tensor, or another dtype.
        ValueError: not 2-D, shapes differ, ``rotary_dim`` past the head dim, no rows.
    """
    for name, table in ((cos_name, cos), (sin_name, sin)):
        if not isinstance(table, torch.Tensor) or table.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise TypeError(
                f"{name} must be a float16, bfloat16 or float32 tensor [seqlen_ro, rotary_dim / 2], "
                f"got {getattr(table, 'dtype', type(table).__name__)}"
            )
        if table.dim() != 2:
            raise ValueError(f"{name} must be 2-D [seqlen_ro, rotary_dim / 2], got shape {tuple(table.shape)}")
    if sin.shape != cos.shape:
        raise ValueError(f"{sin_name} shape {tuple(sin.shape)} != {cos_name} shape {tuple(cos.shape)}")
    rotary_dim = 2 * cos.shape[1]
    if rotary_dim > head_dim:
        raise ValueError(f"rotary_dim = 2 * {cos_name}.shape[1] = {rotary_dim} must be <= head dim {head_dim}")
    if rotary_dim > 0 and cos.shape[0] == 0:
        raise ValueError(f"{cos_name} has no rows (seqlen_ro = 0)")


def check_append_descale(name: str, descale, new, cache, new_name: str, cache_name: str) -> None:
    """The dtypes of an append ``new`` ``[B, S_new, Hkv, D]`` → ``cache``: the cache's dtype, or fp16 / bf16 into a
    float8_e4m3fn cache; ``descale`` None or, with an e4m3 cache, float32 ``[B, Hkv]`` (size-1 dims broadcast).

    Raises:
        TypeError: other dtypes, naming ``new_name`` or ``name``. ValueError: a descale of another shape, or with a
        cache that is not e4m3, naming ``name``.
    """
    if new.dtype != cache.dtype and not (cache.dtype == FP8 and new.dtype in (torch.float16, torch.bfloat16)):
        raise TypeError(
            f"{new_name} dtype {new.dtype} != {cache_name} dtype {cache.dtype} (or float16 / bfloat16 into a "
            f"float8_e4m3fn cache)"
        )
    if cache.dtype == FP8:
        check_fp8_capability(cache_name, cache.device)
    if descale is None:
        return
    if cache.dtype != FP8:
        raise ValueError(f"{name} given but {cache_name} is {cache.dtype}, not float8_e4m3fn")
    if not isinstance(descale, torch.Tensor) or descale.dtype != torch.float32:
        raise TypeError(
            f"{name} must be a float32 tensor [B, Hkv], got {getattr(descale, 'dtype', type(descale).__name__)}"
        )
    want = (new.shape[0], new.shape[2])
    if descale.dim() != 2 or any(size not in (1, full) for size, full in zip(descale.shape, want)):
        raise ValueError(f"{name} must be [B, Hkv] = {list(want)} (or size-1 dims), got shape {tuple(descale.shape)}")
    if descale.device != new.device:
        raise ValueError(f"{name} is on {descale.device} but {new_name} is on {new.device}")


def _check_positions(name: str, tensor, batch: int) -> None:
    if not isinstance(tensor, torch.Tensor) or tensor.dtype != torch.int32 or tensor.shape != (batch,):
        raise ValueError(
            f"{name} must be an int32 tensor [{batch}], got "
            f"{getattr(tensor, 'dtype', type(tensor).__name__)} {tuple(getattr(tensor, 'shape', ()))}"
        )


def apply_rotary(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, start: torch.Tensor, interleaved: bool, per_token: bool
) -> torch.Tensor:
    """``x`` ``[B, S, H, D]`` rotated at positions ``start[b] + i`` (``start[b]`` for every token without
    ``per_token``): a new contiguous tensor of x's shape and dtype. ``start`` int32 ``[B]``; cos / sin
    ``[seqlen_ro, R / 2]`` (:func:`check_rotary_tables`). Any strides.

    Raises:
        ValueError / TypeError: x not 4-D, bad tables (:func:`check_rotary_tables`), ``start`` not int32 ``[B]``.
    """
    if x.dim() != 4:
        raise ValueError(f"x must be [B, S, H, D], got shape {tuple(x.shape)}")
    check_rotary_tables(cos, sin, x.shape[-1])
    _check_positions("start", start, x.shape[0])
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _launch(x, out, cos, sin, start, None, None, interleaved, per_token, False, False, 1, 0, 1)
    return out


def append_to_cache(
    new: torch.Tensor,
    cache: torch.Tensor,
    start: torch.Tensor,
    *,
    cos=None,
    sin=None,
    interleaved: bool = True,
    cache_batch_idx: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    descale: torch.Tensor | None = None,
) -> None:
    """Writes ``new`` ``[B, S_new, Hkv, D]`` (rotated when ``cos`` / ``sin`` are given) into ``cache`` in place,
    token i of sequence b at position ``start[b] + i``: a dense cache ``[B_cache, S, Hkv, D]`` (sequence
    ``cache_batch_idx[b]``, default b) or pages ``[num_pages, page_size, Hkv, D]`` through ``block_table``
    int32 ``[B, max_pages]``. Positions outside the cache's capacity (S, or ``max_pages * page_size``) are not
    written; page ids and ``cache_batch_idx`` entries are clamped to the cache. Two tokens sent to one cache row
    (repeated ``cache_batch_idx`` entries or pages) leave one of them there, which is unspecified. Any strides
    (the cache's elements must not overlap: the caller's contract).

    FP8 cache (float8_e4m3fn): fp16 / bf16 ``new`` is stored as the e4m3 rounding to nearest even of ``new /
    descale[b, head]`` (float32 ``descale`` ``[B, Hkv]``, FA3's ``k_descale`` / ``v_descale``; ``[1, 1]`` is vLLM's
    per-tensor ``k_scale`` / ``v_scale``; None: 1.0), saturated to ``[-448, 448]`` (NaN stays NaN); e4m3 ``new`` is
    already in the cache's scale: copied (rotated, then rounded, with cos / sin), never divided.

    Raises:
        TypeError: ``new`` neither the cache's dtype nor fp16 / bf16 into an e4m3 cache; ``descale`` not float32.
        ValueError: shapes that disagree (new's heads / head dim vs the cache's, ``start`` / ``cache_batch_idx``
            not int32 ``[B]``, ``block_table`` not int32 ``[B, max_pages]``, bad rotary tables, ``descale`` not
            broadcastable to ``[B, Hkv]``), a ``descale`` with a cache that is not e4m3.
    """
    if new.dim() != 4 or cache.dim() != 4 or new.shape[2:] != cache.shape[2:]:
        raise ValueError(
            f"new [B, S_new, Hkv, D] {tuple(new.shape)} does not fit cache [.., .., Hkv, D] {tuple(cache.shape)}"
        )
    batch = new.shape[0]
    _check_positions("start", start, batch)
    check_append_descale("descale", descale, new, cache, "new", "cache")
    if new.dtype == FP8 or cache.dtype != FP8:
        descale = None  # e4m3 keys are in the cache's scale already
    if cos is not None:
        check_rotary_tables(cos, sin, new.shape[-1])
    if block_table is not None:
        if block_table.dtype != torch.int32 or block_table.dim() != 2 or block_table.shape[0] != batch:
            raise ValueError(
                f"block_table must be int32 [{batch}, max_pages], got {block_table.dtype} {tuple(block_table.shape)}"
            )
        page_size = cache.shape[1]
        _launch(
            new,
            cache,
            cos,
            sin,
            start,
            None,
            block_table,
            interleaved,
            True,
            True,
            True,
            page_size,
            block_table.shape[1] * page_size,
            cache.shape[0],
            descale,
        )
    else:
        if cache_batch_idx is not None:
            _check_positions("cache_batch_idx", cache_batch_idx, batch)
        _launch(
            new,
            cache,
            cos,
            sin,
            start,
            cache_batch_idx,
            None,
            interleaved,
            True,
            True,
            False,
            1,
            cache.shape[1],
            cache.shape[0],
            descale,
        )
