"""PyTorch reference of the grouped matmul, in float32 (float64 accumulation), for tests and users."""

from __future__ import annotations

import math

import torch

from ..formats import ScaledTensor, dequantize, quantize_reference
from .epilogue import SwiGLU

__all__ = ["grouped_matmul_reference", "REFERENCE_EPILOGUES"]

REFERENCE_EPILOGUES = {
    "silu": torch.nn.functional.silu,
    "gelu": lambda x: 0.5 * x * (1.0 + torch.erf(x / math.sqrt(2.0))),
}


def grouped_matmul_reference(
    a, b, a_offsets, expert_ids, expert_scales=None, *, epilogue=None, bias=None
) -> torch.Tensor:
    """float32 ``[T, N_out]`` reference of :func:`llmkernels.grouped_matmul` on the same arguments.

    ``epilogue``: ``None``, ``"silu"``, ``"gelu"``, ``"swiglu"``, a :class:`SwiGLU` or a PyTorch function
    ``fn(value [rows, N_out], row [rows, 1], col [1, N_out]) -> value`` mirroring a user's jit epilogue.
    Rows outside every group are NaN (the kernel leaves them unwritten). Loops over groups on the
    host: for checking, not for speed. A bf16/fp16 ``a`` with fp8 weights is quantized to fp8 ``block=(1, 128)``
    first (:func:`~llmkernels.formats.quantize_reference`, the bits of the call's own pre-pass).
    """
    if isinstance(b, ScaledTensor) and b.format == "fp8" and not isinstance(a, ScaledTensor):
        a = quantize_reference(a, "fp8", block=(1, 128))
    a_values = dequantize(a) if isinstance(a, ScaledTensor) else a.float()
    b_values = dequantize(b) if isinstance(b, ScaledTensor) else b.float()
    num_tokens = a_values.shape[0]
    num_experts, n, _ = b_values.shape
    glu = SwiGLU() if epilogue == "swiglu" else epilogue if isinstance(epilogue, SwiGLU) else None
    n_out = n // 2 if glu is not None else n
    out = torch.full((num_tokens, n_out), float("nan"), dtype=torch.float32, device=a_values.device)
    # Clamped to [0, T] and made non-decreasing, as the kernel reads them.
    offsets = torch.cummax(a_offsets.to(torch.int64).clamp(0, num_tokens), 0).values.tolist()
    ids = expert_ids.tolist()
    for group, expert in enumerate(ids):
        start, end = offsets[group], offsets[group + 1]
        if end == start:
            continue
        if not 0 <= expert < num_experts:
            out[start:end] = 0.0
            continue
        acc = (a_values[start:end].double() @ b_values[expert].double().T).float()
        if expert_scales is not None:
            acc = acc * expert_scales[expert].float()
        if bias is not None:
            acc = acc + bias[expert].float()
        if glu is not None:
            acc = _swiglu(acc, glu)
        elif isinstance(epilogue, str):
            acc = REFERENCE_EPILOGUES[epilogue](acc)
        elif epilogue is not None:
            rows = torch.arange(start, end, device=acc.device)[:, None]
            cols = torch.arange(n_out, device=acc.device)[None, :]
            acc = epilogue(acc, rows, cols)
        out[start:end] = acc
    return out


def _swiglu(acc: torch.Tensor, glu: SwiGLU) -> torch.Tensor:
    """``[rows, N] → [rows, N / 2]``: the gated epilogue on B's gate and up columns."""
    n_out = acc.shape[1] // 2
    gate, up = (acc[:, 0::2], acc[:, 1::2]) if glu.interleaved else (acc[:, :n_out], acc[:, n_out:])
    if glu.limit is not None:
        gate, up = gate.clamp(max=glu.limit), up.clamp(-glu.limit, glu.limit)
    return gate * torch.sigmoid(glu.alpha * gate) * (up + glu.up_shift)
