"""The plan of one grouped-matmul call signature: its launches (config, group-size class, the backend that takes
each: :mod:`.backends`) and the pre-passes of A: decoded ahead where a launch reads it so, or (bf16/fp16 A with fp8
weights) quantized to fp8 blocks. A plan holds no tensor; each launch binds its compiled kernel at its first run."""

from __future__ import annotations

import dataclasses
from operator import itemgetter

import torch

from .. import runtime
from ..formats import ScaledTensor, quantize
from ..launch import BoundKernel
from ..runtime import check_out, unit_last_stride
from .backends import TENSORS, backend_for
from .backends.upcast import Upcast
from .check import FP8_ACTIVATIONS, CheckedCall, operand_tensors
from .config import ALL_GROUP_SIZES, FP8_BLOCK_K, BlockScaledMatmulConfig, default_launches

__all__ = ["Plan", "Launch", "launch_configs"]


def launch_configs(call: CheckedCall, config: BlockScaledMatmulConfig | None) -> tuple:
    """``((config, min_rows, max_rows), ...)``: the launches of ``call``, each over the groups of ``min_rows < rows
    <= max_rows``: ``config`` over every group, or by default :func:`~llmkernels.grouped_matmul.default_launches`."""
    if config is not None:
        return ((config, *ALL_GROUP_SIZES),)
    a, b = call.a, call.b
    return default_launches(
        call.num_tokens,
        call.num_groups,
        call.n_out,
        call.k,
        call.device,
        a.element,
        b.element,
        call.weight_bytes,
        call.epilogue_kind == "swiglu",
        b.scale_block,
        b.scale_layout,
        b.scale,
        a.scale,
    )


class Launch:
    """One launch of a plan: its backend's kernel spec, the call tensors its kernel takes, and A as it reads it
    (``upcast``: the dtype A is decoded to ahead, or None)."""

    def __init__(self, call: CheckedCall, config: BlockScaledMatmulConfig, group_rows: tuple[int, int]):
        self.call, self.config, self.group_rows = call, config, group_rows
        self.backend = backend_for(call, config)
        self.upcast = self.backend.upcast_dtype(call, config)
        self.spec = self.backend.kernel_spec(call, config, group_rows)
        pointers = tuple(name[: -len("_ptr")] for name in self.spec.fn.arg_names if name.endswith("_ptr"))
        # the kernel's pointers out of the call's tensors (None: all of them, in order)
        self.take = None if pointers == TENSORS else itemgetter(*(TENSORS.index(name) for name in pointers))
        self.bound: BoundKernel | None = None

    def __call__(self, tensors: tuple) -> None:
        """Launches on the call's tensors (:data:`~.backends.TENSORS` order; A as this launch reads it)."""
        pointers = tensors if self.take is None else self.take(tensors)
        bound = self.bound
        if bound is None:
            scalars = self.backend.scalars(self.call, self.config, self.group_rows, dict(zip(TENSORS, tensors)))
            bound = self.bound = self.spec.bind(*pointers, *scalars)
        bound(*pointers)


class Plan:
    """The launches of one call signature and the pre-passes they read A from (one per dtype; bf16/fp16 A with fp8
    weights: its quantization to fp8 ``block=(1, 128)``, after which every launch is fp8 x fp8)."""

    def __init__(self, call: CheckedCall, config: BlockScaledMatmulConfig | None):
        self.call = call = call.described()
        # As vLLM and transformers run these checkpoints: one quantize kernel, no sync, then the fp8 product.
        self.quantize_a = call.b.format == "fp8" and not call.a.quantized
        if self.quantize_a:
            call = dataclasses.replace(call, a=FP8_ACTIVATIONS)
        self.launches = tuple(
            Launch(call, launch_config, (min_rows, max_rows))
            for launch_config, min_rows, max_rows in launch_configs(call, config)
        )
        self.upcasts = {
            launch.upcast: Upcast(call, launch.upcast) for launch in self.launches if launch.upcast is not None
        }
        # Set by the first call: whether the kernels read every operand part and metadata vector as given (no
        # copy). The signature fixes it (formats, layouts, shapes, strides and alignment are in the key), so the
        # later calls of this plan skip the per-part checks.
        self.as_given: bool | None = None
        self.out_shape, self.empty = (call.num_tokens, call.n_out), call.empty

    def __call__(self, a, b, a_offsets, expert_ids, expert_scales, bias, out, out_checked: bool) -> torch.Tensor:
        """Runs the launches on a call of this signature. ``out_checked``: False when ``out`` was given to a cached
        plan (whether it shares memory with an input is checked here, on the tensors the kernels read, before any
        launch)."""
        call = self.call
        as_given = self.as_given
        if as_given:
            a_data, a_scales, a_global_scale = _parts(a)
            b_data, b_scales, b_global_scale = _parts(b)
        else:
            a_data, a_scales, a_global_scale = operand_tensors(a)
            b_data, b_scales, b_global_scale = operand_tensors(b)
        new_out = out is None
        if new_out:
            out = runtime.new_buffer(self.out_shape, call.out_dtype, call.device)
        elif not out_checked:
            check_out(
                out,
                out.shape,
                out.dtype,
                a=a_data,
                a_scales=a_scales,
                b=b_data,
                b_scales=b_scales,
                a_offsets=a_offsets,
                expert_ids=expert_ids,
                expert_scales=expert_scales,
                bias=bias,
            )
        if self.empty:
            return out
        if self.quantize_a:
            a_data, a_scales, _ = operand_tensors(quantize(a_data, "fp8", block=(1, FP8_BLOCK_K)))
        a_scale_offsets = a.group_scale_offsets if isinstance(a, ScaledTensor) else None
        if not as_given:
            # The kernels read the metadata as dense vectors: views of any strides are copied (a few bytes).
            metadata = (a_offsets, expert_ids, expert_scales, a_scale_offsets)
            a_offsets, expert_ids = a_offsets.contiguous(), expert_ids.contiguous()
            expert_scales = expert_scales.contiguous() if expert_scales is not None else None
            a_scale_offsets = a_scale_offsets.contiguous() if a_scale_offsets is not None else None
            if as_given is None and not self.quantize_a:
                self.as_given = _same(metadata, (a_offsets, expert_ids, expert_scales, a_scale_offsets)) and _same(
                    (*_parts(a), *_parts(b)), (a_data, a_scales, a_global_scale, b_data, b_scales, b_global_scale)
                )
        # The kernels store unit-stride rows; another out gets the result through a copy of itself (rows
        # outside every group keep their values). A new out has them.
        target = out if new_out else unit_last_stride(out)
        dummy = a_offsets  # for the pointers a compiled variant never reads
        rest = (
            b_data,
            b_scales if b_scales is not None else dummy,
            b_global_scale if b_global_scale is not None else dummy,
            target,
            a_offsets,
            a_scale_offsets if a_scale_offsets is not None else dummy,
            expert_ids,
            expert_scales if expert_scales is not None else dummy,
            unit_last_stride(bias) if bias is not None else dummy,
        )
        a_global_part = a_global_scale if a_global_scale is not None else dummy
        decoded = {dtype: upcast(a_data, a_scales) for dtype, upcast in self.upcasts.items()} if self.upcasts else None
        for launch in self.launches:
            if launch.upcast is None:
                launch((a_data, a_scales if a_scales is not None else dummy, a_global_part, *rest))
            else:
                launch((decoded[launch.upcast], dummy, a_global_part, *rest))
        if target is not out:
            out.copy_(target)
        return out


def _parts(x) -> tuple:
    """``(data, scales, global_scale)`` of an operand as :func:`~.check.operand_tensors` gives them when it copies
    nothing (data and 8-bit scales as bytes)."""
    if type(x) is not ScaledTensor and not isinstance(x, ScaledTensor):
        return x, None, None
    scales = x.scales
    return (
        x.data.view(torch.uint8),
        scales if scales.dtype == torch.float32 else scales.view(torch.uint8),
        x.global_scale,
    )


def _same(given: tuple, read: tuple) -> bool:
    """Whether each tensor of ``read`` is the one of ``given`` (the same view of the same memory, or both None)."""
    return all(
        r is g
        or (
            r is not None
            and g is not None
            and r.data_ptr() == g.data_ptr()
            and r.dtype == g.dtype
            and r.shape == g.shape
            and r.stride() == g.stride()
        )
        for g, r in zip(given, read)
    )
