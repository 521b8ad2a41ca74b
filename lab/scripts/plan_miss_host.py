"""Host time of a grouped_matmul / dispatch / combine call whose plan is cached (the same row count every call) and
of one planned again (a new row count every call, as the expert-parallel exchange's received rows are): mean
microseconds of host time per call, no GPU sync inside the timed loop. One GPU.

    python lab/scripts/plan_miss_host.py [--out DIR]
"""

import argparse
import os
import time

import torch


def host_us(fn, sizes) -> float:
    torch.cuda.synchronize()
    started = time.perf_counter()
    for size in sizes:
        fn(size)
    elapsed = time.perf_counter() - started
    torch.cuda.synchronize()
    return elapsed / len(sizes) * 1e6


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    args = parser.parse_args()
    from llmkernels.moe import combine, dispatch
    from llmkernels.ops import grouped_matmul

    device = torch.device("cuda")
    experts, n, k = 32, 4096, 7168
    w = torch.randn(experts, n, k, device=device).to(torch.bfloat16)
    x = torch.randn(20000, k, device=device).to(torch.bfloat16)
    ids = torch.arange(experts, dtype=torch.int32, device=device)
    y = torch.randn(20000, 2048, device=device).to(torch.bfloat16)

    def offsets(rows):
        return torch.linspace(0, rows, experts + 1, device=device).to(torch.int32)

    cases = {
        "grouped_matmul": lambda rows: grouped_matmul(x[:rows], w, offsets(rows), ids),
        "dispatch": lambda rows: dispatch(torch.randint(0, experts, (rows, 8), device=device), experts),
        "combine": lambda rows: combine(
            y, torch.zeros(rows, 8, dtype=torch.int64, device=device), torch.ones(rows, 8, device=device)
        ),
        "offsets only (baseline)": lambda rows: offsets(rows),
    }
    lines = ["| call | cached plan, us | new plan each call, us |", "| --- | --- | --- |"]
    for name, fn in cases.items():
        for rows in range(8000, 8010):  # warm: compile every kernel, fill the caches
            fn(rows)
        same = host_us(fn, [8000] * 20)
        fresh = host_us(fn, list(range(9000, 9020)))
        lines.append(f"| {name} | {same:.0f} | {fresh:.0f} |")
    text = "\n".join(lines)
    print(text)
    with open(os.path.join(args.out, "plan_miss_host.md"), "w") as f:
        f.write(text + "\n")


if __name__ == "__main__":
    main()
