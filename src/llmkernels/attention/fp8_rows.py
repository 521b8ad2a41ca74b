"""Per-row e4m3 quantization of a 16-bit q, so that a bf16 / fp16 q over an FP8 cache runs on the FP8 tensor cores.

:func:`quantize_rows` turns ``x [T, H, D]`` or ``[B, S, H, D]`` (fp16 / bf16, any strides) into ``x8`` of x's
shape, float8_e4m3fn (contiguous), and ``scale [T, H]`` (``T = B S``) float32 with ``x ≈ x8 * scale``: one scale per (token, head) row, ``amax / 448``,
so that each row uses e4m3's whole range (the row's largest element becomes ±448), rounded to nearest even. One
element moves by at most 2^-4 of itself (three mantissa bits); a randn row of 128 moves by 2.6% (root mean
square, relative), against bf16's 0.2%. A row of zeros gets a tiny positive scale (its elements stay 0). FA3 and vLLM make
the same choice (an e4m3 q for an e4m3 cache); a scale per row rather than per (sequence, head) keeps an outlier
token from flattening its neighbours' resolution.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..runtime import interpreting
from .kv_append import _e4m3_nearest_even

__all__ = ["quantize_rows", "E4M3_MAX"]

E4M3_MAX = 448.0
_BLOCK_ROWS = 16


@triton.jit
def _quantize_rows_kernel(
    x_ptr,
    out_ptr,
    scale_ptr,
    num_rows,
    num_heads,
    seqlen,
    stride_b,
    stride_s,
    stride_h,
    stride_d,
    HEAD_DIM: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BY_HAND: tl.constexpr,
):
    """Rows ``[pid * BLOCK_ROWS, + BLOCK_ROWS)`` of the ``T * H`` (token, head) rows, token ``t`` at ``(t // seqlen)
    * stride_b + (t % seqlen) * stride_s``: ``out`` e4m3 ``[T, H, D]`` contiguous (uint8 bits when BY_HAND: the interpreter's own conversion does not round to nearest even),
    ``scale`` float32 ``[T, H]`` contiguous."""
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    dims = tl.arange(0, HEAD_DIM)
    keep = rows < num_rows
    token = rows // num_heads
    head = (rows % num_heads).to(tl.int64)
    position = (token // seqlen).to(tl.int64) * stride_b + (token % seqlen).to(tl.int64) * stride_s
    source = x_ptr + (position + head * stride_h)[:, None] + dims[None, :].to(tl.int64) * stride_d
    x = tl.load(source, mask=keep[:, None], other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=1)
    scale = tl.maximum(amax, 1e-30) / 448.0
    y = tl.minimum(tl.maximum(x / scale[:, None], -448.0), 448.0)
    target = out_ptr + rows.to(tl.int64)[:, None] * HEAD_DIM + dims[None, :]
    if BY_HAND:
        tl.store(target, _e4m3_nearest_even(y), mask=keep[:, None])
    else:
        tl.store(target, y.to(tl.float8e4nv), mask=keep[:, None])
    tl.store(scale_ptr + rows, scale, mask=keep)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` fp16 / bf16 ``[T, H, D]`` or ``[B, S, H, D]`` (D a power of two, any strides: nothing is copied) ->
    ``(x8, scale)``: float8_e4m3fn of x's shape, contiguous, and float32 ``[T, H]`` (``T = B S``) contiguous with
    ``x ≈ x8.float() * scale[..., None]`` (token-major; see the module docstring). No host sync: CUDA-graph
    capturable."""
    stride_b, stride_s = (x.stride(0), x.stride(1)) if x.dim() == 4 else (0, x.stride(0))
    seqlen = x.shape[1] if x.dim() == 4 else x.shape[0]
    heads, head_dim = x.shape[-2:]
    tokens = x.shape[0] * x.shape[1] if x.dim() == 4 else x.shape[0]
    x8 = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty((tokens, heads), dtype=torch.float32, device=x.device)
    num_rows = tokens * heads
    if num_rows == 0:
        return x8, scale
    by_hand = interpreting()
    _quantize_rows_kernel[(triton.cdiv(num_rows, _BLOCK_ROWS),)](
        x,
        x8.view(torch.uint8) if by_hand else x8,
        scale,
        num_rows,
        heads,
        max(seqlen, 1),
        stride_b,
        stride_s,
        x.stride(-2),
        x.stride(-1),
        HEAD_DIM=head_dim,
        BLOCK_ROWS=_BLOCK_ROWS,
        BY_HAND=by_hand,
        num_warps=4,
    )
    return x8, scale
