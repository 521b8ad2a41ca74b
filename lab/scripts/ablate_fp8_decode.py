"""Paged decode over an FP8 (e4m3) KV cache: portable-kernel configs and split counts, under CUDA-graph replay,
next to the bf16 cache's default. Hq 32, Hkv 8, D 128, page 16, one query token; descales per (sequence, KV head).

    PYTHONPATH=src:. python lab/scripts/ablate_fp8_decode.py [--tag NAME] [--out DIR] [--quick]

Prints one line per (problem, variant): graph-replay µs, the FP8 bytes' GB/s and % of the copy bandwidth measured
in the same run, and the speedup over the bf16 cache's default. Every variant is checked against the bf16-cache
result on the same (dequantized) keys first."""

from __future__ import annotations

import argparse
import csv
import dataclasses
import os

import torch

from benchmarks.common import graph_time_ms, measure_ceilings
from llmkernels.attention.api import attention
from llmkernels.attention.config import default_config
from llmkernels.attention.paged import PagedKVCache

HEADS, KV_HEADS, DIM, PAGE = 32, 8, 128, 16
PROBLEMS = [(8, 32768), (32, 8192), (1, 131072), (1, 8192)]
# (BN, stages, warps)
TILES = [(64, 2, 2), (64, 3, 2), (128, 2, 4), (64, 1, 2)]
SPLIT_FACTORS = (1, 2, 4)


def problem(batch, context, device):
    pages_per_seq = context // PAGE
    num_pages = batch * pages_per_seq
    table = torch.randperm(num_pages, device=device).to(torch.int32).view(batch, pages_per_seq)
    seqlens = torch.full((batch,), context, dtype=torch.int32, device=device)
    fp8, bf16, descales = [], [], []
    for _ in range(2):
        raw = torch.randn(num_pages, PAGE, KV_HEADS, DIM, device=device)
        descale = torch.rand(batch, KV_HEADS, device=device) + 0.5
        per_page = descale[torch.arange(batch, device=device).repeat_interleave(pages_per_seq)]  # pages in table order
        pages = torch.empty(num_pages, PAGE, KV_HEADS, DIM, dtype=torch.float8_e4m3fn, device=device)
        pages[table.flatten().long()] = raw[:num_pages].to(torch.float8_e4m3fn)
        deq = torch.empty(num_pages, PAGE, KV_HEADS, DIM, dtype=torch.bfloat16, device=device)
        deq[table.flatten().long()] = (pages[table.flatten().long()].float() * per_page[:, None, :, None]).to(
            torch.bfloat16
        )
        fp8.append(pages)
        bf16.append(deq)
        descales.append(descale)
    q = torch.randn(batch, 1, HEADS, DIM, dtype=torch.bfloat16, device=device)
    return q, PagedKVCache(*fp8, table, seqlens), PagedKVCache(*bf16, table, seqlens), descales


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tag", default="")
    parser.add_argument("--out", default=None)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--splits", action="store_true", help="default tiles, split counts around the rule's")
    args = parser.parse_args()
    torch.manual_seed(0)
    device = torch.device("cuda")
    copy_gbps = measure_ceilings()["copy_gbps"]
    print(f"copy {copy_gbps:.0f} GB/s, {torch.cuda.get_device_name()}", flush=True)
    rows = []
    tiles = TILES[:2] if args.quick else TILES
    for batch, context in PROBLEMS:
        q, fp8_cache, bf16_cache, (k_descale, v_descale) = problem(batch, context, device)
        fp8_bytes = 2 * batch * context * KV_HEADS * DIM
        expected = attention(q, None, None, kv_cache=bf16_cache).float()
        bf16_us = 1e3 * graph_time_ms(lambda: attention(q, None, None, kv_cache=bf16_cache))
        base = default_config(DIM, torch.bfloat16, device, decode=True, num_q_heads=HEADS, num_kv_heads=KV_HEADS)
        variants = [("default", None, None)]
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        programs = batch * KV_HEADS
        if args.splits:
            rule = max(1, -(-4 * sms // programs))
            counts = sorted(
                {max(1, c) for c in (rule // 2, rule - 1, rule, rule + 1, 2 * rule, 1 << (rule.bit_length() - 1))}
            )
            variants += [(f"default tiles, splits {c}", None, c) for c in counts]
            tiles = []
        for bn, stages, warps in tiles:
            config = dataclasses.replace(base, BN=bn, num_kv_stages=stages, num_warps=warps, warp_specialized=False)
            for factor in SPLIT_FACTORS:
                splits = max(1, min(256, round(factor * 2 * sms / programs)))
                variants.append((f"BN{bn} s{stages} w{warps} splits {splits}", config, splits))
        for name, config, splits in variants:

            def run(config=config, splits=splits):
                return attention(
                    q,
                    None,
                    None,
                    kv_cache=fp8_cache,
                    k_descale=k_descale,
                    v_descale=v_descale,
                    config=config,
                    num_splits=splits,
                )

            try:
                got = run().float()
                err = ((got - expected).norm() / expected.norm()).item()
                if not err < 2e-2:
                    raise AssertionError(f"rel err {err:.3g}")
                us = 1e3 * graph_time_ms(run)
            except Exception as error:  # noqa: BLE001 - a failing variant is a finding
                print(f"B={batch} ctx={context} {name}: {type(error).__name__}: {str(error)[:200]}", flush=True)
                continue
            row = dict(
                tag=args.tag,
                problem=f"B={batch} ctx={context}",
                variant=name,
                us=round(us, 1),
                gbps=round(fp8_bytes / us / 1e3),
                pct_copy=round(100 * fp8_bytes / us / 1e3 / copy_gbps, 1),
                vs_bf16=round(bf16_us / us, 3),
                bf16_us=round(bf16_us, 1),
                rel_err=f"{err:.2e}",
            )
            rows.append(row)
            print(row, flush=True)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"ablate_fp8_decode{args.tag}.csv"), "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)


if __name__ == "__main__":
    main()
