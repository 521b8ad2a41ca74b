"""The row layout: scales row-major ``[..., R, K / block]`` beside data ``[..., R, K]`` (``[..., R, K / 2]`` packed
e2m1), unpadded; what :func:`llmkernels.quantize` returns by default and every kernel reads."""

from __future__ import annotations

import triton
import triton.language as tl

from .base import Layout, Packed

__all__ = ["RowLayout", "ROW"]


@triton.jit
def token_scale_rows(
    rows, row_mask, group, group_start, group_tiles_ptr, stride_row, num_tile_rows, K, SCALE_BLOCK: tl.constexpr
):
    """Byte offset of each activation row's first scale: ``rows * stride_row``; every row has scales."""
    return rows * stride_row, row_mask


@triton.jit
def expert_scale_rows(expert, rows, stride_expert, stride_row, N, K, SCALE_BLOCK: tl.constexpr):
    """Byte offset of each weight row's first scale in expert ``expert``."""
    return expert * stride_expert + rows * stride_row


@triton.jit
def scale_cols(scale_cols):
    """Byte offset of scale column c from its row's first: c."""
    return scale_cols


class RowLayout(Layout):
    """Row-major scales ``[..., R, K / block]``: one row of scales per data row, any strides."""

    name = "row"
    strided = True
    token_scale_rows = token_scale_rows
    expert_scale_rows = expert_scale_rows
    scale_cols = scale_cols

    def scale_shape(self, shape: tuple, block: int) -> tuple:
        return (*shape[:-1], shape[-1] // block)

    def pack(self, data, scales, spec, shape, group_offsets=None) -> Packed:
        return Packed(data, scales)

    def unpack(self, x):
        return x.data, x.scales


ROW = RowLayout()
