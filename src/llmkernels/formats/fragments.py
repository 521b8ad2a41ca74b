"""MXFP4 and NVFP4 weights in Hopper's wgmma register-fragment order: a one-time, exact rearrangement of the
bytes of an e2m1 tensor and its scales (e8m0 per 32 or e4m3 per 16), so that a kernel that loads 16 bytes per thread holds exactly its part of
wgmma's A operand once decoded in registers (no shared-memory round trip between decode and MMA).

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

N is padded to 16 and K to 64 with zero codes and unit scales (``scale_fill``: 127 for e8m0, 0x38 for e4m3). A ScaledTensor holds it as
``scale_layout="hopper"`` (:meth:`llmkernels.ScaledTensor.to_layout`); the grouped matmul's Hopper kernel
(``grouped_matmul/hopper_kernel.py``) reads it.
"""
from __future__ import annotations

import torch

__all__ = ["SLOT_BITS", "FRAGMENT_ROWS", "FRAGMENT_K", "fragment_scales_per_chunk", "to_hopper_fragments",
           "from_hopper_fragments"]

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
    out[..., :t.shape[-2], :t.shape[-1]] = t
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


def to_hopper_fragments(data: torch.Tensor, scales: torch.Tensor, block: int = 32,
                        scale_fill: int = 127) -> tuple[torch.Tensor, torch.Tensor]:
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


def from_hopper_fragments(fragment_data: torch.Tensor, fragment_scales: torch.Tensor, n: int,
                          k: int) -> tuple[torch.Tensor, torch.Tensor]:
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
    scales = scales.reshape(*lead, nb * FRAGMENT_ROWS, kc * per_chunk)[..., :n, :k * per_chunk // FRAGMENT_K]
    return data.contiguous(), scales.contiguous()
