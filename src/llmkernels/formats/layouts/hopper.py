"""MXFP4 and NVFP4 weights in Hopper's wgmma register-fragment order: a one-time, exact rearrangement of the bytes of
an e2m1 tensor and its scales (e8m0 per 32 or e4m3 per 16), so that a kernel that loads 16 bytes per thread holds
exactly its part of wgmma's A operand once decoded in registers (no shared-memory round trip between decode and
MMA).

The fragment: lane ``4g + t`` of a warp holds, for each 16-wide K step ``j`` of its 16 rows, rows ``g`` and
``g + 8`` at ``k = 16j + 2t + {0, 1}`` and ``16j + 2t + 8 + {0, 1}``. Weights ``[..., N, K]`` become

* data uint8 ``[..., N/16, K/64, 8 (g), 4 (t), 16]``: per (16 rows, 64-wide K chunk) 512 bytes; thread
  ``(g, t)``'s 16 bytes are four little-endian 32-bit words, one per step ``j``, each holding eight values:
  row g at k = 2t, 2t+1, 2t+8, 2t+9 (slots 0, 0, 1, 1 of lanes low, high, low, high) and row g + 8 at the same
  k (slots 2, 2, 3, 3). The sign, e1, e0 and m bits of a slot's value sit at :data:`SLOT_BITS` of its 16-bit
  lane, so that a mask and shifts put them at bf16 bits 15, 8, 7 and 6, which times 2^126 is the value;
* scales uint8 ``[..., N/16, K/64, 8 (g), 2 (h), S]``, ``S = 64 / block`` scales per row and chunk: the scale
  of row ``16 nb + 8h + g`` and block ``S c + s`` of chunk c, the one of K steps ``j`` with ``j // (4 / S) = s``.
  MXFP4 (block 32, S = 2): one 4-byte word per thread and chunk; NVFP4 (block 16, S = 4): two.

N is padded to 16 and K to 64 with zero codes and unit scales (``scale_fill``: 127 for e8m0, 0x38 for e4m3). A
ScaledTensor holds it as ``scale_layout="hopper"`` (:meth:`llmkernels.ScaledTensor.to_layout`, which keeps the logical
shape); the grouped matmul's Hopper kernel (``grouped_matmul/hopper_kernel.py``) reads it through
:func:`load_fragment_tile`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..kernel import decode_e2m1, decode_scale
from .base import Layout, Packed

__all__ = [
    "HopperLayout",
    "HOPPER",
    "SLOT_BITS",
    "FRAGMENT_ROWS",
    "FRAGMENT_K",
    "fragment_scales_per_chunk",
    "to_hopper_fragments",
    "from_hopper_fragments",
    "decode_fragment_tile",
    "load_fragment_tile",
]

FRAGMENT_ROWS, FRAGMENT_K = 16, 64
# (sign, e1, e0, m) bit positions of the four value slots of a 16-bit lane
SLOT_BITS = ((15, 8, 7, 6), (12, 5, 4, 3), (9, 2, 1, 0), (14, 13, 11, 10))


def fragment_scales_per_chunk(block: int) -> int:
    """Scales per row in one 64-wide K chunk for scale blocks of ``block`` (32 or 16) elements."""
    if block not in (16, 32):
        raise ValueError(f"the hopper layout takes scale blocks of 16 or 32 elements, got {block}")
    return FRAGMENT_K // block


def _place(codes: torch.Tensor, slot: int, lane: int) -> torch.Tensor:
    placed = torch.zeros_like(codes)
    for bit, position in zip((3, 2, 1, 0), SLOT_BITS[slot]):
        placed |= ((codes >> bit) & 1) << (position + 16 * lane)
    return placed


def _take(words: torch.Tensor, slot: int, lane: int) -> torch.Tensor:
    codes = torch.zeros_like(words)
    for bit, position in zip((3, 2, 1, 0), SLOT_BITS[slot]):
        codes |= ((words >> (position + 16 * lane)) & 1) << bit
    return codes


def _padded(t: torch.Tensor, rows: int, cols: int, fill: int) -> torch.Tensor:
    out = t.new_full((*t.shape[:-2], rows, cols), fill)
    out[..., : t.shape[-2], : t.shape[-1]] = t
    return out


def _per_leading_index(convert, data: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``convert`` applied to each index of the first dim, the results written into one output pair."""
    outputs = None
    for index in range(data.shape[0]):
        parts = convert(data[index], scales[index])
        if outputs is None:
            outputs = tuple(part.new_empty((data.shape[0], *part.shape)) for part in parts)
        for output, part in zip(outputs, parts):
            output[index] = part
    return outputs


def to_hopper_fragments(
    data: torch.Tensor, scales: torch.Tensor, block: int = 32, scale_fill: int = 127
) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed e2m1 bytes ``[..., N, K/2]`` (low nibble = even k) and their scales ``[..., N, K/block]`` (one byte
    each, any 8-bit dtype) → fragment data uint8 ``[..., N'/16, K'/64, 8, 4, 16]`` and scales uint8
    ``[..., N'/16, K'/64, 8, 2, 64/block]``, N' and K' padded to 16 and 64 (padding scales ``scale_fill``).
    Exact; runs on the tensors' device."""
    data, scales = data.view(torch.uint8), scales.view(torch.uint8)
    *lead, n, half_k = data.shape
    k = 2 * half_k
    per_chunk = fragment_scales_per_chunk(block)
    if tuple(scales.shape) != (*lead, n, k // block) or k % block:
        raise ValueError(f"scales {tuple(scales.shape)} do not fit e2m1 data {tuple(data.shape)} (one per {block})")
    if lead and lead[0] > 1:  # one leading index (expert) at a time: the temporaries hold 8 bytes per value
        return _per_leading_index(lambda d, s: to_hopper_fragments(d, s, block, scale_fill), data, scales)
    nb, kc = -(-n // FRAGMENT_ROWS), -(-k // FRAGMENT_K)
    codes = torch.stack([data & 0xF, data >> 4], dim=-1).reshape(*lead, n, k)
    codes = _padded(codes, nb * FRAGMENT_ROWS, kc * FRAGMENT_K, 0).to(torch.int64)
    lead_dims = len(lead)
    # (..., nb, h, g, c, j, bh, t, bl) → (..., nb, h, c, g, t, j, bh, bl)
    codes = codes.reshape(*lead, nb, 2, 8, kc, 4, 2, 4, 2)
    codes = codes.permute(*range(lead_dims), *(lead_dims + d for d in (0, 1, 3, 2, 6, 4, 5, 7)))
    rows_g, rows_g8 = codes.select(lead_dims + 1, 0), codes.select(lead_dims + 1, 1)  # (..., nb, c, g, t, j, bh, bl)
    words = torch.zeros_like(rows_g[..., 0, 0])
    for slot, rows in enumerate((rows_g, rows_g, rows_g8, rows_g8)):
        for lane in range(2):
            words |= _place(rows[..., slot % 2, lane], slot, lane)
    word_bytes = torch.stack([(words >> shift) & 0xFF for shift in (0, 8, 16, 24)], dim=-1)  # little-endian
    fragment_data = word_bytes.to(torch.uint8).reshape(*lead, nb, kc, 8, 4, 16)
    padded_scales = _padded(scales, nb * FRAGMENT_ROWS, kc * per_chunk, scale_fill)
    # (..., nb, h, g, c, s) → (..., nb, c, g, h, s)
    padded_scales = padded_scales.reshape(*lead, nb, 2, 8, kc, per_chunk)
    fragment_scales = padded_scales.permute(*range(lead_dims), *(lead_dims + d for d in (0, 3, 2, 1, 4)))
    return fragment_data, fragment_scales.contiguous()


def from_hopper_fragments(
    fragment_data: torch.Tensor, fragment_scales: torch.Tensor, n: int, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of :func:`to_hopper_fragments`: packed e2m1 bytes ``[..., n, k/2]`` and uint8 scales
    ``[..., n, k/block]`` of the logical ``[..., n, k]`` tensor (padding dropped; the block is read from the
    scales' last dim)."""
    *lead, nb, kc, _, _, _ = fragment_data.shape
    per_chunk = fragment_scales.shape[-1]
    if lead and lead[0] > 1:
        return _per_leading_index(lambda d, s: from_hopper_fragments(d, s, n, k), fragment_data, fragment_scales)
    lead_dims = len(lead)
    # little-endian words from the bytes, whatever the view's offset (an int32 view needs 4-byte alignment)
    byte_values = fragment_data.reshape(*fragment_data.shape[:-1], 4, 4).to(torch.int64)
    words = (byte_values << torch.arange(0, 32, 8, device=byte_values.device)).sum(-1)  # (..., nb, c, g, t, j)
    slots = [[_take(words, slot, lane) for lane in range(2)] for slot in range(4)]
    rows_g = torch.stack([torch.stack(slots[0], -1), torch.stack(slots[1], -1)], -2)  # (..., j, bh, bl)
    rows_g8 = torch.stack([torch.stack(slots[2], -1), torch.stack(slots[3], -1)], -2)
    codes = torch.stack([rows_g, rows_g8], lead_dims + 1)  # (..., nb, h, c, g, t, j, bh, bl)
    codes = codes.permute(*range(lead_dims), *(lead_dims + d for d in (0, 1, 3, 2, 5, 6, 4, 7)))
    codes = codes.reshape(*lead, nb * FRAGMENT_ROWS, kc * FRAGMENT_K)[..., :n, :k].to(torch.uint8)
    data = codes[..., 0::2] | (codes[..., 1::2] << 4)
    scales = fragment_scales.permute(*range(lead_dims), *(lead_dims + d for d in (0, 3, 2, 1, 4)))
    scales = scales.reshape(*lead, nb * FRAGMENT_ROWS, kc * per_chunk)[..., :n, : k * per_chunk // FRAGMENT_K]
    return data.contiguous(), scales.contiguous()


# ------------------------------------------------------------------------------------------------ device

# $4: one word of eight e2m1 values with their bits placed by SLOT_BITS, so that masks put each value's
# sign, exponent and mantissa bits at bf16 bits 15, 8-7 and 6 of its lane: that bf16 times 2^126 is the
# e2m1 value (the subnormal code 0.5 included). $5-$6 / $7-$8: bf16x2 scales of rows g / g + 8. Outputs
# $0-$1: row g's four values (k = 2t, 2t + 1, 2t + 8, 2t + 9), $2-$3 row g + 8's.
_E2M1_FRAGMENT_PTX = tl.constexpr("""
{
.reg .b32 mask, bias, minus_zero, v0, v1, v2, v3, a, b, c;
mov.b32 mask, 0x81C081C0;
mov.b32 bias, 0x7E807E80;
mov.b32 minus_zero, 0x80008000;
and.b32 v0, $4, mask;
shl.b32 a, $4, 3;
and.b32 v1, a, mask;
shl.b32 a, $4, 6;
and.b32 v2, a, mask;
shl.b32 a, $4, 1;
and.b32 a, a, 0x80008000;
shr.u32 b, $4, 5;
and.b32 b, b, 0x01000100;
shr.u32 c, $4, 4;
and.b32 c, c, 0x00C000C0;
or.b32 v3, a, b;
or.b32 v3, v3, c;
fma.rn.bf16x2 v0, v0, bias, minus_zero;
fma.rn.bf16x2 v1, v1, bias, minus_zero;
fma.rn.bf16x2 v2, v2, bias, minus_zero;
fma.rn.bf16x2 v3, v3, bias, minus_zero;
fma.rn.bf16x2 $0, v0, $5, minus_zero;
fma.rn.bf16x2 $1, v1, $6, minus_zero;
fma.rn.bf16x2 $2, v2, $7, minus_zero;
fma.rn.bf16x2 $3, v3, $8, minus_zero;
}
""")

# $2: four e8m0 bytes → $0 / $1: bf16 2^(s - 127) of bytes 0-1 / 2-3 (0 gives the subnormal 2^-127, 255 NaN):
# the byte moved to bits 14-7 of its lane, raised to 0x0040, and bit 6 set where the lane is 0x7F80.
_E8M0_TO_BF16_PTX = tl.constexpr("""
{
.reg .b32 a, b, t, smallest;
mov.b32 smallest, 0x00400040;
prmt.b32 a, $2, 0, 0x5140;
prmt.b32 b, $2, 0, 0x7362;
shl.b32 a, a, 7;
shl.b32 b, b, 7;
max.u16x2 a, a, smallest;
max.u16x2 b, b, smallest;
add.u32 t, a, 0x00800080;
and.b32 t, t, 0x80008000;
shr.u32 t, t, 9;
or.b32 $0, a, t;
add.u32 t, b, 0x00800080;
and.b32 t, t, 0x80008000;
shr.u32 t, t, 9;
or.b32 $1, b, t;
}
""")


@triton.jit
def _slot_bit(slot, S0: tl.constexpr, S1: tl.constexpr, S2: tl.constexpr, S3: tl.constexpr):
    return tl.where(slot == 0, S0, tl.where(slot == 1, S1, tl.where(slot == 2, S2, S3)))


@triton.jit
def _fragment_codes(words, slot, lane):
    """The e2m1 codes of value ``slot`` of 16-bit ``lane`` in each word (fragments.SLOT_BITS)."""
    shift = 16 * lane
    sign = (words >> (_slot_bit(slot, 15, 12, 9, 14) + shift)) & 1
    e1 = (words >> (_slot_bit(slot, 8, 5, 2, 13) + shift)) & 1
    e0 = (words >> (_slot_bit(slot, 7, 4, 1, 11) + shift)) & 1
    m = (words >> (_slot_bit(slot, 6, 3, 0, 10) + shift)) & 1
    return (sign << 3) | (e1 << 2) | (e0 << 1) | m


@triton.jit
def decode_fragment_tile(
    data,
    scale_bytes,
    NB: tl.constexpr,
    C: tl.constexpr,
    PACKED_DECODE: tl.constexpr,
    DTYPE: tl.constexpr = tl.bfloat16,
    SCALE: tl.constexpr = "e8m0",
):
    """A tile of MXFP4 or NVFP4 weights in the Hopper fragment layout → ``[NB * 16, C * 64]`` in (n, k) order,
    bf16 (``DTYPE`` float32 without PACKED_DECODE: the interpreter flushes bf16 subnormals, float32 keeps them).

    ``data`` uint8 ``[NB, C, 8, 4, 16]`` and ``scale_bytes`` uint8 ``[NB, C, 8, 2, S]`` (or ``[NB, C, 8, 2 S]``) as
    :func:`to_hopper_fragments` lays them out: ``SCALE`` ``"e8m0"`` with S = 2
    (MXFP4) or ``"e4m3"`` with S = 4 (NVFP4; the global scale is the caller's). An e2m1 value times either
    scale has at most 6 significant bits in bf16's range: exact. With PACKED_DECODE (NVIDIA GPUs) each
    thread's words go through PTX (masks, shifts and two bf16x2 multiplies per value pair) and the reshapes
    below only relabel registers: on Hopper the result is already in wgmma's A-operand layout. Otherwise
    (the interpreter) the same values come from integer ops.
    """
    S: tl.constexpr = 2 if SCALE == "e8m0" else 4
    if PACKED_DECODE:
        if SCALE == "e8m0":
            scales = tl.inline_asm_elementwise(
                _E8M0_TO_BF16_PTX,
                "=r,=r,r",
                [tl.reshape(scale_bytes, (NB, C, 8, 4))],
                dtype=tl.bfloat16,
                is_pure=True,
                pack=4,
            )
        else:
            scales = scale_bytes.to(tl.float8e4nv, bitcast=True).to(tl.bfloat16)
    else:
        scales = decode_scale(scale_bytes, SCALE)
    scales = tl.permute(tl.reshape(scales, (NB, C, 8, 2, S)), (0, 1, 2, 4, 3))  # (.., s, h)
    scale_g, scale_g8 = tl.split(scales)  # rows g and g + 8: [NB, C, 8, S]
    if PACKED_DECODE:  # one scale per byte of each thread's 16: words j share scale j // (4 / S)
        scale_g = tl.reshape(
            tl.broadcast_to(scale_g[:, :, :, None, :, None], (NB, C, 8, 4, S, 16 // S)), (NB, C, 8, 4, 16)
        )
        scale_g8 = tl.reshape(
            tl.broadcast_to(scale_g8[:, :, :, None, :, None], (NB, C, 8, 4, S, 16 // S)), (NB, C, 8, 4, 16)
        )
        low, high = tl.inline_asm_elementwise(
            _E2M1_FRAGMENT_PTX,
            "=r,=r,=r,=r,r,r,r,r,r",
            [data, scale_g, scale_g8],
            dtype=(tl.bfloat16, tl.bfloat16),
            is_pure=True,
            pack=4,
        )
    else:
        byte_shifts = 8 * tl.arange(0, 4)
        words = tl.sum(tl.reshape(data, (NB, C, 8, 4, 4, 4)).to(tl.int32) << byte_shifts, axis=5)  # (.., t, j)
        value = tl.arange(0, 4)  # of a word's four per row: lanes low, high of slots 0-1 (row g) or 2-3 (g + 8)
        words = words[:, :, :, :, :, None]
        low = decode_e2m1(_fragment_codes(words, value // 2, value % 2))
        high = decode_e2m1(_fragment_codes(words, 2 + value // 2, value % 2))
        low = tl.reshape(low, (NB, C, 8, 4, S, 4 // S, 4)) * scale_g[:, :, :, None, :, None, None]
        high = tl.reshape(high, (NB, C, 8, 4, S, 4 // S, 4)) * scale_g8[:, :, :, None, :, None, None]
        low = tl.reshape(low, (NB, C, 8, 4, 16)).to(DTYPE)
        high = tl.reshape(high, (NB, C, 8, 4, 16)).to(DTYPE)
    low = tl.reshape(low, (NB, C, 8, 4, 4, 2, 2))  # (nb, c, g, t, j, bh, bl): k = 64c + 16j + 8bh + 2t + bl
    high = tl.reshape(high, (NB, C, 8, 4, 4, 2, 2))
    both = tl.permute(tl.join(low, high), (0, 7, 2, 1, 4, 5, 3, 6))  # (nb, h, g, c, j, bh, t, bl)
    return tl.reshape(both, (NB * 16, C * 64))


_CHUNK_BYTES = tl.constexpr(512)  # one (16 rows, 64-wide K chunk) block of the data layout


@triton.jit
def load_fragment_tile(
    data_base,
    scale_base,
    blocks,
    k_start,
    num_chunks,
    live,
    EVEN_K: tl.constexpr,
    NB: tl.constexpr,
    C: tl.constexpr,
    SCALE: tl.constexpr,
    PACKED_DECODE: tl.constexpr,
    COMPUTE_DTYPE: tl.constexpr,
):
    """The decoded ``[NB * 16, C * 64]`` weights of fragment blocks ``blocks`` ``[NB]`` (of one expert's data and
    scales at ``data_base`` / ``scale_base``, ``num_chunks`` K chunks per block) at K ``k_start``: all zero codes under
    unit scales where ``live`` (``[1]``) is false, and with EVEN_K false in the chunks past the last."""
    S: tl.constexpr = 2 if SCALE == "e8m0" else 4  # scales per row and chunk
    chunks = k_start // 64 + tl.arange(0, C)
    data_offsets = (
        ((blocks[:, None] * num_chunks + chunks[None, :]) * _CHUNK_BYTES)[:, :, None, None, None]
        + (tl.arange(0, 8) * 64)[None, None, :, None, None]
        + (tl.arange(0, 4) * 16)[None, None, None, :, None]
        + tl.arange(0, 16)[None, None, None, None, :]
    )
    # one run of 2·S bytes per (block, chunk, g): one or two words a thread loads whole
    scale_offsets = (
        ((blocks[:, None] * num_chunks + chunks[None, :]) * (16 * S))[:, :, None, None]
        + (tl.arange(0, 8) * (2 * S))[None, None, :, None]
        + tl.arange(0, 2 * S)[None, None, None, :]
    )
    unit_scale: tl.constexpr = 127 if SCALE == "e8m0" else 0x38
    if EVEN_K:
        data = tl.load(data_base + data_offsets, mask=live, other=0)
        scales = tl.load(scale_base + scale_offsets, mask=live, other=unit_scale)
    else:  # chunks past K's last: zero codes under unit scales
        in_k = ((chunks < num_chunks) & live)[None, :]
        data = tl.load(data_base + data_offsets, mask=in_k[:, :, None, None, None], other=0)
        scales = tl.load(scale_base + scale_offsets, mask=in_k[:, :, None, None], other=unit_scale)
    return decode_fragment_tile(data, scales, NB, C, PACKED_DECODE, COMPUTE_DTYPE, SCALE)  # bf16 whenever packed


class HopperLayout(Layout):
    """MXFP4 and NVFP4 data and scales in wgmma's register-fragment order (see the module), at least 2 dims; the
    tensor carries its logical shape ``[..., N, K]``, weight rows are addressed in blocks of 16."""

    name = "hopper"
    min_dims = 2
    formats = frozenset(("mxfp4", "nvfp4"))
    rearranges_data = True
    rows_per_block = FRAGMENT_ROWS

    def check_dims(self, x) -> None:
        shape = x.logical_shape
        if not self.holds(x.format):
            raise ValueError(
                f"logical_shape goes with scale_layout={self!r}, which holds "
                f"{' and '.join(sorted(self.formats))}; got {x.format} with "
                f"scale_layout={x.scale_layout!r}"
            )
        if (
            not isinstance(shape, tuple)
            or len(shape) < self.min_dims
            or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
        ):
            raise ValueError(
                f"the {self} layout needs logical_shape, a tuple of >= 2 non-negative ints [..., N, K], got {shape!r}"
            )
        if x.group_offsets is not None or x.group_scale_offsets is not None:
            raise ValueError(f"group offsets go with 128x4 scales, not the {self} layout")

    def data_shape(self, shape: tuple) -> tuple:
        """The fragment data's shape for logical shape ``[..., N, K]``."""
        *lead, n, k = shape
        return (*lead, -(-n // FRAGMENT_ROWS), -(-k // FRAGMENT_K), 8, 4, 16)

    def scale_shape(self, shape: tuple, block: int) -> tuple:
        *lead, n, k = shape
        return (*lead, -(-n // FRAGMENT_ROWS), -(-k // FRAGMENT_K), 8, 2, fragment_scales_per_chunk(block))

    def check_scales(self, x) -> None:
        data_shape, scale_shape = self.data_shape(x.logical_shape), self.scale_shape(x.logical_shape, x.spec.block)
        if tuple(x.data.shape) != data_shape or tuple(x.scales.shape) != scale_shape:
            raise ValueError(
                f"{self}-layout data and scales of shapes {tuple(x.data.shape)} and "
                f"{tuple(x.scales.shape)} do not fit logical shape {x.logical_shape} (expected "
                f"{data_shape} and {scale_shape})"
            )

    def pack(self, data, scales, spec, shape, group_offsets=None) -> Packed:
        if not self.holds(spec.name) or len(shape) < self.min_dims or group_offsets is not None:
            raise ValueError(
                f"the {self} layout holds {' and '.join(sorted(self.formats))} tensors of at least "
                f"{self.min_dims} dims without group offsets, got {spec.name} of shape {tuple(shape)}"
            )
        fragment_data, fragment_scales = to_hopper_fragments(data, scales, spec.block, spec.scale_one_bits)
        return Packed(fragment_data, fragment_scales.view(spec.scale_dtype), logical_shape=tuple(shape))

    def unpack(self, x):
        *_, n, k = x.shape
        data, scales = from_hopper_fragments(x.data.view(torch.uint8), x.scales.view(torch.uint8), n, k)
        return data.view(x.spec.data_dtype), scales.view(x.spec.scale_dtype)


HOPPER = HopperLayout()
