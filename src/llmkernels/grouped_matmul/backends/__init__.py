"""The grouped matmul's backends, tried in the order of :data:`BACKENDS`: the first whose ``supports(call, config)``
holds takes a launch.

A backend module exposes

* ``supports(call, config) -> bool``: whether it takes a launch of the checked call (``grouped_matmul.check.
  CheckedCall``, possibly :meth:`~grouped_matmul.check.CheckedCall.described` without tensors) under ``config``;
* ``upcast_dtype(call, config)``: the torch dtype a quantized A is decoded to ahead (:mod:`.upcast`) before its
  kernel reads it, or None when the kernel reads A as given;
* ``kernel_spec(call, config, group_rows) -> KernelSpec``: the launch over the groups of ``min_rows < rows <=
  max_rows`` (``group_rows``): kernel, grid, constexprs, options and the argument types an ahead-of-time compile
  needs (:func:`.base.pointer_types`). Its pointer arguments are named after the call's tensors (:data:`TENSORS`, plus
  ``_ptr``) and come first;
* ``scalars(call, config, group_rows, tensors) -> tuple``: the kernel's other runtime arguments (strides, sizes),
  in its order, for the call's tensors (``{name in TENSORS: tensor}``, A as the kernel reads it).
"""

from __future__ import annotations

from . import (
    bf16_hopper,
    dot_scaled,
    fp8_blocks,
    fp8_hopper,
    hopper_layout,
    portable,
    w4a8_blocks,
    w4a8_decode,
    w4a8_hopper,
)
from .base import TENSORS, pointer_types

__all__ = ["BACKENDS", "TENSORS", "backend_for", "pointer_types"]

# fp8 blocks first (no other backend takes their float32 scales): the Gluon kernel for sm_90 where it takes the
# launch, else the portable one; fp8 (1, 128) activations with MXFP4 weights (w4a8) next: the Gluon kernel for sm_90
# where it takes the launch, the Hopper-layout kernel on the weights' Hopper-layout copy for the decode sizes on
# sm_90, else the portable one; then the fp8 Gluon kernel on plain 16-bit operands (sm_90, large groups); portable
# last: it takes every call the others leave
BACKENDS = (
    fp8_hopper,
    fp8_blocks,
    w4a8_hopper,
    w4a8_decode,
    w4a8_blocks,
    bf16_hopper,
    hopper_layout,
    dot_scaled,
    portable,
)


def backend_for(call, config):
    """The first backend of :data:`BACKENDS` that takes a launch of ``call`` under ``config``.

    Raises:
        ValueError: none does (the checks let no such call through), or what the backend's ``supports`` raises
            for a config that asks for it but cannot run (``mma="dot_scaled"`` on operands it does not take).
    """
    for backend in BACKENDS:
        if backend.supports(call, config):
            return backend
    raise ValueError(
        f"no grouped-matmul backend takes a={call.a.format} ({call.a.scale_layout}), "
        f"b={call.b.format} ({call.b.scale_layout}) under {config}"
    )
