"""The one-time preparation of MXFP4 expert weights for the ``w4a8_hopper`` kernel (``gluon_w4a8_kernel.py``), and
the copies :func:`llmkernels.grouped_matmul` keeps of it.

**Exactness**: ``e2m1 x 2^-d`` is an e4m3 value for every ``-6 <= d <= 8``. Each weight row gets a reference
exponent ``R = max s - 6`` over its 32-K blocks that matter (codes not all zero, scale not NaN), and each block the
e4m3 table of its eight magnitudes times ``2^(s - R)``: exact while the row's exponents spread by at most 14
binades. Weights with a block further below (``d > 8``) would be rounded; :func:`prepare_weights` raises for them
unless ``allow_rounding``, and the copies never round: such weights take the portable ``w4a8_blocks`` kernel.

**The copies** (:data:`W4A8_COPIES`) follow the rules of :mod:`~llmkernels.grouped_matmul.layout_cache`:

* keyed on the memory of the weights' data and scales (storage, offset, shape, strides), so every view or re-wrap
  of the same tensors finds its copy; dropped when the data's storage is freed;
* an in-place write to the data or the scales (their version counters) makes the next call prepare again; tensors
  without a version counter (``torch.inference_mode``) are not prepared;
* never prepared while a CUDA graph is being captured (the portable kernel runs; a copy made before is used);
* the preparation syncs once (it counts the blocks it would round): a one-time conversion, never in a hot path;
* memory: 1.5x the weights' bytes (data as large as the packed codes, tables of 8 bytes per 32 weights, a float32
  factor per row and 128-K step); ``W4A8_COPIES.enabled = False`` turns the Hopper kernel off, ``clear()`` frees
  the copies.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .layout_cache import WeightCopies

__all__ = ["PreparedW4A8", "prepare_weights", "emulate_decode", "W4A8Copies", "W4A8_COPIES"]

_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # magnitudes of the e2m1 codes 0..7
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


_CHUNK_WEIGHTS = 2**27


def _codes_and_exponents(packed: torch.Tensor, scales: torch.Tensor):
    """Packed e2m1 bytes ``[E, N, K / 2]`` and row-layout e8m0 bytes ``[E, N, K / 32]`` → uint8 codes ``[E, N, K']``
    and e8m0 exponents int32 ``[E, N, K'/32]``, K' = K rounded up to 128 (zero codes, exponent 127 past K)."""
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2)
    exps = scales.to(torch.int32)
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
    if reference == "row":  # one R per row over all of K
        step_max = step_max.amax(-1, keepdim=True).expand(-1, -1, kp // 128)
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
    """The one-time weight conversion for the ``w4a8_hopper`` kernel: MXFP4 ScaledTensor ``[E, N, K]`` (any scale
    layout) → :class:`PreparedW4A8`. N a multiple of 128, K of 64 (padded to whole 128-K steps with zero codes).
    ``reference``: "row" (one R per row over all of K: the row factor goes to the epilogue, the promotion is one
    FFMA an element; exact while the row's K/32 exponents spread by <= 14; what the product runs) or "step" (one R
    per row and 128-K step: exact while a row's four exponents of a step spread by <= 14; one more FMUL an element
    and step). Syncs once (the count of rounded blocks).

    Raises:
        ValueError: other shapes or formats, and a block that would be rounded unless ``allow_rounding`` (then each
            rounded weight is within ``2^(R - 137)`` of its value).
    """
    if getattr(w, "spec", None) is None or w.spec.name != "mxfp4":
        raise ValueError("w: must be an MXFP4 ScaledTensor")
    return _prepare(
        w.row_data().view(torch.uint8), w.row_scales().view(torch.uint8), tuple(w.shape), reference, allow_rounding
    )


def _prepare(packed, scales, shape: tuple, reference: str, allow_rounding: bool) -> PreparedW4A8:
    """:func:`prepare_weights` on row-layout bytes (``[E, N, K / 2]`` codes, ``[E, N, K / 32]`` exponents), a few
    experts at a time (the rearrangement holds int64 temporaries of ~8 bytes per weight: 2^27 weights a chunk keep
    it near a GB whatever E; each expert's rows are prepared on their own, so chunks change no bit)."""
    if len(shape) != 3 or shape[1] % 128 or shape[2] % 64:
        raise ValueError(f"w: must be [E, N, K] with N a multiple of 128 and K of 64, got {shape}")
    if reference not in ("row", "step"):
        raise ValueError(f"reference: must be 'row' or 'step', got {reference!r}")
    num_experts = shape[0]
    per_chunk = max(1, _CHUNK_WEIGHTS // max(1, shape[1] * shape[2]))
    parts = [
        _prepare_experts(packed[e : e + per_chunk], scales[e : e + per_chunk], reference)
        for e in range(0, num_experts, per_chunk)
    ]
    rounded_blocks = sum(part[3] for part in parts)
    spread = max((part[4] for part in parts), default=0)
    if rounded_blocks and not allow_rounding:
        raise ValueError(
            f"w: {rounded_blocks} 32-K blocks lie more than 14 binades below their reference (spread "
            f"{spread}): they would be rounded; pass allow_rounding=True to accept the stated bound"
        )
    data, tables, factors = (torch.cat([part[i] for part in parts]) if parts else None for i in range(3))
    return PreparedW4A8(data, tables, factors, shape, reference, rounded_blocks, spread)


def _prepare_experts(packed, scales, reference: str) -> tuple:
    """``(data, tables, row_factors, rounded_blocks, spread)`` of the experts ``packed`` / ``scales`` hold."""
    codes, exps = _codes_and_exponents(packed, scales)
    num_experts, n, kp = codes.shape
    r, d, relevant = _references(codes, exps, reference)
    rounded_blocks = int((relevant & (d > D_MAX)).sum())
    spread = int(torch.where(relevant, d, D_MIN).amax() - D_MIN) if relevant.any() else 0
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
    return data, tables.contiguous(), factors.contiguous(), rounded_blocks, spread


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


class W4A8Copies(WeightCopies):
    """The prepared copies of MXFP4 weights that the ``w4a8_hopper`` backend reads (see the module for the rules).
    ``enabled``: whether launches prepare and use them (True by default)."""

    def get(self, data: torch.Tensor, scales: torch.Tensor, shape: tuple) -> PreparedW4A8 | None:
        """The prepared copy of row-layout MXFP4 weights (packed bytes ``data`` ``[E, N, K / 2]``, e8m0 bytes
        ``scales`` ``[E, N, K / 32]``, logical ``shape`` ``[E, N, K]``), made now if needed; None where the rules
        make none (disabled, no version counter, a capture without a copy made before) or where the weights are not
        exact in the kernel's decode (remembered until they change)."""
        if not self.enabled:
            return None
        return self._copy_of(data, scales, (), lambda: _exact_copy(data, scales, tuple(shape)))


def _exact_copy(data, scales, shape: tuple) -> PreparedW4A8 | None:
    try:
        return _prepare(data, scales, shape, "row", allow_rounding=False)
    except ValueError:  # blocks that would be rounded
        return None


W4A8_COPIES = W4A8Copies()
"""The prepared copies the ``w4a8_hopper`` backend reads MXFP4 weights through."""
