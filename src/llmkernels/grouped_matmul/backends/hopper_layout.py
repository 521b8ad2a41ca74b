"""The Hopper-layout backend: MXFP4 and NVFP4 weights in wgmma's register-fragment order
(:mod:`llmkernels.formats.layouts.hopper`), read by ``grouped_matmul/hopper_kernel.py`` (each thread's 16 bytes
decode to its part of the MMA's register operand). Activations are bf16, or quantized ones decoded ahead; the
product is always swapped and the grid not persistent. :func:`kernel_spec` also plans the kernel's fp8 ``(1, 128)``
mode (A's e4m3 tiles and float32 scales read as they are) for the ``w4a8_decode`` backend."""

from __future__ import annotations

from ...launch import KernelSpec
from ...runtime import cdiv
from .. import config as gm_config
from ..hopper_kernel import hopper_fp4_matmul_kernel
from .base import compute_torch_dtype, epilogue_constexprs, pointer_types
from .portable import UNALIGNED

__all__ = ["supports", "upcast_dtype", "kernel_spec", "scalars"]


def supports(call, config) -> bool:
    """Weights in a layout that rearranges the data into fragments (the checks took the rest of the call)."""
    return call.b.scale_layout.rearranges_data


def upcast_dtype(call, config):
    """The compute dtype for a quantized A (the kernel reads A plain), else None; None for fp8 ``(1, 128)``
    activations too (float32 scales: the kernel's fp8 mode reads them as they are)."""
    return compute_torch_dtype(call) if call.a.quantized and not _fp8_blocks(call) else None


def _fp8_blocks(call) -> bool:
    return call.a.scale == "f32"


def kernel_spec(call, config, group_rows: tuple[int, int]) -> KernelSpec:
    """One program per output tile of the launch's (group, M tile) pairs and weight columns, over an upper bound
    of those pairs: each holds at least one of the T rows, and there are at most ``cdiv(T, block_m)`` plus one per
    group of this launch's size class, of which there are at most ``T / (min_rows + 1)``. The programs past the
    last return at once, but an empty class launched over ``cdiv(T, block_m) + G`` tiles cost 15 us (E128 x 1
    token, H100). fp8 ``(1, 128)`` activations (float32 scales) take the kernel's A_FP8_BLOCKS mode, whose K step
    is one scale block of A: ``config.block_k`` must be 128.

    Raises:
        ValueError: fp8 ``(1, 128)`` activations under a ``block_k`` other than 128."""
    min_rows, _ = group_rows
    fp8_blocks = _fp8_blocks(call)
    if fp8_blocks and config.block_k != 128:
        raise ValueError(f"config: fp8 (1, 128) activations take block_k=128 on Hopper-layout weights, got {config}")
    dtype = gm_config.compute_dtype(call.a.element)
    class_groups = call.num_groups if min_rows < 0 else min(call.num_groups, call.num_tokens // (min_rows + 1))
    m_tiles = min(cdiv(call.num_tokens, config.block_m) + class_groups, call.num_tokens)
    grid = (m_tiles * cdiv(call.n_out, config.block_n),)
    constexprs = dict(
        B_SCALE=call.b.scale,
        A_FP8_BLOCKS=fp8_blocks,
        A_GLOBAL_SCALE=call.a.has_global_scale,
        B_GLOBAL_SCALE=call.b.has_global_scale,
        **epilogue_constexprs(call, interleaved_rows=False),
        EVEN_K=call.k % config.block_k == 0,
        PACKED_DECODE=gm_config.packed_decode(dtype, call.device),
        RETIRE_MMA=gm_config.retires_mma(call.device, True),
        COMPUTE_DTYPE=dtype,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        BLOCK_GROUPS=gm_config.block_groups(call.num_groups),
    )
    return KernelSpec(
        hopper_fp4_matmul_kernel,
        grid,
        constexprs,
        dict(num_warps=config.num_warps, num_stages=config.num_stages),
        arg_types=pointer_types(call, upcast_dtype(call, config)),
        # A's scale strides count 128-wide blocks of K
        unaligned=(*UNALIGNED, "stride_a_scale_row", "stride_a_scale_k") if fp8_blocks else UNALIGNED,
    )


def scalars(call, config, group_rows: tuple[int, int], tensors: dict) -> tuple:
    """Strides and sizes, then A's scales' both strides (the fp8 mode's; else 0)."""
    a_scales = tensors["a_scales"] if _fp8_blocks(call) else None
    return (
        tensors["a"].stride(0),
        tensors["b"].stride(0),
        tensors["b_scales"].stride(0),
        tensors["out"].stride(0),
        tensors["bias"].stride(0) if call.has_bias else 0,
        call.num_tokens,
        call.num_groups,
        call.num_experts,
        call.n,
        call.k,
        *group_rows,
        a_scales.stride(0) if a_scales is not None else 0,
        a_scales.stride(1) if a_scales is not None else 0,
    )
