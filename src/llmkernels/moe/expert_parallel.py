"""Expert parallelism over ``torch.distributed``: each rank holds a contiguous block of the experts, routes its
own tokens, sends each (token, expert) copy to the rank that holds the expert with ``all_to_all_single``, runs
its experts on what it receives, and sends the results back.

Two modes (:class:`ExpertExchange`):

* **exact** (``capacity=None``, :meth:`ExpertExchange.exact`): the per-rank copy counts are exchanged first and
  read on the host (one sync), then the copies travel with those split sizes. Every copy is computed. For
  prefill. The sender orders its copies by expert (its own experts last), so that each source's rows arrive
  grouped by local expert: the receiver runs its grouped matmuls straight on the received buffer (one group per
  (source, expert)), writes the outputs where the return all-to-all reads them, and the returned rows land in the
  sender's order, where the combine reads them. The rows a rank keeps for its own experts are never exchanged: its
  gather writes them where its grouped matmuls read them, and they run in two parts
  (:attr:`ExpertExchange.kept_first`): the first half of its experts' rows while the dispatch is in flight, the
  others' while the return is. The payload is any set of row-major parts (bf16 rows, or quantized data and its
  scales). With ``micro_batches = m`` the tokens run in m chunks: chunk i+1's dispatch all-to-all and chunk i's
  return are in flight (``async_op=True``) while chunk i's experts run; the counts of all chunks travel in one
  exchange (still one sync). Each token's result does not depend on the chunking.
* **bounded** (``capacity=C``): every rank sends exactly ``C`` rows to every rank (padding included), so no
  count reaches the host: no sync, CUDA-graph capturable. For decode. One chunk; the payload is any set of
  row-major parts, as in the exact mode. **Rule for the overflow**: a rank's copies to one destination beyond the
  first ``C`` (in token order, then top-k slot) are dropped: their expert's output is left out of the token's
  weighted sum (the other weights are not renormalized). The number of copies dropped in the last forward is :attr:`ExpertExchange.dropped` (a device
  tensor, read it when convenient); dropped copies never change any other token's result.

The local experts run exactly as on one GPU.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from ..ops import dispatch

__all__ = ["ExpertExchange"]


class ExpertExchange:
    """The token exchange of one expert-parallel MoE block over ``group`` (``W`` ranks, ``E / W`` experts each:
    rank ``r`` owns experts ``r·E/W … (r+1)·E/W − 1``).

    :meth:`exact` runs the exact mode's forward around this rank's experts (what the block calls without a
    capacity). In the bounded mode :meth:`send` takes this rank's tokens and their routing, and returns the rows this
    rank's experts must run; :meth:`receive` takes those rows' outputs and returns this rank's tokens' outputs.
    """

    def __init__(self, group, num_experts: int, capacity: int | None, micro_batches: int = 1, device=None):
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.num_experts = num_experts
        self.experts_per_rank = num_experts // self.world
        self.capacity = capacity
        self.micro_batches = micro_batches
        # exact mode: run half the copies kept here while the dispatch is in flight, then the received rows, then
        # the other kept copies while the return is in flight (three calls of the experts per chunk); False: one
        # call on both, between the dispatch and the return
        self.kept_first = True
        self.dropped = None  # copies dropped in the last bounded forward (int64 device scalar)
        world, rank, per_rank = self.world, self.rank, self.experts_per_rank
        # The exact mode's sort key of each global expert: the experts of the other ranks in rank order, then this
        # rank's own, so that the copies for the other ranks are one contiguous block in rank order (what
        # all_to_all_single sends) and the kept copies follow it.
        experts = torch.arange(num_experts)
        owner = experts // per_rank
        key = torch.where(owner < rank, experts, experts - per_rank)
        key = torch.where(owner == rank, experts + (world - 1 - rank) * per_rank, key)
        self.sort_key = key.to(device=device, dtype=torch.int32)  # [E] global expert -> sort key
        # the receiver's rows: this rank's own copies first, then the other sources in rank order
        self.sources = torch.tensor([rank] + [s for s in range(world) if s != rank], device=device)
        self.group_expert_ids = torch.arange(per_rank, dtype=torch.int32, device=device).repeat(world)

    def exact(
        self,
        parts: Sequence[torch.Tensor],
        expert_ids: torch.Tensor,
        run_experts: Callable,
        hidden: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The exact mode's forward around this rank's experts.

        Args:
            parts: the payload of this rank's ``T`` tokens, row-major ``[T, ...]`` tensors of any dtype that the
                backend moves (bf16 rows, or quantized data and scales as uint8 / float32); row t of each part
                travels with every copy of token t.
            expert_ids: int ``[T, k]`` global expert ids.
            run_experts: ``run_experts(rows, a_offsets, group_expert_ids, out)``: ``rows``, the parts' ``[R, ...]``
                rows this rank's experts run (views), grouped by ``a_offsets`` (int32 ``[G + 1]``: one group per
                (source rank, local expert) of these rows, G = E/W · the sources given: 1, W − 1 or W) with the
                local expert ``group_expert_ids[g]`` (int32 ``[G]``); it writes the bf16 ``[R, hidden]`` outputs
                into ``out`` (a view). Called once or three times per micro-batch (:attr:`kept_first`).

        Returns:
            ``(results, row_of_copy)``: bf16 ``[N, hidden]`` holding the expert outputs of this rank's copies (and
            other rows), and int64 ``[T, k]``, the row of ``results`` of token t's slot s (:func:`combine`'s
            arguments).
        """
        num_tokens, top_k = expert_ids.shape
        world, rank, per_rank, device = self.world, self.rank, self.experts_per_rank, expert_ids.device
        if self.sort_key.device != device:  # the block was moved (``.to()``): the tables follow once
            self.sort_key, self.sources, self.group_expert_ids = (
                t.to(device) for t in (self.sort_key, self.sources, self.group_expert_ids)
            )
        chunks = self.micro_batches  # on every rank, also one with fewer tokens (empty chunks exchange nothing)
        bounds = [num_tokens * c // chunks for c in range(chunks + 1)]
        keys = self.sort_key[expert_ids]
        routed = [dispatch(keys[bounds[c] : bounds[c + 1]], self.num_experts) for c in range(chunks)]
        # copies per (destination, chunk, local expert): every chunk's counts in one exchange
        send_counts = torch.stack([offsets.diff().index_select(0, self.sort_key) for _, offsets, _ in routed])
        send_counts = send_counts.view(chunks, world, per_rank).transpose(0, 1).contiguous()
        recv_counts = torch.empty_like(send_counts)
        if world > 1:
            dist.all_to_all_single(recv_counts, send_counts, group=self.group)
        else:
            recv_counts = send_counts
        # the kept copies run in two calls, the first `early` local experts' while the dispatch is in flight and
        # the others' while the return is: the rows of the first part travel in the one sync
        early = per_rank // 2
        counts = torch.cat([send_counts.sum(2), recv_counts.sum(2), send_counts[rank : rank + 1, :, :early].sum(2)])
        counts = counts.tolist()  # the exact mode's one sync
        send_sizes, recv_sizes, kept_early = counts[:world], counts[world : 2 * world], counts[2 * world]
        ordered = recv_counts.index_select(0, self.sources).permute(1, 0, 2).reshape(chunks, world * per_rank)
        a_offsets = torch.nn.functional.pad(ordered.cumsum(1), (1, 0)).to(torch.int32)  # [chunks, W·E/W + 1]
        layout, base = [], 0  # per chunk: (start, rows sent away, copies, rows received from the others)
        for c in range(chunks):
            copies = (bounds[c + 1] - bounds[c]) * top_k
            kept = send_sizes[rank][c]
            received = sum(recv_sizes[s][c] for s in range(world)) - kept
            layout.append((base, copies - kept, copies, received))
            base += copies + received
        buffers = [part.new_empty((base, *part.shape[1:])) for part in parts]
        out = torch.empty((base, hidden), dtype=torch.bfloat16, device=device)

        def splits(sizes, c):
            return [0 if s == rank else sizes[s][c] for s in range(world)]

        def post_dispatch(c):
            start, sent, copies, received = layout[c]
            token_of_row = routed[c][0]
            works = []
            for part, buffer in zip(parts, buffers):
                torch.index_select(part[bounds[c] : bounds[c + 1]], 0, token_of_row, out=buffer[start : start + copies])
                if world > 1:
                    works.append(
                        dist.all_to_all_single(
                            buffer[start + copies : start + copies + received],
                            buffer[start : start + sent],
                            splits(recv_sizes, c),
                            splits(send_sizes, c),
                            group=self.group,
                            async_op=True,
                        )
                    )
            return works

        kept_first = self.kept_first and world > 1
        if kept_first:  # the groups of the kept copies (two parts), and those of the received rows, each from 0
            early_offsets = a_offsets[:, : early + 1]
            late_offsets = a_offsets[:, early : per_rank + 1] - a_offsets[:, early : early + 1]
            received_offsets = a_offsets[:, per_rank:] - a_offsets[:, per_rank : per_rank + 1]

        def run_kept(c, first: bool):
            start, sent = layout[c][:2]
            if first:
                rows, offsets, ids = slice(start + sent, start + sent + kept_early[c]), early_offsets[c], slice(early)
            else:
                rows = slice(start + sent + kept_early[c], start + sent + send_sizes[rank][c])
                offsets, ids = late_offsets[c], slice(early, per_rank)
            run_experts([buffer[rows] for buffer in buffers], offsets, self.group_expert_ids[ids], out[rows])

        pending = post_dispatch(0)
        returns = []
        for c in range(chunks):
            following = post_dispatch(c + 1) if c + 1 < chunks else []
            start, sent, copies, received = layout[c]
            if kept_first and early:  # while the chunk's dispatch is in flight
                run_kept(c, first=True)
            for work in pending:
                work.wait()
            if kept_first:
                rows = slice(start + copies, start + copies + received)
                ids = self.group_expert_ids[per_rank:]
                run_experts([buffer[rows] for buffer in buffers], received_offsets[c], ids, out[rows])
            else:
                rows = slice(start + sent, start + copies + received)  # this rank's kept copies, then the received
                run_experts([buffer[rows] for buffer in buffers], a_offsets[c], self.group_expert_ids, out[rows])
            if world > 1:
                returns.append(
                    dist.all_to_all_single(
                        out[start : start + sent],
                        out[start + copies : start + copies + received],
                        splits(send_sizes, c),
                        splits(recv_sizes, c),
                        group=self.group,
                        async_op=True,
                    )
                )
            if kept_first:  # while the chunk's return is in flight
                run_kept(c, first=False)
            pending = following
        for work in returns:
            work.wait()
        if chunks == 1:
            return out, routed[0][2]
        return out, torch.cat([row_of_copy + layout[c][0] for c, (_, _, row_of_copy) in enumerate(routed)])

    def send(self, parts: Sequence[torch.Tensor], expert_ids: torch.Tensor):
        """The bounded mode's dispatch. parts: this rank's ``T`` tokens' payload, row-major ``[T, ...]`` tensors (bf16
        rows, or quantized data and scales as uint8 / float32); expert_ids: int ``[T, k]`` global expert ids. Returns
        ``(rows, local_ids [W·C] int32, state)``: ``rows``, the parts' ``[W·C, ...]`` copies this rank's experts run
        (padding rows are zeros with local id 0), and what :meth:`receive` needs."""
        top_k = expert_ids.shape[1]
        dest = (expert_ids.reshape(-1) // self.experts_per_rank).to(torch.int64)  # [T·k] destination rank
        order = torch.argsort(dest, stable=True)  # copies grouped by destination, token order within
        dest_sorted = dest[order]
        local_sorted = (expert_ids.reshape(-1)[order] - dest_sorted * self.experts_per_rank).to(torch.int32)
        token_sorted = order // top_k
        # counts by scatter_add: bincount would sync to size its output
        device = expert_ids.device
        send_counts = torch.zeros(self.world, dtype=torch.int64, device=device).scatter_add_(
            0, dest, torch.ones_like(dest)
        )
        capacity = self.capacity
        starts = torch.cumsum(send_counts, 0) - send_counts
        slot = torch.arange(dest.numel(), device=device) - starts[dest_sorted]  # rank among copies to that rank
        kept = slot < capacity
        self.dropped = (~kept).sum()
        position = torch.where(kept, dest_sorted * capacity + slot, self.world * capacity)  # the last row: a sink
        rows = []
        for part in parts:
            send_rows = part.new_zeros((self.world * capacity + 1, *part.shape[1:]))
            send_rows[position] = part[token_sorted]
            rows.append(torch.empty_like(send_rows[:-1]))
            dist.all_to_all_single(rows[-1], send_rows[:-1], group=self.group)
        send_ids = torch.zeros(self.world * capacity + 1, dtype=torch.int32, device=device)
        send_ids[position] = local_sorted
        local_ids = torch.empty_like(send_ids[:-1])
        dist.all_to_all_single(local_ids, send_ids[:-1], group=self.group)
        return rows, local_ids, (order, position)

    def receive(self, outputs: torch.Tensor, state) -> tuple[torch.Tensor, torch.Tensor]:
        """The bounded mode's return. outputs: ``[W·C, H]`` the experts' results for :meth:`send`'s rows, in their
        order. Returns ``(results, row_of_copy)``: int64 ``row_of_copy [T·k]`` is the row of ``results`` holding token
        t's slot s at ``t·k + s``; -1 for a dropped copy (:func:`llmkernels.moe.combine` skips rows outside
        results)."""
        order, position = state
        row_of_copy = torch.empty_like(order)
        results = torch.empty_like(outputs)
        dist.all_to_all_single(results, outputs.contiguous(), group=self.group)
        row_of_copy[order] = torch.where(position < self.world * self.capacity, position, -1)
        return results, row_of_copy
