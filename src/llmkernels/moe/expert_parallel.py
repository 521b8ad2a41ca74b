"""Expert parallelism over ``torch.distributed``: each rank holds a contiguous block of the experts, routes its
own tokens, sends each (token, expert) copy to the rank that holds the expert with ``all_to_all_single``, runs
its experts on what it receives, and sends the results back.

Two modes (:class:`ExpertExchange`):

* **exact** (``capacity=None``): the per-rank copy counts are exchanged first and read on the host (one sync),
  then the copies travel with those split sizes. Every copy is computed. For prefill.
* **bounded** (``capacity=C``): every rank sends exactly ``C`` rows to every rank (padding included), so no
  count reaches the host: no sync, CUDA-graph capturable. For decode. **Rule for the overflow**: a rank's copies
  to one destination beyond the first ``C`` (in token order, then top-k slot) are dropped: their expert's
  output is left out of the token's weighted sum (the other weights are not renormalized). The number of copies
  dropped in the last forward is :attr:`ExpertExchange.dropped` (a device tensor, read it when convenient);
  dropped copies never change any other token's result.

The exchange moves bf16 activations and int32 local expert ids; the local experts run exactly as on one GPU.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["ExpertExchange"]


class ExpertExchange:
    """The token exchange of one expert-parallel MoE block over ``group`` (``W`` ranks, ``E / W`` experts each:
    rank ``r`` owns experts ``r·E/W … (r+1)·E/W − 1``).

    :meth:`send` takes this rank's tokens and their routing, and returns the rows this rank's experts must run;
    :meth:`receive` takes those rows' outputs and returns this rank's tokens' outputs.
    """

    def __init__(self, group, num_experts: int, capacity: int | None):
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.experts_per_rank = num_experts // self.world
        self.capacity = capacity
        self.dropped = None  # copies dropped in the last bounded forward (int64 device scalar)

    def send(self, x: torch.Tensor, expert_ids: torch.Tensor):
        """x: bf16 ``[T, H]`` this rank's tokens; expert_ids: int ``[T, k]`` global expert ids. Returns
        ``(rows [R, H] bf16, local_ids [R] int32, state)``: the copies this rank's experts run (padding rows of the
        bounded mode are zeros with local id 0) and what :meth:`receive` needs."""
        top_k = expert_ids.shape[1]
        dest = (expert_ids.reshape(-1) // self.experts_per_rank).to(torch.int64)  # [T·k] destination rank
        order = torch.argsort(dest, stable=True)  # copies grouped by destination, token order within
        dest_sorted = dest[order]
        local_sorted = (expert_ids.reshape(-1)[order] - dest_sorted * self.experts_per_rank).to(torch.int32)
        token_sorted = order // top_k
        # counts by scatter_add: bincount would sync to size its output
        send_counts = torch.zeros(self.world, dtype=torch.int64, device=x.device).scatter_add_(
            0, dest, torch.ones_like(dest)
        )
        if self.capacity is None:
            recv_counts = torch.empty_like(send_counts)
            dist.all_to_all_single(recv_counts, send_counts, group=self.group)
            send_sizes, recv_sizes = send_counts.tolist(), recv_counts.tolist()  # the exact mode's one sync
            send_rows = x[token_sorted]
            rows = x.new_empty((sum(recv_sizes), x.shape[1]))
            dist.all_to_all_single(rows, send_rows, recv_sizes, send_sizes, group=self.group)
            local_ids = torch.empty(sum(recv_sizes), dtype=torch.int32, device=x.device)
            dist.all_to_all_single(local_ids, local_sorted, recv_sizes, send_sizes, group=self.group)
            # the copy in send position i belongs to (token, slot) order[i]
            return rows, local_ids, (order, send_sizes, recv_sizes)
        capacity = self.capacity
        starts = torch.cumsum(send_counts, 0) - send_counts
        slot = torch.arange(dest.numel(), device=x.device) - starts[dest_sorted]  # rank among copies to that rank
        kept = slot < capacity
        self.dropped = (~kept).sum()
        position = torch.where(kept, dest_sorted * capacity + slot, self.world * capacity)  # the last row: a sink
        send_rows = x.new_zeros((self.world * capacity + 1, x.shape[1]))
        send_rows[position] = x[token_sorted]
        send_ids = torch.zeros(self.world * capacity + 1, dtype=torch.int32, device=x.device)
        send_ids[position] = local_sorted
        rows = torch.empty_like(send_rows[:-1])
        dist.all_to_all_single(rows, send_rows[:-1], group=self.group)
        local_ids = torch.empty_like(send_ids[:-1])
        dist.all_to_all_single(local_ids, send_ids[:-1], group=self.group)
        return rows, local_ids, (order, position)

    def receive(self, outputs: torch.Tensor, state) -> tuple[torch.Tensor, torch.Tensor]:
        """outputs: ``[R, H]`` the experts' results for :meth:`send`'s rows, in their order. Returns
        ``(results, row_of_copy)``: int64 ``row_of_copy [T·k]`` is the row of ``results`` holding token t's slot s
        at ``t·k + s``; -1 for a dropped copy (:func:`llmkernels.moe.combine` skips rows outside results)."""
        order = state[0]
        row_of_copy = torch.empty_like(order)
        if self.capacity is None:
            _, send_sizes, recv_sizes = state
            results = outputs.new_empty((sum(send_sizes), outputs.shape[1]))
            dist.all_to_all_single(results, outputs.contiguous(), send_sizes, recv_sizes, group=self.group)
            row_of_copy[order] = torch.arange(order.numel(), device=order.device)
            return results, row_of_copy
        _, position = state
        results = torch.empty_like(outputs)
        dist.all_to_all_single(results, outputs.contiguous(), group=self.group)
        row_of_copy[order] = torch.where(position < self.world * self.capacity, position, -1)
        return results, row_of_copy
