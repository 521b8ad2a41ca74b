"""The peers benchmarks run beside llmkernels, written once: PyTorch's SDPA with a chosen backend (flash,
cuDNN) and FlexAttention (inputs in SDPA's layout ``[B, H, S, D]``), and a Mixture-of-Experts block in plain
PyTorch ops. Each function returns a zero-argument callable or a function of the input (what the timers take)."""
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


def moe_batched_mm_runner(router_weight, w_gate_up, w_down, top_k: int):
    """A Mixture-of-Experts block in plain PyTorch ops, the way transformers' ``batched_mm`` experts run a
    decode step: softmax top-k routing (renormalized), each copy's expert weights gathered and applied with
    ``torch.bmm`` in bf16, SwiGLU, weighted sum. Weights as :meth:`MoEFeedForward.from_float` takes them
    (``[E, H]``, ``[E, 2I, H]``, ``[E, H, I]``); returns ``run(x [T, H] bf16) -> [T, H]``. Meant for a few
    tokens: it materializes every copy's weights."""
    router = router_weight.float()
    w_gate_up, w_down = w_gate_up.to(torch.bfloat16), w_down.to(torch.bfloat16)
    intermediate = w_down.shape[2]

    def run(x):
        weights, ids = torch.topk((x.float() @ router.t()).softmax(-1), top_k)
        weights = weights / weights.sum(-1, keepdim=True)
        copies = x.repeat_interleave(top_k, 0)[:, :, None]  # [T·k, H, 1]
        gate_up = torch.bmm(w_gate_up[ids.view(-1)], copies)  # [T·k, 2I, 1]
        h = torch.nn.functional.silu(gate_up[:, :intermediate]) * gate_up[:, intermediate:]
        y = torch.bmm(w_down[ids.view(-1)], h).view(x.shape[0], top_k, -1)  # [T, k, H]
        return (y.float() * weights[..., None]).sum(1).to(x.dtype)
    return run
