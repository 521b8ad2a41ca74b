"""The 128x4 layout padded per group: the seed's A operand of the grouped matmul. Each group of rows (``group_offsets``
``[G + 1]``) starts a fresh 128-row tile; ``group_scale_offsets`` ``[G]`` (MAX's ``a_scale_offsets``) places group
g's first scale tile-row at ``group_offsets[g] // 128 + group_scale_offsets[g]``. A ScaledTensor in it is 2D and
compares equal to ``"128x4"`` (with its group offsets set), as it always has."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...runtime import describe
from .base import Layout, Packed
from .blocked import (
    TILE_ROWS,
    TILE_SCALE_COLS,
    check_scales,
    pad_bits,
    rows_from_tiles,
    scale_cols,
    tile_scale_row_base,
    tiles_from_rows,
)

__all__ = [
    "GroupedBlockedLayout",
    "GROUPED_BLOCKED",
    "to_grouped_blocked_scales",
    "from_grouped_blocked_scales",
    "check_group_offsets",
    "OFFSET_DTYPES",
]

OFFSET_DTYPES = (torch.int32, torch.uint32, torch.int64)  # of group offsets


@triton.jit
def token_scale_rows(
    rows, row_mask, group, group_start, group_tiles_ptr, stride_row, num_tile_rows, K, SCALE_BLOCK: tl.constexpr
):
    """Byte offset of each activation row's first scale: tile row ``group_start // 128 + group_tiles[group] +
    (row - group_start) // 128``. Rows whose tile row lies outside the ``num_tile_rows`` of the scales (metadata
    that does not match them) have none: the mask is false there and the offset that of tile row 0."""
    local_rows = rows - group_start
    tile_rows = group_start // 128 + tl.load(group_tiles_ptr + group).to(tl.int64) + local_rows // 128
    mask = row_mask & (tile_rows >= 0) & (tile_rows < num_tile_rows)
    return tile_scale_row_base(tl.where(mask, tile_rows, 0), local_rows % 128, K // SCALE_BLOCK), mask


def check_group_offsets(group_offsets) -> None:
    """``group_offsets`` is an int32 / uint32 / int64 ``[G + 1]`` tensor (its values are read clamped).

    Raises:
        TypeError: another type, dtype or shape.
    """
    if (
        not isinstance(group_offsets, torch.Tensor)
        or group_offsets.dtype not in OFFSET_DTYPES
        or group_offsets.dim() != 1
        or group_offsets.numel() < 1
    ):
        raise TypeError(f"group_offsets must be an int32/uint32/int64 [G + 1] tensor, got {describe(group_offsets)}")


def _group_tile_rows(group_offsets: torch.Tensor, num_rows: int):
    """For every row of a grouped 2D tensor: its tile-row and row-in-tile in the per-group padded layout.

    Returns ``(tile_row [R], row_in_tile [R], group_scale_offsets [G])``. Rows outside every group get
    tile-row ``-1``. Offsets are clamped to ``[0, R]`` and made non-decreasing, as the kernel does.
    """
    offsets = group_offsets.to(torch.int64).clamp(0, num_rows)
    offsets = torch.cummax(offsets, dim=0).values
    sizes = offsets[1:] - offsets[:-1]
    tiles = (sizes + TILE_ROWS - 1) // TILE_ROWS
    first_tile = torch.cumsum(tiles, 0) - tiles
    group_scale_offsets = first_tile - offsets[:-1] // TILE_ROWS
    rows = torch.arange(num_rows, device=group_offsets.device)
    if sizes.numel() == 0:  # no groups (a_offsets = [0]): every row is outside
        return torch.full_like(rows, -1), torch.zeros_like(rows), group_scale_offsets.to(torch.int32)
    group = torch.searchsorted(offsets[1:], rows, right=True).clamp(max=max(len(sizes) - 1, 0))
    start = offsets[group]
    local = rows - start
    inside = (rows >= offsets[0]) & (rows < offsets[-1])
    tile_row = torch.where(inside, first_tile[group] + local // TILE_ROWS, -1)
    return tile_row, local % TILE_ROWS, group_scale_offsets.to(torch.int32)


def to_grouped_blocked_scales(scales: torch.Tensor, group_offsets: torch.Tensor):
    """Row-major scales ``[R, C]`` of a grouped tensor → ``(tiles, group_scale_offsets)``.

    Each group's scale rows start a fresh 128-row tile (the seed's A-operand layout): row ``m`` of
    group ``g`` lands in tile-row ``(m - off[g]) // 128 + off[g] // 128 + group_scale_offsets[g]``.
    ``tiles`` is ``[ceil(R/128) + G, ceil(C/4), 32, 16]`` (an upper bound on the tiles needed; the rest
    is padding), ``group_scale_offsets`` int32 ``[G]``. Rows outside every group are dropped.

    Raises:
        TypeError / ValueError: scales not a 2D scale tensor, group_offsets not an int [G + 1].
    """
    check_scales("scales", scales, 2)
    check_group_offsets(group_offsets)
    if scales.dim() != 2:
        raise ValueError(f"grouped scales must be 2D [R, C], got shape {tuple(scales.shape)}")
    r, c = scales.shape
    num_groups = group_offsets.numel() - 1
    rt, ct = -(-r // TILE_ROWS) + num_groups, -(-c // TILE_SCALE_COLS)
    tile_row, row_in_tile, group_scale_offsets = _group_tile_rows(group_offsets, r)
    # Rows outside every group go to one extra tile-row that is cut off at the end.
    flat_row = torch.where(tile_row >= 0, tile_row * TILE_ROWS + row_in_tile, rt * TILE_ROWS)
    bits = scales.view(torch.uint8)
    padded = bits.new_full(((rt + 1) * TILE_ROWS, ct * TILE_SCALE_COLS), pad_bits(scales))
    padded[flat_row, :c] = bits
    tiles = tiles_from_rows(padded[: rt * TILE_ROWS])
    return tiles.contiguous().view(scales.dtype), group_scale_offsets


def from_grouped_blocked_scales(blocked: torch.Tensor, group_offsets: torch.Tensor, num_rows: int, cols: int):
    """Inverse of :func:`to_grouped_blocked_scales` (the seed's own ``a_scale_offsets`` are not needed:
    they follow from ``group_offsets``). Rows outside every group read as 1.0.

    Raises:
        TypeError / ValueError: blocked not a scale tensor of 128x4 tiles, group_offsets not an int [G + 1].
    """
    check_scales("blocked", blocked, 4, tile=True)
    check_group_offsets(group_offsets)
    rows = rows_from_tiles(blocked.view(torch.uint8))
    tile_row, row_in_tile, _ = _group_tile_rows(group_offsets, num_rows)
    flat_row = (tile_row.clamp(min=0) * TILE_ROWS + row_in_tile).clamp(max=rows.shape[0] - 1)
    out = rows[flat_row, :cols]
    out = torch.where((tile_row >= 0)[:, None], out, pad_bits(blocked))
    return out.to(torch.uint8).contiguous().view(blocked.dtype)


class GroupedBlockedLayout(Layout):
    """128x4 tiles of a 2D tensor's scales, each group of rows padded to whole tiles: ``[tile rows, ceil(K / block
    / 4), 32, 16]`` with at least ``ceil(R / 128) + G`` tile rows. Compares equal to ``"128x4"``."""

    name = "128x4_grouped"
    public_name = "128x4"
    min_dims = 2
    grouped = True
    token_scale_rows = token_scale_rows
    scale_cols = scale_cols
    rows_may_miss_scales = True

    def scale_shape(self, shape: tuple, block: int) -> tuple:
        return ("tile_rows", -(-(shape[-1] // block) // TILE_SCALE_COLS), 32, 16)

    def pack(self, data, scales, spec, shape, group_offsets=None) -> Packed:
        blocked, group_scale_offsets = to_grouped_blocked_scales(scales, group_offsets)
        return Packed(data, blocked, group_offsets, group_scale_offsets)

    def unpack(self, x):
        return x.data, from_grouped_blocked_scales(x.scales, x.group_offsets, x.shape[-2], x.shape[-1] // x.spec.block)


GROUPED_BLOCKED = GroupedBlockedLayout()
