"""flash-attn's Python API on llmkernels' attention: replace ``from flash_attn import ...`` with
``from llmkernels.flash_attn import ...`` and nothing else changes.

:func:`flash_attn_func`, :func:`flash_attn_varlen_func` and :func:`flash_attn_with_kvcache` take flash-attn 2.8's
arguments, names, defaults, layouts and return values, plus FA3's ``attention_chunk``, ``num_splits``,
``seqused_k`` and ``page_table`` (an alias of ``block_table``) and FA4's ``learnable_sink`` (keyword-only).
Forward only: ``dropout_p > 0`` and inputs that require grad raise. ``return_attn_probs=True`` returns
``(out, softmax_lse, None)``: the probabilities are not materialized. Head dims that are not a multiple of 16
(our kernels' unit) are zero-padded on the way in by the dense and varlen functions (a copy of q, k and v);
``flash_attn_with_kvcache`` needs a multiple of 16 (padding would copy the whole cache every call).

Not yet supported, each raising ``NotImplementedError`` that names the argument: per-batch ``alibi_slopes``
``[B, H]``, softcap together with ALiBi.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .attention import Chunked, PagedKVCache, SlidingWindow, alibi, softcap as softcap_mod
from .attention.kv_append import append_to_cache, apply_rotary
from .attention.paged import SUPPORTED_PAGE_SIZES
from .ops import attention

__all__ = ["flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache"]


def _modifiers(causal, window_size, softcap, alibi_slopes, attention_chunk, dropout_p=0.0):
    """flash-attn's masking and score arguments → ``lk.attention``'s ``mask`` and ``score_mod``."""
    if dropout_p != 0.0:
        raise ValueError(f"dropout_p={dropout_p}: llmkernels.flash_attn is forward-only inference, use dropout_p=0")
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2:
        raise ValueError(f"window_size must be a pair (left, right), got {window_size!r}")
    parts = []
    left, right = (int(side) for side in window_size)
    if left >= 0 or right >= 0:
        parts.append(SlidingWindow(left, right))
    if attention_chunk:
        parts.append(Chunked(int(attention_chunk)))
    if softcap and alibi_slopes is not None:
        raise NotImplementedError("softcap together with alibi_slopes is not supported yet (one score_mod per call)")
    score_mod = None
    if softcap:
        score_mod = softcap_mod(float(softcap))
    elif alibi_slopes is not None:
        if not isinstance(alibi_slopes, torch.Tensor) or alibi_slopes.dim() != 1:
            raise NotImplementedError(f"alibi_slopes must be [nheads] for now, got shape "
                                      f"{tuple(getattr(alibi_slopes, 'shape', ()))} (per-batch [B, H] not yet)")
        score_mod = alibi(alibi_slopes)
    mask = tuple(parts) if len(parts) > 1 else (parts[0] if parts else None)
    return mask, score_mod


def _block_table(block_table, page_table):
    """flash-attn's ``block_table`` or FA3's name for it, ``page_table``."""
    if block_table is not None and page_table is not None:
        raise ValueError("pass block_table or page_table (its FA3 name), not both")
    return block_table if block_table is not None else page_table


def _sinks(learnable_sink):
    return None if learnable_sink is None else learnable_sink.float()


def _splits(num_splits):
    return None if not num_splits or num_splits <= 0 else int(num_splits)


def _results(result, return_lse: bool, attn_probs: bool, head_dim: int | None = None):
    """flash-attn's return forms; ``head_dim``: the caller's, when the inputs were padded past it."""
    out, lse = result if return_lse else (result, None)
    if head_dim is not None and out.shape[-1] != head_dim:
        out = out[..., :head_dim].contiguous()
    if not return_lse:
        return out
    return (out, lse, None) if attn_probs else (out, lse)


def _pad_head_dim(q, k, v, softmax_scale):
    """flash-attn takes any head dim up to 256, our kernels multiples of 16: q, k, v zero-padded to the next
    one (a copy of each; the scores are unchanged, the padded output columns are dropped), the softmax scale
    kept at ``1 / sqrt(D)`` of the caller's D."""
    head_dim = q.shape[-1]
    if head_dim % 16 == 0 or head_dim > 256 or any(not isinstance(t, torch.Tensor) for t in (q, k, v)):
        return q, k, v, softmax_scale  # what llmkernels.attention accepts or names in its error
    pad = -head_dim % 16
    scale = softmax_scale if softmax_scale is not None else head_dim ** -0.5
    return F.pad(q, (0, pad)), F.pad(k, (0, pad)), F.pad(v, (0, pad)), scale


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False, *, attention_chunk=0,
                    num_splits=0, learnable_sink=None):
    """flash-attn's ``flash_attn_func``: q ``[B, Sq, Hq, D]``, k / v ``[B, Skv, Hkv, D]`` (fp16 / bf16, Hq a
    multiple of Hkv) → out ``[B, Sq, Hq, D]``; with ``return_attn_probs`` ``(out, lse [B, Hq, Sq] float32,
    None)``. ``window_size=(left, right)`` (-1: unbounded), ``softcap`` (0: off), ``alibi_slopes`` float32
    ``[Hq]``, ``attention_chunk`` (FA3; 0: off), ``num_splits`` (0: heuristic), ``learnable_sink`` ``[Hq]``
    natural-log sink logits (FA4). ``deterministic`` is accepted (the forward is deterministic).

    Raises:
        ValueError: ``dropout_p != 0``, a bad ``window_size``, and what :func:`llmkernels.attention` raises.
        NotImplementedError: ``[B, H]`` alibi slopes, softcap with ALiBi.
    """
    mask, score_mod = _modifiers(causal, window_size, softcap, alibi_slopes, attention_chunk, dropout_p)
    head_dim = q.shape[-1]
    q, k, v, softmax_scale = _pad_head_dim(q, k, v, softmax_scale)
    result = attention(q, k, v, causal=causal, mask=mask, score_mod=score_mod, sinks=_sinks(learnable_sink),
                       softmax_scale=softmax_scale, num_splits=_splits(num_splits), return_lse=return_attn_probs)
    return _results(result, return_attn_probs, True, head_dim)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None, *, seqused_k=None,
                           page_table=None, attention_chunk=0, num_splits=0, learnable_sink=None):
    """flash-attn's ``flash_attn_varlen_func``: q ``[total_q, Hq, D]``, k / v ``[total_k, Hkv, D]`` with int32
    ``cu_seqlens_q`` / ``cu_seqlens_k`` ``[B + 1]`` → out ``[total_q, Hq, D]``; with ``return_attn_probs``
    ``(out, lse [Hq, total_q], None)``. ``seqused_k`` int32 ``[B]`` (FA3): sequence b attends only its first
    ``seqused_k[b]`` keys (from row ``cu_seqlens_k[b]``; k / v are then read as pages, a copy when ``total_k``
    is not a multiple of 16). With ``block_table`` (or ``page_table``) int32 ``[B, max_pages]``, k / v are pages
    ``[num_pages, page_size, Hkv, D]`` and sequence b holds ``seqused_k[b]`` keys (default ``cu_seqlens_k[b + 1]
    - cu_seqlens_k[b]``). The other arguments as :func:`flash_attn_func`.

    Raises:
        ValueError / NotImplementedError: as :func:`flash_attn_func`; both ``block_table`` and ``page_table``.
    """
    mask, score_mod = _modifiers(causal, window_size, softcap, alibi_slopes, attention_chunk, dropout_p)
    block_table = _block_table(block_table, page_table)
    head_dim = q.shape[-1]
    q, k, v, softmax_scale = _pad_head_dim(q, k, v, softmax_scale)
    common = dict(causal=causal, mask=mask, score_mod=score_mod, sinks=_sinks(learnable_sink),
                  softmax_scale=softmax_scale, num_splits=_splits(num_splits), return_lse=return_attn_probs,
                  cu_seqlens_q=cu_seqlens_q, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)
    if block_table is None and seqused_k is None:
        result = attention(q, k, v, cu_seqlens_k=cu_seqlens_k, **common)
    elif block_table is None:  # rows cu_seqlens_k[b] .. + seqused_k[b]: one run of pages every sequence shares
        k_pages, v_pages = _rows_as_pages(k), _rows_as_pages(v)
        starts = cu_seqlens_k[:-1].to(torch.int32)
        shared = torch.arange(k_pages.shape[0], dtype=torch.int32, device=q.device)
        kv_cache = PagedKVCache(k_pages, v_pages, shared.expand(starts.shape[0], -1),
                                (starts + seqused_k).to(torch.int32), starts)
        result = attention(q, None, None, kv_cache=kv_cache, **common)
    else:
        seqlens = seqused_k if seqused_k is not None else (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).to(torch.int32)
        result = attention(q, None, None, kv_cache=PagedKVCache(k, v, block_table, seqlens), **common)
    return _results(result, return_attn_probs, True, head_dim)


def _rows_as_pages(rows: torch.Tensor) -> torch.Tensor:
    """Ragged rows ``[total, Hkv, D]`` as pages ``[total / P, P, Hkv, D]`` (a view; zero-padded copy when total is
    not a multiple of the smallest page)."""
    pages, _ = _dense_cache_pages(rows[None])
    return pages


def _dense_cache_pages(cache: torch.Tensor) -> tuple[torch.Tensor, int]:
    """A dense cache ``[B_cache, S, Hkv, D]`` seen as pages ``[B_cache * S / P, P, Hkv, D]`` (the largest
    supported page size P dividing S; a view when the strides allow, else a copy, zero-padded when S is not a
    multiple of the smallest page)."""
    seqlen = cache.shape[1]
    page_size = next((p for p in reversed(SUPPORTED_PAGE_SIZES) if seqlen % p == 0), None)
    if page_size is None:
        page_size = SUPPORTED_PAGE_SIZES[0]
        cache = F.pad(cache, (0, 0, 0, 0, 0, -seqlen % page_size))
    pages = cache.unflatten(1, (cache.shape[1] // page_size, page_size)).flatten(0, 1)
    return pages, page_size


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None,
                            softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0, return_softmax_lse=False, *,
                            page_table=None, attention_chunk=0, learnable_sink=None):
    """flash-attn's ``flash_attn_with_kvcache``: attention of q ``[B, Sq, Hq, D]`` over a KV cache, after
    appending new keys and values to it in place.

    Caches: dense ``k_cache`` / ``v_cache`` ``[B_cache, S, Hkv, D]`` (sequence b is ``cache_batch_idx[b]``,
    default b) or paged ``[num_pages, page_size, Hkv, D]`` with ``block_table`` (or ``page_table``) int32
    ``[B, max_pages]`` (page sizes 16-256, powers of two). ``cache_seqlens``: int or int32 ``[B]``, keys already
    in the cache (default: all S). ``k`` / ``v`` ``[B, S_new, Hkv, D]``: written at positions ``cache_seqlens[b]
    + i`` (positions past the cache are dropped), then attended with the cache. ``rotary_cos`` / ``rotary_sin``
    ``[seqlen_ro, rotary_dim / 2]``: the new keys are rotated at their positions and q at ``cache_seqlens[b] +
    i`` when causal or windowed, else at ``cache_seqlens[b]`` (flash-attn's rule); ``rotary_interleaved`` picks
    GPT-J (True) or GPT-NeoX pairs. ``cache_leftpad`` int32 ``[B]``: sequence b's keys start at that cache
    position (left padding; positions and rotary stay absolute, causal alignment and windows count from it).
    The other arguments as :func:`flash_attn_func`.

    Returns:
        out ``[B, Sq, Hq, D]``, or ``(out, lse [B, Hq, Sq])`` with ``return_softmax_lse``.

    Raises:
        ValueError: both ``block_table`` and ``page_table``, ``cache_batch_idx`` with a paged cache, k without
            v, rotary without new keys' partner (cos without sin), and what :func:`llmkernels.attention` raises.
        NotImplementedError: as :func:`flash_attn_func`.
    """
    mask, score_mod = _modifiers(causal, window_size, softcap, alibi_slopes, attention_chunk)
    block_table = _block_table(block_table, page_table)
    if (k is None) != (v is None):
        raise ValueError("k and v come together: pass both new keys and new values, or neither")
    if (rotary_cos is None) != (rotary_sin is None):
        raise ValueError("rotary_cos and rotary_sin come together")
    if block_table is not None and cache_batch_idx is not None:
        raise ValueError("cache_batch_idx goes with a dense cache, not with block_table")
    batch = q.shape[0]
    if cache_seqlens is None:
        cache_seqlens = k_cache.shape[1] if block_table is None else block_table.shape[1] * k_cache.shape[1]
    if not isinstance(cache_seqlens, torch.Tensor):
        cache_seqlens = torch.full((batch,), int(cache_seqlens), dtype=torch.int32, device=q.device)
    cache_seqlens = cache_seqlens.to(torch.int32)
    if k is not None:
        append_to_cache(k, k_cache, cache_seqlens, cos=rotary_cos, sin=rotary_sin, interleaved=rotary_interleaved,
                        cache_batch_idx=cache_batch_idx, block_table=block_table)
        append_to_cache(v, v_cache, cache_seqlens, cache_batch_idx=cache_batch_idx, block_table=block_table)
        seqlens = cache_seqlens + k.shape[1]
    else:
        seqlens = cache_seqlens
    if rotary_cos is not None:
        local = any(int(side) >= 0 for side in window_size)
        q = apply_rotary(q, rotary_cos, rotary_sin, cache_seqlens, rotary_interleaved, per_token=causal or local)
    if block_table is None:
        k_pages, page_size = _dense_cache_pages(k_cache)
        v_pages, _ = _dense_cache_pages(v_cache)
        pages_per_sequence = k_pages.shape[0] // k_cache.shape[0]
        sequences = (cache_batch_idx.to(torch.int32) if cache_batch_idx is not None
                     else torch.arange(batch, dtype=torch.int32, device=q.device))
        block_table = (sequences[:, None] * pages_per_sequence
                       + torch.arange(pages_per_sequence, dtype=torch.int32, device=q.device)[None, :])
    else:
        k_pages, v_pages = k_cache, v_cache
    starts = cache_leftpad.to(torch.int32) if cache_leftpad is not None else None
    kv_cache = PagedKVCache(k_pages, v_pages, block_table, seqlens.to(torch.int32), starts)
    result = attention(q, None, None, kv_cache=kv_cache,
                       causal=causal, mask=mask, score_mod=score_mod, sinks=_sinks(learnable_sink),
                       softmax_scale=softmax_scale, num_splits=_splits(num_splits), return_lse=return_softmax_lse)
    return _results(result, return_softmax_lse, False)
