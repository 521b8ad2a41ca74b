"""Where the one-launch decode's extra time goes: per-kernel device times (torch.profiler, eager calls)
of the two-launch and one-launch paths, and graph replay with and without the captured counter fill."""
import os, sys
import torch
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "old"))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from llmkernels_old.attention.api import attention as attention_old  # noqa: E402
old_paged = sys.modules["llmkernels_old.attention.paged"]
from llmkernels.attention.api import attention  # noqa: E402
from llmkernels.attention import api as new_api  # noqa: E402
from llmkernels.attention.paged import PagedKVCache  # noqa: E402
from benchmarks.common import graph_time_ms  # noqa: E402
from torch.profiler import profile, ProfilerActivity

dev = torch.device("cuda")
H, HKV, D = 32, 8, 128
for batch, ctx in [(1, 1024), (1, 8192), (1, 131072), (8, 8192)]:
    torch.manual_seed(0)
    n = batch * ctx // 16
    kp = torch.randn(n, 16, HKV, D, dtype=torch.bfloat16, device=dev)
    vp = torch.randn_like(kp)
    bt = torch.randperm(n, device=dev).to(torch.int32).view(batch, ctx // 16)
    sl = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
    cache, cache_old = PagedKVCache(kp, vp, bt, sl), old_paged.PagedKVCache(kp, vp, bt, sl)
    q = torch.randn(batch, 1, H, D, dtype=torch.bfloat16, device=dev)
    fns = {"old": lambda: attention_old(q, None, None, kv_cache=cache_old),
           "new": lambda: attention(q, None, None, kv_cache=cache)}
    for name, fn in fns.items():
        fn(); torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(20):
                fn()
                torch.cuda.synchronize()
        per = {}
        for e in prof.events():
            if e.device_type.name == "CUDA":
                per.setdefault(e.name[:40], []).append(e.device_time)
        print(batch, ctx, name, {k: round(sum(v) / len(v), 2) for k, v in per.items()}, flush=True)
    # graph: fresh counter per capture (the product) vs a cached counter (no fill node)
    g_fresh = [graph_time_ms(fns["new"]) * 1e3 for _ in range(3)]
    g_old = [graph_time_ms(fns["old"]) * 1e3 for _ in range(3)]
    real = new_api._Plan._split_counter

    def cached(self):
        counter = self.split_counters.get("any")
        if counter is None:
            counter = self.split_counters["any"] = torch.zeros(self.grid[0], dtype=torch.int32, device=self.device)
        return counter
    new_api._Plan._split_counter = cached
    try:
        fns["new"]()
        torch.cuda.synchronize()
        g_cached = [graph_time_ms(fns["new"]) * 1e3 for _ in range(3)]
    finally:
        new_api._Plan._split_counter = real
    print(batch, ctx, "graph us old", [round(x, 2) for x in g_old], "new fresh", [round(x, 2) for x in g_fresh],
          "new cached", [round(x, 2) for x in g_cached], flush=True)
