"""V transposed in memory for the FP8 prefill: keys contiguous, in the order its P operand holds them.

The e4m3 ``P V`` wgmma takes V as a K-major B operand, ``V^T`` with keys contiguous. The FP8 prefill's producer
warps transpose each V tile in shared memory, once per work tile that reads it: every query block and every q head
of a KV group reads (and transposes) the same tile again. :func:`transposed_v` transposes V once, in one pass over
HBM, so that the kernel TMA-loads ``V^T`` tiles as they are. Ablation on an H200 (4 x 16 x 4096 x 128, e4m3,
graph replay): the kernel with the producer's transpose removed ran 748 -> 875 TFLOP/s full and 660 -> 746 causal.
With this pass inside the timed call, on an H100: 1.11x full and 1.07x causal there, 1.17x at D 256 causal, 1.02x
at D 64 (16 reads per KV head); 0.97x at 8 reads, 0.81x at 2 (lab/fp8_prefill_ablation), hence the prefill's rule
:func:`gluon_fp8_prefill.transposes_v`.

Within each block of 32 keys, column ``x`` of the result holds key ``sigma(x)`` (``x = 32b + 16h + 4c + 2e + p``,
``sigma(x) = 32b + 16h + 8e + 2c + p``): the order in which the wgmma's register A operand takes the probabilities
that the S accumulator gives each thread (:func:`gluon_fp8_prefill._to_operand`), so that P needs no shuffle.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import runtime

__all__ = ["transposed_v", "KEY_ALIGN"]

KEY_ALIGN = 32  # keys are padded to a multiple of the permutation's block (and TMA's 16-byte row alignment)
_BLOCK_KEYS = 64
_BLOCK_DIMS = 64


@triton.jit
def _transposed_v_kernel(
    v_ptr,
    out_ptr,
    seqlen,
    padded,
    num_kv_heads,
    stride_b,
    stride_s,
    stride_h,
    stride_d,
    HEAD_DIM: tl.constexpr,
    BLOCK_KEYS: tl.constexpr,
    BLOCK_DIMS: tl.constexpr,
):
    """Program (key block, dim block, batch x KV head): ``out[b, h * D + d, x] = v[b, sigma(x), h, d]``, zero for
    ``sigma(x) >= seqlen``; ``out`` ``[B, Hkv * D, padded]`` contiguous (bytes)."""
    columns = tl.program_id(0) * BLOCK_KEYS + tl.arange(0, BLOCK_KEYS)
    dims = tl.program_id(1) * BLOCK_DIMS + tl.arange(0, BLOCK_DIMS)
    batch = tl.program_id(2) // num_kv_heads
    head = tl.program_id(2) % num_kv_heads
    within = columns % 32
    keys = columns - within + within % 2 + (within // 2 % 2) * 8 + (within // 4 % 4) * 2 + (within // 16) * 16
    source = (
        v_ptr
        + batch.to(tl.int64) * stride_b
        + head.to(tl.int64) * stride_h
        + keys.to(tl.int64)[:, None] * stride_s
        + dims.to(tl.int64)[None, :] * stride_d
    )
    values = tl.load(source, mask=(keys < seqlen)[:, None], other=0)
    rows = (batch * num_kv_heads + head).to(tl.int64) * HEAD_DIM + dims
    target = out_ptr + rows[:, None] * padded + columns.to(tl.int64)[None, :]
    tl.store(target, tl.trans(values), mask=(columns < padded)[None, :])


def transposed_v(v: torch.Tensor) -> torch.Tensor:
    """``v`` float8_e4m3fn ``[B, S, Hkv, D]`` (any strides; D a multiple of 64) -> float8_e4m3fn ``[B, Hkv * D,
    S']`` contiguous, ``S' = cdiv(S, 32) * 32``: row ``h * D + d`` of sequence b holds dim d of KV head h over the
    keys, permuted within each 32-key block as the module docstring says, keys past S zero. One kernel, no host
    sync (CUDA-graph capturable)."""
    batch, seqlen, heads, head_dim = v.shape
    padded = triton.cdiv(seqlen, KEY_ALIGN) * KEY_ALIGN
    out = runtime.new_buffer((batch, heads * head_dim, padded), torch.float8_e4m3fn, v.device)
    if out.numel():  # moved as bytes: the interpreter has no e4m3 loads
        grid = (triton.cdiv(padded, _BLOCK_KEYS), head_dim // _BLOCK_DIMS, batch * heads)
        _transposed_v_kernel[grid](
            v.view(torch.uint8),
            out.view(torch.uint8),
            seqlen,
            padded,
            heads,
            *v.stride(),
            HEAD_DIM=head_dim,
            BLOCK_KEYS=_BLOCK_KEYS,
            BLOCK_DIMS=_BLOCK_DIMS,
        )
    return out
