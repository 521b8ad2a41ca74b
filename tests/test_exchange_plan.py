"""The expert-parallel exchange's device work (``llmkernels.routing.exchange``): the plan kernel against a
PyTorch statement of the plan, and the row gather bounded by a device count. Unwritten rows must stay as
poisoned, and nothing outside a buffer may change."""

import pytest
import torch

from llmkernels import runtime
from llmkernels.routing.exchange import gather_rows, plan_exchange
from llmkernels.testing import poison

GUARD = 3  # guard rows on each side of the byte rows sent


def expected_plan(expert_ids, weights, rank, world, per_rank, row_offset):
    """The plan, token by token (what ``plan_exchange`` documents)."""
    num_tokens, top_k = expert_ids.shape
    dest = (expert_ids // per_rank).tolist()
    local = (expert_ids % per_rank).tolist()
    own_ids = [[local[t][s] if dest[t][s] == rank else -1 for s in range(top_k)] for t in range(num_tokens)]
    token, ids, row_weights, counts = [], [], [], []
    rows = [[-1] * world for _ in range(num_tokens)]
    for d in range(world):
        sent = 0
        for t in range(num_tokens):
            if d != rank and d in dest[t]:
                rows[t][d] = len(token) + row_offset
                token.append(t)
                ids.append([local[t][s] if dest[t][s] == d else -1 for s in range(top_k)])
                row_weights.append(weights[t].tolist())
                sent += 1
        counts.append([sent, sum(row.count(d) for row in dest)])
    table = torch.cat([weights, torch.ones(num_tokens, world)], 1)
    ids = torch.tensor(ids, dtype=torch.int64).view(len(ids), top_k)
    return own_ids, token, ids, torch.tensor(row_weights).view(len(token), top_k), rows, table, counts


@pytest.mark.parametrize(
    "num_tokens, top_k, world, rank, per_rank",
    [(1, 1, 2, 0, 1), (5, 6, 3, 2, 4), (37, 8, 4, 1, 16), (1100, 8, 2, 1, 32), (300, 2, 4, 3, 2), (0, 4, 2, 0, 8)],
)
@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
def test_plan_exchange(num_tokens, top_k, world, rank, per_rank, id_dtype, device, monkeypatch):
    monkeypatch.setattr(
        runtime, "new_buffer", lambda shape, dtype, on: poison(torch.empty(shape, dtype=dtype, device=on))
    )
    num_experts = world * per_rank
    expert_ids = torch.argsort(torch.rand(num_tokens, num_experts, device=device), 1)[:, :top_k].to(
        id_dtype
    )  # int64: strided
    if num_tokens > 2:  # a token whose experts all sit on this rank, one with none there
        expert_ids[0] = (
            torch.arange(top_k, device=device) % per_rank + rank * per_rank if top_k <= per_rank else expert_ids[0]
        )
        expert_ids[1] = (expert_ids[1] + per_rank * ((expert_ids[1] // per_rank == rank).to(id_dtype))) % num_experts
    weights = torch.rand(num_tokens, top_k, device=device)
    bound = num_tokens * min(top_k, world - 1)
    width = 16 + 32 * top_k  # a payload field, then 16-byte aligned ids and weights fields
    ids_at, weights_at = 16, 16 + -(-4 * top_k // 16) * 16
    buffer = torch.randint(0, 256, (bound + 2 * GUARD, width), dtype=torch.uint8, device=device)
    before = buffer.clone()
    sent = buffer[GUARD : GUARD + bound]
    field = lambda at: sent[:, at : at + 4 * top_k]
    row_offset = 7
    own_ids, token, rows, table, counts = plan_exchange(
        expert_ids,
        weights,
        field(ids_at).view(torch.int32),
        field(weights_at).view(torch.float32),
        rank,
        world,
        per_rank,
        row_offset,
    )
    want_own, want_token, want_ids, want_weights, want_rows, want_table, want_counts = expected_plan(
        expert_ids.long().cpu(), weights.cpu(), rank, world, per_rank, row_offset
    )
    count = len(want_token)
    assert own_ids.dtype == torch.int32 and own_ids.tolist() == want_own
    assert token[:count].tolist() == want_token and token[count:].eq(0).all()
    assert rows.tolist() == want_rows and counts.tolist() == want_counts
    torch.testing.assert_close(table.cpu(), want_table, rtol=0, atol=0)
    assert torch.equal(field(ids_at)[:count].view(torch.int32).long().cpu(), want_ids)
    assert torch.equal(field(weights_at)[:count].view(torch.float32).cpu(), want_weights)
    # nothing else of the byte rows changed: the payload field, the padding bytes, the rows past the count, guards
    changed = buffer != before
    changed[GUARD : GUARD + count, ids_at : ids_at + 4 * top_k] = False
    changed[GUARD : GUARD + count, weights_at : weights_at + 4 * top_k] = False
    assert not changed.any()


@pytest.mark.parametrize(
    "dtype, shape, row_stride",
    [
        (torch.bfloat16, (23, 7), 7),
        (torch.uint8, (40, 224), 256),
        (torch.float32, (9, 3), 5),
        (torch.bfloat16, (1, 1), 1),
    ],
)
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_gather_rows(dtype, shape, row_stride, index_dtype, device, monkeypatch):
    """Rows below the count are the source's; the others and everything around the output stay untouched."""
    outputs = []

    def guarded(shape, dtype, on):
        storage = torch.empty(torch.Size(shape).numel() + 2 * 64, dtype=dtype, device=on)
        storage.view(torch.uint8).fill_(0xA5)
        outputs.append((storage, storage.clone()))
        return storage[64:-64].view(shape)

    monkeypatch.setattr(runtime, "new_buffer", guarded)
    rows = shape[0]
    base = torch.randint(0, 256, (rows, row_stride), device=device).to(dtype)
    src = base[:, : shape[1]]
    index = torch.randint(0, rows, (2 * rows + 1,), dtype=index_dtype, device=device)
    for count in (0, rows, len(index)):
        outputs.clear()
        out = gather_rows(src, index, torch.tensor([count], dtype=torch.int32, device=device))
        assert out.shape == (len(index), shape[1]) and out.dtype == dtype
        assert torch.equal(out[:count], src[index[:count].long()])
        storage, before = outputs[0]
        after = storage.view(torch.uint8) if dtype.itemsize == 1 else storage
        unwritten = torch.cat([after[:64], after[64 + count * shape[1] :]])
        reference = torch.cat([before[:64], before[64 + count * shape[1] :]])
        assert torch.equal(unwritten.view(torch.uint8), reference.view(torch.uint8))
