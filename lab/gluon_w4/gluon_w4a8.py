"""LAB Gluon kernel, e4m3 mode (w4a8): FP8 (1, 128)-block activations x MXFP4 expert weights on Hopper's FP8 tensor
cores, the weights decoded in registers straight into the e4m3 A operand of ``wgmma m64nNk32 f32.e4m3.e4m3``. Not
the product (see NOTES.md, "e4m3 mode"). The schedule is the bf16 mode's (``gluon_kernel.py``: swap-AB, persistent
grid, one TMA load warp reused as is, two consumer warpgroups of 64 weight rows); what differs is the consumer:

* **Decode by table**: for each weight row and 128-K step a reference exponent ``R`` (:func:`prepare_weights`), and
  for each 32-K block of that row (e8m0 exponent ``s``) the eight e4m3 bytes of ``{0, 0.5, 1, 1.5, 2, 3, 4, 6} x
  2^(s - R)`` (two int32 words, precomputed). A packed data word holds 8 codes (3 magnitude bits as PRMT selector
  nibbles, the signs at the e4m3 sign bits); ``prmt`` looks up four magnitudes at once: 7 instructions per 8 weights
  (``and, prmt, lop3, shr, prmt, shl, lop3``), against 2.6 a weight for the bf16 mode's decode.
* **Exact range**: ``e2m1 x 2^-d`` is an e4m3 value for every ``-6 <= d <= 8`` (384 = 1.5 x 2^8 on top, 2^-9 the
  smallest subnormal at the bottom). With ``R = max s - 6`` over the domain's blocks that matter (codes not all
  zero, scale not NaN), every block is exact while the domain's exponents spread by at most 14. A block further
  below (``d > 8``) is rounded to nearest e4m3: each such weight is off by at most ``2^(R - 127 - 10) = 2^(max s -
  127 - 16)``; :func:`prepare_weights` counts these blocks and raises unless ``allow_rounding=True``.
* **Promotion**: a fresh fp32 partial per 128-K step (``use_acc=False`` on its first wgmma), then ``acc +=
  partial x (2^(R - 127) x a_scale[token])``: per accumulator element one FMUL (the outer product of the row
  factor and the token scale) and one FFMA; with ``reference="tile"`` (one R per 64-row consumer half and 128-K
  step) the factor is a token vector: half an FMUL per element (32 FMUL + 64 FFMA a thread and step).

Shapes: a ``float8_e4m3fn [T, K]`` with fp32 scales ``[T, ceil(K/128)]`` (any strides), K a multiple of 64, N of 128;
out bf16 ``[T, N]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

# magnitudes of the e2m1 codes 0..7
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
D_MIN, D_MAX = -6, 8  # e2m1 x 2^-d is an e4m3 value for every d in [D_MIN, D_MAX]
_NAN_TABLE = 0x7F7F7F7F  # e4m3fn NaN in every byte: a block with scale 255 decodes to NaN, as dequantize does


@dataclass(frozen=True)
class PreparedW4A8:
    """:func:`prepare_weights`' result.

    data: int32 ``[E, N/16, K'/64, 8 (g), 4 (t), 4 (j)]`` (K' = K rounded up to 128): lane ``4g + t``'s four words of
    a 16-row fragment block and 64-K chunk; word ``j = 2i + h`` holds row ``g + 8h`` at ``k = 32i + 4t + n`` (low
    output word) and ``k = 32i + 16 + 4t + n`` (high output word), n = 0..3: magnitude of low byte n in bits
    ``4n..4n+2``, of high byte n in ``16+4n..18+4n``, sign of low byte n at bit ``8n+7``, of high byte n at ``8n+3``.
    tables: int32 ``[E, N/16, K'/128, 8 (g), 2 (chunk), 4 (j), 2]``: the e4m3 bytes of magnitudes 0..3 and 4..7 for
    word j's row and 32-K block. row_factors: float32 ``[E, N, K'/128]`` = ``2^(R - 127)``.
    rounded_blocks: how many (row, 32-K) blocks have ``d > 8`` (rounded, see the module docstring)."""

    data: torch.Tensor
    tables: torch.Tensor
    row_factors: torch.Tensor
    shape: tuple
    reference: str
    rounded_blocks: int
    max_spread: int


def _codes_and_exponents(w):
    """MXFP4 ScaledTensor ``[E, N, K]`` → uint8 codes ``[E, N, K']`` and e8m0 exponents int32 ``[E, N, K'/32]``,
    K' = K rounded up to 128 (zero codes, exponent 127 past K)."""
    packed = w.row_data().view(torch.uint8)
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2)
    exps = w.row_scales().view(torch.uint8).to(torch.int32)
    k = codes.shape[-1]
    pad = -k % 128
    if pad:
        codes = torch.cat([codes, codes.new_zeros(*codes.shape[:-1], pad)], dim=-1)
        exps = torch.cat([exps, exps.new_full((*exps.shape[:-1], pad // 32), 127)], dim=-1)
    return codes, exps


def _references(codes, exps, reference):
    """Reference exponent R ``[E, N, K'/128]`` (int64), the per-block shift d ``[E, N, K'/32]`` and the mask of the
    blocks that matter (not NaN, codes not all zero)."""
    num_experts, n, kp = codes.shape
    relevant = ((codes & 7).reshape(num_experts, n, kp // 32, 32).amax(-1) > 0) & (exps != 255)
    masked = torch.where(relevant, exps, -1).to(torch.int64)  # [E, N, K'/32]
    step_max = masked.reshape(num_experts, n, kp // 128, 4).amax(-1)  # [E, N, steps]
    if reference == "tile":  # one R per 64 rows (a consumer's half of the 128-row tile) and 128-K step
        step_max = step_max.reshape(num_experts, n // 64, 64, -1).amax(2, keepdim=True).expand(-1, -1, 64, -1)
        step_max = step_max.reshape(num_experts, n, -1)
    r = torch.where(step_max >= 0, step_max - 6, 127)
    d = r.repeat_interleave(4, dim=-1) - exps
    return r, d, relevant


def _tables(exps, d):
    """Per (row, 32-K block): int32 ``[..., 2]``, the e4m3 bytes of magnitudes 0..3 and 4..7 times 2^-d (RNE)."""
    mags = torch.tensor(_E2M1, dtype=torch.float32, device=exps.device)
    factor = torch.ldexp(torch.ones_like(d, dtype=torch.float32), -d.clamp(max=60).to(torch.float32))
    values = (mags * factor[..., None]).to(torch.float8_e4m3fn).view(torch.uint8).to(torch.int64)
    words = values.reshape(*values.shape[:-1], 2, 4)
    words = words[..., 0] | (words[..., 1] << 8) | (words[..., 2] << 16) | (words[..., 3] << 24)
    words = torch.where((exps == 255)[..., None], _NAN_TABLE, words)
    return (words - ((words >> 31) << 32)).to(torch.int32)  # as signed int32


def prepare_weights(w, reference: str = "row", allow_rounding: bool = False) -> PreparedW4A8:
    """The one-time weight conversion for the e4m3 mode (outside timing): MXFP4 ScaledTensor ``[E, N, K]`` (any
    scale layout) → :class:`PreparedW4A8`. N a multiple of 128, K of 64 (padded to whole 128-K steps with zero
    codes). ``reference``: "row" (one R per row and 128-K step: exact while a row's four 32-K exponents of a step
    spread by <= 14) or "tile" (one R per 64 rows and step: cheaper promotion, exact while those 256 exponents
    spread by <= 14). Raises ValueError on other shapes or formats, and when a block would be rounded unless
    ``allow_rounding`` (then each rounded weight is within ``2^(R - 137)`` of its value)."""
    if getattr(w, "spec", None) is None or w.spec.name != "mxfp4":
        raise ValueError("w: must be an MXFP4 ScaledTensor")
    shape = tuple(w.shape)
    if len(shape) != 3 or shape[1] % 128 or shape[2] % 64:
        raise ValueError(f"w: must be [E, N, K] with N a multiple of 128 and K of 64, got {shape}")
    if reference not in ("row", "tile"):
        raise ValueError(f"reference: must be 'row' or 'tile', got {reference!r}")
    codes, exps = _codes_and_exponents(w)
    num_experts, n, kp = codes.shape
    r, d, relevant = _references(codes, exps, reference)
    rounded = relevant & (d > D_MAX)
    rounded_blocks = int(rounded.sum())
    spread = torch.where(relevant, d, D_MIN).amax() - D_MIN if relevant.any() else torch.tensor(0)
    if rounded_blocks and not allow_rounding:
        raise ValueError(
            f"w: {rounded_blocks} 32-K blocks lie more than 14 binades below their reference (spread "
            f"{int(spread)}): they would be rounded; pass allow_rounding=True to accept the stated bound"
        )
    mags = (codes & 7).to(torch.int64)
    signs = (codes >> 3).to(torch.int64)
    # [E, block, h, g, chunk, i, half, t, n]: row = 16 block + 8h + g, k = 64 chunk + 32i + 16 half + 4t + n
    view = (num_experts, n // 16, 2, 8, kp // 64, 2, 2, 4, 4)
    mags, signs = mags.reshape(view), signs.reshape(view)
    nib = torch.arange(4, device=codes.device)
    words = (
        (mags[..., 0, :, :] << (4 * nib)).sum(-1)
        | (mags[..., 1, :, :] << (16 + 4 * nib)).sum(-1)
        | (signs[..., 0, :, :] << (8 * nib + 7)).sum(-1)
        | (signs[..., 1, :, :] << (8 * nib + 3)).sum(-1)
    )  # [E, block, h, g, chunk, i, t]
    words = words.permute(0, 1, 4, 3, 6, 5, 2).reshape(num_experts, n // 16, kp // 64, 8, 4, 4)
    data = (words - ((words >> 31) << 32)).to(torch.int32).contiguous()
    tables = _tables(exps, d)  # [E, N, K'/32, 2]
    tables = tables.reshape(num_experts, n // 16, 2, 8, kp // 128, 2, 2, 2)  # (e, block, h, g, step, chunk, i, w)
    tables = tables.permute(0, 1, 4, 3, 5, 6, 2, 7).reshape(num_experts, n // 16, kp // 128, 8, 2, 4, 2)
    factors = torch.ldexp(torch.ones_like(r, dtype=torch.float32), (r - 127).to(torch.float32))
    return PreparedW4A8(data, tables.contiguous(), factors.contiguous(), shape, reference, rounded_blocks, int(spread))


def emulate_decode(w: PreparedW4A8) -> torch.Tensor:
    """float32 ``[E, N, K]``: the weights as the kernel decodes them from ``w`` (the PTX's and / prmt / shifts on
    each data word and its table words, the e4m3 bytes' values, x the row factor), in torch on any device."""
    num_experts, n, k_logical = w.shape
    kp = -(-k_logical // 128) * 128
    words = w.data.to(torch.int64) & 0xFFFFFFFF  # [E, block, chunk, g, t, j]
    tables = w.tables.to(torch.int64) & 0xFFFFFFFF  # [E, block, step, g, chunk, j, 2]
    tables = tables.permute(0, 1, 2, 4, 3, 5, 6).reshape(num_experts, n // 16, kp // 64, 8, 1, 4, 2)
    table64 = tables[..., 0] | (tables[..., 1] << 32)  # prmt's 8 source bytes

    def prmt(selector):  # default mode: four selector nibbles (bit 3 clear) → four bytes of table64
        out = torch.zeros_like(selector)
        for b in range(4):
            index = (selector >> (4 * b)) & 0xF
            out |= ((table64 >> (8 * index)) & 0xFF) << (8 * b)
        return out

    m = words & 0x77777777
    low = prmt(m & 0xFFFF) | (words & 0x80808080)
    high = prmt(m >> 16) | ((words << 4) & 0x80808080)

    def values(word):  # [..., j] → [..., j, 4] float32 of the e4m3 bytes
        b = torch.stack([(word >> (8 * i)) & 0xFF for i in range(4)], -1).to(torch.uint8)
        return b.view(torch.float8_e4m3fn).to(torch.float32)

    both = torch.stack([values(low), values(high)], -2)  # [E, block, chunk, g, t, j, half, n]
    both = both.reshape(num_experts, n // 16, kp // 64, 8, 4, 2, 2, 2, 4)  # j → (i, h)
    # row = 16 block + 8h + g, k = 64 chunk + 32 i + 16 half + 4 t + n
    both = both.permute(0, 1, 6, 3, 2, 5, 7, 4, 8).reshape(num_experts, n, kp)
    factors = w.row_factors.repeat_interleave(128, dim=-1)
    return (both * factors)[..., :k_logical]


def reference_matmul(a, w: PreparedW4A8, a_offsets, expert_ids, out_rows=None):
    """float64 ``[T, N]``: the fp8 activations (dequantized) times :func:`emulate_decode` per group; zero rows for
    expert -1 and rows past ``a_offsets[G]``."""
    from llmkernels import dequantize

    a64 = dequantize(a).double()
    weights = emulate_decode(w).double()
    out = torch.zeros(a64.shape[0], w.shape[1], dtype=torch.float64, device=a64.device)
    offsets = a_offsets.tolist()
    for g, e in enumerate(expert_ids.tolist()):
        if e >= 0:
            out[offsets[g] : offsets[g + 1]] = a64[offsets[g] : offsets[g + 1]] @ weights[e].T
    return out
