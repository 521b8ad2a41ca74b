"""Session 19: short causal prefill at D 64 on the Gluon kernel: 64-key tiles (llmkernels_n64) against the product's
128-key tiles, with 2 and 3 consumer warpgroups; SDPA cuDNN in the same run. Graph replay, median of 3 interleaved."""
import os, sys, importlib, statistics
import torch
here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(here, "old"))
from benchmarks.common import graph_time_ms
from benchmarks.peers import sdpa_runner
OUT = os.environ.get("OUT", "/tmp")
prod = importlib.import_module("llmkernels.attention.gluon_hopper").gluon_attention
n64 = importlib.import_module("llmkernels_n64.attention.gluon_hopper").gluon_attention
lines = []
for b, s, h, causal in [(8, 2048, 16, True), (4, 4096, 16, True), (2, 8192, 16, True), (8, 2048, 16, False),
                        (4, 4096, 16, False)]:
    d = 64
    torch.manual_seed(0)
    q, k, v = (torch.randn(b, s, h, d, dtype=torch.bfloat16, device="cuda") for _ in range(3))
    ref = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2).float(), k.transpose(1, 2).float(),
                                                           v.transpose(1, 2).float(), is_causal=causal).transpose(1, 2)
    fns = {"cudnn": sdpa_runner("cudnn", q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=causal)}
    for c in (2, 3):
        fns[f"prod c{c}"] = lambda c=c: prod(q, k, v, causal, consumers=c)
        fns[f"n64 c{c}"] = lambda c=c: n64(q, k, v, causal, consumers=c)
    errs = {}
    for n, fn in fns.items():
        o = fn().float()
        if n == "cudnn":
            o = o.transpose(1, 2)
        errs[n] = ((o - ref).norm() / ref.norm()).item()
    times = {n: [] for n in fns}
    for _ in range(3):
        for n, fn in fns.items():
            times[n].append(graph_time_ms(fn) * 1e3)
    med = {n: statistics.median(t) for n, t in times.items()}
    flops = 4 * b * h * s * s * d / (2 if causal else 1)
    line = f"{b}x{h}x{s}x{d} {'causal' if causal else 'full'}: " + ", ".join(
        f"{n} {t:.1f} us {flops / t / 1e6:.0f} TF/s ({med['cudnn'] / t:.3f}x cudnn, err {errs[n]:.1e})" for n, t in med.items())
    print(line, flush=True)
    lines.append(line)
    open(os.path.join(OUT, "ab_n64.txt"), "w").write("\n".join(lines) + "\n")
