"""transformers (5.x) through llmkernels: ``register()`` adds ``"llmkernels"`` to ``AttentionInterface`` and to
``AttentionMaskInterface``, so that ``from_pretrained(..., attn_implementation="llmkernels")`` runs every attention
layer through :func:`llmkernels.attention`.

The mask entry is transformers' own SDPA mask (a bool ``[B, 1, Sq, Skv]`` with padding and sliding windows, or
None when plain causal attention says it all): :func:`llmkernels.attention` reads it tile by tile. gpt-oss' sinks
(``s_aux``) become ``sinks``, ``softcap`` a softcap score mod. Forward only (inference). Not yet: the experts
interface (``experts_implementation="llmkernels"``).
"""
from __future__ import annotations

import torch

from ..attention import softcap as softcap_mod
from ..ops import attention

__all__ = ["register", "attention_forward", "NAME"]

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


def register(name: str = NAME) -> None:
    """Registers ``name`` in transformers' ``AttentionInterface`` and ``AttentionMaskInterface``."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, sdpa_mask)
