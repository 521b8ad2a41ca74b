"""The attention peers every benchmark runs beside llmkernels, written once: PyTorch's SDPA with a chosen
backend (flash, cuDNN) and FlexAttention. Inputs in SDPA's layout ``[B, H, S, D]``; each function returns a
zero-argument callable that runs the peer (what the timers take)."""
from __future__ import annotations

import torch

_COMPILED_FLEX = {}


def sdpa_backend(name: str):
    """``"flash"``, ``"cudnn"``, ``"efficient"`` or ``"math"`` → the ``SDPBackend``."""
    from torch.nn.attention import SDPBackend

    return {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}[name]


def sdpa_runner(backend: str, q, k, v, *, causal: bool = False, attn_mask=None):
    """SDPA under one backend (GQA when k has fewer heads than q); ``attn_mask`` bool ``[Sq, Skv]``."""
    from torch.nn.attention import sdpa_kernel

    chosen = sdpa_backend(backend)
    enable_gqa = q.shape[1] != k.shape[1]

    def run():
        with sdpa_kernel(chosen):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=causal,
                                                                    enable_gqa=enable_gqa)
    return run


def causal_mask_mod(q_len: int, kv_len: int):
    """FlexAttention ``mask_mod`` of bottom-right aligned causal attention (query i sees keys
    ``j <= i + kv_len - q_len``)."""
    offset = kv_len - q_len
    return lambda b, h, q_idx, kv_idx: kv_idx <= q_idx + offset


def flex_runner(q, k, v, mask_mod=None):
    """FlexAttention, compiled once per process (one graph per shape: the recompile limits are raised so
    that a sweep never falls back to the unfused eager path), with the block mask of ``mask_mod``."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if "fn" not in _COMPILED_FLEX:
        torch._dynamo.config.recompile_limit = 64
        torch._dynamo.config.accumulated_recompile_limit = 1024
        _COMPILED_FLEX["fn"] = torch.compile(flex_attention, dynamic=False)
    block_mask = None
    if mask_mod is not None:
        block_mask = create_block_mask(mask_mod, None, None, q.shape[2], k.shape[2], device=q.device)
    enable_gqa = q.shape[1] != k.shape[1]
    return lambda: _COMPILED_FLEX["fn"](q, k, v, block_mask=block_mask, enable_gqa=enable_gqa)
