"""The portable w4a8 backend: ``grouped_matmul/w4a8_kernel.py`` on fp8 ``block=(1, 128)`` activations and MXFP4
weights (row or 128x4 scales), plain or swap-AB, A's e4m3 tile and B's decoded tile in bf16 (exact) with per-step
promotion by A's scales in fp32. Any GPU with e4m3 conversions (sm_89+) and the interpreter; on sm_90 the launches
that ``w4a8_hopper`` and ``w4a8_decode`` do not take, and theirs where the weights have no copy for them."""

from __future__ import annotations

from ...launch import BoundKernel, KernelSpec
from .. import config as gm_config
from ..w4a8_kernel import w4a8_matmul_kernel
from .base import epilogue_constexprs, pointer_types
from .fp8_blocks import max_tiles

__all__ = ["supports", "upcast_dtype", "kernel_spec", "scalars", "takes", "bound_fallback", "UNALIGNED"]

# what the kernel's compile assumes of its integer arguments: all divisible by 16 but these (A's scale strides
# count 128-wide blocks of K; B's row stride K / 2 bytes may be 16 for K = 32)
UNALIGNED = ("stride_a_scale_row", "stride_a_scale_k", "stride_b_scale_row", "num_groups", "min_group_rows")


def takes(a, b) -> bool:
    """Whether operands ``a`` and ``b`` (:class:`~llmkernels.grouped_matmul.check.Operand`) are the w4a8 pair: fp8
    ``(1, 128)`` activations (float32 scales) with MXFP4 weights."""
    return a.format == "fp8" and a.block_rows == 1 and b.format == "mxfp4"


def supports(call, config) -> bool:
    """The w4a8 pair with B's scales in a layout of expert rows (row or 128x4; the checks refuse the others)."""
    return takes(call.a, call.b) and call.b.scale_layout.expert_scale_rows is not None


def upcast_dtype(call, config):
    """None: the kernel reads A's e4m3 tiles as they are."""
    return None


def kernel_spec(call, config, group_rows: tuple[int, int]) -> KernelSpec:
    """One program per tile of :func:`~.fp8_blocks.max_tiles` (``config.num_programs`` None), or a persistent grid
    of ``config.num_programs`` programs when fewer."""
    tiles = max_tiles(call, config, group_rows)
    programs = tiles if config.num_programs is None else min(config.num_programs, tiles)
    dtype = gm_config.compute_dtype(call.a.element)
    constexprs = dict(
        B_SCALE_ROWS=call.b.scale_layout.expert_scale_rows,
        B_SCALE_COLS=call.b.scale_layout.scale_cols,
        **epilogue_constexprs(call),
        SWAP_AB=config.ab_swapped,
        PACKED_DECODE=gm_config.packed_decode(dtype, call.device),
        COMPUTE_DTYPE=dtype,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        BLOCK_GROUPS=gm_config.block_groups(call.num_groups),
    )
    return KernelSpec(
        w4a8_matmul_kernel,
        (programs,),
        constexprs,
        dict(num_warps=config.num_warps, num_stages=config.num_stages),
        arg_types=pointer_types(call),
        unaligned=UNALIGNED,
    )


def scalars(call, config, group_rows: tuple[int, int], tensors: dict) -> tuple:
    """Strides (both strides of A's scales: row-major or token-major views alike; B's scale strides where its
    layout is strided, else 0) and sizes."""
    a_scales, b, b_scales = tensors["a_scales"], tensors["b"], tensors["b_scales"]
    row_scales = call.b.scale_layout.strided
    return (
        tensors["a"].stride(0),
        a_scales.stride(0),
        a_scales.stride(1),
        b.stride(0),
        b.stride(1),
        b_scales.stride(0) if row_scales else 0,
        b_scales.stride(1) if row_scales else 0,
        tensors["out"].stride(0),
        tensors["bias"].stride(0) if call.has_bias else 0,
        call.num_tokens,
        call.num_groups,
        call.num_experts,
        call.n,
        call.k,
        *group_rows,
    )


def bound_fallback(call, config, group_rows: tuple[int, int], tensors: tuple) -> BoundKernel:
    """This backend's launch of ``call`` under ``config`` bound to ``tensors`` (``(a, a_scales, b, b_scales, out,
    a_offsets, expert_ids, expert_scales, bias)``, its kernel's pointer order): what the Hopper backends run where
    the weights have no prepared copy."""
    a, a_scales, b, b_scales, out, _, _, _, bias = tensors
    named = dict(a=a, a_scales=a_scales, b=b, b_scales=b_scales, out=out, bias=bias)
    return kernel_spec(call, config, group_rows).bind(*tensors, *scalars(call, config, group_rows, named))
