"""Combine: each token's output is the router-weighted sum of its k expert rows, read straight from
the expert-sorted layout (one read of the expert outputs, one write of the tokens)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._runtime import check_device, next_power_of_2

__all__ = ["combine"]


@triton.jit
def combine_kernel(y_ptr, row_of_copy_ptr, weights_ptr, out_ptr, stride_y_row, stride_out_row, num_rows_y, hidden,
                   TOP_K: tl.constexpr, BLOCK_H: tl.constexpr):
    """out ``[T, H]``: ``out[t] = Σ_j weights[t, j] · y[row_of_copy[t, j]]`` in fp32; one program per
    (token, BLOCK_H columns). A row index outside y (e.g. the -1 of a copy that dispatch could not
    place) contributes nothing."""
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    col_ok = cols < hidden
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for slot in tl.static_range(TOP_K):
        row = tl.load(row_of_copy_ptr + token * TOP_K + slot).to(tl.int64)
        row_ok = (row >= 0) & (row < num_rows_y)
        weight = tl.load(weights_ptr + token * TOP_K + slot)
        values = tl.load(y_ptr + tl.where(row_ok, row, 0) * stride_y_row + cols, mask=col_ok, other=0.0)
        acc += tl.where(row_ok, weight * values.to(tl.float32), 0.0)
    tl.store(out_ptr + token * stride_out_row + cols, acc.to(out_ptr.dtype.element_ty), mask=col_ok)


def combine(y: torch.Tensor, row_of_copy: torch.Tensor, weights: torch.Tensor,
            out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Router-weighted sum of each token's expert outputs.

    Args:
        y: ``[T·k, H]`` expert outputs in the expert-sorted layout (unit column stride).
        row_of_copy: int64/int32 ``[T, k]``: row of y holding each (token, slot) copy
            (:func:`llmkernels.moe.dispatch`).
        weights: float32 ``[T, k]`` router weights.
        out_dtype: default y's dtype.

    Returns:
        ``[T, H]`` of ``out_dtype``, accumulated in fp32.
    """
    if row_of_copy.dim() != 2 or weights.shape != row_of_copy.shape or weights.dtype != torch.float32:
        raise ValueError(f"row_of_copy and weights must be [T, k] (weights float32), got "
                         f"{tuple(row_of_copy.shape)} and {weights.dtype} {tuple(weights.shape)}")
    if y.dim() != 2 or y.stride(-1) != 1:
        raise ValueError(f"y must be [T·k, H] with unit column stride, got shape {tuple(y.shape)}")
    device = check_device(y=y, row_of_copy=row_of_copy, weights=weights)
    if torch.compiler.is_compiling():
        from ..ops import moe_combine_op  # an opaque node for the compiler

        return moe_combine_op(y, row_of_copy, weights, out_dtype or y.dtype)
    num_tokens, top_k = row_of_copy.shape
    hidden = y.shape[1]
    out = torch.empty((num_tokens, hidden), dtype=out_dtype or y.dtype, device=device)
    if num_tokens == 0 or hidden == 0 or y.shape[0] == 0:
        return out.zero_()
    block_h = min(1024, next_power_of_2(hidden))
    combine_kernel[(num_tokens, triton.cdiv(hidden, block_h))](
        y, row_of_copy.contiguous(), weights.contiguous(), out, y.stride(0), out.stride(0), y.shape[0], hidden,
        TOP_K=top_k, BLOCK_H=block_h)
    return out
