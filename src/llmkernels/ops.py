"""The public functions and, for ``torch.compile``, the kernels as custom operators (``torch.ops.llmkernels.*``).

This layer sits on top of the kernel families (``formats``, ``grouped_matmul``, ``attention``, ``routing``),
which never import it. Each public function here runs its family's eager function (validate, then launch)
when called normally; while ``torch.compile`` traces, it runs the family's checks (no launch, no sync) and
calls the custom operator, which the compiler treats as an opaque node with a fake (meta) implementation:
no graph break and no host sync inside, so the compiled graph stays capturable in a CUDA graph. The
operator's implementation is the family's eager function. In eager mode nothing goes through the
dispatcher (it would add host time to every decode step).

A ScaledTensor crosses the operator boundary as its parts (data, scales, global scale, format and
layout strings), masks and score modifiers as numbers; Python callables do not, so calls with a
user ``@triton.jit`` epilogue, mask_mod or score_mod, an ``out=`` buffer, an explicit config or
``validate=True`` stay on the traced Python path (where Dynamo may break the graph).
"""

from __future__ import annotations

import functools

import torch

from .attention import api as attention_api
from .attention.masks import SCORE_MOD_SOFTCAP, UNBOUNDED, Chunked, SlidingWindow, alibi, split_mask_tensor
from .attention.masks import softcap as make_softcap
from .attention.paged import PagedKVCache
from .formats import ScaledTensor, nvfp4_global_scale, scaled_tensor_from_parts, scaled_tensor_parts, unwrap_torchao
from .formats import api as formats_api
from .formats.layouts import ROW, as_layout
from .formats.scaled_tensor import as_block, block_scale_shape
from .formats.spec import format_spec
from .grouped_matmul import SwiGLU
from .grouped_matmul import api as grouped_matmul_api
from .grouped_matmul.check import check_grouped_matmul
from .routing.combine import check_combine
from .routing.combine import combine as eager_combine
from .routing.dispatch import check_dispatch
from .routing.dispatch import dispatch as eager_dispatch
from .routing.select import select_experts as eager_select_experts
from .routing.topk import check_selection
from .runtime import check_device, forward_only

__all__ = [
    "quantize",
    "grouped_matmul",
    "attention",
    "dispatch",
    "combine",
    "select_experts",
    "attention_op",
    "grouped_matmul_op",
    "moe_combine_op",
    "moe_dispatch_op",
    "moe_select_experts_op",
    "quantize_op",
]


@torch.library.custom_op("llmkernels::grouped_matmul", mutates_args=())
def grouped_matmul_op(
    a_data: torch.Tensor,
    a_scales: torch.Tensor | None,
    a_global_scale: torch.Tensor | None,
    a_format: str,
    a_scale_layout: str,
    a_group_offsets: torch.Tensor | None,
    a_group_scale_offsets: torch.Tensor | None,
    b_data: torch.Tensor,
    b_scales: torch.Tensor | None,
    b_global_scale: torch.Tensor | None,
    b_format: str,
    b_scale_layout: str,
    b_shape: list[int],
    a_offsets: torch.Tensor,
    expert_ids: torch.Tensor,
    expert_scales: torch.Tensor | None,
    epilogue: str | None,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,
    glu_alpha: float = 1.0,
    glu_limit: float = 0.0,
    glu_up_shift: float = 0.0,
    glu_interleaved: bool = False,
    a_block: list[int] | None = None,
    b_block: list[int] | None = None,
) -> torch.Tensor:
    """:func:`llmkernels.grouped_matmul` on the parts of its operands (``b_shape``: b's logical ``[E, N, K]``;
    ``a_block`` / ``b_block``: their ``ScaledTensor.block``, None for the formats whose block it is anyway);
    returns ``[T, N_out]``. A :class:`SwiGLU` epilogue crosses as ``epilogue="swiglu"`` and its fields
    (``glu_limit`` 0: no clamp)."""
    a = scaled_tensor_from_parts(
        a_data,
        a_scales,
        a_global_scale,
        a_format,
        a_scale_layout,
        a_group_offsets,
        a_group_scale_offsets,
        block=a_block,
    )
    b = scaled_tensor_from_parts(
        b_data, b_scales, b_global_scale, b_format, b_scale_layout, shape=b_shape, block=b_block
    )
    if epilogue == "swiglu":
        epilogue = SwiGLU(glu_alpha, glu_limit or None, glu_up_shift, glu_interleaved)
    return grouped_matmul_api.grouped_matmul(
        a, b, a_offsets, expert_ids, expert_scales, epilogue=epilogue, bias=bias, out_dtype=out_dtype
    )


@grouped_matmul_op.register_fake
def _grouped_matmul_fake(
    a_data,
    a_scales,
    a_global_scale,
    a_format,
    a_scale_layout,
    a_group_offsets,
    a_group_scale_offsets,
    b_data,
    b_scales,
    b_global_scale,
    b_format,
    b_scale_layout,
    b_shape,
    a_offsets,
    expert_ids,
    expert_scales,
    epilogue,
    out_dtype,
    bias=None,
    glu_alpha=1.0,
    glu_limit=0.0,
    glu_up_shift=0.0,
    glu_interleaved=False,
    a_block=None,
    b_block=None,
):
    n = b_shape[1]
    return a_data.new_empty((a_data.shape[0], n // 2 if epilogue == "swiglu" else n), dtype=out_dtype)


@torch.library.custom_op("llmkernels::quantize", mutates_args=())
def quantize_op(
    x: torch.Tensor,
    format: str,
    global_scale: torch.Tensor | None,
    block: list[int] | None = None,
    power_of_two_scales: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`llmkernels.quantize` with row scales: ``(data, scales, global_scale)``, data and scales
    as uint8 bytes (fp8's float32 scales: 4 bytes each along the last dim); the global scale is a float32
    scalar, 1.0 for the formats that have none, a copy of a given one (an operator's output may not alias its
    input)."""
    result = formats_api.quantize(
        x,
        format,
        global_scale=global_scale,
        block=None if block is None else tuple(block),
        power_of_two_scales=power_of_two_scales,
    )
    if result.global_scale is None:
        scale = torch.ones((), device=x.device)
    else:
        scale = result.global_scale if global_scale is None else result.global_scale.clone()
    return result.data.view(torch.uint8), result.scales.view(torch.uint8), scale


@quantize_op.register_fake
def _quantize_fake(x, format, global_scale, block=None, power_of_two_scales=False):
    spec = format_spec(format)
    k = x.shape[-1]
    data = x.new_empty((*x.shape[:-1], k // 2 if spec.packed else k), dtype=torch.uint8)
    if spec.scale == "f32":
        scale_shape = block_scale_shape(tuple(x.shape), as_block(spec, None if block is None else tuple(block)))
        scales = x.new_empty((*scale_shape[:-1], scale_shape[-1] * 4), dtype=torch.uint8)
    else:
        scales = x.new_empty((*x.shape[:-1], k // spec.block), dtype=torch.uint8)
    return data, scales, x.new_empty((), dtype=torch.float32)


@torch.library.custom_op("llmkernels::attention", mutates_args=())
def attention_op(
    q: torch.Tensor,
    k: torch.Tensor | None,
    v: torch.Tensor | None,
    has_window: bool,
    window_left: int,
    window_right: int,
    chunk_size: int,
    softcap: float,
    alibi_slopes: torch.Tensor | None,
    sinks: torch.Tensor | None,
    softmax_scale: float,
    cu_seqlens_q: torch.Tensor | None,
    cu_seqlens_k: torch.Tensor | None,
    max_seqlen_q: int | None,
    max_seqlen_k: int | None,
    k_pages: torch.Tensor | None,
    v_pages: torch.Tensor | None,
    block_table: torch.Tensor | None,
    seqlens: torch.Tensor | None,
    num_splits: int | None,
    return_lse: bool,
    kv_starts: torch.Tensor | None = None,
    attn_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`llmkernels.attention` with its mask and score modifier as plain values: a window
    (``-1`` = unbounded side; causal is the window's ``right = 0``), a chunk size (0: none), a
    softcap (0: none) or ALiBi slopes. Returns ``(out, lse)``; lse is empty unless ``return_lse``.

    Raises:
        ValueError: ``chunk_size < 0`` or ``softcap < 0`` (or NaN): only 0 means "none".
    """
    if chunk_size < 0:
        raise ValueError(f"chunk_size must be >= 0 (0: no chunking), got {chunk_size}")
    if not softcap >= 0.0:
        raise ValueError(f"softcap must be >= 0 (0: no softcap), got {softcap}")
    mask = [] if attn_mask is None else [attn_mask]
    if has_window:
        mask.append(SlidingWindow(window_left, window_right))
    if chunk_size > 0:
        mask.append(Chunked(chunk_size))
    score_mod = make_softcap(softcap) if softcap > 0 else alibi(alibi_slopes) if alibi_slopes is not None else None
    kv_cache = PagedKVCache(k_pages, v_pages, block_table, seqlens, kv_starts) if k_pages is not None else None
    result = attention_api.attention(
        q,
        k,
        v,
        mask=tuple(mask) or None,
        score_mod=score_mod,
        sinks=sinks,
        softmax_scale=softmax_scale,
        cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_k=cu_seqlens_k,
        max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k,
        kv_cache=kv_cache,
        num_splits=num_splits,
        return_lse=return_lse,
    )
    if return_lse:
        return result
    return result, q.new_empty(0, dtype=torch.float32)


@attention_op.register_fake
def _attention_fake(
    q,
    k,
    v,
    has_window,
    window_left,
    window_right,
    chunk_size,
    softcap,
    alibi_slopes,
    sinks,
    softmax_scale,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    k_pages,
    v_pages,
    block_table,
    seqlens,
    num_splits,
    return_lse,
    kv_starts=None,
    attn_mask=None,
):
    out = torch.empty_like(q)
    if not return_lse:
        return out, q.new_empty(0, dtype=torch.float32)
    ragged = cu_seqlens_q is not None
    lse_shape = (q.shape[1], q.shape[0]) if ragged else (q.shape[0], q.shape[2], q.shape[1])
    return out, q.new_empty(lse_shape, dtype=torch.float32)


@torch.library.custom_op("llmkernels::moe_combine", mutates_args=())
def moe_combine_op(
    y: torch.Tensor, row_of_copy: torch.Tensor, weights: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    """:func:`llmkernels.routing.combine`: ``[T, H]`` router-weighted sums of the expert rows."""
    return eager_combine(y, row_of_copy, weights, out_dtype)


@moe_combine_op.register_fake
def _moe_combine_fake(y, row_of_copy, weights, out_dtype):
    return y.new_empty((row_of_copy.shape[0], y.shape[1]), dtype=out_dtype)


@torch.library.custom_op("llmkernels::moe_dispatch", mutates_args=())
def moe_dispatch_op(expert_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`llmkernels.routing.dispatch`: ``(token_of_row, a_offsets, row_of_copy)``."""
    return eager_dispatch(expert_ids, num_experts)


@moe_dispatch_op.register_fake
def _moe_dispatch_fake(expert_ids, num_experts):
    num_tokens, top_k = expert_ids.shape
    return (
        expert_ids.new_empty(num_tokens * top_k, dtype=torch.int64),
        expert_ids.new_empty(num_experts + 1, dtype=torch.int32),
        expert_ids.new_empty((num_tokens, top_k), dtype=torch.int64),
    )


@torch.library.custom_op("llmkernels::moe_select_experts", mutates_args=())
def moe_select_experts_op(
    router_logits: torch.Tensor, top_k: int, scoring: str, renormalize: bool, correction_bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`llmkernels.moe.select_experts`: ``(weights, expert_ids)``, float32 and int32 ``[T, top_k]``."""
    return eager_select_experts(
        router_logits, top_k, scoring=scoring, renormalize=renormalize, correction_bias=correction_bias
    )


@moe_select_experts_op.register_fake
def _moe_select_experts_fake(router_logits, top_k, scoring, renormalize, correction_bias):
    shape = (router_logits.shape[0], top_k)
    return router_logits.new_empty(shape, dtype=torch.float32), router_logits.new_empty(shape, dtype=torch.int32)


# ------------------------------------------------------------------------------------------------
# The public functions: the family's eager function, or while torch.compile traces its checks + the op
# ------------------------------------------------------------------------------------------------


@functools.wraps(formats_api.quantize)
def quantize(
    x,
    format,
    *,
    global_scale=None,
    scale_layout=ROW,
    group_offsets=None,
    rows=None,
    block=None,
    power_of_two_scales=False,
):
    if not torch.compiler.is_compiling():
        return formats_api.quantize(
            x,
            format,
            global_scale=global_scale,
            scale_layout=scale_layout,
            group_offsets=group_offsets,
            rows=rows,
            block=block,
            power_of_two_scales=power_of_two_scales,
        )
    spec, block = formats_api.check_quantize(
        x, format, global_scale, scale_layout, group_offsets, rows, block, power_of_two_scales
    )
    if rows is not None:  # the compiler sees a gather and the quantize op
        if spec.has_global_scale and global_scale is None:
            global_scale = nvfp4_global_scale(x)
        x = x[rows]
    data, scales, op_global_scale = quantize_op(x, format, global_scale, list(block), power_of_two_scales)
    result = ScaledTensor(
        data.view(spec.data_dtype),
        scales.view(spec.scale_dtype),
        format,
        op_global_scale if spec.has_global_scale else None,
        block=block,
    )
    if as_layout(scale_layout) is not ROW or group_offsets is not None:
        result = result.to_layout(scale_layout, group_offsets=group_offsets)
    return result


@functools.wraps(grouped_matmul_api.grouped_matmul)
def grouped_matmul(
    a,
    b,
    a_offsets,
    expert_ids,
    expert_scales=None,
    *,
    epilogue=None,
    bias=None,
    out_dtype=torch.bfloat16,
    out=None,
    config=None,
    validate=False,
):
    a, b = unwrap_torchao(a), unwrap_torchao(b)  # torchao's MXTensor / NVFP4Tensor: views as ScaledTensors
    call = None
    if torch.compiler.is_compiling() and out is None and config is None and not validate:
        call = check_grouped_matmul(a, b, a_offsets, expert_ids, expert_scales, epilogue, out_dtype, out, config, bias)
    if call is None or call.epilogue_fn is not None:
        return grouped_matmul_api.grouped_matmul(
            a,
            b,
            a_offsets,
            expert_ids,
            expert_scales,
            epilogue=epilogue,
            bias=bias,
            out_dtype=out_dtype,
            out=out,
            config=config,
            validate=validate,
        )
    a_parts, b_parts = scaled_tensor_parts(a), scaled_tensor_parts(b)
    glu = call.glu or SwiGLU()
    return grouped_matmul_op(
        *a_parts[:7],
        *b_parts[:5],
        b_parts[7],
        call.a_offsets,
        call.expert_ids,
        call.expert_scales,
        call.epilogue_kind if call.epilogue_kind != "none" else None,
        out_dtype,
        call.bias,
        glu.alpha,
        glu.limit or 0.0,
        glu.up_shift,
        glu.interleaved,
        a_parts[8],
        b_parts[8],
    )


@functools.wraps(attention_api.attention)
def attention(
    q,
    k,
    v,
    *,
    causal=False,
    mask=None,
    score_mod=None,
    sinks=None,
    softmax_scale=None,
    cu_seqlens_q=None,
    cu_seqlens_k=None,
    max_seqlen_q=None,
    max_seqlen_k=None,
    kv_cache=None,
    num_splits=None,
    return_lse=False,
    config=None,
    validate=False,
    q_descale=None,
    k_descale=None,
    v_descale=None,
):
    # FP8 calls stay on the Python path: the custom op takes no descales (and gives out in q's dtype)
    if (
        torch.compiler.is_compiling()
        and config is None
        and not validate
        and not _fp8_call(q, k, kv_cache, q_descale, k_descale, v_descale)
    ):
        call = attention_api.check_attention(
            q,
            k,
            v,
            causal,
            mask,
            score_mod,
            sinks,
            softmax_scale,
            cu_seqlens_q,
            cu_seqlens_k,
            max_seqlen_q,
            max_seqlen_k,
            kv_cache,
            num_splits,
            return_lse,
            config,
            validate,
        )
        if call.mask_spec.mask_mod is None and call.mod_spec.fn is None:  # Python callables cannot cross the op
            return _attention_through_op(
                q,
                k,
                v,
                call,
                sinks,
                cu_seqlens_q,
                cu_seqlens_k,
                max_seqlen_q,
                max_seqlen_k,
                kv_cache,
                num_splits,
                return_lse,
                split_mask_tensor(mask)[1],
            )
    return attention_api.attention(
        q,
        k,
        v,
        causal=causal,
        mask=mask,
        score_mod=score_mod,
        sinks=sinks,
        softmax_scale=softmax_scale,
        cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_k=cu_seqlens_k,
        max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k,
        kv_cache=kv_cache,
        num_splits=num_splits,
        return_lse=return_lse,
        config=config,
        validate=validate,
        q_descale=q_descale,
        k_descale=k_descale,
        v_descale=v_descale,
    )


def _fp8_call(q, k, kv_cache, *descales) -> bool:
    """A call with a descale or a float8_e4m3fn q, k or page tensor (FP8 attention)."""
    tensors = (q, k, getattr(kv_cache, "k_pages", None))
    return any(d is not None for d in descales) or any(
        getattr(t, "dtype", None) == torch.float8_e4m3fn for t in tensors
    )


def _attention_through_op(
    q,
    k,
    v,
    call,
    sinks,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    kv_cache,
    num_splits,
    return_lse,
    attn_mask=None,
):
    """The custom op's call for checked arguments: mask and score modifier as plain values."""
    mask_spec, mod_spec = call.mask_spec, call.mod_spec

    def side(bound):  # the op's window convention: -1 = unbounded
        return -1 if bound >= UNBOUNDED else bound

    paged = kv_cache is not None
    result = attention_op(
        q,
        k,
        v,
        mask_spec.has_window,
        side(mask_spec.window_left),
        side(mask_spec.window_right),
        mask_spec.chunk_size if mask_spec.has_chunk else 0,
        mod_spec.cap if mod_spec.kind == SCORE_MOD_SOFTCAP else 0.0,
        mod_spec.slopes,
        sinks,
        call.softmax_scale,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        kv_cache.k_pages if paged else None,
        kv_cache.v_pages if paged else None,
        kv_cache.block_table if paged else None,
        kv_cache.seqlens if paged else None,
        num_splits,
        return_lse,
        kv_cache.starts if paged else None,
        attn_mask,
    )
    return result if return_lse else result[0]


@functools.wraps(eager_dispatch)
def dispatch(expert_ids, num_experts):
    if not torch.compiler.is_compiling():
        return eager_dispatch(expert_ids, num_experts)
    check_dispatch(expert_ids, num_experts)
    return moe_dispatch_op(expert_ids, num_experts)


@functools.wraps(eager_combine)
def combine(y, row_of_copy, weights, out_dtype=None):
    if not torch.compiler.is_compiling():
        return eager_combine(y, row_of_copy, weights, out_dtype)
    check_combine(y, row_of_copy, weights, out_dtype)
    return moe_combine_op(y, row_of_copy, weights, out_dtype or y.dtype)


@functools.wraps(eager_select_experts)
def select_experts(router_logits, top_k, *, scoring="softmax", renormalize=True, correction_bias=None):
    if not torch.compiler.is_compiling():
        return eager_select_experts(
            router_logits, top_k, scoring=scoring, renormalize=renormalize, correction_bias=correction_bias
        )
    check_selection(router_logits, top_k, scoring, correction_bias)
    check_device(router_logits=router_logits, correction_bias=correction_bias)
    forward_only("select_experts", router_logits=router_logits, correction_bias=correction_bias)
    return moe_select_experts_op(router_logits, top_k, scoring, renormalize, correction_bias)
