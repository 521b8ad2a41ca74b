"""The grouped matmul's documented rules for A scales padded per group (the seed's ``a_scale_offsets``): a
row whose scale tile-row lies outside A's scale tensor reads no scales and is written as NaN; every other
row is bit-equal to the call with sound scales. A ScaledTensor whose parts were changed after
construction is re-checked at the call."""

import pytest
import torch
from test_canaries import Canaried

import llmkernels as lk
from llmkernels.testing import random_group_offsets

SIZES = [130, 0, 7, 128, 3]  # tile rows 0-1, -, 2, 3, 4 (each group starts a fresh 128-row tile)


def _problem(device):
    offsets = random_group_offsets(SIZES, device)
    x = torch.randn(sum(SIZES), 64, device=device)
    a = lk.quantize(x, "mxfp8", scale_layout="128x4", group_offsets=offsets)
    b = lk.quantize(torch.randn(3, 32, 64, device=device), "mxfp8")
    ids = torch.tensor([0, 1, 2, 1, 0], dtype=torch.int32, device=device)
    return a, b, offsets, ids


def _rows_of(groups, device):
    rows = torch.zeros(sum(SIZES), dtype=torch.bool, device=device)
    offsets = random_group_offsets(SIZES)
    for g in groups:
        rows[int(offsets[g]) : int(offsets[g + 1])] = True
    return rows


def _tile_row_of_each_row(device) -> torch.Tensor:
    """The scale tile-row each row of A reads in the per-group padded layout."""
    tile_rows, first_tile = [], 0
    for size in SIZES:
        tile_rows += [first_tile + local // 128 for local in range(size)]
        first_tile += -(-size // 128)
    return torch.tensor(tile_rows, device=device)


@pytest.mark.parametrize("tile_rows", [0, 1, 3])
def test_scales_with_too_few_tile_rows_give_nan_rows_and_read_nothing_past_them(tile_rows, device):
    a, b, offsets, ids = _problem(device)
    expected = lk.grouped_matmul(a, b, offsets, ids)
    canaried = Canaried()  # NaN scale bytes after the cut: a read past it would poison a covered row
    scales = canaried.place("a.scales", a.scales[:tile_rows], "high")
    short = lk.ScaledTensor(a.data, scales, "mxfp8", None, "128x4", a.group_offsets, a.group_scale_offsets)
    out = lk.grouped_matmul(short, b, offsets, ids)
    canaried.check(written=set())
    rows = _tile_row_of_each_row(device) < tile_rows
    assert torch.equal(out[rows].view(torch.int16), expected[rows].view(torch.int16))
    nan_rows = ~rows & _rows_of(range(len(SIZES)), device)
    assert torch.isnan(out[nan_rows]).all()


def test_backward_scale_offsets_give_nan_rows_only_where_they_leave_the_scales(device):
    a, b, offsets, ids = _problem(device)
    expected = lk.grouped_matmul(a, b, offsets, ids)
    hostile = a.group_scale_offsets.clone()
    hostile[2] = -100  # group 2 would read tile row 1 // 128 ... far before the tensor
    hostile[4] = 2**31 - 1
    bad = lk.ScaledTensor(a.data, a.scales, "mxfp8", None, "128x4", a.group_offsets, hostile)
    out = lk.grouped_matmul(bad, b, offsets, ids)
    good = _rows_of([0, 3], device)
    assert torch.equal(out[good].view(torch.int16), expected[good].view(torch.int16))
    assert torch.isnan(out[_rows_of([2, 4], device)]).all()


def test_scaled_tensor_changed_after_construction_is_checked_at_the_call(device):
    a, b, offsets, ids = _problem(device)
    plain = lk.quantize(torch.randn(sum(SIZES), 64, device=device), "mxfp8")
    plain.scales = plain.scales[:10]
    with pytest.raises(ValueError, match="scales of shape"):
        lk.grouped_matmul(plain, b, offsets, ids)
    with pytest.raises(ValueError, match="scales of shape"):
        lk.dequantize(plain)
    resized = lk.quantize(torch.randn(4, 64, device=device), "mxfp8")
    resized.scales.resize_(2, 2)
    with pytest.raises(ValueError, match="scales of shape"):
        lk.dequantize(resized)
