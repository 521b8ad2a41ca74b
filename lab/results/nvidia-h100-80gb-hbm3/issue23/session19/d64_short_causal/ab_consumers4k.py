"""Session 19: two or three consumer warpgroups for causal D 64 at 4096-8192 queries (the rule's threshold),
16/16 and 32/8 heads; 5 interleaved graph replays, median; SDPA cuDNN in the same run."""
import os, statistics
import torch
from benchmarks.common import graph_time_ms
from benchmarks.peers import sdpa_runner
from llmkernels.attention.gluon_hopper import gluon_attention
OUT = os.environ.get("OUT", "/tmp")
lines = []
for b, s, hq, hkv in [(4, 4096, 16, 16), (4, 4096, 32, 8), (2, 8192, 16, 16), (2, 8192, 32, 8), (8, 2048, 32, 8)]:
    torch.manual_seed(0)
    q = torch.randn(b, s, hq, 64, dtype=torch.bfloat16, device="cuda")
    k, v = (torch.randn(b, s, hkv, 64, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    fns = {"cudnn": sdpa_runner("cudnn", q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True),
           "c2": lambda: gluon_attention(q, k, v, True, consumers=2),
           "c3": lambda: gluon_attention(q, k, v, True, consumers=3)}
    a, c = fns["c2"]().float(), fns["c3"]().float()
    assert ((a - c).norm() / a.norm()).item() < 1e-2
    times = {n: [] for n in fns}
    for _ in range(5):
        for n, fn in fns.items():
            times[n].append(graph_time_ms(fn) * 1e3)
    med = {n: statistics.median(t) for n, t in times.items()}
    flops = 4 * b * hq * s * s * 64 / 2
    line = f"{b}x{hq}/{hkv}x{s}x64 causal: " + ", ".join(
        f"{n} {t:.1f} us {flops / t / 1e6:.0f} TF/s ({med['cudnn'] / t:.3f}x cudnn)" for n, t in med.items()) + \
        "; spread c2 " + "/".join(f"{t:.0f}" for t in times["c2"]) + " c3 " + "/".join(f"{t:.0f}" for t in times["c3"])
    print(line, flush=True)
    lines.append(line)
    open(os.path.join(OUT, "ab_consumers.txt"), "w").write("\n".join(lines) + "\n")
