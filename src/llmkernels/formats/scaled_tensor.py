"""ScaledTensor: quantized data with its block scales."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..launch import value_key
from ..runtime import describe
from .layouts import BLOCKED, HOPPER, ROW, SCALE_LAYOUTS, Layout, as_layout, check_group_offsets
from .spec import FORMATS, FP8_BLOCKS, FormatSpec, format_spec

__all__ = [
    "ScaledTensor",
    "SCALE_LAYOUTS",
    "HOPPER_FORMATS",
    "PLAIN_FORMATS",
    "scaled_tensor_parts",
    "scaled_tensor_from_parts",
    "as_block",
    "block_scale_shape",
]

HOPPER_FORMATS = tuple(sorted(HOPPER.formats))  # what the hopper layout holds (e2m1 data)
PLAIN_FORMATS = ("bf16", "fp16")  # what scaled_tensor_parts calls a plain bf16 / fp16 tensor


@dataclass
class ScaledTensor:
    """A block-scaled tensor of logical shape ``[..., K]``.

    Attributes:
        data: ``float8_e4m3fn [..., K]`` (mxfp8, fp8) or ``uint8 [..., K // 2]`` (mxfp4, nvfp4; two e2m1
            values per byte, the even element in the low nibble).
        scales: one scale per ``block`` elements along K. ``scale_layout="row"``: ``[..., R, K // block]``
            row-major. fp8: float32 ``[..., ceil(R / rows), ceil(K / cols)]`` for ``block=(rows, cols)``
            (``[..., ceil(K / 128)]`` for ``(1, 128)``, which a 1D tensor may have too), row layout only. ``"128x4"``: the tensor-core layout ``[..., ceil(R / 128), ceil(K / block / 4), 32, 16]``
            (byte ``(r % 32) * 16 + (r % 128) // 32 * 4 + c % 4`` of tile ``(r // 128, c // 4)``), padded with 1.0.
            dtype ``float8_e8m0fnu`` (MX) or ``float8_e4m3fn`` (nvfp4).
        format: ``"mxfp8"``, ``"mxfp4"``, ``"nvfp4"`` or ``"fp8"`` (DeepSeek-style blocks: e4m3 data, one float32
            decode scale per ``block`` tile, ``x ≈ data · scale``; K any, partial last tiles allowed).
        global_scale: nvfp4 only, float32 scalar tensor: the **decode** scale,
            ``x ≈ e2m1 · block_scale · global_scale``.
        scale_layout: the :class:`~llmkernels.formats.layouts.Layout` of the parts, given as one or by its name
            (``"row"``, ``"128x4"``, ``"hopper"``; ``"128x4_grouped"`` for 128x4 scales padded per group, which
            ``"128x4"`` with group offsets also means); it compares equal to and prints as that name (``"128x4"``
            for the grouped one). ``"hopper"`` (MXFP4 and NVFP4, at least 2D) rearranges the data too: both in
            Hopper's wgmma register-fragment order (:mod:`llmkernels.formats.layouts.hopper`), data uint8
            ``[..., ceil(N/16), ceil(K/64), 8, 4, 16]`` and scales ``[..., ceil(N/16), ceil(K/64), 8, 2, 64 / block]``
            (2 for MXFP4, 4 for NVFP4) of the logical ``[..., N, K]``, padded with zero codes and unit scales. Made
            once from the row layout by :meth:`to_layout`; the grouped matmul's Hopper kernel reads it without a
            shared-memory round trip.
        group_offsets, group_scale_offsets: set only for a 2D tensor whose 128x4 scales are padded per
            group (the seed's A operand): int32 ``[G + 1]`` row offsets of the groups and the seed's
            ``a_scale_offsets`` int32 ``[G]``. Group g's scale rows start at tile-row
            ``group_offsets[g] // 128 + group_scale_offsets[g]``.
        logical_shape: the logical shape, for a layout that rearranges the data (``"hopper"``) only.
        block: ``(rows, cols)``, the elements of the last two dims that share one scale; after construction always
            a tuple: ``(1, 32)`` (MX) or ``(1, 16)`` (nvfp4), which None also means, and for fp8 required:
            ``(1, 128)`` (activations, per token) or ``(128, 128)`` (weights, per tile of each ``[N, K]``).
    """

    data: torch.Tensor
    scales: torch.Tensor
    format: str
    global_scale: torch.Tensor | None = None
    scale_layout: Layout | str = ROW.name  # a name as the default: Dynamo takes it as a constant in __init__
    group_offsets: torch.Tensor | None = None
    group_scale_offsets: torch.Tensor | None = None
    logical_shape: tuple[int, ...] | None = None
    block: tuple[int, int] | None = None

    def __setattr__(self, name, value) -> None:
        if name == "scale_layout":  # assigned a layout or its name, it holds the layout
            value = as_layout(value)
        object.__setattr__(self, name, value)

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
        self.block = block = as_block(spec, self.block)
        if not isinstance(self.data, torch.Tensor) or self.data.dtype != spec.data_dtype:
            raise TypeError(f"{self.format} data must be a {spec.data_dtype} tensor, got {describe(self.data)}")
        if not isinstance(self.scales, torch.Tensor) or self.scales.dtype != spec.scale_dtype:
            raise TypeError(f"{self.format} scales must be a {spec.scale_dtype} tensor, got {describe(self.scales)}")
        grouped = self.group_offsets is not None or self.group_scale_offsets is not None
        layout = self.scale_layout
        if grouped and layout is BLOCKED:  # "128x4" with group offsets: its per-group padding
            layout = self.scale_layout = as_layout(layout, grouped=True)
        if self.logical_shape is not None and not layout.rearranges_data:
            raise ValueError(
                f"logical_shape goes with a layout that rearranges the data ({HOPPER!r}, which holds "
                f"{' and '.join(HOPPER_FORMATS)}); got {self.format} with scale_layout={layout!r}"
            )
        layout.check_dims(self)
        if spec.scale == "f32":
            if layout is not ROW:
                raise ValueError(f"fp8 scales live in the row layout only, got scale_layout={layout!r}")
            if block[0] > 1 and self.data.dim() < 2:
                raise ValueError(f"fp8 with block={block} needs data of at least 2 dims, got {describe(self.data)}")
        if spec.has_global_scale:
            gs = self.global_scale
            if not isinstance(gs, torch.Tensor) or gs.dtype != torch.float32 or gs.numel() != 1:
                raise TypeError(f"nvfp4 needs global_scale, a float32 tensor of one element, got {describe(gs)}")
        elif self.global_scale is not None:
            raise ValueError(f"{self.format} has no global_scale")
        if (grouped or layout.grouped) and (
            not layout.grouped or self.data.dim() != 2 or self.group_offsets is None or self.group_scale_offsets is None
        ):
            raise ValueError("group_offsets and group_scale_offsets go together, on a 2D tensor with 128x4 scales")
        if grouped:
            offsets, scale_offsets = self.group_offsets, self.group_scale_offsets
            check_group_offsets(offsets)
            if (
                not isinstance(scale_offsets, torch.Tensor)
                or scale_offsets.dtype != torch.int32
                or tuple(scale_offsets.shape) != (offsets.numel() - 1,)
            ):
                raise TypeError(
                    f"group_scale_offsets must be an int32 [G] tensor with G = {offsets.numel() - 1}, "
                    f"got {describe(scale_offsets)}"
                )
        parts = {
            "data": self.data,
            "scales": self.scales,
            "global_scale": self.global_scale,
            "group_offsets": self.group_offsets,
            "group_scale_offsets": self.group_scale_offsets,
        }
        devices = {name: t.device for name, t in parts.items() if t is not None}
        if len(set(devices.values())) > 1:
            raise ValueError(f"ScaledTensor parts must share one device, got {devices}")
        if spec.scale == "f32":
            expected = block_scale_shape(tuple(self.data.shape), block)
            if tuple(self.scales.shape) != expected:
                raise ValueError(
                    f"fp8 scales of shape {tuple(self.scales.shape)} do not fit data of shape "
                    f"{tuple(self.data.shape)} with block={block} (expected {expected})"
                )
            return
        if self.shape[-1] % spec.block:
            raise ValueError(f"{self.format} needs K = {self.shape[-1]} to be a multiple of {spec.block}")
        layout.check_scales(self)

    @classmethod
    def unchecked(
        cls,
        data,
        scales,
        format,
        global_scale=None,
        scale_layout=ROW.name,
        group_offsets=None,
        group_scale_offsets=None,
        logical_shape=None,
        block=None,
    ) -> ScaledTensor:
        """A ScaledTensor from parts a kernel just made to fit (no :meth:`validate`: the hot path of
        :func:`llmkernels.quantize`; ``block`` as the kernel made it, a tuple, None for the formats whose
        block is ``(1, spec.block)``). While torch.compile traces, the checked constructor (what Dynamo reads
        best; tracing costs nothing at run time)."""
        if torch.compiler.is_compiling():
            return cls(
                data,
                scales,
                format,
                global_scale,
                scale_layout,
                group_offsets,
                group_scale_offsets,
                logical_shape,
                block,
            )
        tensor = object.__new__(cls)
        tensor.__dict__.update(
            data=data,
            scales=scales,
            format=format,
            global_scale=global_scale,
            scale_layout=ROW if scale_layout is ROW else as_layout(scale_layout, grouped=group_offsets is not None),
            group_offsets=group_offsets,
            group_scale_offsets=group_scale_offsets,
            logical_shape=logical_shape,
            block=block or _DEFAULT_BLOCKS.get(format),  # fp8's None stays None: validate() then says so
        )
        return tensor

    def plan_key(self) -> tuple:
        """What a kernel's plan depends on (:func:`llmkernels.launch.value_key`): format, layout and the
        parts' dtypes, shapes, strides, alignment and devices, and the block. Equal keys pass :meth:`validate`
        alike."""
        layout = self.scale_layout.plan_key()
        if (  # the common case, spelled out: this runs on every call
            self.global_scale is None
            and self.group_offsets is None
            and self.group_scale_offsets is None
            and self.logical_shape is None
        ):
            return "ScaledTensor", self.format, layout, value_key(self.data), value_key(self.scales), self.block
        optional = (self.global_scale, self.group_offsets, self.group_scale_offsets)
        return (
            "ScaledTensor",
            self.format,
            layout,
            value_key(self.data),
            value_key(self.scales),
            self.block,
            *map(value_key, optional),
            self.logical_shape,
        )

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
        """The data in the row layout ``[..., K]`` (``[..., K / 2]`` packed; a copy where the layout rearranges it)."""
        if not self.scale_layout.rearranges_data:
            return self.data
        return self.scale_layout.unpack(self)[0]

    def row_scales(self) -> torch.Tensor:
        """The scales in the row-major layout ``[..., R, K / block]`` (a copy unless already row-major)."""
        return self.scale_layout.unpack(self)[1]

    def to_layout(self, layout, group_offsets: torch.Tensor | None = None) -> ScaledTensor:
        """The same tensor in ``layout`` (a :class:`~llmkernels.formats.layouts.Layout` or its name, one of
        :data:`SCALE_LAYOUTS`): ``"row"`` or ``"128x4"`` (scales), or ``"hopper"`` (data and scales of an MXFP4 or
        NVFP4 tensor of at least 2 dims in wgmma fragment order; see the class). Exact both ways.

        ``group_offsets`` (int32 ``[G + 1]``, 2D tensors only): pad the 128x4 scales per group, as the
        seed's A operand needs (see :func:`llmkernels.formats.to_grouped_blocked_scales`); ignored by ``"row"``.

        Raises:
            ValueError: an unknown layout, ``"hopper"`` for mxfp8, a 1D tensor or with group offsets, a layout other
                than ``"row"`` for fp8.
        """
        target = as_layout(layout, grouped=group_offsets is not None, argument="layout")
        if self.spec.scale == "f32" and target is not ROW:
            raise ValueError(f"fp8 scales live in the row layout only, got layout={target!r}")
        if target is self.scale_layout and target.rearranges_data and group_offsets is None:
            return self
        data, row_scales = self.scale_layout.unpack(self)
        if target is ROW:
            return ScaledTensor(data, row_scales, self.format, self.global_scale, block=self.block)
        parts = target.pack(data, row_scales, self.spec, tuple(self.shape), group_offsets)
        return ScaledTensor(
            parts.data,
            parts.scales,
            self.format,
            self.global_scale,
            target,
            parts.group_offsets,
            parts.group_scale_offsets,
            parts.logical_shape,
        )


def scaled_tensor_parts(x) -> tuple:
    """``(data, scales, global_scale, format, scale_layout, group_offsets, group_scale_offsets, shape, block)`` of a
    ScaledTensor (data and scales as their uint8 bytes, which every backend can carry; ``scale_layout`` the
    layout's name; ``shape`` its logical shape and ``block`` its ``(rows, cols)``, as lists), or of a plain
    bf16/fp16 tensor (format ``"bf16"``/``"fp16"``, no scales, block None)."""
    if isinstance(x, ScaledTensor):
        return (
            x.data.view(torch.uint8),
            x.scales.view(torch.uint8),
            x.global_scale,
            x.format,
            x.scale_layout.name,
            x.group_offsets,
            x.group_scale_offsets,
            list(x.shape),
            list(x.block),
        )
    plain = "fp16" if x.dtype == torch.float16 else "bf16"
    return x, None, None, plain, ROW.name, None, None, list(x.shape), None


def scaled_tensor_from_parts(
    data,
    scales,
    global_scale,
    format,
    scale_layout=ROW,
    group_offsets=None,
    group_scale_offsets=None,
    shape=None,
    block=None,
):
    """The inverse of :func:`scaled_tensor_parts` (data and scales may be any same-size view; ``shape`` is
    read for a layout that rearranges the data only; ``block`` a pair or None, as :class:`ScaledTensor` takes it).
    A float32 scale tensor travels as its bytes: the last dim of its uint8 view is 4 times the scales'."""
    if format in PLAIN_FORMATS:
        return data
    spec = format_spec(format)
    layout = as_layout(scale_layout, grouped=group_offsets is not None)
    logical_shape = tuple(int(d) for d in shape) if layout.rearranges_data else None
    return ScaledTensor(
        data.view(spec.data_dtype),
        scales.view(spec.scale_dtype),
        format,
        global_scale,
        layout,
        group_offsets,
        group_scale_offsets,
        logical_shape,
        None if block is None else tuple(block),
    )


# the block of each format that has only one (None means it)
_DEFAULT_BLOCKS = {name: (1, spec.block) for name, spec in FORMATS.items() if spec.scale != "f32"}


def as_block(spec: FormatSpec, block) -> tuple[int, int]:
    """The ``(rows, cols)`` block of a tensor of format ``spec`` given ``block`` (a pair of ints or None):
    ``(1, spec.block)`` for the MX formats and nvfp4 (None means it), one of ``(1, 128)`` and ``(128, 128)`` for fp8.

    Raises:
        ValueError: another block, or None for fp8.
    """
    pair = None
    if isinstance(block, (tuple, list)) and len(block) == 2 and all(type(side) is int for side in block):
        pair = (block[0], block[1])
    if spec.scale != "f32":
        if block is None or pair == (1, spec.block):
            return (1, spec.block)
        raise ValueError(f"{spec.name} has block=(1, {spec.block}) (or None), got block={block!r}")
    if pair not in FP8_BLOCKS:
        raise ValueError(f"fp8 needs block=(1, 128) or (128, 128), got block={block!r}")
    return pair


def block_scale_shape(shape: tuple, block: tuple[int, int]) -> tuple:
    """The row-layout scale shape of a tensor of shape ``shape`` ``[..., R, K]`` (or ``[K]``) with one scale per
    ``block = (rows, cols)`` tile: ``[..., ceil(R / rows), ceil(K / cols)]``; for ``rows == 1`` every leading dim
    is kept (``[..., ceil(K / cols)]``)."""
    rows, cols = block
    num_cols = -(-shape[-1] // cols)
    if rows == 1:
        return (*shape[:-1], num_cols)
    return (*shape[:-2], -(-shape[-2] // rows), num_cols)
