"""The portable backend: :func:`kernel.attention_fwd_kernel` on any GPU and in the interpreter, every call the
Gluon backends do not take (the last of the plan's list). One pass, or the split pass of split-KV whose partials
the combine backend (:mod:`split_kv`) merges."""

from __future__ import annotations

import torch

from ..launch import BoundKernel, KernelSpec
from ..runtime import cuda_capability, interpreting, next_power_of_2, unit_last_stride
from .check import CheckedCall
from .config import Tiling
from .kernel import attention_fwd_kernel
from .layout import dummy, paged_metadata, strides3, token_row_descriptor
from .masks import SCORE_MOD_ALIBI, mask_tensor_4d

__all__ = ["BACKEND", "Portable", "TYPE_NAMES"]

TYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float8_e4m3fn: "fp8e4nv"}
# integer arguments a typical launch does not see divisible by 16 (what an ahead-of-time compile assumes)
UNALIGNED = (
    "group",
    "num_splits",
    "num_kv_heads",
    "num_head_programs",
    "window_left",
    "window_right",
    "chunk_size",
    "num_pages",
    "stride_q_descale_b",
    "stride_q_descale_h",
    "stride_k_descale_b",
    "stride_k_descale_h",
    "stride_v_descale_b",
    "stride_v_descale_h",
)
# dense K/V: what a cache growing by a token per call changes, passed per call (CheckedCall.dynamic_kv)
PER_CALL = ("stride_kb", "stride_ks", "stride_kh", "stride_vb", "stride_vs", "stride_vh", "seqlen_k_dense")


def _tma_capable(device: torch.device) -> bool:
    """Tensor descriptors run as TMA on sm90+; the interpreter emulates them (so CPU tests cover the path)."""
    capability = cuda_capability(device)
    return interpreting() or (capability is not None and capability[0] >= 9)


class Portable:
    """The portable Triton kernel: supports every checked call, FP8 (float8_e4m3fn q / K / V with descales)
    included."""

    name = "portable"
    kernel = attention_fwd_kernel
    reads_fp8 = True

    def supports(self, call: CheckedCall, tiles: Tiling) -> bool:
        return True

    def tma_kv(self, call: CheckedCall, tiles: Tiling) -> bool:
        """Whether the launch reads K and V's fully visible band through tensor descriptors: ``config.tma_kv``, K/V
        token rows (dense or ragged), D a power of two, on sm90+ (or the interpreter)."""
        return (
            tiles.config.tma_kv
            and not call.fp8_kv  # e4m3 tiles through descriptors: not yet measured, the pointer loads read them
            and not call.paged
            and call.kv_token_rows
            and call.head_dim == next_power_of_2(call.head_dim)
            and _tma_capable(call.device)
        )

    def spec(self, call: CheckedCall, tiles: Tiling) -> KernelSpec:
        config, spec, partials, paged = tiles.config, call.mask_spec, tiles.partials, call.paged
        tma = self.tma_kv(call, tiles)
        constexprs = dict(
            HEAD_DIM=call.head_dim,
            HEAD_DIM_PAD=next_power_of_2(call.head_dim),
            BLOCK_Q=tiles.block_q,
            HEADS_PER_TILE=tiles.heads_per_tile,
            BLOCK_N=config.BN,
            NUM_Q_TILES=tiles.num_q_tiles,
            RAGGED_Q=call.ragged,
            RAGGED_K=call.ragged and not paged,
            PAGED=paged,
            PAGE_SIZE=call.page_size if paged else 16,
            HAS_WINDOW=spec.has_window,
            HAS_CHUNK=spec.has_chunk,
            HAS_MASK_MOD=spec.mask_mod is not None,
            MASK_MOD=spec.mask_mod,
            SCORE_MOD_KIND=call.mod_spec.kind,
            SCORE_MOD=call.mod_spec.fn,
            HAS_SINKS=call.has_sinks and not partials,
            SPLIT=partials,
            RETURN_LSE=call.return_lse and not partials,
            REVERSE_Q_BLOCKS=spec.has_window and not tiles.split,
            RESCALE_THRESHOLD=config.rescale_threshold,
            POLY_EXP2_FRACTION=config.poly_exp2_fraction,
            TMA_KV=tma,
            UPCAST=interpreting(),
            KV_STARTS=call.kv_starts,
            MASK_TENSOR=call.mask_kind,
            PAGE_OFFSETS_64=paged and call.page_offsets_64,
            FP8_Q=call.fp8_q,
            FP8_KV=call.fp8_kv,
            E4M3_ASM=call.fp8_kv and call.dtype == torch.bfloat16 and not interpreting(),  # FP8 is sm_89+
            Q_DESCALE=call.descales[0],
            K_DESCALE=call.descales[1],
            V_DESCALE=call.descales[2],
        )
        data = "*" + TYPE_NAMES[call.dtype]
        fp8 = "*" + TYPE_NAMES[torch.float8_e4m3fn]
        arg_types = {name: "*i32" for name in self.kernel.arg_names if name.endswith("_ptr")}
        arg_types.update(
            q_ptr=fp8 if call.fp8_q else data,
            k_ptr=fp8 if call.fp8_kv else data,
            v_ptr=fp8 if call.fp8_kv else data,
            q_descale_ptr="*fp32",
            k_descale_ptr="*fp32",
            v_descale_ptr="*fp32",
            out_ptr="*fp32" if partials else data,
            lse_ptr="*fp32",
            sinks_ptr="*fp32",
            alibi_slopes_ptr="*fp32",
            softmax_scale="fp32",
            softcap_value="fp32",
            k_desc=fp8 if call.fp8_kv else data,
            v_desc=fp8 if call.fp8_kv else data,
        )
        if tma:
            block = f"tensordesc<{TYPE_NAMES[call.dtype]}[{config.BN},{call.head_dim}]>"
            arg_types.update(k_desc=block, v_desc=block)
        return KernelSpec(
            self.kernel,
            tiles.grid,
            constexprs,
            dict(num_warps=config.num_warps, num_stages=config.num_kv_stages),
            arg_types,
            UNALIGNED,
            PER_CALL if call.dynamic_kv else (),
        )

    def launch(self, call: CheckedCall, tiles: Tiling) -> PortableLaunch:
        return PortableLaunch(call, tiles, self.spec(call, tiles))


BACKEND = Portable()


class PortableLaunch:
    """The portable kernel's launch for one plan: the arguments it reads made from a call's tensors, bound at the
    first call (:meth:`KernelSpec.bind`), then the bound kernel called with the tensors (and, for dense K/V,
    their strides and key count)."""

    def __init__(self, call: CheckedCall, tiles: Tiling, spec: KernelSpec):
        self.spec, self.bound = spec, None
        self.ragged, self.paged, self.partials = call.ragged, call.paged, tiles.partials
        self.kv_starts, self.dynamic = call.kv_starts, call.dynamic_kv
        self.has_slopes = call.mod_spec.kind == SCORE_MOD_ALIBI
        self.tma, self.block_n = spec.constexprs["TMA_KV"], tiles.config.BN
        self.call, self.tiles = call, tiles
        # one-element tensors for the pointers a compiled variant never reads (shared, never written)
        self.dummies = (dummy(call.device, torch.int32), dummy(call.device, torch.float32))

    def __call__(
        self,
        q,
        k,
        v,
        kv_cache,
        cu_seqlens_q,
        cu_seqlens_k,
        sinks,
        slopes,
        attn_mask,
        out,
        lse,
        o_partial,
        lse_partial,
        descales=(None, None, None),
    ) -> None:
        # Token / head / batch strides of q, k, v and the pages go to the kernel (zero ones included); a head dim
        # that is not unit-stride is copied. The kernel reads metadata vectors as dense: views of other strides
        # are copied (a few bytes, no sync).
        q = unit_last_stride(q)
        int_dummy, float_dummy = self.dummies
        if self.paged:
            k, v = unit_last_stride(kv_cache.k_pages), unit_last_stride(kv_cache.v_pages)
            block_table, seqlens = paged_metadata(kv_cache)
            kv_starts = kv_cache.starts.contiguous() if self.kv_starts else int_dummy
        else:
            k, v = unit_last_stride(k), unit_last_stride(v)
            block_table = seqlens = kv_starts = int_dummy
        sinks = sinks.contiguous() if sinks is not None else float_dummy
        slopes = slopes.contiguous() if self.has_slopes else float_dummy
        if attn_mask is not None:  # 4D, broadcast by strides (see _bind); bool read as its bytes
            attn_mask = mask_tensor_4d(attn_mask.view(torch.uint8) if attn_mask.dtype == torch.bool else attn_mask)
        else:
            attn_mask = float_dummy
        if self.partials:
            target_out, target_lse = o_partial, lse_partial
        else:
            target_out, target_lse = out, lse if lse is not None else float_dummy
        # [B|1, Hkv|1] float32, any strides (bound with the plan; a size-1 dim broadcasts with stride 0)
        descales = tuple(float_dummy if descale is None else descale for descale in descales)
        if not self.dynamic:
            values = (
                q,
                k,
                v,
                target_out,
                target_lse,
                cu_seqlens_q.contiguous() if self.ragged else int_dummy,
                cu_seqlens_k.contiguous() if self.ragged and not self.paged else int_dummy,
                seqlens,
                kv_starts,
                block_table,
                sinks,
                slopes,
                attn_mask,
                k,
                v,
                *descales,
            )
        else:  # dense K/V: their strides and key count, and the descriptors' rows (B * Skv), vary per call
            (batch, seqlen, heads, head_dim), k_strides, v_strides = k.shape, k.stride(), v.stride()
            k_desc, v_desc = k, v
            if self.tma:
                rows = (batch * seqlen, heads * head_dim)
                k_desc, v_desc = (k, rows, (k_strides[1], 1)), (v, rows, (v_strides[1], 1))
            values = (
                q,
                k,
                v,
                target_out,
                target_lse,
                int_dummy,
                int_dummy,
                int_dummy,
                int_dummy,
                int_dummy,
                sinks,
                slopes,
                attn_mask,
                k_desc,
                v_desc,
                *descales,
                k_strides[0],
                k_strides[1],
                k_strides[2],
                v_strides[0],
                v_strides[1],
                v_strides[2],
                seqlen,
            )
        (self.bound or self._bind(values, out, lse))(*values)

    def _bind(self, values, out, lse) -> BoundKernel:
        q, k, v, target_out, target_lse, *_ = values
        call, tiles, ragged, paged, partials = self.call, self.tiles, self.ragged, self.paged, self.partials
        if paged:
            stride_k, stride_v = (k.stride(0), k.stride(1), k.stride(2)), (v.stride(0), v.stride(1), v.stride(2))
            block_table = values[9]
            stride_block_table, seqlen_k_dense, num_pages = block_table.stride(0), 0, k.shape[0]
            paged_seqlen_bound = block_table.shape[1] * k.shape[1] if num_pages > 0 else 0  # no pages: no keys
        else:
            stride_k, stride_v = strides3(k, ragged), strides3(v, ragged)
            seqlen_k_dense = 0 if ragged else k.shape[1]
            stride_block_table, num_pages, paged_seqlen_bound = 0, 0, 0
        attn_mask = values[12]  # [B|1, Hq|1, Sq|1, Skv|1]: a size-1 dim broadcasts with stride 0
        mask_strides = (0, 0, 0, 0)
        if call.mask_kind != "none":
            mask_strides = tuple(
                0 if size == 1 else stride for size, stride in zip(attn_mask.shape, attn_mask.stride())
            )
        descales = values[15:18]
        if self.tma:
            pointers = (
                *values[:13],
                token_row_descriptor(k, ragged, self.block_n),
                token_row_descriptor(v, ragged, self.block_n),
                *descales,
            )
        else:
            pointers = values[:18]
        descale_strides = tuple(
            0 if size == 1 else stride
            for descale, given in zip(descales, call.descales)
            for size, stride in zip(descale.shape if given else (1, 1), descale.stride() if given else (0, 0))
        )
        # out / lse strides as (b, token, head) and (b, head, token); ragged has no batch stride
        stride_o = strides3(out, ragged)
        stride_lse = strides3(lse, ragged) if lse is not None else (0, 0, 0)
        if partials:
            stride_target_o, stride_target_lse = strides3(target_out[0], ragged), strides3(target_lse[0], ragged)
            stride_o_split, stride_lse_split = target_out.stride(0), target_lse.stride(0)
        else:
            stride_target_o, stride_target_lse, stride_o_split, stride_lse_split = stride_o, stride_lse, 0, 0
        spec = call.mask_spec
        self.bound = self.spec.bind(
            *pointers,
            *strides3(q, ragged),
            *stride_k,
            *stride_v,
            *stride_target_o,
            stride_o_split,
            *stride_target_lse,
            stride_lse_split,
            stride_block_table,
            *mask_strides,
            *descale_strides,
            0 if ragged else q.shape[1],
            seqlen_k_dense,
            q.shape[0],
            k.shape[0],
            num_pages,
            paged_seqlen_bound,
            call.num_kv_heads,
            call.group,
            tiles.num_splits,
            tiles.num_head_programs,
            float(call.softmax_scale),
            spec.window_left,
            spec.window_right,
            spec.chunk_size,
            float(call.mod_spec.cap),
        )
        return self.bound
