"""Combine: each token's output is the router-weighted sum of its k expert rows, read straight from
the expert-sorted layout (one read of the expert outputs, one write of the tokens)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import runtime
from ..launch import BoundKernel, PlanCache, bind
from ..runtime import check_device, forward_only, next_power_of_2, unit_last_stride

__all__ = ["combine", "check_combine"]

_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def combine_kernel(
    y_ptr,
    row_of_copy_ptr,
    weights_ptr,
    out_ptr,
    stride_y_row,
    stride_out_row,
    num_rows_y,
    hidden,
    TOP_K: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
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


def combine(
    y: torch.Tensor, row_of_copy: torch.Tensor, weights: torch.Tensor, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """Router-weighted sum of each token's expert outputs.

    Args:
        y: bf16 / fp16 / fp32 ``[T·k, H]`` expert outputs in the expert-sorted layout.
        row_of_copy: int64/int32 ``[T, k]``: row of y holding each (token, slot) copy
            (:func:`llmkernels.moe.dispatch`); a row outside ``[0, T·k)`` contributes nothing.
        weights: float32 ``[T, k]`` router weights.
        out_dtype: bf16, fp16 or fp32; default y's dtype.

    Every tensor may be any view (strided, expanded, offset).

    Returns:
        ``[T, H]`` of ``out_dtype``, accumulated in fp32.

    Raises:
        TypeError: a tensor of the wrong dtype, or out_dtype not bf16/fp16/fp32.
        ValueError: shapes that do not fit, tensors on different devices, y or weights requiring grad
            (combine is forward-only).
    """
    key, plan = PLANS.lookup(y, row_of_copy, weights, out_dtype)
    if plan is None:
        device = check_combine(y, row_of_copy, weights, out_dtype)
        plan = PLANS.put(key, _Plan(y, row_of_copy, out_dtype or y.dtype, device))
    return plan(y, row_of_copy, weights)


PLANS = PlanCache("combine")


class _Plan:
    """The output's shape and the bound combine kernel of one call signature (no tensor kept)."""

    def __init__(self, y, row_of_copy, out_dtype, device):
        self.num_tokens, self.top_k = row_of_copy.shape
        self.hidden, self.out_dtype, self.device = y.shape[1], out_dtype, device
        self.empty = self.num_tokens == 0 or self.hidden == 0 or y.shape[0] == 0
        self.bound = None

    def __call__(self, y, row_of_copy, weights) -> torch.Tensor:
        out = runtime.new_buffer((self.num_tokens, self.hidden), self.out_dtype, self.device)
        if self.empty:
            return out.zero_()
        pointers = (unit_last_stride(y), row_of_copy.contiguous(), weights.contiguous(), out)
        (self.bound or self._bind(pointers))(*pointers)
        return out

    def _bind(self, pointers) -> BoundKernel:
        y, out = pointers[0], pointers[3]
        block_h = min(1024, next_power_of_2(self.hidden))
        self.bound = bind(
            combine_kernel,
            (self.num_tokens, triton.cdiv(self.hidden, block_h)),
            *pointers,
            y.stride(0),
            out.stride(0),
            y.shape[0],
            self.hidden,
            TOP_K=self.top_k,
            BLOCK_H=block_h,
        )
        return self.bound


def check_combine(y, row_of_copy, weights, out_dtype) -> torch.device:
    """The checks of :func:`combine` (no launch; safe while torch.compile traces); returns the device."""
    for name, tensor, dtypes in (
        ("y", y, _FLOAT_DTYPES),
        ("row_of_copy", row_of_copy, (torch.int32, torch.int64)),
        ("weights", weights, (torch.float32,)),
    ):
        if not isinstance(tensor, torch.Tensor) or tensor.dtype not in dtypes:
            raise TypeError(
                f"{name} must be a tensor of dtype {' or '.join(map(str, dtypes))}, "
                f"got {getattr(tensor, 'dtype', type(tensor).__name__)}"
            )
    if row_of_copy.dim() != 2 or weights.shape != row_of_copy.shape:
        raise ValueError(
            f"row_of_copy and weights must both be [T, k], got {tuple(row_of_copy.shape)} and {tuple(weights.shape)}"
        )
    if y.dim() != 2:
        raise ValueError(f"y must be [T·k, H], got shape {tuple(y.shape)}")
    if out_dtype is not None and out_dtype not in _FLOAT_DTYPES:
        raise TypeError(f"out_dtype must be bf16, fp16 or fp32, got {out_dtype}")
    device = check_device(y=y, row_of_copy=row_of_copy, weights=weights)
    forward_only("combine", y=y, weights=weights)
    return device
