"""transformers (5.x) through llmkernels: ``register()`` adds ``"llmkernels"`` to ``AttentionInterface``, to
``AttentionMaskInterface`` and to ``ExpertsInterface``, so that ``from_pretrained(..., attn_implementation="llmkernels",
experts_implementation="llmkernels")`` runs every attention layer through :func:`llmkernels.attention` and the
experts through :func:`llmkernels.moe.fused_experts` (:func:`quantize_experts` makes them MXFP4 / MXFP8 / NVFP4 /
fp8 blocks).

The mask entry is transformers' own SDPA mask (a bool ``[B, 1, Sq, Skv]`` with padding and sliding windows, or
None when plain causal attention says it all): :func:`llmkernels.attention` reads it tile by tile. gpt-oss' sinks
(``s_aux``) become ``sinks``, ``softcap`` a softcap score mod. Forward only (inference).

Experts run fused (gated activation and biases in the grouped matmuls' epilogues) in two layouts: SiLU-gated
experts in transformers' default layout (``gate_up_proj [E, 2I, H]`` gate rows first, ``down_proj [E, H, I]``,
no bias: Mixtral, Qwen3-MoE, DeepSeek-V3), and gpt-oss' (``gate_up_proj [E, H, 2I]`` gate and up columns
interleaved, ``down_proj [E, I, H]``, biases, the clamped SwiGLU), whose weights are rearranged once. Other
layouts run transformers' own ``grouped_mm`` path.

FP8 checkpoints of the fine-grained kind (``quant_method: "fp8"``, ``weight_block_size: [128, 128]``: DeepSeek-V3,
Qwen3-FP8), which transformers loads into its ``FP8Experts`` (float8_e4m3fn ``gate_up_proj`` / ``down_proj`` with
float32, or ue8m0, ``*_scale_inv`` block scales), run their experts through :func:`fused_experts` too: the weights
and scales are read in place as fp8 ScaledTensors of block ``(128, 128)``, the activations quantized per token and
128 columns on the fly (dynamic ``activation_scheme`` only; static activation scales, biases, softcapped or clamped
gates run transformers' own FP8 path). ``register()`` adds ``"llmkernels"`` to transformers' FP8 experts interface
as well.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..attention import softcap as softcap_mod
from ..formats import ScaledTensor
from ..formats.layouts import HOPPER, ROW, Layout, as_layout
from ..grouped_matmul import SwiGLU
from ..grouped_matmul.epilogue import deinterleave_gate_up
from ..moe import fused_experts
from ..moe.layer import prefers_hopper_layout
from ..ops import attention, quantize

__all__ = ["register", "attention_forward", "experts_forward", "quantize_experts", "ExpertWeights", "NAME"]

NAME = "llmkernels"
FP8_BLOCK = (128, 128)  # the fine-grained FP8 checkpoints' weight_block_size that the experts run on


def attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    softcap: float | None = None,
    s_aux: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
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
    out = attention(
        q,
        k,
        v,
        causal=causal,
        mask=attention_mask,
        sinks=None if s_aux is None else s_aux.float(),
        score_mod=softcap_mod(float(softcap)) if softcap else None,
        softmax_scale=scaling,
    )
    return out, None


@dataclass(frozen=True)
class ExpertWeights:
    """An experts module's weights as :func:`fused_experts` takes them: ``w1 [E, 2I, H]`` gate rows first, ``w2
    [E, H, I]`` (bf16 tensors or ScaledTensors), optional biases ``[E, 2I]`` / ``[E, H]``, the gated activation,
    and ``source``: the parameters' ``(version, address)`` they were made from (None: quantized, kept until
    :func:`quantize_experts` runs again)."""

    w1: object
    w2: object
    w1_bias: torch.Tensor | None
    w2_bias: torch.Tensor | None
    activation: SwiGLU
    source: tuple | None


def _is_fp8(experts: torch.nn.Module) -> bool:
    """Whether the module is transformers' ``FP8Experts`` of a quantized checkpoint (weights with ``*_scale_inv``
    scales: FP8, or FP4 for DeepSeek-V4-style ``expert_dtype``)."""
    return isinstance(getattr(experts, "down_proj_scale_inv", None), torch.Tensor)


def _fp8_layout(experts: torch.nn.Module) -> str | None:
    """``"fp8"``: transformers' ``FP8Experts`` with 128x128 blocks, dynamic activation scales, float32 or ue8m0
    weight scales and the plain SiLU gate (no softcap, clamp, bias); None: other."""
    apply_gate = type(experts)._apply_gate
    block_size = getattr(experts, "block_size", None)
    scale_dtypes = (torch.float32, getattr(torch, "float8_e8m0fnu", torch.float32))
    if (
        apply_gate.__qualname__ == "FP8Experts._apply_gate"
        and block_size is not None
        and tuple(block_size) == FP8_BLOCK
        and getattr(experts, "activation_scheme", None) == "dynamic"
        and not getattr(experts, "has_bias", False)
        and not getattr(experts, "is_transposed", False)
        and getattr(experts, "is_concatenated", True)
        and getattr(experts, "gate_softcap", None) is None
        and getattr(experts, "swiglu_alpha", None) is None
        and getattr(experts, "limit", None) is None
        and type(getattr(experts, "act_fn", None)).__name__ in ("SiLU", "SiLUActivation")
        and getattr(experts, "gate_up_proj", None) is not None
        and experts.gate_up_proj.dtype == experts.down_proj.dtype == torch.float8_e4m3fn
        and all(getattr(experts, f"{name}_scale_inv").dtype in scale_dtypes for name in ("gate_up_proj", "down_proj"))
    ):
        return "fp8"
    return None


def _layout(experts: torch.nn.Module) -> str | None:
    """``"default"``: SiLU-gated experts in transformers' default layout (Mixtral, Qwen3-MoE, DeepSeek-V3);
    ``"gpt_oss"``: gpt-oss' transposed, interleaved, biased experts and its clamped SwiGLU; ``"fp8"``: transformers'
    ``FP8Experts`` of a fine-grained FP8 checkpoint (:func:`_fp8_layout`); None: other."""
    from transformers.integrations.moe import _default_apply_gate

    if not getattr(experts, "has_gate", False) or getattr(experts, "has_post_expert_norm", False):
        return None
    if _is_fp8(experts):
        return _fp8_layout(experts)
    apply_gate = type(experts)._apply_gate
    if (
        apply_gate is _default_apply_gate
        and not getattr(experts, "has_bias", False)
        and not getattr(experts, "is_transposed", False)
        and getattr(experts, "is_concatenated", True)
        and type(getattr(experts, "act_fn", None)).__name__ in ("SiLU", "SiLUActivation")
    ):
        return "default"
    if (
        apply_gate.__qualname__ == "GptOssExperts._apply_gate"
        and getattr(experts, "has_bias", False)
        and getattr(experts, "is_transposed", False)
        and not getattr(experts, "is_concatenated", True)
    ):
        return "gpt_oss"
    return None


def _source(experts: torch.nn.Module) -> tuple:
    return tuple((p._version, p.data_ptr()) for p in experts.parameters(recurse=False))


def _fp8_expert_weights(experts: torch.nn.Module) -> ExpertWeights:
    """An ``FP8Experts`` module's weights and block scales as fp8 ScaledTensors of block ``(128, 128)``, read in
    place (ue8m0 scales, powers of two, become float32 exactly: a copy of the scales only).

    Raises:
        ValueError: a scale tensor that is not ``[E, ceil(rows / 128), ceil(cols / 128)]`` of its weight (the
            checkpoint's gate and up projections quantized apart with an intermediate size not a multiple of 128:
            their tiles do not line up with the concatenated ``gate_up_proj``'s).
    """
    parts = []
    for name in ("gate_up_proj", "down_proj"):
        data, scales = getattr(experts, name).detach(), getattr(experts, f"{name}_scale_inv").detach()
        tile = FP8_BLOCK[0]
        expected = (data.shape[0], -(-data.shape[1] // tile), -(-data.shape[2] // tile))
        if data.dim() != 3 or tuple(scales.shape) != expected:
            raise ValueError(
                f"{name}_scale_inv must be [E, ceil(rows / 128), ceil(cols / 128)] = {list(expected)} for {name} of "
                f"shape {tuple(data.shape)}, got {tuple(scales.shape)} (gate and up quantized apart need an "
                f"intermediate size that is a multiple of 128)"
            )
        parts.append(ScaledTensor(data, scales.float(), "fp8", block=FP8_BLOCK))
    return ExpertWeights(parts[0], parts[1], None, None, SwiGLU(), _source(experts))


def _expert_weights(
    experts: torch.nn.Module, layout: str, weight_format: str | None = None, scale_layout: Layout | str = ROW
) -> ExpertWeights:
    """The module's weights in :func:`fused_experts`' layout, bf16 or quantized (one copy, made once); an fp8
    checkpoint's in place (:func:`_fp8_expert_weights`).

    Raises:
        ValueError: ``gate_up_proj`` / ``down_proj`` not 3D weights of the same number of experts, what
            :func:`_fp8_expert_weights` raises.
    """
    for name in ("gate_up_proj", "down_proj"):
        weight = getattr(experts, name)
        if weight.dim() != 3 or weight.shape[0] != experts.gate_up_proj.shape[0]:
            raise ValueError(f"{name} must be [E, ., .] for E experts, got shape {tuple(weight.shape)}")
    if layout == "fp8":
        return _fp8_expert_weights(experts)
    with torch.no_grad():
        if layout == "default":
            w1, w2, b1, b2, activation = experts.gate_up_proj, experts.down_proj, None, None, SwiGLU()
        else:  # gpt-oss: [E, H, 2I] interleaved and [E, I, H] -> K-major, [gate | up] halves
            w1 = deinterleave_gate_up(experts.gate_up_proj.transpose(1, 2))
            w2 = experts.down_proj.transpose(1, 2)
            b1, b2 = deinterleave_gate_up(experts.gate_up_proj_bias).float(), experts.down_proj_bias.float()
            activation = SwiGLU(alpha=float(experts.alpha), limit=float(experts.limit), up_shift=1.0)
        w1, w2 = (w.detach().to(torch.bfloat16).contiguous() for w in (w1, w2))
        if weight_format == "fp8":
            w1, w2 = (quantize(w, "fp8", block=FP8_BLOCK) for w in (w1, w2))
        elif weight_format is not None:
            w1, w2 = (quantize(w, weight_format, scale_layout=scale_layout) for w in (w1, w2))
    return ExpertWeights(w1, w2, b1, b2, activation, None if weight_format is not None else _source(experts))


def experts_forward(
    self: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """transformers' experts-function signature: ``hidden_states [T, H]``, ``top_k_index`` / ``top_k_weights``
    ``[T, k]`` → ``[T, H]``. Runs :func:`fused_experts` on the weights :func:`quantize_experts` stored, or on
    bf16 copies in its layout made at the first call (made again when a parameter changes; gpt-oss' copy
    doubles its experts' memory, which :func:`quantize_experts` avoids; the default layout is used in place).
    Expert ids outside ``[0, E)`` (expert parallelism's sentinels) contribute nothing. Layouts other than the
    two fused ones run transformers' ``grouped_mm`` path."""
    weights = self.__dict__.get("llmkernels_weights")
    if weights is None or (weights.source is not None and weights.source != _source(self)):
        layout = _layout(self)
        if layout is None and _is_fp8(self):
            from transformers.integrations.finegrained_fp8 import fp8_grouped_mm_experts_forward

            return fp8_grouped_mm_experts_forward(self, hidden_states, top_k_index, top_k_weights)
        if layout is None:
            from transformers.integrations.moe import grouped_mm_experts_forward

            return grouped_mm_experts_forward(self, hidden_states, top_k_index, top_k_weights)
        weights = self.llmkernels_weights = _expert_weights(self, layout)
    return fused_experts(
        hidden_states,
        weights.w1,
        weights.w2,
        top_k_weights,
        top_k_index,
        activation=weights.activation,
        w1_bias=weights.w1_bias,
        w2_bias=weights.w2_bias,
    )


def quantize_experts(
    model: torch.nn.Module, weight_format: str = "mxfp4", scale_layout: Layout | str | None = None
) -> int:
    """Quantizes, once, the weights of every experts module of ``model`` that runs fused (transformers'
    default layout and gpt-oss') to ``weight_format`` (``"mxfp4"``, ``"mxfp8"``, ``"nvfp4"``, or ``"fp8"``: 128x128
    blocks with float32 scales, as the fine-grained FP8 checkpoints hold them, and activations quantized per token
    and 128 columns; ``scale_layout`` the row or the Hopper layout, a :class:`~llmkernels.formats.layouts.Layout`
    or its name, the row layout only for fp8; None: the layout the grouped matmul reads fastest where the weights
    are, the Hopper layout for MXFP4 and NVFP4 on a Hopper GPU, as :meth:`~llmkernels.moe.MoEFeedForward.from_float`
    chooses, else the row layout) and stores them as its ``llmkernels_weights`` (an
    :class:`ExpertWeights`), which ``experts_implementation="llmkernels"`` reads. The bf16 parameters stay, for
    the other implementations; call it again after changing them or moving the model. Experts loaded from an FP8
    checkpoint are quantized already (they run as they are) and are not counted. Returns how many modules were
    quantized.

    Raises:
        ValueError: ``scale_layout`` other than the row layout for fp8, and what :func:`llmkernels.quantize`
            raises.
    """
    if (
        weight_format == "fp8"
        and scale_layout is not None
        and as_layout(scale_layout, argument="scale_layout") is not ROW
    ):
        raise ValueError(f"fp8 scales live in the row layout only, got scale_layout={scale_layout!r}")
    count = 0
    for module in model.modules():
        layout = _layout(module) if hasattr(module, "gate_up_proj") else None
        if layout is not None and layout != "fp8":
            chosen = scale_layout
            if chosen is None:
                fast = HOPPER.holds(weight_format) and prefers_hopper_layout(module.gate_up_proj.device)
                chosen = HOPPER if fast else ROW
            module.llmkernels_weights = _expert_weights(module, layout, weight_format, chosen)
            count += 1
    return count


def register(name: str = NAME) -> None:
    """Registers ``name`` in transformers' ``AttentionInterface``, ``AttentionMaskInterface`` and
    ``ExpertsInterface`` (and its ``FP8ExpertsInterface``, which the experts of FP8 checkpoints dispatch through).

    Raises:
        TypeError: ``name`` is not a non-empty string.
    """
    if not isinstance(name, str) or not name:
        raise TypeError(f"name must be a non-empty str, got {name!r}")
    from transformers import AttentionInterface
    from transformers.integrations.moe import ExpertsInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, sdpa_mask)
    ExpertsInterface.register(name, experts_forward)
    try:  # FP8 checkpoints' experts dispatch through an interface of their own
        from transformers.integrations.finegrained_fp8 import FP8ExpertsInterface
    except ImportError:
        return
    FP8ExpertsInterface.register(name, experts_forward)
