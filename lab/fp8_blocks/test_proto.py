"""Interpreter tests of the FP8-block prototype (quantize references and the grouped matmul kernel).

    python3 -m pytest -n 0 -p no:cacheprovider -c /dev/null lab/fp8_blocks/test_proto.py -q

(``-c /dev/null`` keeps the repository's pytest configuration out; the tests set TRITON_INTERPRET=1 themselves.)

Tolerances (relative errors against the float64 product of the decoded operands, :func:`relative_errors`):

| output | Frobenius ‖out − ref‖/‖ref‖ | max |out − ref| / max |ref| | what bounds it |
| --- | --- | --- | --- |
| float32 | 1e-5 | 1e-5 | fp32 products and sums (the interpreter's dot is exact-product fp32) |
| bf16 | 5e-3 | 1e-2 | bf16 output: 8 significant bits. Also checked per element: within one bf16 ulp of the reference |

Measured here: 5e-8 (float32 output), 3.4e-3 Frobenius / 5e-3 max (bf16). Triton 3.9's interpreter converts
fp32 to bf16 by *truncation* (also with ``fp_downcast_rounding="rtne"``; checked: it equals ``bits >> 16``), a
uniform error of up to one ulp: ~3.1e-3 Frobenius. The GPU rounds to nearest (``cvt.rn.bf16.f32``), half that:
~1.5e-3, which bench_gpu.py checks (<= 3e-3) together with the fp8 wgmma's reduced-precision accumulation of each
128-long partial sum before its promotion.
"""
from __future__ import annotations

import os
import sys

os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import pytest
import torch
from kernel import Fp8BlockConfig, default_config, fp8_block_grouped_matmul
from quantize import (
    E4M3_MAX,
    dequantize_fp8_blocks,
    expand_scales,
    quantize_fp8_blocks,
    reference_grouped_matmul,
    relative_errors,
)

TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (5e-3, 1e-2)}

CONFIGS = {
    "plain 64x64": Fp8BlockConfig(64, 64, 4, 2),
    "plain 32x128 split2": Fp8BlockConfig(32, 128, 4, 2, split_n=2),
    "plain 16x256 split2 persistent": Fp8BlockConfig(16, 256, 4, 2, split_n=2, programs_per_sm=1),
    "swapAB 16x64": Fp8BlockConfig(16, 64, 4, 2, swap_ab=True),
    "swapAB 16x128 split2 persistent": Fp8BlockConfig(16, 128, 4, 2, swap_ab=True, split_n=2, programs_per_sm=2),
}


def make_problem(num_tokens, num_experts, n, k, group_rows, expert_ids, seed=0, power_of_two=False):
    """Random operands quantized as checkpoints store them, and the group metadata."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, k, generator=generator)
    x[:, ::7] *= 30.0  # outlier columns: scales that differ across K blocks and tokens
    w = torch.randn(num_experts, n, k, generator=generator) * k**-0.5
    w[:, : min(n, 128) // 2] *= 10.0  # weight scale blocks that differ
    a, a_scales = quantize_fp8_blocks(x, (1, 128), power_of_two)
    b, b_scales = quantize_fp8_blocks(w, (128, 128), power_of_two)
    offsets = torch.tensor([0] + list(torch.tensor(group_rows).cumsum(0)), dtype=torch.int32)
    assert offsets[-1] <= num_tokens
    return a, a_scales, b, b_scales, offsets, torch.tensor(expert_ids, dtype=torch.int32)


def within_one_bf16_ulp(out, reference):
    """Per element: |out − ref| <= one bf16 ulp of ref (2^(floor(log2|ref|) − 7)) plus 1e-5 · max|ref| for the
    fp32 accumulation (cancellation near zero)."""
    ref = reference.double()
    ulp = torch.exp2(torch.floor(torch.log2(ref.abs().clamp_min(1e-300))) - 7)
    return ((out.double() - ref).abs() <= ulp + 1e-5 * ref.abs().max()).all()


def check(out, reference, poison_rows, dtype):
    """Written rows within the tolerance, rows past a_offsets[G] still the poison (NaN) they were."""
    fro, worst = relative_errors(out, reference)
    fro_tol, worst_tol = TOLERANCE[dtype]
    assert fro <= fro_tol and worst <= worst_tol, f"relative error {fro:.3g} (Frobenius), {worst:.3g} (max)"
    if dtype == torch.bfloat16:
        assert within_one_bf16_ulp(out[:poison_rows], reference[:poison_rows])
    assert torch.isnan(out[poison_rows:].float()).all(), "a row past a_offsets[G] was written"
    return fro, worst


# ------------------------------------------------------------------------------------------------ quantize


@pytest.mark.parametrize("block, shape", [((1, 128), (5, 300)), ((128, 128), (2, 200, 260)), ((128, 128), (130, 128))])
@pytest.mark.parametrize("power_of_two", [False, True])
def test_quantize_follows_the_format(block, shape, power_of_two):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1)) * 3.0
    x[..., :1, :128] = 0.0  # an all-zero tile (the first)
    data, scales = quantize_fp8_blocks(x, block, power_of_two)
    rows, cols = block
    assert data.dtype == torch.float8_e4m3fn and data.shape == x.shape
    assert scales.dtype == torch.float32
    assert scales.shape == (*shape[:-2], -(-shape[-2] // rows), -(-shape[-1] // cols))
    # amax per tile, computed independently of the quantizer's padding
    amax = torch.zeros_like(scales)
    for index in torch.cartesian_prod(*[torch.arange(s) for s in scales.shape]).reshape(-1, scales.dim()):
        *batch, r, c = index.tolist()
        amax[(*batch, r, c)] = x[(*batch,)][r * rows:(r + 1) * rows, c * cols:(c + 1) * cols].abs().max()
    nonzero = amax > 0
    if power_of_two:
        exponent = torch.log2(scales[nonzero])
        assert torch.equal(exponent, exponent.round()), "scales are powers of two"
        assert (scales[nonzero] >= amax[nonzero] / E4M3_MAX).all()
        assert (scales[nonzero] < 2 * amax[nonzero] / E4M3_MAX).all()
    else:
        assert torch.equal(scales[nonzero], amax[nonzero] / E4M3_MAX)
    assert (scales[~nonzero] == 1.0).all()
    # each element is torch's cast of x / scale
    expanded = expand_scales(scales, block, x.shape)
    assert torch.equal(data.view(torch.uint8), (x / expanded).to(torch.float8_e4m3fn).view(torch.uint8))
    decoded = dequantize_fp8_blocks(data, scales, block)
    assert torch.equal(decoded[..., :1, :128], torch.zeros_like(decoded[..., :1, :128]))  # the zero tile
    # e4m3: 3 mantissa bits (half an ulp: 2^-4 relative), subnormal step 2^-9 (half: 2^-10) times the scale
    bound = torch.maximum(x.double().abs() * 2.0**-4, expanded.double() * 2.0**-10)
    assert ((decoded - x.double()).abs() <= bound * (1 + 1e-6)).all()


def test_dequantize_rejects_wrong_scale_shapes():
    data, scales = quantize_fp8_blocks(torch.randn(4, 256, 256), (128, 128))
    with pytest.raises(ValueError):
        dequantize_fp8_blocks(data, scales[:, :1], (128, 128))


# ------------------------------------------------------------------------------------------------ the kernel

# (tokens, experts, N, K, rows per group, expert id per group): empty groups, -1 ids, rows past a_offsets[G],
# K not a multiple of 128 (320) nor of 16 (200), partial N tiles (192, 100).
SHAPES = {
    "K320 N192": (60, 3, 192, 320, [10, 0, 27, 8], [2, 0, -1, 1]),
    "K200 N100": (45, 2, 100, 200, [0, 17, 1, 20], [1, 1, 0, -1]),
    "K256 N128 one group": (40, 1, 128, 256, [33], [0]),
    "decode K384 N128 1-3 rows": (14, 8, 128, 384, [1, 2, 0, 1, 3, 1, 1, 2], [3, 0, 1, 7, 2, -1, 5, 4]),
}


@pytest.mark.parametrize("config", list(CONFIGS.values()), ids=list(CONFIGS))
@pytest.mark.parametrize("shape", list(SHAPES.values()), ids=list(SHAPES))
def test_grouped_matmul_fp32_output(config, shape):
    num_tokens, num_experts, n, k, group_rows, ids = shape
    a, a_scales, b, b_scales, offsets, expert_ids = make_problem(num_tokens, num_experts, n, k, group_rows, ids)
    out = torch.full((num_tokens, n), float("nan"))
    fp8_block_grouped_matmul(a, a_scales, b, b_scales, offsets, expert_ids, out=out, config=config)
    reference = reference_grouped_matmul(a, a_scales, b, b_scales, offsets, expert_ids)
    check(out, reference, int(offsets[-1]), torch.float32)
    for group, expert in enumerate(ids):  # -1 groups are zeros, exactly
        if expert < 0:
            assert (out[offsets[group]:offsets[group + 1]] == 0).all()


@pytest.mark.parametrize("config", [None, CONFIGS["swapAB 16x64"]], ids=["default", "swapAB"])
def test_grouped_matmul_bf16_output_with_expert_scales(config):
    num_tokens, num_experts, n, k, group_rows, ids = SHAPES["K320 N192"]
    a, a_scales, b, b_scales, offsets, expert_ids = make_problem(num_tokens, num_experts, n, k, group_rows, ids,
                                                                 seed=3)
    expert_scales = torch.tensor([0.5, 2.0, 1.25])
    out = torch.full((num_tokens, n), float("nan"), dtype=torch.bfloat16)
    result = fp8_block_grouped_matmul(a, a_scales, b, b_scales, offsets, expert_ids, expert_scales, out=out,
                                      config=config)
    assert result is out
    reference = reference_grouped_matmul(a, a_scales, b, b_scales, offsets, expert_ids, expert_scales)
    fro, worst = check(out, reference, int(offsets[-1]), torch.bfloat16)
    print(f"bf16 output: relative error {fro:.2e} Frobenius, {worst:.2e} max")


def test_power_of_two_scales_and_token_major_activation_scales():
    """ue8m0-style scales, and A's scales as a ``[K/128, T]`` buffer seen transposed (DeepGEMM's and cuBLAS's
    token-major layout): same result as the row-major copy."""
    num_tokens, num_experts, n, k, group_rows, ids = SHAPES["K320 N192"]
    a, a_scales, b, b_scales, offsets, expert_ids = make_problem(num_tokens, num_experts, n, k, group_rows, ids,
                                                                 seed=5, power_of_two=True)
    token_major = a_scales.t().contiguous().t()
    assert token_major.stride() == (1, num_tokens)
    out = torch.full((num_tokens, n), float("nan"))
    fp8_block_grouped_matmul(a, token_major, b, b_scales, offsets, expert_ids, out=out, config=CONFIGS["plain 64x64"])
    reference = reference_grouped_matmul(a, a_scales, b, b_scales, offsets, expert_ids)
    check(out, reference, int(offsets[-1]), torch.float32)


def test_hostile_metadata_stays_inside_out():
    """Offsets past T and decreasing offsets are clamped (each row in at most one group, nothing written
    outside ``out``); an expert id >= E writes zeros like -1."""
    num_tokens, num_experts, n, k = 20, 2, 64, 128
    a, a_scales, b, b_scales, _, _ = make_problem(num_tokens, num_experts, n, k, [20], [0])
    offsets = torch.tensor([0, 8, 5, 30], dtype=torch.int32)  # group 1 empty after clamping, group 2 rows 8..20
    expert_ids = torch.tensor([1, 0, 7], dtype=torch.int32)
    out = torch.full((num_tokens, n), float("nan"))
    fp8_block_grouped_matmul(a, a_scales, b, b_scales, offsets, expert_ids, out=out, config=CONFIGS["plain 64x64"])
    clamped = torch.tensor([0, 8, 8, 20], dtype=torch.int32)
    reference = reference_grouped_matmul(a, a_scales, b, b_scales, clamped, torch.tensor([1, 0, -1]))
    check(out, reference, num_tokens, torch.float32)
    assert (out[8:] == 0).all()


def test_default_config_and_fresh_output():
    num_tokens, num_experts, n, k, group_rows, ids = SHAPES["K256 N128 one group"]
    a, a_scales, b, b_scales, offsets, expert_ids = make_problem(num_tokens, num_experts, n, k, group_rows, ids)
    assert default_config(num_tokens, 1).swap_ab is False and default_config(16, 8).swap_ab is True
    out = fp8_block_grouped_matmul(a, a_scales, b, b_scales, offsets, expert_ids)
    assert out.dtype == torch.bfloat16 and out.shape == (num_tokens, n)
    reference = reference_grouped_matmul(a, a_scales, b, b_scales, offsets, expert_ids)
    rows = int(offsets[-1])
    fro, worst = relative_errors(out[:rows], reference[:rows])
    assert fro <= TOLERANCE[torch.bfloat16][0] and worst <= TOLERANCE[torch.bfloat16][1]
    assert within_one_bf16_ulp(out[:rows], reference[:rows])


def test_rejects_wrong_arguments():
    a, a_scales, b, b_scales, offsets, expert_ids = make_problem(8, 1, 128, 256, [8], [0])
    with pytest.raises(ValueError):
        fp8_block_grouped_matmul(a, a_scales[:, :1], b, b_scales, offsets, expert_ids)
    with pytest.raises(ValueError):
        fp8_block_grouped_matmul(a.float(), a_scales, b, b_scales, offsets, expert_ids)
    with pytest.raises(ValueError):
        fp8_block_grouped_matmul(a, a_scales, b, b_scales, offsets.long(), expert_ids)
    with pytest.raises(ValueError):
        Fp8BlockConfig(64, 256, 4, 2)  # a 256-row weight tile must be split in two 128-row sub-tiles
