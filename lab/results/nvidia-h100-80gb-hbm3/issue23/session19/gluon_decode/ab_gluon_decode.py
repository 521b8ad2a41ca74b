"""Session 19: the Gluon decode split pass prototype (.session/gluon_decode.py) against the product's decode
(portable split pass + combine) and SDPA cuDNN. Correctness first (ragged seqlens, NaN in unused page rows),
then graph replay (median of 3 interleaved) and the split passes' device times."""
import os, sys, statistics
import torch
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch.profiler import profile, ProfilerActivity
from benchmarks.common import graph_time_ms
from benchmarks.peers import sdpa_runner
from llmkernels.attention.api import attention
from llmkernels.attention.paged import PagedKVCache
from llmkernels.attention.reference import attention_reference
from gluon_decode import GluonDecode
OUT = os.environ.get("OUT", "/tmp")
H, HKV, D = 32, 8, 128
lines = []
def say(line):
    print(line, flush=True)
    lines.append(line)
    open(os.path.join(OUT, "ab_gluon_decode.txt"), "w").write("\n".join(lines) + "\n")

VARIANTS = {"g64s2": dict(tile_n=64, stages=2), "g64s3": dict(tile_n=64, stages=3), "g64s4": dict(tile_n=64, stages=4),
            "g128s2": dict(tile_n=128, stages=2), "g64s3f1": dict(tile_n=64, stages=3, fill=1),
            "g64s3f4": dict(tile_n=64, stages=3, fill=4)}

# correctness: ragged lengths, NaN everywhere no sequence reads, pages shuffled
for page in (16, 64):
    torch.manual_seed(1)
    seqlens = [1000, 77, 5000, 1]
    per = [-(-n // page) for n in seqlens]
    n_pages = sum(per) + 3
    kp = torch.full((n_pages, page, HKV, D), float("nan"), dtype=torch.bfloat16, device="cuda")
    vp = kp.clone()
    perm = torch.randperm(n_pages).tolist()
    table = torch.zeros(len(seqlens), max(per), dtype=torch.int32)
    c = 0
    for b, (n, p) in enumerate(zip(seqlens, per)):
        ids = perm[c:c + p]; c += p
        table[b, :p] = torch.tensor(ids, dtype=torch.int32)
        for i, pid in enumerate(ids):
            rows = min(page, n - i * page)
            kp[pid, :rows] = torch.randn(rows, HKV, D, dtype=torch.bfloat16, device="cuda")
            vp[pid, :rows] = torch.randn(rows, HKV, D, dtype=torch.bfloat16, device="cuda")
    cache = PagedKVCache(kp, vp, table.cuda(), torch.tensor(seqlens, dtype=torch.int32, device="cuda"))
    q = torch.randn(len(seqlens), 1, H, D, dtype=torch.bfloat16, device="cuda")
    ref = attention_reference(q, None, None, kv_cache=cache).float()
    for name, kw in VARIANTS.items():
        for splits in (None, 1, 3):
            out = GluonDecode(q, cache, num_splits=splits, **{k: v for k, v in kw.items()})().float()
            err = ((out - ref).norm() / ref.norm()).item()
            say(f"check page={page} {name} splits={splits}: rel err {err:.2e} {'OK' if err < 2e-2 else 'WRONG'}")

def kernel_times(fn):
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(20):
            fn(); torch.cuda.synchronize()
    per = {}
    for e in prof.events():
        if e.device_type.name == "CUDA":
            per.setdefault(e.name[:14], []).append(e.device_time)
    return {k: round(sorted(v)[len(v) // 2], 2) for k, v in per.items()}

for batch, ctx, page in [(1, 1024, 16), (1, 8192, 16), (1, 32768, 16), (1, 131072, 16), (8, 8192, 16), (8, 32768, 16),
                         (32, 8192, 16), (1, 8192, 64), (8, 32768, 64)]:
    torch.manual_seed(0)
    n = batch * ctx // page
    kp = torch.randn(n, page, HKV, D, dtype=torch.bfloat16, device="cuda")
    vp = torch.randn_like(kp)
    bt = torch.randperm(n, device="cuda").to(torch.int32).view(batch, ctx // page)
    cache = PagedKVCache(kp, vp, bt, torch.full((batch,), ctx, dtype=torch.int32, device="cuda"))
    q = torch.randn(batch, 1, H, D, dtype=torch.bfloat16, device="cuda")
    kd = kp[bt.long()].reshape(batch, ctx, HKV, D).transpose(1, 2).contiguous()
    vd = vp[bt.long()].reshape(batch, ctx, HKV, D).transpose(1, 2).contiguous()
    fns = {"cudnn": sdpa_runner("cudnn", q.transpose(1, 2), kd, vd), "product": lambda: attention(q, None, None, kv_cache=cache)}
    for name, kw in VARIANTS.items():
        fns[name] = GluonDecode(q, cache, **kw)
    ref = fns["cudnn"]().transpose(1, 2).float()
    bad = []
    for name, fn in list(fns.items()):
        if name != "cudnn" and ((fn().float() - ref).norm() / ref.norm()).item() > 2e-2:
            bad.append(name); del fns[name]
    times = {k: [] for k in fns}
    for _ in range(3):
        for name, fn in fns.items():
            times[name].append(graph_time_ms(fn) * 1e3)
    med = {k: statistics.median(v) for k, v in times.items()}
    best = min((t, k) for k, t in med.items() if k.startswith("g"))
    say(f"B={batch} ctx={ctx} page={page}: " + ", ".join(f"{k} {t:.1f} ({med['cudnn'] / t:.3f})" for k, t in med.items())
        + f"; wrong {bad}; kernels product {kernel_times(fns['product'])} {best[1]} {kernel_times(fns[best[1]])} "
        f"(splits {fns[best[1]].num_splits})")
    del kp, vp, kd, vd, fns
    torch.cuda.empty_cache()
