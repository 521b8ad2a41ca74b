"""Row-layout MXFP4 / NVFP4 weights read through their Hopper-layout copy (``grouped_matmul.layout_cache``).

Off a Hopper GPU the tests make the CPU "prefer" the Hopper layout, so that the interpreter runs the conversion
and the Hopper kernel; each result must have the bits of the call on weights converted by hand."""

import gc

import pytest
import torch

import llmkernels as lk
from llmkernels.grouped_matmul import GPT_OSS_SWIGLU, HOPPER_COPIES, SwiGLU, layout_cache
from llmkernels.testing import assert_close_relative, random_group_offsets

SIZES, IDS, EXPERTS = [5, 0, 9, 3], [1, 2, -1, 0], 3


@pytest.fixture
def copies(monkeypatch, device):
    if not layout_cache.prefers_hopper_layout(device):
        monkeypatch.setattr(layout_cache, "prefers_hopper_layout", lambda device: True)
    HOPPER_COPIES.clear()
    yield HOPPER_COPIES
    HOPPER_COPIES.enabled = True
    HOPPER_COPIES.clear()


def _problem(fmt, n, k, device):
    x = torch.randn(sum(SIZES), k, device=device).bfloat16()
    w = lk.quantize(torch.randn(EXPERTS, n, k, device=device), fmt)
    offsets = random_group_offsets(SIZES, device)
    ids = torch.tensor(IDS, dtype=torch.int32, device=device)
    return x, w, offsets, ids


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_row_weights_run_through_one_copy(fmt, copies, device):
    x, w, offsets, ids = _problem(fmt, 32, 64, device)
    expected = lk.grouped_matmul(x, w.to_layout("hopper"), offsets, ids, epilogue="swiglu")
    assert len(copies) == 0
    out = lk.grouped_matmul(x, w, offsets, ids, epilogue="swiglu")
    assert torch.equal(out, expected) and len(copies) == 1
    # a view or a re-wrap of the same memory finds the copy
    rewrapped = lk.ScaledTensor(w.data[:], w.scales.view(w.scales.shape), fmt, w.global_scale)
    assert torch.equal(lk.grouped_matmul(x, rewrapped, offsets, ids, epilogue="swiglu"), expected)
    assert len(copies) == 1
    reference = lk.grouped_matmul_reference(x, w, offsets, ids, epilogue="swiglu")
    assert_close_relative(out.float(), reference, 8e-3)


def test_in_place_writes_are_seen_and_freed_weights_drop_their_copy(copies, device):
    x, w, offsets, ids = _problem("mxfp4", 32, 64, device)
    lk.grouped_matmul(x, w, offsets, ids)
    other = lk.quantize(torch.randn(w.shape, device=device), "mxfp4")
    w.scales.copy_(other.scales)  # the data alone, then the scales: each write must show
    partly = lk.ScaledTensor(w.data.clone(), other.scales, "mxfp4").to_layout("hopper")
    assert torch.equal(lk.grouped_matmul(x, w, offsets, ids), lk.grouped_matmul(x, partly, offsets, ids))
    w.data.copy_(other.data)
    assert torch.equal(
        lk.grouped_matmul(x, w, offsets, ids), lk.grouped_matmul(x, other.to_layout("hopper"), offsets, ids)
    )
    assert len(copies) == 1
    del w
    gc.collect()
    assert len(copies) == 0


def test_interleaved_swiglu_with_bias(copies, device):
    """gpt-oss' interleaved gate/up rows: the copy and the bias are de-interleaved, the result is unchanged."""
    x, w, offsets, ids = _problem("mxfp4", 64, 64, device)
    bias = torch.randn(EXPERTS, 64, device=device)
    out = lk.grouped_matmul(x, w, offsets, ids, epilogue=GPT_OSS_SWIGLU, bias=bias)
    assert len(copies) == 1
    scales = w.scales.view(torch.uint8)
    halves_scales = torch.cat((scales[:, 0::2], scales[:, 1::2]), 1).view(w.scales.dtype)
    halves = lk.ScaledTensor(torch.cat((w.data[:, 0::2], w.data[:, 1::2]), 1), halves_scales, "mxfp4")
    halves_bias = torch.cat((bias[:, 0::2], bias[:, 1::2]), 1)
    glu = SwiGLU(GPT_OSS_SWIGLU.alpha, GPT_OSS_SWIGLU.limit, GPT_OSS_SWIGLU.up_shift)
    expected = lk.grouped_matmul(x, halves.to_layout("hopper"), offsets, ids, epilogue=glu, bias=halves_bias)
    assert torch.equal(out, expected)
    reference = lk.grouped_matmul_reference(x, w, offsets, ids, epilogue=GPT_OSS_SWIGLU, bias=bias)
    assert_close_relative(out.float(), reference, 8e-3)


def test_what_is_not_converted(copies, device, monkeypatch):
    x, w, offsets, ids = _problem("mxfp4", 32, 64, device)
    config = lk.BlockScaledMatmulConfig(block_m=16, block_n=32, block_k=64)
    lk.grouped_matmul(x, w, offsets, ids, config=config)  # an explicit config picks the row-layout kernel
    lk.grouped_matmul(x.half(), w, offsets, ids)  # fp16 activations: the Hopper kernel decodes to bf16
    lk.grouped_matmul(
        x, lk.quantize(torch.randn(EXPERTS, 40, 64, device=device), "mxfp4"), offsets, ids, epilogue="swiglu"
    )  # SwiGLU halves of 20 rows: not whole row blocks of the layout
    lk.grouped_matmul(x, lk.quantize(torch.randn(EXPERTS, 32, 64, device=device), "mxfp8"), offsets, ids)
    with torch.inference_mode():  # no version counter: a write could not be seen
        lk.grouped_matmul(x, lk.quantize(torch.randn(EXPERTS, 32, 64, device=device), "mxfp4"), offsets, ids)
    copies.enabled = False
    lk.grouped_matmul(x, w, offsets, ids)
    copies.enabled = True
    capturing = layout_cache.capturing
    monkeypatch.setattr(layout_cache, "capturing", lambda device: True)
    lk.grouped_matmul(x, w, offsets, ids)  # no conversion while a stream is captured: the row-layout kernel
    assert len(copies) == 0
    monkeypatch.setattr(layout_cache, "capturing", capturing)
    expected = lk.grouped_matmul(x, w.to_layout("hopper"), offsets, ids)
    assert torch.equal(lk.grouped_matmul(x, w, offsets, ids), expected) and len(copies) == 1
    with pytest.raises(ValueError, match="K"):  # a bad call still raises the call's own error
        lk.grouped_matmul(x[:, :32], w, offsets, ids)


def test_w4a8_lookup_shares_the_copy_and_its_rules(copies, device, monkeypatch):
    """``HOPPER_COPIES.get`` (the ``w4a8_decode`` backend's lookup at its launch, on the bytes the kernels read) finds
    the copy a bf16 call made of the same memory and makes the same one itself; it follows the module's rules: an
    in-place write converts again, freed weights drop the copy, none while a stream is captured, for tensors without
    version counters or when disabled, none (remembered) for parts the layout cannot hold."""
    x, w, offsets, ids = _problem("mxfp4", 32, 64, device)

    def as_read(b):  # what a plan hands its launches
        return b.data.view(torch.uint8), b.scales.view(torch.uint8)

    substituted, _, _ = copies.substitute(x, w, None, None, None)
    assert copies.get(*as_read(w)) is substituted and len(copies) == 1
    halves, _, _ = copies.substitute(x, w, GPT_OSS_SWIGLU, None, None)  # interleaved rows: a copy of their own
    assert copies.get(*as_read(w), interleaved=True) is halves and len(copies) == 2
    del halves
    other = lk.quantize(torch.randn(w.shape, device=device), "mxfp4")
    w.scales.copy_(other.scales)
    w.data.copy_(other.data)
    again = copies.get(*as_read(w))
    expected = other.to_layout("hopper")
    assert again is not substituted and len(copies) == 2
    assert torch.equal(again.data, expected.data) and torch.equal(again.scales.view(torch.uint8), as_read(expected)[1])
    del w, substituted, again
    gc.collect()
    assert len(copies) == 0

    fresh = lk.quantize(torch.randn(EXPERTS, 32, 64, device=device), "mxfp4")
    capturing = layout_cache.capturing
    monkeypatch.setattr(layout_cache, "capturing", lambda device: True)
    assert copies.get(*as_read(fresh)) is None
    monkeypatch.setattr(layout_cache, "capturing", capturing)
    with torch.inference_mode():
        assert copies.get(*as_read(lk.quantize(torch.randn(EXPERTS, 32, 64, device=device), "mxfp4"))) is None
    copies.enabled = False
    assert copies.get(*as_read(fresh)) is None
    copies.enabled = True
    assert len(copies) == 0
    data, scales = as_read(fresh)
    assert copies.get(data, scales[..., :1]) is None and len(copies) == 1  # scales of half of K: remembered
