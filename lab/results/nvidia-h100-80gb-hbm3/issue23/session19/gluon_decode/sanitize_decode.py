"""compute-sanitizer target: the Gluon decode pass over a paged cache with NaN pages, a short last tile, an empty
sequence and clamped bad metadata, and over dense K/V; checked against the reference."""
import torch
import llmkernels as lk
from llmkernels.attention.paged import PagedKVCache
from llmkernels.attention.reference import attention_reference
from llmkernels.attention import gluon_decode
calls = []
launch = gluon_decode.launch
gluon_decode.launch = lambda *a, **k: (calls.append(1), launch(*a, **k))[1]
torch.manual_seed(0)
H, HKV, D, P = 16, 4, 128, 16
seqlens = [1000, 0, 37, 300]
pages = [-(-n // P) for n in seqlens]
n_pages = sum(pages) + 2
kp = torch.full((n_pages, P, HKV, D), float("nan"), dtype=torch.bfloat16, device="cuda")
vp = kp.clone()
table = torch.full((4, max(pages) + 1), 10**6, dtype=torch.int32)
c = 0
for b, (n, p) in enumerate(zip(seqlens, pages)):
    for i in range(p):
        rows = min(P, n - i * P)
        kp[c, :rows] = torch.randn(rows, HKV, D, dtype=torch.bfloat16, device="cuda")
        vp[c, :rows] = torch.randn(rows, HKV, D, dtype=torch.bfloat16, device="cuda")
        table[b, i] = c
        c += 1
cache = PagedKVCache(kp, vp, table.cuda(), torch.tensor(seqlens, dtype=torch.int32, device="cuda"))
q = torch.randn(4, 1, H, D, dtype=torch.bfloat16, device="cuda")
out, lse = lk.attention(q, None, None, kv_cache=cache, return_lse=True)
ref = attention_reference(q, None, None, kv_cache=cache).float()
print("paged rel err", ((out.float() - ref).norm() / ref.norm()).item(), "launches", len(calls))
bad = table.clone(); bad[0, 2] = -3; bad[3, 0] = 10**7
hostile = PagedKVCache(kp.nan_to_num(0.0), vp.nan_to_num(0.0), bad.cuda(), torch.tensor([10**6, -4, 37, 300], dtype=torch.int32, device="cuda"))
out2 = lk.attention(q, None, None, kv_cache=hostile)
print("hostile finite", bool(torch.isfinite(out2).all()), "launches", len(calls))
k = torch.randn(2, 777, 8, 64, dtype=torch.bfloat16, device="cuda"); v = torch.randn_like(k)
q2 = torch.randn(2, 1, 32, 64, dtype=torch.bfloat16, device="cuda")
out3 = lk.attention(q2, k, v)
ref3 = attention_reference(q2, k, v).float()
print("dense rel err", ((out3.float() - ref3).norm() / ref3.norm()).item(), "launches", len(calls))
torch.cuda.synchronize()
