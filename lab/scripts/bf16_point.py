"""One bf16 point of bench_grouped_matmul in rounds: ours against torch._grouped_mm, timed the bench's way
(benchmarks.common.graph_time_ms), with only the bf16 weights allocated and then with every format of the bench's
Problem allocated beside them; prints the backends of the plan. For a point where the bench and the lab's timings
disagree (DeepSeek-V3 down at 256 tokens per expert on an H200: 4026 µs in the bench, 3219 in lab/gluon_bf16).

    PYTHONPATH=src:. python lab/scripts/bf16_point.py [E T N K] [ROUNDS]
"""

from __future__ import annotations

import statistics
import sys

import torch

from benchmarks.bench_grouped_matmul import OURS, Problem, _balanced_offsets
from benchmarks.common import graph_time_ms
from llmkernels.grouped_matmul.api import PLANS


def rounds_of(problem: Problem, per: int, rounds: int) -> str:
    offsets = _balanced_offsets(problem.num_experts, per)
    ours = problem.ours("bf16", "bf16", offsets)
    peer = problem.peer_bf16(offsets)
    PLANS.clear()
    ours(), peer()
    plans = [launch.backend.__name__.rsplit(".", 1)[-1] for plan in PLANS.plans() for launch in plan.launches]
    times = {"peer": [], "ours": []}
    for _ in range(rounds):
        times["peer"].append(graph_time_ms(peer) * 1e3)
        times["ours"].append(graph_time_ms(ours) * 1e3)
    ratio = statistics.median(p / o for p, o in zip(times["peer"], times["ours"]))
    return (
        f"peer {statistics.median(times['peer']):.0f} us, ours {statistics.median(times['ours']):.0f} us, "
        f"ratio {ratio:.3f} (rounds ours: {[round(t) for t in times['ours']]}), backends {plans}"
    )


def main() -> None:
    experts, per, n, k = (int(v) for v in sys.argv[1:5]) if len(sys.argv) > 4 else (256, 256, 7168, 2048)
    rounds = int(sys.argv[5]) if len(sys.argv) > 5 else 5
    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name()}: E{experts} x {per}, N {n}, K {k}", flush=True)
    problem = Problem(experts, n, k, experts * per, {"bf16"})
    print("bf16 weights only:", rounds_of(problem, per, rounds), flush=True)
    del problem
    torch.cuda.empty_cache()
    problem = Problem(experts, n, k, experts * per, {fb for _, fb in OURS.values()})
    print("every format allocated:", rounds_of(problem, per, rounds), flush=True)


if __name__ == "__main__":
    main()
