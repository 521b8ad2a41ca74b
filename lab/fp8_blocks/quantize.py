"""Torch references for DeepSeek-style FP8 block scaling (prototype for issue 44; not part of the library).

Two block shapes share one quantizer:

* activations, ``block=(1, 128)``: one float32 scale per token per 128 columns;
* weights, ``block=(128, 128)``: one float32 scale per 128 x 128 tile of each expert's ``[N, K]`` matrix.

Each scale is ``amax(|tile|) / 448`` (448 = the largest e4m3 value), optionally rounded *up* to a power of two
(``power_of_two_scales``: DeepSeek V3.1's ue8m0 scales); each element is ``x / scale`` rounded to the nearest
e4m3 value by torch's cast (round to nearest even). Partial last tiles are allowed. An all-zero tile gets the
scale 1.0, so that it decodes to zeros and no scale is 0 or NaN. The decoded value of an element is
``float(data) * scale`` of its tile, exact in float64 (a 4-bit times a 24-bit significand).

:func:`reference_grouped_matmul` is the float64 oracle of the grouped matmul: the exact product of the decoded
operands, per group.
"""
from __future__ import annotations

import torch

E4M3_MAX = 448.0
BLOCK_ACTIVATIONS = (1, 128)
BLOCK_WEIGHTS = (128, 128)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _next_power_of_two(values: torch.Tensor) -> torch.Tensor:
    """The smallest power of two >= each positive float32 value, exactly (``frexp``, no ``log2`` rounding)."""
    mantissa, exponent = torch.frexp(values)  # values = mantissa * 2**exponent, mantissa in [0.5, 1)
    exponent = exponent - (mantissa == 0.5).to(exponent.dtype)  # already a power of two
    return torch.ldexp(torch.ones_like(values), exponent)


def expand_scales(scales: torch.Tensor, block: tuple[int, int], shape: torch.Size) -> torch.Tensor:
    """Scales ``[..., ceil(R / rows), ceil(K / cols)]`` repeated to one per element of ``shape`` ``[..., R, K]``."""
    rows, cols = block
    expanded = scales.repeat_interleave(rows, dim=-2).repeat_interleave(cols, dim=-1)
    return expanded[..., :shape[-2], :shape[-1]]


def quantize_fp8_blocks(x: torch.Tensor, block: tuple[int, int] = BLOCK_ACTIVATIONS,
                        power_of_two_scales: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x`` to e4m3 with one float32 scale per ``block = (rows, cols)`` tile of its last two dims.

    Args:
        x: floating tensor ``[..., R, K]`` (bf16, fp16, fp32 or fp64), R, K >= 1.
        block: ``(1, 128)`` for activations (per token per 128 columns), ``(128, 128)`` for weights; any
            positive pair works.
        power_of_two_scales: round each scale up to a power of two (then ``amax / scale <= 448`` still holds).

    Returns:
        ``(data, scales)``: data ``float8_e4m3fn [..., R, K]``, scales ``float32 [..., ceil(R / rows),
        ceil(K / cols)]``. NaN in a tile makes its scale NaN (and its elements NaN).

    Raises:
        ValueError: ``x`` has fewer than two dims or is not floating point, or a block side is not positive.
    """
    if x.dim() < 2 or not x.is_floating_point():
        raise ValueError(f"x must be a floating tensor [..., R, K], got {tuple(x.shape)} {x.dtype}")
    rows, cols = block
    if rows < 1 or cols < 1:
        raise ValueError(f"block sides must be positive, got {block}")
    *batch, R, K = x.shape
    values = x.to(torch.float32)
    row_blocks, col_blocks = _cdiv(R, rows), _cdiv(K, cols)
    padded = torch.nn.functional.pad(values, (0, col_blocks * cols - K, 0, row_blocks * rows - R))  # zeros: no amax
    tiles = padded.reshape(*batch, row_blocks, rows, col_blocks, cols)
    amax = tiles.abs().amax(dim=(-3, -1))  # [..., row_blocks, col_blocks]
    scales = amax / E4M3_MAX
    if power_of_two_scales:
        scales = _next_power_of_two(scales)
    scales = torch.where(amax == 0, torch.ones_like(scales), scales)
    # x / scale <= 448 up to the division's rounding; the clamp changes no value inside e4m3's range, so the
    # data are exactly torch's cast of x / scale.
    data = (values / expand_scales(scales, block, values.shape)).clamp(-E4M3_MAX, E4M3_MAX)
    return data.to(torch.float8_e4m3fn), scales.contiguous()


def dequantize_fp8_blocks(data: torch.Tensor, scales: torch.Tensor, block: tuple[int, int],
                          dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """The decoded values ``data * scale`` ``[..., R, K]`` in ``dtype`` (float64: exact).

    Args:
        data: ``float8_e4m3fn [..., R, K]``; scales: float32 ``[..., ceil(R / rows), ceil(K / cols)]``.

    Raises:
        ValueError: the scale shape does not match ``data`` and ``block``.
    """
    rows, cols = block
    expected = (*data.shape[:-2], _cdiv(data.shape[-2], rows), _cdiv(data.shape[-1], cols))
    if tuple(scales.shape) != expected:
        raise ValueError(f"scales {tuple(scales.shape)} do not match data {tuple(data.shape)} and block {block}: "
                         f"expected {expected}")
    return data.to(dtype) * expand_scales(scales.to(dtype), block, data.shape)


def reference_grouped_matmul(a: torch.Tensor, a_scales: torch.Tensor, b: torch.Tensor, b_scales: torch.Tensor,
                             a_offsets: torch.Tensor, expert_ids: torch.Tensor,
                             expert_scales: torch.Tensor | None = None, groups=None) -> torch.Tensor:
    """Float64 oracle of the grouped 1D-1D matmul on the decoded operands.

    ``out[s:e] = expert_scales[x] * A[s:e] @ B[x]ᵀ`` for each group ``g`` with ``s, e = a_offsets[g],
    a_offsets[g + 1]`` and ``x = expert_ids[g]``; zeros for ``x`` outside ``[0, E)`` (``-1``); NaN (meaning
    "never written") for rows outside every group, i.e. past ``a_offsets[G]``.

    Args:
        a: ``float8_e4m3fn [T, K]``, a_scales: float32 ``[T, ceil(K / 128)]`` (block (1, 128)).
        b: ``float8_e4m3fn [E, N, K]``, b_scales: float32 ``[E, ceil(N / 128), ceil(K / 128)]`` (block (128, 128)).
        a_offsets: int ``[G + 1]``, non-decreasing, ``a_offsets[G] <= T``; expert_ids: int ``[G]``.
        expert_scales: optional float32 ``[E]``.
        groups: optional iterable of group indices to compute (the others stay NaN): checks of large
            problems on a few groups (each expert is decoded only when used).

    Returns:
        float64 ``[T, N]`` on ``a``'s device.
    """
    num_tokens, num_experts, n = a.shape[0], b.shape[0], b.shape[1]
    offsets = a_offsets.tolist()
    ids = expert_ids.tolist()
    out = torch.full((num_tokens, n), float("nan"), dtype=torch.float64, device=a.device)
    decoded_a = dequantize_fp8_blocks(a, a_scales, BLOCK_ACTIVATIONS)
    for group in (range(len(ids)) if groups is None else groups):
        start, end, expert = offsets[group], offsets[group + 1], ids[group]
        if end <= start:
            continue
        if not 0 <= expert < num_experts:
            out[start:end] = 0.0
            continue
        weights = dequantize_fp8_blocks(b[expert], b_scales[expert], BLOCK_WEIGHTS)
        product = decoded_a[start:end] @ weights.T
        if expert_scales is not None:
            product = product * float(expert_scales[expert])
        out[start:end] = product
    return out


def relative_errors(out: torch.Tensor, reference: torch.Tensor) -> tuple[float, float]:
    """``(‖out − ref‖_F / ‖ref‖_F, max|out − ref| / max|ref|)`` over the rows where ``reference`` is not NaN
    (the written rows), in float64. A reference of zeros gives the absolute errors."""
    rows = ~torch.isnan(reference).any(dim=1)
    ref, got = reference[rows], out[rows].to(torch.float64)
    diff = got - ref
    norm, peak = ref.norm().item(), ref.abs().max().item() if ref.numel() else 0.0
    fro = diff.norm().item() / (norm if norm > 0 else 1.0)
    worst = (diff.abs().max().item() if diff.numel() else 0.0) / (peak if peak > 0 else 1.0)
    return fro, worst
