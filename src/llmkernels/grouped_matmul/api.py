"""grouped_matmul(): validates its inputs once (``check``), plans the launches by signature (``plan``, which picks a
backend per launch) and runs them."""

from __future__ import annotations

import torch

from ..formats import ScaledTensor, unwrap_torchao
from ..launch import PlanCache, value_key
from .check import CheckedCall, check_grouped_matmul, check_metadata_values
from .config import BlockScaledMatmulConfig
from .epilogue import EPILOGUES
from .layout_cache import HOPPER_COPIES
from .plan import Plan

__all__ = ["grouped_matmul", "check_grouped_matmul", "CheckedCall", "EPILOGUES", "PLANS", "HOPPER_COPIES"]


def grouped_matmul(
    a,
    b,
    a_offsets: torch.Tensor,
    expert_ids: torch.Tensor,
    expert_scales: torch.Tensor | None = None,
    *,
    epilogue=None,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    out: torch.Tensor | None = None,
    config: BlockScaledMatmulConfig | None = None,
    validate: bool = False,
) -> torch.Tensor:
    """Grouped 1D-1D block-scaled matmul for Mixture-of-Experts (the seed's Grouped1D1DMatmulKernel).

    For every group g with rows ``a_offsets[g]:a_offsets[g+1]`` and expert ``e = expert_ids[g]``:
    ``out[rows] = epilogue(expert_scales[e] · (A[rows] @ B[e]ᵀ) + bias[e])``, computed in fp32.

    Args:
        a: ``[T, K]`` tokens of all groups: a ScaledTensor (mxfp8, mxfp4, nvfp4; row or 128x4 scales,
            for 128x4 padded per group, see :meth:`ScaledTensor.to_layout`; fp8 ``block=(1, 128)``), or a
            bf16/fp16 tensor (weight-only quantization).
        b: ``[E, N, K]`` expert weights, K-major: a ScaledTensor of the same family as ``a`` (MX with
            MX, nvfp4 with nvfp4; any for plain ``a``), or a tensor of a's dtype. MXFP4 and NVFP4 weights
            in the hopper layout (:meth:`ScaledTensor.to_layout`) take bf16 ``a``, or a quantized ``a``
            decoded ahead to bf16. fp8 ``block=(128, 128)`` weights (DeepSeek-style checkpoints) take fp8
            ``block=(1, 128)`` activations, or bf16/fp16 ones, which the call quantizes to those first (one
            :func:`llmkernels.quantize` kernel, as vLLM and transformers run these checkpoints); each 128-wide
            K block's e4m3 product is scaled and added to an fp32 accumulator. Their K may be any size. MXFP4
            weights (row or 128x4 scales) take fp8 ``block=(1, 128)`` activations too (w4a8): the fp32-accumulated
            product of the dequantized operands, each product exact (e4m3 times e2m1 · 2^e), each K step's partial
            scaled by its token's scale; measured 5e-8 to 1.4e-7 relative (Frobenius) to float64 in the
            interpreter with fp32 output (the sums' fp32 rounding; ``~K · 2^-24`` at worst). On an sm_90 GPU groups
            of more than 16 tokens with the plain epilogue run on the FP8 tensor cores through a prepared copy of
            the weights (:mod:`llmkernels.grouped_matmul.w4a8_prepare` states when; weights it cannot decode exactly
            run the portable kernel), the decode sizes through the weights' Hopper-layout copy
            (:mod:`llmkernels.grouped_matmul.backends.w4a8_decode`).
        a_offsets: int32 or uint32 ``[G + 1]`` on a's device, ``a_offsets[0] = 0``, non-decreasing.
            Read on the device: the call syncs nothing and can be captured in a CUDA graph.
        expert_ids: int32 ``[G]``; ``-1`` writes the group's rows as zeros.
        expert_scales: optional float32 ``[E]``, multiplies the accumulator before the epilogue.
        epilogue: ``None``, ``"silu"``, ``"gelu"`` (erf form), ``"swiglu"`` (B's N rows are
            ``[gate | up]``; output ``silu(gate) · up`` of width N / 2), a :class:`SwiGLU` (slope, clamp,
            shift of up, interleaved rows: gpt-oss' is ``GPT_OSS_SWIGLU``), or a ``@triton.jit`` function
            ``fn(value, row, col) -> value`` on the fp32 ``[BLOCK_M, BLOCK_N]`` tile with the global
            row (token) and column indices.
        bias: optional float32/bf16/fp16 ``[E, N]``, a row per expert in B's row order (gate and up rows
            alike for SwiGLU), added after ``expert_scales`` and before the activation.
        out_dtype: bf16 (default), fp16 or fp32.
        out: optional ``[T, N_out]`` tensor of ``out_dtype`` to write into (returned).
        config: a :class:`BlockScaledMatmulConfig`; default from the shapes. fp8 weights need
            ``block_k=128``, fp8 activations with MXFP4 weights ``block_k <= 128``.
        validate: check the offsets and expert ids on the host first (one sync) and raise on bad ones.

    Returns:
        ``[T, N_out]`` of ``out_dtype``. Rows outside every group are not written (uninitialised in
        a new tensor).

    Offsets are read clamped to ``[0, T]`` and to their running maximum, and expert ids outside
    ``[0, E)`` write zeros, so bad metadata can neither make the kernel touch memory outside its
    tensors nor write a row twice (``validate=True`` reports it instead). With A scales padded per group,
    a row whose scale tile-row falls outside A's scale tensor reads no scale and is written as NaN.

    On a Hopper GPU, MXFP4 and NVFP4 weights with row scales (``quantize``'s default) are read through a copy in
    the hopper layout made at their first call and kept while they live (2.3-2.6x faster on an H100; twice the
    weights' memory): :mod:`llmkernels.grouped_matmul.layout_cache` states when, and how to turn it off.

    Every tensor (data, scales, metadata, ``out``) may be any view: strides the kernel addresses are
    passed through, other layouts copied first; the result has the bits of the contiguous call.

    Raises:
        TypeError: an argument of the wrong type or dtype, an unsupported format pair (fp8 activations with
            nvfp4 or mxfp8 weights, or with mxfp4 weights in the hopper layout), ``out`` of another dtype.
        ValueError: mismatched shapes (K, lengths of offsets, ids, scales), devices, ScaledTensor parts
            that do not fit, ``out`` of another shape, with overlapping elements (a zero stride) or sharing
            memory with an input, an input that requires grad (forward-only), and with ``validate=True``
            bad offsets or expert ids.
    """
    if type(a) is not torch.Tensor and type(a) is not ScaledTensor:  # torchao's tensors are neither
        a = unwrap_torchao(a)
    if type(b) is not torch.Tensor and type(b) is not ScaledTensor:
        b = unwrap_torchao(b)
    b, epilogue, bias = HOPPER_COPIES.substitute(a, b, epilogue, bias, config)
    if epilogue is None and bias is None and out is None and config is None and type(out_dtype) is torch.dtype:
        # the key PLANS.lookup makes of these arguments, spelled out (this runs on every call)
        try:
            key = (
                torch.is_grad_enabled(),
                value_key(a),
                value_key(b),
                value_key(a_offsets),
                value_key(expert_ids),
                value_key(expert_scales),
                None,
                None,
                out_dtype,
                None,
                None,
            )
            plan = PLANS.get(key)
        except TypeError:  # an unhashable argument: planned, and checked, every time
            key = plan = None
    else:
        key, plan = PLANS.lookup(a, b, a_offsets, expert_ids, expert_scales, epilogue, bias, out_dtype, out, config)
    if plan is None:
        call = check_grouped_matmul(a, b, a_offsets, expert_ids, expert_scales, epilogue, out_dtype, out, config, bias)
        plan = PLANS.put(key, Plan(call, config))
        out_checked = True
    else:  # where out lies is not part of the signature: the plan checks it again
        out_checked = out is None
    if validate:
        check_metadata_values(a_offsets, expert_ids, plan.call.num_tokens, plan.call.num_experts, a)
    return plan(a, b, a_offsets, expert_ids, expert_scales, bias, out, out_checked)


PLANS = PlanCache("grouped_matmul")
