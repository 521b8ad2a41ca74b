"""B=1 decode split pass: does the paged gather cost? Cold (event-timed graph replay, L2 flushed) and hot (trace of
back-to-back replays) for paged page 16 / 64 / 256 and dense KV, against cuDNN."""
import json, os, statistics
import torch
from torch.profiler import profile, ProfilerActivity
from benchmarks.peers import sdpa_runner
from benchmarks.common import graph_time_ms
import llmkernels as lk
dev = torch.device("cuda")
H, HKV, D = 32, 8, 128
OUT = os.environ.get("OUT", "/tmp")
lines = []

def hot_kernels(fn):
    s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    for _ in range(20):
        g.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(30):
            g.replay()
        torch.cuda.synchronize()
    prof.export_chrome_trace("/tmp/t.json")
    ev = [e for e in json.load(open("/tmp/t.json"))["traceEvents"] if e.get("cat") == "kernel"]
    names = sorted({e["name"][:28] for e in ev})
    return {nm: round(statistics.median([e["dur"] for e in ev if e["name"][:28] == nm]), 2) for nm in names}

for batch, ctx in [(1, 8192), (1, 32768), (8, 8192)]:
    torch.manual_seed(0)
    k = torch.randn(batch, ctx, HKV, D, dtype=torch.bfloat16, device=dev); v = torch.randn_like(k)
    q = torch.randn(batch, 1, H, D, dtype=torch.bfloat16, device=dev)
    runners = {"dense": lambda: lk.attention(q, k, v)}
    for page in (16, 64, 256):
        n = batch * ctx // page
        perm = torch.randperm(n, device=dev)
        kp = torch.empty(n, page, HKV, D, dtype=k.dtype, device=dev); vp = torch.empty_like(kp)
        kp[perm] = k.reshape(n, page, HKV, D); vp[perm] = v.reshape(n, page, HKV, D)
        bt = perm.to(torch.int32).view(batch, ctx // page)
        cache = lk.PagedKVCache(kp, vp, bt, torch.full((batch,), ctx, dtype=torch.int32, device=dev))
        runners[f"paged{page}"] = (lambda cache=cache: lk.attention(q, None, None, kv_cache=cache))
    runners["cudnn"] = sdpa_runner("cudnn", q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    ref = runners["dense"]().float()
    for name, fn in runners.items():
        o = fn().float()
        o = o.transpose(1, 2) if name == "cudnn" else o
        assert ((o - ref).norm() / ref.norm()).item() < 2e-2, name
    cold = {name: [] for name in runners}
    for rep in range(3):
        for name, fn in runners.items():
            cold[name].append(graph_time_ms(fn) * 1e3)
    for name, fn in runners.items():
        line = f"B={batch} ctx={ctx} {name:9s} cold replay {statistics.median(cold[name]):7.1f} us  hot kernels {hot_kernels(fn)}"
        print(line, flush=True); lines.append(line)
    del k, v, kp, vp
    torch.cuda.empty_cache()
open(os.path.join(OUT, "decode_layouts.txt"), "w").write("\n".join(lines) + "\n")
