"""A model of flash-attn's forward semantics in PyTorch, shared by the flash-attn API tests
(``test_flash_attn_api.py``, ``test_flash_attn_upstream.py``)."""
import math

import torch


def flash_attn_model(q, k, v, causal, window, softcap, alibi_slopes, query_keep=None, key_keep=None, exact=True):
    """Attention of q ``[B, Sq, Hq, D]`` over k, v ``[B, Sk, Hkv, D]`` as flash-attn defines it (bottom-right
    aligned causal and window, ALiBi ``-slope·|i + Sk - Sq - j|``, tanh softcap), per sequence over its kept keys
    and queries (``*_keep`` bool ``[B, S]``; sequence lengths then count kept positions only). ``exact``: float64;
    else in the inputs' dtype with a float32 softmax, as a PyTorch user would write it. Rows past the kept queries
    are 0."""
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
        scores = torch.einsum("qhd,khd->hqk", qb / math.sqrt(dim), kb).float() if not exact else \
            torch.einsum("qhd,khd->hqk", qb, kb) / math.sqrt(dim)
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
        weights = torch.softmax(scores.masked_fill(~visible, float("-inf")), -1).nan_to_num(0.0)
        out[b, qi] = torch.einsum("hqk,khd->qhd", weights.to(dtype), vb)
    return out
