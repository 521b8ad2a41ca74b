"""Dispatch: token copies sorted by expert into the grouped matmul's 1D layout, and back.

Three small Triton kernels replace a counting pass, a cumsum and a stable ``torch.argsort``: per
block of copies, count the copies of each expert; scan those counts into group offsets and each
block's first row per expert; place every copy at its block's row plus its rank among the block's
earlier copies of the same expert (a stable counting sort, no host sync). When every copy fits one
block (up to 1024 copies, fewer with many experts) one kernel does all three.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import runtime
from ..launch import BoundKernel, PlanCache, bind
from ..runtime import check_device, next_power_of_2

__all__ = ["dispatch", "check_dispatch", "dispatch_reference"]

# copies per block × padded experts per one-hot tile; 32k int32 elements keeps each program in registers
ONE_HOT_ELEMENTS = 1 << 15


@triton.jit
def _one_hot(ids_ptr, copies, num_copies, num_experts, EXPERTS: tl.constexpr):
    """``(ids, placed, one_hot)`` of the copies ``copies``: their expert ids (-1 where not placed: past the
    end, or an id outside [0, E), which counts nowhere) and ``[len(copies), EXPERTS]`` int32 one-hot rows."""
    valid = copies < num_copies
    ids = tl.load(ids_ptr + copies, mask=valid, other=-1)
    placed = valid & (ids >= 0) & (ids < num_experts)
    ids = tl.where(placed, ids, -1)
    return ids, placed, (ids[:, None] == tl.arange(0, EXPERTS)[None, :]).to(tl.int32)


@triton.jit
def _rank_in_block(one_hot):
    """Each copy's rank among the block's earlier copies of its expert (one-hot rows ``[copies, EXPERTS]``)."""
    return tl.sum((tl.cumsum(one_hot, axis=0) - one_hot) * one_hot, axis=1)


@triton.jit
def _count_kernel(ids_ptr, counts_ptr, num_copies, num_experts, BLOCK: tl.constexpr, EXPERTS: tl.constexpr):
    """counts ``[num_blocks, EXPERTS]``: copies of each expert in block ``program_id``."""
    block = tl.program_id(0)
    _, _, one_hot = _one_hot(ids_ptr, block * BLOCK + tl.arange(0, BLOCK), num_copies, num_experts, EXPERTS)
    tl.store(counts_ptr + block * EXPERTS + tl.arange(0, EXPERTS), tl.sum(one_hot, axis=0))


@triton.jit
def _scan_kernel(counts_ptr, offsets_ptr, num_blocks, num_experts, CHUNK: tl.constexpr, EXPERTS: tl.constexpr):
    """One program. ``offsets[e]`` = copies of experts below e (``[E + 1]``); counts are overwritten
    with each block's first row per expert: ``offsets[e] + Σ_{b' < b} counts[b', e]``."""
    experts = tl.arange(0, EXPERTS)
    totals = tl.zeros([EXPERTS], dtype=tl.int32)
    for start in range(0, num_blocks, CHUNK):
        blocks = start + tl.arange(0, CHUNK)
        tile = tl.load(
            counts_ptr + blocks[:, None] * EXPERTS + experts[None, :], mask=blocks[:, None] < num_blocks, other=0
        )
        totals += tl.sum(tile, axis=0)
    group_start = tl.cumsum(totals, axis=0) - totals
    tl.store(offsets_ptr + experts, group_start, mask=experts < num_experts)
    tl.store(offsets_ptr + num_experts, tl.sum(totals, axis=0))
    carry = group_start
    for start in range(0, num_blocks, CHUNK):
        blocks = start + tl.arange(0, CHUNK)
        pointers = counts_ptr + blocks[:, None] * EXPERTS + experts[None, :]
        in_range = blocks[:, None] < num_blocks
        tile = tl.load(pointers, mask=in_range, other=0)
        tl.store(pointers, carry[None, :] + tl.cumsum(tile, axis=0) - tile, mask=in_range)
        carry += tl.sum(tile, axis=0)


@triton.jit
def _place_kernel(
    ids_ptr,
    block_start_ptr,
    token_of_row_ptr,
    row_of_copy_ptr,
    num_copies,
    num_experts,
    TOP_K: tl.constexpr,
    BLOCK: tl.constexpr,
    EXPERTS: tl.constexpr,
):
    """Copy ``c`` of expert ``e`` goes to row ``block_start[block, e]`` + (copies of e before c in the block)."""
    block = tl.program_id(0)
    copies = block * BLOCK + tl.arange(0, BLOCK)
    ids, placed, one_hot = _one_hot(ids_ptr, copies, num_copies, num_experts, EXPERTS)
    rank = _rank_in_block(one_hot)
    rows = tl.load(block_start_ptr + block * EXPERTS + ids, mask=placed, other=0) + rank
    tl.store(row_of_copy_ptr + copies, tl.where(placed, rows, -1).to(tl.int64), mask=copies < num_copies)
    tl.store(token_of_row_ptr + rows, (copies // TOP_K).to(tl.int64), mask=placed)


@triton.jit
def _dispatch_one_block_kernel(
    ids_ptr,
    offsets_ptr,
    token_of_row_ptr,
    row_of_copy_ptr,
    num_copies,
    num_experts,
    TOP_K: tl.constexpr,
    BLOCK: tl.constexpr,
    EXPERTS: tl.constexpr,
):
    """Count, scan and place in one program when every copy fits one block (a decode step's tokens):
    one launch instead of three, and no block table."""
    copies = tl.arange(0, BLOCK)
    ids, placed, one_hot = _one_hot(ids_ptr, copies, num_copies, num_experts, EXPERTS)
    counts = tl.sum(one_hot, axis=0)
    group_start = tl.cumsum(counts, axis=0) - counts
    experts = tl.arange(0, EXPERTS)
    tl.store(offsets_ptr + experts, group_start, mask=experts < num_experts)
    tl.store(offsets_ptr + num_experts, tl.sum(counts, axis=0))
    rank = _rank_in_block(one_hot)
    rows = tl.sum(one_hot * group_start[None, :], axis=1) + rank
    tl.store(row_of_copy_ptr + copies, tl.where(placed, rows, -1).to(tl.int64), mask=copies < num_copies)
    tl.store(token_of_row_ptr + rows, (copies // TOP_K).to(tl.int64), mask=placed)


def dispatch(expert_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sorts the ``T · k`` token copies by expert (stably), on the device and without a host sync.

    Args:
        expert_ids: int32 or int64 ``[T, k]``, values in ``[0, E)``.
        num_experts: E.

    Returns:
        ``(token_of_row, a_offsets, row_of_copy)``: int64 ``[T·k]`` source token of each row of the
        expert-sorted layout (copies of one expert in token order); int32 ``[E + 1]`` group offsets
        (group e = expert e, empty groups included); int64 ``[T, k]`` row of each (token, slot) copy
        in that layout (the inverse). A copy whose id lies outside ``[0, E)`` is not placed: its
        ``row_of_copy`` is -1 and the rows past ``a_offsets[E]`` are left unwritten (nothing is
        written out of bounds).

    expert_ids may be any view (strided, expanded, offset).

    Raises:
        TypeError: expert_ids not an int32/int64 tensor.
        ValueError: expert_ids not 2D, num_experts not a positive int, a CPU tensor outside the interpreter.
    """
    key, plan = PLANS.lookup(expert_ids, num_experts)
    if plan is None:
        device = check_dispatch(expert_ids, num_experts)
        plan = PLANS.put(key, _Plan(expert_ids, num_experts, device))
    return plan(expert_ids)


PLANS = PlanCache("dispatch")


class _Plan:
    """Block sizes, buffer shapes and the bound kernels of one call signature (no tensor kept): one when
    every copy fits one block, else count, scan and place."""

    def __init__(self, expert_ids, num_experts: int, device):
        self.num_tokens, self.top_k = expert_ids.shape
        self.num_experts, self.device = num_experts, device
        self.num_copies = self.num_tokens * self.top_k
        self.experts = next_power_of_2(num_experts)
        self.block = max(16, min(1024, ONE_HOT_ELEMENTS // self.experts, next_power_of_2(max(self.num_copies, 1))))
        self.num_blocks = triton.cdiv(self.num_copies, self.block)
        self.kernels = None

    def __call__(self, expert_ids):
        new_buffer, device = runtime.new_buffer, self.device
        token_of_row = new_buffer(self.num_copies, torch.int64, device)
        row_of_copy = new_buffer((self.num_tokens, self.top_k), torch.int64, device)
        a_offsets = new_buffer(self.num_experts + 1, torch.int32, device)
        if self.num_blocks == 0:
            return token_of_row, a_offsets.zero_(), row_of_copy
        ids = expert_ids.contiguous().view(-1)
        if self.num_blocks == 1:
            (self.kernels or self._bind_one_block(ids, a_offsets, token_of_row, row_of_copy))(
                ids, a_offsets, token_of_row, row_of_copy
            )
            return token_of_row, a_offsets, row_of_copy
        block_start = new_buffer((self.num_blocks, self.experts), torch.int32, device)
        count, scan, place = self.kernels or self._bind(ids, block_start, a_offsets, token_of_row, row_of_copy)
        count(ids, block_start)
        scan(block_start, a_offsets)
        place(ids, block_start, token_of_row, row_of_copy)
        return token_of_row, a_offsets, row_of_copy

    def _bind_one_block(self, ids, a_offsets, token_of_row, row_of_copy) -> BoundKernel:
        self.kernels = bind(
            _dispatch_one_block_kernel,
            (1,),
            ids,
            a_offsets,
            token_of_row,
            row_of_copy,
            self.num_copies,
            self.num_experts,
            TOP_K=self.top_k,
            BLOCK=self.block,
            EXPERTS=self.experts,
        )
        return self.kernels

    def _bind(self, ids, block_start, a_offsets, token_of_row, row_of_copy) -> tuple[BoundKernel, ...]:
        num_blocks, num_copies, num_experts, experts = self.num_blocks, self.num_copies, self.num_experts, self.experts
        self.kernels = (
            bind(
                _count_kernel,
                (num_blocks,),
                ids,
                block_start,
                num_copies,
                num_experts,
                BLOCK=self.block,
                EXPERTS=experts,
            ),
            bind(
                _scan_kernel,
                (1,),
                block_start,
                a_offsets,
                num_blocks,
                num_experts,
                CHUNK=max(1, min(64, ONE_HOT_ELEMENTS // experts)),
                EXPERTS=experts,
            ),
            bind(
                _place_kernel,
                (num_blocks,),
                ids,
                block_start,
                token_of_row,
                row_of_copy,
                num_copies,
                num_experts,
                TOP_K=self.top_k,
                BLOCK=self.block,
                EXPERTS=experts,
            ),
        )
        return self.kernels


def dispatch_reference(expert_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`dispatch` in PyTorch (counts, cumsum, stable argsort, inverse permutation). Copies whose id lies
    outside ``[0, E)`` are not placed, as there: ``row_of_copy`` -1, and the rows past ``a_offsets[E]``
    (which :func:`dispatch` leaves unwritten) hold -1."""
    num_tokens, top_k = expert_ids.shape
    flat = expert_ids.reshape(-1).long()
    placed = (flat >= 0) & (flat < num_experts)
    key = torch.where(placed, flat, num_experts)  # unplaced copies sort last
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, key, torch.ones_like(key))  # bincount would sync to size its output
    a_offsets = torch.cat([counts.new_zeros(1), counts[:num_experts].cumsum(0)]).to(torch.int32)
    order = torch.argsort(key, stable=True)  # copy index of each sorted row
    row_of_copy = torch.empty_like(order)
    row_of_copy[order] = torch.arange(order.numel(), device=flat.device)
    row_of_copy = torch.where(placed, row_of_copy, -1)
    token_of_row = torch.where(placed[order], order // top_k, -1)
    return token_of_row, a_offsets, row_of_copy.view(num_tokens, top_k)


def check_dispatch(expert_ids, num_experts) -> torch.device:
    """The checks of :func:`dispatch` (no launch; safe while torch.compile traces); returns the device."""
    if not isinstance(expert_ids, torch.Tensor) or expert_ids.dtype not in (torch.int32, torch.int64):
        raise TypeError(
            f"expert_ids must be an int32/int64 [T, k] tensor, "
            f"got {getattr(expert_ids, 'dtype', type(expert_ids).__name__)}"
        )
    if expert_ids.dim() != 2:
        raise ValueError(f"expert_ids must be [T, k], got shape {tuple(expert_ids.shape)}")
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"num_experts must be a positive int, got {num_experts!r}")
    device = check_device(expert_ids=expert_ids)
    return device
