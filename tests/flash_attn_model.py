"""A model of flash-attn's forward semantics in PyTorch, shared by the flash-attn API tests
(``test_flash_attn_api.py``, ``test_flash_attn_kvcache.py``, ``test_flash_attn_upstream.py``). Written from the
definitions (flash-attn's docstrings), never with llmkernels' functions."""

import math

import torch

from llmkernels.runtime import interpreting


def flash_attn_model(
    q, k, v, causal, window, softcap, alibi_slopes, query_keep=None, key_keep=None, exact=True, sinks=None, chunk=0
):
    """Attention of q ``[B, Sq, Hq, D]`` over k, v ``[B, Sk, Hkv, D]`` as flash-attn defines it (bottom-right
    aligned causal and window, ALiBi ``-slope·|i + Sk - Sq - j|``, tanh softcap), per sequence over its kept keys
    and queries (``*_keep`` bool ``[B, S]``; sequence lengths then count kept positions only). ``sinks`` ``[Hq]``:
    natural-log logits that join each row's softmax denominator only (FA4's learnable_sink). ``chunk`` > 0: FA3's
    attention_chunk, a query (at its aligned position) sees only keys of its chunk, ``pos // chunk == j //
    chunk``. ``exact``: float64; else in the inputs' dtype with a float32 softmax, as a PyTorch user would write
    it. Rows past the kept queries are 0."""
    dtype = torch.float64 if exact else q.dtype
    batch, seqlen_q, heads, dim = q.shape
    group = heads // k.shape[2]
    out = torch.zeros(q.shape, dtype=dtype, device=q.device)
    for b in range(batch):
        qi = torch.arange(seqlen_q, device=q.device) if query_keep is None else query_keep[b].nonzero()[:, 0]
        kj = torch.arange(k.shape[1], device=q.device) if key_keep is None else key_keep[b].nonzero()[:, 0]
        if qi.numel() == 0:
            continue
        qb = q[b, qi].to(dtype)
        kb = k[b, kj].to(dtype).repeat_interleave(group, 1)
        vb = v[b, kj].to(dtype).repeat_interleave(group, 1)
        scores = (
            torch.einsum("qhd,khd->hqk", qb / math.sqrt(dim), kb).float()
            if not exact
            else torch.einsum("qhd,khd->hqk", qb, kb) / math.sqrt(dim)
        )
        if softcap > 0:
            scores = softcap * torch.tanh(scores / softcap)
        rows = torch.arange(qi.numel(), device=q.device)[:, None] + kj.numel() - qi.numel()
        cols = torch.arange(kj.numel(), device=q.device)[None, :]
        if alibi_slopes is not None:
            scores = scores - alibi_slopes.to(scores.dtype)[:, None, None] * (rows - cols).abs()
        visible = torch.ones(qi.numel(), kj.numel(), dtype=torch.bool, device=q.device)
        if causal:
            visible &= cols <= rows
        if window[0] >= 0:
            visible &= cols >= rows - window[0]
        if window[1] >= 0:
            visible &= cols <= rows + window[1]
        if chunk > 0:
            visible &= (rows >= 0) & (torch.div(rows, chunk, rounding_mode="floor") == cols // chunk)
        scores = scores.masked_fill(~visible, float("-inf"))
        if sinks is not None:  # one more column per row, dropped after the softmax
            sink_column = sinks.to(scores.dtype)[:, None, None].expand(-1, qi.numel(), 1)
            weights = torch.softmax(torch.cat([scores, sink_column], -1), -1)[..., :-1]
        else:
            weights = torch.softmax(scores, -1).nan_to_num(0.0)
        out[b, qi] = torch.einsum("hqk,khd->qhd", weights.to(dtype), vb)
    return out


def rotary_model(x, cos, sin, positions, interleaved, dtype=torch.float64):
    """flash-attn's ``apply_rotary_emb`` of x ``[B, S, H, D]`` at integer positions ``[B, S]`` (clamped to the
    table's rows): the first ``rotary_dim = 2 * cos.shape[1]`` features rotate in pairs, ``(x[2j], x[2j + 1])``
    when interleaved (GPT-J), ``(x[j], x[j + rotary_dim / 2])`` otherwise (GPT-NeoX), by angle j: ``(x1 cos -
    x2 sin, x1 sin + x2 cos)``; the rest pass through. Computed in ``dtype`` (float32: the formula's two products
    and one sum, each rounded to float32, as a float32 implementation without fused multiply-adds does)."""
    half = cos.shape[1]
    rows = positions.clamp(0, cos.shape[0] - 1)
    c = cos.to(dtype)[rows][:, :, None, :]
    s = sin.to(dtype)[rows][:, :, None, :]
    x = x.to(dtype)
    rot, rest = x[..., : 2 * half], x[..., 2 * half :]
    x1, x2 = (rot[..., 0::2], rot[..., 1::2]) if interleaved else (rot[..., :half], rot[..., half:])
    first, second = x1 * c - x2 * s, x2 * c + x1 * s
    rotated = torch.stack([first, second], -1).flatten(-2) if interleaved else torch.cat([first, second], -1)
    return torch.cat([rotated, rest], -1)


def kvcache_model(
    q,
    k_cache,
    v_cache,
    k,
    v,
    cache_seqlens,
    *,
    cos=None,
    sin=None,
    interleaved=True,
    causal=False,
    window=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    sinks=None,
    chunk=0,
    leftpad=None,
):
    """flash-attn's ``flash_attn_with_kvcache`` on logical caches ``[B, capacity, Hkv, D]`` (sequence b's rows,
    whatever the physical layout): token i of k / v written at position ``cache_seqlens[b] + i`` when that is
    below the capacity (k rotated there, in float32, rounded once to the cache's dtype), q rotated at
    ``cache_seqlens[b] + i`` when causal or windowed, else at ``cache_seqlens[b]`` (rounded to q's dtype), then
    float64 attention over keys ``leftpad[b] .. min(cache_seqlens[b] + S_new, capacity) - 1``.

    Returns ``(out float64, k_cache after, v_cache after)`` (the caches in their dtype)."""
    batch, capacity = k_cache.shape[:2]
    seqlens = [int(n) for n in cache_seqlens]
    new_tokens = 0 if k is None else k.shape[1]
    k_after, v_after = k_cache.clone(), v_cache.clone()
    if k is not None:
        positions = torch.tensor(seqlens, device=q.device)[:, None] + torch.arange(new_tokens, device=q.device)
        k_rows = k if cos is None else rotary_model(k, cos, sin, positions, interleaved, torch.float32)
        for b in range(batch):
            for i in range(new_tokens):
                if seqlens[b] + i < capacity:
                    k_after[b, seqlens[b] + i] = k_rows[b, i].to(k_cache.dtype)
                    v_after[b, seqlens[b] + i] = v[b, i]
    if cos is not None:
        per_token = causal or any(side >= 0 for side in window)
        steps = (
            torch.arange(q.shape[1], device=q.device)
            if per_token
            else torch.zeros(q.shape[1], dtype=torch.long, device=q.device)
        )
        q = rotary_model(
            q, cos, sin, torch.tensor(seqlens, device=q.device)[:, None] + steps[None, :], interleaved, torch.float32
        ).to(q.dtype)
    ends = torch.tensor([min(n + new_tokens, capacity) for n in seqlens], device=q.device)[:, None]
    starts = torch.zeros_like(ends) if leftpad is None else torch.as_tensor(leftpad, device=q.device).reshape(-1, 1)
    key = torch.arange(capacity, device=q.device)[None, :]
    out = flash_attn_model(
        q,
        k_after,
        v_after,
        causal,
        window,
        softcap,
        alibi_slopes,
        key_keep=(key >= starts) & (key < ends),
        sinks=sinks,
        chunk=chunk,
    )
    return out, k_after, v_after


def assert_cache_after(actual, expected, what="cache"):
    """A cache after an append against :func:`kvcache_model`'s: rows the append did not write keep their bits;
    written rows are the float32 rotation rounded once (bit for bit in the interpreter; a GPU compiler may fuse
    the rotation's multiply-add: at most one ulp of the cache's dtype there)."""
    if interpreting():
        assert torch.equal(actual, expected), f"{what}: {(actual != expected).sum().item()} elements differ"
    else:
        ulp = expected.float().abs().clamp_min(torch.finfo(expected.dtype).tiny) * torch.finfo(expected.dtype).eps
        assert ((actual.float() - expected.float()).abs() <= ulp).all(), what
