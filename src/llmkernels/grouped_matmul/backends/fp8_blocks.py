"""The portable FP8-blocks backend: ``grouped_matmul/fp8_kernel.py`` on fp8 ``block=(1, 128)`` activations and fp8
``block=(128, 128)`` weights (DeepSeek-style checkpoints), plain or swap-AB, with per-128-K promotion of the e4m3
products in fp32. Any GPU with e4m3 ``tl.dot`` and the interpreter. bf16/fp16 activations reach it quantized to fp8
by the plan's pre-pass."""

from __future__ import annotations

from ...launch import KernelSpec
from ...runtime import cdiv
from .. import config as gm_config
from ..fp8_kernel import fp8_blocks_matmul_kernel
from .base import epilogue_constexprs, pointer_types

__all__ = ["supports", "upcast_dtype", "kernel_spec", "scalars", "UNALIGNED"]

# what the kernel's compile assumes of its integer arguments: all divisible by 16 but these (scale strides count
# 128-wide blocks of K and N)
UNALIGNED = (
    "stride_a_scale_row",
    "stride_a_scale_k",
    "stride_b_scale_expert",
    "stride_b_scale_row",
    "stride_b_scale_k",
    "num_groups",
    "min_group_rows",
)


def supports(call, config) -> bool:
    """fp8-block weights (float32 scales; the checks let them through with fp8 ``(1, 128)`` A only, the plan having
    quantized a plain A)."""
    return call.b.scale == "f32"


def upcast_dtype(call, config):
    """None: the kernel reads the e4m3 tiles as they are."""
    return None


def split_n(config) -> int:
    """Weight sub-tiles per tile: each at most 128 rows, so that it lies in one 128-row scale block."""
    return max(1, config.block_n // gm_config.FP8_BLOCK_K)


def uniform_scales(call, config) -> bool:
    """Whether every weight sub-tile's rows lie in one 128-row scale block (one scalar weight scale per K step): the
    rows of its output columns, or under SwiGLU its gate and up rows (interleaved: ``2 · sub_n`` rows of one block;
    ``[gate | up]`` halves: up rows that start a sub-tile apart, ``n_out`` a multiple of the sub-tile)."""
    sub_n = config.block_n // split_n(config)
    if call.epilogue_kind != "swiglu":
        return True
    if call.glu.interleaved:
        return 2 * sub_n <= gm_config.FP8_BLOCK_K
    return call.n_out % sub_n == 0


def max_tiles(call, config, group_rows: tuple[int, int]) -> int:
    """An upper bound of the launch's tiles from shapes: each (group, M tile) pair holds at least one of the T
    rows, and there are at most ``cdiv(T, block_m)`` plus one per group of this size class, of which there are at
    most ``T / (min_rows + 1)``; times the N tiles."""
    min_rows, _ = group_rows
    class_groups = call.num_groups if min_rows < 0 else min(call.num_groups, call.num_tokens // (min_rows + 1))
    m_tiles = min(cdiv(call.num_tokens, config.block_m) + class_groups, call.num_tokens)
    return max(1, m_tiles * cdiv(call.n_out, config.block_n))


def kernel_spec(call, config, group_rows: tuple[int, int]) -> KernelSpec:
    """One program per tile of :func:`max_tiles` (``config.num_programs`` None), or a persistent grid of
    ``config.num_programs`` programs when fewer."""
    tiles = max_tiles(call, config, group_rows)
    programs = tiles if config.num_programs is None else min(config.num_programs, tiles)
    constexprs = dict(
        **epilogue_constexprs(call),
        SWAP_AB=config.ab_swapped,
        EVEN_K=call.k % gm_config.FP8_BLOCK_K == 0,
        SPLIT_N=split_n(config),
        UNIFORM_SCALES=uniform_scales(call, config),
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        BLOCK_GROUPS=gm_config.block_groups(call.num_groups),
    )
    return KernelSpec(
        fp8_blocks_matmul_kernel,
        (programs,),
        constexprs,
        dict(num_warps=config.num_warps, num_stages=config.num_stages),
        arg_types=pointer_types(call),
        unaligned=UNALIGNED,
    )


def scalars(call, config, group_rows: tuple[int, int], tensors: dict) -> tuple:
    """Strides (every stride of both scale tensors: row-major or token-major views alike) and sizes."""
    a_scales, b, b_scales = tensors["a_scales"], tensors["b"], tensors["b_scales"]
    return (
        tensors["a"].stride(0),
        a_scales.stride(0),
        a_scales.stride(1),
        b.stride(0),
        b.stride(1),
        b_scales.stride(0),
        b_scales.stride(1),
        b_scales.stride(2),
        tensors["out"].stride(0),
        tensors["bias"].stride(0) if call.has_bias else 0,
        call.num_tokens,
        call.num_groups,
        call.num_experts,
        call.n,
        call.k,
        *group_rows,
    )
