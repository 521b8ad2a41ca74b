"""grouped_matmul(): validates its inputs, picks a config and launches the kernel."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .. import runtime
from ..launch import BoundKernel, PlanCache, bind
from ..runtime import (check_device, check_out, cuda_capability, describe, first_bad_prefix_sum, first_true,
                        forward_only, interpreting, next_power_of_2, num_programs_hint, unit_last_stride)
from ..formats import ScaledTensor, unwrap_torchao
from ..formats.kernel import upcast_rows_kernel
from . import hopper_kernel, kernel
from .config import ALL_GROUP_SIZES, HOPPER_MIN_BLOCK_K, BlockScaledMatmulConfig, default_launches
from .epilogue import EPILOGUES, SwiGLU

__all__ = ["grouped_matmul", "check_grouped_matmul", "EPILOGUES"]

_BIAS_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_PLAIN_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16"}
_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_OFFSET_DTYPES = (torch.int32, torch.uint32)


@dataclass(frozen=True)
class _Operand:
    """What the kernel needs to know about one operand."""

    data: torch.Tensor
    scales: torch.Tensor | None
    global_scale: torch.Tensor | None
    element: str  # "bf16", "fp16", "e4m3", "e2m1"
    scale: str  # "none", "e8m0", "e4m3"
    scale_block: int
    scale_layout: str  # "row", "128x4", "128x4_grouped", "hopper" (data and scales in wgmma fragment order)
    format: str  # "bf16", "fp16" or a block-scaled format name
    has_global_scale: bool = False

    @property
    def quantized(self) -> bool:
        return self.scale != "none"


def _operand(x, name: str, dims: int) -> _Operand:
    """The kernel's view of ``a`` or ``b``. Any strides are accepted: a layout the kernel cannot address
    (K not unit-stride, 128x4 scales not contiguous) is copied to a contiguous one."""
    if isinstance(x, ScaledTensor):
        x.validate()
        if x.dim() != dims:
            raise ValueError(f"{name} must be {dims}D, got logical shape {tuple(x.shape)}")
        spec = x.spec
        layout = x.scale_layout
        if layout == "128x4" and x.group_offsets is not None:
            layout = "128x4_grouped"
        if layout == "hopper" and name == "a":
            raise ValueError("a is in the hopper layout, a layout of weights: pass a with row or 128x4 scales")
        data, scales, global_scale = _operand_tensors(x)
        return _Operand(data, scales, global_scale, spec.element, spec.scale, spec.block, layout, x.format,
                        global_scale is not None)
    if isinstance(x, torch.Tensor):
        if x.dtype not in _PLAIN_DTYPES:
            raise TypeError(f"{name} must be a ScaledTensor or a bf16/fp16 tensor, got {x.dtype}")
        if x.dim() != dims:
            raise ValueError(f"{name} must be {dims}D, got shape {tuple(x.shape)}")
        element = _PLAIN_DTYPES[x.dtype]
        return _Operand(unit_last_stride(x), None, None, element, "none", 1, "row", element)
    raise TypeError(f"{name} must be a ScaledTensor or a torch.Tensor, got {type(x).__name__}")


def _check_format_pair(a: _Operand, b: _Operand) -> None:
    if not a.quantized:
        if not b.quantized and b.element != a.element:
            raise TypeError(f"a is {a.format} but b is {b.format}: plain operands must share a dtype")
        return
    if not b.quantized:
        raise TypeError(f"a is {a.format} but b is plain {b.format}: quantized activations need quantized weights")
    if (a.format == "nvfp4") != (b.format == "nvfp4"):
        raise TypeError(f"unsupported format pair a={a.format}, b={b.format}: nvfp4 pairs only with nvfp4")


def _check_metadata(a_offsets, expert_ids, expert_scales, num_experts: int):
    if not isinstance(a_offsets, torch.Tensor) or a_offsets.dtype not in _OFFSET_DTYPES or a_offsets.dim() != 1:
        raise TypeError(f"a_offsets must be a 1D int32 or uint32 tensor, got {describe(a_offsets)}")
    if a_offsets.numel() < 1:
        raise ValueError("a_offsets must hold G + 1 >= 1 entries")
    num_groups = a_offsets.numel() - 1
    if not isinstance(expert_ids, torch.Tensor) or expert_ids.dtype != torch.int32 or expert_ids.dim() != 1:
        raise TypeError(f"expert_ids must be a 1D int32 tensor, got {describe(expert_ids)}")
    if expert_ids.numel() != num_groups:
        raise ValueError(f"expert_ids has {expert_ids.numel()} entries but a_offsets describes {num_groups} groups")
    if expert_scales is not None:
        if not isinstance(expert_scales, torch.Tensor) or expert_scales.dtype != torch.float32:
            raise TypeError(f"expert_scales must be a float32 tensor, got {describe(expert_scales)}")
        if tuple(expert_scales.shape) != (num_experts,):
            raise ValueError(f"expert_scales must have shape ({num_experts},), got {tuple(expert_scales.shape)}")
    return num_groups



def _check_hopper_weights(a: _Operand, n_out: int, epilogue_kind: str, config) -> None:
    """What the kernel for weights in the hopper layout takes: bf16 activations or quantized ones it decodes
    ahead to bf16 (row or 128x4 scales), SwiGLU halves on 16-row blocks, K steps of whole 64-wide chunks,
    at least 64 weight rows per MMA on the GPU."""
    if a.element == "fp16":
        raise TypeError("b in the hopper layout decodes to bf16: a must be bf16 or a ScaledTensor, not fp16")
    if a.scale_layout == "128x4_grouped":
        raise ValueError("b in the hopper layout takes a quantized a decoded ahead, which needs row or ungrouped "
                         "128x4 scales, not scales padded per group")
    if epilogue_kind == "swiglu" and n_out % 16:
        raise ValueError(f"swiglu on b in the hopper layout needs N / 2 to be a multiple of 16 (the layout's "
                         f"row blocks), got N / 2 = {n_out}")
    if config is not None and (config.block_k < HOPPER_MIN_BLOCK_K or config.mma == "dot_scaled"):
        raise ValueError(f"b in the hopper layout needs config.block_k >= {HOPPER_MIN_BLOCK_K} (its 64-wide K "
                         f"chunks) and mma 'auto' or 'dequant', got "
                         f"block_k={config.block_k}, mma={config.mma!r}")
    if config is not None and config.block_n < 64 and a.data.device.type == "cuda" and not interpreting():
        # wgmma's M is 64 rows: SwiGLU halves of 32 rows gave wrong results on the H100 (lab/NOTES.md);
        # the interpreter, which has no wgmma, runs 32-row tiles.
        raise ValueError(f"b in the hopper layout needs config.block_n >= 64 on the GPU (weight rows per MMA; "
                         f"under swiglu per half), got block_n={config.block_n}")


def _epilogue_kind(epilogue) -> tuple[str, object, SwiGLU | None]:
    """``(kind, user function, SwiGLU parameters)`` of an ``epilogue`` argument."""
    if epilogue is None:
        return "none", None, None
    if isinstance(epilogue, SwiGLU):
        return "swiglu", None, epilogue
    if isinstance(epilogue, str):
        if epilogue not in EPILOGUES:
            raise ValueError(f"epilogue must be None, one of {EPILOGUES}, a SwiGLU or a @triton.jit function, "
                             f"got {epilogue!r}")
        return epilogue, None, SwiGLU() if epilogue == "swiglu" else None
    if callable(getattr(epilogue, "fn", None)):  # a @triton.jit function (or its interpreted twin)
        return "user", epilogue, None
    raise TypeError(f"epilogue must be None, one of {EPILOGUES}, a SwiGLU or a @triton.jit function, "
                    f"got {type(epilogue).__name__}")


def _check_bias(bias, num_experts: int, n: int) -> None:
    if bias is None:
        return
    if not isinstance(bias, torch.Tensor) or bias.dtype not in _BIAS_DTYPES:
        raise TypeError(f"bias must be a float32, bf16 or fp16 tensor, got {describe(bias)}")
    if tuple(bias.shape) != (num_experts, n):
        raise ValueError(f"bias must have shape (E, N) = ({num_experts}, {n}) (one row per expert, in b's row "
                         f"order), got {tuple(bias.shape)}")


def _validate_metadata_on_host(a_offsets, expert_ids, num_tokens: int, num_experts: int, a: ScaledTensor | None):
    """The checks that need the offsets' values (one sync); only with ``validate=True``."""
    offsets = a_offsets.to(torch.int64).cpu()
    i = first_bad_prefix_sum(offsets, num_tokens)
    if i == 0:
        raise ValueError(f"a_offsets[0] must be 0, got {int(offsets[0])}")
    if i is not None and offsets[i] > num_tokens:
        raise ValueError(f"a_offsets[{i}] = {int(offsets[i])} exceeds the {num_tokens} rows of a")
    if i is not None:
        raise ValueError(f"a_offsets must be non-decreasing: a_offsets[{i}] = {int(offsets[i])} < "
                         f"a_offsets[{i - 1}] = {int(offsets[i - 1])}")
    ids = expert_ids.cpu()
    bad_id = first_true((ids < -1) | (ids >= num_experts))
    if bad_id is not None:
        i = bad_id[0]
        raise ValueError(f"expert_ids must lie in [-1, {num_experts}): expert_ids[{i}] = {int(ids[i])}")
    if a is not None and a.group_offsets is not None and not torch.equal(a.group_offsets.to(torch.int64).cpu(), offsets):
        raise ValueError("a's scales were laid out for other group offsets than a_offsets")


def _resolve_mma(config: BlockScaledMatmulConfig, a: _Operand, b: _Operand, device: torch.device) -> bool:
    """True when the kernel should use ``tl.dot_scaled``: block-scaled weights with activations of their
    family (MX with MX, NVFP4 with NVFP4) or MX weights with bf16 activations. ``"auto"`` takes it on
    Blackwell (the native block-scaled MMA, NVFP4 included) and for MX e2m1 weights on Hopper (where
    Triton upcasts, which measured best for those); never in the interpreter (whose dot_scaled is
    checked through ``mma="dot_scaled"``)."""
    scaled_pair = b.scale != "none" and (a.scale == b.scale or (a.element == "bf16" and b.scale == "e8m0"))
    blackwell = device.type == "cuda" and not interpreting() and cuda_capability(device)[0] >= 10
    if config.mma == "dequant":
        return False
    if config.mma == "dot_scaled":
        if not scaled_pair:
            raise ValueError(f"mma='dot_scaled' needs block-scaled weights with activations of their family or "
                             f"MX weights with bf16 activations, got a={a.format}, b={b.format}")
        if b.scale == "e4m3" and not blackwell:
            raise ValueError("mma='dot_scaled' with nvfp4 runs on Blackwell (sm_100+) only: Triton's interpreter "
                             "reads e4m3 scales as e8m0 and its Hopper lowering of them fails")
        return True
    if not scaled_pair or interpreting() or device.type != "cuda":
        return False
    return blackwell or (b.element == "e2m1" and b.scale == "e8m0")


@dataclass(frozen=True)
class CheckedCall:
    """What :func:`check_grouped_matmul` found: the operands as the kernel reads them, dense metadata, sizes."""

    a: _Operand
    b: _Operand
    a_offsets: torch.Tensor
    expert_ids: torch.Tensor
    expert_scales: torch.Tensor | None
    a_scale_offsets: torch.Tensor | None
    num_tokens: int
    k: int
    num_experts: int
    n: int
    n_out: int
    num_groups: int
    epilogue_kind: str
    epilogue_fn: object
    glu: SwiGLU | None
    bias: torch.Tensor | None
    device: torch.device


def check_grouped_matmul(a, b, a_offsets, expert_ids, expert_scales, epilogue, out_dtype, out, config,
                         bias=None) -> CheckedCall:
    """The checks of :func:`grouped_matmul` (no launch, no sync; safe while torch.compile traces)."""
    a_op, b_op = _operand(a, "a", 2), _operand(b, "b", 3)
    _check_format_pair(a_op, b_op)
    forward_only("grouped_matmul", a=a_op.data, a_scales=a_op.scales, a_global_scale=a_op.global_scale,
                 b=b_op.data, b_scales=b_op.scales, b_global_scale=b_op.global_scale,
                 expert_scales=expert_scales, bias=bias, out=out)
    num_tokens, k = a.shape
    num_experts, n, k_b = b.shape
    if k != k_b:
        raise ValueError(f"a has K = {k} but b has K = {k_b}")
    num_groups = _check_metadata(a_offsets, expert_ids, expert_scales, num_experts)
    epilogue_kind, epilogue_fn, glu = _epilogue_kind(epilogue)
    if epilogue_kind == "swiglu" and n % 2:
        raise ValueError(f"swiglu needs an even N (gate and up halves), got N = {n}")
    if glu is not None and glu.interleaved and b_op.scale_layout != "row":
        raise ValueError(f"SwiGLU(interleaved=True) reads gate and up rows in place, which b's "
                         f"{b_op.scale_layout} layout cannot address: de-interleave b's rows into [gate | up] "
                         f"halves before making that layout")
    _check_bias(bias, num_experts, n)
    n_out = n // 2 if epilogue_kind == "swiglu" else n
    if out_dtype not in _OUT_DTYPES:
        raise TypeError(f"out_dtype must be bf16, fp16 or fp32, got {out_dtype}")
    if config is not None and not isinstance(config, BlockScaledMatmulConfig):
        raise TypeError(f"config must be a BlockScaledMatmulConfig, got {type(config).__name__}")
    if b_op.scale_layout == "hopper":
        _check_hopper_weights(a_op, n_out, epilogue_kind, config)
    if out is not None:
        check_out(out, (num_tokens, n_out), out_dtype, a=a_op.data, a_scales=a_op.scales, b=b_op.data,
                  b_scales=b_op.scales, a_offsets=a_offsets, expert_ids=expert_ids, expert_scales=expert_scales,
                  bias=bias)
    a_scale_offsets = a.group_scale_offsets if isinstance(a, ScaledTensor) else None
    device = check_device(a=a_op.data, a_scales=a_op.scales, b=b_op.data, b_scales=b_op.scales, a_offsets=a_offsets,
                          expert_ids=expert_ids, expert_scales=expert_scales, bias=bias, out=out,
                          a_scale_offsets=a_scale_offsets,
                          a_global_scale=a_op.global_scale, b_global_scale=b_op.global_scale)
    if a_scale_offsets is not None and a_scale_offsets.numel() != num_groups:
        raise ValueError(f"a's group_scale_offsets has {a_scale_offsets.numel()} entries for {num_groups} groups")
    # The kernel reads the metadata as dense vectors: views of any strides are copied (a few bytes).
    a_offsets, expert_ids = a_offsets.contiguous(), expert_ids.contiguous()
    expert_scales = expert_scales.contiguous() if expert_scales is not None else None
    a_scale_offsets = a_scale_offsets.contiguous() if a_scale_offsets is not None else None
    bias = unit_last_stride(bias) if bias is not None else None
    return CheckedCall(a_op, b_op, a_offsets, expert_ids, expert_scales, a_scale_offsets, num_tokens, k, num_experts,
                       n, n_out, num_groups, epilogue_kind, epilogue_fn, glu, bias, device)


def grouped_matmul(    a,
    b,
    a_offsets: torch.Tensor,
    expert_ids: torch.Tensor,
    expert_scales: torch.Tensor | None = None,
    *,
    epilogue=None,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    out: torch.Tensor | None = None,
    config: BlockScaledMatmulConfig | None = None,
    validate: bool = False,
) -> torch.Tensor:
    """Grouped 1D-1D block-scaled matmul for Mixture-of-Experts (the seed's Grouped1D1DMatmulKernel).

    For every group g with rows ``a_offsets[g]:a_offsets[g+1]`` and expert ``e = expert_ids[g]``:
    ``out[rows] = epilogue(expert_scales[e] · (A[rows] @ B[e]ᵀ) + bias[e])``, computed in fp32.

    Args:
        a: ``[T, K]`` tokens of all groups: a ScaledTensor (mxfp8, mxfp4, nvfp4; row or 128x4 scales,
            for 128x4 padded per group, see :meth:`ScaledTensor.to_layout`), or a bf16/fp16 tensor
            (weight-only quantization).
        b: ``[E, N, K]`` expert weights, K-major: a ScaledTensor of the same family as ``a`` (MX with
            MX, nvfp4 with nvfp4; any for plain ``a``), or a tensor of a's dtype. MXFP4 and NVFP4 weights
            in the hopper layout (:meth:`ScaledTensor.to_layout`) take bf16 ``a``, or a quantized ``a``
            decoded ahead to bf16.
        a_offsets: int32 or uint32 ``[G + 1]`` on a's device, ``a_offsets[0] = 0``, non-decreasing.
            Read on the device: the call syncs nothing and can be captured in a CUDA graph.
        expert_ids: int32 ``[G]``; ``-1`` writes the group's rows as zeros.
        expert_scales: optional float32 ``[E]``, multiplies the accumulator before the epilogue.
        epilogue: ``None``, ``"silu"``, ``"gelu"`` (erf form), ``"swiglu"`` (B's N rows are
            ``[gate | up]``; output ``silu(gate) · up`` of width N / 2), a :class:`SwiGLU` (slope, clamp,
            shift of up, interleaved rows: gpt-oss' is ``GPT_OSS_SWIGLU``), or a ``@triton.jit`` function
            ``fn(value, row, col) -> value`` on the fp32 ``[BLOCK_M, BLOCK_N]`` tile with the global
            row (token) and column indices.
        bias: optional float32/bf16/fp16 ``[E, N]``, a row per expert in B's row order (gate and up rows
            alike for SwiGLU), added after ``expert_scales`` and before the activation.
        out_dtype: bf16 (default), fp16 or fp32.
        out: optional ``[T, N_out]`` tensor of ``out_dtype`` to write into (returned).
        config: a :class:`BlockScaledMatmulConfig`; default from the shapes.
        validate: check the offsets and expert ids on the host first (one sync) and raise on bad ones.

    Returns:
        ``[T, N_out]`` of ``out_dtype``. Rows outside every group are not written (uninitialised in
        a new tensor).

    Offsets are read clamped to ``[0, T]`` and to their running maximum, and expert ids outside
    ``[0, E)`` write zeros, so bad metadata can neither make the kernel touch memory outside its
    tensors nor write a row twice (``validate=True`` reports it instead). With A scales padded per group,
    a row whose scale tile-row falls outside A's scale tensor reads no scale and is written as NaN.

    Every tensor (data, scales, metadata, ``out``) may be any view: strides the kernel addresses are
    passed through, other layouts copied first; the result has the bits of the contiguous call.

    Raises:
        TypeError: an argument of the wrong type or dtype, an unsupported format pair, ``out`` of another
            dtype.
        ValueError: mismatched shapes (K, lengths of offsets, ids, scales), devices, ScaledTensor parts
            that do not fit, ``out`` of another shape, with overlapping elements (a zero stride) or sharing
            memory with an input, an input that requires grad (forward-only), and with ``validate=True``
            bad offsets or expert ids.
    """
    a, b = unwrap_torchao(a), unwrap_torchao(b)
    key, plan = _PLANS.lookup(a, b, a_offsets, expert_ids, expert_scales, epilogue, bias, out_dtype, out, config)
    if plan is None:
        call = check_grouped_matmul(a, b, a_offsets, expert_ids, expert_scales, epilogue, out_dtype, out, config,
                                    bias)
        plan = _PLANS.put(key, _Plan(call, out_dtype, config))
        out_checked = True
    else:  # where out lies is not part of the signature: the plan checks it again
        out_checked = out is None
    if validate:
        _validate_metadata_on_host(a_offsets, expert_ids, plan.num_tokens, plan.num_experts,
                                   a if isinstance(a, ScaledTensor) else None)
    return plan(a, b, a_offsets, expert_ids, expert_scales, bias, out, out_checked)


_PLANS = PlanCache("grouped_matmul")


def _operand_tensors(x) -> tuple:
    """``(data, scales, global_scale)`` of a checked operand as the kernel reads them: data and scales as
    bytes, copied where the kernel cannot address their strides (K not unit-stride, 128x4 scales not
    contiguous); scales and global scale None for a plain tensor."""
    if isinstance(x, ScaledTensor):
        scales = x.scales.view(torch.uint8)
        if x.scale_layout == "hopper":
            # The kernel addresses each expert's blocks as one dense run, and its tile decode reads each
            # thread's loaded bytes as words: Triton gives the loads that layout only for 16-byte-aligned parts.
            return _aligned(x.data.view(torch.uint8)), _aligned(scales), x.global_scale
        scales = unit_last_stride(scales) if x.scale_layout == "row" else scales.contiguous()
        return unit_last_stride(x.data.view(torch.uint8)), scales, x.global_scale
    return unit_last_stride(x), None, None


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """``t`` if dense and 16-byte aligned, else a dense copy (new allocations are aligned). While torch.compile
    traces, ``t`` (a fake tensor has no address; the custom op's eager call aligns the real one)."""
    if torch.compiler.is_compiling():
        return t
    return t if t.is_contiguous() and t.data_ptr() % 16 == 0 else t.clone(memory_format=torch.contiguous_format)


def _kinds(op: _Operand) -> _Operand:
    """An operand's formats without its tensors (what a plan may keep)."""
    return dataclasses.replace(op, data=None, scales=None, global_scale=None)


class _Plan:
    """The launches of one call signature: per launch its config, group-size class, MMA path and whether it
    reads A decoded ahead. Holds no tensor; each launch binds its compiled kernel at its first run."""

    def __init__(self, call: CheckedCall, out_dtype: torch.dtype, config: BlockScaledMatmulConfig | None):
        a_op, b_op, device = call.a, call.b, call.device
        self.a, self.b = _kinds(a_op), _kinds(b_op)
        self.num_tokens, self.num_experts, self.num_groups = call.num_tokens, call.num_experts, call.num_groups
        self.n, self.k, self.n_out = call.n, call.k, call.n_out
        self.out_dtype, self.device = out_dtype, device
        self.epilogue_kind, self.epilogue_fn = call.epilogue_kind, call.epilogue_fn
        self.glu = call.glu or SwiGLU()  # the kernels' GLU_* constexprs (unread by other epilogues)
        self.has_expert_scales = call.expert_scales is not None
        self.has_bias = call.bias is not None
        self.empty = call.num_tokens == 0 or call.num_groups == 0 or call.n_out == 0
        if config is not None:
            configs = [(config, *ALL_GROUP_SIZES)]
        else:
            weight_bytes = b_op.data.numel() * b_op.data.element_size()
            configs = default_launches(call.num_tokens, call.num_groups, call.n_out, call.k, device, a_op.element,
                                       b_op.element, weight_bytes, call.epilogue_kind == "swiglu", b_op.scale_block,
                                       b_op.scale_layout)
        self.compute_dtype = tl.float16 if a_op.element == "fp16" else tl.bfloat16
        if interpreting():
            # Triton's interpreter multiplies bf16 tiles as raw uint16 bits; decoded tiles are exact in
            # bf16/fp16, so an fp32 dot gives the same products there.
            self.compute_dtype = tl.float32
        # Per launch: does it read A decoded ahead, and which MMA path (checked before anything launches).
        self.launches = []
        self.hopper = b_op.scale_layout == "hopper"
        for launch_config, min_rows, max_rows in configs:
            upcast = _takes_upcast(launch_config, a_op) or (self.hopper and a_op.quantized)
            use_dot_scaled = not self.hopper and _resolve_mma(launch_config, _upcast_view(a_op) if upcast else a_op,
                                                              b_op, device)
            # tl.dot_scaled takes a bf16 operand; tl.dot the compute dtype (both hold A's values exactly)
            upcast_dtype = (tl.bfloat16 if use_dot_scaled else self.compute_dtype) if upcast else None
            self.launches.append(_Launch(launch_config, min_rows, max_rows, use_dot_scaled, upcast_dtype))
        # A decoded ahead, per dtype, shared by the launches that read it
        self.upcasts = {launch.upcast_dtype: _Upcast(self.a, launch.upcast_dtype, self.num_tokens, self.k, device)
                        for launch in self.launches if launch.upcast_dtype is not None}

    def __call__(self, a, b, a_offsets, expert_ids, expert_scales, bias, out, out_checked: bool) -> torch.Tensor:
        """``out_checked``: False when ``out`` was given to a cached plan (whether it shares memory with an
        input is checked here, on the tensors the kernel reads, before any launch)."""
        a_data, a_scales, a_global_scale = _operand_tensors(a)
        b_data, b_scales, b_global_scale = _operand_tensors(b)
        if out is None:
            out = runtime.new_buffer((self.num_tokens, self.n_out), self.out_dtype, self.device)
        elif not out_checked:
            check_out(out, out.shape, out.dtype, a=a_data, a_scales=a_scales, b=b_data, b_scales=b_scales,
                      a_offsets=a_offsets, expert_ids=expert_ids, expert_scales=expert_scales, bias=bias)
        if self.empty:
            return out
        # The kernel reads the metadata as dense vectors: views of any strides are copied (a few bytes).
        a_offsets, expert_ids = a_offsets.contiguous(), expert_ids.contiguous()
        expert_scales = expert_scales.contiguous() if expert_scales is not None else None
        a_scale_offsets = a.group_scale_offsets if isinstance(a, ScaledTensor) else None
        a_scale_offsets = a_scale_offsets.contiguous() if a_scale_offsets is not None else None
        # The kernel stores unit-stride rows; another out gets the result through a copy of itself (rows
        # outside every group keep their values).
        target = unit_last_stride(out)
        decoded = {dtype: upcast(a_data, a_scales) for dtype, upcast in self.upcasts.items()}
        dummy = a_offsets  # for the pointers a compiled variant never reads
        b_parts = (b_data, b_scales if b_scales is not None else dummy,
                   b_global_scale if b_global_scale is not None else dummy)
        bias = unit_last_stride(bias) if bias is not None else dummy
        rest = (target, a_offsets, a_scale_offsets if a_scale_offsets is not None else dummy, expert_ids,
                expert_scales if expert_scales is not None else dummy, bias)
        a_global_part = a_global_scale if a_global_scale is not None else dummy
        for launch in self.launches:
            if launch.upcast_dtype is None:
                a_parts = (a_data, a_scales if a_scales is not None else dummy, a_global_part)
            else:
                a_parts = (decoded[launch.upcast_dtype], dummy, a_global_part)
            pointers = (*a_parts, *b_parts, *rest)
            (launch.bound or launch.bind(self, pointers))(*pointers)
        if target is not out:
            out.copy_(target)
        return out


class _Launch:
    """One persistent launch over the groups of ``min_rows < rows <= max_rows``."""

    def __init__(self, config: BlockScaledMatmulConfig, min_rows: int, max_rows: int, use_dot_scaled: bool,
                 upcast_dtype):
        self.config, self.min_rows, self.max_rows = config, min_rows, max_rows
        self.use_dot_scaled, self.upcast_dtype = use_dot_scaled, upcast_dtype
        self.bound = None

    def bind(self, plan: _Plan, pointers: tuple) -> BoundKernel:
        """The compiled kernel, bound on the first call's tensors (``pointers`` in the kernel's order)."""
        if plan.hopper:
            return self._bind_hopper(plan, pointers)
        a_data, a_scales, a_global_scale, b_data, b_scales, _, out, *_, bias = pointers
        if self.upcast_dtype is None:
            a_op = dataclasses.replace(plan.a, data=a_data, scales=a_scales)
        else:  # A decoded ahead: plain, loaded by its pointer's dtype, with A's global scale for the epilogue
            element = "fp16" if a_data.dtype == torch.float16 else "bf16"
            a_op = _Operand(a_data, None, None, element, "none", 1, "row", element)
        a_op = dataclasses.replace(a_op, global_scale=a_global_scale if plan.a.has_global_scale else None)
        b_op = dataclasses.replace(plan.b, data=b_data, scales=b_scales)
        config, k = self.config, plan.k
        num_tokens, num_groups, n_out = plan.num_tokens, plan.num_groups, plan.n_out
        max_tiles = (-(-num_tokens // config.block_m) + num_groups) * -(-n_out // config.block_n)
        num_programs = min(config.num_programs or num_programs_hint(plan.device), max_tiles)
        a_row_scales = a_op.quantized and a_op.scale_layout == "row"
        b_row_scales = b_op.quantized and b_op.scale_layout == "row"
        self.bound = bind(
            kernel.grouped_matmul_kernel, (num_programs,), *pointers,
            a_data.stride(0), a_scales.stride(0) if a_row_scales else 0,
            b_data.stride(0), b_data.stride(1),
            b_scales.stride(0) if b_row_scales else 0, b_scales.stride(1) if b_row_scales else 0,
            out.stride(0), bias.stride(0) if plan.has_bias else 0,
            num_tokens, num_groups, plan.num_experts, plan.n, k, self.min_rows, self.max_rows,
            a_scales.shape[0] if a_op.scale_layout == "128x4_grouped" else 0,
            A_ELEMENT=a_op.element, A_SCALE=a_op.scale, A_SCALE_BLOCK=a_op.scale_block,
            A_SCALE_LAYOUT=a_op.scale_layout,
            B_ELEMENT=b_op.element, B_SCALE=b_op.scale, B_SCALE_BLOCK=b_op.scale_block,
            B_SCALE_LAYOUT=b_op.scale_layout,
            A_GLOBAL_SCALE=plan.a.has_global_scale, B_GLOBAL_SCALE=plan.b.has_global_scale,
            HAS_EXPERT_SCALES=plan.has_expert_scales, EPILOGUE=plan.epilogue_kind, EPILOGUE_FN=plan.epilogue_fn,
            HAS_BIAS=plan.has_bias, GLU_ALPHA=plan.glu.alpha, GLU_LIMIT=plan.glu.limit,
            GLU_UP_SHIFT=plan.glu.up_shift, GLU_INTERLEAVED=plan.glu.interleaved,
            USE_DOT_SCALED=self.use_dot_scaled, SWAP_AB=config.ab_swapped, PREFETCH_SCALES=config.prefetch_scales,
            SCALE_WORDS=config.scale_words and _scale_words(a_op, config.block_k, k)
            and _scale_words(b_op, config.block_k, k),
            PACKED_DECODE=_packed_decode(plan.compute_dtype, plan.device),
            RETIRE_MMA=_retire_mma(plan.device, (b_op if config.ab_swapped else a_op).element not in ("bf16", "fp16")),
            COMPUTE_DTYPE=plan.compute_dtype, BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
            BLOCK_GROUPS=max(16, next_power_of_2(num_groups)),
            num_warps=config.num_warps, num_stages=config.num_stages,
        )
        return self.bound

    def _bind_hopper(self, plan: _Plan, pointers: tuple) -> BoundKernel:
        """The kernel for weights in the hopper layout (``hopper_kernel``), on the grouped kernel's pointers."""
        (a_data, _, a_global_scale, b_data, b_scales, b_global_scale, out, a_offsets, _, expert_ids, expert_scales,
         bias) = pointers
        config = self.config
        # An upper bound of the launch's (group, M tile) pairs: each holds at least one of the T rows, and
        # there are at most cdiv(T, block_m) plus one per group of this launch's size class, of which there
        # are at most T / (min_rows + 1). The programs past the last return at once, but an empty class
        # launched over cdiv(T, block_m) + G tiles cost 15 us (E128 x 1 token, H100).
        class_groups = plan.num_groups if self.min_rows < 0 else min(plan.num_groups,
                                                                     plan.num_tokens // (self.min_rows + 1))
        m_tiles = min(-(-plan.num_tokens // config.block_m) + class_groups, plan.num_tokens)
        grid = (m_tiles * -(-plan.n_out // config.block_n),)
        bound = bind(
            hopper_kernel.hopper_fp4_matmul_kernel, grid, a_data, a_global_scale, b_data, b_scales, b_global_scale,
            out, a_offsets, expert_ids, expert_scales, bias, a_data.stride(0), b_data.stride(0), b_scales.stride(0),
            out.stride(0), bias.stride(0) if plan.has_bias else 0, plan.num_tokens, plan.num_groups,
            plan.num_experts, plan.n, plan.k, self.min_rows, self.max_rows, B_SCALE=plan.b.scale,
            A_GLOBAL_SCALE=plan.a.has_global_scale, B_GLOBAL_SCALE=plan.b.has_global_scale,
            HAS_EXPERT_SCALES=plan.has_expert_scales, EPILOGUE=plan.epilogue_kind, EPILOGUE_FN=plan.epilogue_fn,
            HAS_BIAS=plan.has_bias, GLU_ALPHA=plan.glu.alpha, GLU_LIMIT=plan.glu.limit,
            GLU_UP_SHIFT=plan.glu.up_shift, EVEN_K=plan.k % config.block_k == 0,
            PACKED_DECODE=_packed_decode(plan.compute_dtype, plan.device),
            RETIRE_MMA=_retire_mma(plan.device, True), COMPUTE_DTYPE=plan.compute_dtype,
            BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
            BLOCK_GROUPS=max(16, next_power_of_2(plan.num_groups)),
            num_warps=config.num_warps, num_stages=config.num_stages,
        )
        # the grouped kernel's pointer order, as the plan calls every launch
        self.bound = lambda a, a_s, a_g, b, b_s, b_g, o, offsets, a_so, ids, scales, bias: bound(
            a, a_g, b, b_s, b_g, o, offsets, ids, scales, bias)
        return self.bound


_UPCAST_TILE = (16, 256, 4)  # rows, K columns, warps of one upcast program (memory bound)


def _takes_upcast(config: BlockScaledMatmulConfig, a: _Operand) -> bool:
    """Whether a launch reads A decoded ahead (``config.upcast_a``); A scales padded per group
    (``128x4_grouped``) keep the fused decode."""
    return config.upcast_a and a.quantized and a.scale_layout != "128x4_grouped"


def _upcast_view(a: _Operand) -> _Operand:
    """What the kernel sees of A decoded ahead (data not yet made): plain bf16 with A's global scale."""
    return _Operand(None, None, a.global_scale, "bf16", "none", 1, "row", "bf16")


def _packed_decode(compute_dtype, device: torch.device) -> bool:
    """Whether e2m1 tiles take the packed PTX decode: bf16 tiles compiled for an NVIDIA GPU."""
    return (compute_dtype == tl.bfloat16 and device.type == "cuda"
            and torch.version.hip is None and not interpreting())


def _retire_mma(device: torch.device, decoded_left_operand: bool) -> bool:
    """Whether each K step waits for its wgmmas (``kernel.retire_mma``): on Hopper under Triton < 3.9 when
    the MMA's left operand is decoded in registers. Triton 3.6's PTX leaves such wgmmas reading registers
    that the next step overwrites (``tools/sass_hazards.py`` finds it in its SASS); 3.9's PTX waits for
    them itself. 3.7 and 3.8 are not checked, so they take the wait too."""
    return (decoded_left_operand and device.type == "cuda" and torch.version.hip is None and not interpreting()
            and cuda_capability(device)[0] == 9 and runtime._triton_version() < (3, 9))


class _Upcast:
    """The pre-pass that decodes a quantized A: its elements times their block scales, ``[T, K]`` in the
    compute dtype (float32 in the interpreter)."""

    def __init__(self, a: _Operand, compute_dtype, num_tokens: int, k: int, device: torch.device):
        self.a, self.num_tokens, self.k, self.device = a, num_tokens, k, device
        self.compute_dtype = compute_dtype
        self.dtype = {tl.bfloat16: torch.bfloat16, tl.float16: torch.float16, tl.float32: torch.float32}[compute_dtype]
        self.bound = None

    def __call__(self, a_data: torch.Tensor, a_scales: torch.Tensor) -> torch.Tensor:
        values = runtime.new_buffer((self.num_tokens, self.k), self.dtype, self.device)
        (self.bound or self._bind(a_data, a_scales, values))(a_data, a_scales, values)
        return values

    def _bind(self, a_data, a_scales, values) -> BoundKernel:
        a = self.a
        block_rows, block_k, num_warps = _UPCAST_TILE
        self.bound = bind(
            upcast_rows_kernel, (triton.cdiv(self.num_tokens, block_rows), triton.cdiv(self.k, block_k)),
            a_data, a_scales, values, a_data.stride(0), a_scales.stride(0) if a.scale_layout == "row" else 0,
            values.stride(0), self.num_tokens, self.k,
            ELEMENT=a.element, SCALE=a.scale, SCALE_BLOCK=a.scale_block, SCALE_LAYOUT=a.scale_layout,
            PACKED_DECODE=_packed_decode(self.compute_dtype, self.device), BLOCK_ROWS=block_rows, BLOCK_K=block_k,
            num_warps=num_warps,
        )
        return self.bound


def _scale_words(op: _Operand, block_k: int, k: int) -> bool:
    """Whether the kernel may read op's scales as int32 words of four scale columns (``SCALE_WORDS``):
    every word must start 4-byte aligned and hold four columns of this row inside K."""
    if not op.quantized:
        return True
    columns_per_step, columns = block_k // op.scale_block, k // op.scale_block
    aligned = op.scales.data_ptr() % 4 == 0 and (
        op.scale_layout != "row" or all(stride % 4 == 0 for stride in op.scales.stride()[:-1]))
    return columns_per_step % 4 == 0 and columns % 4 == 0 and aligned
