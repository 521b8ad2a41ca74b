"""Session 19, decode: (1) A/B of the page-aligned tile load: HEAD (per-row gather) vs pga (scalar page id, per-row
offsets) vs the working tree (scalar page id, offsets hoisted), pages 16 / 64 / 256; (2) the split count at short
contexts. Graph replay (median of 3 interleaved repeats) and per-kernel device times (torch.profiler)."""
import os, sys, importlib, statistics
import torch
here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(here, "old"))
from benchmarks.common import graph_time_ms
from benchmarks.peers import sdpa_runner
from torch.profiler import profile, ProfilerActivity
OUT = os.environ.get("OUT", "/tmp")
mods = {}
for name in ["llmkernels_head", "llmkernels_pga", "llmkernels"]:
    api = importlib.import_module(name + ".attention.api")
    mods[name] = (api.attention, sys.modules[name + ".attention.paged"].PagedKVCache)
dev = torch.device("cuda")
H, HKV, D = 32, 8, 128
lines = []

def say(line):
    print(line, flush=True)
    lines.append(line)
    open(os.path.join(OUT, "ab_pages.txt"), "w").write("\n".join(lines) + "\n")

def kernel_times(fn):
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(20):
            fn(); torch.cuda.synchronize()
    per = {}
    for e in prof.events():
        if e.device_type.name == "CUDA":
            per.setdefault(e.name[:18], []).append(e.device_time)
    return {k: round(sorted(v)[len(v) // 2], 2) for k, v in per.items()}

def problem(batch, ctx, page):
    torch.manual_seed(0)
    n = batch * ctx // page
    kp = torch.randn(n, page, HKV, D, dtype=torch.bfloat16, device=dev)
    vp = torch.randn_like(kp)
    bt = torch.randperm(n, device=dev).to(torch.int32).view(batch, ctx // page)
    sl = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
    q = torch.randn(batch, 1, H, D, dtype=torch.bfloat16, device=dev)
    kd = kp[bt.long()].reshape(batch, ctx, HKV, D).transpose(1, 2).contiguous()
    vd = vp[bt.long()].reshape(batch, ctx, HKV, D).transpose(1, 2).contiguous()
    return q, kp, vp, bt, sl, kd, vd

def check(runners):
    ref = runners["cudnn"]().transpose(1, 2).float()
    for name, fn in runners.items():
        o = fn().float()
        if name == "cudnn":
            o = o.transpose(1, 2)
        err = ((o - ref).norm() / ref.norm()).item()
        assert err < 2e-2, (name, err)

def timed(runners, reps=3):
    times = {name: [] for name in runners}
    for _ in range(reps):
        for name, fn in runners.items():
            times[name].append(graph_time_ms(fn) * 1e3)
    return {k: statistics.median(v) for k, v in times.items()}

say("## (1) page-aligned tile loads: graph replay us (vs cuDNN), kernel device times us")
for batch, ctx, page in [(1, 1024, 64), (1, 8192, 64), (1, 32768, 64), (1, 131072, 64), (8, 8192, 64), (32, 8192, 64),
                         (128, 8192, 64), (1, 8192, 256), (8, 32768, 256), (1, 8192, 16), (32, 8192, 16)]:
    q, kp, vp, bt, sl, kd, vd = problem(batch, ctx, page)
    runners = {}
    for name, (attn, Cache) in mods.items():
        cache = Cache(kp, vp, bt, sl)
        runners[name] = (lambda attn=attn, cache=cache: attn(q, None, None, kv_cache=cache))
    runners["cudnn"] = sdpa_runner("cudnn", q.transpose(1, 2), kd, vd)
    check(runners)
    med = timed(runners)
    ks = {name: kernel_times(runners[name]) for name in mods}
    say(f"B={batch} ctx={ctx} page={page}: " + ", ".join(f"{n.replace('llmkernels_', '').replace('llmkernels', 'new')} {t:.1f}"
        f" ({med['cudnn'] / t:.3f})" for n, t in med.items() if n != "cudnn") + f", cudnn {med['cudnn']:.1f}; kernels "
        + "; ".join(f"{n.replace('llmkernels_', '')} {k}" for n, k in ks.items()))
    del kp, vp, kd, vd
    torch.cuda.empty_cache()

say("## (2) split count at short contexts (working tree, page 16 and 64): graph replay us")
attn, Cache = mods["llmkernels"]
for batch, ctx in [(1, 1024), (1, 2048), (1, 4096), (4, 1024), (8, 1024), (8, 2048)]:
    for page in (16, 64):
        q, kp, vp, bt, sl, kd, vd = problem(batch, ctx, page)
        cache = Cache(kp, vp, bt, sl)
        runners = {"cudnn": sdpa_runner("cudnn", q.transpose(1, 2), kd, vd)}
        for splits in (None, 1, 2, 4, 8, 16, 32):
            if splits is not None and splits > ctx // 64:
                continue
            runners[f"s{splits or 'auto'}"] = (lambda s=splits, cache=cache: attn(q, None, None, kv_cache=cache, num_splits=s))
        check(runners)
        med = timed(runners)
        best = min((t, n) for n, t in med.items() if n != "cudnn")
        say(f"B={batch} ctx={ctx} page={page}: " + ", ".join(f"{n} {t:.1f}" for n, t in med.items())
            + f"; best {best[1]} {med['cudnn'] / best[0]:.3f}x cudnn, auto {med['cudnn'] / med['sauto']:.3f}x; kernels auto "
            + str(kernel_times(runners["sauto"])) + f" {best[1]} " + str(kernel_times(runners[best[1]])))
        del kp, vp, kd, vd
        torch.cuda.empty_cache()
