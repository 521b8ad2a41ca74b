"""torchao's ``MXTensor`` and ``NVFP4Tensor`` (torchao 0.18 attribute names) as ScaledTensors and back.

The bits agree: torchao's ``to_mx`` (FLOOR scales) and ``to_nvfp4`` (``per_tensor_scale`` is the decode scale)
give the data and scales :func:`llmkernels.quantize` gives, e2m1 packed low nibble first in both; swizzled
scales (``is_swizzled_scales=True``) are the 128x4 tiles of our ``"128x4"`` layout, tile-major. So
:func:`from_torchao` returns views of the torchao tensor's own storage (no copy), also of its row slices
(``x[a:b]``, ``narrow``), block-aligned column slices and ``select``; only an NVFP4 tensor without a per-tensor
scale gets a new one-element global scale of 1.0, and a 3D swizzled tensor whose matrices do not fill whole
128-row tiles gets row scales (torchao tiles the rows of all its matrices as one). A transposed tensor
(``x.t()``, ``transpose(-2, -1)``) blocks along its second-to-last dim, which a ScaledTensor cannot express:
:func:`from_torchao` refuses it. torchao is imported only by :func:`to_torchao`.
"""

from __future__ import annotations

import math

import torch

from .layouts import BLOCKED, ROW, TILE_ROWS, TILE_SCALE_COLS, Layout, from_blocked_scales
from .scaled_tensor import ScaledTensor
from .spec import FormatSpec, format_spec

__all__ = ["is_torchao_tensor", "from_torchao", "to_torchao", "unwrap_torchao"]

_TORCHAO_CLASSES = ("MXTensor", "NVFP4Tensor")
_TILE_BYTES = 32 * 16  # scale bytes of one 128x4 tile


def _torchao_class(x) -> str | None:
    """``"MXTensor"`` or ``"NVFP4Tensor"`` when ``x`` is one (or of a subclass of one), else None."""
    for cls in type(x).__mro__:
        if cls.__name__ in _TORCHAO_CLASSES and cls.__module__.startswith("torchao"):
            return cls.__name__
    return None


def is_torchao_tensor(x) -> bool:
    """Whether ``x`` is a torchao ``MXTensor`` or ``NVFP4Tensor`` (by class and module, without importing
    torchao)."""
    return _torchao_class(x) is not None


def _format(x) -> str:
    if _torchao_class(x) == "NVFP4Tensor":
        if x.block_size != 16:
            raise ValueError(f"x: an NVFP4Tensor with block_size {x.block_size}: nvfp4 scales blocks of 16")
        return "nvfp4"
    elements = {torch.float8_e4m3fn: "mxfp8", torch.float4_e2m1fn_x2: "mxfp4"}
    fmt = elements.get(x.elem_dtype)
    if fmt is None or x.block_size != 32:
        raise ValueError(
            f"x: an MXTensor of elem_dtype {x.elem_dtype} and block_size {x.block_size}: only "
            f"float8_e4m3fn (mxfp8) and float4_e2m1fn_x2 (mxfp4) in blocks of 32 map to a ScaledTensor"
        )
    return fmt


def unwrap_torchao(x):
    """``x`` as a ScaledTensor when it is a torchao MXTensor / NVFP4Tensor (:func:`from_torchao`), else ``x``."""
    return from_torchao(x) if is_torchao_tensor(x) else x


def _scale_dims(rows: int, cols: int, block: int, swizzled: bool) -> tuple[int, int]:
    """The last two dims of torchao's scale of a ``[rows, cols]`` matrix blocked along cols: ``[rows, cols /
    block]``, or swizzled its 128x4 tiles as one ``[row_tiles * 32, col_tiles * 16]`` matrix."""
    if not swizzled:
        return rows, cols // block
    return -(-rows // TILE_ROWS) * 32, -(-(cols // block) // TILE_SCALE_COLS) * 16


def _check_not_transposed(x, spec: FormatSpec) -> None:
    """Raises ValueError when ``x`` is a transposed torchao tensor: data and scales transposed views (what
    torchao's ``t`` and ``transpose`` make), blocks along dim -2. Told apart by the scale's shape, not by
    strides alone: data of any strides with scales of the untransposed shape is the untransposed tensor."""
    data, scale = x.qdata, x.scale
    if data.dim() < 2 or scale.dim() < 2 or data.stride(-2) >= data.stride(-1):
        return
    packed_rows, cols = data.shape[-2:]
    untransposed = _scale_dims(cols, packed_rows * (2 if spec.packed else 1), spec.block, x.is_swizzled_scales)
    if tuple(scale.shape[-2:]) == untransposed[::-1]:
        raise ValueError(
            f"x: a transposed {_torchao_class(x)} of shape {tuple(x.shape)}: its blocks run along dim {x.dim() - 2}, "
            f"and a ScaledTensor blocks along the last dim. Quantize the tensor in the orientation it is read "
            f"(e.g. MXTensor.to_mx(w.t().contiguous(), ...)), or pass the untransposed one"
        )


def _global_scale(x, device: torch.device) -> torch.Tensor:
    per_tensor = x.per_tensor_scale
    if per_tensor is None:
        return torch.ones(1, dtype=torch.float32, device=device)
    if per_tensor.numel() != 1:
        raise ValueError(
            f"x: an NVFP4Tensor with a per_tensor_scale of shape {tuple(per_tensor.shape)} (one per "
            f"expert): a ScaledTensor holds one global scale; convert each expert's slice"
        )
    return per_tensor.float().reshape(1)


def _wrong_scale_count(scales: torch.Tensor, expected: int, shape: tuple, swizzled: bool) -> ValueError:
    layout = "swizzled" if swizzled else "row"
    return ValueError(
        f"x: its {layout} scale holds {scales.numel()} scales, but data of logical shape {shape} needs {expected}"
    )


def _swizzled_scales(scales: torch.Tensor, shape: tuple, block: int) -> tuple[torch.Tensor, Layout]:
    """torchao's swizzled scale of data of logical shape ``[..., R, K]`` → ``(scales, layout)``: the 128x4
    tiles ``[..., RT, CT, 32, 16]`` (a view) where they are per-matrix, else row scales ``[..., R, K /
    block]`` (a copy): torchao tiles the ``prod(...) * R`` rows as one matrix, which matches per-matrix tiles
    only when R fills whole tiles."""
    *lead, rows, k = shape
    matrices, cols = math.prod(lead), k // block
    col_tiles = -(-cols // TILE_SCALE_COLS)
    if rows % TILE_ROWS == 0 or matrices == 1:
        row_tiles = -(-rows // TILE_ROWS)
        if scales.numel() != matrices * row_tiles * col_tiles * _TILE_BYTES:
            raise _wrong_scale_count(scales, matrices * row_tiles * col_tiles * _TILE_BYTES, shape, True)
        return scales.reshape(*lead, row_tiles, col_tiles, 32, 16), BLOCKED
    all_tiles = -(-matrices * rows // TILE_ROWS)
    if scales.numel() != all_tiles * col_tiles * _TILE_BYTES:
        raise _wrong_scale_count(scales, all_tiles * col_tiles * _TILE_BYTES, shape, True)
    row_scales = from_blocked_scales(scales.reshape(all_tiles, col_tiles, 32, 16), matrices * rows, cols)
    return row_scales.reshape(*lead, rows, cols), ROW


def from_torchao(x) -> ScaledTensor:
    """A torchao ``MXTensor`` / ``NVFP4Tensor`` of logical shape ``[..., K]``, blocked along K → the same
    tensor as a ScaledTensor (views of its data and scales; row scales stay ``"row"``, swizzled ones become
    ``"128x4"``). Its values are torchao's ``x.dequantize(torch.float32)``; for a column slice, which torchao
    0.18 cannot dequantize, those of the same columns of the unsliced tensor.

    Raises:
        TypeError: x is not an MXTensor / NVFP4Tensor.
        ValueError: an element type or block size without a ScaledTensor format; a transposed tensor (blocks
            along dim -2); a per-expert ``per_tensor_scale``; a scale that does not fit the data.
    """
    if not is_torchao_tensor(x):
        raise TypeError(f"x: expected a torchao MXTensor or NVFP4Tensor, got {type(x).__name__}")
    fmt = _format(x)
    spec = format_spec(fmt)
    _check_not_transposed(x, spec)
    data = x.qdata if fmt == "mxfp8" else x.qdata.view(torch.uint8)
    scales = x.scale.view(spec.scale_dtype)
    global_scale = _global_scale(x, data.device) if spec.has_global_scale else None
    shape = (*data.shape[:-1], data.shape[-1] * (2 if spec.packed else 1))
    if shape[-1] % spec.block:
        raise ValueError(f"x: {fmt} needs K = {shape[-1]} (of logical shape {shape}) to be a multiple of {spec.block}")
    if not x.is_swizzled_scales:
        expected = math.prod(shape[:-1]) * (shape[-1] // spec.block)
        if scales.numel() != expected:
            raise _wrong_scale_count(scales, expected, shape, False)
        return ScaledTensor(data, scales.reshape(*shape[:-1], shape[-1] // spec.block), fmt, global_scale)
    if data.dim() < 2:
        raise ValueError(f"x: swizzled scales of a {data.dim()}D tensor: 128x4 tiles hold at least 2 dims")
    scales, layout = _swizzled_scales(scales, shape, spec.block)
    return ScaledTensor(data, scales, fmt, global_scale, layout)


def to_torchao(x: ScaledTensor, orig_dtype: torch.dtype = torch.bfloat16):
    """A ScaledTensor (row scales, or 128x4 ones) → torchao's ``MXTensor`` / ``NVFP4Tensor`` with the same bits
    and values (``dequantize``). Data and scales are shared where torchao reads them as they are, else copied
    contiguous: torchao reads non-contiguous MX data (NVFP4 data whose rows are not its outer stride) as
    transposed. ``orig_dtype``: the dtype torchao dequantizes to.

    Raises:
        ImportError: torchao is not installed.
        ValueError: fp8, the hopper layout, scales padded per group, a 1D nvfp4 tensor (an NVFP4Tensor has at
            least 2 dims), 128x4 scales of more than 2 dims whose matrices do not fill whole 128-row tiles
            (torchao tiles the rows of all matrices as one).
    """
    from torchao.prototype.mx_formats.mx_tensor import MXTensor
    from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor
    from torchao.quantization.quantize_.common.kernel_preference import KernelPreference

    if x.format not in ("mxfp8", "mxfp4", "nvfp4"):  # fp8 blocks: no torchao tensor holds float32 block scales
        raise ValueError(f"x: to_torchao takes mxfp8, mxfp4 or nvfp4, got {x.format}")
    if x.scale_layout not in (ROW, BLOCKED) or x.scale_layout.grouped:
        raise ValueError(
            f"x: to_torchao takes {ROW} or ungrouped {BLOCKED} scales; convert with to_layout({ROW!r}) first"
        )
    if x.format == "nvfp4" and x.dim() < 2:
        raise ValueError(f"x: an NVFP4Tensor has at least 2 dims, got logical shape {tuple(x.shape)}")
    swizzled = x.scale_layout is BLOCKED
    if swizzled and x.dim() > 2 and x.shape[-2] % TILE_ROWS:
        raise ValueError(
            f"x: 128x4 scales of logical shape {tuple(x.shape)}: torchao tiles the rows of all its "
            f"matrices as one, which are per-matrix tiles only for rows in multiples of {TILE_ROWS}; "
            f"convert with to_layout({ROW!r}) first"
        )
    data, scales = x.data.contiguous(), x.scales.contiguous()
    if swizzled:  # torchao keeps the tiles as [..., row_tiles * 32, col_tiles * 16]
        *lead, row_tiles, col_tiles, _, _ = scales.shape
        scales = scales.reshape(*lead, row_tiles * 32, col_tiles * 16)
    if x.format == "nvfp4":
        return NVFP4Tensor(
            data,
            scales,
            block_size=16,
            orig_dtype=orig_dtype,
            per_tensor_scale=x.global_scale.reshape(()),
            is_swizzled_scales=swizzled,
        )
    elem_dtype = torch.float8_e4m3fn if x.format == "mxfp8" else torch.float4_e2m1fn_x2
    return MXTensor(data, scales, elem_dtype, 32, orig_dtype, KernelPreference.EMULATED, None, swizzled)
