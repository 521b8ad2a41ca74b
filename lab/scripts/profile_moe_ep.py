"""Where an expert-parallel forward's time goes: torch.profiler on every rank of one exact-mode forward (and of the
one-GPU block on rank 0), kernels summed by name, the GPU's idle time inside the forward, and a Chrome trace per
rank under $OUT.

    torchrun --nproc-per-node W lab/scripts/profile_moe_ep.py [--weight-format mxfp4] [--tokens 4096]
        [--one-gpu] [--high-priority]

Same shapes as benchmarks/bench_moe_ep.py (E 64, H 7168, I 2048, top-8).
"""

from __future__ import annotations

import argparse
import os
from collections import defaultdict

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile


def kernel_summary(prof, label: str, reps: int) -> str:
    """Kernels by name (ms per forward), the GPU-busy union and the span from first kernel start to last end."""
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    by_name = defaultdict(float)
    spans = []
    for e in events:
        by_name[e.name[:90]] += e.device_time_total / 1e3
        spans.append((e.time_range.start, e.time_range.end))
    spans.sort()
    busy, cur_s, cur_e = 0.0, None, None
    for s, t in spans:
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                busy += cur_e - cur_s
            cur_s, cur_e = s, t
        else:
            cur_e = max(cur_e, t)
    if cur_e is not None:
        busy += cur_e - cur_s
    span = (spans[-1][1] - spans[0][0]) if spans else 0
    # compute-only busy (NCCL kernels excluded): what the experts and the glue keep the SMs busy
    lines = [f"## {label}: span {span / 1e3 / reps:.3f} ms/forward, GPU busy (union) {busy / 1e3 / reps:.3f} ms"]
    for name, ms in sorted(by_name.items(), key=lambda kv: -kv[1])[:40]:
        lines.append(f"{ms / reps:9.3f} ms  {name}")
    # the last forward's kernels in order: start (ms from the forward's first kernel), duration, name
    last = sorted(events, key=lambda e: e.time_range.start)[-len(events) // reps :]
    origin = last[0].time_range.start if last else 0
    lines.append("### last forward's kernels: start ms, duration ms, name")
    for e in last:
        if e.device_time_total >= 20:
            start_ms = (e.time_range.start - origin) / 1e3
            lines.append(f"{start_ms:8.3f} {e.device_time_total / 1e3:8.3f}  {e.name[:60]}")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--weight-format", default="mxfp4")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--one-gpu", action="store_true", help="also profile the one-GPU block on rank 0")
    parser.add_argument("--high-priority", action="store_true", help="the exchange on NCCL's high-priority streams")
    args = parser.parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
    torch.cuda.set_device(device)
    from llmkernels.moe import MoEFeedForward

    E, H, I, K, T = 64, 7168, 2048, 8, args.tokens
    g = torch.Generator(device=device).manual_seed(0)
    router = torch.randn(E, H, device=device, generator=g) / H**0.5  # unit-scale logits, as bench_moe_ep
    w_gate_up = torch.randn(E, 2 * I, H, device=device, generator=g) / H**0.5
    w_down = torch.randn(E, H, I, device=device, generator=g) / I**0.5
    per = E // world
    mine = slice(rank * per, (rank + 1) * per)
    x_all = torch.randn(world * T, H, device=device, generator=g).to(torch.bfloat16)
    x = x_all[rank * T : (rank + 1) * T]
    out_dir = os.environ.get("OUT", "/tmp")
    reps = 3
    report = []
    if rank == 0 and args.one_gpu:
        whole = MoEFeedForward.from_float(router, w_gate_up, w_down, K, weight_format=args.weight_format)
        for _ in range(3):
            whole(x_all)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(reps):
                whole(x_all)
            torch.cuda.synchronize()
        report.append(kernel_summary(prof, f"one GPU, {world * T} tokens", reps))
        prof.export_chrome_trace(f"{out_dir}/one_gpu_{args.weight_format}.json")
        del whole
    dist.barrier()
    block = MoEFeedForward.from_float(
        router,
        w_gate_up[mine],
        w_down[mine],
        K,
        weight_format=args.weight_format,
        process_group=dist.new_group(
            backend="nccl", pg_options=dist.ProcessGroupNCCL.Options(is_high_priority_stream=True)
        )
        if args.high_priority
        else dist.group.WORLD,
    )
    for _ in range(3):
        block(x)
    torch.cuda.synchronize()
    dist.barrier()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        block(x)
    end.record()
    torch.cuda.synchronize()
    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            block(x)
        torch.cuda.synchronize()
    report.append(f"# rank {rank}: {start.elapsed_time(end) / 10:.3f} ms per forward (events, unprofiled)")
    report.append(kernel_summary(prof, f"rank {rank} of {world}, {T} tokens, high priority {args.high_priority}", reps))
    from llmkernels.grouped_matmul.api import PLANS

    for plan in PLANS.plans():  # what each grouped-matmul call planned (config, size class, grid)
        c = plan.call
        launches = "; ".join(
            f"{type(launch.backend).__name__} {launch.config} rows {launch.group_rows} grid {launch.spec.grid}"
            for launch in plan.launches
        )
        report.append(f"plan: rows {c.num_tokens} groups {c.num_groups} n {c.n_out} k {c.k}: {launches}")
    cpu = prof.key_averages().table(sort_by="cpu_time_total", row_limit=25)
    report.append("### host ops by CPU time\n" + cpu)
    text = "\n".join(report)
    with open(f"{out_dir}/profile_w{world}_{args.weight_format}_hp{int(args.high_priority)}_rank{rank}.txt", "w") as f:
        f.write(text)
    if rank == 0:
        print(text)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
