"""How the attention kernels see the call's tensors: the layout facts a plan is made on (which tensors TMA reads in
place, whether K/V are token rows, how far the pages reach), and the per-call views every launch takes (strides as
(batch, token, head), the paged metadata with the strides the kernels read, one-element dummies)."""

from __future__ import annotations

import torch

__all__ = [
    "tma_ready",
    "kv_token_rows",
    "last_offset",
    "read_extent",
    "token_rows",
    "token_row_descriptor",
    "strides3",
    "paged_metadata",
    "dummy",
]


def tma_ready(t: torch.Tensor) -> bool:
    """Whether TMA can read a ``[B, S, H, D]`` (or ragged ``[total, H, D]``) tensor in place as ``[B, S, H·D]``:
    heads contiguous in a token row, batch and token strides positive multiples of 16 bytes, a 16-byte aligned
    start. The Gluon kernels copy other layouts (or refuse them)."""
    if t.dim() == 3:
        t = t.unsqueeze(0)
    batch_stride, token_stride, head_stride, unit = t.stride()
    size = t.element_size()
    return (
        unit == 1
        and head_stride == t.shape[3]
        and token_stride > 0
        and batch_stride > 0
        and (token_stride * size) % 16 == 0
        and (batch_stride * size) % 16 == 0
        and t.data_ptr() % 16 == 0
    )


def kv_token_rows(k: torch.Tensor, v: torch.Tensor, ragged: bool) -> bool:
    """Whether the portable kernel may read K and V through tensor descriptors over ``[tokens, Hkv * D]`` rows
    (``[B * Skv]`` dense or ``[total_k]`` ragged): heads contiguous in a token row, batches evenly spaced,
    rows and base 16-byte aligned, at least one row."""
    for t in (k, v):
        head_dim = t.shape[-1]
        row_stride = t.stride(-3)
        rows = t.shape[0] if ragged else t.shape[0] * t.shape[1]
        evenly_spaced = ragged or t.shape[0] == 1 or t.stride(0) == t.shape[1] * row_stride
        if (
            rows == 0
            or t.stride(-1) != 1
            or t.stride(-2) != head_dim
            or not evenly_spaced
            or (row_stride * t.element_size()) % 16
            or t.data_ptr() % 16
        ):
            return False
    return True


def last_offset(t: torch.Tensor) -> int:
    """The largest element offset of a view from its first element (0 for an empty one)."""
    return sum((size - 1) * stride for size, stride in zip(t.shape, t.stride())) if t.numel() else 0


def read_extent(t: torch.Tensor) -> int:
    """:func:`last_offset` of what the portable kernel reads for ``t``: ``t`` itself, or its contiguous copy when its
    last dim is not unit-stride (``runtime.unit_last_stride``)."""
    if t.stride(-1) == 1 or t.shape[-1] <= 1:
        return last_offset(t)
    return max(t.numel() - 1, 0)


def token_rows(t: torch.Tensor, ragged: bool) -> tuple:
    """``(t, shape, strides)`` of ``t`` seen as ``[tokens, H * D]`` rows (``[B * S]`` dense or ``[total]`` ragged):
    what a descriptor slot of a bound launch takes when the rows vary per call."""
    shape = t.shape
    return t, (shape[0] if ragged else shape[0] * shape[1], shape[-2] * shape[-1]), (t.stride(-3), 1)


def token_row_descriptor(t: torch.Tensor, ragged: bool, block_n: int):
    """The portable kernel's tensor descriptor over :func:`token_rows` of ``t``, blocks ``[block_n, D]`` (a layout
    :func:`kv_token_rows` accepts)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    base, shape, strides = token_rows(t, ragged)
    return TensorDescriptor(base, list(shape), list(strides), [block_n, t.shape[-1]])


def strides3(t: torch.Tensor, ragged: bool) -> tuple[int, int, int]:
    """(batch, token, head) strides of a ``[B, S, H, D]`` tensor, or ``(0, token, head)`` of a ragged
    ``[total, H, D]`` one."""
    return (0, t.stride(0), t.stride(1)) if ragged else (t.stride(0), t.stride(1), t.stride(2))


def paged_metadata(kv_cache) -> tuple[torch.Tensor, torch.Tensor]:
    """(block table with unit stride along a row, contiguous seqlens) of a :class:`PagedKVCache` as the kernels read
    them (a copy of a few bytes when a view has other strides, no sync)."""
    block_table = kv_cache.block_table
    return (block_table if block_table.stride(1) == 1 else block_table.contiguous(), kv_cache.seqlens.contiguous())


_DUMMIES: dict = {}


def dummy(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A one-element tensor for pointer arguments that the compiled variant never reads (shared, never written)."""
    key = (str(device), dtype)
    if key not in _DUMMIES:
        _DUMMIES[key] = torch.zeros(1, dtype=dtype, device=device)
    return _DUMMIES[key]
