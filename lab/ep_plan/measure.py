"""Host and GPU time of the exchange plan: the product's ``ExpertExchange._plan_sends`` (torch ops) against the
prototype kernel (``plan_kernel.py``), T = 4096 tokens, top-8 of 64 experts, W = 2 and 4, one GPU (no process
group: the plan is local). Host us: the mean time to enqueue one plan (no sync inside the loop); GPU us: CUDA
events over 50 plans. ``PYTHONPATH=src:. python lab/ep_plan/measure.py``"""

import os
import sys
import time
import types

import torch

sys.path.insert(0, os.path.dirname(__file__))
from plan_kernel import exchange_plan  # noqa: E402

from llmkernels.moe.expert_parallel import ExpertExchange  # noqa: E402


def timed(fn, reps=50):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    started = time.perf_counter()
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    host = (time.perf_counter() - started) / reps * 1e6
    torch.cuda.synchronize()
    return host, start.elapsed_time(end) / reps * 1e3


def main():
    device = torch.device("cuda")
    tokens, experts, top_k = 4096, 64, 8
    print("| W | plan | host us | GPU us |\n| --- | --- | --- | --- |")
    for world in (2, 4):
        ids = torch.argsort(torch.rand(tokens, experts, device=device), dim=1)[:, :top_k]
        weights = torch.rand(tokens, top_k, device=device)
        per_rank = experts // world
        dest, local = ids // per_rank, ids % per_rank
        exchange = types.SimpleNamespace(world=world, rank=0)
        parts = [torch.zeros(tokens, 7168, dtype=torch.bfloat16, device=device)]
        torch_plan = lambda: ExpertExchange._plan_sends(exchange, parts, dest, local, weights)  # noqa: E731
        kernel_plan = lambda: exchange_plan(dest, local, weights, 0, world)  # noqa: E731
        for name, fn in (("torch ops (product)", torch_plan), ("one kernel (prototype)", kernel_plan)):
            host, gpu = timed(fn)
            print(f"| {world} | {name} | {host:.0f} | {gpu:.0f} |")


if __name__ == "__main__":
    main()
