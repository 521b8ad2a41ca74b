"""Plain-PyTorch float32 reference for :func:`llmkernels.attention` (every layout, mask and modifier).

Slow and simple on purpose: one sequence at a time, the full score matrix, ``torch.logsumexp``.
"""

from __future__ import annotations

import math

import torch

from .masks import (
    SCORE_MOD_ALIBI,
    SCORE_MOD_SOFTCAP,
    UNBOUNDED,
    Chunked,
    ScoreMod,
    SlidingWindow,
    is_jit_function,
    mask_tensor_4d,
    resolve_mask,
    resolve_score_mod,
    split_mask_tensor,
)
from .paged import PagedKVCache

__all__ = ["attention_reference", "paged_to_dense"]


def _as_torch_fn(fn):
    """A user mask_mod / score_mod for torch tensors: plain callables as they are, a ``@triton.jit``
    function through its Python body (works when the body only uses operators, not ``tl.*`` calls)."""
    if is_jit_function(fn):
        return fn.fn
    return fn


def _split_mask(mask):
    """(jit-free part for resolve_mask, user torch mask fn or None)."""
    parts = () if mask is None else (tuple(mask) if isinstance(mask, (tuple, list)) else (mask,))
    builtin, user = [], None
    for part in parts:
        if isinstance(part, (SlidingWindow, Chunked)):
            builtin.append(part)
        elif callable(part):
            user = _as_torch_fn(part)
        else:
            raise TypeError(f"mask: unsupported {type(part).__name__}")
    return tuple(builtin), user


def paged_to_dense(kv_cache: PagedKVCache, batch: int, length: int, start: int = 0):
    """Keys and values of cache positions ``start .. length - 1`` of sequence ``batch``, read as the kernels
    read them: page ids clamped to ``[0, num_pages - 1]``."""
    pages_needed = -(-length // kv_cache.page_size)
    page_ids = kv_cache.block_table[batch, :pages_needed].long().clamp(0, kv_cache.num_pages - 1)
    k = kv_cache.k_pages[page_ids].reshape(-1, kv_cache.num_kv_heads, kv_cache.head_dim)[start:length]
    v = kv_cache.v_pages[page_ids].reshape(-1, kv_cache.num_kv_heads, kv_cache.head_dim)[start:length]
    return k, v


def attention_reference(
    q,
    k,
    v,
    *,
    causal=False,
    mask=None,
    score_mod=None,
    sinks=None,
    softmax_scale=None,
    cu_seqlens_q=None,
    cu_seqlens_k=None,
    kv_cache=None,
    return_lse=False,
    q_descale=None,
    k_descale=None,
    v_descale=None,
    **_ignored,
):
    """Same arguments and conventions as :func:`llmkernels.attention`; returns float32 ``out`` (q's shape)
    and, with ``return_lse``, the float32 (float64: see FP8 below) natural-log LSE ``[B, Hq, Sq]`` (ragged ``[Hq, total_q]``).

    ``mask`` / ``score_mod`` may also be plain Python callables on torch tensors (``b`` an int, ``h``
    ``[Hq, 1, 1]``, ``q_idx`` ``[1, Sq, 1]``, ``kv_idx`` ``[1, 1, Skv]``); a ``@triton.jit`` function is
    called through its Python body. Extra keyword arguments of :func:`attention` (``num_splits``,
    ``config``, ``max_seqlen_*``) are accepted and ignored. Reads lengths on the host (it syncs).

    FP8: float8_e4m3fn q / k / v (or pages) and float32 ``q_descale`` / ``k_descale`` / ``v_descale`` ``[B, Hkv]``
    (size-1 dims broadcast) are read as ``x.double() * descale[b, kv head]``, and such a call (and one with float64
    inputs) computes and returns float64.
    """
    mask, attn_mask = split_mask_tensor(mask)
    builtin_mask, user_mask = _split_mask(mask)
    spec = resolve_mask(causal, builtin_mask if builtin_mask else None)
    user_score = None
    if score_mod is not None and not isinstance(score_mod, ScoreMod):
        user_score = _as_torch_fn(score_mod)
        mod = None
    else:
        mod = resolve_score_mod(score_mod)
    ragged = cu_seqlens_q is not None
    head_dim = q.shape[-1]
    scale = 1.0 / math.sqrt(head_dim) if softmax_scale is None else softmax_scale
    num_q_heads = q.shape[-2]
    if ragged:
        starts_q = cu_seqlens_q.tolist()
        batch = len(starts_q) - 1
    else:
        batch = q.shape[0]
    if kv_cache is None and ragged:
        starts_k = cu_seqlens_k.tolist()
    seqlens_cache = kv_cache.seqlens.clamp(0, kv_cache.max_seqlen_bound).tolist() if kv_cache is not None else None
    starts_cache = kv_cache.starts.tolist() if kv_cache is not None and kv_cache.starts is not None else [0] * batch

    kv_dtype = kv_cache.dtype if kv_cache is not None else k.dtype
    fp8 = torch.float8_e4m3fn in (q.dtype, kv_dtype) or any(d is not None for d in (q_descale, k_descale, v_descale))
    compute = torch.float64 if fp8 or q.dtype == torch.float64 else torch.float32
    num_kv_heads = kv_cache.num_kv_heads if kv_cache is not None else k.shape[-2]

    def per_head(descale, b):  # [Hkv] factors of sequence b (1.0 without a descale)
        if descale is None:
            return torch.ones(num_kv_heads, dtype=compute, device=q.device)
        return descale[b if descale.shape[0] > 1 else 0].to(compute).expand(num_kv_heads)

    out = torch.zeros(q.shape, dtype=compute, device=q.device)
    lse_shape = (num_q_heads, q.shape[0]) if ragged else (q.shape[0], num_q_heads, q.shape[1])
    lse = torch.full(lse_shape, float("-inf"), dtype=compute, device=q.device)
    for b in range(batch):
        qb = q[starts_q[b] : starts_q[b + 1]] if ragged else q[b]
        if kv_cache is not None:
            kb, vb = paged_to_dense(kv_cache, b, seqlens_cache[b], min(max(starts_cache[b], 0), seqlens_cache[b]))
        elif ragged:
            kb, vb = k[starts_k[b] : starts_k[b + 1]], v[starts_k[b] : starts_k[b + 1]]
        else:
            kb, vb = k[b], v[b]
        seqlen_q, seqlen_k = qb.shape[0], kb.shape[0]
        if seqlen_q == 0:
            continue
        group = num_q_heads // kb.shape[1]
        # dense copies: the matmuls' rounding must not depend on the strides of the caller's views
        q_factor, k_factor, v_factor = (per_head(d, b) for d in (q_descale, k_descale, v_descale))
        qf = (qb.to(compute) * q_factor.repeat_interleave(group)[:, None]).transpose(0, 1).contiguous()  # [Hq, Sq, D]
        kf = (kb.to(compute) * k_factor[:, None]).repeat_interleave(group, dim=1).transpose(0, 1).contiguous()
        vf = (vb.to(compute) * v_factor[:, None]).repeat_interleave(group, dim=1).transpose(0, 1).contiguous()
        scores = torch.matmul(qf, kf.transpose(1, 2)) * scale  # [Hq, Sq, Skv]
        heads = torch.arange(num_q_heads, device=q.device).view(-1, 1, 1)
        q_idx = torch.arange(seqlen_q, device=q.device).view(1, -1, 1)
        kv_idx = torch.arange(seqlen_k, device=q.device).view(1, 1, -1)
        pos = q_idx + (seqlen_k - seqlen_q)
        if user_score is not None:
            scores = user_score(scores, b, heads, q_idx, kv_idx).to(compute)
        elif mod.kind == SCORE_MOD_SOFTCAP:
            scores = mod.cap * torch.tanh(scores / mod.cap)
        elif mod.kind == SCORE_MOD_ALIBI:
            scores = scores - mod.slopes.view(-1, 1, 1) * (pos - kv_idx).abs().float()
        visible = torch.ones_like(scores, dtype=torch.bool)
        if spec.has_window:
            if spec.window_right < UNBOUNDED:
                visible &= kv_idx <= pos + spec.window_right
            if spec.window_left < UNBOUNDED:
                visible &= kv_idx >= pos - spec.window_left
        if spec.has_chunk:
            visible &= (pos >= 0) & (
                torch.div(pos, spec.chunk_size, rounding_mode="floor")
                == torch.div(kv_idx, spec.chunk_size, rounding_mode="floor")
            )
        if user_mask is not None:
            visible &= user_mask(b, heads, q_idx, kv_idx).bool()
        if attn_mask is not None:  # SDPA's attn_mask, broadcast to [B, Hq, Sq, Skv]
            full = mask_tensor_4d(attn_mask)
            mask_b = full[b if full.shape[0] > 1 else 0]
            mask_b = (
                mask_b.expand(num_q_heads, seqlen_q, full.shape[-1])[:, :, :seqlen_k]
                if full.shape[-1] > 1
                else mask_b.expand(num_q_heads, seqlen_q, seqlen_k)
            )
            if attn_mask.dtype == torch.bool:
                visible &= mask_b
            else:
                scores = scores + mask_b.to(compute)
        scores = scores.masked_fill(~visible, float("-inf"))
        logits = scores
        if sinks is not None:
            logits = torch.cat([scores, sinks.to(compute).view(-1, 1, 1).expand(-1, seqlen_q, 1)], dim=-1)
        row_lse = torch.logsumexp(logits, dim=-1)  # [Hq, Sq]
        empty = torch.isneginf(row_lse)  # fully masked rows: output 0; NaN scores propagate
        probs = torch.exp(scores - torch.where(empty, 0.0, row_lse).unsqueeze(-1))
        probs = torch.where(empty.unsqueeze(-1), 0.0, probs)
        ob = torch.matmul(probs, vf).transpose(0, 1)  # [Sq, Hq, D]
        if ragged:
            out[starts_q[b] : starts_q[b + 1]] = ob
            lse[:, starts_q[b] : starts_q[b + 1]] = row_lse
        else:
            out[b] = ob
            lse[b] = row_lse
    return (out, lse) if return_lse else out
