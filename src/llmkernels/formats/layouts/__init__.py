"""The layouts of a ScaledTensor, one module each (its host rearrangement from and to the row layout and the device
helpers kernels address it with): ``row``, ``128x4`` tiles, ``128x4`` tiles padded per group, ``hopper`` fragments.

A new layout is one module with a :class:`Layout` subclass and its singleton, named in :data:`LAYOUTS` below;
:meth:`ScaledTensor.to_layout`, validation, plan keys and the grouped matmul's kernel read it through the object.
"""

from __future__ import annotations

from .base import Layout, Packed
from .blocked import BLOCKED, TILE_ROWS, TILE_SCALE_COLS, BlockedLayout, from_blocked_scales, to_blocked_scales
from .grouped_blocked import (
    GROUPED_BLOCKED,
    OFFSET_DTYPES,
    GroupedBlockedLayout,
    check_group_offsets,
    from_grouped_blocked_scales,
    to_grouped_blocked_scales,
)
from .hopper import HOPPER, HopperLayout
from .row import ROW, RowLayout

__all__ = [
    "Layout",
    "Packed",
    "LAYOUTS",
    "SCALE_LAYOUTS",
    "as_layout",
    "ROW",
    "BLOCKED",
    "GROUPED_BLOCKED",
    "HOPPER",
    "RowLayout",
    "BlockedLayout",
    "GroupedBlockedLayout",
    "HopperLayout",
    "to_blocked_scales",
    "from_blocked_scales",
    "to_grouped_blocked_scales",
    "from_grouped_blocked_scales",
    "check_group_offsets",
    "OFFSET_DTYPES",
    "TILE_ROWS",
    "TILE_SCALE_COLS",
]

LAYOUTS: dict[str, Layout] = {layout.name: layout for layout in (ROW, BLOCKED, GROUPED_BLOCKED, HOPPER)}
SCALE_LAYOUTS = tuple(LAYOUTS)  # the names a scale_layout argument takes


def as_layout(value, grouped: bool = False, argument: str = "scale_layout") -> Layout:
    """The layout named ``value`` (one of :data:`SCALE_LAYOUTS`, or a :class:`Layout`); with ``grouped`` (group
    offsets given), ``"128x4"`` means its per-group padding.

    Raises:
        ValueError: an unknown name, naming ``argument``.
    """
    layout = value if isinstance(value, Layout) else LAYOUTS.get(value) if isinstance(value, str) else None
    if layout is None:
        raise ValueError(f"{argument} must be one of {SCALE_LAYOUTS}, got {value!r}")
    if grouped and layout is BLOCKED:
        return GROUPED_BLOCKED
    return layout
