"""Hashes of the outputs of a fixed catalogue of public calls, to compare two trees bit for bit on one GPU.

    PYTHONPATH=<tree>/src python lab/scripts/bitwise_outputs.py OUT.json

Only the public API is used, so the same script runs on the tree before and after a refactor; each call's
inputs come from its own seed. Compare two files with ``--compare A.json B.json``.
"""
import hashlib
import json
import sys

import torch


def digest(value) -> str:
    if isinstance(value, (tuple, list)):
        return "+".join(digest(v) for v in value)
    if value is None:
        return "none"
    if not isinstance(value, torch.Tensor):  # a ScaledTensor
        return "+".join(digest(t) for t in (value.data, value.scales, value.global_scale))
    return hashlib.sha256(value.detach().reshape(-1).contiguous().view(torch.uint8).cpu().numpy().tobytes()).hexdigest()[:16]


def catalogue(device):
    import llmkernels as lk
    from llmkernels import flash_attn
    from llmkernels.moe import MoEFeedForward, fused_experts

    bf16 = dict(dtype=torch.bfloat16, device=device)
    calls = {}

    def call(name):
        def register(fn):
            calls[name] = fn
            return fn
        return register

    for d in (64, 128, 256):
        for causal in (False, True):
            @call(f"prefill d{d} causal={causal}")
            def _(d=d, causal=causal):
                q, k, v = (torch.randn(2, 512, 8, d, **bf16) for _ in range(3))
                return lk.attention(q, k[:, :, :2], v[:, :, :2], causal=causal, return_lse=True)

    @call("prefill window+sinks")
    def _():
        q, k, v = (torch.randn(1, 700, 8, 64, **bf16) for _ in range(3))
        sinks = torch.randn(8, device=device)
        return lk.attention(q, k, v, mask=lk.SlidingWindow(128, 0), sinks=sinks)

    @call("prefill window gluon")
    def _():
        q, k, v = (torch.randn(1, 1024, 8, 128, **bf16) for _ in range(3))
        return lk.attention(q, k, v, mask=lk.SlidingWindow(256, 0), causal=True)

    @call("prefill softcap alibi")
    def _():
        q, k, v = (torch.randn(2, 200, 4, 64, **bf16) for _ in range(3))
        return lk.attention(q, k, v, causal=True, score_mod=lk.softcap(30.0))

    @call("ragged prefill")
    def _():
        lens = torch.tensor([0, 100, 357, 800], dtype=torch.int32, device=device)
        q, k, v = (torch.randn(800, 8, 128, **bf16) for _ in range(3))
        return lk.attention(q, k, v, cu_seqlens_q=lens, cu_seqlens_k=lens, max_seqlen_q=457, max_seqlen_k=457,
                            causal=True, return_lse=True)

    for page in (16, 64):
        for queries in (1, 4):
            @call(f"paged decode page={page} q={queries}")
            def _(page=page, queries=queries):
                pages = 4096 // page * 4
                kp, vp = (torch.randn(pages, page, 8, 128, **bf16) for _ in range(2))
                table = torch.randperm(pages, device=device, dtype=torch.int32).view(4, -1)
                seqlens = torch.tensor([4096, 1, 3000, 777], dtype=torch.int32, device=device)
                q = torch.randn(4, queries, 32, 128, **bf16)
                return lk.attention(q, None, None, kv_cache=lk.PagedKVCache(kp, vp, table, seqlens), causal=True,
                                    return_lse=True)

    @call("dense decode splits")
    def _():
        q = torch.randn(2, 1, 32, 128, **bf16)
        k, v = (torch.randn(2, 8192, 8, 128, **bf16) for _ in range(2))
        return lk.attention(q, k, v, num_splits=8, return_lse=True)

    @call("paged prefill chunk")
    def _():
        kp, vp = (torch.randn(256, 64, 8, 128, **bf16) for _ in range(2))
        table = torch.randperm(256, device=device, dtype=torch.int32).view(2, -1)
        seqlens = torch.tensor([8192, 5000], dtype=torch.int32, device=device)
        q = torch.randn(2, 512, 16, 128, **bf16)
        return lk.attention(q, None, None, kv_cache=lk.PagedKVCache(kp, vp, table, seqlens), causal=True)

    @call("flash_attn_with_kvcache append")
    def _():
        k_cache, v_cache = (torch.randn(2, 1024, 8, 128, **bf16) for _ in range(2))
        seqlens = torch.tensor([100, 900], dtype=torch.int32, device=device)
        q, k, v = torch.randn(2, 3, 32, 128, **bf16), *(torch.randn(2, 3, 8, 128, **bf16) for _ in range(2))
        out = flash_attn.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=seqlens, causal=True)
        return out, k_cache, v_cache

    @call("flash_attn_varlen_func")
    def _():
        lens = torch.tensor([0, 300, 1000], dtype=torch.int32, device=device)
        q, k, v = (torch.randn(1000, 8, 64, **bf16) for _ in range(3))
        return flash_attn.flash_attn_varlen_func(q, k, v, lens, lens, 700, 700, causal=True)

    groups = torch.tensor([0, 0, 3, 131, 131, 400, 1200, 1201], dtype=torch.int32, device=device)
    ids = torch.tensor([5, 1, -1, 0, 7, 3, 2], dtype=torch.int32, device=device)
    pairs = [("bf16", b) for b in ("bf16", "mxfp8", "mxfp4", "nvfp4")] + [
        ("mxfp8", "mxfp8"), ("mxfp4", "mxfp4"), ("mxfp8", "mxfp4"), ("nvfp4", "nvfp4")]
    for a_format, b_format in pairs:
            for layout in ("row", "hopper"):
                if layout == "hopper" and not (a_format == "bf16" and b_format in ("mxfp4", "nvfp4")):
                    continue
                for epilogue in (None, "swiglu"):
                    @call(f"grouped_matmul {a_format}x{b_format} {layout} {epilogue}")
                    def _(a_format=a_format, b_format=b_format, layout=layout, epilogue=epilogue):
                        x = torch.randn(1201, 512, **bf16)
                        w = torch.randn(8, 384, 512, **bf16) / 20
                        a = x if a_format == "bf16" else lk.quantize(x, a_format)
                        b = w if b_format == "bf16" else lk.quantize(w, b_format)
                        if layout == "hopper":
                            b = b.to_layout("hopper")
                        scales = torch.rand(8, device=device)
                        return lk.grouped_matmul(a, b, groups, ids, expert_scales=scales, epilogue=epilogue)

    for rows in (1, 16, 4096):
        @call(f"grouped_matmul decode-ish bf16xmxfp4 hopper rows={rows}")
        def _(rows=rows):
            x = torch.randn(rows * 8, 2048, **bf16)
            w = lk.quantize(torch.randn(8, 1024, 2048, **bf16), "mxfp4").to_layout("hopper")
            offsets = torch.arange(0, rows * 8 + 1, rows, dtype=torch.int32, device=device)
            return lk.grouped_matmul(x, w, offsets, torch.arange(8, dtype=torch.int32, device=device))

    for fmt in ("mxfp8", "mxfp4", "nvfp4"):
        @call(f"quantize {fmt}")
        def _(fmt=fmt):
            x = torch.randn(333, 1024, **bf16) * 3
            return lk.quantize(x, fmt), lk.quantize(x, fmt, scale_layout="128x4")

    for weight_format in ("bf16", "mxfp8", "mxfp4"):
        for tokens in (1, 300):
            @call(f"MoEFeedForward {weight_format} tokens={tokens}")
            def _(weight_format=weight_format, tokens=tokens):
                h, i, e = 1024, 512, 16
                router = torch.randn(e, h, device=device) / 30
                w13 = torch.randn(e, 2 * i, h, device=device) / 30
                w2 = torch.randn(e, h, i, device=device) / 20
                block = MoEFeedForward.from_float(router, w13, w2, 4, weight_format=weight_format)
                return block(torch.randn(tokens, h, **bf16))

    @call("fused_experts")
    def _():
        x = torch.randn(64, 512, **bf16)
        w1, w2 = torch.randn(8, 2 * 256, 512, **bf16) / 20, torch.randn(8, 512, 256, **bf16) / 20
        weights, ids_ = torch.rand(64, 2, device=device), torch.randint(0, 8, (64, 2), device=device, dtype=torch.int32)
        return fused_experts(x, w1, w2, weights, ids_)

    return calls


def main():
    if sys.argv[1] == "--compare":
        a, b = (json.load(open(path)) for path in sys.argv[2:4])
        same = [name for name in a if a[name] == b.get(name)]
        differ = [name for name in a if name in b and a[name] != b[name]]
        print(f"{len(same)} identical, {len(differ)} differ, {len(set(a) ^ set(b))} only in one")
        for name in differ + sorted(set(a) ^ set(b)):
            print(f"  {name}: {a.get(name)} vs {b.get(name)}")
        sys.exit(1 if differ or set(a) ^ set(b) else 0)
    device = torch.device("cuda")
    results = {}
    with torch.inference_mode():
        for name, fn in catalogue(device).items():
            torch.manual_seed(sum(map(ord, name)))
            try:
                results[name] = digest(fn())
                torch.manual_seed(sum(map(ord, name)))
                if digest(fn()) != results[name]:
                    results[name] += " (not deterministic)"
            except Exception as error:  # noqa: BLE001 - a failure is a result to compare too
                results[name] = f"error {type(error).__name__}: {str(error)[:100]}"
            print(name, results[name], flush=True)
    json.dump(results, open(sys.argv[1], "w"), indent=1)


if __name__ == "__main__":
    main()
