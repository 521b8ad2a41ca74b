"""What the grouped matmul's backends share: the call's tensors in the order a plan passes them, the pointer types
of an ahead-of-time compile, and A as a kernel reads it."""

from __future__ import annotations

import torch
import triton.language as tl

from ..check import Operand
from ..config import compute_dtype
from ..epilogue import SwiGLU

__all__ = ["TENSORS", "pointer_types", "triton_dtype", "compute_torch_dtype", "read_a", "epilogue_constexprs"]

# The tensors of a call, in the order a plan hands them to every launch (a kernel takes those of its
# ``<name>_ptr`` arguments); a missing one is a dummy the compiled kernel never reads.
TENSORS = (
    "a",
    "a_scales",
    "a_global_scale",
    "b",
    "b_scales",
    "b_global_scale",
    "out",
    "a_offsets",
    "a_scale_offsets",
    "expert_ids",
    "expert_scales",
    "bias",
)

_POINTER_TYPES = {
    torch.bfloat16: "*bf16",
    torch.float16: "*fp16",
    torch.float32: "*fp32",
    torch.int32: "*i32",
    torch.uint32: "*u32",
    torch.uint8: "*u8",
}
_ELEMENT_POINTERS = {"bf16": "*bf16", "fp16": "*fp16", "e4m3": "*u8", "e2m1": "*u8"}  # data as the kernels get it
_TORCH_DTYPES = {tl.bfloat16: torch.bfloat16, tl.float16: torch.float16, tl.float32: torch.float32}
_TRITON_DTYPES = {torch_dtype: triton_dtype for triton_dtype, torch_dtype in _TORCH_DTYPES.items()}


def triton_dtype(dtype: torch.dtype):
    """The Triton dtype of a torch compute dtype (bf16, fp16, fp32)."""
    return _TRITON_DTYPES[dtype]


def compute_torch_dtype(call) -> torch.dtype:
    """The kernels' compute dtype of ``call`` (:func:`~llmkernels.grouped_matmul.config.compute_dtype`) as a torch
    dtype: what A is decoded ahead to for a ``tl.dot``."""
    return _TORCH_DTYPES[compute_dtype(call.a.element)]


def read_a(call, upcast_dtype: torch.dtype | None) -> Operand:
    """A as a kernel reads it: the call's, or plain when decoded ahead to ``upcast_dtype`` (its global scale, which
    the pre-pass leaves, still for the epilogue)."""
    if upcast_dtype is None:
        return call.a
    return Operand.plain("fp16" if upcast_dtype == torch.float16 else "bf16", call.a.has_global_scale)


def pointer_types(call, a_dtype: torch.dtype | None = None) -> dict:
    """Triton's type of each pointer argument of a launch of ``call`` (what an ahead-of-time compile specializes
    on): data by element (quantized data as bytes), scales as bytes, global and expert scales float32, out and
    bias by dtype, metadata int32 (uint32 offsets); ``a_dtype``: A's dtype when it is decoded ahead. An absent
    bias is typed as the int32 dummy a launch passes for it. fp8 blocks' float32 scales (scale ``"f32"``) are
    ``*fp32``."""
    return {
        "a_ptr": _POINTER_TYPES[a_dtype] if a_dtype is not None else _ELEMENT_POINTERS[call.a.element],
        "a_scales_ptr": "*fp32" if call.a.scale == "f32" and a_dtype is None else "*u8",
        "a_global_scale_ptr": "*fp32",
        "b_ptr": _ELEMENT_POINTERS[call.b.element],
        "b_scales_ptr": "*fp32" if call.b.scale == "f32" else "*u8",
        "b_global_scale_ptr": "*fp32",
        "out_ptr": _POINTER_TYPES[call.out_dtype],
        "a_offsets_ptr": _POINTER_TYPES[call.offsets_dtype],
        "a_scale_offsets_ptr": "*i32",
        "expert_ids_ptr": "*i32",
        "expert_scales_ptr": "*fp32",
        "bias_ptr": _POINTER_TYPES[call.bias_dtype] if call.has_bias else "*i32",
    }


def epilogue_constexprs(call, interleaved_rows: bool = True) -> dict:
    """The epilogue's constexprs of a launch of ``call`` as the Triton kernels name them: expert scales, the
    epilogue's kind and user function, bias, and the SwiGLU parameters (``SwiGLU()``'s where the epilogue is not
    one: unread). ``interleaved_rows`` False: without GLU_INTERLEAVED, for a kernel whose weights hold SwiGLU's rows
    as ``[gate | up]`` halves whatever the call's rows (the Hopper-layout copy)."""
    glu = call.glu or SwiGLU()
    constexprs = dict(
        HAS_EXPERT_SCALES=call.has_expert_scales,
        EPILOGUE=call.epilogue_kind,
        EPILOGUE_FN=call.epilogue_fn,
        HAS_BIAS=call.has_bias,
        GLU_ALPHA=glu.alpha,
        GLU_LIMIT=glu.limit,
        GLU_UP_SHIFT=glu.up_shift,
    )
    if interleaved_rows:
        constexprs["GLU_INTERLEAVED"] = glu.interleaved
    return constexprs
