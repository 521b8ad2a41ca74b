"""The portable backend: the persistent grouped kernel (``grouped_matmul/kernel.py``) with ``tl.dot`` on tiles
decoded in registers (on Hopper the decoded weights are wgmma's register operand under swap-AB), a quantized A
read as it is or decoded ahead (``config.upcast_a``). It takes every call the other backends leave, on any GPU and
in the interpreter."""

from __future__ import annotations

from ...launch import KernelSpec
from ...runtime import cdiv, num_programs_hint
from .. import config as gm_config
from ..kernel import grouped_matmul_kernel
from .base import compute_torch_dtype, epilogue_constexprs, pointer_types, read_a

__all__ = ["supports", "upcast_dtype", "kernel_spec", "scalars", "grouped_kernel_spec", "grouped_kernel_scalars"]

# what the grouped kernel's compile assumes of its integer arguments: all divisible by 16 but these
UNALIGNED = ("num_groups", "min_group_rows")


def supports(call, config) -> bool:
    """Every call whose scale layouts the grouped kernel addresses (A's rows of tokens, B's rows of experts), fp8
    blocks (float32 scales, the ``fp8_blocks`` backend's) aside."""
    return (
        call.b.scale != "f32"
        and call.a.scale_layout.token_scale_rows is not None
        and call.b.scale_layout.expert_scale_rows is not None
    )


def upcast_dtype(call, config):
    """The compute dtype when the launch decodes a quantized A ahead (``config.upcast_a``), else None."""
    return compute_torch_dtype(call) if gm_config.takes_upcast(config, call.a) else None


def kernel_spec(call, config, group_rows: tuple[int, int]) -> KernelSpec:
    return grouped_kernel_spec(call, config, group_rows, use_dot_scaled=False, upcast=upcast_dtype(call, config))


def scalars(call, config, group_rows: tuple[int, int], tensors: dict) -> tuple:
    return grouped_kernel_scalars(call, group_rows, read_a(call, upcast_dtype(call, config)), tensors)


def grouped_kernel_spec(call, config, group_rows: tuple[int, int], use_dot_scaled: bool, upcast) -> KernelSpec:
    """The grouped kernel's launch over the groups of ``group_rows``: a persistent grid of one program per SM (or
    ``config.num_programs``, at most one per tile), ``tl.dot_scaled`` where ``use_dot_scaled``, A decoded ahead to
    ``upcast`` (a torch dtype) or read as given (None)."""
    a, b, device = read_a(call, upcast), call.b, call.device
    dtype = gm_config.compute_dtype(call.a.element)
    max_tiles = (cdiv(call.num_tokens, config.block_m) + call.num_groups) * cdiv(call.n_out, config.block_n)
    num_programs = min(config.num_programs or num_programs_hint(device), max_tiles)
    decoded_left_operand = (b if config.ab_swapped else a).element not in ("bf16", "fp16")  # the MMA's left operand
    constexprs = dict(
        A_ELEMENT=a.element,
        A_SCALE=a.scale,
        A_SCALE_BLOCK=a.scale_block,
        A_SCALE_ROWS=a.scale_layout.token_scale_rows,
        A_SCALE_COLS=a.scale_layout.scale_cols,
        A_SCALES_MAY_MISS=a.scale_layout.rows_may_miss_scales,
        B_ELEMENT=b.element,
        B_SCALE=b.scale,
        B_SCALE_BLOCK=b.scale_block,
        B_SCALE_ROWS=b.scale_layout.expert_scale_rows,
        B_SCALE_COLS=b.scale_layout.scale_cols,
        A_GLOBAL_SCALE=call.a.has_global_scale,
        B_GLOBAL_SCALE=b.has_global_scale,
        **epilogue_constexprs(call),
        USE_DOT_SCALED=use_dot_scaled,
        SWAP_AB=config.ab_swapped,
        PREFETCH_SCALES=config.prefetch_scales,
        SCALE_WORDS=(
            config.scale_words
            and gm_config.reads_scale_words(a, config.block_k, call.k)
            and gm_config.reads_scale_words(b, config.block_k, call.k)
        ),
        PACKED_DECODE=gm_config.packed_decode(dtype, device),
        RETIRE_MMA=gm_config.retires_mma(device, decoded_left_operand),
        COMPUTE_DTYPE=dtype,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        BLOCK_GROUPS=gm_config.block_groups(call.num_groups),
    )
    return KernelSpec(
        grouped_matmul_kernel,
        (num_programs,),
        constexprs,
        dict(num_warps=config.num_warps, num_stages=config.num_stages),
        arg_types=pointer_types(call, upcast),
        unaligned=UNALIGNED,
    )


def grouped_kernel_scalars(call, group_rows: tuple[int, int], a, tensors: dict) -> tuple:
    """The grouped kernel's strides and sizes for ``tensors`` (A as read: ``a``); a stride the layout does not
    read is 0."""
    a_data, a_scales, b_data, b_scales = tensors["a"], tensors["a_scales"], tensors["b"], tensors["b_scales"]
    a_row_scales = a.quantized and a.scale_layout.strided
    b_row_scales = call.b.quantized and call.b.scale_layout.strided
    return (
        a_data.stride(0),
        a_scales.stride(0) if a_row_scales else 0,
        b_data.stride(0),
        b_data.stride(1),
        b_scales.stride(0) if b_row_scales else 0,
        b_scales.stride(1) if b_row_scales else 0,
        tensors["out"].stride(0),
        tensors["bias"].stride(0) if call.has_bias else 0,
        call.num_tokens,
        call.num_groups,
        call.num_experts,
        call.n,
        call.k,
        *group_rows,
        a_scales.shape[0] if a.scale_layout.grouped else 0,
    )
