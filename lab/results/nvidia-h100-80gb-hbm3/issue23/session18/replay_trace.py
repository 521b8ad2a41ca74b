"""Where a decode graph replay's time goes: kernel durations and gaps from a chrome trace of back-to-back replays,
ours and cuDNN, B=1 at 1k / 8k."""
import json, os, statistics, time
import torch
from torch.profiler import profile, ProfilerActivity
from benchmarks.peers import sdpa_runner
from benchmarks.common import graph_time_ms
import llmkernels as lk
dev = torch.device("cuda")
H, HKV, D = 32, 8, 128
OUT = os.environ.get("OUT", "/tmp")
lines = []
for batch, ctx in [(1, 1024), (1, 8192), (1, 32768)]:
    torch.manual_seed(0)
    n = batch * ctx // 16
    kp = torch.randn(n, 16, HKV, D, dtype=torch.bfloat16, device=dev); vp = torch.randn_like(kp)
    bt = torch.randperm(n, device=dev).to(torch.int32).view(batch, ctx // 16)
    cache = lk.PagedKVCache(kp, vp, bt, torch.full((batch,), ctx, dtype=torch.int32, device=dev))
    q = torch.randn(batch, 1, H, D, dtype=torch.bfloat16, device=dev)
    kd = kp[bt.long()].reshape(batch, ctx, HKV, D).transpose(1, 2).contiguous()
    vd = vp[bt.long()].reshape(batch, ctx, HKV, D).transpose(1, 2).contiguous()
    runners = {"ours": lambda: lk.attention(q, None, None, kv_cache=cache), "cudnn": sdpa_runner("cudnn", q.transpose(1, 2), kd, vd)}
    for name, fn in runners.items():
        fn(); torch.cuda.synchronize()
        s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fn()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        for _ in range(50):
            g.replay()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(200):
            g.replay()
        host_us = (time.perf_counter() - t0) / 200 * 1e6
        torch.cuda.synchronize()
        gpu_us = graph_time_ms(fn) * 1e3
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(40):
                g.replay()
            torch.cuda.synchronize()
        path = f"/tmp/trace_{name}_{ctx}.json"
        prof.export_chrome_trace(path)
        ev = [e for e in json.load(open(path))["traceEvents"] if e.get("cat") == "kernel"]
        ev.sort(key=lambda e: e["ts"])
        names = sorted({e["name"][:40] for e in ev})
        per_replay = len(ev) // 40
        durs = {nm: statistics.median([e["dur"] for e in ev if e["name"][:40] == nm]) for nm in names}
        firsts = [ev[i]["ts"] for i in range(0, len(ev), per_replay)]
        period = statistics.median([b - a for a, b in zip(firsts[10:], firsts[11:])])
        gaps = [ev[i + 1]["ts"] - (ev[i]["ts"] + ev[i]["dur"]) for i in range(len(ev) - 1)]
        line = (f"B={batch} ctx={ctx} {name}: event-timed replay {gpu_us:.1f} us, host per replay() {host_us:.1f} us, "
                f"trace period {period:.1f} us, kernels/replay {per_replay}, durations {durs}, median gap {statistics.median(gaps):.1f} us, "
                f"gaps {[round(x, 1) for x in gaps[20:20 + 2 * per_replay]]}")
        print(line, flush=True); lines.append(line)
open(os.path.join(OUT, "replay_trace.txt"), "w").write("\n".join(lines) + "\n")
