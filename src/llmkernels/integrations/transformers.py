"""transformers (5.x) through llmkernels: ``register()`` adds ``"llmkernels"`` to ``AttentionInterface``, to
``AttentionMaskInterface`` and to ``ExpertsInterface``, so that ``from_pretrained(..., attn_implementation="llmkernels",
experts_implementation="llmkernels")`` runs every attention layer through :func:`llmkernels.attention` and the
experts through :func:`llmkernels.moe.fused_experts` (:func:`quantize_experts` makes them MXFP4 / MXFP8 / NVFP4).

The mask entry is transformers' own SDPA mask (a bool ``[B, 1, Sq, Skv]`` with padding and sliding windows, or
None when plain causal attention says it all): :func:`llmkernels.attention` reads it tile by tile. gpt-oss' sinks
(``s_aux``) become ``sinks``, ``softcap`` a softcap score mod. Forward only (inference).

Experts: SiLU-gated experts in transformers' default layout (``gate_up_proj [E, 2I, H]`` gate rows first,
``down_proj [E, H, I]``, no bias: the experts of Mixtral, Qwen3-MoE or DeepSeek-V3) run fused; other
layouts (gpt-oss' interleaved, transposed, biased experts with their clamped gate) fall back, documented, to
transformers' own ``grouped_mm`` path: not yet fused.
"""
from __future__ import annotations

import torch

from ..attention import softcap as softcap_mod
from ..formats import ScaledTensor
from ..moe import fused_experts
from ..ops import attention, quantize

__all__ = ["register", "attention_forward", "experts_forward", "quantize_experts", "NAME"]

NAME = "llmkernels"


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                      is_causal: bool | None = None, softcap: float | None = None, s_aux: torch.Tensor | None = None,
                      **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: query ``[B, Hq, Sq, D]``, key / value ``[B, Hkv, Skv, D]``
    (fp16 / bf16), ``attention_mask`` bool or additive ``[B, 1, Sq, Skv]`` or None → ``([B, Sq, Hq, D], None)``.

    Raises:
        ValueError: ``dropout > 0`` (training), and what :func:`llmkernels.attention` raises.
    """
    if dropout:
        raise ValueError(f"dropout={dropout}: the llmkernels attention is inference-only (call model.eval())")
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)  # views, [B, S, H, D]
    q_length = q.shape[1]
    is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    causal = q_length > 1 and attention_mask is None and is_causal
    if causal and k.shape[1] > q_length:  # as transformers' SDPA path: no mask means the first q_length keys
        k, v = k[:, :q_length], v[:, :q_length]
    out = attention(q, k, v, causal=causal, mask=attention_mask, sinks=None if s_aux is None else s_aux.float(),
                    score_mod=softcap_mod(float(softcap)) if softcap else None, softmax_scale=scaling)
    return out, None


def _fusable(experts: torch.nn.Module) -> bool:
    """SiLU-gated experts in transformers' default layout (what :func:`fused_experts` computes)."""
    from transformers.integrations.moe import _default_apply_gate

    return (getattr(experts, "has_gate", False) and not getattr(experts, "has_bias", False)
            and not getattr(experts, "is_transposed", False) and getattr(experts, "is_concatenated", True)
            and not getattr(experts, "has_post_expert_norm", False)
            and type(experts)._apply_gate is _default_apply_gate
            and type(getattr(experts, "act_fn", None)).__name__ in ("SiLU", "SiLUActivation"))


def experts_forward(self: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:
    """transformers' experts-function signature: ``hidden_states [T, H]``, ``top_k_index`` / ``top_k_weights``
    ``[T, k]`` → ``[T, H]``. Quantized weights set by :func:`quantize_experts` are used when present; expert ids
    outside ``[0, E)`` (expert parallelism's sentinels) contribute nothing."""
    if not _fusable(self):
        from transformers.integrations.moe import grouped_mm_experts_forward

        return grouped_mm_experts_forward(self, hidden_states, top_k_index, top_k_weights)
    w_gate_up, w_down = getattr(self, "llmkernels_weights", (self.gate_up_proj, self.down_proj))
    if not isinstance(w_gate_up, ScaledTensor):
        w_gate_up, w_down = w_gate_up.to(torch.bfloat16), w_down.to(torch.bfloat16)
    return fused_experts(hidden_states, w_gate_up, w_down, top_k_weights, top_k_index)


def quantize_experts(model: torch.nn.Module, weight_format: str = "mxfp4", scale_layout: str = "row") -> int:
    """Quantizes, once, the weights of every fusable experts module of ``model`` to ``weight_format``
    (``"mxfp4"``, ``"mxfp8"``, ``"nvfp4"``; ``scale_layout`` ``"row"`` or ``"hopper"``) and stores them as its
    ``llmkernels_weights``, which ``experts_implementation="llmkernels"`` reads (the bf16 parameters stay, for
    the other implementations). Returns how many modules were quantized."""
    count = 0
    for module in model.modules():
        if hasattr(module, "gate_up_proj") and hasattr(module, "has_gate") and _fusable(module):
            module.llmkernels_weights = tuple(
                quantize(weight.detach().contiguous(), weight_format, scale_layout=scale_layout)
                for weight in (module.gate_up_proj, module.down_proj))
            count += 1
    return count


def register(name: str = NAME) -> None:
    """Registers ``name`` in transformers' ``AttentionInterface``, ``AttentionMaskInterface`` and
    ``ExpertsInterface``."""
    from transformers import AttentionInterface
    from transformers.integrations.moe import ExpertsInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, sdpa_mask)
    ExpertsInterface.register(name, experts_forward)
