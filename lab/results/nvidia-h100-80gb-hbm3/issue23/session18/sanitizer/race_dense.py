import os, sys, importlib
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "old"))
import torch
pkg = sys.argv[1]
gluon_attention = importlib.import_module(pkg + ".attention.gluon_hopper").gluon_attention
torch.manual_seed(0)
q = torch.randn(1, 300, 2, 128, device="cuda", dtype=torch.bfloat16)
k = torch.randn(1, 1000, 2, 128, device="cuda", dtype=torch.bfloat16); v = torch.randn_like(k)
out = gluon_attention(q, k, v, causal=True)
torch.cuda.synchronize()
print(pkg, "ok", out.float().abs().mean().item())
