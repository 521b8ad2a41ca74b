"""Session 19: where the Gluon split pass beats the portable one: B = 1-8 (8-64 sequences x KV heads), pages 16
and 64, dense; the pass's limit raised for this run. Graph replay, median of 3 interleaved, cuDNN in the run."""
import os, statistics
import torch
from torch.profiler import profile, ProfilerActivity
from benchmarks.common import graph_time_ms
from benchmarks.peers import sdpa_runner
from llmkernels.attention import gluon_decode
from llmkernels.attention.api import attention
from llmkernels.attention.config import default_config
from llmkernels.attention.paged import PagedKVCache
gluon_decode.MAX_HEAD_PROGRAMS = 1024
OUT = os.environ.get("OUT", "/tmp")
H, HKV, D = 32, 8, 128
portable = default_config(D, torch.bfloat16, torch.device("cuda"), decode=True).replace(warp_specialized=False)
lines = []
for batch, ctx, page in [(1, 1024, 16), (1, 8192, 16), (1, 32768, 16), (1, 131072, 16), (2, 1024, 16), (2, 8192, 16),
                         (2, 32768, 16), (4, 8192, 16), (4, 32768, 16), (8, 8192, 16), (1, 8192, 64), (2, 8192, 64),
                         (4, 8192, 64), (1, 8192, 0), (2, 8192, 0)]:
    torch.manual_seed(0)
    q = torch.randn(batch, 1, H, D, dtype=torch.bfloat16, device="cuda")
    if page:
        n = batch * ctx // page
        kp = torch.randn(n, page, HKV, D, dtype=torch.bfloat16, device="cuda")
        vp = torch.randn_like(kp)
        bt = torch.randperm(n, device="cuda").to(torch.int32).view(batch, ctx // page)
        cache = PagedKVCache(kp, vp, bt, torch.full((batch,), ctx, dtype=torch.int32, device="cuda"))
        kd = kp[bt.long()].reshape(batch, ctx, HKV, D)
        vd = vp[bt.long()].reshape(batch, ctx, HKV, D)
        args = (q, None, None)
        kw = dict(kv_cache=cache)
    else:
        kd = torch.randn(batch, ctx, HKV, D, dtype=torch.bfloat16, device="cuda")
        vd = torch.randn_like(kd)
        args, kw = (q, kd, vd), {}
    fns = {"cudnn": sdpa_runner("cudnn", q.transpose(1, 2), kd.transpose(1, 2).contiguous(), vd.transpose(1, 2).contiguous()),
           "gluon": lambda: attention(*args, **kw), "portable": lambda: attention(*args, config=portable, **kw)}
    ref = fns["cudnn"]().transpose(1, 2).float()
    errs = {n_: ((fn().float() - ref).norm() / ref.norm()).item() for n_, fn in fns.items() if n_ != "cudnn"}
    times = {k: [] for k in fns}
    for _ in range(3):
        for name, fn in fns.items():
            times[name].append(graph_time_ms(fn) * 1e3)
    med = {k: statistics.median(v) for k, v in times.items()}
    line = (f"B={batch} ctx={ctx} page={page or 'dense'}: " + ", ".join(f"{k} {t:.1f} ({med['cudnn'] / t:.3f})" for k, t in med.items())
            + f"; gluon/portable {med['portable'] / med['gluon']:.3f}; errs {errs}")
    print(line, flush=True)
    lines.append(line)
    open(os.path.join(OUT, "ab_decode_limit.txt"), "w").write("\n".join(lines) + "\n")
    del fns
    torch.cuda.empty_cache()
