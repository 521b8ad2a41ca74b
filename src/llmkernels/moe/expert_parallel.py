"""Expert parallelism over ``torch.distributed``: each rank holds a contiguous block of the experts, routes its
own tokens, sends them to the ranks that hold their experts with ``all_to_all_single``, runs its experts on what it
receives, and sends the results back.

Two modes (:class:`ExpertExchange`):

* **exact** (``capacity=None``, :meth:`ExpertExchange.exact`): for prefill. Every copy is computed. A token travels
  once to each rank that holds one or more of its experts (not once per expert: top-8 of 64 experts over 4 ranks
  puts ~2 copies on each rank, so the exchange moves 2.7 rows a token instead of 6), with its local expert ids and
  routing weights. The expert rank runs the copies it received, grouped by expert across every source, sums each
  token's copies weighted (fp32, one bf16 rounding) and returns one row per (token, rank); the sender adds those
  rows to its own experts' weighted copies. The exchange is planned in one kernel
  (:func:`llmkernels.routing.exchange.plan_exchange`); the per-rank row counts are exchanged first and read on the
  host (one sync). The copies a rank keeps for its own experts are never exchanged and run in two calls: the first
  (three quarters of its experts at W = 2, half beyond) is launched before the sync over a bound on its rows
  (rows past the device count are never computed), so the GPU runs it while the host waits and
  then posts the dispatch; the other runs while the return is in flight. The dispatch, and the received rows'
  sort and gather, run on a side stream. W = 1 with row-local activations needs no sync. The payload is any set
  of row-major parts (bf16 rows, or quantized data and its scales).

  **Rounding**: a token's copies on its own rank are summed in fp32 as on one GPU; each other rank's copies are
  summed in fp32 there and rounded to bf16 once before they travel, then added in fp32 (own copies in slot order,
  then the other ranks in rank order). The result differs from the one-GPU block by those roundings (at most
  2^-9 of each remote partial sum).
* **bounded** (``capacity=C``): every rank sends exactly ``C`` rows to every rank (padding included), so no
  count reaches the host: no sync, CUDA-graph capturable. For decode. Copies travel one row each, and the payload
  is any set of row-major parts, as in the exact mode. **Rule for the overflow**: a rank's copies to one
  destination beyond the first ``C`` (in token order, then top-k slot) are dropped: their expert's output is left
  out of the token's weighted sum (the other weights are not renormalized). The number of copies dropped in the
  last forward is :attr:`ExpertExchange.dropped` (a device tensor, read it when convenient); dropped copies never
  change any other token's result.

The local experts run exactly as on one GPU.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from ..ops import combine, dispatch
from ..routing.exchange import plan_exchange

__all__ = ["ExpertExchange"]


def _padded(rows: int, limit: int | None = None) -> int:
    """``rows`` rounded up to a size class: a multiple of 1/16 of its power of two, at least 256 (at most 1/16
    more rows), capped at ``limit``."""
    step = max(256, 1 << max(rows.bit_length() - 5, 0))
    padded = -(-rows // step) * step
    return padded if limit is None else min(padded, limit)


class _Sends:
    """The byte rows this rank sends in the exact mode (:func:`llmkernels.routing.exchange.plan_exchange` plans them).

    A token travels once to each other rank that holds one or more of its experts, as one byte row: each payload
    part's row, then its local expert ids on that rank (int32 ``[k]``, -1 for its other slots) and its routing
    weights (float32 ``[k]``), every field 16-byte aligned so that each is a view of the rows (one all-to-all
    moves them all). ``bound`` rows at most: one per token and other rank, or k.
    """

    def __init__(self, parts, num_tokens, top_k, world):
        self.bound = num_tokens * min(top_k, world - 1)
        fields = [(part.dtype, tuple(part.shape[1:])) for part in parts]
        fields += [(torch.int32, (top_k,)), (torch.float32, (top_k,))]
        self.fields, self.width = [], 0  # (byte offset, dtype, shape of a row) of each field; bytes of a row
        for dtype, shape in fields:
            self.fields.append((self.width, dtype, shape))
            self.width += -(-math.prod(shape) * dtype.itemsize // 16) * 16

    def _field(self, rows: torch.Tensor, field) -> torch.Tensor:
        offset, dtype, shape = field
        return rows[:, offset : offset + math.prod(shape) * dtype.itemsize].view(dtype).view(len(rows), *shape)

    def empty(self, device) -> torch.Tensor:
        """uint8 ``[bound, width]`` rows to fill."""
        return torch.empty((self.bound, self.width), dtype=torch.uint8, device=device)

    def gather(self, parts, token: torch.Tensor, sent: torch.Tensor) -> None:
        """Writes each payload part's rows ``token`` into its field of ``sent``."""
        for part, field in zip(parts, self.fields):
            torch.index_select(part, 0, token, out=self._field(sent, field))

    def fields_of(self, rows: torch.Tensor):
        """``(parts, ids, weights)`` of byte rows, as views."""
        parts = [self._field(rows, field) for field in self.fields[:-2]]
        return parts, self._field(rows, self.fields[-2]), self._field(rows, self.fields[-1])


class ExpertExchange:
    """The token exchange of one expert-parallel MoE block over ``group`` (``W`` ranks, ``E / W`` experts each:
    rank ``r`` owns experts ``r·E/W … (r+1)·E/W − 1``).

    :meth:`exact` runs the exact mode's forward around this rank's experts (what the block calls without a
    capacity). In the bounded mode :meth:`send` takes this rank's tokens and their routing, and returns the rows this
    rank's experts must run; :meth:`receive` takes those rows' outputs and returns this rank's tokens' outputs.
    """

    def __init__(self, group, num_experts: int, capacity: int | None, device=None, pad_rows: bool = True):
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.num_experts = num_experts
        self.experts_per_rank = num_experts // self.world
        self.capacity = capacity
        self.dropped = None  # copies dropped in the last bounded forward (int64 device scalar)
        self._stream = None  # the exact mode's side stream (CUDA)
        # Pad each call of the experts' rows to a size class (plans stay cached): only where a row's output
        # depends on that row alone. nvfp4 activations take one global scale over the rows quantized together,
        # and the first projection leaves the padding rows of its output unwritten (garbage in that scale).
        self.pad_rows = pad_rows
        self.local_experts = torch.arange(self.experts_per_rank, dtype=torch.int32, device=device)

    def exact(
        self,
        parts: Sequence[torch.Tensor],
        expert_ids: torch.Tensor,
        weights: torch.Tensor,
        gather: Callable,
        project: Callable,
        hidden: int,
        out_dtype: torch.dtype,
    ) -> torch.Tensor:
        """The exact mode's forward around this rank's experts.

        Args:
            parts: the payload of this rank's ``T`` tokens, row-major ``[T, ...]`` tensors of any dtype that the
                backend moves (bf16 rows, or quantized data and scales as uint8 / float32); row t of each part
                travels to every rank that holds one of token t's experts.
            expert_ids: int ``[T, k]`` global expert ids; weights: float32 ``[T, k]`` routing weights.
            gather: ``gather(rows, token_of_row, count)``: the experts' input (the grouped matmul's A, ``[R, ...]``)
                from the rows ``token_of_row`` (int64 ``[R]``) of the payload ``rows`` (parts' ``[N, ...]`` views);
                the rows from ``count`` (a one-element device tensor) on are padding (valid token indices) and may
                be left unwritten.
            project: ``project(a, a_offsets, group_expert_ids, out)``: the experts on ``gather``'s ``a``, grouped by
                ``a_offsets`` (int32 ``[G + 1]``, ``a_offsets[G]`` = the count) with the local experts
                ``group_expert_ids`` (int32 ``[G]``); writes the bf16 ``[R, hidden]`` outputs into ``out`` (a view;
                padding rows may be left unwritten) and returns it.
            hidden: H; out_dtype: the result's dtype.

        Returns:
            ``[T, hidden]`` of ``out_dtype``: each token's weighted sum of its experts' outputs (the rounding is
            in the module's docstring).
        """
        num_tokens, top_k = expert_ids.shape
        world, rank, per_rank, device = self.world, self.rank, self.experts_per_rank, expert_ids.device
        if self.local_experts.device != device:  # the block was moved (``.to()``): the table follows once
            self.local_experts = self.local_experts.to(device)
        weights = weights.float().contiguous()
        all_copies = num_tokens * top_k
        # `out`: this rank's own copies (T·k rows at most), then each rank's returned sum
        if world > 1:
            sends = _Sends(parts, num_tokens, top_k, world)
            sent = sends.empty(device)
            _, sent_ids, sent_weights = sends.fields_of(sent)
            own_ids, token, returned_rows, weights_table, send_counts = plan_exchange(
                expert_ids, weights, sent_ids, sent_weights, rank, world, per_rank, all_copies
            )
        else:
            own_ids, weights_table = expert_ids, weights
        # the copies this rank keeps, sorted by local expert: the first `early` experts' run while the dispatch is
        # in flight and the host launches the received rows' work, the others' while the return is. Own copies
        # are 1/W of a rank's work: at W = 2 three quarters of them still cover the return, beyond that half.
        early = per_rank if world == 1 else per_rank * 3 // 4 if world == 2 else per_rank // 2
        own_token_of_row, own_offsets, own_row_of_copy = dispatch(own_ids, per_rank)
        own_token_of_row.clamp_(0, max(num_tokens - 1, 0))  # the rows past the copies, read by padded calls
        if world > 1:
            rows_table = torch.cat([own_row_of_copy, returned_rows], 1)
            counts_in = torch.empty_like(send_counts)  # rows and copies from each rank
            dist.all_to_all_single(counts_in, send_counts, group=self.group)
            counts = torch.cat([own_offsets[early : early + 1].long(), send_counts[:, 0], counts_in.t().reshape(-1)])
        else:
            rows_table = own_row_of_copy
            counts = None if self.pad_rows else own_offsets[early : early + 1].long()  # read when not padded
        if device.type == "cuda" and (world > 1 or not self.pad_rows):  # the gather runs while the host waits
            host = torch.empty(counts.shape, dtype=counts.dtype, pin_memory=True)
            host.copy_(counts, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record()
        if world > 1:
            sends.gather(parts, token, sent)
            if device.type == "cuda":
                gathered = torch.cuda.Event()
                gathered.record()
        out = torch.empty((all_copies + (sends.bound if world > 1 else 0), hidden), dtype=torch.bfloat16, device=device)
        own_rows = out[:all_copies]

        def run_own_early(rows: int):
            a = gather(parts, own_token_of_row[:rows], own_offsets[early : early + 1])
            project(a, own_offsets[: early + 1], self.local_experts[:early], own_rows[:rows])

        if self.pad_rows:
            # Launched before the sync, sized by every copy (rows past the first `early` experts' copies are never
            # computed): the GPU runs them while the host waits for the counts.
            run_own_early(all_copies)
            if world == 1:  # every expert ran: no count needed on the host
                return combine(out, rows_table, weights_table, out_dtype)
        if device.type == "cuda":
            ready.synchronize()  # the exact mode's one sync
            counts = host.tolist()
        else:
            counts = counts.tolist()
        own_early = counts[0]
        if not self.pad_rows and own_early:  # one global scale over the call's rows: exactly its copies
            run_own_early(own_early)
        if world == 1:
            return combine(out, rows_table, weights_table, out_dtype)
        send_sizes, recv_sizes, copies_from = (
            counts[1 : 1 + world],
            counts[1 + world : 1 + 2 * world],
            counts[1 + 2 * world :],
        )
        own_total = copies_from[rank]
        recv_sizes[rank] = 0
        num_received = sum(recv_sizes)
        received_copies = sum(copies_from) - own_total
        # Each call of the experts takes its rows padded to a size class (rows outside its groups are never
        # computed), so that its plans, keyed by the row count, are found cached: planned again, one
        # grouped matmul costs ~0.7 ms of host time (H200), which the GPU waits for.
        padded = _padded if self.pad_rows else (lambda rows, limit=None: rows)
        # The dispatch, and the received rows' sort and gather, run on a side stream beside the own experts: it
        # waits for the sender's gather only. Every buffer it writes is allocated on it, so that no block freed by
        # the own experts' calls (whose kernels may still run) is handed to it; the blocks it frees are taken
        # again on it only, after the next forward's gather.
        side = self._side_stream(device) if device.type == "cuda" else None
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            if side is not None:
                side.wait_event(gathered)
            received = sent.new_empty((_padded(num_received), sent.shape[1]))
            received_parts, ids, received_weights = sends.fields_of(received)
            ids[num_received:] = -1  # padding rows: no copy
            dispatched = dist.all_to_all_single(
                received[:num_received],
                sent[: sum(send_sizes)],
                recv_sizes,
                send_sizes,
                group=self.group,
                async_op=True,
            )
            dispatched.wait()
            token_of_row, offsets, row_of_copy = dispatch(ids, per_rank)
            token_of_row.clamp_(0, max(num_received - 1, 0))
            received_rows = padded(received_copies, len(token_of_row))
            if received_copies:
                rows = [part[:num_received] for part in received_parts]  # (nvfp4's global scale spans them all)
                a = gather(rows, token_of_row[:received_rows], offsets[-1:])
        if side is not None:
            torch.cuda.current_stream(device).wait_stream(side)
        y = out.new_empty((received_rows, hidden))
        if received_copies:
            y = project(a, offsets, self.local_experts, y)
        partial = combine(y, row_of_copy, received_weights, torch.bfloat16)
        returned = dist.all_to_all_single(
            out[all_copies : all_copies + sum(send_sizes)],
            partial[:num_received],
            send_sizes,
            recv_sizes,
            group=self.group,
            async_op=True,
        )
        if own_total > own_early:  # while the return is in flight
            late_rows = padded(own_total - own_early, all_copies - own_early)
            late_offsets = own_offsets[early:] - own_offsets[early]
            a = gather(parts, own_token_of_row[own_early : own_early + late_rows], late_offsets[-1:])
            project(a, late_offsets, self.local_experts[early:], own_rows[own_early : own_early + late_rows])
        returned.wait()
        return combine(out, rows_table, weights_table, out_dtype)

    def _side_stream(self, device) -> torch.cuda.Stream:
        """The stream the dispatch is posted from (made once per device)."""
        if self._stream is None or self._stream.device != device:
            self._stream = torch.cuda.Stream(device)
        return self._stream

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
