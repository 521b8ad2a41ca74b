"""quantize(): checks its input and launches the Triton quantize kernel."""

from __future__ import annotations

import math

import torch
import triton

from .. import runtime
from ..launch import BoundKernel, PlanCache, bind, value_key
from ..runtime import check_device, forward_only, unit_last_stride
from . import kernel
from .layouts import BLOCKED, GROUPED_BLOCKED, ROW, Layout, as_layout, check_group_offsets
from .reference import nvfp4_global_scale
from .scaled_tensor import ScaledTensor, as_block, block_scale_shape
from .spec import format_spec

__all__ = ["quantize", "check_quantize", "PLANS", "GATHER_AFTER_MIN_ELEMENTS"]

_INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# (rows, columns, warps) of one quantize program; lab/scripts/ablate_quantize.py measures the choices.
QUANTIZE_TILE = (16, 256, 4)
# (rows, columns, warps) of one fp8 (128, 128) program: one whole tile, 64 float32 registers a thread.
FP8_TILE = (128, 128, 8)
# ``rows=`` gathers of at least this many elements, with every row of x taken twice or more on average (an MoE
# dispatch's top-k copies), quantize x once and copy the quantized rows: the one-pass kernel reads each source row
# once per copy. H100, CUDA graphs, [T, 2048] bf16 x, 8 copies a token: fp8 (1, 128) 338 -> 208 µs at T = 16384,
# 48 -> 28 µs at 2048, 11.5 -> 10.1 µs at 256 (mxfp8: 285 -> 201, 41 -> 25, 10.7 -> 10.4).
GATHER_AFTER_MIN_ELEMENTS = 1 << 21
# (rows, words, warps) of one program of the quantized rows' copy
GATHER_TILE = (8, 256, 4)


def quantize(
    x: torch.Tensor,
    format: str,
    *,
    global_scale: torch.Tensor | None = None,
    scale_layout: Layout | str = ROW,
    group_offsets: torch.Tensor | None = None,
    rows: torch.Tensor | None = None,
    block: tuple[int, int] | None = None,
    power_of_two_scales: bool = False,
) -> ScaledTensor:
    """Quantizes ``x`` ``[..., K]`` to a block-scaled format with a Triton kernel.

    Args:
        x: bf16, fp16 or fp32 ``[..., K]``; K a multiple of the format's block (32 MX, 16 NVFP4; any K for fp8).
            fp8 with ``block=(128, 128)``: ``[N, K]`` or ``[..., N, K]`` (e.g. ``[E, N, K]`` expert weights).
        format: ``"mxfp8"`` (e4m3 data, e8m0 scale per 32), ``"mxfp4"`` (packed e2m1, e8m0 per 32),
            ``"nvfp4"`` (packed e2m1, e4m3 scale per 16, float32 per-tensor decode scale) or ``"fp8"``
            (DeepSeek-style blocks: e4m3 data, one float32 decode scale per ``block`` tile).
        global_scale: nvfp4 only: float32 scalar decode scale; default ``amax(|x|) / (448 · 6)``,
            floored at 2^-126, computed on the device (:func:`nvfp4_global_scale`).
        scale_layout: a layout or its name: ``"row"`` (``[..., K / block]``, the default), ``"128x4"``
            (tensor-core tiles) or ``"hopper"`` (mxfp4 or nvfp4 of at least 2 dims: data and scales in wgmma
            fragment order, what the grouped matmul reads fastest on Hopper; see :class:`ScaledTensor`).
        group_offsets: int32 ``[G + 1]`` for a 2D x with ``scale_layout="128x4"``: pad the scale tiles
            per group, the layout of the seed's A operand.
        rows: optional int32/int64 ``[R]`` row indices into a 2D x: quantizes ``x[rows]`` (``[R, K]``)
            without materializing it, e.g. the token copies of an MoE dispatch (one pass, or for large gathers
            x quantized once and its quantized rows copied: same bits). Indices are clamped to x's
            rows; nvfp4's default global scale still comes from all of x. fp8: with ``block=(1, 128)`` only.
        block: fp8 only, required: ``(1, 128)`` (activations: one scale per token per 128 columns) or
            ``(128, 128)`` (weights: one scale per 128 x 128 tile of each ``[N, K]`` matrix). The other formats
            take None or their own ``(1, block)``.
        power_of_two_scales: fp8 only: round each scale up to a power of two (DeepSeek V3.1's ue8m0 scales).

    MX scales follow the OCP MX floor rule ``2^(floor(log2(amax)) - emax)``; elements round to
    nearest even and saturate. fp8: each scale is ``amax(|tile|) / 448`` (correctly rounded; floored at
    2^-126; 1.0 for an all-zero tile, so that it decodes to zeros), each element ``x / scale`` (correctly rounded)
    rounded to the nearest e4m3 value; partial last tiles hold the elements there are; the decoded value is
    ``data · scale`` of the element's tile. Same bits as :func:`llmkernels.formats.quantize_reference`.

    Every tensor argument may be any view (strided, expanded, offset): the result equals that of its
    contiguous copy. The nvfp4 ``global_scale`` is a device value and is not checked: it must be
    positive and finite (0 or a negative scale gives NaN or sign-flipped codes).

    Raises:
        TypeError: x is not a floating tensor of a supported dtype; rows or group_offsets of another dtype;
            power_of_two_scales not a bool.
        ValueError: unknown format or scale_layout, K not a multiple of the block, bad global_scale,
            group_offsets without ``scale_layout="128x4"`` or with x not 2D, ``"hopper"`` for mxfp8 or a
            1D x, tensors on different devices,
            x or global_scale requiring grad (quantize is forward-only); fp8: a block other than ``(1, 128)``
            and ``(128, 128)``, a scale layout other than ``"row"``, ``(128, 128)`` with x of one dim or with
            rows; the other formats: a block other than their own, ``power_of_two_scales=True``.
    """
    if (
        type(x) is torch.Tensor
        and type(format) is str
        and scale_layout is ROW
        and power_of_two_scales is False
        and global_scale is None
        and group_offsets is None
        and rows is None
        and block is None
    ):  # the defaults: the key PLANS.lookup makes of them, spelled out (this runs on every call)
        key = (torch.is_grad_enabled(), value_key(x), format, None, _ROW_KEY, None, None, None, _FALSE_KEY)
        plan = PLANS.get(key)
    else:
        key, plan = PLANS.lookup(x, format, global_scale, scale_layout, group_offsets, rows, block, power_of_two_scales)
    if plan is None:
        spec, block = check_quantize(
            x, format, global_scale, scale_layout, group_offsets, rows, block, power_of_two_scales
        )
        if block[0] > 1:
            plan = _TilePlan(x, power_of_two_scales)
        else:
            layout = as_layout(scale_layout, grouped=group_offsets is not None)
            plan = _Plan(spec, format, x, rows, layout, block, power_of_two_scales)
        plan = PLANS.put(key, plan)
    return plan(x, global_scale, group_offsets, rows)


PLANS = PlanCache("quantize")
_ROW_KEY, _FALSE_KEY = value_key(ROW), value_key(False)


class _Plan:
    """Output shapes, the layout to convert the row-layout result to (None: none) and the bound quantize kernel of
    one call signature (no tensor kept)."""

    def __init__(
        self,
        spec,
        format: str,
        x: torch.Tensor,
        rows: torch.Tensor | None,
        layout: Layout,
        block: tuple[int, int],
        power_of_two_scales: bool,
    ):
        self.spec, self.format, self.device = spec, format, x.device
        self.block, self.power_of_two = block, power_of_two_scales
        self.num_cols = x.shape[-1]
        self.num_x_rows = math.prod(x.shape[:-1])
        out_rows_shape = tuple(x.shape[:-1]) if rows is None else (rows.shape[0],)
        self.data_shape = (*out_rows_shape, self.num_cols // 2 if spec.packed else self.num_cols)
        self.scales_shape = (*out_rows_shape, -(-self.num_cols // spec.block))
        # float32 scales are written as such; the 8-bit ones as their bytes
        self.scales_buffer_dtype = torch.float32 if spec.scale == "f32" else torch.uint8
        self.num_rows = self.num_x_rows if rows is None else rows.shape[0]
        self.gather = rows is not None
        self.is_2d = x.dim() == 2
        self.data_dtype, self.scale_dtype = spec.data_dtype, spec.scale_dtype
        self.launches = self.num_rows > 0 and self.num_cols > 0  # rows > 0 with an empty x was rejected
        self.layout = None if layout is ROW else layout
        self.has_global_scale = spec.has_global_scale
        # x as the kernel reads it is x itself for a 2D x with unit-stride rows (its strides are in the key)
        self.x_as_given = self.is_2d and unit_last_stride(x) is x
        self.bound = None
        self.whole = None  # the plan of x quantized whole, for large gathers (GATHER_AFTER_MIN_ELEMENTS)
        self.gather_bound = None  # and the bound copy of its rows

    def __call__(self, x, global_scale, group_offsets, rows) -> ScaledTensor:
        if (
            self.gather
            and self.launches
            and self.num_rows >= 2 * self.num_x_rows
            and self.num_rows * self.num_cols >= GATHER_AFTER_MIN_ELEMENTS
        ):
            return self._quantize_then_gather(x, global_scale, group_offsets, rows)
        if self.x_as_given:
            x2d = x
        else:
            x2d = unit_last_stride(x if self.is_2d else x.reshape(self.num_x_rows, self.num_cols))  # a view if it can
        data = runtime.new_buffer(self.data_shape, self.data_dtype, self.device)
        scales = runtime.new_buffer(self.scales_shape, self.scales_buffer_dtype, self.device)
        if self.has_global_scale:
            global_scale = nvfp4_global_scale(x) if global_scale is None else global_scale.float().reshape(())
        if self.launches:
            rows = scales if rows is None else rows.contiguous()  # read as a dense vector (only with GATHER)
            data_bytes = data.view(torch.uint8)
            bound = self.bound or self._bind((x2d, data_bytes, scales, global_scale, rows))
            if global_scale is None:  # a None argument is a constant of the compiled kernel, not passed
                bound(x2d, data_bytes, scales, rows)
            else:
                bound(x2d, data_bytes, scales, global_scale, rows)
        return self._result(data, scales, global_scale, group_offsets)

    def _quantize_then_gather(self, x, global_scale, group_offsets, rows) -> ScaledTensor:
        """``rows=``'s result as x quantized once, then its rows copied (same bits: rows are quantized alone)."""
        if self.whole is None:
            self.whole = _Plan(self.spec, self.format, x, None, ROW, self.block, self.power_of_two)
        if self.has_global_scale and global_scale is None:
            global_scale = nvfp4_global_scale(x)
        whole = self.whole(x, global_scale, None, None)
        data = runtime.new_buffer(self.data_shape, self.data_dtype, self.device)
        scales = runtime.new_buffer(self.scales_shape, self.scales_buffer_dtype, self.device)
        # data and scales as rows of words of one integer type (the narrower row decides; one kernel copies both)
        data_bytes = data.numel() // self.num_rows * data.element_size()
        scale_bytes = scales.numel() // self.num_rows * scales.element_size()
        word = _widest_word(math.gcd(data_bytes, scale_bytes))
        words = [t.view(torch.uint8).view(-1).view(word) for t in (whole.data, whole.scales, data, scales)]
        rows = rows.contiguous()
        if self.gather_bound is None:
            data_words, scale_words = data_bytes // word.itemsize, scale_bytes // word.itemsize
            block_rows, block_words, num_warps = GATHER_TILE
            block_words = max(block_words, triton.next_power_of_2(scale_words))
            self.gather_bound = bind(
                kernel.gather_rows_kernel,
                (triton.cdiv(self.num_rows, block_rows), triton.cdiv(data_words, block_words)),
                rows,
                *words,
                self.num_rows,
                self.num_x_rows,
                data_words,
                scale_words,
                BLOCK_ROWS=block_rows,
                BLOCK_WORDS=block_words,
                num_warps=num_warps,
            )
        self.gather_bound(rows, *words)
        return self._result(data, scales, whole.global_scale, group_offsets)

    def _result(self, data, scales, global_scale, group_offsets) -> ScaledTensor:
        """The row-layout data and scale buffers as the call's ScaledTensor, in its layout."""
        result = ScaledTensor.unchecked(
            data, scales.view(self.scale_dtype), self.format, global_scale, ROW, block=self.block
        )
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
            POWER_OF_TWO=self.power_of_two,
            num_warps=num_warps,
        )
        return self.bound


def _widest_word(row_bytes: int) -> torch.dtype:
    """The widest integer type whose size divides ``row_bytes``: rows copied as words of it."""
    for dtype in (torch.int64, torch.int32, torch.int16):
        if row_bytes % dtype.itemsize == 0:
            return dtype
    return torch.uint8


class _TilePlan:
    """fp8 with ``(128, 128)`` blocks: the output shapes and the bound tile kernel of one call signature (x seen as
    ``[matrices, N, K]``; no tensor kept)."""

    def __init__(self, x: torch.Tensor, power_of_two_scales: bool):
        self.device, self.shape = x.device, tuple(x.shape)
        self.matrix_shape = (math.prod(x.shape[:-2]), x.shape[-2], x.shape[-1])
        self.scales_shape = block_scale_shape(self.shape, (FP8_TILE[0], FP8_TILE[1]))
        self.power_of_two = power_of_two_scales
        self.launches = x.numel() > 0
        self.bound = None

    def __call__(self, x, global_scale, group_offsets, rows) -> ScaledTensor:
        data = runtime.new_buffer(self.shape, torch.float8_e4m3fn, self.device)
        scales = runtime.new_buffer(self.scales_shape, torch.float32, self.device)
        if self.launches:
            matrices = unit_last_stride(x.reshape(self.matrix_shape))  # a view if it can
            data_bytes = data.view(torch.uint8)
            bound = self.bound or self._bind(matrices, data_bytes, scales)
            bound(matrices, data_bytes, scales)
        return ScaledTensor.unchecked(data, scales, "fp8", block=(FP8_TILE[0], FP8_TILE[1]))

    def _bind(self, matrices, data_bytes, scales) -> BoundKernel:
        tile_rows, tile_cols, num_warps = FP8_TILE
        num_matrices, num_rows, num_cols = self.matrix_shape
        grid = (triton.cdiv(num_rows, tile_rows), triton.cdiv(num_cols, tile_cols), num_matrices)
        self.bound = bind(
            kernel.quantize_tiles_kernel,
            grid,
            matrices,
            data_bytes,
            scales,
            matrices.stride(0),
            matrices.stride(1),
            num_rows,
            num_cols,
            POWER_OF_TWO=self.power_of_two,
            TILE_ROWS=tile_rows,
            TILE_COLS=tile_cols,
            num_warps=num_warps,
        )
        return self.bound


def check_quantize(
    x, format, global_scale, scale_layout, group_offsets, rows, block=None, power_of_two_scales=False
) -> tuple:
    """The checks of :func:`quantize` (no launch, no sync; safe while torch.compile traces); returns the
    format's :class:`FormatSpec` and the block ``(rows, cols)`` (a tuple)."""
    spec = format_spec(format)
    block = as_block(spec, block)
    if type(power_of_two_scales) is not bool:
        raise TypeError(f"power_of_two_scales must be a bool, got {type(power_of_two_scales).__name__}")
    if power_of_two_scales and spec.scale != "f32":
        raise ValueError(f"power_of_two_scales is for fp8 only, not {format}")
    if not isinstance(x, torch.Tensor) or x.dtype not in _INPUT_DTYPES:
        raise TypeError(f"x must be a bf16, fp16 or fp32 tensor, got {getattr(x, 'dtype', type(x).__name__)}")
    if spec.scale == "f32":
        min_dims = 2 if block[0] > 1 else 1
        if x.dim() < min_dims:
            raise ValueError(f"fp8 with block={block} needs x of at least {min_dims} dims, got shape {tuple(x.shape)}")
        if as_layout(scale_layout) is not ROW:
            raise ValueError(f"fp8 scales live in the row layout only, got scale_layout={scale_layout!r}")
        if block[0] > 1 and rows is not None:
            raise ValueError(f"rows gathers tokens: it goes with block=(1, 128), not block={block}")
    elif x.dim() < 1 or x.shape[-1] % spec.block:
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
    return spec, block
