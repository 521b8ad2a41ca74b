"""The ``fp8_hopper`` backend: the warp-specialized Gluon kernel for FP8 blocks on Hopper
(``grouped_matmul/gluon_fp8_kernel.py``), for fp8 (1, 128) activations with fp8 (128, 128) weights on an sm_90 GPU.

It runs its own measured tile (128 x 256, 3 stages, TMA-store epilogue) and a persistent grid of one program per
SM whatever ``block_m``, ``block_n``, ``num_stages``, ``num_warps`` and ``num_programs`` the config names; it takes
the config's plain (not ``ab_swapped``) launches of 128-row tiles, the default for large groups, and leaves
swap-AB (decode) and smaller tiles to the portable ``fp8_blocks`` backend, as it leaves what its kernel does not
take (see :func:`supports`).

The kernel reads A and B through TMA descriptors. The plan hands every launch the call's tensors by name
(``a_ptr``, ``b_ptr``, ...); this backend's :class:`HopperWsSpec` binds descriptors over them (shapes and strides
are the plan's: they are part of the call signature) and its bound launch passes each call's tensors as the
descriptors' bases.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from ...launch import BoundKernel, KernelSpec, bind, take_tile_counter
from ...runtime import cdiv, cuda_capability, interpreting, num_programs_hint
from .. import gluon_fp8_kernel as kernel
from .base import pointer_types

__all__ = [
    "supports",
    "upcast_dtype",
    "kernel_spec",
    "scalars",
    "HopperWsSpec",
    "HopperWsLaunch",
    "EPILOGUES",
    "descriptor_type",
    "warp_specialized_launch",
    "warp_specialized_spec",
    "warp_specialized_scalars",
    "GL_DTYPES",
    "tma_readable",
    "dense_copy",
]

EPILOGUES = ("none", "silu", "gelu", "swiglu", "user")  # "user": a @triton.jit fn(value, row, col)
GL_DTYPES = {  # torch dtype -> Gluon dtype
    torch.bfloat16: gl.bfloat16,
    torch.float16: gl.float16,
    torch.float32: gl.float32,
    torch.float8_e4m3fn: gl.float8e4nv,
}
_TYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
_E4M3 = torch.float8_e4m3fn


def supports(call, config) -> bool:
    """fp8 (1, 128) ``a`` (a bf16 ``a`` reaches backends quantized ahead by the plan) with fp8 (128, 128) ``b`` on
    a CUDA device of compute capability 9.x (not the interpreter); a launch for large groups: not ``ab_swapped``,
    ``block_m`` >= 128 (the defaults pick smaller tiles for groups of at most 64 rows, where 128-row tiles would
    compute mostly padding); K a multiple of 16 (TMA reads 16-byte rows); an epilogue of :data:`EPILOGUES`, SwiGLU
    on ``[gate | up]`` halves with ``N / 2`` a multiple of 128 (each up box in one weight-scale block), not
    interleaved."""
    a, b = call.a, call.b
    if a.format != "fp8" or b.format != "fp8" or a.block_rows != 1 or b.block_rows != 128:
        return False
    return config.block_k == kernel.BLOCK_K and warp_specialized_launch(call, config, element_bytes=1)


def warp_specialized_launch(call, config, element_bytes: int) -> bool:
    """What the warp-specialized kernel needs of a launch whatever its operands: a CUDA device of compute
    capability 9.x (not the interpreter); not ``ab_swapped``, ``block_m`` >= 128; rows of K a multiple of 16
    bytes (TMA); an epilogue of :data:`EPILOGUES`, SwiGLU on ``[gate | up]`` halves with ``N / 2`` a multiple of
    128, not interleaved."""
    if call.device.type != "cuda" or interpreting() or (cuda_capability(call.device) or (0, 0))[0] != 9:
        return False
    if config.ab_swapped or config.block_m < kernel.BLOCK_M or call.k * element_bytes % 16:
        return False
    if call.epilogue_kind not in EPILOGUES:
        return False
    return call.epilogue_kind != "swiglu" or (not call.glu.interleaved and call.n_out % 128 == 0)


def upcast_dtype(call, config):
    """None: the kernel reads fp8 A as it is."""
    return None


def descriptor_type(dtype, block) -> str:
    """Triton's type of a TMA descriptor argument over ``dtype`` (a Gluon dtype) boxes of ``block``."""
    layout = gl.NVMMASharedLayout.get_default_for(block, dtype)
    name = {gl.float8e4nv: "fp8e4nv", gl.bfloat16: "bf16", gl.float16: "fp16", gl.float32: "fp32"}[dtype]
    return f"tensordesc<{name}[{', '.join(map(str, block))}],{layout!r}>"


def _tma_store(call) -> bool:
    """Whether the epilogue stores full 64-row halves through TMA: bf16 / fp16 out (a float32 staging buffer per
    consumer and half would not fit beside the ring's 144 KB of shared memory)."""
    return call.out_dtype in (torch.bfloat16, torch.float16)


def kernel_spec(call, config, group_rows: tuple[int, int]) -> HopperWsSpec:
    """The kernel's launch for ``call``: a persistent grid of ``min(SMs, tile bound)`` programs (the bound, from
    shapes, needs no sync); ``config`` only selects this backend (its tile sizes are the kernel's own)."""
    return warp_specialized_spec(call, gl.float8e4nv, kernel.STAGES, _tma_store(call))


def warp_specialized_spec(call, element, stages: int, tma_store: bool) -> HopperWsSpec:
    """The launch of the warp-specialized kernel on operands of Gluon dtype ``element`` (FP8 blocks here, bf16 /
    fp16 in ``bf16_hopper``): ``stages`` deep, with the TMA-store epilogue or pointer stores; a persistent grid of
    ``min(SMs, tile bound)`` programs."""
    glu = call.glu
    swiglu = call.epilogue_kind == "swiglu"
    n_tiles = cdiv(call.n_out, kernel.out_columns_per_tile(swiglu))
    bound = (cdiv(call.num_tokens, kernel.BLOCK_M) + call.num_groups) * n_tiles
    a_box, b_box = kernel.boxes(element)
    constexprs = dict(
        STAGES=stages,
        HAS_EXPERT_SCALES=call.has_expert_scales,
        HAS_BIAS=call.has_bias,
        EPILOGUE=call.epilogue_kind,
        EPILOGUE_FN=call.epilogue_fn,
        GLU_ALPHA=glu.alpha if swiglu else 1.0,
        GLU_LIMIT=glu.limit if swiglu else None,
        GLU_UP_SHIFT=glu.up_shift if swiglu else 0.0,
        TMA_STORE=tma_store,
    )
    arg_types = dict(pointer_types(call))
    arg_types.update(
        a_ptr=descriptor_type(element, a_box),
        b_ptr=descriptor_type(element, b_box),
        a_scales_ptr="*fp32",
        b_scales_ptr="*fp32",
        out_desc=descriptor_type(GL_DTYPES[call.out_dtype], kernel.OUT_BOX),
        tile_counter="*i32",
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
    """The kernel's strides and sizes after ``out_desc`` (which :meth:`HopperWsSpec.bind` makes)."""
    a_scales, b_scales = tensors["a_scales"], tensors["b_scales"]
    scale_strides = (a_scales.stride(0), a_scales.stride(1), b_scales.stride(0), b_scales.stride(1), b_scales.stride(2))
    return warp_specialized_scalars(call, group_rows, tensors, scale_strides)


def warp_specialized_scalars(call, group_rows: tuple[int, int], tensors: dict, scale_strides: tuple) -> tuple:
    """The warp-specialized kernel's runtime scalars: the five scale strides given, then out's and the bias' row
    strides and the sizes."""
    return (
        *scale_strides,
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


def tma_readable(t: torch.Tensor) -> bool:
    """What a TMA descriptor over ``t``'s rows needs: 16-byte aligned base and row strides, unit last stride."""
    return (
        t.stride(-1) == 1
        and t.data_ptr() % 16 == 0
        and all(stride * t.element_size() % 16 == 0 for stride in t.stride()[:-1])
    )


def _weights_2d(b: torch.Tensor) -> bool:
    """B ``[E, N, K]`` addressable as ``[E·N, K]`` rows (experts one after the other) in place."""
    return b.shape[0] <= 1 or b.stride(0) == b.shape[1] * b.stride(1)


def dense_copy(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of ``t`` in fresh (aligned) memory, even where ``t`` is contiguous already."""
    return t.clone(memory_format=torch.contiguous_format)


@dataclass(frozen=True)
class HopperWsSpec(KernelSpec):
    """The warp-specialized kernel's :class:`~llmkernels.launch.KernelSpec` (this backend's and ``bf16_hopper``'s).
    :meth:`bind` takes the plan's arguments (the call's tensors for the kernel's ``*_ptr`` arguments, then
    :func:`scalars`) and returns a :class:`HopperWsLaunch`."""

    def bind(self, *args) -> HopperWsLaunch:
        a, a_scales, b, b_scales, out, a_offsets, expert_ids, expert_scales, bias, *sizes = args
        # A, B in a layout TMA cannot read (16-byte rows and base; B's experts back to back) are copied per
        # call: their strides and alignment are the plan's, so the decision is made once, here
        copy_a = not tma_readable(a)
        copy_b = not (tma_readable(b) and _weights_2d(b))
        a, b = (dense_copy(a) if copy_a else a), (dense_copy(b) if copy_b else b)
        num_tokens, k = a.shape
        num_experts, n, _ = b.shape
        # FP8 data may come as its bytes; 16-bit operands as they are
        dtype = a.dtype if a.element_size() == 2 else _E4M3
        element = GL_DTYPES[dtype]
        a_box, b_box = kernel.boxes(element)
        a_desc = TensorDescriptor(a.view(dtype), [num_tokens, k], [a.stride(0), 1], a_box, _layout(a_box, element))
        b_desc = TensorDescriptor(b.view(dtype), [num_experts * n, k], [b.stride(1), 1], b_box, _layout(b_box, element))
        # the TMA store's descriptor over out [T, N_out] (it clips the columns past N_out); a variant without the
        # TMA store, or an out TMA cannot address, gets a dummy the kernel never reads
        use_out = self.constexprs["TMA_STORE"] and tma_readable(out)
        out_base = out if use_out else torch.zeros(kernel.OUT_BOX, dtype=out.dtype, device=out.device)
        out_desc = TensorDescriptor(
            out_base,
            list(out_base.shape),
            [out_base.stride(0), 1],
            kernel.OUT_BOX,
            _layout(kernel.OUT_BOX, GL_DTYPES[out.dtype]),
        )
        constexprs = dict(self.constexprs, TMA_STORE=use_out)
        bound = bind(
            self.fn,
            self.grid,
            a_desc,
            a_scales,
            b_desc,
            b_scales,
            out,
            a_offsets,
            expert_ids,
            expert_scales,
            bias,
            out_desc,
            torch.zeros(1, dtype=torch.int32, device=out.device),  # each call takes its own (HopperWsLaunch)
            *sizes,
            **constexprs,
            **self.options,
        )
        return HopperWsLaunch(bound, copy_a, copy_b, None if use_out else out_base)


def _layout(block, dtype):
    return gl.NVMMASharedLayout.get_default_for(block, dtype)


class HopperWsLaunch:
    """The bound kernel of one plan, called with the call's tensors in the order of the kernel's ``*_ptr``
    arguments: A and B become the bases of their descriptors (copied first where :meth:`HopperWsSpec.bind`
    found their layout unreadable by TMA), out also that of the TMA store's (or the dummy), and a zeroed tile
    counter of the current stream is added."""

    def __init__(self, bound: BoundKernel, copy_a: bool, copy_b: bool, out_dummy: torch.Tensor | None):
        self.bound, self.copy_a, self.copy_b, self.out_dummy = bound, copy_a, copy_b, out_dummy
        # zeroed tile counters per stream; two threads' launches on one stream take them in order
        self.counters, self.lock = {}, threading.Lock()

    @property
    def compiled(self):
        return self.bound.compiled

    def __call__(self, a, a_scales, b, b_scales, out, a_offsets, expert_ids, expert_scales, bias) -> None:
        if self.copy_a:
            a = dense_copy(a)
        if self.copy_b:
            b = dense_copy(b)
        out_base = out if self.out_dummy is None else self.out_dummy
        with self.lock:
            counter = take_tile_counter(self.counters, out.device)
            self.bound(a, a_scales, b, b_scales, out, a_offsets, expert_ids, expert_scales, bias, out_base, counter)

    def __repr__(self) -> str:
        return f"HopperWsLaunch({self.bound!r})"
