"""vLLM's ``fused_experts`` call shape on our grouped matmuls: a drop-in for code written against
``vllm.model_executor.layers.fused_moe.fused_experts``, with quantized weights as ScaledTensors."""
from __future__ import annotations

import torch

from ..formats import ScaledTensor
from ..grouped_matmul import GPT_OSS_SWIGLU, SwiGLU
from ..ops import combine, dispatch, grouped_matmul, quantize

__all__ = ["fused_experts"]

# vLLM's activation names -> our fused gated epilogues ("swigluoai": gpt-oss', on interleaved w1 rows)
_ACTIVATIONS = {"silu": SwiGLU(), "swigluoai": GPT_OSS_SWIGLU}


def _epilogue(activation) -> SwiGLU:
    if isinstance(activation, SwiGLU):
        return activation
    if isinstance(activation, str) and activation in _ACTIVATIONS:
        return _ACTIVATIONS[activation]
    raise NotImplementedError(f"activation={activation!r}: supported {sorted(_ACTIVATIONS)} or a SwiGLU")


def _check(hidden_states, w1, w2, topk_weights, topk_ids, expert_map, w1_bias, w2_bias):
    if not isinstance(hidden_states, torch.Tensor) or hidden_states.dim() != 2 or not hidden_states.is_floating_point():
        raise TypeError(f"hidden_states must be a floating [T, K] tensor, got "
                        f"{getattr(hidden_states, 'shape', type(hidden_states).__name__)}")
    for name, weight in (("w1", w1), ("w2", w2)):
        if not isinstance(weight, (torch.Tensor, ScaledTensor)) or len(weight.shape) != 3:
            raise TypeError(f"{name} must be a bf16 tensor or a ScaledTensor of 3 dims, got "
                            f"{type(weight).__name__} {tuple(getattr(weight, 'shape', ()))}")
    num_experts, two_n, k = w1.shape
    if hidden_states.shape[1] != k or two_n % 2 or tuple(w2.shape) != (num_experts, k, two_n // 2):
        raise ValueError(f"hidden_states [T, K={hidden_states.shape[1]}], w1 [E, 2N, K] and w2 [E, K, N] do not fit: "
                         f"w1 {tuple(w1.shape)}, w2 {tuple(w2.shape)}")
    if not isinstance(topk_ids, torch.Tensor) or topk_ids.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"topk_ids must be an int32/int64 [T, top_k] tensor, got {getattr(topk_ids, 'dtype', None)}")
    if not isinstance(topk_weights, torch.Tensor) or not topk_weights.is_floating_point():
        raise TypeError("topk_weights must be a floating [T, top_k] tensor")
    if topk_ids.dim() != 2 or topk_weights.shape != topk_ids.shape or topk_ids.shape[0] != hidden_states.shape[0]:
        raise ValueError(f"topk_weights and topk_ids must both be [T={hidden_states.shape[0]}, top_k], got "
                         f"{tuple(topk_weights.shape)} and {tuple(topk_ids.shape)}")
    for name, bias, rows in (("w1_bias", w1_bias, two_n), ("w2_bias", w2_bias, k)):
        if bias is not None and not isinstance(bias, torch.Tensor):
            raise TypeError(f"{name} must be a [E, {rows}] tensor or None, got {type(bias).__name__}")
        if bias is not None and tuple(bias.shape) != (num_experts, rows):
            raise ValueError(f"{name} must be a [E, {rows}] tensor, got {tuple(bias.shape)}")
    if expert_map is not None and (not isinstance(expert_map, torch.Tensor) or expert_map.dim() != 1
                                   or expert_map.dtype not in (torch.int32, torch.int64)):
        raise TypeError("expert_map must be an int32/int64 [global_num_experts] tensor (-1: not on this rank)")


def fused_experts(hidden_states: torch.Tensor, w1, w2, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                  inplace: bool = False, activation: str = "silu", apply_router_weight_on_input: bool = False,
                  global_num_experts: int = -1, expert_map: torch.Tensor | None = None, *,
                  w1_bias: torch.Tensor | None = None, w2_bias: torch.Tensor | None = None,
                  activation_format: str = "bf16") -> torch.Tensor:
    """``out[t] = Σ_j topk_weights[t, j] · (w2[e] act(w1[e] x_t + b1[e]) + b2[e])``, ``e = topk_ids[t, j]``, with
    ``act`` the gated activation of w1's gate and up rows (``silu(gate) · up`` for ``"silu"``).

    Args:
        hidden_states: bf16/fp16/fp32 ``[T, K]`` (any strides).
        w1: ``[E, 2N, K]``, gate rows first (vLLM's ``w13``; interleaved gate, up, gate, ... for
            ``"swigluoai"``); w2: ``[E, K, N]``. bf16 tensors or ScaledTensors (mxfp8 / mxfp4 / nvfp4, row or
            hopper layout: :func:`llmkernels.quantize`; interleaved rows need the row layout).
        topk_weights: float ``[T, top_k]``; topk_ids: int32/int64 ``[T, top_k]``.
        inplace: write the result into ``hidden_states`` and return it.
        activation: ``"silu"`` (SwiGLU), ``"swigluoai"`` (gpt-oss' clamped SwiGLU on interleaved rows, as
            vLLM names it) or a :class:`llmkernels.SwiGLU`; fused into the first grouped matmul.
        apply_router_weight_on_input: scale each token copy's input by its weight instead of its output (as
            vLLM does for top-1 routing).
        global_num_experts, expert_map: expert parallelism as vLLM spells it: ``expert_map[global id]`` is the
            local expert or -1; copies routed to other ranks' experts contribute nothing here.
        w1_bias: optional ``[E, 2N]`` (in w1's row order), w2_bias ``[E, K]``: per-expert biases (keyword-only,
            as vLLM's gpt-oss path passes them).
        activation_format: ``"bf16"`` (weight-only) or a format the activations are quantized to before each
            grouped matmul (keyword-only; not vLLM's).

    Returns:
        ``[T, K]`` in hidden_states' dtype.

    Raises:
        TypeError / ValueError: arguments of the wrong type or shapes that do not fit; what
            :func:`llmkernels.grouped_matmul` raises for the weights.
        NotImplementedError: another activation.
    """
    epilogue = _epilogue(activation)
    _check(hidden_states, w1, w2, topk_weights, topk_ids, expert_map, w1_bias, w2_bias)
    num_experts = w1.shape[0]
    if expert_map is not None:
        topk_ids = expert_map[topk_ids.long()]
    token_of_row, a_offsets, row_of_copy = dispatch(topk_ids, num_experts)
    # rows past the placed copies (ids -1 from expert_map) hold no token: point them at token 0
    rows = torch.arange(token_of_row.shape[0], device=token_of_row.device)
    token_of_row = torch.where(rows < a_offsets[-1], token_of_row, 0)
    weights = topk_weights.float()
    x = hidden_states.to(torch.bfloat16)
    a = x[token_of_row]
    if apply_router_weight_on_input:
        weight_of_row = torch.zeros(token_of_row.shape[0], dtype=torch.float32, device=x.device)
        placed = row_of_copy.flatten() >= 0  # an unplaced copy adds 0 to row 0 (accumulate: no lost write)
        weight_of_row.index_put_((torch.where(placed, row_of_copy.flatten(), 0),),
                                 torch.where(placed, weights.flatten(), 0.0), accumulate=True)
        a = (a.float() * weight_of_row[:, None]).to(torch.bfloat16)
        weights = torch.ones_like(weights)
    if activation_format != "bf16":
        a = quantize(a, activation_format)
    expert_ids = torch.arange(num_experts, dtype=torch.int32, device=x.device)
    h = grouped_matmul(a, w1, a_offsets, expert_ids, epilogue=epilogue, bias=w1_bias)
    if activation_format != "bf16":
        h = quantize(h, activation_format)
    y = grouped_matmul(h, w2, a_offsets, expert_ids, bias=w2_bias)
    out = combine(y, row_of_copy, weights, hidden_states.dtype)
    if inplace:
        hidden_states.copy_(out)
        return hidden_states
    return out
