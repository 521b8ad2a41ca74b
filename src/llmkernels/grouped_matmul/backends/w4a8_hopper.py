"""The ``w4a8_hopper`` backend: the warp-specialized Gluon kernel for fp8 ``block=(1, 128)`` activations with MXFP4
weights on Hopper's FP8 tensor cores (``grouped_matmul/gluon_w4a8_kernel.py``), on an sm_90 GPU.

It takes the plain (not ``ab_swapped``) launches of 64- and 128-row tiles, the defaults for groups of more than 16
tokens (:data:`MIN_CLASS_ROWS`), with the plain epilogue: no bias, no ``expert_scales``, bf16 out, row-layout weights with N a multiple of 128 and K of 64,
int32 offsets (:func:`supports`); the ``w4a8_decode`` backend takes the default launches of the decode sizes (through
the weights' Hopper-layout copy) of up to 16 tokens and of 17-64 under other epilogues, the portable ``w4a8_blocks`` kernel every other launch (epilogues, bias, expert
scales, other shapes of large groups, configs the caller chose). Its own tile: 128 weight rows x 128 tokens x 128 K, 6
stages, a persistent grid of one program per SM, whatever the config's tile.

The kernel reads the weights through a copy prepared once per weight tensor
(:data:`~llmkernels.grouped_matmul.w4a8_prepare.W4A8_COPIES`: memory key, version counters, never during a CUDA
graph capture, freed with the weights). Where no copy is available at a call (during a capture before any copy was
made, ``W4A8_COPIES.enabled`` False, tensors without version counters) or the weights are not exact in the kernel's
e4m3 decode (a row whose exponents spread by more than 14 binades), the launch runs the portable kernel instead:
the same result up to the fp32 summation order, never rounded weights.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from ...formats.layouts import ROW
from ...launch import KernelSpec, bind
from ...runtime import cdiv, cuda_capability, interpreting, num_programs_hint
from .. import gluon_w4a8_kernel as kernel
from ..w4a8_prepare import W4A8_COPIES
from . import w4a8_blocks
from .base import pointer_types
from .fp8_hopper import dense_copy, tma_readable

__all__ = ["supports", "upcast_dtype", "kernel_spec", "scalars", "W4A8HopperSpec", "W4A8HopperLaunch", "TOKENS"]

TOKENS = 128  # tokens per tile (wgmma's N)
# The launches of 64-row tiles (groups of 17-64 tokens) too: its 128-token tiles, half empty there, ran E128 x 64
# tokens (N 4096, K 7168) in 1590 us on an H100 against 2412 for the Hopper-layout kernel's fp8 mode (w4a8_decode)
# on 64 x 64 tiles and 1401 for bf16 x MXFP4; E32 x 64 (N 5760, K 2880) 272 / 370 / 212 us.
MIN_CLASS_ROWS = 64
STAGES = 6  # the TMA ring's depth (24 KB a stage: 16 KB of activations, 8 KB of packed weights)
_A_BOX = [TOKENS, 64]


def supports(call, config) -> bool:
    """The w4a8 pair (:func:`~.w4a8_blocks.takes`) with row-layout weights on a CUDA device of compute capability
    9.x (not the interpreter); a launch of at least 64-row tiles, not ``ab_swapped`` (the defaults for groups of more
    than 16 tokens); the plain epilogue without bias or expert scales, bf16 out; N a multiple of 128, K of 64; int32
    offsets."""
    if not w4a8_blocks.takes(call.a, call.b) or call.b.scale_layout is not ROW:
        return False
    if call.device.type != "cuda" or interpreting() or (cuda_capability(call.device) or (0, 0))[0] != 9:
        return False
    if config.ab_swapped or config.block_m < MIN_CLASS_ROWS:
        return False
    return (
        call.epilogue_kind == "none"
        and not call.has_bias
        and not call.has_expert_scales
        and call.out_dtype == torch.bfloat16
        and call.n % kernel.BLOCK_W == 0
        and call.k % 64 == 0
        and call.offsets_dtype == torch.int32
    )


def upcast_dtype(call, config):
    """None: the kernel reads A's e4m3 tiles as they are."""
    return None


def _descriptor_types() -> dict:
    a_layout, w_layout = kernel.a_layout_shared(_A_BOX), kernel.w_layout_shared()
    return dict(
        a_ptr=f"tensordesc<fp8e4nv[{', '.join(map(str, _A_BOX))}],{a_layout!r}>",
        b_ptr=f"tensordesc<i32[{', '.join(map(str, kernel.W_BOX))}],{w_layout!r}>",
    )


def kernel_spec(call, config, group_rows: tuple[int, int]) -> W4A8HopperSpec:
    """A persistent grid of ``min(SMs, tile bound)`` programs; the portable launch of the same config for the calls
    the prepared copy cannot take."""
    n_tiles = call.n // kernel.BLOCK_W
    bound = (cdiv(call.num_tokens, TOKENS) + call.num_groups) * n_tiles
    types = dict(
        pointer_types(call),
        **_descriptor_types(),
        b_scales_ptr="*i32",  # the prepared tables
        b_global_scale_ptr="*fp32",  # the prepared row factors
        out_ptr="*bf16",
    )
    return W4A8HopperSpec(
        kernel.w4a8_hopper_kernel,
        (max(1, min(bound, num_programs_hint(call.device))),),
        dict(STAGES=STAGES, STEP_REFERENCE=False),
        dict(num_warps=4, maxnreg=kernel.MAX_REGS),
        arg_types=types,
        unaligned=(
            "stride_a_scale_row",
            "stride_a_scale_k",
            "num_tokens",
            "num_groups",
            "num_experts",
            "n_tiles",
            "min_group_rows",
            "max_group_rows",
        ),
        call=call,
        config=config,
        group_rows=group_rows,
    )


def scalars(call, config, group_rows: tuple[int, int], tensors: dict) -> tuple:
    """Strides of out and A's scales, sizes, the size class's group rows (the portable fallback computes its own)."""
    a_scales = tensors["a_scales"]
    return (
        tensors["out"].stride(0),
        a_scales.stride(0),
        a_scales.stride(1),
        call.num_tokens,
        call.num_groups,
        call.num_experts,
        call.n,
        call.k,
        call.n // kernel.BLOCK_W,
        *group_rows,
    )


@dataclass(frozen=True)
class W4A8HopperSpec(KernelSpec):
    """The Gluon kernel's :class:`~llmkernels.launch.KernelSpec`, with the call, config and size class its portable
    fallback is planned from. :meth:`bind` takes the plan's arguments (the call's tensors for the kernel's
    ``*_ptr`` arguments, then :func:`scalars`) and returns a :class:`W4A8HopperLaunch`."""

    call: object = field(default=None, compare=False)
    config: object = None
    group_rows: tuple = ()

    def bind(self, *args) -> W4A8HopperLaunch:
        return W4A8HopperLaunch(self, args[8:])


class W4A8HopperLaunch:
    """The bound launch of one plan, called with the call's tensors in the order of the kernel's ``*_ptr``
    arguments: the Gluon kernel on the prepared copy of ``b`` where there is one, else the portable kernel. Each is
    bound (compiled) at its first use."""

    def __init__(self, spec: W4A8HopperSpec, sizes: tuple):
        self.spec, self.sizes = spec, sizes
        self.gluon = self.portable = None

    def __call__(self, a, b, a_scales, b_scales, b_global_scale, out, a_offsets, expert_ids) -> None:
        call = self.spec.call
        prepared = W4A8_COPIES.get(b, b_scales, (call.num_experts, call.n, call.k))
        if prepared is None:
            self._portable(a, a_scales, b, b_scales, out, a_offsets, expert_ids)
            return
        if not tma_readable(a):  # a contiguous view at a misaligned address too: a fresh copy
            a = dense_copy(a)
        a = a.view(torch.float8_e4m3fn)
        k_padded = cdiv(call.k, 128) * 128
        weights = prepared.data.view(call.num_experts * (call.n // 16), k_padded // 32, 64)
        if self.gluon is None:
            spec = self.spec
            a_layout = kernel.a_layout_shared(_A_BOX)
            a_desc = TensorDescriptor(a, [call.num_tokens, call.k], [a.stride(0), 1], _A_BOX, a_layout)
            w_desc = TensorDescriptor(
                weights, list(weights.shape), [weights.stride(0), 64, 1], kernel.W_BOX, kernel.w_layout_shared()
            )
            self.gluon = bind(
                spec.fn,
                spec.grid,
                a_desc,
                w_desc,
                a_scales,
                prepared.tables,
                prepared.row_factors,
                out,
                a_offsets,
                expert_ids,
                *self.sizes,
                **spec.constexprs,
                **spec.options,
            )
        self.gluon(a, weights, a_scales, prepared.tables, prepared.row_factors, out, a_offsets, expert_ids)

    def _portable(self, a, a_scales, b, b_scales, out, a_offsets, expert_ids) -> None:
        dummy = a_offsets  # for the expert scales and bias this launch never has
        tensors = (a, a_scales, b, b_scales, out, a_offsets, expert_ids, dummy, dummy)
        if self.portable is None:
            spec = self.spec
            self.portable = w4a8_blocks.bound_fallback(spec.call, spec.config, spec.group_rows, tensors)
        self.portable(*tensors)

    def __repr__(self) -> str:
        return f"W4A8HopperLaunch(gluon={self.gluon!r}, portable={self.portable!r})"
