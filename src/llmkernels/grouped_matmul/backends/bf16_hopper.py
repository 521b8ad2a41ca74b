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

from ...runtime import cdiv, cuda_capability, interpreting, num_programs_hint
from .. import gluon_fp8_kernel as kernel
from .base import pointer_types
from .fp8_hopper import EPILOGUES, HopperWsSpec, descriptor_type

__all__ = ["supports", "upcast_dtype", "kernel_spec", "scalars", "STAGES"]

STAGES = 4
_GL_DTYPES = {torch.bfloat16: kernel.gl.bfloat16, torch.float16: kernel.gl.float16, torch.float32: kernel.gl.float32}


def supports(call, config) -> bool:
    """Plain bf16 or fp16 ``a`` and ``b`` (one dtype) on a CUDA device of compute capability 9.x (not the
    interpreter); a launch for large groups: not ``ab_swapped``, ``block_m`` >= 128; K a multiple of 8 (TMA reads
    16-byte rows); an epilogue of :data:`EPILOGUES`, SwiGLU on ``[gate | up]`` halves with ``N / 2`` a multiple of
    128, not interleaved."""
    a, b = call.a, call.b
    if a.quantized or b.quantized or a.element not in ("bf16", "fp16") or b.element != a.element:
        return False
    if call.device.type != "cuda" or interpreting() or (cuda_capability(call.device) or (0, 0))[0] != 9:
        return False
    if config.ab_swapped or config.block_m < kernel.BLOCK_M or call.k % 8:
        return False
    if call.epilogue_kind not in EPILOGUES:
        return False
    return call.epilogue_kind != "swiglu" or (not call.glu.interleaved and call.n_out % 128 == 0)


def upcast_dtype(call, config):
    """None: the kernel reads A as it is."""
    return None


def kernel_spec(call, config, group_rows: tuple[int, int]) -> HopperWsSpec:
    """The kernel's launch for ``call``: a persistent grid of ``min(SMs, tile bound)`` programs; ``config`` only
    selects this backend (the tile is the kernel's own)."""
    glu = call.glu
    swiglu = call.epilogue_kind == "swiglu"
    n_tiles = cdiv(call.n_out, kernel.out_columns_per_tile(swiglu))
    bound = (cdiv(call.num_tokens, kernel.BLOCK_M) + call.num_groups) * n_tiles
    element = _GL_DTYPES[torch.bfloat16 if call.a.element == "bf16" else torch.float16]
    a_box, b_box = kernel.boxes(element)
    constexprs = dict(
        STAGES=STAGES,
        HAS_EXPERT_SCALES=call.has_expert_scales,
        HAS_BIAS=call.has_bias,
        EPILOGUE=call.epilogue_kind,
        EPILOGUE_FN=call.epilogue_fn,
        GLU_ALPHA=glu.alpha if swiglu else 1.0,
        GLU_LIMIT=glu.limit if swiglu else None,
        GLU_UP_SHIFT=glu.up_shift if swiglu else 0.0,
        TMA_STORE=False,
    )
    arg_types = dict(pointer_types(call))
    arg_types.update(
        a_ptr=descriptor_type(element, a_box),
        b_ptr=descriptor_type(element, b_box),
        a_scales_ptr="*fp32",
        b_scales_ptr="*fp32",
        out_desc=descriptor_type(_GL_DTYPES[call.out_dtype], kernel.OUT_BOX),
    )
    return HopperWsSpec(
        kernel.fp8_hopper_grouped_kernel,
        (max(1, min(bound, num_programs_hint(call.device))),),
        constexprs,
        dict(num_warps=4, maxnreg=kernel.MAX_REGS),
        arg_types,
        unaligned=(
            "num_groups",
            "n_tiles",
            "N_out",
            "num_tokens",
            "stride_bias_expert",
            "min_group_rows",
            "max_group_rows",
        ),
    )


def scalars(call, config, group_rows: tuple[int, int], tensors: dict) -> tuple:
    """The kernel's strides and sizes after ``out_desc`` (the scale strides, unread, are 0)."""
    return (
        0,
        0,
        0,
        0,
        0,
        tensors["out"].stride(0),
        tensors["bias"].stride(0) if call.has_bias else 0,
        call.num_tokens,
        call.num_groups,
        call.num_experts,
        call.n,
        call.n_out,
        call.k,
        cdiv(call.n_out, kernel.out_columns_per_tile(call.epilogue_kind == "swiglu")),
        *group_rows,
    )
