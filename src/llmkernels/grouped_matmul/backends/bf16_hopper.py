"""The ``bf16_hopper`` backend: the warp-specialized Gluon kernel of ``fp8_hopper`` (``grouped_matmul/
gluon_fp8_kernel.py``) on plain bf16 / fp16 operands, for an sm_90 GPU.

Same schedule as for FP8 blocks (persistent grid, a TMA load warp, two consumer warpgroups of 64 rows sharing two
128-row B boxes): 128 x 256 tiles, K steps of 64 (one 128-byte row of 16-bit elements), wgmma accumulating straight
into the fp32 accumulators, 4 stages and 16-byte pointer stores in the epilogue (a TMA-store staging buffer would
leave room for 3 stages only). Measured on an H100 (CUDA-graph replay, ``lab/gluon_bf16``): 611-775 TFLOP/s on
the compute-bound shapes, 0.97-1.02x ``torch._grouped_mm`` and 1.15-1.21x the portable kernel's 128 x 256 x 64
tiles; 3 stages with the TMA-store epilogue measured 0.84-0.86x ``_grouped_mm``.

It takes the plain (not ``ab_swapped``) launches of 128-row tiles, the default for groups of more than 64 rows,
and leaves the decode tiles and what its kernel does not take (:func:`supports`) to the portable backend.
"""

from __future__ import annotations

import torch

from .fp8_hopper import (
    GL_DTYPES,
    HopperWsSpec,
    warp_specialized_launch,
    warp_specialized_scalars,
    warp_specialized_spec,
)

__all__ = ["supports", "upcast_dtype", "kernel_spec", "scalars", "STAGES"]

STAGES = 4


def supports(call, config) -> bool:
    """Plain bf16 or fp16 ``a`` and ``b`` (one dtype), in a launch the warp-specialized kernel takes
    (:func:`~llmkernels.grouped_matmul.backends.fp8_hopper.warp_specialized_launch`: sm_90, 128-row tiles not
    swapped, 16-byte rows of K, its epilogues)."""
    a, b = call.a, call.b
    if a.quantized or b.quantized or a.element not in ("bf16", "fp16") or b.element != a.element:
        return False
    return warp_specialized_launch(call, config, element_bytes=2)


def upcast_dtype(call, config):
    """None: the kernel reads A as it is."""
    return None


def kernel_spec(call, config, group_rows: tuple[int, int]) -> HopperWsSpec:
    """The kernel's launch for ``call``: a persistent grid of ``min(SMs, tile bound)`` programs; ``config`` only
    selects this backend (the tile is the kernel's own)."""
    element = GL_DTYPES[torch.bfloat16 if call.a.element == "bf16" else torch.float16]
    return warp_specialized_spec(call, element, STAGES, tma_store=False)


def scalars(call, config, group_rows: tuple[int, int], tensors: dict) -> tuple:
    """The kernel's strides and sizes after ``out_desc`` (the scale strides, unread, are 0)."""
    return warp_specialized_scalars(call, group_rows, tensors, (0, 0, 0, 0, 0))
