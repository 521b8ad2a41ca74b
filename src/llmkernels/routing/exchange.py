"""The expert-parallel exchange's device work: its plan in one kernel, and a gather of rows up to a device count.

:func:`plan_exchange` turns a rank's routing into what its exact-mode exchange sends, in one single-program launch
(the same plan in torch ops took ~25 small launches and ~0.2 ms of host time before the exchange's one sync).
:func:`gather_rows` copies the rows ``index[:count]`` of a tensor where ``count`` lives on the device: a call sized
by a bound on its rows (known without a sync) moves only the rows that exist.

Internal to :mod:`llmkernels.moe.expert_parallel`, which builds every argument: nothing here checks its arguments.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import runtime
from ..launch import PlanCache, bind
from ..runtime import next_power_of_2

__all__ = ["plan_exchange", "gather_rows"]


@triton.jit
def _plan_exchange_kernel(
    expert_ids_ptr,
    weights_ptr,
    own_ids_ptr,
    token_ptr,
    sent_ids_ptr,
    sent_weights_ptr,
    rows_ptr,
    weights_table_ptr,
    counts_ptr,
    num_tokens,
    bound,
    row_offset,
    sent_row_words,
    RANK: tl.constexpr,
    WORLD: tl.constexpr,
    PER_RANK: tl.constexpr,
    K: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_W: tl.constexpr,
):
    """One program; see :func:`plan_exchange`. Rows sent are rank-major (destinations in rank order), tokens in
    order within a destination: a running count over destinations, then over token blocks."""
    slots = tl.arange(0, BLOCK_K)
    ranks = tl.arange(0, BLOCK_W)
    for start in range(0, num_tokens, BLOCK_T):  # this rank's own copies, and the combine's weights
        tokens = start + tl.arange(0, BLOCK_T)
        copy = (tokens < num_tokens)[:, None] & (slots < K)[None, :]
        at = tokens[:, None].to(tl.int64) * K + slots[None, :]
        ids = tl.load(expert_ids_ptr + at, mask=copy, other=0)
        dest = ids // PER_RANK
        tl.store(own_ids_ptr + at, tl.where(dest == RANK, ids - dest * PER_RANK, -1).to(tl.int32), mask=copy)
        table = weights_table_ptr + tokens[:, None].to(tl.int64) * (K + WORLD)
        tl.store(table + slots[None, :], tl.load(weights_ptr + at, mask=copy), mask=copy)
        returned = (tokens < num_tokens)[:, None] & (ranks < WORLD)[None, :]
        tl.store(table + K + ranks[None, :], tl.full([BLOCK_T, BLOCK_W], 1.0, tl.float32), mask=returned)
    sent = tl.zeros([], dtype=tl.int64)
    for d in tl.static_range(WORLD):
        rows_d = tl.zeros([], dtype=tl.int64)
        copies = tl.zeros([], dtype=tl.int64)
        for start in range(0, num_tokens, BLOCK_T):
            tokens = start + tl.arange(0, BLOCK_T)
            valid = tokens < num_tokens
            copy = valid[:, None] & (slots < K)[None, :]
            at = tokens[:, None].to(tl.int64) * K + slots[None, :]
            ids = tl.load(expert_ids_ptr + at, mask=copy, other=-1)
            on = copy & (ids // PER_RANK == d)
            copies += tl.sum(on.to(tl.int64))
            if d == RANK:  # a rank's own copies never travel
                tl.store(rows_ptr + tokens.to(tl.int64) * WORLD + d, tl.full([BLOCK_T], -1, tl.int64), mask=valid)
            else:
                has = tl.max(on.to(tl.int32), axis=1) > 0
                has_i = has.to(tl.int64)
                row = sent + rows_d + tl.cumsum(has_i, axis=0) - has_i
                tl.store(rows_ptr + tokens.to(tl.int64) * WORLD + d, tl.where(has, row + row_offset, -1), mask=valid)
                tl.store(token_ptr + row, tokens.to(tl.int64), mask=has)
                out_at = row[:, None] * sent_row_words + slots[None, :]
                written = has[:, None] & (slots < K)[None, :]
                tl.store(sent_ids_ptr + out_at, tl.where(on, ids - d * PER_RANK, -1).to(tl.int32), mask=written)
                tl.store(sent_weights_ptr + out_at, tl.load(weights_ptr + at, mask=copy), mask=written)
                rows_d += tl.sum(has_i)
        tl.store(counts_ptr + 2 * d, rows_d)
        tl.store(counts_ptr + 2 * d + 1, copies)
        sent += rows_d
    for start in range(sent, bound, BLOCK_T):  # the rows past the count gather token 0 and are never sent
        rows = start + tl.arange(0, BLOCK_T)
        tl.store(token_ptr + rows, tl.zeros([BLOCK_T], dtype=tl.int64), mask=rows < bound)


_PLANS = PlanCache("exchange")


def plan_exchange(
    expert_ids: torch.Tensor,
    weights: torch.Tensor,
    sent_ids: torch.Tensor,
    sent_weights: torch.Tensor,
    rank: int,
    world: int,
    experts_per_rank: int,
    row_offset: int,
):
    """What rank ``rank`` of ``world`` sends in the exact mode, for its ``T`` tokens routed to ``k`` experts each.

    A token travels once to each other rank that holds one or more of its experts (rank ``id // experts_per_rank``).
    The ``bound = T · min(k, world - 1)`` rows sent are rank-major, tokens in order within a rank.

    Args:
        expert_ids: int32/int64 ``[T, k]`` global expert ids; weights: float32 ``[T, k]``.
        sent_ids: int32 ``[bound, k]`` view, written: each row's local expert ids on its rank, -1 for the token's
            slots elsewhere. sent_weights: float32 ``[bound, k]`` view, written: the token's routing weights. Both
            are fields of the byte rows sent, with one row stride (in 4-byte words); rows past the count are left
            unwritten.
        row_offset: added to the rows of the combine table.

    Returns:
        ``(own_ids, token, rows, weights_table, counts)``: int32 ``[T, k]`` local expert id of each copy this rank
        keeps (-1 elsewhere); int64 ``[bound]`` token of each row sent (0 past the count); int64 ``[T, world]`` the
        row (plus ``row_offset``) of (token, rank) among those sent, where its returned sum lands, or -1; float32
        ``[T, k + world]`` the combine's weights (the routing weights, then 1 for each rank's returned sum); int64
        ``[world, 2]`` the rows and the copies sent to each rank (the copies this rank keeps included).
    """
    num_tokens, top_k = expert_ids.shape
    bound = num_tokens * min(top_k, world - 1)
    device = expert_ids.device
    expert_ids, weights = expert_ids.contiguous(), weights.contiguous()
    key, plan = _PLANS.lookup(expert_ids, weights, sent_ids, sent_weights, rank, world, experts_per_rank, row_offset)
    new_buffer = runtime.new_buffer
    own_ids = new_buffer((num_tokens, top_k), torch.int32, device)
    token = new_buffer(bound, torch.int64, device)
    rows = new_buffer((num_tokens, world), torch.int64, device)
    weights_table = new_buffer((num_tokens, top_k + world), torch.float32, device)
    counts = new_buffer((world, 2), torch.int64, device)
    outputs = (own_ids, token, sent_ids, sent_weights, rows, weights_table, counts)
    if plan is None:
        plan = _PLANS.put(
            key,
            bind(
                _plan_exchange_kernel,
                (1,),
                expert_ids,
                weights,
                *outputs,
                num_tokens,
                bound,
                row_offset,
                sent_ids.stride(0),
                RANK=rank,
                WORLD=world,
                PER_RANK=experts_per_rank,
                K=top_k,
                BLOCK_T=max(16, min(1024, next_power_of_2(num_tokens))),
                BLOCK_K=next_power_of_2(top_k),
                BLOCK_W=next_power_of_2(world),
                num_warps=8,
            ),
        )
    plan(expert_ids, weights, *outputs)
    return own_ids, token, rows, weights_table, counts


@triton.jit
def _gather_rows_kernel(
    src_ptr,
    index_ptr,
    count_ptr,
    out_ptr,
    src_stride,
    WORDS: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_W: tl.constexpr,
):
    """Rows ``r < count`` of out: ``out[r] = src[index[r]]``, ``BLOCK_R`` rows a program (the others return)."""
    count = tl.load(count_ptr)
    start = tl.program_id(0) * BLOCK_R
    if start < count:
        rows = start + tl.arange(0, BLOCK_R)
        valid = rows < count
        source = tl.load(index_ptr + rows, mask=valid, other=0).to(tl.int64)
        for first in tl.static_range(0, WORDS, BLOCK_W):
            words = first + tl.arange(0, BLOCK_W)
            mask = valid[:, None] & (words[None, :] < WORDS)
            values = tl.load(src_ptr + source[:, None] * src_stride + words[None, :], mask=mask)
            tl.store(out_ptr + rows[:, None].to(tl.int64) * WORDS + words[None, :], values, mask=mask)


_GATHERS = PlanCache("gather_rows")


def gather_rows(src: torch.Tensor, index: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """``out[r] = src[index[r]]`` for ``r < count``: a new ``[R, ...]`` tensor (``R = len(index)``) whose rows from
    ``count`` on are left unwritten.

    Args:
        src: ``[N, ...]`` of any dtype, each row unit-stride (rows at any stride); index: int32/int64 ``[R]``
            (contiguous), values in ``[0, N)`` below ``count``; count: int32/int64 one-element tensor on the
            device (read there: no sync), at most ``R``.
    """
    out = runtime.new_buffer((len(index), *src.shape[1:]), src.dtype, src.device)
    if out.numel() == 0:
        return out
    row_bytes = out[0].numel() * out.element_size()
    word = torch.int32 if row_bytes % 4 == 0 and (src.stride(0) * src.element_size()) % 4 == 0 else torch.uint8
    source = src.reshape(src.shape[0], -1) if src.dim() != 2 else src
    source, target = source.view(word), out.view(len(index), -1).view(word)
    key, plan = _GATHERS.lookup(source, index, count, target)
    if plan is None:
        words = target.shape[1]
        block_w = min(1024 if word == torch.int32 else 4096, next_power_of_2(words))
        block_r = max(1, 4096 // block_w)
        plan = _GATHERS.put(
            key,
            bind(
                _gather_rows_kernel,
                (triton.cdiv(len(index), block_r),),
                source,
                index,
                count,
                target,
                source.stride(0),
                WORDS=words,
                BLOCK_R=block_r,
                BLOCK_W=block_w,
                num_warps=4,
            ),
        )
    plan(source, index, count, target)
    return out
