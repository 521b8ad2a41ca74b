"""Session 19: at page 16 the default 64-key tiles gather page ids per row; tiles of 16 or 32 keys inside one page
take the page-aligned load (one page id per tile). Graph replay, median of 3 interleaved, against cuDNN."""
import os, statistics
import torch
from benchmarks.common import graph_time_ms
from benchmarks.peers import sdpa_runner
from llmkernels.attention.api import attention
from llmkernels.attention.config import default_config
from llmkernels.attention.paged import PagedKVCache
OUT = os.environ.get("OUT", "/tmp")
H, HKV, D = 32, 8, 128
lines = []
for batch, ctx, page in [(1, 1024, 16), (1, 8192, 16), (1, 32768, 16), (8, 8192, 16), (32, 8192, 16), (1, 8192, 32)]:
    torch.manual_seed(0)
    n = batch * ctx // page
    kp = torch.randn(n, page, HKV, D, dtype=torch.bfloat16, device="cuda")
    vp = torch.randn_like(kp)
    bt = torch.randperm(n, device="cuda").to(torch.int32).view(batch, ctx // page)
    cache = PagedKVCache(kp, vp, bt, torch.full((batch,), ctx, dtype=torch.int32, device="cuda"))
    q = torch.randn(batch, 1, H, D, dtype=torch.bfloat16, device="cuda")
    kd = kp[bt.long()].reshape(batch, ctx, HKV, D).transpose(1, 2).contiguous()
    vd = vp[bt.long()].reshape(batch, ctx, HKV, D).transpose(1, 2).contiguous()
    base = default_config(D, torch.bfloat16, torch.device("cuda"), decode=True)
    fns = {"cudnn": sdpa_runner("cudnn", q.transpose(1, 2), kd, vd), "default": lambda: attention(q, None, None, kv_cache=cache)}
    for bn, stages, warps in [(16, 4, 2), (16, 6, 2), (32, 3, 2), (32, 4, 2), (32, 4, 4)]:
        if bn <= page:
            cfg = base.replace(BN=bn, num_kv_stages=stages, num_warps=warps)
            fns[f"BN{bn} s{stages} w{warps}"] = lambda cfg=cfg: attention(q, None, None, kv_cache=cache, config=cfg)
    ref = fns["cudnn"]().transpose(1, 2).float()
    for name, fn in fns.items():
        if name != "cudnn":
            assert ((fn().float() - ref).norm() / ref.norm()).item() < 2e-2, name
    times = {n_: [] for n_ in fns}
    for _ in range(3):
        for name, fn in fns.items():
            times[name].append(graph_time_ms(fn) * 1e3)
    med = {k: statistics.median(v) for k, v in times.items()}
    line = f"B={batch} ctx={ctx} page={page}: " + ", ".join(f"{k} {t:.1f} ({med['cudnn'] / t:.3f})" for k, t in med.items())
    print(line, flush=True)
    lines.append(line)
    open(os.path.join(OUT, "ab_bn_page16.txt"), "w").write("\n".join(lines) + "\n")
    del kp, vp, kd, vd
    torch.cuda.empty_cache()
