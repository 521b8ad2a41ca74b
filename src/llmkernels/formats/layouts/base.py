"""What a layout of a :class:`~llmkernels.ScaledTensor` holds: how its parts sit in memory, made from the row layout
and back on the host, and how a kernel finds a scale in it on the device."""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["Layout", "Packed"]


class Packed(NamedTuple):
    """A ScaledTensor's parts in one layout (what :meth:`Layout.pack` makes): ``data`` and ``scales`` in the layout's
    order and dtypes; ``group_offsets`` / ``group_scale_offsets`` for scales padded per group; ``logical_shape``
    for a layout that rearranges the data too (its shape no longer tells the tensor's)."""

    data: torch.Tensor
    scales: torch.Tensor
    group_offsets: torch.Tensor | None = None
    group_scale_offsets: torch.Tensor | None = None
    logical_shape: tuple | None = None


class Layout:
    """One layout of a block-scaled tensor's scales (and, where :attr:`rearranges_data`, its data).

    A layout is a singleton per kind. It compares equal to the string users name it by (``"row"``, ``"128x4"``,
    ``"hopper"``; scales padded per group are ``"128x4"`` too) and prints as it; :attr:`name` is unique per layout
    and is its plan key. Subclasses set the class attributes and implement :meth:`pack`, :meth:`unpack` and
    :meth:`scale_shape`; a kernel that reads scales in this layout takes the layout's device helpers as
    constexprs (:attr:`token_scale_rows`, :attr:`expert_scale_rows`, :attr:`scale_cols`).

    Attributes:
        name: ``"row"``, ``"128x4"``, ``"128x4_grouped"``, ``"hopper"``: how ``as_layout`` finds it and what a plan
            keys on.
        min_dims: the fewest logical dims a tensor in this layout has.
        formats: the formats it holds (None: every format).
        grouped: made per group of rows (it needs ``group_offsets``).
        rearranges_data: the data is rearranged too (a tensor then carries its logical shape).
        strided: the scales are addressed through their tensor's strides (a kernel takes them as arguments); the
            others are dense in their own order.
        rows_per_block: weight rows are addressed in blocks of this many (SwiGLU's up half must start on a block).
        token_scale_rows: ``@triton.jit`` ``(rows, row_mask, group, group_start, group_tiles_ptr, stride_row,
            num_tile_rows, K, SCALE_BLOCK) -> (offsets, mask)``: byte offset of each activation row's first scale
            (rows int64 ``[BLOCK]`` of group ``group`` starting at row ``group_start``) and which rows have scales.
        expert_scale_rows: ``@triton.jit`` ``(expert, rows, stride_expert, stride_row, N, K, SCALE_BLOCK) -> offsets``:
            byte offset of each weight row's first scale in expert ``expert`` of ``[E, N, K]``.
        scale_cols: ``@triton.jit`` ``(scale_cols) -> offsets``: byte offset of scale column c from its row's first.
        rows_may_miss_scales: token_scale_rows' mask can be narrower than the rows' (a kernel writes those rows NaN).
    """

    name: str = ""
    min_dims: int = 1
    formats: frozenset | None = None
    grouped: bool = False
    rearranges_data: bool = False
    strided: bool = False
    rows_per_block: int = 1
    token_scale_rows = None
    expert_scale_rows = None
    scale_cols = None
    rows_may_miss_scales: bool = False
    public_name: str | None = None  # the string it compares equal to and prints as, when not its name

    # --- what it is -------------------------------------------------------------------------------------------

    def __str__(self) -> str:
        return self.public_name or self.name

    def __repr__(self) -> str:
        return repr(str(self))

    def __eq__(self, other) -> bool:
        if isinstance(other, Layout):
            return self.name == other.name
        if isinstance(other, str):
            return other == str(self)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(str(self))

    def __reduce__(self):
        from . import as_layout

        return as_layout, (self.name,)

    def plan_key(self) -> str:
        """What a plan keys on (:func:`llmkernels.launch.value_key`): the name."""
        return self.name

    def holds(self, format: str) -> bool:
        """Whether a tensor of ``format`` (``"mxfp8"``, ``"mxfp4"``, ``"nvfp4"``) can be in this layout."""
        return self.formats is None or format in self.formats

    # --- host: shapes, and the rearrangement from and to the row layout -------------------------------------------

    def check_dims(self, x) -> None:
        """Raises ValueError when the ScaledTensor ``x`` has too few dims for this layout."""
        if x.data.dim() < self.min_dims:
            raise ValueError(f"data of shape {tuple(x.data.shape)} has too few dimensions for {self} scales")

    def scale_shape(self, shape: tuple, block: int) -> tuple:
        """The scales' shape for logical shape ``shape`` ``[..., K]`` with one scale per ``block`` elements
        (a string entry: a dim of any size)."""
        raise NotImplementedError

    def check_scales(self, x) -> None:
        """Raises ValueError when the ScaledTensor ``x``'s scales do not have :meth:`scale_shape`."""
        expected = self.scale_shape(tuple(x.shape), x.spec.block)
        found = tuple(x.scales.shape)
        if len(found) != len(expected) or any(e != f for e, f in zip(expected, found) if not isinstance(e, str)):
            raise ValueError(
                f"scales of shape {found} do not fit data of logical shape {x.shape} in layout {self!r} "
                f"(expected {expected})"
            )

    def pack(
        self, data: torch.Tensor, scales: torch.Tensor, spec, shape: tuple, group_offsets: torch.Tensor | None = None
    ) -> Packed:
        """Row-layout ``data`` and ``scales`` (``[..., R, K / block]``) of a tensor of format ``spec`` and logical shape
        ``shape`` → its parts in this layout (exact; on the tensors' device, no sync)."""
        raise NotImplementedError

    def unpack(self, x) -> tuple[torch.Tensor, torch.Tensor]:
        """``(data, scales)`` of the ScaledTensor ``x`` (in this layout) in the row layout, in the format's dtypes:
        the inverse of :meth:`pack` (views where the layout keeps them as they are, else copies)."""
        raise NotImplementedError
