"""LAB host side of the e4m3 mode (w4a8): FP8 (1, 128)-block activations x MXFP4 expert weights on Hopper's FP8
tensor cores. The kernel and the weight preparation are the product's (``llmkernels.grouped_matmul.
gluon_w4a8_kernel`` and ``w4a8_prepare``: their docstrings and NOTES.md, "e4m3 mode", say how they work); what
stays here is the lab's: its configs (tile, stages, reference) for the bench's sweep, the ahead-of-time compile
signature, a float64 reference on the emulated decode, and a launcher that takes a config (the product runs one
tile, through ``lk.grouped_matmul``'s ``w4a8_hopper`` backend).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from llmkernels.grouped_matmul.gluon_w4a8_kernel import MAX_REGS, W_BOX, a_layout_shared, w_layout_shared
from llmkernels.grouped_matmul.gluon_w4a8_kernel import w4a8_hopper_kernel as w4a8_gluon_kernel
from llmkernels.grouped_matmul.w4a8_prepare import (  # noqa: F401 - the bench's and the scripts' names
    D_MAX,
    D_MIN,
    PreparedW4A8,
    emulate_decode,
    prepare_weights,
)


@dataclass(frozen=True)
class W4A8Config:
    """``stages``: the TMA ring's depth (24 KB a stage at 128 tokens: 16 KB of e4m3 activations + 8 KB of packed
    weights); ``block_t``: tokens per tile (wgmma's N: 64 or 128; 256 would need 256 accumulator registers);
    ``reference``: the :func:`prepare_weights` reference the weights were prepared with."""

    stages: int = 6
    block_t: int = 128
    reference: str = "row"
    mode: str = "e4m3"

    @property
    def a_box(self) -> list:
        return [self.block_t, 64]

    @property
    def label(self) -> str:
        return f"gluon-w4 e4m3 128x{self.block_t}x128 s{self.stages} {self.reference}-ref"


CONFIGS = [
    W4A8Config(6),
    W4A8Config(4),
    W4A8Config(6, reference="step"),
    W4A8Config(8, block_t=64),
]
LAST_COMPILED = {}


def descriptor_types(config: W4A8Config) -> dict:
    return dict(
        a_ptr=f"tensordesc<fp8e4nv[{', '.join(map(str, config.a_box))}],{a_layout_shared(config.a_box)!r}>",
        b_ptr=f"tensordesc<i32[{', '.join(map(str, W_BOX))}],{w_layout_shared()!r}>",
    )


def compile_signature(config: W4A8Config):
    names = w4a8_gluon_kernel.arg_names
    types = dict(
        descriptor_types(config),
        a_scales_ptr="*fp32",
        b_scales_ptr="*i32",  # the prepared tables
        b_global_scale_ptr="*fp32",  # the prepared row factors
        out_ptr="*bf16",
        a_offsets_ptr="*i32",
        expert_ids_ptr="*i32",
    )
    constexprs = dict(STAGES=config.stages, STEP_REFERENCE=config.reference == "step")
    signature = {name: ("constexpr" if name in constexprs else types.get(name, "i32")) for name in names}
    return signature, constexprs


def reference_matmul(a, w: PreparedW4A8, a_offsets, expert_ids, out_rows=None):
    """float64 ``[T, N]``: the fp8 activations (dequantized) times :func:`emulate_decode` per group; zero rows for
    expert -1 and rows past ``a_offsets[G]``."""
    from llmkernels import dequantize

    a64 = dequantize(a).double()
    weights = emulate_decode(w).double()
    out = torch.zeros(a64.shape[0], w.shape[1], dtype=torch.float64, device=a64.device)
    offsets = a_offsets.tolist()
    for g, e in enumerate(expert_ids.tolist()):
        if e >= 0:
            out[offsets[g] : offsets[g + 1]] = a64[offsets[g] : offsets[g + 1]] @ weights[e].T
    return out


def w4a8_grouped_matmul_gluon(a, w, a_offsets, expert_ids, out=None, config=None):
    """``out[rows of g] = dequantize(a)[rows of g] @ W[expert_ids[g]]ᵀ`` on an sm_90 GPU, W the weights as
    :func:`emulate_decode` gives them (``dequantize(w)`` exactly unless ``prepare_weights`` rounded blocks).

    a: FP8 ScaledTensor ``[T, K]`` (float8_e4m3fn data, fp32 scales ``[T, ceil(K/128)]``, block (1, 128)); w:
    :class:`PreparedW4A8` (or an MXFP4 ScaledTensor ``[E, N, K]``, prepared here with the config's reference);
    a_offsets int32 ``[G + 1]`` (non-decreasing, a_offsets[0] = 0), expert_ids int32 ``[G]`` (-1 → zero rows); out
    bf16 ``[T, N]`` (rows past ``a_offsets[G]`` untouched). K a multiple of 64, N of 128. Raises ValueError on
    other shapes, dtypes or blocks, before any launch."""
    config = config or CONFIGS[0]
    if config.block_t not in (64, 128) or config.stages < 2:
        raise ValueError(f"config: block_t must be 64 or 128 and stages >= 2, got {config}")
    if not isinstance(w, PreparedW4A8):
        w = prepare_weights(w, reference=config.reference)
    if w.reference != config.reference:
        raise ValueError(f"w: prepared with reference {w.reference!r}, config wants {config.reference!r}")
    if getattr(a, "spec", None) is None or a.spec.name != "fp8" or tuple(a.block) != (1, 128) or a.dim() != 2:
        raise ValueError("a: must be an FP8 ScaledTensor [T, K] with block (1, 128)")
    num_experts, n, k = w.shape
    data, scales = a.data, a.scales
    num_tokens = data.shape[0]
    if data.shape[1] != k or k % 64 or n % 128:
        raise ValueError(f"a: K must be w's K ({k}) and a multiple of 64 (N of 128), got a {tuple(data.shape)}")
    num_groups = expert_ids.numel()
    if a_offsets.numel() != num_groups + 1 or a_offsets.dtype != torch.int32 or expert_ids.dtype != torch.int32:
        raise ValueError("a_offsets: must be int32 [G + 1] with expert_ids int32 [G]")
    if out is None:
        out = torch.empty(num_tokens, n, dtype=torch.bfloat16, device=data.device)
    if out.dtype != torch.bfloat16 or tuple(out.shape) != (num_tokens, n):
        raise ValueError("out: must be bf16 [T, N]")
    if num_groups == 0 or num_tokens == 0:
        return out
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    a_data = data if (data.stride(1) == 1 and data.stride(0) % 16 == 0 and data.data_ptr() % 16 == 0) else None
    a_data = a_data if a_data is not None else data.contiguous()
    a_desc = TensorDescriptor(
        a_data, [num_tokens, k], [a_data.stride(0), 1], config.a_box, a_layout_shared(config.a_box)
    )
    k_padded = triton.cdiv(k, 128) * 128
    w_view = w.data.view(num_experts * (n // 16), k_padded // 32, 64)
    w_desc = TensorDescriptor(w_view, list(w_view.shape), [w_view.stride(0), 64, 1], W_BOX, w_layout_shared())
    target = out if out.stride(1) == 1 else out.contiguous()
    n_tiles = n // 128
    bound = (triton.cdiv(num_tokens, config.block_t) + num_groups) * n_tiles
    grid = (max(1, min(bound, torch.cuda.get_device_properties(data.device).multi_processor_count)),)
    LAST_COMPILED[config] = w4a8_gluon_kernel[grid](
        a_desc,
        w_desc,
        scales,
        w.tables,
        w.row_factors,
        target,
        a_offsets.contiguous(),
        expert_ids.contiguous(),
        target.stride(0),
        scales.stride(0),
        scales.stride(1),
        num_tokens,
        num_groups,
        num_experts,
        n,
        k,
        n_tiles,
        STAGES=config.stages,
        STEP_REFERENCE=config.reference == "step",
        num_warps=4,
        maxnreg=MAX_REGS,
    )
    if target is not out:
        out.copy_(target)
    return out
