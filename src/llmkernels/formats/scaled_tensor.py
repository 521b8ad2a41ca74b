"""ScaledTensor: quantized data with its block scales."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..launch import value_key
from ..runtime import describe
from . import layout as scale_layouts
from .fragments import (FRAGMENT_K, FRAGMENT_ROWS, fragment_scales_per_chunk, from_hopper_fragments,
                        to_hopper_fragments)
from .layout import OFFSET_DTYPES, TILE_ROWS, TILE_SCALE_COLS, check_group_offsets
from .spec import FormatSpec, format_spec

__all__ = ["ScaledTensor", "SCALE_LAYOUTS", "HOPPER_FORMATS", "OFFSET_DTYPES", "PLAIN_FORMATS", "scaled_tensor_parts",
           "scaled_tensor_from_parts"]

SCALE_LAYOUTS = ("row", "128x4", "hopper")
HOPPER_FORMATS = ("mxfp4", "nvfp4")  # what the hopper layout holds (e2m1 data)
PLAIN_FORMATS = ("bf16", "fp16")  # what scaled_tensor_parts calls a plain bf16 / fp16 tensor


@dataclass
class ScaledTensor:
    """A block-scaled tensor of logical shape ``[..., K]``.

    Attributes:
        data: ``float8_e4m3fn [..., K]`` (mxfp8) or ``uint8 [..., K // 2]`` (mxfp4, nvfp4; two e2m1
            values per byte, the even element in the low nibble).
        scales: one scale per ``block`` elements along K. ``scale_layout="row"``: ``[..., R, K // block]``
            row-major. ``"128x4"``: the tensor-core layout ``[..., ceil(R / 128), ceil(K / block / 4), 32, 16]``
            (byte ``(r % 32) * 16 + (r % 128) // 32 * 4 + c % 4`` of tile ``(r // 128, c // 4)``), padded with 1.0.
            dtype ``float8_e8m0fnu`` (MX) or ``float8_e4m3fn`` (nvfp4).
        format: ``"mxfp8"``, ``"mxfp4"`` or ``"nvfp4"``.
        global_scale: nvfp4 only, float32 scalar tensor: the **decode** scale,
            ``x ≈ e2m1 · block_scale · global_scale``.
        scale_layout: ``"row"``, ``"128x4"`` or ``"hopper"``. ``"hopper"`` (MXFP4 and NVFP4, at least 2D)
            rearranges the data too: both in Hopper's wgmma register-fragment order
            (:mod:`llmkernels.formats.fragments`), data uint8 ``[..., ceil(N/16), ceil(K/64), 8, 4, 16]`` and
            scales ``[..., ceil(N/16), ceil(K/64), 8, 2, 64 / block]`` (2 for MXFP4, 4 for NVFP4) of the logical
            ``[..., N, K]``, padded with zero codes and unit scales. Made once from the row layout by :meth:`to_layout`; the grouped matmul's Hopper
            kernel reads it without a shared-memory round trip.
        group_offsets, group_scale_offsets: set only for a 2D tensor whose 128x4 scales are padded per
            group (the seed's A operand): int32 ``[G + 1]`` row offsets of the groups and the seed's
            ``a_scale_offsets`` int32 ``[G]``. Group g's scale rows start at tile-row
            ``group_offsets[g] // 128 + group_scale_offsets[g]``.
    """

    data: torch.Tensor
    scales: torch.Tensor
    format: str
    global_scale: torch.Tensor | None = None
    scale_layout: str = "row"
    group_offsets: torch.Tensor | None = None
    group_scale_offsets: torch.Tensor | None = None
    logical_shape: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Checks that the parts fit together: dtypes, shapes, one device. Run at construction and again by
        every kernel that reads the tensor (fields can be re-assigned, tensors resized in place), so that a
        scale tensor too small for the data is an error, never a read past its end.

        Raises:
            TypeError: a part of the wrong type or dtype.
            ValueError: shapes that do not fit, an unknown layout, parts on different devices.
        """
        spec = self.spec
        if not isinstance(self.data, torch.Tensor) or self.data.dtype != spec.data_dtype:
            raise TypeError(f"{self.format} data must be a {spec.data_dtype} tensor, got {describe(self.data)}")
        if not isinstance(self.scales, torch.Tensor) or self.scales.dtype != spec.scale_dtype:
            raise TypeError(f"{self.format} scales must be a {spec.scale_dtype} tensor, got {describe(self.scales)}")
        if self.scale_layout not in SCALE_LAYOUTS:
            raise ValueError(f"scale_layout must be one of {SCALE_LAYOUTS}, got {self.scale_layout!r}")
        if self.scale_layout == "hopper" or self.logical_shape is not None:
            self._check_hopper()
        elif self.data.dim() < (2 if self.scale_layout == "128x4" else 1):
            raise ValueError(f"data of shape {tuple(self.data.shape)} has too few dimensions for {self.scale_layout} scales")
        if spec.has_global_scale:
            gs = self.global_scale
            if not isinstance(gs, torch.Tensor) or gs.dtype != torch.float32 or gs.numel() != 1:
                raise TypeError(f"nvfp4 needs global_scale, a float32 tensor of one element, got {describe(gs)}")
        elif self.global_scale is not None:
            raise ValueError(f"{self.format} has no global_scale")
        grouped = self.group_offsets is not None or self.group_scale_offsets is not None
        if grouped and (self.scale_layout != "128x4" or self.data.dim() != 2
                        or self.group_offsets is None or self.group_scale_offsets is None):
            raise ValueError("group_offsets and group_scale_offsets go together, on a 2D tensor with 128x4 scales")
        if grouped:
            offsets, scale_offsets = self.group_offsets, self.group_scale_offsets
            check_group_offsets(offsets)
            if (not isinstance(scale_offsets, torch.Tensor) or scale_offsets.dtype != torch.int32
                    or tuple(scale_offsets.shape) != (offsets.numel() - 1,)):
                raise TypeError(f"group_scale_offsets must be an int32 [G] tensor with G = {offsets.numel() - 1}, "
                                f"got {describe(scale_offsets)}")
        parts = {"data": self.data, "scales": self.scales, "global_scale": self.global_scale,
                 "group_offsets": self.group_offsets, "group_scale_offsets": self.group_scale_offsets}
        devices = {name: t.device for name, t in parts.items() if t is not None}
        if len(set(devices.values())) > 1:
            raise ValueError(f"ScaledTensor parts must share one device, got {devices}")
        self._check_scale_shape()

    def _check_hopper(self) -> None:
        shape = self.logical_shape
        if self.scale_layout != "hopper" or self.format not in HOPPER_FORMATS:
            raise ValueError(f"logical_shape goes with scale_layout='hopper', which holds mxfp4 and nvfp4; got "
                             f"{self.format} with scale_layout={self.scale_layout!r}")
        if (not isinstance(shape, tuple) or len(shape) < 2
                or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)):
            raise ValueError(f"the hopper layout needs logical_shape, a tuple of >= 2 non-negative ints [..., N, K], "
                             f"got {shape!r}")
        *lead, n, k = shape
        blocks = (*lead, -(-n // FRAGMENT_ROWS), -(-k // FRAGMENT_K), 8)
        scale_shape = (*blocks, 2, fragment_scales_per_chunk(self.spec.block))
        if tuple(self.data.shape) != (*blocks, 4, 16) or tuple(self.scales.shape) != scale_shape:
            raise ValueError(f"hopper-layout data and scales of shapes {tuple(self.data.shape)} and "
                             f"{tuple(self.scales.shape)} do not fit logical shape {shape} (expected {(*blocks, 4, 16)} and {scale_shape})")
        if self.group_offsets is not None or self.group_scale_offsets is not None:
            raise ValueError("group offsets go with 128x4 scales, not the hopper layout")

    def _check_scale_shape(self) -> None:
        if self.shape[-1] % self.spec.block:
            raise ValueError(f"{self.format} needs K = {self.shape[-1]} to be a multiple of {self.spec.block}")
        if self.scale_layout == "hopper":  # its shapes were checked against the logical shape (_check_hopper)
            return
        rows_shape = tuple(self.data.shape[:-1])
        scale_cols = self.shape[-1] // self.spec.block
        if self.scale_layout == "row":
            expected = rows_shape + (scale_cols,)
            ok = tuple(self.scales.shape) == expected
        elif self.group_offsets is not None:
            expected = ("tile_rows", -(-scale_cols // TILE_SCALE_COLS), 32, 16)
            ok = self.scales.dim() == 4 and tuple(self.scales.shape[1:]) == expected[1:]
        else:
            row_tiles = -(-rows_shape[-1] // TILE_ROWS)
            expected = rows_shape[:-1] + (row_tiles, -(-scale_cols // TILE_SCALE_COLS), 32, 16)
            ok = tuple(self.scales.shape) == expected
        if not ok:
            raise ValueError(
                f"scales of shape {tuple(self.scales.shape)} do not fit data of logical shape {self.shape} "
                f"in layout {self.scale_layout!r} (expected {expected})"
            )

    @classmethod
    def unchecked(cls, data, scales, format, global_scale=None, scale_layout="row", group_offsets=None,
                  group_scale_offsets=None, logical_shape=None) -> "ScaledTensor":
        """A ScaledTensor from parts a kernel just made to fit (no :meth:`validate`: the hot path of
        :func:`llmkernels.quantize`). While torch.compile traces, the checked constructor (what Dynamo reads
        best; tracing costs nothing at run time)."""
        if torch.compiler.is_compiling():
            return cls(data, scales, format, global_scale, scale_layout, group_offsets, group_scale_offsets,
                       logical_shape)
        tensor = object.__new__(cls)
        tensor.__dict__.update(data=data, scales=scales, format=format, global_scale=global_scale,
                               scale_layout=scale_layout, group_offsets=group_offsets,
                               group_scale_offsets=group_scale_offsets, logical_shape=logical_shape)
        return tensor

    def plan_key(self) -> tuple:
        """What a kernel's plan depends on (:func:`llmkernels.launch.value_key`): format, layout and the
        parts' dtypes, shapes, strides, alignment and devices. Equal keys pass :meth:`validate` alike."""
        optional = (self.global_scale, self.group_offsets, self.group_scale_offsets, self.logical_shape)
        if optional == (None, None, None, None):  # the common case, spelled out: this runs on every call
            return "ScaledTensor", self.format, self.scale_layout, value_key(self.data), value_key(self.scales)
        return ("ScaledTensor", self.format, self.scale_layout, value_key(self.data), value_key(self.scales),
                *map(value_key, optional[:3]), self.logical_shape)

    @property
    def spec(self) -> FormatSpec:
        return format_spec(self.format)

    @property
    def shape(self) -> torch.Size:
        """The logical shape ``[..., K]`` (packed data holds K / 2 bytes per row)."""
        if self.logical_shape is not None:
            return torch.Size(self.logical_shape)
        if self.spec.packed:
            return torch.Size((*self.data.shape[:-1], self.data.shape[-1] * 2))
        return self.data.shape

    @property
    def device(self) -> torch.device:
        return self.data.device

    def dim(self) -> int:
        return len(self.shape)

    def row_data(self) -> torch.Tensor:
        """The data in the row layout ``[..., K]`` (``[..., K / 2]`` packed; a copy for the hopper layout)."""
        if self.scale_layout != "hopper":
            return self.data
        return self._from_hopper()[0].view(self.spec.data_dtype)

    def _from_hopper(self) -> tuple[torch.Tensor, torch.Tensor]:
        *_, n, k = self.shape
        return from_hopper_fragments(self.data.view(torch.uint8), self.scales.view(torch.uint8), n, k)

    def row_scales(self) -> torch.Tensor:
        """The scales in the row-major layout ``[..., R, K / block]`` (a copy unless already row-major)."""
        if self.scale_layout == "row":
            return self.scales
        if self.scale_layout == "hopper":
            return self._from_hopper()[1].view(self.spec.scale_dtype)
        rows, cols = self.shape[-2], self.shape[-1] // self.spec.block
        if self.group_offsets is not None:
            return scale_layouts.from_grouped_blocked_scales(self.scales, self.group_offsets, rows, cols)
        return scale_layouts.from_blocked_scales(self.scales, rows, cols)

    def to_layout(self, layout: str, group_offsets: torch.Tensor | None = None) -> "ScaledTensor":
        """The same tensor in ``layout``: ``"row"`` or ``"128x4"`` (scales), or ``"hopper"`` (data and scales
        of an MXFP4 or NVFP4 tensor of at least 2 dims in wgmma fragment order; see the class). Exact both ways.

        ``group_offsets`` (int32 ``[G + 1]``, 2D tensors only): pad the 128x4 scales per group, as the
        seed's A operand needs (see :func:`llmkernels.formats.to_grouped_blocked_scales`).

        Raises:
            ValueError: an unknown layout, ``"hopper"`` for mxfp8, a 1D tensor or with group offsets.
        """
        if layout not in SCALE_LAYOUTS:
            raise ValueError(f"layout must be one of {SCALE_LAYOUTS}, got {layout!r}")
        if layout == self.scale_layout == "hopper" and group_offsets is None:
            return self
        if self.scale_layout == "hopper":
            data, row_scales = self._from_hopper()
            data, row_scales = data.view(self.spec.data_dtype), row_scales.view(self.spec.scale_dtype)
        else:
            data, row_scales = self.data, self.row_scales()
        if layout == "row":
            return ScaledTensor(data, row_scales, self.format, self.global_scale)
        if layout == "hopper":
            if self.format not in HOPPER_FORMATS or self.dim() < 2 or group_offsets is not None:
                raise ValueError(f"the hopper layout holds mxfp4 and nvfp4 tensors of at least 2 dims "
                                 f"without group offsets, got {self.format} of shape {tuple(self.shape)}")
            fragment_data, fragment_scales = to_hopper_fragments(data, row_scales, self.spec.block,
                                                                 self.spec.scale_one_bits)
            return ScaledTensor(fragment_data, fragment_scales.view(self.spec.scale_dtype), self.format,
                                self.global_scale, scale_layout="hopper", logical_shape=tuple(self.shape))
        if group_offsets is None:
            return ScaledTensor(data, scale_layouts.to_blocked_scales(row_scales), self.format, self.global_scale,
                                "128x4")
        blocked, group_scale_offsets = scale_layouts.to_grouped_blocked_scales(row_scales, group_offsets)
        return ScaledTensor(data, blocked, self.format, self.global_scale, "128x4", group_offsets,
                            group_scale_offsets)


def scaled_tensor_parts(x) -> tuple:
    """``(data, scales, global_scale, format, scale_layout, group_offsets, group_scale_offsets, shape)`` of a
    ScaledTensor (data and scales as their uint8 bytes, which every backend can carry; ``shape`` its logical
    shape as a list), or of a plain bf16/fp16 tensor (format ``"bf16"``/``"fp16"``, no scales)."""
    if isinstance(x, ScaledTensor):
        return (x.data.view(torch.uint8), x.scales.view(torch.uint8), x.global_scale, x.format, x.scale_layout,
                x.group_offsets, x.group_scale_offsets, list(x.shape))
    return x, None, None, "fp16" if x.dtype == torch.float16 else "bf16", "row", None, None, list(x.shape)


def scaled_tensor_from_parts(data, scales, global_scale, format, scale_layout="row", group_offsets=None,
                             group_scale_offsets=None, shape=None):
    """The inverse of :func:`scaled_tensor_parts` (data and scales may be any same-size view; ``shape`` is
    read for the hopper layout only)."""
    if format in PLAIN_FORMATS:
        return data
    spec = format_spec(format)
    logical_shape = tuple(int(d) for d in shape) if scale_layout == "hopper" else None
    return ScaledTensor(data.view(spec.data_dtype), scales.view(spec.scale_dtype), format, global_scale,
                        scale_layout, group_offsets, group_scale_offsets, logical_shape)

