"""Session 16 (run as .session/ablate_persistent.py): the persistent Gluon attention (commit after a0d2f12) against the per-block grid of a0d2f12 (old_grid, loaded from that commit's gluon_hopper.py) and cuDNN,
graph replay, the prefill grid. Bits of new vs old compared."""
import csv, importlib.util, os, sys, time
import torch
sys.path.insert(0, os.getcwd())
import llmkernels.attention as _pkg
from benchmarks.common import graph_time_ms
from benchmarks.peers import sdpa_runner
from llmkernels.attention import gluon_hopper as new

spec = importlib.util.spec_from_file_location("llmkernels.attention.gluon_hopper_old", ".session/gluon_hopper_old.py")
old = importlib.util.module_from_spec(spec); spec.loader.exec_module(old)

def run(module, q, k, v, causal, window=None, lse=False):
    return module.gluon_attention(q, k, v, causal=causal, window=window, return_lse=lse)

out = os.environ.get("OUT", "/tmp/out")
rows = []
shapes = []
for dim, heads, kvh in ((64, 16, 16), (128, 16, 16), (256, 8, 8), (128, 32, 8)):
    for seqlen in (2048, 4096, 8192, 16384):
        shapes.append((16384 // seqlen, seqlen, heads, kvh, dim))
shapes.append((1, 8192, 32, 8, 128, (1024, 0)))  # sliding window
for shape in shapes:
    batch, seqlen, heads, kvh, dim = shape[:5]
    window = shape[5] if len(shape) > 5 else None
    for causal in ((False, True) if window is None else (True,)):
        q = torch.randn(batch, seqlen, heads, dim, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(batch, seqlen, kvh, dim, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        a, la = run(new, q, k, v, causal, window, True)
        b, lb = run(old, q, k, v, causal, window, True)
        same = bool(torch.equal(a, b) and torch.equal(la, lb))
        systems = {"old_grid": lambda: run(old, q, k, v, causal, window), "persistent": lambda: run(new, q, k, v, causal, window)}
        if window is None:
            cud = sdpa_runner("cudnn", *(t.transpose(1, 2) for t in (q, k, v)), causal=causal)
            systems["sdpa_cudnn"] = cud
            ref = cud().transpose(1, 2).float()
            err = ((a.float() - ref).norm() / ref.norm()).item()
        else:
            err = float("nan")
        if window is None:
            flops = 4 * batch * heads * seqlen * seqlen * dim * (0.5 if causal else 1.0)
        else:
            flops = 4 * batch * heads * seqlen * min(seqlen, window[0] + 1) * dim
        t = {name: graph_time_ms(fn) for name, fn in systems.items()}
        row = dict(batch=batch, seqlen=seqlen, heads=heads, kv_heads=kvh, head_dim=dim, causal=causal, window=window,
                   bits_equal_old=same, rel_err_vs_cudnn=err,
                   **{f"{n}_tflops": round(flops / ms / 1e9, 1) for n, ms in t.items()},
                   persistent_vs_old=round(t["old_grid"] / t["persistent"], 3))
        if "sdpa_cudnn" in t:
            row["persistent_vs_cudnn"] = round(t["sdpa_cudnn"] / t["persistent"], 3)
            row["old_vs_cudnn"] = round(t["sdpa_cudnn"] / t["old_grid"], 3)
        rows.append(row)
        print(row, flush=True)
keys = list(dict.fromkeys(k for r in rows for k in r))
with open(f"{out}/persistent_ablation.csv", "w", newline="") as f:
    w = csv.DictWriter(f, keys); w.writeheader(); w.writerows(rows)
