"""Where the host time of one eager call goes: each call of ``bench_host_overhead`` under cProfile.

    python -m benchmarks profile_host_overhead [--calls N] [--top K] [--out DIR]

For each call: µs per call spent in the functions that take the most cumulative time (ours, Triton's
launcher and binder, torch), written to ``host_overhead_profile.txt`` under ``--out`` (default
``benchmarks/results/<gpu>/``). cProfile slows Python down, so the shares matter, not the totals.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats

import torch

from benchmarks.bench_host_overhead import _problems
from benchmarks.common import default_out_dir


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    report = io.StringIO()
    with torch.inference_mode():
        for name, ours, _, _ in _problems(torch.device("cuda")):
            for _ in range(20):
                ours()
            torch.cuda.synchronize()
            profiler = cProfile.Profile()
            profiler.enable()
            for _ in range(args.calls):
                ours()
            profiler.disable()
            torch.cuda.synchronize()
            stats = pstats.Stats(profiler)
            total_us = stats.total_tt / args.calls * 1e6
            report.write(f"\n## {name}: {total_us:.0f} us per call under cProfile\n")
            rows = sorted(stats.stats.items(), key=lambda item: -item[1][3])[:args.top]
            report.write(f"{'cumulative us/call':>18} {'own us/call':>12} {'calls/call':>10}  function\n")
            for (path, line, function), (_, calls, own, cumulative, _) in rows:
                where = f"{os.path.basename(os.path.dirname(path))}/{os.path.basename(path)}:{line}"
                report.write(f"{cumulative / args.calls * 1e6:18.1f} {own / args.calls * 1e6:12.1f} "
                             f"{calls / args.calls:10.1f}  {function} ({where})\n")
    out_dir = args.out or default_out_dir()
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "host_overhead_profile.txt"), "w") as file:
        file.write(f"# Host time per eager call under cProfile ({torch.cuda.get_device_name()})\n")
        file.write(report.getvalue())
    print(report.getvalue())


if __name__ == "__main__":
    main()
