"""Split-KV (flash-decoding): the combine kernel and its backend (the split heuristics are in ``config.py``).

The split pass itself is ``kernel.attention_fwd_kernel`` with ``SPLIT=True``: program axis 1 is the
split, each program runs the same masked/visible/masked phases over its share of whole KV tiles and
writes a float32 partial O (already divided by its own row sum) and a base-2 LSE (-inf when the
split saw no visible key). For decode the q heads of one KV head are packed into the rows of one
tile (``HEADS_PER_TILE``), so each K/V tile is read once per KV head, not once per q head.

``combine_splits_kernel`` merges the partials with the usual LSE weights, adds the sinks (once, here),
and writes O in the output dtype and the natural-log LSE.
"""

import torch
import triton
import triton.language as tl

from ..launch import BoundKernel, KernelSpec
from ..runtime import next_power_of_2
from .check import CheckedCall
from .config import Tiling, combine_block_splits
from .layout import dummy, strides3
from .portable import TYPE_NAMES

__all__ = ["combine_splits_kernel", "BACKEND", "Combine"]

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def combine_splits_kernel(
    o_partial_ptr,
    lse_partial_ptr,
    out_ptr,
    lse_ptr,
    sinks_ptr,
    stride_p_split,
    stride_p_b,
    stride_p_s,
    stride_p_h,
    stride_lp_split,
    stride_lp_b,
    stride_lp_h,
    stride_lp_s,
    stride_ob,
    stride_os,
    stride_oh,
    stride_lse_b,
    stride_lse_h,
    stride_lse_s,
    rows_per_batch,
    num_splits,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SPLITS: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    RETURN_LSE: tl.constexpr,
    ONE_BLOCK: tl.constexpr,
):
    """One program per (token row, q head): ``out = sum_s w_s O_s / (sum_s w_s + sink)``,
    ``w_s = 2**(lse_s - M)``. Sinks as in the one-pass path: +inf gives O = 0 and LSE = +inf, -inf
    is no sink, NaN gives NaN; a row with no key and no sink gets O = 0, LSE = -inf.

    o_partial float32 ``[splits, B, Sq, Hq, D]`` (ragged: ``[splits, total_q, Hq, D]``, ``stride_p_b = 0``),
    lse_partial float32 base 2 ``[splits, B, Hq, Sq]`` (ragged ``[splits, Hq, total_q]``); program axis 0
    enumerates ``B * rows_per_batch`` rows (ragged: B = 1, rows = total_q), axis 1 the q heads.
    ONE_BLOCK: ``num_splits <= BLOCK_SPLITS``.
    """
    row = tl.program_id(0)
    head = tl.program_id(1).to(tl.int64)  # head * lse head stride (Hq x total_q) may pass 2**31
    batch = (row // rows_per_batch).to(tl.int64)
    token = (row % rows_per_batch).to(tl.int64)
    splits = tl.arange(0, BLOCK_SPLITS)
    dims = tl.arange(0, HEAD_DIM_PAD)
    lse_base = lse_partial_ptr + batch * stride_lp_b + head * stride_lp_h + token * stride_lp_s
    o_base = o_partial_ptr + batch * stride_p_b + token * stride_p_s + head * stride_p_h

    # The max of the split LSEs (and the sink), in one load of every split's LSE and partial O when they fit one
    # block (one round trip to L2), else a pass over the LSEs and a second one for the O.
    if ONE_BLOCK:
        in_range = splits < num_splits
        lse_split = tl.load(lse_base + splits.to(tl.int64) * stride_lp_split, mask=in_range, other=float("-inf"))
        o_split = tl.load(
            o_base + splits.to(tl.int64)[:, None] * stride_p_split + dims[None, :],
            mask=in_range[:, None] & (dims < HEAD_DIM)[None, :],
            other=0.0,
        )
        global_max = tl.max(lse_split, 0)
    else:
        running_max = tl.zeros([BLOCK_SPLITS], dtype=tl.float32) - float("inf")
        for start in tl.range(0, num_splits, BLOCK_SPLITS):
            lse_split = tl.load(
                lse_base + (start + splits).to(tl.int64) * stride_lp_split,
                mask=start + splits < num_splits,
                other=float("-inf"),
            )
            running_max = tl.maximum(running_max, lse_split)
        global_max = tl.max(running_max, 0)
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + head) * LOG2E
        global_max = tl.maximum(global_max, sink)
    reference = tl.where(global_max == float("-inf"), 0.0, global_max)

    if ONE_BLOCK:
        weight_sum = tl.exp2(lse_split - reference)
        acc = weight_sum[:, None] * o_split
    else:
        weight_sum = tl.zeros([BLOCK_SPLITS], dtype=tl.float32)
        acc = tl.zeros([BLOCK_SPLITS, HEAD_DIM_PAD], dtype=tl.float32)
        for start in tl.range(0, num_splits, BLOCK_SPLITS):
            in_range = start + splits < num_splits
            split_offsets = (start + splits).to(tl.int64)
            lse_split = tl.load(lse_base + split_offsets * stride_lp_split, mask=in_range, other=float("-inf"))
            weight = tl.exp2(lse_split - reference)
            o_split = tl.load(
                o_base + split_offsets[:, None] * stride_p_split + dims[None, :],
                mask=in_range[:, None] & (dims < HEAD_DIM)[None, :],
                other=0.0,
            )
            weight_sum += weight
            acc += weight[:, None] * o_split
    total = tl.sum(weight_sum, 0)
    if HAS_SINKS:
        # a sink at the max adds exactly 1, also a sink of +inf (where inf - inf would be NaN)
        total += tl.exp2(tl.where(sink == reference, 0.0, sink - reference))
    nonempty = total != 0.0  # 0: no key and no sink; NaN goes on into O and the LSE
    out = tl.sum(acc, 0) / tl.where(nonempty, total, 1.0)
    tl.store(
        out_ptr + batch * stride_ob + token * stride_os + head * stride_oh + dims,
        out.to(out_ptr.dtype.element_ty),
        mask=dims < HEAD_DIM,
    )
    if RETURN_LSE:
        lse = tl.where(nonempty, (reference + tl.log2(tl.where(nonempty, total, 1.0))) * LN2, float("-inf"))
        tl.store(lse_ptr + batch * stride_lse_b + head * stride_lse_h + token * stride_lse_s, lse)


class Combine:
    """The combine backend: :func:`combine_splits_kernel` after a split pass that wrote several splits' partials."""

    name = "combine"
    kernel = combine_splits_kernel

    def supports(self, call: CheckedCall, tiles: Tiling) -> bool:
        return tiles.partials

    def spec(self, call: CheckedCall, tiles: Tiling) -> KernelSpec:
        """One program per (token row, q head): ``B * Sq`` rows (ragged: ``total_q``) by ``Hq``."""
        batches = 1 if call.ragged else call.batch
        block_splits = combine_block_splits(tiles.num_splits)
        constexprs = dict(
            HEAD_DIM=call.head_dim,
            HEAD_DIM_PAD=next_power_of_2(call.head_dim),
            BLOCK_SPLITS=block_splits,
            HAS_SINKS=call.has_sinks,
            RETURN_LSE=call.return_lse,
            ONE_BLOCK=tiles.num_splits <= block_splits,
        )
        arg_types = dict(
            o_partial_ptr="*fp32",
            lse_partial_ptr="*fp32",
            out_ptr="*" + TYPE_NAMES[call.dtype],
            lse_ptr="*fp32",
            sinks_ptr="*fp32",
        )
        return KernelSpec(
            self.kernel,
            (batches * call.q_rows, call.num_q_heads),
            constexprs,
            dict(num_warps=4),
            arg_types,
            ("num_splits",),
        )

    def launch(self, call: CheckedCall, tiles: Tiling) -> "CombineLaunch":
        return CombineLaunch(call, self.spec(call, tiles), tiles.num_splits)


BACKEND = Combine()


class CombineLaunch:
    """The combine's launch for one plan: bound at the first call on its partials, output and sinks."""

    def __init__(self, call: CheckedCall, spec: KernelSpec, num_splits: int):
        self.spec, self.bound, self.num_splits = spec, None, num_splits
        self.ragged, self.return_lse, self.rows_per_batch = call.ragged, call.return_lse, call.q_rows
        self.float_dummy = dummy(call.device, torch.float32)

    def __call__(self, o_partial, lse_partial, out, lse, sinks) -> None:
        float_dummy = self.float_dummy
        values = (
            o_partial,
            lse_partial,
            out,
            lse if lse is not None else float_dummy,
            sinks.contiguous() if sinks is not None else float_dummy,
        )
        (self.bound or self._bind(values))(*values)

    def _bind(self, values) -> BoundKernel:
        o_partial, lse_partial, out, lse, _ = values
        ragged = self.ragged
        stride_lse = strides3(lse, ragged) if self.return_lse else (0, 0, 0)
        self.bound = self.spec.bind(
            *values,
            o_partial.stride(0),
            *strides3(o_partial[0], ragged),
            lse_partial.stride(0),
            *strides3(lse_partial[0], ragged),
            *strides3(out, ragged),
            *stride_lse,
            self.rows_per_batch,
            self.num_splits,
        )
        return self.bound
