"""torchao's ``MXTensor`` and ``NVFP4Tensor`` (torchao 0.18 attribute names) as ScaledTensors and back.

The bits agree: torchao's ``to_mx`` (FLOOR scales) and ``to_nvfp4`` (``per_tensor_scale`` is the decode scale)
give the data and scales :func:`llmkernels.quantize` gives, e2m1 packed low nibble first in both; swizzled
scales (``is_swizzled_scales=True``, 2D) are the 128x4 tiles of our ``"128x4"`` layout, tile-major. So
:func:`from_torchao` returns views of the torchao tensor's own storage (no copy); only an NVFP4 tensor without a
per-tensor scale gets a new one-element global scale of 1.0. torchao is imported only by :func:`to_torchao`.
"""
from __future__ import annotations

import torch

from .layout import TILE_ROWS, TILE_SCALE_COLS
from .scaled_tensor import ScaledTensor

__all__ = ["is_torchao_tensor", "from_torchao", "to_torchao", "unwrap_torchao"]

_TORCHAO_CLASSES = ("MXTensor", "NVFP4Tensor")


def is_torchao_tensor(x) -> bool:
    """Whether ``x`` is a torchao ``MXTensor`` or ``NVFP4Tensor`` (by class and module, without importing
    torchao)."""
    cls = type(x)
    return cls.__name__ in _TORCHAO_CLASSES and cls.__module__.startswith("torchao")


def _format(x) -> str:
    if type(x).__name__ == "NVFP4Tensor":
        if x.block_size != 16:
            raise ValueError(f"an NVFP4Tensor with block_size {x.block_size}: nvfp4 scales blocks of 16")
        return "nvfp4"
    elements = {torch.float8_e4m3fn: "mxfp8", torch.float4_e2m1fn_x2: "mxfp4"}
    fmt = elements.get(x.elem_dtype)
    if fmt is None or x.block_size != 32:
        raise ValueError(f"an MXTensor of elem_dtype {x.elem_dtype} and block_size {x.block_size}: only "
                         f"float8_e4m3fn (mxfp8) and float4_e2m1fn_x2 (mxfp4) in blocks of 32 map to a ScaledTensor")
    return fmt


def unwrap_torchao(x):
    """``x`` as a ScaledTensor when it is a torchao MXTensor / NVFP4Tensor (:func:`from_torchao`), else ``x``."""
    return from_torchao(x) if is_torchao_tensor(x) else x


def from_torchao(x) -> ScaledTensor:
    """A torchao ``MXTensor`` / ``NVFP4Tensor`` of logical shape ``[..., K]`` → the same tensor as a ScaledTensor
    (views of its data and scales; row scales stay ``"row"``, swizzled ones become ``"128x4"``).

    Raises:
        TypeError: x is not an MXTensor / NVFP4Tensor.
        ValueError: an element type or block size without a ScaledTensor format, swizzled scales of a tensor
            that is not 2D.
    """
    if not is_torchao_tensor(x):
        raise TypeError(f"expected a torchao MXTensor or NVFP4Tensor, got {type(x).__name__}")
    fmt = _format(x)
    data = x.qdata if fmt == "mxfp8" else x.qdata.view(torch.uint8)
    scale_dtype = torch.float8_e4m3fn if fmt == "nvfp4" else torch.float8_e8m0fnu
    scales = x.scale.view(scale_dtype)
    global_scale = None
    if fmt == "nvfp4":
        per_tensor = x.per_tensor_scale
        global_scale = (per_tensor.float().reshape(1) if per_tensor is not None
                        else torch.ones(1, dtype=torch.float32, device=data.device))
    if not x.is_swizzled_scales:
        return ScaledTensor(data, scales.reshape(*data.shape[:-1], -1), fmt, global_scale)
    if data.dim() != 2:
        raise ValueError(f"swizzled scales of a {data.dim()}D torchao tensor: only 2D ones map to 128x4 tiles")
    rows, k = x.shape[0], x.shape[-1]
    block = 16 if fmt == "nvfp4" else 32
    tiles = scales.reshape(-(-rows // TILE_ROWS), -(-(k // block) // TILE_SCALE_COLS), 32, 16)
    return ScaledTensor(data, tiles, fmt, global_scale, "128x4")


def to_torchao(x: ScaledTensor, orig_dtype: torch.dtype = torch.bfloat16):
    """A ScaledTensor (row scales, or 128x4 of a 2D tensor) → torchao's ``MXTensor`` / ``NVFP4Tensor`` with the
    same bits (data and scales shared where the layouts agree). ``orig_dtype``: the dtype torchao dequantizes to.

    Raises:
        ImportError: torchao is not installed.
        ValueError: the hopper layout, or scales padded per group.
    """
    from torchao.prototype.mx_formats.mx_tensor import MXTensor
    from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor
    from torchao.quantization.quantize_.common.kernel_preference import KernelPreference

    if x.scale_layout == "hopper" or x.group_offsets is not None:
        raise ValueError("to_torchao takes row or ungrouped 128x4 scales; convert with to_layout('row') first")
    swizzled = x.scale_layout == "128x4"
    if swizzled and x.dim() != 2:
        raise ValueError("torchao's swizzled scales are 2D: convert a 128x4 tensor of more dims to_layout('row')")
    scales = x.scales
    if swizzled:  # torchao keeps the tiles as one 2D tensor, [row_tiles * 32, col_tiles * 16]
        scales = x.scales.reshape(x.scales.shape[0] * 32, x.scales.shape[1] * 16)
    if x.format == "nvfp4":
        return NVFP4Tensor(x.data, scales, block_size=16, orig_dtype=orig_dtype,
                           per_tensor_scale=x.global_scale.reshape(()), is_swizzled_scales=swizzled)
    elem_dtype = torch.float8_e4m3fn if x.format == "mxfp8" else torch.float4_e2m1fn_x2
    return MXTensor(x.data, scales, elem_dtype, 32, orig_dtype, KernelPreference.EMULATED, None, swizzled)
