"""Interpreter tests of the w4a8 grouped matmul prototype (lab/w4a8/kernel.py).

    python3 -m pytest -n 0 -p no:cacheprovider -c /dev/null lab/w4a8/test_proto.py -q

Operands come from the library's public ``llmkernels.quantize`` (fp8 block (1, 128) activations, mxfp4 weights);
the reference is a float64 product of ``llmkernels.dequantize`` of both. The kernel's only roundings are fp32 sums
(exact e4m3 products, exact power-of-two decode shifts and promotion factors), so a float32 output agrees to 1e-6
relative (Frobenius, and max element over max |ref|); bf16 output within one bf16 ulp of the exact value per
element (the interpreter truncates, so the Frobenius error is ~3.5e-3, not the ~1.5e-3 of rounding to nearest).
"""

from __future__ import annotations

import os
import sys

os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import pytest
import torch
from kernel import COMPUTE_CONFIG, W4A8Config, decode_e2m1, w4a8_grouped_matmul

import llmkernels

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
SMALL = W4A8Config(16, 32, 4, 1)
SWAP = W4A8Config(16, 32, 4, 1, swap_ab=True)
CONFIGS = {
    "tile": SMALL,
    "swap_ab": SWAP,
    "tileref": W4A8Config(16, 32, 4, 1, tile_reference=True),
    "swap_tileref": W4A8Config(16, 32, 4, 1, swap_ab=True, tile_reference=True),
}


def make_problem(group_rows, expert_ids, n, k, spread, seed):
    """Activations of all groups (ragged) plus 5 rows outside any group, MXFP4 weights of 3 experts whose
    32-wide blocks' exponents within each 128 block differ by ``spread`` (0: one shared scale)."""
    generator = torch.Generator().manual_seed(seed)
    tokens = sum(group_rows) + 5
    x = torch.randn(tokens, k, generator=generator)
    blocks = torch.randint(-4, 5, (tokens, -(-k // 128)), generator=generator).float()
    x = x * torch.exp2(blocks).repeat_interleave(128, 1)[:, :k]
    w = torch.randn(3, n, k, generator=generator) * k**-0.5
    shifts = torch.randint(0, spread + 1, (3, n, -(-k // 128) * 4), generator=generator).float()
    shifts[..., ::4] = 0  # at least one sub-block per 128 at the base: the spread is reached
    shifts[..., 1::4] = spread
    w = w * torch.exp2(-shifts[..., : k // 32]).repeat_interleave(32, -1)
    offsets = torch.tensor([0] + list(torch.tensor(group_rows).cumsum(0)), dtype=torch.int32)
    return (
        llmkernels.quantize(x, "fp8", block=(1, 128)),
        llmkernels.quantize(w, "mxfp4"),
        offsets,
        torch.tensor(expert_ids, dtype=torch.int32),
    )


def reference(a_q, w_q, offsets, expert_ids):
    """float64 ``[T, N]``; rows outside every group NaN, groups of an invalid expert zeros."""
    a = llmkernels.dequantize(a_q).double()
    w = llmkernels.dequantize(w_q).double()
    ref = torch.full((a.shape[0], w.shape[1]), float("nan"), dtype=torch.float64)
    for g, e in enumerate(expert_ids.tolist()):
        rows = slice(int(offsets[g]), int(offsets[g + 1]))
        ref[rows] = a[rows] @ w[e].T if 0 <= e < w.shape[0] else 0.0
    return ref


def check(out, ref, out_dtype):
    grouped = ~torch.isnan(ref[:, 0])
    assert torch.isnan(out[~grouped].float()).all(), "a row outside every group was written"
    got, want = out[grouped].double(), ref[grouped]
    assert not torch.isnan(got).any(), "an output element of a group was not written"
    diff = got - want
    fro = (diff.norm() / want.norm()).item()
    worst = (diff.abs().max() / want.abs().max()).item()
    if out_dtype == torch.float32:
        assert fro <= 1e-6 and worst <= 1e-6, f"rel. error {fro:.3g} / {worst:.3g}"
    else:  # within one bf16 ulp of the exact value, element by element (rounding to nearest or truncating)
        ulp = torch.exp2(torch.floor(torch.log2(want.abs().clamp_min(1e-300))) - 7)
        assert (diff.abs() <= ulp + 1e-6 * want.abs().max()).all(), f"rel. error {fro:.3g} / {worst:.3g}"
        assert fro <= 5e-3, f"rel. error {fro:.3g} (Frobenius)"


RAGGED = ([0, 1, 37, 20, 6], [1, 2, 0, -1, 2])


K_CONFIGS = {128: ("tile", "swap_tileref"), 256: ("tileref",), 384: ("tile", "swap_ab")}


@pytest.mark.parametrize(
    "k,spread,config", [(k, s, c) for k, names in K_CONFIGS.items() for s in (0, 3, 11) for c in names]
)
def test_ragged_float32_exact(k, spread, config):
    """Spreads 0 and 3 take the branch-free loop, 11 (> 8) the checking loop and its four-dot branch: both exact,
    with a reference exponent per weight row or per tile (tileref)."""
    a_q, w_q, offsets, ids = make_problem(*RAGGED, n=48, k=k, spread=spread, seed=k + spread)
    ref = reference(a_q, w_q, offsets, ids)
    out = torch.full(ref.shape, float("nan"), dtype=torch.float32)
    w4a8_grouped_matmul(a_q, w_q, offsets, ids, out=out, out_dtype=torch.float32, config=CONFIGS[config])
    check(out, ref, torch.float32)


@pytest.mark.parametrize("k,spread", [(256, 2), (256, 9), (160, 1), (352, 10)])
def test_bf16(k, spread):
    """bf16 output; K 160 and 352 end in a partial 128-K block (32 and 96 of its columns): per-row references
    (spread <= 2) and per-tile references (spread >= 9)."""
    a_q, w_q, offsets, ids = make_problem(*RAGGED, n=40, k=k, spread=spread, seed=5)
    ref = reference(a_q, w_q, offsets, ids)
    out = torch.full(ref.shape, float("nan"), dtype=torch.bfloat16)
    w4a8_grouped_matmul(a_q, w_q, offsets, ids, out=out, config=SMALL if spread <= 2 else CONFIGS["tileref"])
    check(out, ref, torch.bfloat16)


@pytest.mark.parametrize("config", ["tile", "tileref"])
def test_mixed_branches_and_strided_views(config):
    """Weight rows 0-31 have one K block spread by 9 (their tiles take the checking loop, its two branches), rows
    32-63 spread by 2 (the branch-free loop), in one launch; the weights are a non-contiguous view (every other
    expert of a larger tensor) and the output a column-offset view."""
    a_q, w_q, offsets, ids = make_problem([20, 13], [0, 1], n=64, k=256, spread=2, seed=11)
    exps = w_q.scales.view(torch.uint8).clone()
    exps[:, :32, 4:8] = (exps[:, :32, 4:8].int() - torch.tensor([0, 9, 3, 1])).clamp_min(1).to(torch.uint8)
    data = torch.stack([w_q.data, torch.zeros_like(w_q.data)], 1).flatten(0, 1)[::2]
    scales = torch.stack([exps, torch.zeros_like(exps)], 1).flatten(0, 1)[::2].view(torch.float8_e8m0fnu)
    w_view = llmkernels.ScaledTensor(data, scales, "mxfp4")
    ref = reference(a_q, w_view, offsets, ids)
    wide = torch.full((ref.shape[0], ref.shape[1] + 8), float("nan"), dtype=torch.float32)
    out = wide[:, 8:]
    w4a8_grouped_matmul(a_q, w_view, offsets, ids, out=out, out_dtype=torch.float32, config=CONFIGS[config])
    check(out, ref, torch.float32)
    assert torch.isnan(wide[:, :8]).all()


def test_decode_bit_exact_all_codes_and_shifts():
    """e2m1 code c (all 16, both zeros) at shift d in 0..8: the e4m3 bits of ``value(c) · 2^-d``."""
    codes = torch.arange(16).repeat(4).repeat(16, 1)  # [16, 64]
    shifts = torch.tensor([[d, (d + 5) % 9] for d in range(9)] + [[d % 9, 8 - d % 9] for d in range(7)])
    values = torch.tensor(E2M1 + [-v for v in E2M1], dtype=torch.float64)[codes]
    want = (values * torch.exp2(-shifts.repeat_interleave(32, 1).double())).to(torch.float8_e4m3fn)
    got = decode_e2m1(codes, shifts)
    assert torch.equal(got, want.view(torch.uint8))
    assert (shifts == 8).any() and (shifts == 0).any()


def test_compute_config_and_errors():
    """The default compute tile on a small problem, then the argument checks (raised before any launch)."""
    a_q, w_q, offsets, ids = make_problem([3, 130], [2, 0], n=128, k=128, spread=1, seed=3)
    ref = reference(a_q, w_q, offsets, ids)
    out = torch.full(ref.shape, float("nan"), dtype=torch.float32)
    w4a8_grouped_matmul(a_q, w_q, offsets, ids, out=out, out_dtype=torch.float32, config=COMPUTE_CONFIG)
    check(out, ref, torch.float32)
    with pytest.raises(TypeError, match="a_fp8"):
        w4a8_grouped_matmul(w_q, w_q, offsets, ids)
    with pytest.raises(TypeError, match="w must"):
        w4a8_grouped_matmul(a_q, a_q, offsets, ids)
    with pytest.raises(ValueError, match="expert_ids"):
        w4a8_grouped_matmul(a_q, w_q, offsets, ids[:1])
    with pytest.raises(ValueError, match="out must"):
        w4a8_grouped_matmul(a_q, w_q, offsets, ids, out=out[:, :8])
