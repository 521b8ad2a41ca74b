"""The scale layouts as objects (``llmkernels.formats.layouts``): each one's host pack / unpack round trip, its device
addressing against its host rearrangement, the strings users name them by, and their plan keys."""

import copy
import pickle

import pytest
import torch
import triton
import triton.language as tl

import llmkernels as lk
from llmkernels.formats import format_spec
from llmkernels.formats.layouts import (
    BLOCKED,
    GROUPED_BLOCKED,
    HOPPER,
    LAYOUTS,
    ROW,
    SCALE_LAYOUTS,
    Layout,
    as_layout,
)
from llmkernels.launch import value_key

FORMAT_NAMES = ["mxfp8", "mxfp4", "nvfp4"]
# (layout, logical shape) of each round trip: odd rows and scale columns, padded tiles, two leading dims
SHAPES = {
    ROW: [(5, 96), (2, 3, 64)],
    BLOCKED: [(130, 160), (2, 33, 64)],
    GROUPED_BLOCKED: [(150, 96)],
    HOPPER: [(17, 96), (2, 33, 160)],
}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def _offsets(rows: int, device) -> torch.Tensor:
    return torch.tensor([0, 3, 3, rows - 10, rows], dtype=torch.int32, device=device)


@pytest.mark.parametrize("format", FORMAT_NAMES)
@pytest.mark.parametrize(
    "layout, shape",
    [(layout, shape) for layout, shapes in SHAPES.items() for shape in shapes],
    ids=lambda value: str(value) if isinstance(value, Layout) else "x".join(map(str, value)),
)
def test_pack_unpack_round_trip(layout, shape, format, device):
    """Row data and scales packed into the layout and unpacked give the same bits; the ScaledTensor made of the
    packed parts validates, holds the layout and dequantizes as the row one."""
    if not layout.holds(format):
        pytest.skip(f"{layout.name} holds no {format}")
    row = lk.quantize(torch.randn(shape, device=device), format)
    spec = format_spec(format)
    offsets = _offsets(shape[0], device) if layout.grouped else None
    parts = layout.pack(row.data, row.scales, spec, tuple(row.shape), offsets)
    tensor = lk.ScaledTensor(
        parts.data,
        parts.scales,
        format,
        row.global_scale,
        layout,
        parts.group_offsets,
        parts.group_scale_offsets,
        parts.logical_shape,
    )
    assert tensor.scale_layout is layout and tensor.shape == row.shape
    expected = layout.scale_shape(tuple(row.shape), spec.block)  # (a grouped layout's tile rows: any number)
    assert all(isinstance(e, str) or e == f for e, f in zip(expected, tensor.scales.shape, strict=True))
    data, scales = layout.unpack(tensor)
    assert data.dtype == spec.data_dtype and scales.dtype == spec.scale_dtype
    assert torch.equal(_bits(data), _bits(row.data)) and torch.equal(_bits(scales), _bits(row.scales))
    assert torch.equal(lk.dequantize(tensor), lk.dequantize(row))
    assert tensor.to_layout(layout, group_offsets=offsets).scale_layout is layout  # and the way users go


@triton.jit
def _scales_through_layout(
    scales_ptr,
    out_ptr,
    group_tiles_ptr,
    stride_expert,
    stride_row,
    num_experts,
    num_rows,
    num_tile_rows,
    K,
    group_start,
    group,
    SCALE_BLOCK: tl.constexpr,
    SCALE_ROWS: tl.constexpr,
    SCALE_COLS: tl.constexpr,
    EXPERTS: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
):
    """out[e, r, c] = the scale a kernel finds for row r, column c through the layout's helpers: for each expert
    (EXPERTS: ``expert_scale_rows``) or for the rows of one group (``token_scale_rows``)."""
    expert = tl.program_id(0)
    rows = tl.arange(0, BLOCK_ROWS)
    cols = tl.arange(0, BLOCK_COLS)
    row_mask = rows < num_rows
    if EXPERTS:
        offsets = SCALE_ROWS(expert.to(tl.int64), rows, stride_expert, stride_row, num_rows, K, SCALE_BLOCK)
    else:
        offsets, row_mask = SCALE_ROWS(
            group_start + rows.to(tl.int64),
            row_mask,
            group,
            group_start,
            group_tiles_ptr,
            stride_row,
            num_tile_rows,
            K,
            SCALE_BLOCK,
        )
    mask = row_mask[:, None] & (cols < K // SCALE_BLOCK)[None, :]
    found = tl.load(scales_ptr + offsets[:, None] + SCALE_COLS(cols)[None, :], mask=mask, other=0)
    out = out_ptr + (expert * num_rows + rows[:, None]) * (K // SCALE_BLOCK) + cols[None, :]
    tl.store(out, found, mask=mask)


@pytest.mark.parametrize("layout", [ROW, BLOCKED], ids=str)
def test_expert_scale_rows_find_the_packed_scales(layout, device):
    """A kernel reading weights ``[E, N, K]`` through ``expert_scale_rows`` and ``scale_cols`` finds each row's
    scales where the host packed them."""
    row = lk.quantize(torch.randn(3, 130, 160, device=device), "mxfp4")
    weights = row.to_layout(layout)
    found = torch.zeros(3, 130, 5, dtype=torch.uint8, device=device)
    scales = weights.scales.view(torch.uint8)
    strides = scales.stride() if layout.strided else (0, 0)
    _scales_through_layout[(3,)](
        scales,
        found,
        scales,
        strides[0],
        strides[1],
        3,
        130,
        0,
        160,
        0,
        0,
        SCALE_BLOCK=32,
        SCALE_ROWS=layout.expert_scale_rows,
        SCALE_COLS=layout.scale_cols,
        EXPERTS=True,
        BLOCK_ROWS=256,
        BLOCK_COLS=8,
    )
    assert torch.equal(found, _bits(row.scales))


@pytest.mark.parametrize("layout", [ROW, BLOCKED, GROUPED_BLOCKED], ids=lambda layout: layout.name)
def test_token_scale_rows_find_the_packed_scales(layout, device):
    """A kernel reading one group of activation rows through ``token_scale_rows`` and ``scale_cols`` finds each
    row's scales where the host packed them; rows whose tile row lies past the scales have none."""
    x = lk.quantize(torch.randn(150, 96, device=device), "mxfp8")
    offsets = _offsets(150, device)
    tensor = x.to_layout(layout, group_offsets=offsets if layout.grouped else None)
    scales = tensor.scales.view(torch.uint8)
    group_tiles = tensor.group_scale_offsets if layout.grouped else offsets
    for group in range(4):
        start, end = int(offsets[group]), int(offsets[group + 1])
        found = torch.zeros(end - start, 3, dtype=torch.uint8, device=device)
        _scales_through_layout[(1,)](
            scales,
            found,
            group_tiles,
            0,
            scales.stride(0) if layout.strided else 0,
            1,
            end - start,
            scales.shape[0],
            96,
            start,
            group,
            SCALE_BLOCK=32,
            SCALE_ROWS=layout.token_scale_rows,
            SCALE_COLS=layout.scale_cols,
            EXPERTS=False,
            BLOCK_ROWS=256,
            BLOCK_COLS=4,
        )
        assert torch.equal(found, _bits(x.scales[start:end])), f"group {group}"
    if layout.rows_may_miss_scales:  # group 2 (rows 3-139, tile rows 1-2) told of 2 tile rows: its last 9 have none
        found = torch.full((137, 3), 7, dtype=torch.uint8, device=device)
        _scales_through_layout[(1,)](
            scales,
            found,
            group_tiles,
            0,
            0,
            1,
            137,
            2,
            96,
            3,
            2,
            SCALE_BLOCK=32,
            SCALE_ROWS=layout.token_scale_rows,
            SCALE_COLS=layout.scale_cols,
            EXPERTS=False,
            BLOCK_ROWS=256,
            BLOCK_COLS=4,
        )
        assert torch.equal(found[:128], _bits(x.scales[3:131])) and bool((found[128:] == 7).all())


def test_layouts_compare_equal_to_their_names_and_print_as_them(device):
    for name, layout in LAYOUTS.items():
        assert as_layout(name) is layout and layout.name == name and layout.plan_key() == name
        assert pickle.loads(pickle.dumps(layout)) is layout and copy.deepcopy(layout) is layout
    for layout, string in ((ROW, "row"), (BLOCKED, "128x4"), (GROUPED_BLOCKED, "128x4"), (HOPPER, "hopper")):
        assert layout == string and string == layout and not layout != string
        assert str(layout) == f"{layout}" == string and repr(layout) == repr(string) and hash(layout) == hash(string)
        assert layout in (string,) and {string: 1}[layout] == 1
    assert ROW != "hopper" and ROW != BLOCKED and BLOCKED != GROUPED_BLOCKED and ROW != 1
    assert SCALE_LAYOUTS == ("row", "128x4", "128x4_grouped", "hopper")
    assert as_layout("128x4", grouped=True) is GROUPED_BLOCKED and as_layout(ROW, grouped=True) is ROW
    with pytest.raises(ValueError, match="weight_layout must be one of"):
        as_layout("sm90", argument="weight_layout")


def test_scaled_tensor_takes_the_names_and_holds_the_objects(device):
    x = torch.randn(150, 64, device=device)
    q = lk.quantize(x, "mxfp4")
    assert q.scale_layout is ROW and q.scale_layout == "row"
    assert lk.ScaledTensor(q.data, q.scales, "mxfp4").scale_layout is ROW
    hopper = q.to_layout("hopper")
    assert hopper.scale_layout is HOPPER and hopper.scale_layout == "hopper"
    assert lk.quantize(x, "mxfp4", scale_layout=HOPPER).scale_layout is HOPPER
    assert f"scale_layout={hopper.scale_layout!r}" in repr(hopper)
    offsets = _offsets(150, device)
    grouped = lk.quantize(x, "mxfp4", scale_layout="128x4", group_offsets=offsets)
    assert grouped.scale_layout is GROUPED_BLOCKED and grouped.scale_layout == "128x4"
    by_name = lk.ScaledTensor(
        grouped.data, grouped.scales, "mxfp4", None, "128x4_grouped", offsets, grouped.group_scale_offsets
    )
    assert by_name.scale_layout is GROUPED_BLOCKED and torch.equal(lk.dequantize(by_name), lk.dequantize(q))
    with pytest.raises(ValueError, match="group_offsets"):
        lk.ScaledTensor(grouped.data, grouped.scales, "mxfp4", None, "128x4_grouped")
    with pytest.raises(ValueError, match="scale_layout must be one of"):
        lk.ScaledTensor(q.data, q.scales, "mxfp4", scale_layout="col")
    reassigned = lk.ScaledTensor(q.data, q.scales, "mxfp4")
    reassigned.scale_layout = "row"
    assert reassigned.scale_layout is ROW


def test_plan_keys_tell_layouts_apart(device):
    x = torch.randn(150, 64, device=device)
    blocked = lk.quantize(x, "mxfp8", scale_layout="128x4")
    grouped = lk.quantize(x, "mxfp8", scale_layout="128x4", group_offsets=_offsets(150, device))
    assert blocked.plan_key()[2] == "128x4" and grouped.plan_key()[2] == "128x4_grouped"
    assert len({layout.plan_key() for layout in LAYOUTS.values()}) == len(LAYOUTS)
    assert value_key(ROW) == value_key("row") and value_key(HOPPER) != value_key(ROW)
