"""Ragged (varlen) prefill, with and without a paged cache, against SDPA flash varlen and SDPA cuDNN.

    python -m benchmarks bench_attention_ragged [--out DIR]

Sequences of different lengths in one call, bf16, Hq = 32, Hkv = 8, D = 128. Problems: a ragged batch of 16k
tokens (8 sequences of 256-5120 tokens, causal and not), and a chunked prefill of 4 sequences (512-2048 new tokens
each) over paged caches of 2k-32k keys (page 16, bottom-right causal).
llmkernels runs ``lk.attention`` with ``cu_seqlens`` (and the cache). Peers, each on the same keys: SDPA flash's
varlen kernel (``aten._flash_attention_forward`` with cumulative lengths: FlashAttention-2, bottom-right causal,
the same work), SDPA cuDNN called once per sequence (the same work in as many launches, all in one CUDA graph;
for the chunked prefill without a mask, since SDPA's causal is top-left: every query sees its whole context,
a little more work) and, causal, SDPA cuDNN on the batch padded to its longest sequence (more work). Every system is
checked against a float32 reference first; times are CUDA-graph replays; TFLOP/s count the causal (or full)
work of the ragged batch for every system. Writes ``attention_ragged.{csv,md,png}`` to DIR (default
``benchmarks/results/<gpu>/bench_attention_ragged/``). GPU only.
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.common import bar_plot, default_out_dir, graph_time_ms, measure_ceilings, require_gpu, write_table
from benchmarks.peers import sdpa_backend
from llmkernels.attention.api import attention
from llmkernels.attention.paged import PagedKVCache

HEADS, KV_HEADS, DIM = 32, 8, 128
PREFILL_LENGTHS = [1024, 3072, 512, 4096, 2048, 5120, 256, 256]  # 16k tokens
CHUNKS = [(512, 8192), (1024, 2048), (2048, 16384), (512, 32768)]  # (new tokens, keys in the cache)


def cumulative(lengths) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")


def reference(q, k, v, lengths_q, lengths_k, causal):
    """float32 ``[total_q, Hq, D]``, each sequence on its own keys, bottom-right causal."""
    out, cu_q, cu_k = [], cumulative(lengths_q).tolist(), cumulative(lengths_k).tolist()
    for b in range(len(lengths_q)):
        qs = q[cu_q[b] : cu_q[b + 1]].float().transpose(0, 1)
        ks = k[cu_k[b] : cu_k[b + 1]].float().transpose(0, 1).repeat_interleave(HEADS // KV_HEADS, 0)
        vs = v[cu_k[b] : cu_k[b + 1]].float().transpose(0, 1).repeat_interleave(HEADS // KV_HEADS, 0)
        mask = None
        if causal:
            rows = torch.arange(qs.shape[1], device="cuda")[:, None] + ks.shape[1] - qs.shape[1]
            mask = torch.arange(ks.shape[1], device="cuda")[None, :] <= rows
        out.append(torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask).transpose(0, 1))
    return torch.cat(out)


def flash_varlen(q, k, v, lengths_q, lengths_k, causal):
    cu_q, cu_k = cumulative(lengths_q), cumulative(lengths_k)
    max_q, max_k = max(lengths_q), max(lengths_k)
    return lambda: torch.ops.aten._flash_attention_forward(q, k, v, cu_q, cu_k, max_q, max_k, 0.0, causal, False)[0]


def cudnn_per_sequence(q, k, v, lengths_q, lengths_k, causal):
    """One SDPA cuDNN call per sequence (heads repeated to Hq: GQA through enable_gqa), outputs concatenated."""
    from torch.nn.attention import sdpa_kernel

    cu_q, cu_k = cumulative(lengths_q).tolist(), cumulative(lengths_k).tolist()
    views = [
        (
            q[cu_q[b] : cu_q[b + 1]].transpose(0, 1)[None],
            k[cu_k[b] : cu_k[b + 1]].transpose(0, 1)[None],
            v[cu_k[b] : cu_k[b + 1]].transpose(0, 1)[None],
        )
        for b in range(len(lengths_q))
    ]

    def run():
        with sdpa_kernel(sdpa_backend("cudnn")):
            return torch.cat(
                [
                    torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=causal, enable_gqa=True)[
                        0
                    ].transpose(0, 1)
                    for qs, ks, vs in views
                ]
            )

    return run


def cudnn_padded(q, k, v, lengths):
    """SDPA cuDNN, causal, on the batch padded to its longest sequence (more work): sequences at the start of
    their rows, so that causal masking keeps every query off the padding; the padding is sliced off."""
    from torch.nn.attention import sdpa_kernel

    batch, longest, cu = len(lengths), max(lengths), cumulative(lengths).tolist()
    padded = [
        torch.zeros(batch, heads, longest, DIM, dtype=q.dtype, device="cuda") for heads in (HEADS, KV_HEADS, KV_HEADS)
    ]
    for b in range(batch):
        for buffer, t in zip(padded, (q, k, v)):
            buffer[b, :, : lengths[b]] = t[cu[b] : cu[b + 1]].transpose(0, 1)

    def run():
        with sdpa_kernel(sdpa_backend("cudnn")):
            out = torch.nn.functional.scaled_dot_product_attention(*padded, is_causal=True, enable_gqa=True)
        return torch.cat([out[b, :, : lengths[b]].transpose(0, 1) for b in range(batch)])

    return run


def causal_flops(lengths_q, lengths_k, causal):
    pairs = sum(lq * lk - (lq * (lq - 1) // 2 if causal else 0) for lq, lk in zip(lengths_q, lengths_k))
    return 4 * HEADS * DIM * pairs


def problem_rows(name, lengths_q, lengths_k, causal, paged, bf16_tflops):
    dtype = torch.bfloat16
    q = torch.randn(sum(lengths_q), HEADS, DIM, dtype=dtype, device="cuda")
    k = torch.randn(sum(lengths_k), KV_HEADS, DIM, dtype=dtype, device="cuda")
    v = torch.randn_like(k)
    cu_q, cu_k = cumulative(lengths_q), cumulative(lengths_k)
    if paged:
        page = 16
        counts = [n // page for n in lengths_k]
        pages = torch.randperm(sum(counts), device="cuda")
        k_pages = torch.empty(sum(counts), page, KV_HEADS, DIM, dtype=dtype, device="cuda")
        v_pages = torch.empty_like(k_pages)
        k_pages[pages], v_pages[pages] = k.view(-1, page, KV_HEADS, DIM), v.view(-1, page, KV_HEADS, DIM)
        table = torch.zeros(len(counts), max(counts), dtype=torch.int32, device="cuda")
        first = 0
        for b, count in enumerate(counts):
            table[b, :count] = pages[first : first + count].to(torch.int32)
            first += count
        cache = PagedKVCache(k_pages, v_pages, table, torch.tensor(lengths_k, dtype=torch.int32, device="cuda"))
        ours = lambda: attention(
            q,
            None,
            None,
            kv_cache=cache,
            cu_seqlens_q=cu_q,
            max_seqlen_q=max(lengths_q),  # noqa: E731
            causal=causal,
        )
    else:
        ours = lambda: attention(
            q,
            k,
            v,
            cu_seqlens_q=cu_q,
            cu_seqlens_k=cu_k,
            max_seqlen_q=max(lengths_q),  # noqa: E731
            max_seqlen_k=max(lengths_k),
            causal=causal,
        )
    expected = reference(q, k, v, lengths_q, lengths_k, causal)
    runners = {
        "llmkernels": (ours, expected),
        "sdpa_flash varlen": (flash_varlen(q, k, v, lengths_q, lengths_k, causal), expected),
    }
    same_work = not paged or not causal
    runners["sdpa_cudnn per sequence" + ("" if same_work else " nomask")] = (
        cudnn_per_sequence(q, k, v, lengths_q, lengths_k, causal and same_work),
        expected if same_work else reference(q, k, v, lengths_q, lengths_k, False),
    )
    if not paged and causal:
        runners["sdpa_cudnn padded"] = (cudnn_padded(q, k, v, lengths_q), expected)
    flops = causal_flops(lengths_q, lengths_k, causal)
    rows, mine = [], None
    for impl, (fn, want) in runners.items():
        try:
            out = fn()
            error = ((out.float() - want).norm() / want.norm()).item()
            ms, note = (graph_time_ms(fn), "") if error < 2e-2 else (None, f"WRONG (rel. error {error:.2e})")
        except Exception as exc:  # noqa: BLE001 - a system that cannot run a problem is reported, not fatal
            ms, note = None, f"fails ({type(exc).__name__}: {str(exc)[:60]})"
        mine = ms if impl == "llmkernels" else mine
        rows.append(
            dict(
                problem=name,
                causal=causal,
                impl=impl,
                graph_ms=ms,
                tflops=flops / ms / 1e9 if ms else None,
                pct_bf16=100 * flops / ms / 1e9 / bf16_tflops if ms else None,
                llmk_speedup=ms / mine if ms and mine and impl != "llmkernels" else None,
                note=note,
            )
        )
        print(
            {key: (f"{value:.4g}" if isinstance(value, float) else value) for key, value in rows[-1].items()},
            flush=True,
        )
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    require_gpu("bench_attention_ragged")
    torch.manual_seed(0)
    out_dir = args.out or default_out_dir("bench_attention_ragged")
    bf16_tflops = measure_ceilings()["bf16_tflops"]
    rows = []
    for causal in (False, True):
        rows += problem_rows("ragged prefill 16k tokens", PREFILL_LENGTHS, PREFILL_LENGTHS, causal, False, bf16_tflops)
    rows += problem_rows(
        "chunked prefill over pages", [c[0] for c in CHUNKS], [c[1] for c in CHUNKS], True, True, bf16_tflops
    )
    table = write_table(
        rows,
        out_dir,
        "attention_ragged",
        f"Ragged prefill on {torch.cuda.get_device_name()}",
        f"bf16, Hq={HEADS}, Hkv={KV_HEADS}, D={DIM}; ragged prefill lengths {PREFILL_LENGTHS}; "
        f"chunked prefill (new tokens, cached keys) {CHUNKS}, page 16, bottom-right causal. CUDA-graph "
        "replay times; `tflops` count the ragged batch's (causal) work for every system; `pct_bf16` "
        "of the measured bf16 matmul ceiling; `llmk_speedup`: system time / llmkernels time.",
    )
    labels = [f"{r['problem']}{' causal' if r['causal'] else ''}" for r in rows if r["impl"] == "llmkernels"]
    series = {}
    for r in rows:
        series.setdefault(r["impl"], []).append(r["tflops"] or 0.0)
    series = {impl: values for impl, values in series.items() if len(values) == len(labels)}
    bar_plot(
        labels,
        series,
        "TFLOP/s (graph replay)",
        f"{out_dir}/attention_ragged.png",
        "ragged prefill, bf16, Hq=32, Hkv=8, D=128",
    )
    print(table)


if __name__ == "__main__":
    main()
