"""A prototype: the exact mode's exchange plan (``ExpertExchange._plan_sends``, ~25 small torch ops, ~0.2 ms of
host time before the one sync at W = 2 on an H200) as one single-program Triton kernel. Not in the product until a
GPU run shows it winning (``measure.py``); ``check.py`` compares its outputs with the product's on the CPU.

Per destination rank d (in rank order) and token block: the tokens with a copy on d (none for this rank), their
rows among those sent (a running count: rank-major, token order within), each row's token, local expert ids on d
(-1 for its other slots) and routing weights, the (token, rank) -> row table, and the rows and copies per rank.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def exchange_plan_kernel(
    dest_ptr,  # int64 [T, K] destination rank of each copy
    local_ptr,  # int64 [T, K] local expert id there
    weights_ptr,  # float32 [T, K]
    token_ptr,  # int64 [bound] out: token of each row sent (0 past the count)
    ids_ptr,  # int64 [bound, K] out
    row_weights_ptr,  # float32 [bound, K] out
    rows_ptr,  # int64 [T, WORLD] out: row of (token, rank), or -1
    counts_ptr,  # int64 [WORLD, 2] out: rows and copies to each rank
    num_tokens,
    bound,
    RANK,
    WORLD: tl.constexpr,
    K: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    slots = tl.arange(0, K)
    sent = 0
    for d in range(WORLD):
        rows_d = 0
        copies = 0
        for start in range(0, num_tokens, BLOCK_T):
            tokens = start + tl.arange(0, BLOCK_T)
            valid = tokens < num_tokens
            at = tokens[:, None].to(tl.int64) * K + slots[None, :]
            dest = tl.load(dest_ptr + at, mask=valid[:, None], other=-1)
            on = dest == d
            copies += tl.sum(on.to(tl.int64))
            has = (tl.max(on.to(tl.int32), axis=1) > 0) & (tokens * 0 + d != RANK)  # never to this rank
            has_i = has.to(tl.int64)
            row = sent + rows_d + tl.cumsum(has_i, axis=0) - has_i
            tl.store(rows_ptr + tokens.to(tl.int64) * WORLD + d, tl.where(has, row, -1), mask=valid)
            tl.store(token_ptr + row, tokens.to(tl.int64), mask=has)
            local = tl.load(local_ptr + at, mask=valid[:, None], other=0)
            weight = tl.load(weights_ptr + at, mask=valid[:, None], other=0.0)
            out_at = row[:, None] * K + slots[None, :]
            tl.store(ids_ptr + out_at, tl.where(on, local, -1), mask=has[:, None])
            tl.store(row_weights_ptr + out_at, weight, mask=has[:, None])
            rows_d += tl.sum(has_i)
        tl.store(counts_ptr + 2 * d, rows_d)
        tl.store(counts_ptr + 2 * d + 1, copies)
        sent += rows_d
    for start in range(sent, bound, BLOCK_T):  # the rows past the count gather token 0, never sent
        rows = start + tl.arange(0, BLOCK_T)
        tl.store(token_ptr + rows, tl.zeros([BLOCK_T], dtype=tl.int64), mask=rows < bound)


def exchange_plan(dest: torch.Tensor, local_ids: torch.Tensor, weights: torch.Tensor, rank: int, world: int):
    """``(token, ids, weights, rows, counts)`` as ``_Sends`` holds them (ids int64 here)."""
    num_tokens, top_k = dest.shape
    bound = num_tokens * min(top_k, world - 1)
    device = dest.device
    token = torch.empty(bound, dtype=torch.int64, device=device)
    ids = torch.empty(bound, top_k, dtype=torch.int64, device=device)
    row_weights = torch.empty(bound, top_k, dtype=torch.float32, device=device)
    rows = torch.empty(num_tokens, world, dtype=torch.int64, device=device)
    counts = torch.empty(world, 2, dtype=torch.int64, device=device)
    block = min(1024, triton.next_power_of_2(max(num_tokens, 16)))
    exchange_plan_kernel[(1,)](
        dest.contiguous(),
        local_ids.contiguous(),
        weights.float().contiguous(),
        token,
        ids,
        row_weights,
        rows,
        counts,
        num_tokens,
        bound,
        rank,
        WORLD=world,
        K=top_k,
        BLOCK_T=block,
    )
    return token, ids, row_weights, rows, counts
