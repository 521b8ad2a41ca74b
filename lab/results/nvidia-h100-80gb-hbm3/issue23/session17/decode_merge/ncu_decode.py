import os, sys, torch
sys.path.insert(0, os.getcwd())
from llmkernels.attention.api import attention
from llmkernels.attention.paged import PagedKVCache
from torch.nn.attention import SDPBackend, sdpa_kernel
dev = torch.device("cuda")
H, HKV, D, B, CTX = 32, 8, 128, 1, 8192
torch.manual_seed(0)
n = B * CTX // 16
kp = torch.randn(n, 16, HKV, D, dtype=torch.bfloat16, device=dev); vp = torch.randn_like(kp)
bt = torch.randperm(n, device=dev).to(torch.int32).view(B, CTX // 16)
cache = PagedKVCache(kp, vp, bt, torch.full((B,), CTX, dtype=torch.int32, device=dev))
q = torch.randn(B, 1, H, D, dtype=torch.bfloat16, device=dev)
kd = kp[bt.long()].reshape(B, CTX, HKV, D).transpose(1, 2).contiguous(); vd = vp[bt.long()].reshape(B, CTX, HKV, D).transpose(1, 2).contiguous()
for _ in range(3):
    attention(q, None, None, kv_cache=cache)
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), kd, vd, enable_gqa=True)
torch.cuda.synchronize()
