"""quantize(): checks its input and launches the Triton quantize kernel."""

from __future__ import annotations

import math

import torch
import triton

from .. import runtime
from ..launch import BoundKernel, PlanCache, bind
from ..runtime import check_device, forward_only, unit_last_stride
from . import kernel
from .layouts import BLOCKED, GROUPED_BLOCKED, ROW, Layout, as_layout, check_group_offsets
from .reference import nvfp4_global_scale
from .scaled_tensor import ScaledTensor
from .spec import format_spec

__all__ = ["quantize", "check_quantize", "PLANS"]

_INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# (rows, columns, warps) of one quantize program; lab/scripts/ablate_quantize.py measures the choices.
QUANTIZE_TILE = (16, 256, 4)


def quantize(
    x: torch.Tensor,
    format: str,
    *,
    global_scale: torch.Tensor | None = None,
    scale_layout: Layout | str = ROW,
    group_offsets: torch.Tensor | None = None,
    rows: torch.Tensor | None = None,
) -> ScaledTensor:
    """Quantizes ``x`` ``[..., K]`` to a block-scaled format with a Triton kernel.

    Args:
        x: bf16, fp16 or fp32 ``[..., K]``; K a multiple of the format's block (32 MX, 16 NVFP4).
        format: ``"mxfp8"`` (e4m3 data, e8m0 scale per 32), ``"mxfp4"`` (packed e2m1, e8m0 per 32)
            or ``"nvfp4"`` (packed e2m1, e4m3 scale per 16, float32 per-tensor decode scale).
        global_scale: nvfp4 only: float32 scalar decode scale; default ``amax(|x|) / (448 · 6)``,
            floored at 2^-126, computed on the device (:func:`nvfp4_global_scale`).
        scale_layout: a layout or its name: ``"row"`` (``[..., K / block]``, the default), ``"128x4"``
            (tensor-core tiles) or ``"hopper"`` (mxfp4 or nvfp4 of at least 2 dims: data and scales in wgmma
            fragment order, what the grouped matmul reads fastest on Hopper; see :class:`ScaledTensor`).
        group_offsets: int32 ``[G + 1]`` for a 2D x with ``scale_layout="128x4"``: pad the scale tiles
            per group, the layout of the seed's A operand.
        rows: optional int32/int64 ``[R]`` row indices into a 2D x: quantizes ``x[rows]`` (``[R, K]``)
            in the same pass, e.g. the token copies of an MoE dispatch. Indices are clamped to x's
            rows; nvfp4's default global scale still comes from all of x.

    MX scales follow the OCP MX floor rule ``2^(floor(log2(amax)) - emax)``; elements round to
    nearest even and saturate. Same bits as :func:`llmkernels.formats.quantize_reference`.

    Every tensor argument may be any view (strided, expanded, offset): the result equals that of its
    contiguous copy. The nvfp4 ``global_scale`` is a device value and is not checked: it must be
    positive and finite (0 or a negative scale gives NaN or sign-flipped codes).

    Raises:
        TypeError: x is not a floating tensor of a supported dtype; rows or group_offsets of another dtype.
        ValueError: unknown format or scale_layout, K not a multiple of the block, bad global_scale,
            group_offsets without ``scale_layout="128x4"`` or with x not 2D, ``"hopper"`` for mxfp8 or a
            1D x, tensors on different devices,
            x or global_scale requiring grad (quantize is forward-only).
    """
    key, plan = PLANS.lookup(x, format, global_scale, scale_layout, group_offsets, rows)
    if plan is None:
        spec = check_quantize(x, format, global_scale, scale_layout, group_offsets, rows)
        plan = PLANS.put(key, _Plan(spec, format, x, rows, as_layout(scale_layout, grouped=group_offsets is not None)))
    return plan(x, global_scale, group_offsets, rows)


PLANS = PlanCache("quantize")


class _Plan:
    """Output shapes, the layout to convert the row-layout result to (None: none) and the bound quantize kernel of
    one call signature (no tensor kept)."""

    def __init__(self, spec, format: str, x: torch.Tensor, rows: torch.Tensor | None, layout: Layout):
        self.spec, self.format, self.device = spec, format, x.device
        self.num_cols = x.shape[-1]
        self.num_x_rows = math.prod(x.shape[:-1])
        out_rows_shape = tuple(x.shape[:-1]) if rows is None else (rows.shape[0],)
        self.data_shape = (*out_rows_shape, self.num_cols // 2 if spec.packed else self.num_cols)
        self.scales_shape = (*out_rows_shape, self.num_cols // spec.block)
        self.num_rows = self.num_x_rows if rows is None else rows.shape[0]
        self.gather = rows is not None
        self.is_2d = x.dim() == 2
        self.data_dtype, self.scale_dtype = spec.data_dtype, spec.scale_dtype
        self.launches = self.num_rows > 0 and self.num_cols > 0  # rows > 0 with an empty x was rejected
        self.layout = None if layout is ROW else layout
        self.bound = None

    def __call__(self, x, global_scale, group_offsets, rows) -> ScaledTensor:
        x2d = unit_last_stride(x if self.is_2d else x.reshape(self.num_x_rows, self.num_cols))  # a view if it can
        data = runtime.new_buffer(self.data_shape, self.data_dtype, self.device)
        scales = runtime.new_buffer(self.scales_shape, torch.uint8, self.device)
        if self.spec.has_global_scale:
            global_scale = nvfp4_global_scale(x) if global_scale is None else global_scale.float().reshape(())
        if self.launches:
            rows = scales if rows is None else rows.contiguous()  # read as a dense vector (only with GATHER)
            data_bytes = data.view(torch.uint8)
            bound = self.bound or self._bind((x2d, data_bytes, scales, global_scale, rows))
            if global_scale is None:  # a None argument is a constant of the compiled kernel, not passed
                bound(x2d, data_bytes, scales, rows)
            else:
                bound(x2d, data_bytes, scales, global_scale, rows)
        result = ScaledTensor.unchecked(data, scales.view(self.scale_dtype), self.format, global_scale)
        if self.layout is not None:
            result = result.to_layout(self.layout, group_offsets=group_offsets)
        return result

    def _bind(self, pointers) -> BoundKernel:
        spec, x2d = self.spec, pointers[0]
        block_rows, block_cols, num_warps = QUANTIZE_TILE
        grid = (triton.cdiv(self.num_rows, block_rows), triton.cdiv(self.num_cols, block_cols))
        self.bound = bind(
            kernel.quantize_kernel,
            grid,
            *pointers,
            x2d.stride(0),
            self.num_rows,
            x2d.shape[0],
            self.num_cols,
            ELEMENT=spec.element,
            SCALE=spec.scale,
            SCALE_BLOCK=spec.block,
            EMAX=spec.emax,
            GATHER=self.gather,
            BLOCK_ROWS=block_rows,
            BLOCK_COLS=block_cols,
            num_warps=num_warps,
        )
        return self.bound


def check_quantize(x, format, global_scale, scale_layout, group_offsets, rows):
    """The checks of :func:`quantize` (no launch, no sync; safe while torch.compile traces); returns the
    format's :class:`FormatSpec`."""
    spec = format_spec(format)
    if not isinstance(x, torch.Tensor) or x.dtype not in _INPUT_DTYPES:
        raise TypeError(f"x must be a bf16, fp16 or fp32 tensor, got {getattr(x, 'dtype', type(x).__name__)}")
    if x.dim() < 1 or x.shape[-1] % spec.block:
        raise ValueError(f"x's last dim must be a multiple of {spec.block} for {format}, got shape {tuple(x.shape)}")
    layout = as_layout(scale_layout)
    dims = x.dim() if rows is None else 2
    if group_offsets is not None:
        if layout not in (BLOCKED, GROUPED_BLOCKED):
            raise ValueError(f"group_offsets pads {BLOCKED} scales per group: it needs scale_layout={BLOCKED!r}")
        check_group_offsets(group_offsets)
        if dims != 2:
            raise ValueError(f"group_offsets needs a 2D x, got shape {tuple(x.shape)}")
    elif layout.grouped:
        raise ValueError(f"scale_layout={layout.name!r} pads scales per group: it needs group_offsets")
    if not layout.holds(format) or dims < layout.min_dims:
        held = "" if layout.formats is None else " and ".join(sorted(layout.formats)) + " "
        raise ValueError(
            f"scale_layout={layout!r} holds {held}tensors of at least {layout.min_dims} dims, got "
            f"{format} of shape {tuple(x.shape)}"
        )
    if global_scale is not None:
        if not spec.has_global_scale:
            raise ValueError(f"global_scale is for nvfp4 only, not {format}")
        if not isinstance(global_scale, torch.Tensor) or global_scale.numel() != 1:
            raise ValueError("global_scale must be a tensor of one element")
    if rows is not None:
        if not isinstance(rows, torch.Tensor) or rows.dtype not in (torch.int32, torch.int64) or rows.dim() != 1:
            raise TypeError(
                f"rows must be an int32/int64 [R] tensor, got {getattr(rows, 'dtype', type(rows).__name__)}"
            )
        if x.dim() != 2 or (x.shape[0] == 0 and rows.shape[0] > 0):
            raise ValueError(f"rows needs a 2D x with rows to pick from, got shape {tuple(x.shape)}")
    check_device(x=x, global_scale=global_scale, rows=rows, group_offsets=group_offsets)
    forward_only("quantize", x=x, global_scale=global_scale)
    return spec
