"""PyTorch reference for the block-scaled formats: quantize and dequantize, written for clarity.

These are the oracle for the Triton quantize kernel and for the matmul tests; they compute in float32.
"""

from __future__ import annotations

import math

import torch

from .layouts import ROW
from .scaled_tensor import ScaledTensor, as_block
from .spec import E2M1_MAX, E4M3_MAX, FormatSpec, format_spec

__all__ = [
    "quantize_reference",
    "quantize_fp8_reference",
    "dequantize",
    "e2m1_values",
    "encode_e2m1",
    "decode_e2m1",
    "decode_e8m0",
]

# e2m1 code (sign << 3 | exponent << 1 | mantissa) → value
_E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E4M3_TINY = 2.0**-6  # smallest normal e4m3: floor of an nvfp4 block scale (torchao's choice)


def e2m1_values(device=None) -> torch.Tensor:
    """float32 ``[16]``: the value of every e2m1 code."""
    mags = torch.tensor(_E2M1_MAGNITUDES, dtype=torch.float32, device=device)
    return torch.cat([mags, -mags])


def encode_e2m1(x: torch.Tensor) -> torch.Tensor:
    """float32 → uint8 e2m1 codes (one per element), round to nearest even, saturating at ±6."""
    mags = torch.tensor(_E2M1_MAGNITUDES, dtype=torch.float32, device=x.device)
    a = x.abs().clamp(max=E2M1_MAX)
    dist = (a[..., None] - mags).abs()
    best = dist.min(dim=-1, keepdim=True).values
    # Among the nearest codes (two on a tie), prefer the even one (mantissa bit 0).
    candidates = (dist == best) & (torch.arange(8, device=x.device) % 2 == 0)
    code = torch.where(candidates.any(-1), candidates.int().argmax(-1), dist.argmin(-1))
    sign = torch.signbit(x) & ~torch.isnan(x)
    return (code + sign.to(code.dtype) * 8).to(torch.uint8)


def decode_e2m1(codes: torch.Tensor) -> torch.Tensor:
    return e2m1_values(codes.device)[codes.int()]


def decode_e8m0(bits: torch.Tensor) -> torch.Tensor:
    """uint8 biased exponents → float32 ``2^(bits - 127)`` (255 → NaN), built from the bits (exact on
    every device; CUDA's exp2 is not exact at every integer)."""
    exponents = bits.to(torch.int32)
    words = torch.where(exponents == 0, 0x00400000, exponents << 23)  # 2^-127 is float32's subnormal
    return torch.where(exponents == 255, torch.nan, words.view(torch.float32))


def _pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def _unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2)


def _divide(x: torch.Tensor, divisor: float) -> torch.Tensor:
    """``x / divisor`` correctly rounded on every device (CUDA turns division by a Python scalar into
    a multiplication by its rounded reciprocal, which can move a value across an e4m3 tie)."""
    return x / torch.full_like(x, divisor)


# The smallest global scale: float32's smallest normal. Below it, block_scale · global_scale would
# be subnormal or 0, and x / 0 has no agreed code.
NVFP4_MIN_GLOBAL_SCALE = 2.0**-126


def nvfp4_global_scale(x: torch.Tensor) -> torch.Tensor:
    """The nvfp4 decode scale ``max(amax / (448 · 6), 2^-126)`` as a float32 scalar tensor (1.0 for an
    all-zero or empty x).

    The floor only acts on tensors whose amax is below ``2^-126 · 2688`` (about 3.2e-35, float32's
    subnormal range after the division): their elements below about ``2^-136`` decode to 0, and
    nothing decodes to NaN or inf.
    """
    if x.numel() == 0:  # host-known: no sync; aminmax has no identity
        return torch.ones((), dtype=torch.float32, device=x.device)
    low, high = torch.aminmax(x)  # one pass, no |x| temporary
    amax = torch.maximum(-low, high).float()
    scale = _divide(amax, E4M3_MAX * E2M1_MAX).clamp_min(NVFP4_MIN_GLOBAL_SCALE)
    return torch.where(amax > 0, scale, torch.ones_like(amax))


def quantize_reference(
    x: torch.Tensor,
    format: str,
    global_scale: torch.Tensor | None = None,
    *,
    block: tuple[int, int] | None = None,
    power_of_two_scales: bool = False,
) -> ScaledTensor:
    """Reference for :func:`llmkernels.quantize` (same bits), in plain PyTorch. x: ``[..., K]`` (fp8 with
    ``block=(128, 128)``: ``[..., R, K]``).

    ``block`` and ``power_of_two_scales`` as :func:`llmkernels.quantize` takes them (fp8 only; see
    :func:`quantize_fp8_reference`).

    Raises:
        ValueError: unknown format, K not a multiple of the block (MX, nvfp4), a bad block, ``power_of_two_scales``
            for a format other than fp8.
    """
    spec = format_spec(format)
    as_block(spec, block)
    if spec.scale == "f32":
        return quantize_fp8_reference(x, block, power_of_two_scales)
    if power_of_two_scales:
        raise ValueError(f"power_of_two_scales is for fp8 only, not {format}")
    k = x.shape[-1]
    if k % spec.block:
        raise ValueError(f"{format} needs the last dim ({k}) to be a multiple of {spec.block}")
    blocks = x.float().reshape(*x.shape[:-1], k // spec.block, spec.block)
    amax = blocks.abs().amax(-1)
    if spec.scale == "e8m0":
        scale_bits, scale = _mx_scales(amax, spec)
        scales = scale_bits.view(torch.float8_e8m0fnu)
    else:
        if global_scale is None:
            global_scale = nvfp4_global_scale(x)
        global_scale = global_scale.float().reshape(())
        block_scale = _divide(amax, E2M1_MAX) / global_scale
        scales = block_scale.clamp(E4M3_TINY, E4M3_MAX).to(torch.float8_e4m3fn)
        scale = scales.float() * global_scale
    scaled = (blocks / scale[..., None]).clamp(-spec.element_max, spec.element_max).reshape(x.shape)
    if spec.packed:
        data = _pack_e2m1(encode_e2m1(scaled))
    else:
        data = scaled.to(torch.float8_e4m3fn)
    return ScaledTensor(data, scales, format, global_scale if spec.has_global_scale else None)


# fp8 scales are floored here (float32's smallest normal): below it amax / 448 would be subnormal or 0, and a
# tile of tiny values would divide by 0 or depend on whether the device flushes subnormals.
FP8_MIN_SCALE = 2.0**-126


def quantize_fp8_reference(x: torch.Tensor, block: tuple[int, int], power_of_two_scales: bool = False) -> ScaledTensor:
    """The fp8 block format in plain PyTorch: for each ``block = (rows, cols)`` tile of x's last two dims (of its
    last dim for ``(1, 128)``; partial last tiles hold the elements there are),

    - ``scale = max(amax(|tile|) / 448, 2^-126)`` in float32 (correctly rounded), with ``power_of_two_scales``
      rounded up to a power of two (exactly, by ``frexp``: DeepSeek V3.1's ue8m0 scales); 1.0 for an all-zero
      tile; NaN for a tile holding a NaN;
    - each element ``x / scale`` in float32 (correctly rounded), clamped to ±448 (which only catches the
      division's last-ulp overshoot) and cast to ``float8_e4m3fn`` by torch (nearest, ties to even); a NaN is
      written as +NaN (0x7F).

    x: bf16, fp16 or fp32 ``[..., K]`` (``(1, 128)``) or ``[..., R, K]`` (``(128, 128)``). Returns the
    ScaledTensor (data ``float8_e4m3fn`` of x's shape, scales float32 ``[..., ceil(R / rows), ceil(K / cols)]``).
    """
    spec = format_spec("fp8")
    rows, cols = block = as_block(spec, block)
    if rows > 1 and x.dim() < 2:
        raise ValueError(f"fp8 with block={block} needs x of at least 2 dims, got shape {tuple(x.shape)}")
    values = x.float() if x.dim() >= 2 else x.float()[None]
    *batch, num_rows, k = values.shape
    row_tiles, col_tiles = -(-num_rows // rows), -(-k // cols)
    padded = torch.nn.functional.pad(values, (0, col_tiles * cols - k, 0, row_tiles * rows - num_rows))
    amax = padded.reshape(*batch, row_tiles, rows, col_tiles, cols).abs().amax(dim=(-3, -1))
    scales = _divide(amax, E4M3_MAX).clamp_min(FP8_MIN_SCALE)  # (a NaN stays NaN)
    if power_of_two_scales:
        mantissa, exponent = torch.frexp(scales)  # scales = mantissa · 2^exponent, mantissa in [0.5, 1)
        exponent = exponent - (mantissa == 0.5).to(exponent.dtype)  # already a power of two
        scales = torch.where(torch.isfinite(scales), torch.ldexp(torch.ones_like(scales), exponent), scales)
    scales = torch.where(amax == 0, torch.ones_like(scales), scales)
    per_element = scales.repeat_interleave(rows, dim=-2).repeat_interleave(cols, dim=-1)[..., :num_rows, :k]
    scaled = (values / per_element).clamp(-E4M3_MAX, E4M3_MAX)
    scaled = torch.where(torch.isnan(scaled), torch.nan, scaled)  # +NaN: what the kernel writes
    data = scaled.to(torch.float8_e4m3fn).reshape(x.shape)
    if x.dim() < 2:
        scales = scales[0]
    return ScaledTensor(data, scales.contiguous(), "fp8", block=block)


def _mx_scales(amax: torch.Tensor, spec: FormatSpec):
    """OCP MX floor rule: ``scale = 2^(floor(log2(amax)) - emax)``, clamped to e8m0's range."""
    # floor(log2(amax)) exactly (a float32 log2 rounds up just below a power of two); subnormal
    # and zero amax fall below e8m0's range and clamp to its bottom, as the bit-level rule does.
    exponent = torch.where(amax > 0, torch.frexp(amax).exponent - 1, -127)
    exponent = torch.where(torch.isinf(amax), 128, exponent)  # inf's exponent field, as the bit rule reads it
    unbiased = (exponent.clamp(min=-127) - spec.emax).clamp(-127, 127)
    bits = torch.where(torch.isnan(amax), 255, unbiased + 127).to(torch.uint8)
    return bits, decode_e8m0(bits)


def dequantize(x: ScaledTensor) -> torch.Tensor:
    """ScaledTensor of logical shape ``[..., K]`` → float32 ``[..., K]`` (any scale layout, any strides).

    Raises:
        TypeError: x is not a ScaledTensor (or its parts have the wrong dtypes).
        ValueError: its parts do not fit together (:meth:`ScaledTensor.validate`).
    """
    if not isinstance(x, ScaledTensor):
        raise TypeError(f"dequantize takes a ScaledTensor, got {type(x).__name__}")
    x.validate()
    if x.scale_layout.rearranges_data:
        x = x.to_layout(ROW)
    spec = x.spec
    if spec.scale == "f32":
        return _dequantize_fp8(x)
    row_scales = x.row_scales()
    scale = decode_e8m0(row_scales.view(torch.uint8)) if spec.scale == "e8m0" else row_scales.float()
    if spec.has_global_scale:
        scale = scale * x.global_scale.float().reshape(())
    # Decoded in row chunks so that the temporaries stay small next to the float32 result
    # (an [E, N, K] expert weight can be several GiB).
    k = x.shape[-1]
    num_rows = math.prod(x.data.shape[:-1])
    data = x.data.reshape(num_rows, x.data.shape[-1])
    scale = scale.reshape(num_rows, k // spec.block)
    values = torch.empty(data.shape[0], k, dtype=torch.float32, device=data.device)
    rows_per_chunk = max(1, (1 << 24) // max(k, 1))
    for start in range(0, data.shape[0], rows_per_chunk):
        chunk = data[start : start + rows_per_chunk]
        decoded = decode_e2m1(_unpack_e2m1(chunk)) if spec.packed else chunk.float()
        blocks = decoded.view(decoded.shape[0], -1, spec.block) * scale[start : start + rows_per_chunk, :, None]
        values[start : start + rows_per_chunk] = blocks.view(decoded.shape[0], k)
    return values.reshape(x.shape)


def _dequantize_fp8(x: ScaledTensor) -> torch.Tensor:
    """fp8 → float32: ``float(data) · scale`` of each element's tile, one float32 multiply (so within half a float32
    ulp of the exact decode), in place in the result: one broadcast multiply where the tiles divide the rows (the
    expert-parallel exchange decodes its fp8 rows here), else one tile column at a time."""
    rows, cols = x.block
    values = x.data.to(torch.float32, memory_format=torch.contiguous_format)
    if values.dim() == 1:
        values = values[None]
    scales = x.scales if x.scales.dim() == values.dim() else x.scales[None]
    row_scales = scales.repeat_interleave(rows, dim=-2)[..., : values.shape[-2], :] if rows > 1 else scales
    width = values.shape[-1]
    if width % cols == 0 and row_scales.shape[-1] == width // cols:
        values.view(*values.shape[:-1], width // cols, cols).mul_(row_scales[..., None])
    else:
        for tile in range(row_scales.shape[-1]):
            values[..., tile * cols : (tile + 1) * cols] *= row_scales[..., tile : tile + 1]
    return values.reshape(x.shape)
