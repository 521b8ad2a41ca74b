"""Session 19: eager (not replayed) decode time, the Gluon split pass bound through _launch.bind against the
portable pass, and PyTorch SDPA's, B = 1; event-timed (do_bench median) and host time per call."""
import os, time
import torch
from benchmarks.common import time_ms, graph_time_ms
from benchmarks.peers import sdpa_runner
from llmkernels.attention.api import attention
from llmkernels.attention.config import default_config
from llmkernels.attention.paged import PagedKVCache
OUT = os.environ.get("OUT", "/tmp")
H, HKV, D = 32, 8, 128
portable = default_config(D, torch.bfloat16, torch.device("cuda"), decode=True).replace(warp_specialized=False)
lines = []
for ctx in (1024, 8192):
    n = ctx // 16
    kp = torch.randn(n, 16, HKV, D, dtype=torch.bfloat16, device="cuda"); vp = torch.randn_like(kp)
    bt = torch.randperm(n, device="cuda").to(torch.int32).view(1, n)
    cache = PagedKVCache(kp, vp, bt, torch.full((1,), ctx, dtype=torch.int32, device="cuda"))
    q = torch.randn(1, 1, H, D, dtype=torch.bfloat16, device="cuda")
    kd = kp[bt.long()].reshape(1, ctx, HKV, D).transpose(1, 2).contiguous(); vd = vp[bt.long()].reshape(1, ctx, HKV, D).transpose(1, 2).contiguous()
    fns = {"gluon": lambda: attention(q, None, None, kv_cache=cache),
           "portable": lambda: attention(q, None, None, kv_cache=cache, config=portable),
           "cudnn": sdpa_runner("cudnn", q.transpose(1, 2), kd, vd)}
    for name, fn in fns.items():
        fn(); torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(200):
            fn()
        host = (time.perf_counter() - start) / 200 * 1e6
        torch.cuda.synchronize()
        line = f"ctx={ctx} {name}: eager {time_ms(fn) * 1e3:.1f} us, graph {graph_time_ms(fn) * 1e3:.1f} us, host {host:.1f} us/call"
        print(line, flush=True); lines.append(line)
open(os.path.join(OUT, "eager_decode.txt"), "w").write("\n".join(lines) + "\n")
