"""Issue 23, session 17: one-launch split-KV decode (the last split merges) against the two-launch
path (split pass + combine kernel, the package as of bc09a17 under .session/old), same run, graph replay,
interleaved repeats; also split counts around the heuristic's, and SDPA cuDNN on dense KV."""
import csv, os, sys, time
import torch
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "old"))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import llmkernels_old  # noqa: E402
from llmkernels_old.attention.api import attention as attention_old  # noqa: E402
from llmkernels.attention.api import attention  # noqa: E402
from llmkernels.attention.paged import PagedKVCache  # noqa: E402
from llmkernels.attention import api as new_api  # noqa: E402
from benchmarks.common import graph_time_ms  # noqa: E402

OUT = os.environ.get("OUT", "/tmp/out")
dev = torch.device("cuda")
H, HKV, D = 32, 8, 128
K = 1024
POINTS = [(1, 1 * K, 1), (1, 8 * K, 1), (1, 32 * K, 1), (1, 128 * K, 1), (8, 8 * K, 1), (8, 32 * K, 1),
          (32, 8 * K, 1), (64, 8 * K, 1), (128, 1 * K, 1), (1, 8 * K, 4), (8, 8 * K, 4)]
REPEATS = 3
rows = []
for batch, ctx, q_len in POINTS:
    torch.manual_seed(0)
    pages_per_seq = ctx // 16
    n = batch * pages_per_seq
    kp = torch.randn(n, 16, HKV, D, dtype=torch.bfloat16, device=dev)
    vp = torch.randn_like(kp)
    bt = torch.randperm(n, device=dev).to(torch.int32).view(batch, pages_per_seq)
    seqlens = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
    cache = PagedKVCache(kp, vp, bt, seqlens)
    old_mod = sys.modules["llmkernels_old.attention.paged"]
    cache_old = old_mod.PagedKVCache(kp, vp, bt, seqlens)
    q = torch.randn(batch, q_len, H, D, dtype=torch.bfloat16, device=dev)
    kd = kp[bt.long()].reshape(batch, ctx, HKV, D).transpose(1, 2).contiguous()
    vd = vp[bt.long()].reshape(batch, ctx, HKV, D).transpose(1, 2).contiguous()
    qt = q.transpose(1, 2)
    mask = None
    if q_len > 1:
        mask = torch.arange(ctx, device=dev)[None, :] <= torch.arange(q_len, device=dev)[:, None] + ctx - q_len
    ref = torch.nn.functional.scaled_dot_product_attention(qt.float(), kd.float(), vd.float(), attn_mask=mask,
                                                           enable_gqa=True).transpose(1, 2)
    out = attention(q, None, None, kv_cache=cache, causal=True)
    plan = [p for p in new_api._PLANS._plans.values()][-1]
    default_splits = plan.num_splits
    variants = {
        "two_launch": lambda: attention_old(q, None, None, kv_cache=cache_old, causal=True),
        "one_launch": lambda: attention(q, None, None, kv_cache=cache, causal=True),
    }
    for factor in (0.5, 2):
        s = max(1, int(round(default_splits * factor)))
        if s != default_splits:
            variants[f"one_launch_splits{s}"] = (lambda s=s: attention(q, None, None, kv_cache=cache, causal=True,
                                                                       num_splits=s))
    if default_splits == 1:
        variants["one_launch_splits2"] = lambda: attention(q, None, None, kv_cache=cache, causal=True, num_splits=2)
        variants["two_launch_splits2"] = lambda: attention_old(q, None, None, kv_cache=cache_old, causal=True,
                                                               num_splits=2)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(qt, kd, vd, attn_mask=mask, enable_gqa=True)
    variants["sdpa_cudnn"] = cudnn
    errors = {}
    for name, fn in variants.items():
        o = fn()
        if name == "sdpa_cudnn":
            o = o.transpose(1, 2)
        errors[name] = ((o.float() - ref).norm() / ref.norm()).item()
    same_bits = torch.equal(variants["one_launch"](), variants["one_launch"]())
    times = {name: [] for name in variants}
    for _ in range(REPEATS):
        for name, fn in variants.items():
            times[name].append(graph_time_ms(fn) * 1e3)
    med = {name: sorted(t)[len(t) // 2] for name, t in times.items()}
    kv_bytes = 2 * kd.numel() * 2
    for name in variants:
        rows.append(dict(batch=batch, context=ctx, q_len=q_len, default_splits=default_splits, impl=name,
                         us=round(med[name], 2), spread=round(max(times[name]) / min(times[name]) - 1, 3),
                         gbps=round(kv_bytes / med[name] / 1e3, 1),
                         vs_two_launch=round(med["two_launch"] / med[name], 3),
                         vs_cudnn=round(med["sdpa_cudnn"] / med[name], 3), rel_error=f"{errors[name]:.2e}",
                         repeat_bits_equal=same_bits if name == "one_launch" else ""))
        print(rows[-1], flush=True)
    del kp, vp, kd, vd, cache, cache_old
    torch.cuda.empty_cache()
with open(os.path.join(OUT, "decode_merge_ablation.csv"), "w", newline="") as f:
    w = csv.DictWriter(f, fieldnames=list(rows[0]))
    w.writeheader()
    w.writerows(rows)
with open(os.path.join(OUT, "decode_merge_ablation.md"), "w") as f:
    f.write(f"# One-launch split-KV decode vs split + combine ({torch.cuda.get_device_name()})\n\n"
            "bf16 paged decode (page 16, pages shuffled), Hq=32, Hkv=8, D=128; microseconds per call under CUDA-graph "
            f"replay, median of {REPEATS} interleaved repeats; `two_launch` = the package at bc09a17 (split pass + "
            "combine kernel); `one_launch` = this session's kernel (the last split of a tile merges); "
            "`sdpa_cudnn` reads the same keys as dense tensors. q_len > 1: bottom-right causal.\n\n")
    keys = list(rows[0])
    f.write("| " + " | ".join(keys) + " |\n|" + "---|" * len(keys) + "\n")
    for r in rows:
        f.write("| " + " | ".join(str(r[k]) for k in keys) + " |\n")
print("done")
