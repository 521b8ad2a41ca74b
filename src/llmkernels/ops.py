"""The kernels as PyTorch custom operators (``torch.ops.llmkernels.*``), for ``torch.compile``.

Under ``torch.compile`` the public functions (:func:`llmkernels.grouped_matmul`,
:func:`llmkernels.quantize`, :func:`llmkernels.attention`, :func:`llmkernels.moe.dispatch`,
:func:`llmkernels.moe.combine`) check
their arguments while tracing and then call these operators, which the compiler treats as opaque
nodes with fake (meta) implementations: no graph break, and no host sync inside, so the compiled
graph stays capturable in a CUDA graph. In eager mode the public functions launch directly (the
dispatcher would add host time to every decode step).

A ScaledTensor crosses the operator boundary as its parts (data, scales, global scale, format and
layout strings), masks and score modifiers as numbers; Python callables do not, so calls with a
user ``@triton.jit`` epilogue, mask_mod or score_mod, an ``out=`` buffer, an explicit config or
``validate=True`` stay on the traced Python path (where Dynamo may break the graph).
"""
from __future__ import annotations

import torch

from .formats import scaled_tensor_from_parts, scaled_tensor_parts
from .formats.spec import format_spec

__all__ = ["attention_op", "grouped_matmul_op", "moe_combine_op", "moe_dispatch_op", "quantize_op"]

@torch.library.custom_op("llmkernels::grouped_matmul", mutates_args=())
def grouped_matmul_op(
    a_data: torch.Tensor, a_scales: torch.Tensor | None, a_global_scale: torch.Tensor | None, a_format: str,
    a_scale_layout: str, a_group_offsets: torch.Tensor | None, a_group_scale_offsets: torch.Tensor | None,
    b_data: torch.Tensor, b_scales: torch.Tensor | None, b_global_scale: torch.Tensor | None, b_format: str,
    b_scale_layout: str, a_offsets: torch.Tensor, expert_ids: torch.Tensor, expert_scales: torch.Tensor | None,
    epilogue: str | None, out_dtype: torch.dtype,
) -> torch.Tensor:
    """:func:`llmkernels.grouped_matmul` on the parts of its operands; returns ``[T, N_out]``."""
    from .grouped_matmul.api import grouped_matmul

    a = scaled_tensor_from_parts(a_data, a_scales, a_global_scale, a_format, a_scale_layout, a_group_offsets,
                                 a_group_scale_offsets)
    b = scaled_tensor_from_parts(b_data, b_scales, b_global_scale, b_format, b_scale_layout)
    return grouped_matmul(a, b, a_offsets, expert_ids, expert_scales, epilogue=epilogue, out_dtype=out_dtype)


@grouped_matmul_op.register_fake
def _grouped_matmul_fake(a_data, a_scales, a_global_scale, a_format, a_scale_layout, a_group_offsets,
                         a_group_scale_offsets, b_data, b_scales, b_global_scale, b_format, b_scale_layout,
                         a_offsets, expert_ids, expert_scales, epilogue, out_dtype):
    n = b_data.shape[1]
    return a_data.new_empty((a_data.shape[0], n // 2 if epilogue == "swiglu" else n), dtype=out_dtype)


@torch.library.custom_op("llmkernels::quantize", mutates_args=())
def quantize_op(x: torch.Tensor, format: str, global_scale: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`llmkernels.quantize` with row scales: ``(data, scales, global_scale)``, data and scales
    as uint8 bytes; the global scale is a float32 scalar, 1.0 for the MX formats (which have none)."""
    from .formats.api import quantize

    result = quantize(x, format, global_scale=global_scale)
    scale = result.global_scale if result.global_scale is not None else torch.ones((), device=x.device)
    return result.data.view(torch.uint8), result.scales.view(torch.uint8), scale


@quantize_op.register_fake
def _quantize_fake(x, format, global_scale):
    spec = format_spec(format)
    k = x.shape[-1]
    data = x.new_empty((*x.shape[:-1], k // 2 if spec.packed else k), dtype=torch.uint8)
    scales = x.new_empty((*x.shape[:-1], k // spec.block), dtype=torch.uint8)
    return data, scales, x.new_empty((), dtype=torch.float32)


@torch.library.custom_op("llmkernels::attention", mutates_args=())
def attention_op(
    q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
    has_window: bool, window_left: int, window_right: int, chunk_size: int, softcap: float,
    alibi_slopes: torch.Tensor | None, sinks: torch.Tensor | None, softmax_scale: float,
    cu_seqlens_q: torch.Tensor | None, cu_seqlens_k: torch.Tensor | None,
    max_seqlen_q: int | None, max_seqlen_k: int | None,
    k_pages: torch.Tensor | None, v_pages: torch.Tensor | None, block_table: torch.Tensor | None,
    seqlens: torch.Tensor | None, num_splits: int | None, return_lse: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`llmkernels.attention` with its mask and score modifier as plain values: a window
    (``-1`` = unbounded side; causal is the window's ``right = 0``), a chunk size (0: none), a
    softcap (0: none) or ALiBi slopes. Returns ``(out, lse)``; lse is empty unless ``return_lse``.

    Raises:
        ValueError: ``chunk_size < 0`` or ``softcap < 0`` (or NaN): only 0 means "none".
    """
    from .attention.api import attention
    from .attention.masks import Chunked, SlidingWindow, alibi
    from .attention.masks import softcap as make_softcap
    from .attention.paged import PagedKVCache

    if chunk_size < 0:
        raise ValueError(f"chunk_size must be >= 0 (0: no chunking), got {chunk_size}")
    if not softcap >= 0.0:
        raise ValueError(f"softcap must be >= 0 (0: no softcap), got {softcap}")
    mask = []
    if has_window:
        mask.append(SlidingWindow(window_left, window_right))
    if chunk_size > 0:
        mask.append(Chunked(chunk_size))
    score_mod = make_softcap(softcap) if softcap > 0 else alibi(alibi_slopes) if alibi_slopes is not None else None
    kv_cache = PagedKVCache(k_pages, v_pages, block_table, seqlens) if k_pages is not None else None
    result = attention(q, k, v, mask=tuple(mask) or None, score_mod=score_mod, sinks=sinks,
                       softmax_scale=softmax_scale, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                       max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, kv_cache=kv_cache,
                       num_splits=num_splits, return_lse=return_lse)
    if return_lse:
        return result
    return result, q.new_empty(0, dtype=torch.float32)


@attention_op.register_fake
def _attention_fake(q, k, v, has_window, window_left, window_right, chunk_size, softcap, alibi_slopes, sinks,
                    softmax_scale, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, k_pages, v_pages,
                    block_table, seqlens, num_splits, return_lse):
    out = torch.empty_like(q)
    if not return_lse:
        return out, q.new_empty(0, dtype=torch.float32)
    ragged = cu_seqlens_q is not None
    lse_shape = (q.shape[1], q.shape[0]) if ragged else (q.shape[0], q.shape[2], q.shape[1])
    return out, q.new_empty(lse_shape, dtype=torch.float32)


@torch.library.custom_op("llmkernels::moe_combine", mutates_args=())
def moe_combine_op(y: torch.Tensor, row_of_copy: torch.Tensor, weights: torch.Tensor,
                   out_dtype: torch.dtype) -> torch.Tensor:
    """:func:`llmkernels.moe.combine`: ``[T, H]`` router-weighted sums of the expert rows."""
    from .moe.combine import combine

    return combine(y, row_of_copy, weights, out_dtype)


@moe_combine_op.register_fake
def _moe_combine_fake(y, row_of_copy, weights, out_dtype):
    return y.new_empty((row_of_copy.shape[0], y.shape[1]), dtype=out_dtype)


@torch.library.custom_op("llmkernels::moe_dispatch", mutates_args=())
def moe_dispatch_op(expert_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`llmkernels.moe.dispatch`: ``(token_of_row, a_offsets, row_of_copy)``."""
    from .moe.dispatch import dispatch

    return dispatch(expert_ids, num_experts)


@moe_dispatch_op.register_fake
def _moe_dispatch_fake(expert_ids, num_experts):
    num_tokens, top_k = expert_ids.shape
    return (expert_ids.new_empty(num_tokens * top_k, dtype=torch.int64),
            expert_ids.new_empty(num_experts + 1, dtype=torch.int32),
            expert_ids.new_empty((num_tokens, top_k), dtype=torch.int64))
