"""flash-attn's Python API on llmkernels' attention: replace ``from flash_attn import ...`` with
``from llmkernels.flash_attn import ...`` and nothing else changes.

:func:`flash_attn_func`, :func:`flash_attn_varlen_func` and :func:`flash_attn_with_kvcache` take flash-attn 2.8's
arguments, names, defaults, layouts and return values, plus FA3's ``attention_chunk``, ``num_splits``,
``seqused_k`` and ``page_table`` (an alias of ``block_table``) and FA4's ``learnable_sink`` (keyword-only).
Forward only: ``dropout_p > 0`` and inputs that require grad (while grad mode is on) raise. ``return_attn_probs=True``
returns ``(out, softmax_lse, None)``: the probabilities are not materialized. Head dims that are not a multiple of
16 (our kernels' unit) are zero-padded on the way in by the dense and varlen functions (a copy of q, k and v);
``flash_attn_with_kvcache`` needs a multiple of 16 (padding would copy the whole cache every call).

Every tensor argument may be any view (strided, expanded, offset): the result, and the cache after an append, have
the bits of the contiguous call. ``flash_attn_with_kvcache`` checks its whole call before it writes the cache: a
call that raises leaves every tensor as it was.

FP8 (FA3): q, k, v (or the caches) may be float8_e4m3fn, k and v with a bf16 / fp16 q or all three, with FA3's
``q_descale`` / ``k_descale`` / ``v_descale`` float32 ``[B, Hkv]`` keywords (``[1, 1]``, ``[B, 1]`` broadcast; vLLM's
per-tensor ``k_scale`` / ``v_scale`` are the ``[1, 1]`` case) that multiply the stored values; an fp8 q gives a
bf16 output. ``flash_attn_with_kvcache`` appends bf16 / fp16 ``k`` / ``v`` into an e4m3 cache as the round-to-nearest
e4m3 of ``k / k_descale`` (``v / v_descale``), saturated at ±448. Under torch.compile such calls run eagerly
(:func:`llmkernels.attention` keeps them off its custom op, which does not take descales yet).

Not yet supported, each raising ``NotImplementedError`` that names the argument: per-batch ``alibi_slopes``
``[B, H]``, softcap together with ALiBi.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .attention import Chunked, PagedKVCache, SlidingWindow, alibi
from .attention import softcap as softcap_mod
from .attention.api import check_attention
from .attention.kv_append import append_to_cache, apply_rotary, check_append_descale, check_rotary_tables
from .attention.paged import SUPPORTED_PAGE_SIZES
from .launch import PlanCache
from .ops import attention
from .runtime import check_device, first_true, forward_only, has_internal_overlap

__all__ = ["flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache"]

_INT32_MAX = 2**31 - 1


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
        if not isinstance(alibi_slopes, torch.Tensor):
            raise TypeError(f"alibi_slopes must be a float32 tensor [nheads], got {type(alibi_slopes).__name__}")
        if alibi_slopes.dim() == 2:
            raise NotImplementedError(
                f"alibi_slopes must be [nheads] for now, got shape "
                f"{tuple(alibi_slopes.shape)} (per-batch [B, H] not yet)"
            )
        if alibi_slopes.dim() != 1:
            raise ValueError(
                f"alibi_slopes must be [nheads] (or flash-attn's [B, nheads]), got shape {tuple(alibi_slopes.shape)}"
            )
        score_mod = alibi(alibi_slopes)
    mask = tuple(parts) if len(parts) > 1 else (parts[0] if parts else None)
    return mask, score_mod


def _block_table(block_table, page_table):
    """flash-attn's ``block_table`` or FA3's name for it, ``page_table``."""
    if block_table is not None and page_table is not None:
        raise ValueError("pass block_table or page_table (its FA3 name), not both")
    return block_table if block_table is not None else page_table


def _sinks(learnable_sink, q):
    """FA4's ``learnable_sink`` ``[Hq]`` (any float dtype) as the float32 sinks of ``lk.attention``."""
    if learnable_sink is None:
        return None
    if not isinstance(learnable_sink, torch.Tensor) or not learnable_sink.is_floating_point():
        raise TypeError(
            f"learnable_sink must be a float tensor [Hq], got "
            f"{getattr(learnable_sink, 'dtype', type(learnable_sink).__name__)}"
        )
    num_q_heads = q.shape[-2] if isinstance(q, torch.Tensor) and q.dim() >= 2 else None
    if learnable_sink.shape != (num_q_heads,):
        raise ValueError(f"learnable_sink must be [Hq] = [{num_q_heads}], got shape {tuple(learnable_sink.shape)}")
    return learnable_sink.float()


FP8 = torch.float8_e4m3fn


def _pad(x: torch.Tensor, pad: tuple) -> torch.Tensor:
    """``F.pad`` with zeros, also for float8_e4m3fn (padded as its bytes: byte 0 is +0.0)."""
    if x.dtype == FP8:
        return F.pad(x.view(torch.uint8), pad).view(FP8)
    return F.pad(x, pad)


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
    if any(not isinstance(t, torch.Tensor) or t.dim() < 1 for t in (q, k, v)):
        return q, k, v, softmax_scale  # what llmkernels.attention names in its error
    head_dim = q.shape[-1]
    if head_dim % 16 == 0 or head_dim > 256:
        return q, k, v, softmax_scale
    pad = -head_dim % 16
    scale = softmax_scale if softmax_scale is not None else head_dim**-0.5
    return _pad(q, (0, pad)), _pad(k, (0, pad)), _pad(v, (0, pad)), scale


def flash_attn_func(
    q,
    k,
    v,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    *,
    attention_chunk=0,
    num_splits=0,
    learnable_sink=None,
    q_descale=None,
    k_descale=None,
    v_descale=None,
):
    """flash-attn's ``flash_attn_func``: q ``[B, Sq, Hq, D]``, k / v ``[B, Skv, Hkv, D]`` (fp16 / bf16, Hq a
    multiple of Hkv) → out ``[B, Sq, Hq, D]``; with ``return_attn_probs`` ``(out, lse [B, Hq, Sq] float32,
    None)``. ``window_size=(left, right)`` (-1: unbounded), ``softcap`` (0: off), ``alibi_slopes`` float32
    ``[Hq]``, ``attention_chunk`` (FA3; 0: off), ``num_splits`` (0: heuristic), ``learnable_sink`` ``[Hq]``
    natural-log sink logits (FA4; any float dtype). ``deterministic`` is accepted (the forward is deterministic).
    FP8 (FA3): float8_e4m3fn k / v (and q) with ``q_descale`` / ``k_descale`` / ``v_descale`` float32 ``[B, Hkv]``
    (module docstring).

    Raises:
        TypeError: ``learnable_sink`` not a float tensor, ``alibi_slopes`` not a float32 tensor, and what
            :func:`llmkernels.attention` raises.
        ValueError: ``dropout_p != 0``, a bad ``window_size``, ``learnable_sink`` not ``[Hq]``, ``alibi_slopes``
            neither ``[Hq]`` nor ``[B, Hq]``, an input that requires grad (forward-only), and what
            :func:`llmkernels.attention` raises.
        NotImplementedError: ``[B, H]`` alibi slopes, softcap with ALiBi.
    """
    mask, score_mod = _modifiers(causal, window_size, softcap, alibi_slopes, attention_chunk, dropout_p)
    forward_only("flash_attn_func", q=q, k=k, v=v, learnable_sink=learnable_sink)
    sinks = _sinks(learnable_sink, q)
    head_dim = q.shape[-1] if isinstance(q, torch.Tensor) and q.dim() >= 1 else None
    q, k, v, softmax_scale = _pad_head_dim(q, k, v, softmax_scale)
    result = attention(
        q,
        k,
        v,
        causal=causal,
        mask=mask,
        score_mod=score_mod,
        sinks=sinks,
        softmax_scale=softmax_scale,
        num_splits=_splits(num_splits),
        return_lse=return_attn_probs,
        q_descale=q_descale,
        k_descale=k_descale,
        v_descale=v_descale,
    )
    return _results(result, return_attn_probs, True, head_dim)


def _check_index_vector(name: str, tensor, length: int) -> None:
    """``tensor``: an int32 tensor ``[length]`` (any strides)."""
    if not isinstance(tensor, torch.Tensor) or tensor.dtype != torch.int32:
        raise TypeError(
            f"{name} must be an int32 tensor [{length}], got {getattr(tensor, 'dtype', type(tensor).__name__)}"
        )
    if tuple(tensor.shape) != (length,):
        raise ValueError(f"{name} must be [{length}], got shape {tuple(tensor.shape)}")


def _check_varlen_metadata(cu_seqlens_q, cu_seqlens_k, seqused_k) -> None:
    """cu_seqlens_q / cu_seqlens_k int32 ``[B + 1]`` of one length, ``seqused_k`` int32 ``[B]``."""
    for name, cu_seqlens in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dtype != torch.int32:
            raise TypeError(
                f"{name} must be an int32 tensor [B + 1], got {getattr(cu_seqlens, 'dtype', type(cu_seqlens).__name__)}"
            )
        if cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 1:
            raise ValueError(f"{name} must be 1-D [B + 1], got shape {tuple(cu_seqlens.shape)}")
    batch = cu_seqlens_q.shape[0] - 1
    if cu_seqlens_k.shape[0] != batch + 1:
        raise ValueError(f"cu_seqlens_k must have {batch + 1} entries like cu_seqlens_q, got {cu_seqlens_k.shape[0]}")
    if seqused_k is not None:
        _check_index_vector("seqused_k", seqused_k, batch)


def flash_attn_varlen_func(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    block_table=None,
    *,
    seqused_k=None,
    page_table=None,
    attention_chunk=0,
    num_splits=0,
    learnable_sink=None,
    q_descale=None,
    k_descale=None,
    v_descale=None,
):
    """flash-attn's ``flash_attn_varlen_func``: q ``[total_q, Hq, D]``, k / v ``[total_k, Hkv, D]`` with int32
    ``cu_seqlens_q`` / ``cu_seqlens_k`` ``[B + 1]`` → out ``[total_q, Hq, D]``; with ``return_attn_probs``
    ``(out, lse [Hq, total_q], None)``. ``seqused_k`` int32 ``[B]`` (FA3): sequence b attends only its first
    ``seqused_k[b]`` keys (from row ``cu_seqlens_k[b]``, never past row ``total_k``; k / v are then read as
    pages, a copy when ``total_k`` is not a multiple of 16). With ``block_table`` (or ``page_table``) int32
    ``[B, max_pages]``, k / v are pages ``[num_pages, page_size, Hkv, D]`` and sequence b holds ``seqused_k[b]``
    keys (default ``cu_seqlens_k[b + 1] - cu_seqlens_k[b]``). The other arguments as :func:`flash_attn_func`, FP8
    and its descales (``[B, Hkv]``, B the sequences) included.

    Raises:
        TypeError: ``cu_seqlens_q`` / ``cu_seqlens_k`` / ``seqused_k`` not int32 tensors; as :func:`flash_attn_func`.
        ValueError: ``cu_seqlens_k`` of another length than ``cu_seqlens_q``, ``seqused_k`` not ``[B]``, both
            ``block_table`` and ``page_table``; as :func:`flash_attn_func`.
        NotImplementedError: as :func:`flash_attn_func`.
    """
    mask, score_mod = _modifiers(causal, window_size, softcap, alibi_slopes, attention_chunk, dropout_p)
    block_table = _block_table(block_table, page_table)
    _check_varlen_metadata(cu_seqlens_q, cu_seqlens_k, seqused_k)
    forward_only("flash_attn_varlen_func", q=q, k=k, v=v, learnable_sink=learnable_sink)
    sinks = _sinks(learnable_sink, q)
    head_dim = q.shape[-1] if isinstance(q, torch.Tensor) and q.dim() >= 1 else None
    q, k, v, softmax_scale = _pad_head_dim(q, k, v, softmax_scale)
    common = dict(
        causal=causal,
        mask=mask,
        score_mod=score_mod,
        sinks=sinks,
        softmax_scale=softmax_scale,
        num_splits=_splits(num_splits),
        return_lse=return_attn_probs,
        cu_seqlens_q=cu_seqlens_q,
        max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k,
        q_descale=q_descale,
        k_descale=k_descale,
        v_descale=v_descale,
    )
    if block_table is None and seqused_k is None:
        result = attention(q, k, v, cu_seqlens_k=cu_seqlens_k, **common)
    elif block_table is None:  # rows cu_seqlens_k[b] .. + seqused_k[b]: one run of pages every sequence shares
        if not isinstance(k, torch.Tensor) or k.dim() != 3 or not isinstance(v, torch.Tensor) or v.shape != k.shape:
            raise ValueError(
                f"k / v must be [total_k, Hkv, D] of one shape with seqused_k, got "
                f"{tuple(getattr(k, 'shape', ()))} / {tuple(getattr(v, 'shape', ()))}"
            )
        total_k = k.shape[0]
        k_pages, v_pages = _rows_as_pages(k), _rows_as_pages(v)
        starts = cu_seqlens_k[:-1].clamp(0, total_k)
        ends = torch.minimum(seqused_k, total_k - starts) + starts  # never into the zero rows padding k to pages
        shared = torch.arange(k_pages.shape[0], dtype=torch.int32, device=k.device)
        kv_cache = PagedKVCache(k_pages, v_pages, shared.expand(starts.shape[0], -1), ends, starts)
        result = attention(q, None, None, kv_cache=kv_cache, **common)
    else:
        seqlens = seqused_k if seqused_k is not None else cu_seqlens_k[1:] - cu_seqlens_k[:-1]
        result = attention(q, None, None, kv_cache=PagedKVCache(k, v, block_table, seqlens), **common)
    return _results(result, return_attn_probs, True, head_dim)


def _rows_as_pages(rows: torch.Tensor) -> torch.Tensor:
    """Ragged rows ``[total, Hkv, D]`` as pages ``[total / P, P, Hkv, D]`` (a view; zero-padded copy when total is
    not a multiple of the smallest page)."""
    pages, _, _ = _dense_cache_pages(rows[None])
    return pages


def _dense_cache_pages(cache: torch.Tensor) -> tuple[torch.Tensor, int, bool]:
    """A dense cache ``[B_cache, S, Hkv, D]`` seen as pages ``[B_cache * S / P, P, Hkv, D]`` (the largest
    supported page size P dividing S): ``(pages, P, copied)``, a view when the strides allow, else a copy
    (``copied``), zero-padded when S is not a multiple of the smallest page."""
    seqlen = cache.shape[1]
    page_size = next((p for p in reversed(SUPPORTED_PAGE_SIZES) if seqlen % p == 0), None)
    copied = page_size is None
    if copied:
        page_size = SUPPORTED_PAGE_SIZES[0]
        cache = _pad(cache, (0, 0, 0, 0, 0, -seqlen % page_size))
    grouped = cache.unflatten(1, (cache.shape[1] // page_size, page_size))
    shape = (grouped.shape[0] * grouped.shape[1], *grouped.shape[2:])
    try:
        return grouped.view(shape), page_size, copied
    except RuntimeError:  # sequences not evenly spaced in memory: one copy
        return grouped.reshape(shape), page_size, True


def _check_kvcache_call(
    q,
    k_cache,
    v_cache,
    k,
    v,
    rotary_cos,
    rotary_sin,
    cache_seqlens,
    cache_batch_idx,
    cache_leftpad,
    block_table,
    learnable_sink,
    alibi_slopes,
    k_descale=None,
    v_descale=None,
) -> None:
    """flash-attn's rules for the arguments of :func:`flash_attn_with_kvcache`, with their names; no launch, no
    sync. The attention call's own rules are checked next, on the final arguments (:func:`check_attention`)."""
    if not isinstance(q, torch.Tensor) or q.dtype not in (torch.float16, torch.bfloat16, FP8):
        raise TypeError(
            f"q must be a float16, bfloat16 or float8_e4m3fn tensor, got {getattr(q, 'dtype', type(q).__name__)}"
        )
    if q.dim() != 4:
        raise ValueError(f"q must be [B, Sq, Hq, D], got shape {tuple(q.shape)}")
    batch, head_dim = q.shape[0], q.shape[3]
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(cache, torch.Tensor):
            raise TypeError(f"{name} must be a tensor, got {type(cache).__name__}")
        if cache.dtype != q.dtype and cache.dtype != FP8:
            raise TypeError(f"{name} dtype {cache.dtype} != q dtype {q.dtype} (or float8_e4m3fn)")
        if cache.dim() != 4:
            raise ValueError(
                f"{name} must be [B_cache, S, Hkv, D] or pages [num_pages, page_size, Hkv, D], got "
                f"shape {tuple(cache.shape)}"
            )
    if v_cache.dtype != k_cache.dtype:
        raise TypeError(f"v_cache dtype {v_cache.dtype} != k_cache dtype {k_cache.dtype}")
    if q.dtype == FP8 and k_cache.dtype != FP8:
        raise TypeError(f"k_cache dtype {k_cache.dtype}: with a float8_e4m3fn q the caches must be float8_e4m3fn")
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache shape {tuple(v_cache.shape)} != k_cache shape {tuple(k_cache.shape)}")
    if k_cache.shape[3] != head_dim:
        raise ValueError(f"k_cache head dim {k_cache.shape[3]} != q head dim {head_dim}")
    if block_table is not None:
        if not isinstance(block_table, torch.Tensor) or block_table.dtype != torch.int32:
            raise TypeError(
                f"block_table must be an int32 tensor [B, max_pages], got "
                f"{getattr(block_table, 'dtype', type(block_table).__name__)}"
            )
        if block_table.dim() != 2 or block_table.shape[0] != batch:
            raise ValueError(f"block_table must be [B={batch}, max_pages], got shape {tuple(block_table.shape)}")
        if cache_batch_idx is not None:
            raise ValueError("cache_batch_idx goes with a dense cache, not with block_table")
        if k_cache.shape[1] not in SUPPORTED_PAGE_SIZES:
            raise ValueError(
                f"with block_table, k_cache.shape[1] is the page size: one of {SUPPORTED_PAGE_SIZES}, "
                f"got {k_cache.shape[1]}"
            )
    elif cache_batch_idx is not None:
        _check_index_vector("cache_batch_idx", cache_batch_idx, batch)
        if batch > 0 and k_cache.shape[0] == 0:
            raise ValueError("cache_batch_idx indexes k_cache, which holds no sequence (B_cache = 0)")
    elif k_cache.shape[0] < batch:
        raise ValueError(
            f"k_cache holds {k_cache.shape[0]} sequences, fewer than q's batch {batch}: pass "
            f"cache_batch_idx to pick them"
        )
    capacity = _capacity(k_cache, block_table)
    if isinstance(cache_seqlens, torch.Tensor):
        _check_index_vector("cache_seqlens", cache_seqlens, batch)
    elif cache_seqlens is not None:
        if isinstance(cache_seqlens, bool) or not isinstance(cache_seqlens, int):
            raise TypeError(f"cache_seqlens must be an int or an int32 tensor [B], got {type(cache_seqlens).__name__}")
        if not 0 <= cache_seqlens <= _INT32_MAX:
            raise ValueError(f"cache_seqlens = {cache_seqlens} not in [0, 2**31 - 1]")
    if cache_leftpad is not None:
        _check_index_vector("cache_leftpad", cache_leftpad, batch)
    if (k is None) != (v is None):
        raise ValueError("k and v come together: pass both new keys and new values, or neither")
    if k is not None:
        _check_new_tokens(k, v, k_cache, v_cache, batch, k_descale, v_descale)
    if (rotary_cos is None) != (rotary_sin is None):
        raise ValueError("rotary_cos and rotary_sin come together")
    if rotary_cos is not None:
        check_rotary_tables(rotary_cos, rotary_sin, head_dim, "rotary_cos", "rotary_sin")
        if rotary_cos.shape[0] < capacity:
            raise ValueError(
                f"rotary_cos / rotary_sin have {rotary_cos.shape[0]} rows (positions), fewer than the "
                f"cache's {capacity}"
            )
    check_device(
        q=q,
        k_cache=k_cache,
        v_cache=v_cache,
        k=k,
        v=v,
        rotary_cos=rotary_cos,
        rotary_sin=rotary_sin,
        cache_seqlens=cache_seqlens if isinstance(cache_seqlens, torch.Tensor) else None,
        cache_batch_idx=cache_batch_idx,
        cache_leftpad=cache_leftpad,
        block_table=block_table,
        learnable_sink=learnable_sink,
        alibi_slopes=alibi_slopes,
    )
    forward_only(
        "flash_attn_with_kvcache",
        q=q,
        k=k,
        v=v,
        k_cache=k_cache,
        v_cache=v_cache,
        rotary_cos=rotary_cos,
        rotary_sin=rotary_sin,
        learnable_sink=learnable_sink,
        alibi_slopes=alibi_slopes,
    )


def _check_new_tokens(k, v, k_cache, v_cache, batch: int, k_descale=None, v_descale=None) -> None:
    """k / v ``[B, S_new, Hkv, D]`` of one shape, in the caches' dtype (or fp16 / bf16 into e4m3 caches, with the
    descales the append divides by) and heads; caches writable in place."""
    for name, new, cache in (("k", k, k_cache), ("v", v, v_cache)):
        if not isinstance(new, torch.Tensor):
            raise TypeError(f"{name} must be a tensor [B, S_new, Hkv, D] or None, got {type(new).__name__}")
        check_append_descale(f"{name}_descale", None, new, cache, name, f"{name}_cache")  # the dtypes
    expected = (batch, "S_new", *k_cache.shape[2:])
    if k.dim() != 4 or k.shape[0] != batch or k.shape[2:] != k_cache.shape[2:]:
        raise ValueError(
            f"k must be [B, S_new, Hkv, D] = {list(expected)} (q's batch, the cache's heads and head "
            f"dim), got shape {tuple(k.shape)}"
        )
    if v.shape != k.shape:
        raise ValueError(f"v shape {tuple(v.shape)} != k shape {tuple(k.shape)}")
    check_append_descale("k_descale", k_descale, k, k_cache, "k", "k_cache")
    check_append_descale("v_descale", v_descale, v, v_cache, "v", "v_cache")
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if has_internal_overlap(cache):
            raise ValueError(
                f"{name} has elements that share memory (strides {cache.stride()}, e.g. an expanded "
                f"view): new keys / values cannot be written into it"
            )


def _capacity(k_cache: torch.Tensor, block_table) -> int:
    """Keys one sequence of the cache can hold: S, or ``max_pages * page_size``."""
    return k_cache.shape[1] if block_table is None else block_table.shape[1] * k_cache.shape[1]


@dataclass(frozen=True)
class _CacheCall:
    """The cache as the call reads and writes it: where the new keys go and what attention reads."""

    kv_cache: PagedKVCache  # what attention reads (the caches' pages, or a page-aligned copy of them)
    cache_seqlens: torch.Tensor  # int32 [B]: keys before the append, where the new ones go
    k_pages_copied: bool  # kv_cache's key pages are a copy of the dense k_cache: the new keys go there too
    v_pages_copied: bool  # likewise for the values


def _cache_call(
    q, k_cache, v_cache, new_tokens: int, cache_seqlens, cache_batch_idx, cache_leftpad, block_table
) -> _CacheCall:
    """Seqlens, pages and block table for attention over the cache after the append, without launching nor
    syncing. Sequence b attends its keys ``cache_leftpad[b] .. min(cache_seqlens[b] + new_tokens, capacity)``:
    never past the cache's capacity, whatever padding the page view adds."""
    batch, device = q.shape[0], q.device
    capacity = _capacity(k_cache, block_table)
    if cache_seqlens is None:
        cache_seqlens = capacity
    if not isinstance(cache_seqlens, torch.Tensor):
        cache_seqlens = torch.full((batch,), cache_seqlens, dtype=torch.int32, device=device)
    # min(cache_seqlens + new, capacity), without int32 overflow
    seqlens = torch.clamp(cache_seqlens, max=capacity - new_tokens) + new_tokens
    if block_table is not None:
        return _CacheCall(
            PagedKVCache(k_cache, v_cache, block_table, seqlens, cache_leftpad), cache_seqlens, False, False
        )
    k_pages, _, k_copied = _dense_cache_pages(k_cache)
    v_pages, _, v_copied = _dense_cache_pages(v_cache)
    pages_per_sequence = k_pages.shape[0] // max(k_cache.shape[0], 1)
    sequences = (
        cache_batch_idx.clamp(0, max(k_cache.shape[0] - 1, 0))
        if cache_batch_idx is not None
        else torch.arange(batch, dtype=torch.int32, device=device)
    )
    dense_table = (
        sequences[:, None] * pages_per_sequence
        + torch.arange(pages_per_sequence, dtype=torch.int32, device=device)[None, :]
    )
    return _CacheCall(
        PagedKVCache(k_pages, v_pages, dense_table, seqlens, cache_leftpad), cache_seqlens, k_copied, v_copied
    )


def _validate_kvcache_on_host(
    cache: _CacheCall, new_tokens: int, k_cache, cache_batch_idx, cache_leftpad, block_table
) -> None:
    """``validate=True``: the values a wrong entry of which would write where it should not or read another
    sequence's keys, read on the host (one sync) before anything is written; raises ``ValueError`` naming the
    argument and its first bad index."""
    capacity = _capacity(k_cache, block_table)
    seqlens = cache.cache_seqlens.cpu().long()
    first = first_true((seqlens < 0) | (seqlens > capacity))
    if first is not None:
        raise ValueError(
            f"cache_seqlens[{first[0]}] = {int(seqlens[first[0]])} not in [0, {capacity}] (the cache's capacity)"
        )
    ends = torch.clamp(seqlens + new_tokens, max=capacity)
    if cache_leftpad is not None:
        leftpad = cache_leftpad.cpu().long()
        first = first_true((leftpad < 0) | (leftpad > ends))
        if first is not None:
            b = first[0]
            raise ValueError(
                f"cache_leftpad[{b}] = {int(leftpad[b])} not in [0, {int(ends[b])}] (the keys of sequence {b})"
            )
    if block_table is None:
        if cache_batch_idx is not None:
            _validate_cache_batch_idx(cache_batch_idx.cpu().tolist(), k_cache.shape[0], appends=new_tokens > 0)
        return
    table, page_size, num_pages = block_table.cpu().long(), k_cache.shape[1], k_cache.shape[0]
    used = torch.arange(table.shape[1])[None, :] < ((ends + page_size - 1) // page_size)[:, None]
    first = first_true(used & ((table < 0) | (table >= num_pages)))
    if first is not None:
        b, i = first
        raise ValueError(f"block_table[{b}, {i}] = {int(table[b, i])} not in [0, num_pages={num_pages})")
    if new_tokens == 0 or capacity == 0:
        return
    positions = seqlens[:, None] + torch.arange(new_tokens)[None, :]
    written = positions < capacity
    slots = table.gather(1, (positions // page_size).clamp(max=table.shape[1] - 1))
    slots = (slots * page_size + positions % page_size)[written]
    values, counts = slots.unique(return_counts=True)
    if (counts > 1).any():
        slot = int(values[counts > 1][0])
        raise ValueError(
            f"block_table sends two new tokens to page {slot // page_size}, slot {slot % page_size}: "
            f"the pages two sequences append into must differ"
        )


def _validate_cache_batch_idx(idx: list[int], cache_sequences: int, appends: bool) -> None:
    first_seen = {}
    for b, sequence in enumerate(idx):
        if not 0 <= sequence < cache_sequences:
            raise ValueError(f"cache_batch_idx[{b}] = {sequence} not in [0, B_cache={cache_sequences})")
        if appends and sequence in first_seen:
            raise ValueError(
                f"cache_batch_idx[{b}] = {sequence} repeats cache_batch_idx[{first_seen[sequence]}]: "
                f"two sequences would append into one cache sequence"
            )
        first_seen.setdefault(sequence, b)


_CHECKED = PlanCache("flash_attn_with_kvcache")  # call signatures whose checks passed


def flash_attn_with_kvcache(
    q,
    k_cache,
    v_cache,
    k=None,
    v=None,
    rotary_cos=None,
    rotary_sin=None,
    cache_seqlens=None,
    cache_batch_idx=None,
    cache_leftpad=None,
    block_table=None,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    rotary_interleaved=True,
    alibi_slopes=None,
    num_splits=0,
    return_softmax_lse=False,
    *,
    page_table=None,
    attention_chunk=0,
    learnable_sink=None,
    validate=False,
    q_descale=None,
    k_descale=None,
    v_descale=None,
):
    """flash-attn's ``flash_attn_with_kvcache``: attention of q ``[B, Sq, Hq, D]`` (fp16 / bf16, D a multiple of
    16 up to 256) over a KV cache, after appending new keys and values to it in place.

    Caches: dense ``k_cache`` / ``v_cache`` ``[B_cache, S, Hkv, D]`` in q's dtype (sequence b is
    ``cache_batch_idx[b]``, int32 ``[B]``, default b, then ``B_cache >= B``) or paged ``[num_pages, page_size,
    Hkv, D]`` with ``block_table`` (or ``page_table``) int32 ``[B, max_pages]`` (page sizes 16-256, powers of
    two). The capacity of a sequence is S, or ``max_pages * page_size``. ``cache_seqlens``: int or int32 ``[B]``,
    keys already in the cache (default: the capacity). ``k`` / ``v`` ``[B, S_new, Hkv, D]`` in the caches' dtype:
    token i of sequence b written at position ``cache_seqlens[b] + i`` (positions past the capacity are
    dropped), then sequence b attends its first ``min(cache_seqlens[b] + S_new, capacity)`` keys (a dense S that
    is not a multiple of 16 is read from a page-aligned copy; its padding is never attended). ``rotary_cos`` /
    ``rotary_sin`` ``[seqlen_ro, rotary_dim / 2]`` (one shape, float16 / bfloat16 / float32, ``rotary_dim <=
    D``, ``seqlen_ro >=`` the capacity): the new keys are rotated at their positions and q at
    ``cache_seqlens[b] + i`` when causal or windowed, else at ``cache_seqlens[b]`` (flash-attn's rule;
    positions past ``seqlen_ro`` read its last row); also without new keys (q alone is rotated).
    ``rotary_interleaved`` picks GPT-J (True) or GPT-NeoX pairs. ``cache_leftpad`` int32 ``[B]``: sequence b's
    keys start at that cache position (left padding; positions and rotary stay absolute, causal alignment and
    windows count from it). The other arguments as :func:`flash_attn_func`.

    FP8 (FA3): e4m3 caches (and q) with ``q_descale`` / ``k_descale`` / ``v_descale`` float32 ``[B, Hkv]`` that
    multiply the stored values; new bf16 / fp16 ``k`` / ``v`` are stored as the round-to-nearest-even e4m3 of
    ``k / k_descale`` / ``v / v_descale`` (after the rotary; IEEE division), saturated at ±448, NaN kept; new e4m3
    ``k`` / ``v`` are already in the cache's scale and are copied (rotated and rounded with the rotary).

    Every argument is checked before the cache is written: a call that raises changes no tensor; the checks run
    once per call signature (shapes, dtypes, strides, devices, flags and scalar values). No host sync
    (CUDA-graph capturable) unless ``validate``. Values are not read on the host; what bad ones do:
    ``cache_batch_idx`` and ``block_table`` entries are clamped to the cache (a write or read lands in some
    sequence / page of this cache, never outside it); two new tokens sent to one cache row (a repeated
    ``cache_batch_idx`` entry, or pages shared by the positions two sequences append at) leave one of them there,
    which one unspecified; ``cache_seqlens[b]`` past the capacity appends nothing and attends the capacity.

    Args:
        validate: keyword-only. First read ``cache_seqlens``, ``cache_leftpad``, ``cache_batch_idx`` and
            ``block_table`` on the host (one sync, not capturable) and raise ``ValueError`` naming the argument
            and its first bad index: ``cache_seqlens[b]`` outside ``[0, capacity]``, ``cache_leftpad[b]`` outside
            the sequence's keys, a ``cache_batch_idx`` entry outside ``[0, B_cache)`` or (with new keys) repeated,
            a used ``block_table`` entry outside ``[0, num_pages)`` or two new tokens sent to one page slot.

    Returns:
        out ``[B, Sq, Hq, D]``, or ``(out, lse [B, Hq, Sq])`` with ``return_softmax_lse``.

    Raises:
        TypeError: q not fp16 / bf16 / e4m3; caches neither q's dtype nor e4m3 (an e4m3 q: e4m3 caches); k / v neither
            their cache's dtype nor fp16 / bf16 into an e4m3 cache; descales not float32; cache_seqlens,
            cache_batch_idx, cache_leftpad, block_table not int32 (cache_seqlens: or an int); rotary tables not
            float16 / bfloat16 / float32; learnable_sink not a float tensor; as :func:`llmkernels.attention`.
        ValueError: a shape that disagrees (caches, k / v against the cache and q's batch, metadata lengths,
            rotary tables, learnable_sink), Hq not a multiple of Hkv, an unsupported head dim or page size, a
            dense cache with fewer sequences than q's batch and no cache_batch_idx, a cache whose elements
            overlap (expanded) given new keys, both ``block_table`` and ``page_table``, ``cache_batch_idx`` with
            ``block_table``, k without v, cos without sin, tensors on different devices, an input that requires
            grad (forward-only), and with ``validate`` the bad values above.
        NotImplementedError: as :func:`flash_attn_func`.
    """
    mask, score_mod = _modifiers(causal, window_size, softcap, alibi_slopes, attention_chunk)
    block_table = _block_table(block_table, page_table)
    # the checks below pass or fail alike for every call of one signature: once per signature
    key, checked = None, None
    if not torch.compiler.is_compiling():
        key, checked = _CHECKED.lookup(
            q,
            k_cache,
            v_cache,
            k,
            v,
            rotary_cos,
            rotary_sin,
            cache_seqlens,
            cache_batch_idx,
            cache_leftpad,
            block_table,
            softmax_scale,
            causal,
            window_size,
            softcap,
            rotary_interleaved,
            alibi_slopes,
            num_splits,
            return_softmax_lse,
            attention_chunk,
            learnable_sink,
            validate,
            q_descale,
            k_descale,
            v_descale,
        )
    if checked is None:
        _check_kvcache_call(
            q,
            k_cache,
            v_cache,
            k,
            v,
            rotary_cos,
            rotary_sin,
            cache_seqlens,
            cache_batch_idx,
            cache_leftpad,
            block_table,
            learnable_sink,
            alibi_slopes,
            k_descale,
            v_descale,
        )
    sinks, num_splits = _sinks(learnable_sink, q), _splits(num_splits)
    new_tokens = k.shape[1] if k is not None else 0
    cache = _cache_call(q, k_cache, v_cache, new_tokens, cache_seqlens, cache_batch_idx, cache_leftpad, block_table)
    if checked is None:
        # the attention call's own checks, on its final arguments, before the first write (q: the caller's, which
        # the rotated copy matches in all that is checked)
        check_attention(
            q,
            None,
            None,
            causal,
            mask,
            score_mod,
            sinks,
            softmax_scale,
            None,
            None,
            None,
            None,
            cache.kv_cache,
            num_splits,
            return_softmax_lse,
            None,
            validate,
            q_descale,
            k_descale,
            v_descale,
        )
        _CHECKED.put(key, True)
    if validate:
        _validate_kvcache_on_host(cache, new_tokens, k_cache, cache_batch_idx, cache_leftpad, block_table)
    if k is not None:
        rotary = dict(cos=rotary_cos, sin=rotary_sin, interleaved=rotary_interleaved)
        where = dict(cache_batch_idx=cache_batch_idx, block_table=block_table)
        append_to_cache(k, k_cache, cache.cache_seqlens, descale=k_descale, **rotary, **where)
        append_to_cache(v, v_cache, cache.cache_seqlens, descale=v_descale, **where)
        # the page-aligned copies attention reads get them too
        paged = dict(block_table=cache.kv_cache.block_table)
        if cache.k_pages_copied:
            append_to_cache(k, cache.kv_cache.k_pages, cache.cache_seqlens, descale=k_descale, **rotary, **paged)
        if cache.v_pages_copied:
            append_to_cache(v, cache.kv_cache.v_pages, cache.cache_seqlens, descale=v_descale, **paged)
    if rotary_cos is not None:
        local = any(int(side) >= 0 for side in window_size)
        q = apply_rotary(q, rotary_cos, rotary_sin, cache.cache_seqlens, rotary_interleaved, per_token=causal or local)
    result = attention(
        q,
        None,
        None,
        kv_cache=cache.kv_cache,
        causal=causal,
        mask=mask,
        score_mod=score_mod,
        sinks=sinks,
        softmax_scale=softmax_scale,
        num_splits=num_splits,
        return_lse=return_softmax_lse,
        validate=validate,
        q_descale=q_descale,
        k_descale=k_descale,
        v_descale=v_descale,
    )
    return _results(result, return_softmax_lse, False)
