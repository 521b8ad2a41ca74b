"""The ``w4a8_decode`` backend: fp8 ``block=(1, 128)`` activations with row-layout MXFP4 weights (w4a8) in the decode
sizes on an sm_90 GPU, through the weights' Hopper-layout copy and the Hopper-layout kernel
(``grouped_matmul/hopper_kernel.py``) in its fp8 mode: A's e4m3 tile converted to bf16 (exact), each 128-wide K
step's fp32 partial added to the accumulator times A's scales. The products are exact (e4m3 x e2m1 · 2^e): the
result is the portable ``w4a8_blocks`` kernel's up to the fp32 summation order.

It takes the launches of the default size classes of at most 64 tokens per group (:func:`supports`), every
epilogue, bias, expert scales and out dtype the Hopper-layout kernel has (interleaved SwiGLU rows through a copy
that holds them as ``[gate | up]`` halves, the bias de-interleaved alongside: a copy of ``[E, N]`` per launch, as
the bf16 calls' ``HOPPER_COPIES.substitute`` does), on the tiles
:func:`~llmkernels.grouped_matmul.config.hopper_config` gives the bf16 x MXFP4 Hopper-layout path for groups of the
launch's size, of at most 64 x 64 outputs (:func:`tile`; whatever the config's tile, as ``w4a8_hopper`` takes its own).

The weights are read through the copy :data:`~llmkernels.grouped_matmul.layout_cache.HOPPER_COPIES` keeps of them
(:meth:`~llmkernels.grouped_matmul.layout_cache.HopperCopies.get`, looked up at each launch; the layout cache's
rules: memory key, version counters, never made during a CUDA graph capture, freed with the weights, the same copy
bf16 calls on those weights read). Where there is none (during a capture before any copy was made,
``HOPPER_COPIES.enabled`` False, tensors without version counters), the launch runs the portable ``w4a8_blocks``
kernel on the row-layout weights with the launch's config instead. Memory: the copy is as large as the weights;
weights whose large groups ran ``w4a8_hopper`` also have its prepared copy (1.5x the weights):
``HOPPER_COPIES.enabled = False`` / ``W4A8_COPIES.enabled = False`` turn either off.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from ...formats.layouts import HOPPER, ROW
from ...launch import KernelSpec
from ...runtime import cuda_capability, interpreting
from .. import config as gm_config
from ..epilogue import deinterleave_gate_up
from ..layout_cache import HOPPER_COPIES
from . import hopper_layout, w4a8_blocks, w4a8_hopper

__all__ = ["supports", "upcast_dtype", "kernel_spec", "scalars", "tile", "W4A8DecodeSpec", "W4A8DecodeLaunch"]

MAX_GROUP_ROWS = 64  # the decode sizes: the default launches' tiles of at most 64 rows
MAX_TILE_ELEMENTS = 64 * 64  # outputs per tile of 4 warps (:func:`tile`)


def supports(call, config) -> bool:
    """The w4a8 pair (:func:`~.w4a8_blocks.takes`) with row-layout weights on a CUDA device of compute capability
    9.x (not the interpreter), in a launch ``w4a8_hopper`` does not take whose config is the default one of the
    groups of at most 64 tokens (:func:`~llmkernels.grouped_matmul.config.w4a8_config`'s 16- and 64-row tiles: a
    config the caller chose runs the portable kernel, as the layout cache's rules have it); SwiGLU halves of whole
    16-row blocks of the layout."""
    if not w4a8_blocks.takes(call.a, call.b) or call.b.scale_layout is not ROW:
        return False
    if call.device.type != "cuda" or interpreting() or (cuda_capability(call.device) or (0, 0))[0] != 9:
        return False
    if w4a8_hopper.supports(call, config) or config.block_m > MAX_GROUP_ROWS:
        return False
    swiglu = call.epilogue_kind == "swiglu"
    if config != gm_config.w4a8_config(config.block_m, 1, call.device, swiglu):
        return False
    return not swiglu or call.n % (2 * HOPPER.rows_per_block) == 0


def upcast_dtype(call, config):
    """None: the kernel reads A's e4m3 tiles as they are."""
    return None


def tile(call, config) -> gm_config.BlockScaledMatmulConfig:
    """The Hopper-layout kernel's tile for a launch under ``config``: :func:`~llmkernels.grouped_matmul.config.
    hopper_config`'s for groups of ``config.block_m`` tokens (the default launch's tile height is its size class's:
    16 or 64 rows), K steps of 128 (one scale block of A), at most :data:`MAX_TILE_ELEMENTS` outputs: the fp8 mode
    holds each step's fp32 partial beside the accumulator, and the plain 64-token tile of 128 weight rows spilled
    160 bytes a thread inside its MMA loop at sm_90a (Triton 3.9, 4 warps, 255 registers), 64 rows none (196
    registers; SwiGLU's 64 gate and 64 up rows none either). Not timed on a GPU."""
    chosen = gm_config.hopper_config(config.block_m, 1, call.device, call.epilogue_kind == "swiglu")
    assert chosen.block_k == 128, chosen  # the fp8 mode promotes once per scale block of A
    if chosen.block_m * chosen.block_n > MAX_TILE_ELEMENTS:
        chosen = dataclasses.replace(chosen, block_n=max(16, MAX_TILE_ELEMENTS // chosen.block_m))
    return chosen


def kernel_spec(call, config, group_rows: tuple[int, int]) -> W4A8DecodeSpec:
    """The Hopper-layout kernel's fp8 launch (:func:`.hopper_layout.kernel_spec` on :func:`tile`), with what its
    portable fallback is planned from."""
    spec = hopper_layout.kernel_spec(call, tile(call, config), group_rows)
    return W4A8DecodeSpec(
        spec.fn,
        spec.grid,
        spec.constexprs,
        spec.options,
        arg_types=spec.arg_types,
        unaligned=spec.unaligned,
        call=call,
        config=config,
        group_rows=group_rows,
    )


def scalars(call, config, group_rows: tuple[int, int], tensors: dict) -> tuple:
    """(): the launch takes the scalars of the kernel it runs from the tensors of its first call of that kernel
    (the Hopper-layout copy's strides are not the row-layout weights')."""
    return ()


@dataclass(frozen=True)
class W4A8DecodeSpec(KernelSpec):
    """The Hopper-layout kernel's :class:`~llmkernels.launch.KernelSpec` in its fp8 mode, with the call, config and
    size class the portable fallback is planned from. :meth:`bind` takes the plan's tensors for the kernel's
    ``*_ptr`` arguments and returns a :class:`W4A8DecodeLaunch`."""

    call: object = field(default=None, compare=False)
    config: object = None
    group_rows: tuple = ()

    def bind(self, *args) -> W4A8DecodeLaunch:
        return W4A8DecodeLaunch(self)


class W4A8DecodeLaunch:
    """The bound launch of one plan, called with the call's tensors in the order of the Hopper-layout kernel's
    ``*_ptr`` arguments: that kernel on the Hopper-layout copy of ``b`` where there is one, else the portable
    ``w4a8_blocks`` kernel on ``b``. Each is bound (compiled) at its first use."""

    def __init__(self, spec: W4A8DecodeSpec):
        self.spec = spec
        self.hopper = self.portable = None

    def __call__(
        self,
        a,
        a_global_scale,
        b,
        b_scales,
        b_global_scale,
        out,
        a_offsets,
        expert_ids,
        expert_scales,
        bias,
        a_scales,
    ) -> None:
        call = self.spec.call
        interleaved = call.glu is not None and call.glu.interleaved
        copy = HOPPER_COPIES.get(b, b_scales, interleaved)
        if copy is None:
            self._portable(a, a_scales, b, b_scales, out, a_offsets, expert_ids, expert_scales, bias)
            return
        b, b_scales = copy.data.view(torch.uint8), copy.scales.view(torch.uint8)
        if interleaved and call.has_bias:
            bias = deinterleave_gate_up(bias)  # in the copy's row order
        tensors = (a, a_global_scale, b, b_scales, b_global_scale, out, a_offsets, expert_ids, expert_scales, bias)
        tensors = (*tensors, a_scales)
        if self.hopper is None:
            spec = self.spec
            named = dict(a=a, a_scales=a_scales, b=b, b_scales=b_scales, out=out, bias=bias)
            sizes = hopper_layout.scalars(spec.call, tile(spec.call, spec.config), spec.group_rows, named)
            self.hopper = KernelSpec.bind(spec, *tensors, *sizes)
        self.hopper(*tensors)

    def _portable(self, a, a_scales, b, b_scales, out, a_offsets, expert_ids, expert_scales, bias) -> None:
        tensors = (a, a_scales, b, b_scales, out, a_offsets, expert_ids, expert_scales, bias)
        if self.portable is None:
            spec = self.spec
            self.portable = w4a8_blocks.bound_fallback(spec.call, spec.config, spec.group_rows, tensors)
        self.portable(*tensors)

    def __repr__(self) -> str:
        return f"W4A8DecodeLaunch(hopper={self.hopper!r}, portable={self.portable!r})"
