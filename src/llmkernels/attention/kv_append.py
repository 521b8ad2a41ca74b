"""Rotary embedding and KV-cache append: what flash-attn's ``flash_attn_with_kvcache`` does before attending.

* :func:`apply_rotary`: q rotated at per-sequence positions, into a new tensor.
* :func:`append_to_cache`: new keys (rotated) or values written into a dense ``[B_cache, S, Hkv, D]`` or paged
  ``[num_pages, page_size, Hkv, D]`` cache in place, at positions ``start[b] + i``.

Rotary follows flash-attn's ``apply_rotary_emb``: ``cos`` / ``sin`` ``[seqlen_ro, rotary_dim / 2]``; the first
``rotary_dim`` features rotate in pairs, ``(x[2j], x[2j + 1])`` when interleaved (GPT-J), ``(x[j], x[j +
rotary_dim / 2])`` otherwise (GPT-NeoX); the rest pass through. Computed in float32, rounded once. No host sync:
positions come from device tensors, and a write past the cache's capacity is dropped, never made.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._runtime import interpreting, unit_last_stride

__all__ = ["apply_rotary", "append_to_cache"]


@triton.jit
def _rotary_copy_kernel(
    src_ptr, dst_ptr, cos_ptr, sin_ptr, start_ptr, dst_batch_ptr, block_table_ptr,
    stride_src_b, stride_src_s, stride_src_h,
    stride_dst_b, stride_dst_s, stride_dst_h,
    stride_cos, stride_block_table,
    seqlen_new, num_heads, head_dim, rotary_seqlen, capacity, num_pages,
    ROTARY_DIM: tl.constexpr, INTERLEAVED: tl.constexpr, PER_TOKEN: tl.constexpr, TO_CACHE: tl.constexpr,
    PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr, HAS_DST_BATCH: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """One (sequence b, new token i) row of every head: ``src[b, i]`` ``[H, D]``, rotated at position
    ``start[b] + i`` (``start[b]`` without PER_TOKEN) over its first ROTARY_DIM features, stored to ``dst[b, i]``
    or, TO_CACHE, to cache position ``p = start[b] + i`` of sequence ``dst_batch[b]`` (dense) or of the pages
    ``block_table[b, p // PAGE_SIZE]`` (PAGED; entries clamped to ``[0, num_pages - 1]``, and so is
    ``dst_batch[b]`` to the dense cache's ``num_pages`` sequences); ``p`` outside ``[0, capacity)`` is not
    stored. Rotary positions past ``rotary_seqlen`` read its last row."""
    row = tl.program_id(0)
    b = row // seqlen_new
    i = row % seqlen_new
    start = tl.load(start_ptr + b)
    position = start + i if PER_TOKEN else start
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    valid = (heads < num_heads) & (dims < head_dim)
    src_row = src_ptr + b.to(tl.int64) * stride_src_b + i.to(tl.int64) * stride_src_s + heads * stride_src_h
    x = tl.load(src_row + dims, mask=valid, other=0.0).to(tl.float32)
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
        rotates = dims < ROTARY_DIM
        cos_row = tl.minimum(tl.maximum(position, 0), rotary_seqlen - 1).to(tl.int64) * stride_cos
        cos = tl.load(cos_ptr + cos_row + frequency, mask=rotates, other=1.0).to(tl.float32)
        sin = tl.load(sin_ptr + cos_row + frequency, mask=rotates, other=0.0).to(tl.float32)
        x_partner = tl.load(src_row + partner, mask=valid & rotates, other=0.0).to(tl.float32)
        x = x * cos + sign * x_partner * sin
    if TO_CACHE:
        positions = tl.zeros((1, 1), tl.int32) + position  # [1, 1]: the interpreter takes no scalar mask
        in_cache = (positions < capacity) & (positions >= 0)
        keep = valid & in_cache
        if PAGED:
            page = tl.load(block_table_ptr + b.to(tl.int64) * stride_block_table + positions // PAGE_SIZE,
                           mask=in_cache, other=0)
            page = tl.minimum(tl.maximum(page, 0), num_pages - 1)
            dst_row = dst_ptr + page.to(tl.int64) * stride_dst_b + (positions % PAGE_SIZE) * stride_dst_s
        else:
            cache_b = tl.load(dst_batch_ptr + b) if HAS_DST_BATCH else b
            cache_b = tl.minimum(tl.maximum(cache_b, 0), num_pages - 1)  # num_pages: the cache's sequences
            dst_row = dst_ptr + cache_b.to(tl.int64) * stride_dst_b + position.to(tl.int64) * stride_dst_s
    else:
        keep = valid
        dst_row = dst_ptr + b.to(tl.int64) * stride_dst_b + i.to(tl.int64) * stride_dst_s
    tl.store(dst_row + heads * stride_dst_h + dims, x.to(dst_ptr.dtype.element_ty), mask=keep)


def _launch(src, dst, cos, sin, start, dst_batch, block_table, interleaved, per_token, to_cache, paged,
            page_size, capacity, num_pages):
    batch, seqlen_new, num_heads, head_dim = src.shape
    if batch * seqlen_new == 0 or num_heads == 0:
        return
    rotary_dim = 0 if cos is None else 2 * cos.shape[1]
    dummy = start
    cos_arg, sin_arg = (cos, sin) if cos is not None else (dummy, dummy)
    _rotary_copy_kernel[(batch * seqlen_new,)](
        src, dst, cos_arg, sin_arg, start, dst_batch if dst_batch is not None else dummy,
        block_table if block_table is not None else dummy,
        src.stride(0), src.stride(1), src.stride(2), dst.stride(0), dst.stride(1), dst.stride(2),
        cos.stride(0) if cos is not None else 0, block_table.stride(0) if block_table is not None else 0,
        seqlen_new, num_heads, head_dim, cos.shape[0] if cos is not None else 1, capacity, num_pages,
        ROTARY_DIM=rotary_dim, INTERLEAVED=interleaved, PER_TOKEN=per_token, TO_CACHE=to_cache, PAGED=paged,
        PAGE_SIZE=page_size, HAS_DST_BATCH=dst_batch is not None,
        BLOCK_H=triton.next_power_of_2(num_heads), BLOCK_D=triton.next_power_of_2(head_dim),
        num_warps=1 if interpreting() else 4,
    )


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, start: torch.Tensor, interleaved: bool,
                 per_token: bool) -> torch.Tensor:
    """``x`` ``[B, S, H, D]`` rotated at positions ``start[b] + i`` (``start[b]`` for every token without
    ``per_token``): a new tensor of x's shape and dtype. ``start`` int32 ``[B]``; cos / sin ``[seqlen_ro, R / 2]``."""
    x = unit_last_stride(x)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _launch(x, out, unit_last_stride(cos), unit_last_stride(sin), start, None, None, interleaved, per_token, False,
            False, 1, 0, 1)
    return out


def append_to_cache(new: torch.Tensor, cache: torch.Tensor, start: torch.Tensor, *, cos=None, sin=None,
                    interleaved: bool = True, cache_batch_idx: torch.Tensor | None = None,
                    block_table: torch.Tensor | None = None) -> None:
    """Writes ``new`` ``[B, S_new, Hkv, D]`` (rotated when ``cos`` / ``sin`` are given) into ``cache`` in place,
    token i of sequence b at position ``start[b] + i``: a dense cache ``[B_cache, S, Hkv, D]`` (sequence
    ``cache_batch_idx[b]``, default b) or pages ``[num_pages, page_size, Hkv, D]`` through ``block_table``
    int32 ``[B, max_pages]``. Positions outside the cache's capacity (S, or ``max_pages * page_size``) are not
    written; page ids and ``cache_batch_idx`` entries are clamped to the cache."""
    new = unit_last_stride(new)
    if cache.stride(-1) != 1:
        raise ValueError("the KV cache must have a unit-stride head dim to be written in place")
    cos, sin = (None, None) if cos is None else (unit_last_stride(cos), unit_last_stride(sin))
    if block_table is not None:
        page_size = cache.shape[1]
        _launch(new, cache, cos, sin, start, None, block_table, interleaved, True, True, True, page_size,
                block_table.shape[1] * page_size, cache.shape[0])
    else:
        _launch(new, cache, cos, sin, start, cache_batch_idx, None, interleaved, True, True, False, 1,
                cache.shape[1], cache.shape[0])
