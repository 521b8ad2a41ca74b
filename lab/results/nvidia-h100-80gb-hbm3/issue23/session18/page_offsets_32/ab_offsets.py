"""A/B of the one-block combine: graph replay of HEAD~ (llmkernels_head) vs the working tree, and cuDNN; then
per-kernel device times (torch.profiler)."""
import os, sys, importlib, statistics
import torch
here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(here, "old"))
from benchmarks.common import graph_time_ms
from benchmarks.peers import sdpa_runner
from torch.profiler import profile, ProfilerActivity
mods = {}
for name in ["llmkernels_head", "llmkernels"]:
    api = importlib.import_module(name + ".attention.api")
    mods[name] = (api.attention, sys.modules[name + ".attention.paged"].PagedKVCache)
dev = torch.device("cuda")
H, HKV, D = 32, 8, 128
out = []
for batch, ctx in [(1, 1024), (1, 8192), (1, 32768), (1, 131072), (8, 8192), (8, 32768), (32, 8192), (128, 8192)]:
    torch.manual_seed(0)
    n = batch * ctx // 16
    kp = torch.randn(n, 16, HKV, D, dtype=torch.bfloat16, device=dev)
    vp = torch.randn_like(kp)
    bt = torch.randperm(n, device=dev).to(torch.int32).view(batch, ctx // 16)
    sl = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
    q = torch.randn(batch, 1, H, D, dtype=torch.bfloat16, device=dev)
    kd = kp[bt.long()].reshape(batch, ctx, HKV, D).transpose(1, 2).contiguous()
    vd = vp[bt.long()].reshape(batch, ctx, HKV, D).transpose(1, 2).contiguous()
    runners = {}
    for name, (attn, Cache) in mods.items():
        cache = Cache(kp, vp, bt, sl)
        runners[name] = (lambda attn=attn, cache=cache: attn(q, None, None, kv_cache=cache))
    runners["cudnn"] = sdpa_runner("cudnn", q.transpose(1, 2), kd, vd)
    ref = runners["cudnn"]().transpose(1, 2).float()
    times = {name: [] for name in runners}
    for name, fn in runners.items():
        o = fn().float()
        if name == "cudnn":
            o = o.transpose(1, 2)
        err = ((o - ref).norm() / ref.norm()).item()
        assert err < 2e-2, (name, err)
    for rep in range(3):
        for name, fn in runners.items():
            times[name].append(graph_time_ms(fn) * 1e3)
    med = {k: statistics.median(v) for k, v in times.items()}
    kernels = {}
    for name in mods:
        fn = runners[name]
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(20):
                fn(); torch.cuda.synchronize()
        per = {}
        for e in prof.events():
            if e.device_type.name == "CUDA":
                per.setdefault(e.name[:22], []).append(e.device_time)
        kernels[name] = {k: round(sorted(v)[len(v) // 2], 2) for k, v in per.items()}
    line = (f"B={batch} ctx={ctx}: head {med['llmkernels_head']:.1f} us, new {med['llmkernels']:.1f} us, cudnn {med['cudnn']:.1f} us;"
            f" vs_cudnn head {med['cudnn'] / med['llmkernels_head']:.3f} new {med['cudnn'] / med['llmkernels']:.3f};"
            f" kernels head {kernels['llmkernels_head']} new {kernels['llmkernels']}")
    print(line, flush=True)
    out.append(line)
    del kp, vp, kd, vd
    torch.cuda.empty_cache()
open(os.path.join(os.environ.get("OUT", "/tmp"), "ab_offsets.txt"), "w").write("\n".join(out) + "\n")
