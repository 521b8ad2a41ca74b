"""Conversions between the plain row-major scale layout and the seed's 128x4 tensor-core layout.

A 128x4 tile holds the scales of 128 rows × 4 scale columns in 512 bytes; scale ``(r, c)`` of a tile
sits at byte ``(r % 32) * 16 + (r // 32) * 4 + c``. We store tiles as ``[..., row_tiles, col_tiles, 32, 16]``.
All functions run on the tensors' device without a host sync.
"""
from __future__ import annotations

import torch

from ..runtime import describe

__all__ = [
    "to_blocked_scales", "from_blocked_scales", "to_grouped_blocked_scales", "from_grouped_blocked_scales",
    "TILE_ROWS", "TILE_SCALE_COLS", "OFFSET_DTYPES", "check_group_offsets",
]

TILE_ROWS = 128  # rows of one tensor-core scale tile
TILE_SCALE_COLS = 4  # scale columns of one tile


SCALE_DTYPES = (torch.float8_e8m0fnu, torch.float8_e4m3fn, torch.uint8)
OFFSET_DTYPES = (torch.int32, torch.uint32, torch.int64)  # of group offsets


def _check_scales(name: str, tensor, min_dims: int, tile: bool = False) -> None:
    """``tensor`` is a scale tensor (e8m0 / e4m3, or their bytes as uint8) of at least ``min_dims`` dims
    (``tile``: ending in 128x4 tiles ``[..., 32, 16]``)."""
    if not isinstance(tensor, torch.Tensor) or tensor.dtype not in SCALE_DTYPES:
        raise TypeError(f"{name} must be a float8_e8m0fnu / float8_e4m3fn (or uint8) tensor, got "
                        f"{getattr(tensor, 'dtype', type(tensor).__name__)}")
    if tensor.dim() < min_dims or (tile and tuple(tensor.shape[-2:]) != (32, 16)):
        layout = "[..., RT, CT, 32, 16] tiles" if tile else f"at least {min_dims} dims"
        raise ValueError(f"{name} must be {layout}, got shape {tuple(tensor.shape)}")


def check_group_offsets(group_offsets) -> None:
    """``group_offsets`` is an int32 / uint32 / int64 ``[G + 1]`` tensor (its values are read clamped)."""
    if (not isinstance(group_offsets, torch.Tensor) or group_offsets.dtype not in OFFSET_DTYPES
            or group_offsets.dim() != 1 or group_offsets.numel() < 1):
        raise TypeError(f"group_offsets must be an int32/uint32/int64 [G + 1] tensor, got {describe(group_offsets)}")


def _pad_bits(scales: torch.Tensor) -> int:
    return 127 if scales.dtype == torch.float8_e8m0fnu else 0x38  # 1.0 in e8m0 / e4m3


def _tiles_from_rows(rows: torch.Tensor) -> torch.Tensor:
    """``[..., RT*128, CT*4]`` → ``[..., RT, CT, 32, 16]``."""
    *lead, r, c = rows.shape
    tiles = rows.reshape(*lead, r // TILE_ROWS, 4, 32, c // TILE_SCALE_COLS, TILE_SCALE_COLS)
    n = len(lead)
    tiles = tiles.permute(*range(n), n, n + 3, n + 2, n + 1, n + 4)
    return tiles.reshape(*lead, r // TILE_ROWS, c // TILE_SCALE_COLS, 32, 16)


def _rows_from_tiles(tiles: torch.Tensor) -> torch.Tensor:
    """``[..., RT, CT, 32, 16]`` → ``[..., RT*128, CT*4]``."""
    *lead, rt, ct, _, _ = tiles.shape
    n = len(lead)
    rows = tiles.reshape(*lead, rt, ct, 32, 4, TILE_SCALE_COLS)
    rows = rows.permute(*range(n), n, n + 3, n + 2, n + 1, n + 4)
    return rows.reshape(*lead, rt * TILE_ROWS, ct * TILE_SCALE_COLS)


def to_blocked_scales(scales: torch.Tensor) -> torch.Tensor:
    """Row-major scales ``[..., R, C]`` → 128x4 tiles ``[..., ceil(R/128), ceil(C/4), 32, 16]``, padded with 1.0.

    Raises:
        TypeError / ValueError: scales not a scale tensor of at least 2 dims.
    """
    _check_scales("scales", scales, 2)
    *lead, r, c = scales.shape
    rt, ct = -(-r // TILE_ROWS), -(-c // TILE_SCALE_COLS)
    bits = scales.view(torch.uint8)
    padded = bits.new_full((*lead, rt * TILE_ROWS, ct * TILE_SCALE_COLS), _pad_bits(scales))
    padded[..., :r, :c] = bits
    return _tiles_from_rows(padded).contiguous().view(scales.dtype)


def from_blocked_scales(blocked: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """128x4 tiles ``[..., RT, CT, 32, 16]`` → row-major ``[..., rows, cols]``.

    Raises:
        TypeError / ValueError: blocked not a scale tensor of 128x4 tiles.
    """
    _check_scales("blocked", blocked, 4, tile=True)
    bits = _rows_from_tiles(blocked.view(torch.uint8))
    return bits[..., :rows, :cols].contiguous().view(blocked.dtype)


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
    """
    _check_scales("scales", scales, 2)
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
    padded = bits.new_full(((rt + 1) * TILE_ROWS, ct * TILE_SCALE_COLS), _pad_bits(scales))
    padded[flat_row, :c] = bits
    tiles = _tiles_from_rows(padded[: rt * TILE_ROWS])
    return tiles.contiguous().view(scales.dtype), group_scale_offsets


def from_grouped_blocked_scales(blocked: torch.Tensor, group_offsets: torch.Tensor, num_rows: int, cols: int):
    """Inverse of :func:`to_grouped_blocked_scales` (the seed's own ``a_scale_offsets`` are not needed:
    they follow from ``group_offsets``). Rows outside every group read as 1.0.

    Raises:
        TypeError / ValueError: blocked not a scale tensor of 128x4 tiles, group_offsets not an int [G + 1].
    """
    _check_scales("blocked", blocked, 4, tile=True)
    check_group_offsets(group_offsets)
    rows = _rows_from_tiles(blocked.view(torch.uint8))
    tile_row, row_in_tile, _ = _group_tile_rows(group_offsets, num_rows)
    flat_row = (tile_row.clamp(min=0) * TILE_ROWS + row_in_tile).clamp(max=rows.shape[0] - 1)
    out = rows[flat_row, :cols]
    out = torch.where((tile_row >= 0)[:, None], out, _pad_bits(blocked))
    return out.to(torch.uint8).contiguous().view(blocked.dtype)
