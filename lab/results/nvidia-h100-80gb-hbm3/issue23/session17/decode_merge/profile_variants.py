"""Isolates the one-launch decode's extra time: kernel device times (torch.profiler, eager) of variants."""
import os, sys
import torch
here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(here, "old")); sys.path.insert(0, os.path.join(here, "var"))
from torch.profiler import profile, ProfilerActivity
import importlib
mods = {}
for name in ["llmkernels_old", "llmkernels", "llmkernels_nomerge", "llmkernels_noatomic", "llmkernels_nocg"]:
    api = importlib.import_module(name + ".attention.api")
    mods[name] = (api.attention, sys.modules[name + ".attention.paged"].PagedKVCache)
dev = torch.device("cuda")
H, HKV, D = 32, 8, 128
for batch, ctx in [(1, 8192), (1, 131072)]:
    torch.manual_seed(0)
    n = batch * ctx // 16
    kp = torch.randn(n, 16, HKV, D, dtype=torch.bfloat16, device=dev)
    vp = torch.randn_like(kp)
    bt = torch.randperm(n, device=dev).to(torch.int32).view(batch, ctx // 16)
    sl = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
    q = torch.randn(batch, 1, H, D, dtype=torch.bfloat16, device=dev)
    for rep in range(2):
        for name, (attn, Cache) in mods.items():
            cache = Cache(kp, vp, bt, sl)
            fn = lambda: attn(q, None, None, kv_cache=cache)
            fn(); torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(20):
                    fn()
                    torch.cuda.synchronize()
            per = {}
            for e in prof.events():
                if e.device_type.name == "CUDA":
                    per.setdefault(e.name[:30], []).append(e.device_time)
            print(batch, ctx, name, {k: round(sorted(v)[len(v) // 2], 2) for k, v in per.items()}, flush=True)
