"""Property-based tests (hypothesis): quantize/dequantize, grouped_matmul and attention against the
package's references on randomly drawn shapes, values, layouts and options.

Each test is parametrized over its main compile-time choice (the format, the format pair, the
attention layout and dtype), so that every one of them is exercised in every run; hypothesis draws the
rest. Profiles (registered in ``conftest.py``, picked by ``LLMK_HYPOTHESIS_PROFILE``):

* ``ci`` (default): derandomized (the same examples in every run), no deadline, ``CI_EXAMPLES``
  examples per parametrized case: about 2 minutes for the module on a 2-core CPU through Triton's
  interpreter.
* ``gpu-long``: 1000 fresh examples per test function (spread over its parametrized cases), for a
  CUDA GPU with the interpreter off::

      LLMK_HYPOTHESIS_PROFILE=gpu-long python -m pytest tests/test_properties.py

  On the GPU the shapes are larger, and the choices that are ``tl.constexpr`` in the kernels (epilogue,
  scale layouts, config, head dim, masks, ...) are drawn as one of a fixed pool of variants per case
  (``_variant_pool``), so that a long run compiles a bounded number of kernels and reuses them.

Tensors come from a ``torch.Generator`` seeded by a drawn integer, so an example that hypothesis
prints is reproducible on its own. Outputs are poisoned with NaN first: an element the kernels forget
to write fails.
"""

from __future__ import annotations

import math
import random
from unittest import mock

import pytest
import torch
import triton
import triton.language as tl

pytest.importorskip("hypothesis")
from hypothesis import assume, event, given, note, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import llmkernels as lk  # noqa: E402
from llmkernels.attention import api as attention_api  # noqa: E402
from llmkernels.attention import default_config as attention_default_config  # noqa: E402
from llmkernels.formats import FORMATS, nvfp4_global_scale, to_blocked_scales, to_grouped_blocked_scales  # noqa: E402
from llmkernels.formats.reference import decode_e8m0  # noqa: E402
from llmkernels.grouped_matmul import config as gm_config  # noqa: E402
from llmkernels.runtime import interpreting  # noqa: E402
from llmkernels.testing import default_device, on_gpu, poison, random_group_offsets, relative_error  # noqa: E402

# The interpreter evaluates both sides of tl.where: -inf - -inf of fully masked rows warns in numpy.
pytestmark = pytest.mark.filterwarnings(
    "ignore:invalid value encountered:RuntimeWarning", "ignore:overflow encountered:RuntimeWarning"
)

GPU = on_gpu()
INTERPRETER = interpreting()
DEVICE = default_device()
CI = settings.get_current_profile_name() == "ci"

# Examples per parametrized case in the ci profile (cases: formats 3, format pairs 13, attention
# layouts x dtypes 8).
CI_EXAMPLES = {
    "quantize_bits": 100,
    "round_trip": 100,
    "grouped_matmul": 10,
    "attention": 10,
}


def budget(name: str, cases: int):
    """ci: ``CI_EXAMPLES[name]`` examples per case. Other profiles: their ``max_examples`` per test
    function, spread over its ``cases`` parametrized cases (gpu-long: 1000 / cases each)."""
    if CI:
        return settings(max_examples=CI_EXAMPLES[name])
    return settings(max_examples=max(1, -(-settings().max_examples // cases)))


SEEDS = st.integers(0, 2**32 - 1)


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(generator, *shape, dtype=torch.float32):
    """Gaussian on the CPU from ``generator``, then moved to the test device."""
    return torch.randn(*shape, generator=generator).to(dtype=dtype, device=DEVICE)


def _variant_pool(make_variant, forced_axes: dict, repeats: int) -> list:
    """A fixed pool of kernel variants for the GPU: every combination of ``forced_axes`` (name -> options)
    ``repeats`` times, the other choices of ``make_variant(choose)`` drawn by a seeded ``random.Random``.
    Empty off the GPU (the interpreter compiles nothing, so there every choice is drawn freely)."""
    if not GPU:
        return []
    names = list(forced_axes)
    combinations = [()]
    for name in names:
        combinations = [c + (option,) for c in combinations for option in forced_axes[name]]
    pool = []
    for index, forced in enumerate(combinations * repeats):
        rng = random.Random(index)
        fixed = dict(zip(names, forced))

        def choose(name, options, rng=rng, fixed=fixed):
            options = list(options)
            if name in fixed and fixed[name] in options:
                return fixed[name]
            return options[rng.randrange(len(options))]

        pool.append(make_variant(choose))
    return pool


def _draw_variant(data, make_variant, pool):
    """CPU: every constexpr-like choice drawn on its own. GPU: one variant of the fixed pool."""
    if GPU:
        variant = data.draw(st.sampled_from(pool), label="kernel variant")
    else:
        variant = make_variant(lambda name, options: data.draw(st.sampled_from(list(options)), label=name))
    return variant


# ==================================================================================================
# quantize / dequantize
# ==================================================================================================

FORMAT_NAMES = ("mxfp8", "mxfp4", "nvfp4")
INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# How the magnitudes of one scale block are drawn (each block picks one of the example's regimes).
VALUE_REGIMES = ("normal", "tiny", "huge", "near_max", "mixed", "zero", "signed_zero", "grid")
MAX_ROWS = 600 if GPU else 70
MAX_COLS = 4096 if GPU else 384


def _binades(dtype):
    """(lowest binade of a subnormal, highest binade) of a floating dtype: fp32 (-149, 127)."""
    info = torch.finfo(dtype)
    mantissa_bits = -int(math.log2(info.eps))
    return int(math.log2(info.tiny)) - mantissa_bits, int(math.floor(math.log2(info.max)))


def _element_grid(spec) -> torch.Tensor:
    """float64 non-negative values of the element type."""
    if spec.element == "e2m1":
        return torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)
    values = torch.arange(128, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).double()
    return values[torch.isfinite(values)]


def _block_values(generator, num_blocks: int, spec, dtype, regimes, spread: int) -> torch.Tensor:
    """float64 ``[num_blocks, block]``: one regime per block, elements inside a block spread over
    ``spread`` binades below the block's top, random signs."""
    low, high = _binades(dtype)
    block = spec.block
    gaussian = torch.randn(num_blocks, block, generator=generator, dtype=torch.float64)
    if spread:
        gaussian *= torch.exp2(-torch.randint(0, spread + 1, (num_blocks, block), generator=generator).double())
    choice = torch.randint(0, len(regimes), (num_blocks,), generator=generator)
    out = torch.empty(num_blocks, block, dtype=torch.float64)
    info_max = torch.finfo(dtype).max
    signs = torch.where(torch.rand(num_blocks, block, generator=generator) < 0.5, -1.0, 1.0).double()
    grid = _element_grid(spec)
    candidates = torch.cat([grid, (grid[1:] + grid[:-1]) / 2])  # values and rounding ties
    for index, regime in enumerate(regimes):
        rows = choice == index
        count = int(rows.sum())
        if count == 0:
            continue
        if regime == "normal":
            values = gaussian[rows]
        elif regime == "tiny":  # around and below the smallest normal of the input dtype
            exponent = torch.randint(low, low + 14, (count, 1), generator=generator).double()
            values = gaussian[rows] * torch.exp2(exponent)
        elif regime == "huge":
            exponent = torch.randint(high - 6, high, (count, 1), generator=generator).double()
            values = gaussian[rows] * torch.exp2(exponent)
        elif regime == "near_max":  # |x| in [max / 2, max], some exactly max
            values = info_max * (0.5 + 0.5 * torch.rand(count, block, generator=generator, dtype=torch.float64))
            values[:, 0] = info_max
        elif regime == "mixed":  # each block somewhere in the whole range
            exponent = torch.randint(low, high - 1, (count, 1), generator=generator).double()
            values = gaussian[rows] * torch.exp2(exponent)
        elif regime == "zero":
            values = torch.zeros(count, block, dtype=torch.float64)
        elif regime == "signed_zero":
            values = torch.zeros(count, block, dtype=torch.float64) * signs[rows]  # ±0
        else:  # "grid": element values and midpoints times a power of two, amax in the top binade
            picks = torch.randint(0, len(candidates), (count, block), generator=generator)
            values = candidates[picks]
            values[:, 0] = spec.element_max
            values *= torch.exp2(torch.randint(-8, 7, (count, 1), generator=generator).double())
        out[rows] = values * (signs[rows] if regime != "signed_zero" else 1.0)
    return out.clamp(-info_max, info_max)


def _make_input(seed, lead_shape, num_cols, spec, dtype, regimes, spread) -> torch.Tensor:
    generator = _generator(seed)
    num_rows = math.prod(lead_shape)
    blocks = _block_values(generator, num_rows * (num_cols // spec.block), spec, dtype, regimes, spread)
    x = blocks.reshape(*lead_shape, num_cols).to(dtype)
    if dtype == torch.bfloat16 and INTERPRETER:
        # Triton 3.9's interpreter converts subnormal bf16 to float32 wrongly (see
        # test_interpreter_bf16_subnormal_upcast): flush them to (signed) zero there; the GPU keeps them.
        x = torch.where(x.abs() < torch.finfo(dtype).tiny, x * 0, x)
    return x.to(DEVICE)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


# Smallest amax(x) whose nvfp4 decode scale amax / 2688 is a normal float32. Below it the default
# global scale is floored at 2^-126 (test_nvfp4_global_scale_floor), which the round-trip bound below
# does not model; the bits test covers it.
NVFP4_MIN_NORMAL_AMAX = 2688.0 * 2.0**-126


@st.composite
def quantize_inputs(draw, format: str):
    spec = FORMATS[format]
    dtype = draw(st.sampled_from(INPUT_DTYPES), label="dtype")
    lead_shape = draw(
        st.one_of(
            st.tuples(st.integers(0, MAX_ROWS)),
            st.tuples(st.integers(0, 4), st.integers(0, MAX_ROWS // 4)),
            st.just(()),
        ),
        label="leading shape",
    )
    num_cols = spec.block * draw(st.integers(1, MAX_COLS // spec.block), label="K / block")
    regimes = tuple(
        draw(st.lists(st.sampled_from(VALUE_REGIMES), min_size=1, max_size=3, unique=True), label="value regimes")
    )
    spread = draw(st.sampled_from([0, 3, 10, 40]), label="binades spread inside a block")
    seed = draw(SEEDS, label="seed")
    return format, spec, dtype, lead_shape, num_cols, regimes, spread, seed


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("format", FORMAT_NAMES)
@budget("quantize_bits", len(FORMAT_NAMES))
@given(data=st.data())
def test_quantize_matches_reference_bits(format, data):
    """The Triton quantize kernel writes the same bits as quantize_reference, in both scale layouts,
    with a given or default nvfp4 global scale, and for gathered rows."""
    inputs = data.draw(quantize_inputs(format), label="inputs")
    format, spec, dtype, lead_shape, num_cols, regimes, spread, seed = inputs
    x = _make_input(seed, lead_shape, num_cols, spec, dtype, regimes, spread)
    global_scale = None
    if spec.has_global_scale and data.draw(st.booleans(), label="explicit global_scale"):
        exponent = data.draw(st.integers(-126, 120), label="global_scale binade")
        global_scale = torch.tensor(2.0**exponent * 1.3, dtype=torch.float32, device=DEVICE)
    rows = None
    reference_global_scale = global_scale
    if x.dim() == 2 and x.shape[0] > 0 and data.draw(st.booleans(), label="gather rows"):
        # indices out of order, repeated and out of range (clamped to x's rows)
        rows = torch.tensor(
            data.draw(st.lists(st.integers(-2, x.shape[0] + 1), max_size=20), label="rows"),
            dtype=torch.int64,
            device=DEVICE,
        )
        if spec.has_global_scale and global_scale is None:  # the default comes from all of x
            reference_global_scale = nvfp4_global_scale(x)
    layout = "row"
    group_offsets = None
    if x.dim() >= 2 and data.draw(st.booleans(), label="128x4 scales"):
        layout = "128x4"
        num_rows = x.shape[0] if rows is None else rows.shape[0]
        if x.dim() == 2 and data.draw(st.booleans(), label="grouped 128x4 scales"):
            sizes = data.draw(st.lists(st.integers(0, max(num_rows, 1)), max_size=4), label="group sizes")
            sizes = _clip_sizes(sizes, num_rows)
            group_offsets = random_group_offsets(sizes, device=DEVICE)

    event(f"dtype={dtype}")
    for regime in regimes:
        event(f"regime={regime}")
    event(f"layout={layout}{' grouped' if group_offsets is not None else ''}")
    if rows is not None:
        event("gathered rows")
    if spec.has_global_scale and global_scale is not None:
        event("explicit global_scale")
    if x.numel() == 0:
        event("empty x")
    ours = lk.quantize(
        x, format, global_scale=global_scale, scale_layout=layout, group_offsets=group_offsets, rows=rows
    )
    source = x if rows is None else x[rows.clamp(0, x.shape[0] - 1)]
    ref = lk.quantize_reference(source, format, global_scale=reference_global_scale)
    assert ours.data.shape == ref.data.shape and ours.data.dtype == ref.data.dtype
    same_data = torch.equal(_bits(ours.data), _bits(ref.data))
    assert same_data, _first_difference(ours.data, ref.data, "data")
    if spec.has_global_scale:
        assert ours.global_scale.dtype == torch.float32 and ours.global_scale.numel() == 1
        assert torch.equal(ours.global_scale.reshape(()), ref.global_scale.reshape(()))
    assert ours.scale_layout == layout
    if layout == "row":
        expected_scales = ref.scales
    elif group_offsets is None:
        expected_scales = to_blocked_scales(ref.scales)
    else:
        expected_scales, group_scale_offsets = to_grouped_blocked_scales(ref.scales, group_offsets)
        assert torch.equal(ours.group_scale_offsets, group_scale_offsets)
    assert ours.scales.shape == expected_scales.shape
    same_scales = torch.equal(_bits(ours.scales), _bits(expected_scales))
    assert same_scales, _first_difference(ours.scales, expected_scales, "scales")


def _clip_sizes(sizes, total):
    """Group sizes cut so that they sum to at most ``total`` (the rest are trailing rows)."""
    clipped = []
    for size in sizes:
        size = min(size, total - sum(clipped))
        clipped.append(size)
    return clipped


def _first_difference(actual, expected, what):
    a, e = _bits(actual).reshape(-1), _bits(expected).reshape(-1)
    if a.shape != e.shape:
        return f"{what}: shapes {tuple(actual.shape)} != {tuple(expected.shape)}"
    where = (a != e).nonzero()
    if where.numel() == 0:
        return f"{what}: equal"
    index = int(where[0])
    return (
        f"{what}: {where.numel()} bytes differ, first at flat index {index}: "
        f"{int(a[index]):#x} != {int(e[index]):#x} (expected)"
    )


def _half_ulp_and_saturation(y_abs: torch.Tensor, spec) -> torch.Tensor:
    """Most that rounding ``|y|`` (in units of the block scale) to the element grid can move it:
    half the grid spacing at ``|y|``, plus what saturation at the element maximum cuts off."""
    mantissa_bits, lowest_exponent = (3, -6) if spec.element == "e4m3" else (1, 0)
    exponent = torch.frexp(y_abs).exponent.double() - 1
    exponent = torch.where(y_abs > 0, exponent, float(lowest_exponent)).clamp(min=lowest_exponent)
    return torch.exp2(exponent - mantissa_bits - 1) + (y_abs - spec.element_max).clamp(min=0)


# e4m3 rounding of the nvfp4 block scale (2^-4 relative) after float32 divisions that may round in the
# subnormal range (a few ulp of 2^-17 there)
NVFP4_SCALE_ROUNDING = 2.0**-4 + 2.0**-14


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("format", FORMAT_NAMES)
@budget("round_trip", len(FORMAT_NAMES))
@given(data=st.data())
def test_dequantize_quantize_round_trip_error_bound(format, data):
    """dequantize(quantize(x)) is within the format's error bound of x, element by element.

    The block scales are the ones the conventions prescribe: MX ``2^(floor(log2 amax) - emax)``
    (clamped to e8m0's range), nvfp4 the e4m3 rounding of ``amax / 6 / global_scale`` (clamped to
    [2^-6, 448]) with ``global_scale = amax(x) / 2688``. So ``|x| / scale`` stays below the element
    type's saturation point by at most what the scale rule allows (MX: < 2^(emax+1); nvfp4: ≈ 6.4), and
    each element is off by at most half the element grid's spacing at ``|x| / scale`` (plus the
    saturation excess), times the scale.
    """
    inputs = data.draw(quantize_inputs(format), label="inputs")
    layout = data.draw(st.sampled_from(["row", "128x4"]), label="scale layout")
    format, spec, dtype, lead_shape, num_cols, regimes, spread, seed = inputs
    x = _make_input(seed, lead_shape, num_cols, spec, dtype, regimes, spread)
    if spec.has_global_scale and x.numel():
        amax_all = x.abs().max().item()
        assume(amax_all == 0 or amax_all >= NVFP4_MIN_NORMAL_AMAX)
    if layout == "128x4" and x.dim() < 2:
        layout = "row"
    q = lk.quantize(x, format, scale_layout=layout)
    decoded = lk.dequantize(q)
    assert decoded.dtype == torch.float32 and decoded.shape == x.shape
    if x.numel() == 0:
        return
    x64 = x.double().cpu()
    blocks = x64.reshape(-1, num_cols // spec.block, spec.block)
    amax = blocks.abs().amax(-1)
    row_scales = q.to_layout("row").scales.cpu()
    if spec.scale == "e8m0":
        scale = decode_e8m0(_bits(row_scales)).double().reshape(amax.shape)
        exponent = torch.where(amax > 0, torch.frexp(amax).exponent - 1, -1000)
        expected_bits = (exponent - spec.emax).clamp(-127, 127) + 127
        assert torch.equal(_bits(row_scales).reshape(amax.shape).long(), expected_bits.long()), "MX scale rule"
        y_limit = 2.0 ** (spec.emax + 1)
    else:
        global_scale = q.global_scale.double().cpu().reshape(())
        tensor_amax = x64.abs().max()
        expected_global = (tensor_amax / 2688.0).float().double() if tensor_amax > 0 else torch.tensor(1.0).double()
        assert global_scale == expected_global, f"global scale {global_scale} != amax / 2688 = {expected_global}"
        block_scale = row_scales.double().reshape(amax.shape)
        target = amax / 6.0 / global_scale
        low, high = 2.0**-6, 448.0
        inside = (target > low) & (target < high)
        assert (block_scale[target <= low] == low).all(), "nvfp4 block scale not clamped to 2^-6"
        assert (block_scale[target >= high] == high).all(), "nvfp4 block scale not clamped to 448"
        scale_error = (block_scale[inside] - target[inside]).abs() / target[inside]
        assert (scale_error <= NVFP4_SCALE_ROUNDING).all(), (
            f"nvfp4 block scale off the e4m3 rounding of amax / 6 / global_scale by {scale_error.max().item():.3g}"
        )
        scale = (row_scales.float().reshape(amax.shape) * q.global_scale.float().cpu()).double()
        y_limit = spec.element_max / (1 - NVFP4_SCALE_ROUNDING) * (1 + 2.0**-20)
    assert torch.isfinite(decoded).all(), "dequantize gave inf/NaN"
    scale = scale[..., None]
    assert (scale > 0).all()
    y_abs = blocks.abs() / scale
    assert (y_abs <= y_limit).all(), f"|x| / scale = {y_abs.max().item()} > {y_limit}: scale too small"
    bound = scale * _half_ulp_and_saturation(y_abs, spec)
    error = (decoded.double().cpu().reshape(blocks.shape) - blocks).abs()
    # float32 rounding of scale * code in dequantize (nvfp4's scale is not a power of two)
    slack = blocks.abs() * 2.0**-21 + 2.0**-147
    bad = ~(error <= bound + slack)
    assert not bad.any(), (
        f"{int(bad.sum())} elements outside the rounding bound; first: x={blocks[bad][0].item()!r} "
        f"decoded={decoded.double().cpu().reshape(blocks.shape)[bad][0].item()!r} "
        f"scale={scale.expand_as(blocks)[bad][0].item()!r}"
    )


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("amax_binade", [-149, -137, -126, -116])
def test_nvfp4_global_scale_floor(amax_binade):
    """Minimal examples found by the properties above: nvfp4 of float32 subnormals, a block of
    (2^-149, 0) and a block whose amax is ``2^amax_binade``. Without a floor, ``amax / 2688`` is 0
    (-149) or subnormal (-137) and ``block_scale · global_scale`` 0, so that kernel and reference
    coded ``x / 0`` differently. With the floor of 2^-126 both agree, nothing decodes to NaN or inf,
    and what is lost is below 2^-126 in magnitude."""
    x = torch.zeros(1, 32, device=DEVICE)
    x[0, 0:16:2] = 2.0**-149
    x[0, 16] = 2.0**amax_binade
    ours, ref = lk.quantize(x, "nvfp4"), lk.quantize_reference(x, "nvfp4")
    assert torch.equal(_bits(ours.scales), _bits(ref.scales)) and torch.equal(_bits(ours.data), _bits(ref.data))
    assert ours.global_scale.item() == ref.global_scale.item() >= 2.0**-126
    decoded = lk.dequantize(ours)
    assert torch.isfinite(decoded).all()
    assert (decoded - x).abs().max().item() <= 2.0**-126 + 0.25 * x.abs().max().item()


@triton.jit
def _upcast_kernel(x_ptr, y_ptr, N: tl.constexpr):
    offsets = tl.arange(0, N)
    tl.store(y_ptr + offsets, tl.load(x_ptr + offsets).to(tl.float32))


@pytest.mark.xfail(
    INTERPRETER,
    strict=True,
    reason="Triton 3.9's interpreter (_convert_float) upcasts subnormal bf16 to wrong float32 "
    "values; compiled kernels are exact. The property tests flush bf16 subnormals there.",
)
def test_interpreter_bf16_subnormal_upcast():
    x = torch.tensor([2.0**-127, -3 * 2.0**-130, 2.0**-133, 1.5 * 2.0**-126], dtype=torch.bfloat16, device=DEVICE)
    y = torch.empty(4, device=DEVICE)
    _upcast_kernel[(1,)](x, y, N=4)
    assert torch.equal(y, x.float()), (y.tolist(), x.float().tolist())


# ==================================================================================================
# grouped_matmul
# ==================================================================================================

PLAIN = ("bf16", "fp16")
# Every pair the API accepts: plain x plain of one dtype, plain activations x any quantized weights,
# MX x MX, nvfp4 x nvfp4 (tests/test_grouped_matmul.py's FORMAT_PAIRS and the three it leaves out).
GM_FORMAT_PAIRS = (
    ("bf16", "bf16"),
    ("fp16", "fp16"),
    ("bf16", "mxfp8"),
    ("bf16", "mxfp4"),
    ("bf16", "nvfp4"),
    ("fp16", "mxfp8"),
    ("fp16", "mxfp4"),
    ("fp16", "nvfp4"),
    ("mxfp8", "mxfp8"),
    ("mxfp4", "mxfp4"),
    ("mxfp8", "mxfp4"),
    ("mxfp4", "mxfp8"),
    ("nvfp4", "nvfp4"),
)
GM_EPILOGUES = (None, "silu", "gelu", "swiglu")
# Relative error bounds by output dtype (as tests/test_grouped_matmul.py): decoded products are exact
# in bf16/fp16 and accumulate in fp32; what is left is the fp32 summation and the output rounding.
GM_TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 8e-3, torch.float16: 1e-3}
GM_OUT_DTYPES = (torch.bfloat16, torch.float32) if GPU else (torch.float32, torch.bfloat16, torch.float16)


def _tile_heights() -> list[int]:
    """The M tile heights the default configs use on this device (the interpreter's is 16)."""
    if not GPU:
        return [gm_config.default_config(64, 4, 64, 64, DEVICE).block_m]
    return [16, 32, 64, 128]


def _special_group_sizes() -> list[int]:
    sizes = {0, 1, 2}
    for tile in _tile_heights():
        sizes |= {tile - 1, tile, tile + 1, 2 * tile + 1}
    for low, high, _ in gm_config.DECODE_CLASSES:  # size-class bounds of the default launches
        for bound in (low, high):
            if 0 <= bound < 1000:
                sizes |= {bound, bound + 1}
    return sorted(sizes)


SPECIAL_GROUP_SIZES = _special_group_sizes()
GM_LIMITS = (
    dict(max_experts=16, max_groups=24, max_random_size=600, max_n=640, max_k=2048)
    if GPU
    else dict(max_experts=5, max_groups=6, max_random_size=40, max_n=80, max_k=192)
)
# Explicit configs besides the default: small tiles, swap-AB, tl.dot_scaled (MX weights only), A
# decoded ahead (quantized A only).
SMALL_TILES = dict(block_m=16, block_n=32, block_k=64, num_stages=1, num_warps=4)
GM_CONFIGS = {
    "default": None,
    "swapped": lk.BlockScaledMatmulConfig(**SMALL_TILES, ab_swapped=True),
    "dot_scaled": lk.BlockScaledMatmulConfig(**SMALL_TILES, mma="dot_scaled"),
    "dot_scaled_swapped": lk.BlockScaledMatmulConfig(**SMALL_TILES, mma="dot_scaled", ab_swapped=True),
    "upcast": lk.BlockScaledMatmulConfig(**SMALL_TILES, upcast_a=True),
}


def _scale_block(format: str) -> int:
    return FORMATS[format].block if format in FORMATS else 1


def _gm_variant(choose, formats) -> dict:
    """The choices besides the formats that are constexpr in the kernel (or pick its code path)."""
    a_format, b_format = formats
    epilogue = choose("epilogue", GM_EPILOGUES)
    a_layout = choose("a_scale_layout", ("row", "128x4", "128x4_grouped") if a_format in FORMATS else ("row",))
    b_layout = choose("b_scale_layout", ("row", "128x4") if b_format in FORMATS else ("row",))
    dot_scaled_ok = (
        FORMATS.get(b_format) is not None
        and FORMATS[b_format].scale == "e8m0"
        and (a_format == "bf16" or (a_format in FORMATS and FORMATS[a_format].scale == "e8m0"))
    )
    configs = (
        ("default", "swapped")
        + (("dot_scaled", "dot_scaled_swapped") if dot_scaled_ok else ())
        + (("upcast",) if a_format in FORMATS else ())
    )
    config = choose("config", configs)
    expert_scales = choose("expert_scales", (False, True))
    out_dtype = choose("out_dtype", GM_OUT_DTYPES)
    offsets_dtype = choose("offsets_dtype", (torch.int32, torch.uint32))
    return dict(
        a_format=a_format,
        b_format=b_format,
        epilogue=epilogue,
        a_layout=a_layout,
        b_layout=b_layout,
        config=config,
        expert_scales=expert_scales,
        out_dtype=out_dtype,
        offsets_dtype=offsets_dtype,
    )


GM_POOLS = {
    formats: _variant_pool(
        lambda choose, formats=formats: _gm_variant(choose, formats), {"epilogue": GM_EPILOGUES}, repeats=4
    )
    for formats in GM_FORMAT_PAIRS
}


def _expert_ids(num_groups: int, num_experts: int):
    """int lists of length G: independent ids in [-1, E) (repeats, -1), or a permutation of
    [-1, E) cycled (every expert once before any repeats)."""
    independent = st.lists(st.integers(-1, num_experts - 1), min_size=num_groups, max_size=num_groups)
    permuted = st.permutations(list(range(-1, num_experts))).map(lambda p: [p[i % len(p)] for i in range(num_groups)])
    return st.one_of(independent, permuted)


def _make_operand(x: torch.Tensor, format: str):
    if format in PLAIN:
        return x.to(torch.bfloat16 if format == "bf16" else torch.float16)
    return lk.quantize(x, format)


@pytest.mark.parametrize("formats", GM_FORMAT_PAIRS, ids="x".join)
@budget("grouped_matmul", len(GM_FORMAT_PAIRS))
@given(data=st.data())
def test_grouped_matmul_matches_reference(formats, data):
    """grouped_matmul into a NaN-poisoned ``out`` equals grouped_matmul_reference on every row inside a
    group (-1 groups: zeros), and rows past the last group keep their poison."""
    variant = _draw_variant(data, lambda choose: _gm_variant(choose, formats), GM_POOLS[formats])
    note(f"variant: {variant}")
    limits = GM_LIMITS
    num_experts = data.draw(st.integers(1, limits["max_experts"]), label="num_experts")
    group_size = st.one_of(st.sampled_from(SPECIAL_GROUP_SIZES), st.integers(0, limits["max_random_size"]))
    # uniform (integers() would favour 0, an empty problem); shrinks towards one group
    num_groups = data.draw(st.sampled_from([*range(1, limits["max_groups"] + 1), 0]), label="number of groups")
    sizes = data.draw(st.lists(group_size, min_size=num_groups, max_size=num_groups), label="group sizes")
    ids = data.draw(_expert_ids(len(sizes), num_experts), label="expert ids")
    trailing = data.draw(st.integers(0, 5), label="rows past the last group")
    k_align = math.lcm(_scale_block(variant["a_format"]), _scale_block(variant["b_format"]))
    k = k_align * data.draw(st.integers(1, limits["max_k"] // k_align), label="K / alignment")
    n_out = data.draw(
        st.integers(1, limits["max_n"] // 2 if variant["epilogue"] == "swiglu" else limits["max_n"]), label="N out"
    )
    n = 2 * n_out if variant["epilogue"] == "swiglu" else n_out
    seed = data.draw(SEEDS, label="seed")

    generator = _generator(seed)
    rows_in_groups = sum(sizes)
    num_tokens = rows_in_groups + trailing
    a_offsets = random_group_offsets(sizes, device=DEVICE).to(variant["offsets_dtype"])
    expert_ids = torch.tensor(ids, dtype=torch.int32, device=DEVICE)
    x = _randn(generator, num_tokens, k)
    w = _randn(generator, num_experts, n, k) / math.sqrt(k)
    expert_scales = None
    if variant["expert_scales"]:
        expert_scales = (torch.rand(num_experts, generator=generator) * 4 - 2).to(DEVICE)
    a = _make_operand(x, variant["a_format"])
    b = _make_operand(w, variant["b_format"])
    if variant["a_layout"] != "row":
        a = a.to_layout("128x4", group_offsets=a_offsets if variant["a_layout"] == "128x4_grouped" else None)
    if variant["b_layout"] != "row":
        b = b.to_layout("128x4")

    for key in ("epilogue", "config", "a_layout", "b_layout", "expert_scales", "out_dtype"):
        event(f"{key}={variant[key]}")
    event(f"groups={'0' if not sizes else '1' if len(sizes) == 1 else 'many'}")
    for size in sizes:
        event(f"group size {'special ' + str(size) if size in SPECIAL_GROUP_SIZES else 'random'}")
    if -1 in ids:
        event("an expert id -1")
    if len(set(i for i in ids if i >= 0)) < len([i for i in ids if i >= 0]):
        event("a repeated expert id")

    out_dtype = variant["out_dtype"]
    out = poison(torch.empty(num_tokens, n_out, dtype=out_dtype, device=DEVICE))
    result = lk.grouped_matmul(
        a,
        b,
        a_offsets,
        expert_ids,
        expert_scales,
        epilogue=variant["epilogue"],
        out_dtype=out_dtype,
        out=out,
        config=GM_CONFIGS[variant["config"]],
    )
    assert result is out
    expected = lk.grouped_matmul_reference(a, b, a_offsets, expert_ids, expert_scales, epilogue=variant["epilogue"])
    assert out[rows_in_groups:].isnan().all(), "rows past the last group were written"
    _assert_groups_close(out.float(), expected, sizes, ids, GM_TOLERANCE[out_dtype])


def _assert_groups_close(actual, expected, sizes, ids, tolerance):
    """Relative error over all rows in groups, and per group against the larger of its own norm and
    its share of the overall norm (a near-zero group is not held to a relative bound of its own)."""
    rows = sum(sizes)
    if rows == 0 or actual.shape[1] == 0:
        return
    error = relative_error(actual[:rows], expected[:rows])
    assert error <= tolerance, f"relative error {error:.3e} > {tolerance:.1e} over all groups"
    total_norm = expected[:rows].double().norm().item()
    start = 0
    for group, size in enumerate(sizes):
        end = start + size
        if size:
            got, want = actual[start:end].double(), expected[start:end].double()
            if ids[group] == -1:
                assert (got == 0).all(), f"group {group} (expert -1) is not zeros"
            else:
                share = total_norm * math.sqrt(size / rows)
                denominator = max(want.norm().item(), share)
                group_error = (got - want).norm().item() / denominator if denominator else (got - want).norm().item()
                assert group_error <= tolerance, (
                    f"group {group} (rows {start}:{end}, expert {ids[group]}): relative error {group_error:.3e}"
                )
        start = end


# ==================================================================================================
# attention
# ==================================================================================================

ATTN_DTYPES = (torch.float16, torch.bfloat16)
# (Hq, Hkv): MHA, GQA with groups 2, 3, 4, MQA
HEAD_PAIRS = ((1, 1), (2, 2), (4, 4), (2, 1), (4, 2), (6, 2), (8, 2), (4, 1), (8, 1))
HEAD_DIMS = (48, 64, 128, 256) if GPU else (16, 32, 48)
PAGE_SIZES = (16, 64, 256) if GPU else (16, 32)
ATTN_LAYOUTS = ("dense", "ragged", "paged", "paged_ragged_q")
MASK_KINDS = ("none", "causal", "window", "window_causal", "chunked", "chunked_causal", "chunk_and_window")
SCORE_MODS = (None, "softcap", "alibi")
ATTN_TOLERANCE = {torch.float16: 4e-3, torch.bfloat16: 2e-2, "lse": 1e-4}  # as tests/test_attention.py
ATTN_LIMITS = (
    dict(max_batch=4, max_seqlen_q=300, max_seqlen_k=1200, max_window=400)
    if GPU
    else dict(max_batch=3, max_seqlen_q=16, max_seqlen_k=70, max_window=24)
)
# Lengths at tile edges: q tiles of 16 (CPU decode and prefill tiles), multiples of the KV tiles (16 on
# the CPU, 32 to 128 on the GPU).
_KV_TILE_EDGES = (16, 32, 64, 128, 256) if GPU else (16, 32, 64)
SPECIAL_SEQLENS_Q = [1, 2, 3, 15, 16, 17, 0]
SPECIAL_SEQLENS_K = [1, *sorted({t + d for t in _KV_TILE_EDGES for d in (-1, 0, 1)}), 0]


def _attn_variant(choose, layout, dtype) -> dict:
    """The choices besides layout and dtype that are constexpr in the kernels (or pick their path)."""
    return dict(
        dtype=dtype,
        head_dim=choose("head_dim", HEAD_DIMS),
        layout=layout,
        page_size=choose("page_size", PAGE_SIZES) if layout.startswith("paged") else None,
        mask=choose("mask", MASK_KINDS),
        score_mod=choose("score_mod", SCORE_MODS),
        sinks=choose("sinks", (False, True)),
        return_lse=choose("return_lse", (False, True)),
        heads=choose("heads", HEAD_PAIRS),
    )


ATTN_CASES = [(layout, dtype) for layout in ATTN_LAYOUTS for dtype in ATTN_DTYPES]
ATTN_POOLS = {
    case: _variant_pool(lambda choose, case=case: _attn_variant(choose, *case), {"head_dim": HEAD_DIMS}, repeats=3)
    for case in ATTN_CASES
}


def _cu_seqlens(lengths):
    return random_group_offsets(lengths, device=DEVICE)


def _paged_cache(
    generator, seqlens, page_size, num_kv_heads, head_dim, dtype, shared_pages, extra_pages, extra_columns
):
    """``(cache, sharing)``: a PagedKVCache whose pages are shuffled; the first ``shared_pages`` pages of
    every sequence (at most the shortest one's) are the same physical pages, a shared prefix, used by
    ``sharing`` sequences; unused block-table entries hold an out-of-range index."""
    pages_per_seq = [-(-n // page_size) for n in seqlens]
    shared = min([shared_pages] + [p for p in pages_per_seq if p > 0]) if any(pages_per_seq) else 0
    own_pages = [max(0, p - shared) for p in pages_per_seq]
    num_pages = shared + sum(own_pages) + extra_pages
    permutation = torch.randperm(max(num_pages, 1), generator=generator).tolist()
    shared_ids, cursor = permutation[:shared], shared
    max_pages = max(pages_per_seq + [1]) + extra_columns
    block_table = torch.full((len(seqlens), max_pages), 10**6, dtype=torch.int32)
    for b, count in enumerate(pages_per_seq):
        ids = shared_ids[: min(shared, count)] + permutation[cursor : cursor + own_pages[b]]
        cursor += own_pages[b]
        if ids:
            block_table[b, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
    shape = (max(num_pages, 1), page_size, num_kv_heads, head_dim)
    k_pages = _randn(generator, *shape, dtype=dtype)
    v_pages = _randn(generator, *shape, dtype=dtype)
    cache = lk.PagedKVCache(
        k_pages, v_pages, block_table.to(DEVICE), torch.tensor(seqlens, dtype=torch.int32, device=DEVICE)
    )
    return cache, sum(1 for count in pages_per_seq if count and shared)  # sequences on the shared pages


def _poisoned_empty(shape, dtype, device):
    return poison(torch.empty(shape, dtype=dtype, device=device))


def _mask_arguments(data, kind: str):
    max_window = ATTN_LIMITS["max_window"]
    side = st.one_of(st.just(-1), st.integers(0, max_window))
    kwargs = dict(causal=kind in ("causal", "window_causal", "chunked_causal"))
    if kind in ("window", "window_causal"):
        kwargs["mask"] = lk.SlidingWindow(data.draw(side, label="window left"), data.draw(side, label="window right"))
    elif kind in ("chunked", "chunked_causal"):
        kwargs["mask"] = lk.Chunked(data.draw(st.integers(1, max_window + 4), label="chunk size"))
    elif kind == "chunk_and_window":
        kwargs["mask"] = (
            lk.Chunked(data.draw(st.integers(1, max_window + 4), label="chunk size")),
            lk.SlidingWindow(data.draw(side, label="window left"), data.draw(side, label="window right")),
        )
    return kwargs


@pytest.mark.parametrize("layout, dtype", ATTN_CASES, ids=lambda v: str(v).replace("torch.", ""))
@budget("attention", len(ATTN_CASES))
@given(data=st.data())
def test_attention_matches_reference(layout, dtype, data):
    """attention (dense, ragged, paged with shuffled and shared pages) equals attention_reference for
    every mask, score modifier, sinks, GQA ratio, num_splits and return_lse; every buffer the API
    allocates starts as NaN."""
    variant = _draw_variant(data, lambda choose: _attn_variant(choose, layout, dtype), ATTN_POOLS[(layout, dtype)])
    note(f"variant: {variant}")
    limits = ATTN_LIMITS
    head_dim = variant["head_dim"]
    num_q_heads, num_kv_heads = variant["heads"]
    batch = data.draw(st.integers(1, limits["max_batch"]), label="batch")
    seqlen_q = st.one_of(st.sampled_from(SPECIAL_SEQLENS_Q), st.integers(1, limits["max_seqlen_q"]))
    seqlen_k = st.one_of(st.sampled_from(SPECIAL_SEQLENS_K), st.integers(1, limits["max_seqlen_k"]))
    ragged_q = layout in ("ragged", "paged_ragged_q")
    if ragged_q:
        lengths_q = data.draw(st.lists(seqlen_q, min_size=batch, max_size=batch), label="q lengths")
    else:
        lengths_q = [data.draw(seqlen_q, label="Sq")] * batch
    if layout == "dense":
        lengths_k = [data.draw(seqlen_k, label="Skv")] * batch
    else:
        lengths_k = data.draw(st.lists(seqlen_k, min_size=batch, max_size=batch), label="k lengths")
    kwargs = _mask_arguments(data, variant["mask"])
    seed = data.draw(SEEDS, label="seed")
    generator = _generator(seed)
    if variant["score_mod"] == "softcap":
        kwargs["score_mod"] = lk.softcap(data.draw(st.floats(0.5, 50.0), label="softcap"))
    elif variant["score_mod"] == "alibi":
        kwargs["score_mod"] = lk.alibi(torch.rand(num_q_heads, generator=generator).to(DEVICE))
    if variant["sinks"]:
        kwargs["sinks"] = (torch.randn(num_q_heads, generator=generator) * 2).to(DEVICE)
    kwargs["softmax_scale"] = data.draw(st.one_of(st.none(), st.floats(0.05, 2.0)), label="softmax_scale")

    if ragged_q:
        q = _randn(generator, sum(lengths_q), num_q_heads, head_dim, dtype=dtype)
        kwargs["cu_seqlens_q"] = _cu_seqlens(lengths_q)
        kwargs["max_seqlen_q"] = data.draw(
            st.sampled_from([None, max(lengths_q), max(lengths_q) + 3]), label="max_seqlen_q"
        )
    else:
        q = _randn(generator, batch, lengths_q[0], num_q_heads, head_dim, dtype=dtype)
    if layout.startswith("paged"):
        page_size = variant["page_size"]
        cache, sharing = _paged_cache(
            generator,
            lengths_k,
            page_size,
            num_kv_heads,
            head_dim,
            dtype,
            shared_pages=data.draw(st.integers(0, 3), label="shared prefix pages"),
            extra_pages=data.draw(st.integers(0, 3), label="unused pages"),
            extra_columns=data.draw(st.integers(0, 2), label="extra block-table columns"),
        )
        if sharing > 1:
            event("sequences sharing prefix pages")
        k = v = None
        kwargs["kv_cache"] = cache
        kwargs["max_seqlen_k"] = data.draw(st.sampled_from([None, max(lengths_k)]), label="max_seqlen_k")
    elif layout == "ragged":
        k = _randn(generator, sum(lengths_k), num_kv_heads, head_dim, dtype=dtype)
        v = _randn(generator, sum(lengths_k), num_kv_heads, head_dim, dtype=dtype)
        kwargs["cu_seqlens_k"] = _cu_seqlens(lengths_k)
        kwargs["max_seqlen_k"] = data.draw(
            st.sampled_from([None, max(lengths_k), max(lengths_k) + 5]), label="max_seqlen_k"
        )
    else:
        k = _randn(generator, batch, lengths_k[0], num_kv_heads, head_dim, dtype=dtype)
        v = _randn(generator, batch, lengths_k[0], num_kv_heads, head_dim, dtype=dtype)
    decode_block_n = attention_default_config(head_dim, dtype, DEVICE, decode=True).BN
    kv_tiles = -(-max(lengths_k) // decode_block_n)  # KV tiles of the longest sequence on the split path
    kwargs["num_splits"] = data.draw(st.one_of(st.none(), st.integers(1, kv_tiles + 3)), label="num_splits")
    return_lse = variant["return_lse"]
    for key in ("mask", "score_mod", "sinks", "head_dim", "heads", "return_lse"):
        event(f"{key}={variant[key]}")
    event(f"num_splits={'None' if kwargs['num_splits'] is None else '1' if kwargs['num_splits'] == 1 else '>1'}")
    if kwargs["num_splits"] is not None and kwargs["num_splits"] > kv_tiles:
        event("num_splits > KV tiles")
    if any(lq > lk_ for lq, lk_ in zip(lengths_q, lengths_k)):
        event("Sq > Skv")
    if 0 in lengths_q or 0 in lengths_k:
        event("an empty sequence")
    if max(lengths_q) == 1:
        event("Sq = 1 (decode)")

    with mock.patch.object(attention_api, "_empty", _poisoned_empty):
        result = lk.attention(q, k, v, return_lse=return_lse, **kwargs)
    ref_out, ref_lse = lk.attention_reference(q, k, v, return_lse=True, **kwargs)
    out, lse = result if return_lse else (result, None)
    assert out.dtype == q.dtype and out.shape == q.shape
    error = relative_error(out, ref_out)
    assert error <= ATTN_TOLERANCE[dtype], f"out: relative error {error:.3e} > {ATTN_TOLERANCE[dtype]:.1e}"
    # rows that see no key and no sink: exactly 0 (ref_lse is [B, Hq, Sq] or ragged [Hq, total_q])
    no_key = torch.isinf(ref_lse).transpose(-1, -2)
    assert (out[no_key] == 0).all(), "a row that sees no key is not 0"
    if return_lse:
        assert lse.dtype == torch.float32 and lse.shape == ref_lse.shape
        assert not torch.isnan(lse).any(), "NaN in lse"
        empty = torch.isinf(ref_lse)
        assert torch.equal(torch.isinf(lse), empty), "-inf LSE rows differ from the reference"
        assert (lse[empty] < 0).all()
        if (~empty).any():
            # relative to the LSE's norm, with a floor of 1 per element (LSEs near 0 are not held to a
            # relative bound of their own)
            finite, expected = lse[~empty].double(), ref_lse[~empty].double()
            denominator = max(expected.norm().item(), math.sqrt(expected.numel()))
            lse_error = (finite - expected).norm().item() / denominator
            assert lse_error <= ATTN_TOLERANCE["lse"], f"lse: relative error {lse_error:.3e}"
