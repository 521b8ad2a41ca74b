"""Dispatch: token copies sorted by expert into the grouped matmul's 1D layout, and back."""
from __future__ import annotations

import torch

__all__ = ["dispatch"]


def dispatch(expert_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sorts the ``T · k`` token copies by expert, on the device and without a host sync.

    Args:
        expert_ids: int32 ``[T, k]``, values in ``[0, E)``.
        num_experts: E.

    Returns:
        ``(token_of_row, a_offsets, row_of_copy)``: int64 ``[T·k]`` source token of each row of the
        expert-sorted layout; int32 ``[E + 1]`` group offsets (group e = expert e, empty groups
        included); int64 ``[T, k]`` row of each (token, slot) copy in that layout (the inverse).
    """
    num_tokens, top_k = expert_ids.shape
    flat = expert_ids.reshape(-1).long()
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # bincount would sync to size its output
    a_offsets = torch.cat([counts.new_zeros(1), counts.cumsum(0)]).to(torch.int32)
    order = torch.argsort(flat, stable=True)  # copy index of each sorted row
    row_of_copy = torch.empty_like(order)
    row_of_copy[order] = torch.arange(order.numel(), device=flat.device)
    return order // top_k, a_offsets, row_of_copy.view(num_tokens, top_k)
