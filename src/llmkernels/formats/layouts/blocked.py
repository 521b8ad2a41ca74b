"""The 128x4 layout: the tensor cores' block-scaled layout (cuBLAS's and MAX's), scales in tiles of 128 rows × 4
scale columns.

A tile holds 512 bytes; scale ``(r, c)`` of a tile sits at byte ``(r % 32) * 16 + (r // 32) * 4 + c``. Tiles are
stored ``[..., ceil(R / 128), ceil(C / 4), 32, 16]`` per matrix (weights ``[E, N, K]`` tile per expert), padded with
1.0. The conversions run on the tensors' device without a host sync.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .base import Layout, Packed

__all__ = [
    "BlockedLayout",
    "BLOCKED",
    "to_blocked_scales",
    "from_blocked_scales",
    "TILE_ROWS",
    "TILE_SCALE_COLS",
    "SCALE_DTYPES",
]

TILE_ROWS = 128  # rows of one tensor-core scale tile
TILE_SCALE_COLS = 4  # scale columns of one tile
SCALE_DTYPES = (torch.float8_e8m0fnu, torch.float8_e4m3fn, torch.uint8)
TILE_BYTES = tl.constexpr(512)  # one 128-row × 4-column tile of scales


# ------------------------------------------------------------------------------------------------ device


@triton.jit
def tile_scale_row_base(tile_row, row_in_tile, num_scale_cols):
    """Byte offset of a row's scales inside the 128x4 layout, at scale column 0."""
    col_tiles = tl.cdiv(num_scale_cols, 4)
    return tile_row.to(tl.int64) * col_tiles * TILE_BYTES + (row_in_tile % 32) * 16 + (row_in_tile // 32) * 4


@triton.jit
def token_scale_rows(
    rows, row_mask, group, group_start, group_tiles_ptr, stride_row, num_tile_rows, K, SCALE_BLOCK: tl.constexpr
):
    """Byte offset of each activation row's first scale: tile row ``rows // 128``; every row has scales."""
    return tile_scale_row_base(rows // 128, rows % 128, K // SCALE_BLOCK), row_mask


@triton.jit
def expert_scale_rows(expert, rows, stride_expert, stride_row, N, K, SCALE_BLOCK: tl.constexpr):
    """Byte offset of each weight row's first scale: expert ``expert``'s tiles follow the ``cdiv(N, 128)`` tile rows
    of the experts before it."""
    return tile_scale_row_base(expert * tl.cdiv(N, 128) + rows // 128, rows % 128, K // SCALE_BLOCK)


@triton.jit
def scale_cols(scale_cols):
    """Byte offset of scale column c from its row's first: tile ``c // 4``, byte ``c % 4`` of it."""
    return (scale_cols // 4) * TILE_BYTES + scale_cols % 4


# ------------------------------------------------------------------------------------------------ host


def check_scales(name: str, tensor, min_dims: int, tile: bool = False) -> None:
    """``tensor`` is a scale tensor (e8m0 / e4m3, or their bytes as uint8) of at least ``min_dims`` dims
    (``tile``: ending in 128x4 tiles ``[..., 32, 16]``).

    Raises:
        TypeError: not a tensor of a scale dtype.
        ValueError: too few dims, or not ending in tiles.
    """
    if not isinstance(tensor, torch.Tensor) or tensor.dtype not in SCALE_DTYPES:
        raise TypeError(
            f"{name} must be a float8_e8m0fnu / float8_e4m3fn (or uint8) tensor, got "
            f"{getattr(tensor, 'dtype', type(tensor).__name__)}"
        )
    if tensor.dim() < min_dims or (tile and tuple(tensor.shape[-2:]) != (32, 16)):
        layout = "[..., RT, CT, 32, 16] tiles" if tile else f"at least {min_dims} dims"
        raise ValueError(f"{name} must be {layout}, got shape {tuple(tensor.shape)}")


def pad_bits(scales: torch.Tensor) -> int:
    """The bits of 1.0 in ``scales``' dtype (e8m0 or e4m3): what padding scales hold."""
    return 127 if scales.dtype == torch.float8_e8m0fnu else 0x38


def tiles_from_rows(rows: torch.Tensor) -> torch.Tensor:
    """``[..., RT*128, CT*4]`` → ``[..., RT, CT, 32, 16]``."""
    *lead, r, c = rows.shape
    tiles = rows.reshape(*lead, r // TILE_ROWS, 4, 32, c // TILE_SCALE_COLS, TILE_SCALE_COLS)
    n = len(lead)
    tiles = tiles.permute(*range(n), n, n + 3, n + 2, n + 1, n + 4)
    return tiles.reshape(*lead, r // TILE_ROWS, c // TILE_SCALE_COLS, 32, 16)


def rows_from_tiles(tiles: torch.Tensor) -> torch.Tensor:
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
    check_scales("scales", scales, 2)
    *lead, r, c = scales.shape
    rt, ct = -(-r // TILE_ROWS), -(-c // TILE_SCALE_COLS)
    bits = scales.view(torch.uint8)
    padded = bits.new_full((*lead, rt * TILE_ROWS, ct * TILE_SCALE_COLS), pad_bits(scales))
    padded[..., :r, :c] = bits
    return tiles_from_rows(padded).contiguous().view(scales.dtype)


def from_blocked_scales(blocked: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """128x4 tiles ``[..., RT, CT, 32, 16]`` → row-major ``[..., rows, cols]``.

    Raises:
        TypeError / ValueError: blocked not a scale tensor of 128x4 tiles.
    """
    check_scales("blocked", blocked, 4, tile=True)
    bits = rows_from_tiles(blocked.view(torch.uint8))
    return bits[..., :rows, :cols].contiguous().view(blocked.dtype)


class BlockedLayout(Layout):
    """128x4 tiles of scales per matrix, ``[..., ceil(R / 128), ceil(K / block / 4), 32, 16]``; at least 2 dims."""

    name = "128x4"
    min_dims = 2
    token_scale_rows = token_scale_rows
    expert_scale_rows = expert_scale_rows
    scale_cols = scale_cols

    def scale_shape(self, shape: tuple, block: int) -> tuple:
        *lead, rows, k = shape
        return (*lead, -(-rows // TILE_ROWS), -(-(k // block) // TILE_SCALE_COLS), 32, 16)

    def pack(self, data, scales, spec, shape, group_offsets=None) -> Packed:
        return Packed(data, to_blocked_scales(scales))

    def unpack(self, x):
        return x.data, from_blocked_scales(x.scales, x.shape[-2], x.shape[-1] // x.spec.block)


BLOCKED = BlockedLayout()
