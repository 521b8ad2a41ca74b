"""Dense prefill through lk.attention: session 17's package (c48b90f) against the working tree, graph replay,
interleaved repeats, bit-identical outputs checked."""
import os, sys, importlib, statistics
import torch
here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(here, "old"))
from benchmarks.common import graph_time_ms
old = importlib.import_module("llmkernels_c48.attention.api").attention
new = importlib.import_module("llmkernels.attention.api").attention
lines = []
for (b, s, hq, hkv, d, causal) in [(4, 4096, 16, 16, 128, False), (4, 4096, 16, 16, 128, True), (8, 2048, 16, 16, 64, True),
                                   (2, 8192, 32, 8, 256, True), (1, 16384, 16, 16, 128, False)]:
    torch.manual_seed(0)
    q = torch.randn(b, s, hq, d, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(b, s, hkv, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    fo, fn = (lambda: old(q, k, v, causal=causal)), (lambda: new(q, k, v, causal=causal))
    same = torch.equal(fo(), fn())
    t = {"old": [], "new": []}
    for _ in range(5):
        t["old"].append(graph_time_ms(fo)); t["new"].append(graph_time_ms(fn))
    o, n = statistics.median(t["old"]), statistics.median(t["new"])
    flops = 4 * b * hq * s * s * d * (0.5 if causal else 1)
    line = f"{b}x{hq}/{hkv}x{s}x{d} causal={causal}: s17 {flops / o / 1e9:.0f} TF, now {flops / n / 1e9:.0f} TF, now/s17 {o / n:.3f}, bits equal {same}"
    print(line, flush=True); lines.append(line)
open(os.path.join(os.environ.get("OUT", "/tmp"), "ab_dense.txt"), "w").write("\n".join(lines) + "\n")
