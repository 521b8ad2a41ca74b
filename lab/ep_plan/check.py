"""The prototype plan kernel against the product's ``ExpertExchange._plan_sends`` on random routing (CPU:
``TRITON_INTERPRET=1 PYTHONPATH=src:. python lab/ep_plan/check.py``; a GPU: without the variable). The rows sent
past the count hold no data, so only the first ``sum(rows sent)`` rows of token / ids / weights are compared."""

import os
import sys
import types

import torch

sys.path.insert(0, os.path.dirname(__file__))
from plan_kernel import exchange_plan  # noqa: E402

from llmkernels.moe.expert_parallel import ExpertExchange  # noqa: E402


def main():
    device = "cuda" if torch.cuda.is_available() and not os.environ.get("TRITON_INTERPRET") else "cpu"
    generator = torch.Generator().manual_seed(0)
    cases = 0
    shapes = [(2, 8, 2, 37), (4, 16, 4, 70), (4, 64, 8, 300), (2, 64, 8, 0), (8, 64, 8, 129)]  # W, E, k, T
    for world, experts, top_k, tokens in shapes:
        for rank in range(world):
            ids = torch.argsort(torch.rand(tokens, experts, generator=generator), dim=1)[:, :top_k].to(device)
            weights = torch.rand(tokens, top_k, generator=generator).to(device)
            per_rank = experts // world
            dest, local = ids // per_rank, ids % per_rank
            exchange = types.SimpleNamespace(world=world, rank=rank)
            want = ExpertExchange._plan_sends(exchange, [torch.zeros(tokens, 4, device=device)], dest, local, weights)
            token, got_ids, got_weights, rows, counts = exchange_plan(dest, local, weights, rank, world)
            sent = int(want.counts[:, 0].sum())
            assert torch.equal(counts, want.counts), (world, rank, counts, want.counts)
            assert torch.equal(rows, want.rows), (world, rank)
            assert torch.equal(token[:sent], want.token[:sent]), (world, rank)
            assert torch.equal(got_ids[:sent], want.ids[:sent]), (world, rank)
            assert torch.equal(got_weights[:sent], want.weights[:sent]), (world, rank)
            assert bool((token[sent:] == 0).all())
            cases += 1
    print(f"plan kernel == _plan_sends on {cases} (world, rank, routing) cases ({device})")


if __name__ == "__main__":
    main()
