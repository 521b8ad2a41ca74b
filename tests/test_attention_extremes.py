"""Extreme mask sizes and sinks: window sides of 2**30 and more (2**31 - 1, 2**40, 2**63 - 1, past int64)
and any negative side mean "no limit on that side", Chunked(2**40) puts every position in one chunk,
on every path (dense, ragged, paged, split-KV decode; dense and ragged K/V go through the tensor
descriptors). Each run equals, bit for bit, the same call with the equivalent finite window (or
no mask), and matches the reference. Sinks of +inf / -inf / NaN agree with the reference (O = 0 and
LSE = +inf / no sink / NaN), one pass and split. The custom op rejects negative chunk sizes and
softcaps. Tiny shapes for the CPU interpreter; every buffer the API allocates starts as NaN."""

import math

import numpy as np
import pytest
import torch
from test_attention import TOLERANCE, _check_lse, _cu_seqlens, _paged_cache, _qkv

from llmkernels import runtime
from llmkernels.attention import config as attention_config
from llmkernels.attention.api import attention
from llmkernels.attention.config import FA4Config
from llmkernels.attention.masks import UNBOUNDED, Chunked, SlidingWindow, resolve_mask
from llmkernels.attention.reference import attention_reference
from llmkernels.testing import assert_close_relative, poison

# The interpreter evaluates both sides of tl.where: -inf - -inf of fully masked rows warns in numpy.
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")

CONFIG = FA4Config(BM=16, BN=16, num_kv_stages=1)
HEADS, KV_HEADS, HEAD_DIM, DTYPE = 4, 2, 16, torch.float16
FINITE = 256  # a window side / chunk size past every sequence below: binds nothing, yet is finite

# (left, right): the brief's spellings of "no limit" on one or both sides, plus the largest side that
# still enters the kernel's int32 bound arithmetic unclamped and ints past int64.
WINDOWS = [
    (2**31 - 1, 2**31 - 1),
    (2**40, 2**40),
    (2**63 - 1, 0),
    (-5, 3),
    (-1, -1),
    (2**30, 2**30),
    (2**30 - 1, 2**30 - 1),
    (-(2**70), 2**64),
]
LAYOUTS = ["dense", "ragged", "paged", "decode", "paged_decode"]


@pytest.fixture(autouse=True)
def poisoned_buffers(monkeypatch):
    monkeypatch.setattr(
        runtime, "new_buffer", lambda shape, dtype, device: poison(torch.empty(shape, dtype=dtype, device=device))
    )


def _problem(layout, device):
    """(q, k, v, kwargs) of one layout; some sequences have Sq > Skv (with causal, rows that see nothing)."""
    kwargs = dict(config=CONFIG, num_splits=3 if layout.endswith("decode") else 1)
    if layout == "dense":
        q, k, v = _qkv(2, 37, 29, HEADS, KV_HEADS, HEAD_DIM, DTYPE, device)
    elif layout == "ragged":
        lengths_q, lengths_k = [7, 19], [23, 11]
        q = torch.randn(sum(lengths_q), HEADS, HEAD_DIM, dtype=DTYPE, device=device)
        k, v = (torch.randn(sum(lengths_k), KV_HEADS, HEAD_DIM, dtype=DTYPE, device=device) for _ in range(2))
        kwargs.update(
            cu_seqlens_q=_cu_seqlens(lengths_q, device),
            cu_seqlens_k=_cu_seqlens(lengths_k, device),
            max_seqlen_q=max(lengths_q),
            max_seqlen_k=max(lengths_k),
        )
    elif layout == "decode":
        q, k, v = _qkv(2, 1, 37, HEADS, KV_HEADS, HEAD_DIM, DTYPE, device)
    else:
        seqlens, seqlen_q = ([30, 9], 12) if layout == "paged" else ([37, 5], 1)
        kwargs["kv_cache"] = _paged_cache(seqlens, 16, KV_HEADS, HEAD_DIM, DTYPE, device)
        q, k, v = torch.randn(2, seqlen_q, HEADS, HEAD_DIM, dtype=DTYPE, device=device), None, None
    return q, k, v, kwargs


def _unbounded(side: int) -> bool:
    return side < 0 or side >= UNBOUNDED


def _finite(side: int) -> int:
    return FINITE if _unbounded(side) else side


def _run_and_compare(q, k, v, kwargs, mask, equivalents, what):
    """``mask``'s run equals each equivalent (mask, causal) run bit for bit and matches the reference
    of the first one."""
    out, lse = attention(q, k, v, mask=mask, return_lse=True, **kwargs)
    for equivalent in equivalents:
        expected_out, expected_lse = attention(q, k, v, mask=equivalent, return_lse=True, **kwargs)
        assert torch.equal(out, expected_out), f"{what}: out differs from mask={equivalent}"
        assert torch.equal(lse, expected_lse), f"{what}: lse differs from mask={equivalent}"
    ref_out, ref_lse = attention_reference(q, k, v, mask=equivalents[0], return_lse=True, **kwargs)
    assert_close_relative(out, ref_out, TOLERANCE[DTYPE], f"{what} out")
    _check_lse(lse, ref_lse, what)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", WINDOWS, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_unbounded_windows(device, layout, window, causal):
    q, k, v, kwargs = _problem(layout, device)
    kwargs["causal"] = causal
    left, right = window
    equivalents = [SlidingWindow(_finite(left), _finite(right))]
    if _unbounded(left) and (_unbounded(right) or causal):
        equivalents.append(None)  # no window at all (causal alone, or nothing)
    _run_and_compare(q, k, v, kwargs, SlidingWindow(left, right), equivalents, f"{layout} {window} causal={causal}")


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("layout", ["dense", "ragged", "paged", "decode"])
def test_huge_chunk_is_one_chunk(device, layout, causal):
    """Chunked(2**40): every position >= 0 in one chunk (rows with pos < 0 still see nothing)."""
    q, k, v, kwargs = _problem(layout, device)
    kwargs["causal"] = causal
    _run_and_compare(q, k, v, kwargs, Chunked(2**40), [Chunked(FINITE)], f"{layout} chunk causal={causal}")


@pytest.mark.parametrize("layout", ["dense", "decode"])
def test_huge_chunk_and_window_together(device, layout):
    q, k, v, kwargs = _problem(layout, device)
    _run_and_compare(
        q,
        k,
        v,
        kwargs,
        (SlidingWindow(2**40, -3), Chunked(2**63 - 1)),
        [(SlidingWindow(FINITE, FINITE), Chunked(FINITE))],
        f"{layout} chunk + window",
    )


def test_mask_resolution_of_extreme_sizes():
    """Every size reaching the kernel is in [0, UNBOUNDED] (int32 with room for pos + side + 1)."""
    for left, right in WINDOWS:
        for causal in (False, True):
            spec = resolve_mask(causal, SlidingWindow(left, right))
            assert 0 <= spec.window_left <= UNBOUNDED and 0 <= spec.window_right <= UNBOUNDED
            assert spec.window_left == (UNBOUNDED if _unbounded(left) else left)
            assert spec.has_window == (causal or not (_unbounded(left) and _unbounded(right)))
    assert resolve_mask(False, SlidingWindow(-1, -1)) == resolve_mask(False, None)
    assert resolve_mask(True, SlidingWindow(2**63 - 1, 2**40)) == resolve_mask(True, None)
    assert resolve_mask(False, SlidingWindow(2**63 - 1, 0)) == resolve_mask(True, None)
    assert resolve_mask(False, Chunked(2**40)).chunk_size == UNBOUNDED
    assert resolve_mask(False, Chunked(UNBOUNDED - 1)).chunk_size == UNBOUNDED - 1


@pytest.mark.parametrize(
    "causal, mask, band",
    [
        (False, SlidingWindow(2**40, 2**40), None),
        (False, SlidingWindow(2**63 - 1, 0), None),
        (True, SlidingWindow(2**31 - 1, -7), None),
        (False, SlidingWindow(-5, 3), None),
        (False, SlidingWindow(2**30 - 1, 0), 2**30),
        (True, Chunked(2**40), None),
        (False, Chunked(2**30 - 1), 2**30 - 1),
        (False, (SlidingWindow(2**40, 2**40), Chunked(2**50)), None),
        (False, (SlidingWindow(2**40, 5), Chunked(64)), 64),
        (True, (SlidingWindow(100, 2**40), Chunked(2**40)), 101),
    ],
)
def test_visible_band_of_extreme_masks(causal, mask, band):
    assert resolve_mask(causal, mask).visible_band == band


def test_hopper_tiles_for_extreme_windows(monkeypatch):
    """The 64 x 64 short-band tiles are for short windows only, not for "no window" spelled with huge sizes."""
    monkeypatch.setattr(attention_config, "cuda_capability", lambda device: (9, 0))
    default = attention_config.default_config.__wrapped__
    device = torch.device("cuda", 0)
    wide = default(128, torch.bfloat16, device)
    for causal, mask in [
        (False, SlidingWindow(2**40, 2**40)),
        (True, SlidingWindow(2**63 - 1, 0)),
        (True, Chunked(2**40)),
        (False, SlidingWindow(-5, 2**31 - 1)),
    ]:
        band = resolve_mask(causal, mask).visible_band
        assert default(128, torch.bfloat16, device, visible_band=band) == wide, mask
    short = resolve_mask(True, SlidingWindow(127, 2**40)).visible_band  # 128 keys: causal caps the huge right side
    narrow = default(128, torch.bfloat16, device, visible_band=short)
    assert (narrow.BM, narrow.BN) == (64, 64)


def test_window_and_chunk_argument_types():
    """Any int (and numpy / torch integer scalars, stored as int); bool, float and the rest raise TypeError."""
    assert SlidingWindow(-5, -(2**70)) == SlidingWindow(-5, -(2**70))
    window = SlidingWindow(np.int64(7), torch.tensor(-3))
    assert window == SlidingWindow(7, -3) and type(window.left) is int and type(window.right) is int
    chunk = Chunked(np.int32(16))
    assert chunk == Chunked(16) and type(chunk.size) is int
    for bad in (
        True,
        np.bool_(False),
        torch.tensor(True),
        1.0,
        np.float32(2.0),
        torch.tensor(2.0),
        "3",
        None,
        torch.tensor([3]),
    ):
        with pytest.raises(TypeError, match="SlidingWindow.left"):
            SlidingWindow(bad, 0)
        with pytest.raises(TypeError, match="SlidingWindow.right"):
            SlidingWindow(0, bad)
        with pytest.raises(TypeError, match="Chunked.size"):
            Chunked(bad)
    for bad in (0, -1, -(2**40)):
        with pytest.raises(ValueError, match="Chunked.size"):
            Chunked(bad)


# --------------------------------------------------------------------------- sinks of +inf, -inf, NaN


@pytest.mark.parametrize("num_splits", [1, 3])
def test_infinite_and_nan_sinks(device, num_splits):
    """Per head: sink +inf takes all the weight (O = 0, LSE = +inf, also on rows that see no key), -inf is
    no sink (bit for bit), NaN gives NaN, a finite sink is as usual. Causal with Sq > Skv: the first rows
    see no key."""
    q, k, v = _qkv(2, 24, 17, HEADS, KV_HEADS, HEAD_DIM, DTYPE, device)
    sinks = torch.tensor([math.inf, -math.inf, math.nan, 0.75], device=device)
    kwargs = dict(causal=True, num_splits=num_splits, config=CONFIG, return_lse=True)
    out, lse = attention(q, k, v, sinks=sinks, **kwargs)
    ref_out, ref_lse = attention_reference(q, k, v, sinks=sinks, **kwargs)
    plain_out, plain_lse = attention(q, k, v, **kwargs)

    assert torch.equal(ref_out[:, :, 0], torch.zeros_like(ref_out[:, :, 0]))  # the reference's own answer
    assert torch.all(ref_lse[:, 0] == math.inf)
    assert torch.all(out[:, :, 0] == 0) and torch.all(lse[:, 0] == math.inf)
    assert torch.equal(out[:, :, 1], plain_out[:, :, 1]) and torch.equal(lse[:, 1], plain_lse[:, 1])
    assert torch.isnan(ref_out[:, :, 2]).all() and torch.isnan(ref_lse[:, 2]).all()
    assert torch.isnan(out[:, :, 2]).all() and torch.isnan(lse[:, 2]).all()
    finite_heads = [1, 3]
    assert_close_relative(out[:, :, finite_heads], ref_out[:, :, finite_heads], TOLERANCE[DTYPE], "out")
    _check_lse(lse[:, finite_heads], ref_lse[:, finite_heads], "sinks")


@pytest.mark.parametrize("num_splits", [1, 3])
def test_infinite_sinks_paged_decode(device, num_splits):
    cache = _paged_cache([37, 0], 16, KV_HEADS, HEAD_DIM, DTYPE, device)  # sequence 1 holds no key
    q = torch.randn(2, 1, HEADS, HEAD_DIM, dtype=DTYPE, device=device)
    sinks = torch.tensor([math.inf, -math.inf, math.inf, -math.inf], device=device)
    out, lse = attention(
        q, None, None, kv_cache=cache, sinks=sinks, num_splits=num_splits, config=CONFIG, return_lse=True
    )
    ref_out, ref_lse = attention_reference(q, None, None, kv_cache=cache, sinks=sinks, return_lse=True)
    assert torch.equal(torch.isposinf(lse), torch.isposinf(ref_lse)) and torch.isposinf(lse[:, 0::2]).all()
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse)) and torch.isneginf(lse[1, 1::2]).all()
    assert torch.all(out[:, :, 0::2] == 0) and torch.all(out[1] == 0)
    assert_close_relative(out, ref_out, TOLERANCE[DTYPE], "out")
    _check_lse(lse[0, 1::2], ref_lse[0, 1::2], "lse")


# --------------------------------------------------------------------------- the custom op


def _op_args(q, k, v, *, has_window=False, left=-1, right=-1, chunk=0, softcap=0.0):
    return (
        q,
        k,
        v,
        has_window,
        left,
        right,
        chunk,
        softcap,
        None,
        None,
        q.shape[-1] ** -0.5,
        None,
        None,
        None,
        None,
        None,
        None,
        None,
        None,
        1,
        True,
    )


def test_op_rejects_negative_chunk_and_softcap(device):
    q, k, v = _qkv(1, 5, 7, 2, 1, HEAD_DIM, DTYPE, device)
    op = torch.ops.llmkernels.attention
    for kwargs, name in (
        (dict(chunk=-1), "chunk_size"),
        (dict(chunk=-(2**40)), "chunk_size"),
        (dict(softcap=-1.0), "softcap"),
        (dict(softcap=-1e-30), "softcap"),
        (dict(softcap=math.nan), "softcap"),
    ):
        with pytest.raises(ValueError, match=name):
            op(*_op_args(q, k, v, **kwargs))
    out, lse = op(*_op_args(q, k, v, chunk=0, softcap=0.0))  # 0 still means "none"
    expected_out, expected_lse = attention(q, k, v, return_lse=True, num_splits=1)
    assert torch.equal(out, expected_out) and torch.equal(lse, expected_lse)
    for left, right in ((-1, -1), (2**40, 2**63 - 1), (-5, -(2**63))):
        out, lse = op(*_op_args(q, k, v, has_window=True, left=left, right=right))
        assert torch.equal(out, expected_out) and torch.equal(lse, expected_lse), (left, right)
    out, lse = op(*_op_args(q, k, v, chunk=2**40))
    expected_out, expected_lse = attention(q, k, v, mask=Chunked(FINITE), return_lse=True, num_splits=1)
    assert torch.equal(out, expected_out) and torch.equal(lse, expected_lse)
