"""The ``tl.dot_scaled`` backend: the persistent grouped kernel handing raw block-scaled tiles and their scales to
``tl.dot_scaled``, Blackwell's native block-scaled MMA (``tcgen05.mma`` with block scales, NVFP4 included); on
Hopper Triton upcasts them, which measured fastest for MX e2m1 weights (``config.resolve_mma`` says when)."""

from __future__ import annotations

import torch

from ...launch import KernelSpec
from .. import config as gm_config
from .base import read_a
from .portable import UNALIGNED, grouped_kernel_scalars, grouped_kernel_spec

__all__ = ["supports", "upcast_dtype", "kernel_spec", "scalars", "UNALIGNED"]


def _upcast(call, config):
    # tl.dot_scaled takes a bf16 operand (which holds A decoded ahead exactly)
    return torch.bfloat16 if gm_config.takes_upcast(config, call.a) else None


def supports(call, config) -> bool:
    """Block-scaled weights with activations of their family, or MX weights with bf16 activations (A as the kernel
    reads it), where :func:`~llmkernels.grouped_matmul.config.resolve_mma` takes ``tl.dot_scaled`` (it raises for
    ``mma="dot_scaled"`` on operands it cannot take)."""
    if call.b.scale_layout.expert_scale_rows is None or call.b.scale == "f32":  # fp8 blocks: not block-scaled MMA
        return False
    return gm_config.resolve_mma(config, read_a(call, _upcast(call, config)), call.b, call.device)


def upcast_dtype(call, config):
    """bf16 when the launch decodes a quantized A ahead (``config.upcast_a``), else None."""
    return _upcast(call, config)


def kernel_spec(call, config, group_rows: tuple[int, int]) -> KernelSpec:
    return grouped_kernel_spec(call, config, group_rows, use_dot_scaled=True, upcast=_upcast(call, config))


def scalars(call, config, group_rows: tuple[int, int], tensors: dict) -> tuple:
    return grouped_kernel_scalars(call, group_rows, read_a(call, _upcast(call, config)), tensors)
