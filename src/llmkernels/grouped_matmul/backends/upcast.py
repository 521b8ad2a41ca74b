"""The pre-pass that decodes a quantized A ahead, ``[T, K]`` in a plain dtype (``formats/kernel.py``'s
``upcast_rows_kernel``): each element times its block scale, the global scale left to the matmul. The backends that
read A plain after it: portable and ``tl.dot_scaled`` under ``config.upcast_a`` (the fused path would decode A
again for every N tile), and the Hopper layout for any quantized A."""

from __future__ import annotations

import torch

from ... import runtime
from ...formats.kernel import upcast_rows_kernel
from ...launch import KernelSpec
from ...runtime import cdiv
from .. import config as gm_config
from .base import triton_dtype

__all__ = ["upcast_spec", "Upcast"]

_TRITON_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def upcast_spec(call, dtype: torch.dtype) -> KernelSpec:
    """The pre-pass of ``call``'s A to ``dtype`` (bf16, fp16; float32 in the interpreter): one program per
    :data:`~llmkernels.grouped_matmul.config.UPCAST_TILE` of rows and K columns."""
    a = call.a
    block_rows, block_k, num_warps = gm_config.UPCAST_TILE
    constexprs = dict(
        ELEMENT=a.element,
        SCALE=a.scale,
        SCALE_BLOCK=a.scale_block,
        SCALE_ROWS=a.scale_layout.token_scale_rows,
        SCALE_COLS=a.scale_layout.scale_cols,
        PACKED_DECODE=gm_config.packed_decode(triton_dtype(dtype), call.device),
        BLOCK_ROWS=block_rows,
        BLOCK_K=block_k,
    )
    return KernelSpec(
        upcast_rows_kernel,
        (cdiv(call.num_tokens, block_rows), cdiv(call.k, block_k)),
        constexprs,
        dict(num_warps=num_warps),
        arg_types=dict(data_ptr="*u8", scales_ptr="*u8", out_ptr="*" + _TRITON_DTYPES[dtype]),
    )


class Upcast:
    """One plan's pre-pass to ``dtype``: ``upcast(a_data, a_scales)`` returns A decoded, a new ``[T, K]`` tensor."""

    def __init__(self, call, dtype: torch.dtype):
        self.spec = upcast_spec(call, dtype)
        self.num_tokens, self.k, self.device, self.dtype = call.num_tokens, call.k, call.device, dtype
        self.strided_scales = call.a.scale_layout.strided
        self.bound = None

    def __call__(self, a_data: torch.Tensor, a_scales: torch.Tensor) -> torch.Tensor:
        values = runtime.new_buffer((self.num_tokens, self.k), self.dtype, self.device)
        if self.bound is None:
            self.bound = self.spec.bind(
                a_data,
                a_scales,
                values,
                a_data.stride(0),
                a_scales.stride(0) if self.strided_scales else 0,
                values.stride(0),
                self.num_tokens,
                self.k,
            )
        self.bound(a_data, a_scales, values)
        return values
