"""The checks of :func:`llmkernels.grouped_matmul`: every argument once, before anything launches, and what they found
(:class:`CheckedCall`, what the plan and its backends are chosen from)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ..formats import ScaledTensor
from ..formats.layouts import HOPPER, ROW, Layout
from ..runtime import (
    check_device,
    check_out,
    describe,
    first_bad_prefix_sum,
    first_true,
    forward_only,
    interpreting,
    unit_last_stride,
)
from .config import FP8_BLOCK_K, HOPPER_MIN_BLOCK_K, BlockScaledMatmulConfig
from .epilogue import EPILOGUES, SwiGLU

__all__ = [
    "Operand",
    "CheckedCall",
    "check_grouped_matmul",
    "check_metadata_values",
    "operand_tensors",
    "PLAIN_DTYPES",
    "OUT_DTYPES",
    "BIAS_DTYPES",
    "OFFSET_DTYPES",
    "FP8_ACTIVATIONS",
]

BIAS_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
PLAIN_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16"}
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
OFFSET_DTYPES = (torch.int32, torch.uint32)


@dataclass(frozen=True)
class Operand:
    """What a kernel needs to know of ``a`` or ``b`` (no tensor).

    Attributes:
        element: ``"bf16"``, ``"fp16"``, ``"e4m3"`` or ``"e2m1"``.
        scale: ``"none"``, ``"e8m0"``, ``"e4m3"`` or ``"f32"`` (fp8 blocks); scale_block: elements per scale along
            K (1 without scales).
        scale_layout: the scales' :class:`~llmkernels.formats.layouts.Layout` (the row layout for a plain tensor).
        format: ``"bf16"``, ``"fp16"`` or the block-scaled format's name.
        has_global_scale: a float32 per-tensor scale multiplies the product (NVFP4).
        scale_words_aligned: the scales start 4-byte aligned, and so do the rows of row-layout scales (what
            reading them as int32 words needs, :func:`~llmkernels.grouped_matmul.config.reads_scale_words`).
        block_rows: rows per scale: 1 for activations and every MX / NVFP4 operand, 128 for fp8 weights (one
            scale per 128 x 128 tile).
    """

    element: str
    scale: str
    scale_block: int
    scale_layout: Layout
    format: str
    has_global_scale: bool = False
    scale_words_aligned: bool = True
    block_rows: int = 1

    @property
    def quantized(self) -> bool:
        return self.scale != "none"

    @classmethod
    def plain(cls, element: str, has_global_scale: bool = False) -> Operand:
        """A plain ``element`` operand (``"bf16"`` or ``"fp16"``): what a quantized A decoded ahead is, keeping its
        global scale for the epilogue."""
        return cls(element, "none", 1, ROW, element, has_global_scale)


FP8_ACTIVATIONS = Operand("e4m3", "f32", FP8_BLOCK_K, ROW, "fp8")
"""An fp8 ``block=(1, 128)`` A: what a checkpoint's activations are and what bf16/fp16 ``a`` with fp8 weights is
quantized to ahead of the matmul."""


@dataclass(frozen=True)
class CheckedCall:
    """What :func:`check_grouped_matmul` found: the operands as the kernels read them, sizes, the epilogue, and the
    call's metadata tensors made dense (None in a call described without its tensors: :meth:`described`, what a
    plan keeps, and the ahead-of-time compile tools)."""

    a: Operand
    b: Operand
    num_tokens: int
    k: int
    num_experts: int
    n: int
    n_out: int
    num_groups: int
    device: torch.device
    out_dtype: torch.dtype = torch.bfloat16
    epilogue_kind: str = "none"  # "none", "silu", "gelu", "swiglu" or "user"
    epilogue_fn: object = None  # the user's @triton.jit epilogue
    glu: SwiGLU | None = None
    has_expert_scales: bool = False
    bias_dtype: torch.dtype | None = None
    weight_bytes: int = 0  # of b's data as the kernels read it
    offsets_dtype: torch.dtype = torch.int32
    a_offsets: torch.Tensor | None = None
    expert_ids: torch.Tensor | None = None
    expert_scales: torch.Tensor | None = None
    a_scale_offsets: torch.Tensor | None = None
    bias: torch.Tensor | None = None

    @property
    def has_bias(self) -> bool:
        return self.bias_dtype is not None

    @property
    def empty(self) -> bool:
        """Nothing to compute: no tokens, no groups or no output columns."""
        return self.num_tokens == 0 or self.num_groups == 0 or self.n_out == 0

    def described(self) -> CheckedCall:
        """The call without its tensors (what a plan may keep)."""
        return dataclasses.replace(
            self, a_offsets=None, expert_ids=None, expert_scales=None, a_scale_offsets=None, bias=None
        )


def operand_tensors(x) -> tuple:
    """``(data, scales, global_scale)`` of a checked operand as the kernels read them: data and scales as bytes,
    copied where the kernels cannot address their strides (K not unit-stride, tiled scales not contiguous, a
    rearranged layout not dense and 16-byte aligned); scales and global scale None for a plain tensor."""
    if isinstance(x, ScaledTensor):
        if x.spec.scale == "f32":  # fp8 blocks: float32 scales, read with any strides
            return unit_last_stride(x.data.view(torch.uint8)), x.scales, None
        scales = x.scales.view(torch.uint8)
        if x.scale_layout.rearranges_data:
            # The kernel addresses each expert's blocks as one dense run, and its tile decode reads each
            # thread's loaded bytes as words: Triton gives the loads that layout only for 16-byte-aligned parts.
            return _aligned(x.data.view(torch.uint8)), _aligned(scales), x.global_scale
        scales = unit_last_stride(scales) if x.scale_layout.strided else scales.contiguous()
        return unit_last_stride(x.data.view(torch.uint8)), scales, x.global_scale
    return unit_last_stride(x), None, None


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """``t`` if dense and 16-byte aligned, else a dense copy (new allocations are aligned). While torch.compile
    traces, ``t`` (a fake tensor has no address; the custom op's eager call aligns the real one)."""
    if torch.compiler.is_compiling():
        return t
    return t if t.is_contiguous() and t.data_ptr() % 16 == 0 else t.clone(memory_format=torch.contiguous_format)


def _operand(x, name: str, dims: int) -> tuple:
    """``(Operand, data, scales, global_scale)`` of ``a`` or ``b``: its kinds and its tensors as the kernels read
    them (:func:`operand_tensors`). Any strides are accepted."""
    if isinstance(x, ScaledTensor):
        x.validate()
        if x.dim() != dims:
            raise ValueError(f"{name} must be {dims}D, got logical shape {tuple(x.shape)}")
        if x.scale_layout.rearranges_data and name == "a":
            raise ValueError(
                f"a is in the {x.scale_layout} layout, a layout of weights: pass a with {ROW} or 128x4 scales"
            )
        data, scales, global_scale = operand_tensors(x)
        words_aligned = (
            torch.compiler.is_compiling()
            or x.spec.scale == "f32"
            or (
                scales.data_ptr() % 4 == 0
                and (not x.scale_layout.strided or all(stride % 4 == 0 for stride in scales.stride()[:-1]))
            )
        )
        spec = x.spec
        operand = Operand(
            spec.element,
            spec.scale,
            spec.block,
            x.scale_layout,
            x.format,
            global_scale is not None,
            words_aligned,
            x.block[0],
        )
        return operand, data, scales, global_scale
    if isinstance(x, torch.Tensor):
        if x.dtype not in PLAIN_DTYPES:
            raise TypeError(f"{name} must be a ScaledTensor or a bf16/fp16 tensor, got {x.dtype}")
        if x.dim() != dims:
            raise ValueError(f"{name} must be {dims}D, got shape {tuple(x.shape)}")
        return Operand.plain(PLAIN_DTYPES[x.dtype]), unit_last_stride(x), None, None
    raise TypeError(f"{name} must be a ScaledTensor or a torch.Tensor, got {type(x).__name__}")


def _describe(x: Operand) -> str:
    return f"fp8 block=({x.block_rows}, {x.scale_block})" if x.format == "fp8" else x.format


def _check_format_pair(a: Operand, b: Operand) -> None:
    if a.format == "fp8" and a.block_rows == 1 and b.format == "mxfp4":
        # w4a8: fp8 (1, 128) activations with MXFP4 weights whose scale rows the kernel addresses
        if b.scale_layout.expert_scale_rows is None:
            raise TypeError(
                f"unsupported format pair a=fp8 block=(1, 128), b=mxfp4 in the {b.scale_layout} layout: fp8 "
                f"activations take MXFP4 weights with {ROW} or 128x4 scales"
            )
        return
    if "fp8" in (a.format, b.format):
        # fp8 blocks pair only as their checkpoints store them: (1, 128) activations (or bf16/fp16 ones, which
        # the call quantizes so) with (128, 128) weights.
        a_ok = (a.format == "fp8" and a.block_rows == 1) or not a.quantized
        b_ok = b.format == "fp8" and b.block_rows == FP8_BLOCK_K and b.scale_block == FP8_BLOCK_K
        if not (a_ok and b_ok):
            raise TypeError(
                f"unsupported format pair a={_describe(a)}, b={_describe(b)}: fp8 weights take block=(128, 128) "
                f"with fp8 block=(1, 128) or bf16/fp16 activations; fp8 block=(1, 128) activations take those or "
                f"mxfp4 weights"
            )
        return
    if not a.quantized:
        if not b.quantized and b.element != a.element:
            raise TypeError(f"a is {a.format} but b is {b.format}: plain operands must share a dtype")
        return
    if not b.quantized:
        raise TypeError(f"a is {a.format} but b is plain {b.format}: quantized activations need quantized weights")
    if (a.format == "nvfp4") != (b.format == "nvfp4"):
        raise TypeError(f"unsupported format pair a={a.format}, b={b.format}: nvfp4 pairs only with nvfp4")


def _check_fp8_config(config) -> None:
    if config is not None and config.block_k != FP8_BLOCK_K:
        raise ValueError(
            f"fp8 launches step K one 128-wide scale block at a time: config.block_k must be {FP8_BLOCK_K}, "
            f"got {config.block_k}"
        )


def _check_w4a8_config(config) -> None:
    if config is not None and config.block_k > FP8_BLOCK_K:
        raise ValueError(
            f"fp8 block=(1, 128) activations scale each K step by one scale of a: config.block_k must divide "
            f"{FP8_BLOCK_K}, got {config.block_k}"
        )


def _check_metadata(a_offsets, expert_ids, expert_scales, num_experts: int) -> int:
    if not isinstance(a_offsets, torch.Tensor) or a_offsets.dtype not in OFFSET_DTYPES or a_offsets.dim() != 1:
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


def _check_hopper_weights(a: Operand, b: Operand, n_out: int, epilogue_kind: str, config, device) -> None:
    """What the kernel for weights in the Hopper layout takes: bf16 activations or quantized ones it decodes
    ahead to bf16 (row or 128x4 scales), SwiGLU halves on whole row blocks of the layout, K steps of whole
    64-wide chunks, at least 64 weight rows per MMA on the GPU."""
    if a.element == "fp16":
        raise TypeError(f"b in the {b.scale_layout} layout decodes to bf16: a must be bf16 or a ScaledTensor, not fp16")
    if a.scale_layout.grouped:
        raise ValueError(
            f"b in the {b.scale_layout} layout takes a quantized a decoded ahead, which needs {ROW} or "
            f"ungrouped 128x4 scales, not scales padded per group"
        )
    rows_per_block = b.scale_layout.rows_per_block
    if epilogue_kind == "swiglu" and n_out % rows_per_block:
        raise ValueError(
            f"swiglu on b in the {b.scale_layout} layout needs N / 2 to be a multiple of "
            f"{rows_per_block} (the layout's row blocks), got N / 2 = {n_out}"
        )
    if config is not None and (config.block_k < HOPPER_MIN_BLOCK_K or config.mma == "dot_scaled"):
        raise ValueError(
            f"b in the {b.scale_layout} layout needs config.block_k >= {HOPPER_MIN_BLOCK_K} (its 64-wide "
            f"K chunks) and mma 'auto' or 'dequant', got block_k={config.block_k}, mma={config.mma!r}"
        )
    if config is not None and config.block_n < 64 and device.type == "cuda" and not interpreting():
        # wgmma's M is 64 rows: SwiGLU halves of 32 rows gave wrong results on the H100 (lab/NOTES.md);
        # the interpreter, which has no wgmma, runs 32-row tiles.
        raise ValueError(
            f"b in the {b.scale_layout} layout needs config.block_n >= 64 on the GPU (weight rows per "
            f"MMA; under swiglu per half), got block_n={config.block_n}"
        )


def _epilogue_kind(epilogue) -> tuple[str, object, SwiGLU | None]:
    """``(kind, user function, SwiGLU parameters)`` of an ``epilogue`` argument."""
    if epilogue is None:
        return "none", None, None
    if isinstance(epilogue, SwiGLU):
        return "swiglu", None, epilogue
    if isinstance(epilogue, str):
        if epilogue not in EPILOGUES:
            raise ValueError(
                f"epilogue must be None, one of {EPILOGUES}, a SwiGLU or a @triton.jit function, got {epilogue!r}"
            )
        return epilogue, None, SwiGLU() if epilogue == "swiglu" else None
    if callable(getattr(epilogue, "fn", None)):  # a @triton.jit function (or its interpreted twin)
        return "user", epilogue, None
    raise TypeError(
        f"epilogue must be None, one of {EPILOGUES}, a SwiGLU or a @triton.jit function, got {type(epilogue).__name__}"
    )


def _check_bias(bias, num_experts: int, n: int) -> None:
    if bias is None:
        return
    if not isinstance(bias, torch.Tensor) or bias.dtype not in BIAS_DTYPES:
        raise TypeError(f"bias must be a float32, bf16 or fp16 tensor, got {describe(bias)}")
    if tuple(bias.shape) != (num_experts, n):
        raise ValueError(
            f"bias must have shape (E, N) = ({num_experts}, {n}) (one row per expert, in b's row "
            f"order), got {tuple(bias.shape)}"
        )


def check_grouped_matmul(
    a, b, a_offsets, expert_ids, expert_scales, epilogue, out_dtype, out, config, bias=None
) -> CheckedCall:
    """The checks of :func:`llmkernels.grouped_matmul` (no launch, no sync; safe while torch.compile traces).

    Raises:
        TypeError / ValueError: as :func:`llmkernels.grouped_matmul` documents, naming the argument.
    """
    a_op, a_data, a_scales, a_global_scale = _operand(a, "a", 2)
    b_op, b_data, b_scales, b_global_scale = _operand(b, "b", 3)
    _check_format_pair(a_op, b_op)
    forward_only(
        "grouped_matmul",
        a=a_data,
        a_scales=a_scales,
        a_global_scale=a_global_scale,
        b=b_data,
        b_scales=b_scales,
        b_global_scale=b_global_scale,
        expert_scales=expert_scales,
        bias=bias,
        out=out,
    )
    num_tokens, k = a.shape
    num_experts, n, k_b = b.shape
    if k != k_b:
        raise ValueError(f"a has K = {k} but b has K = {k_b}")
    num_groups = _check_metadata(a_offsets, expert_ids, expert_scales, num_experts)
    epilogue_kind, epilogue_fn, glu = _epilogue_kind(epilogue)
    if epilogue_kind == "swiglu" and n % 2:
        raise ValueError(f"swiglu needs an even N (gate and up halves), got N = {n}")
    if glu is not None and glu.interleaved and b_op.scale_layout is not ROW:
        raise ValueError(
            f"SwiGLU(interleaved=True) reads gate and up rows in place, which b's "
            f"{b_op.scale_layout} layout cannot address: de-interleave b's rows into [gate | up] "
            f"halves before making that layout"
        )
    _check_bias(bias, num_experts, n)
    n_out = n // 2 if epilogue_kind == "swiglu" else n
    if out_dtype not in OUT_DTYPES:
        raise TypeError(f"out_dtype must be bf16, fp16 or fp32, got {out_dtype}")
    if config is not None and not isinstance(config, BlockScaledMatmulConfig):
        raise TypeError(f"config must be a BlockScaledMatmulConfig, got {type(config).__name__}")
    if b_op.scale_layout is HOPPER:
        _check_hopper_weights(a_op, b_op, n_out, epilogue_kind, config, a_data.device)
    if b_op.format == "fp8":
        _check_fp8_config(config)
    elif a_op.format == "fp8":
        _check_w4a8_config(config)
    if out is not None:
        check_out(
            out,
            (num_tokens, n_out),
            out_dtype,
            a=a_data,
            a_scales=a_scales,
            b=b_data,
            b_scales=b_scales,
            a_offsets=a_offsets,
            expert_ids=expert_ids,
            expert_scales=expert_scales,
            bias=bias,
        )
    a_scale_offsets = a.group_scale_offsets if isinstance(a, ScaledTensor) else None
    device = check_device(
        a=a_data,
        a_scales=a_scales,
        b=b_data,
        b_scales=b_scales,
        a_offsets=a_offsets,
        expert_ids=expert_ids,
        expert_scales=expert_scales,
        bias=bias,
        out=out,
        a_scale_offsets=a_scale_offsets,
        a_global_scale=a_global_scale,
        b_global_scale=b_global_scale,
    )
    if a_scale_offsets is not None and a_scale_offsets.numel() != num_groups:
        raise ValueError(f"a's group_scale_offsets has {a_scale_offsets.numel()} entries for {num_groups} groups")
    # The kernel reads the metadata as dense vectors: views of any strides are copied (a few bytes).
    return CheckedCall(
        a_op,
        b_op,
        num_tokens,
        k,
        num_experts,
        n,
        n_out,
        num_groups,
        device,
        out_dtype,
        epilogue_kind,
        epilogue_fn,
        glu,
        expert_scales is not None,
        bias.dtype if bias is not None else None,
        b_data.numel() * b_data.element_size(),
        a_offsets.dtype,
        a_offsets.contiguous(),
        expert_ids.contiguous(),
        expert_scales.contiguous() if expert_scales is not None else None,
        a_scale_offsets.contiguous() if a_scale_offsets is not None else None,
        unit_last_stride(bias) if bias is not None else None,
    )


def check_metadata_values(a_offsets, expert_ids, num_tokens: int, num_experts: int, a=None) -> None:
    """The checks that read the metadata's values (one sync; ``validate=True``): offsets start at 0, never
    decrease and stay within the ``num_tokens`` rows, expert ids lie in ``[-1, num_experts)``, and a ScaledTensor
    ``a`` with scales padded per group was padded for these offsets.

    Raises:
        ValueError: naming the first bad entry.
    """
    offsets = a_offsets.to(torch.int64).cpu()
    i = first_bad_prefix_sum(offsets, num_tokens)
    if i == 0:
        raise ValueError(f"a_offsets[0] must be 0, got {int(offsets[0])}")
    if i is not None and offsets[i] > num_tokens:
        raise ValueError(f"a_offsets[{i}] = {int(offsets[i])} exceeds the {num_tokens} rows of a")
    if i is not None:
        raise ValueError(
            f"a_offsets must be non-decreasing: a_offsets[{i}] = {int(offsets[i])} < "
            f"a_offsets[{i - 1}] = {int(offsets[i - 1])}"
        )
    ids = expert_ids.cpu()
    bad_id = first_true((ids < -1) | (ids >= num_experts))
    if bad_id is not None:
        i = bad_id[0]
        raise ValueError(f"expert_ids must lie in [-1, {num_experts}): expert_ids[{i}] = {int(ids[i])}")
    if (
        isinstance(a, ScaledTensor)
        and a.group_offsets is not None
        and not torch.equal(a.group_offsets.to(torch.int64).cpu(), offsets)
    ):
        raise ValueError("a's scales were laid out for other group offsets than a_offsets")
