"""One GPU: what the expert-parallel rank's grouped matmuls cost as the exact exchange calls them, against the same
rows grouped by expert alone, and how evenly bench_moe_ep's routing loads the ranks.

    python lab/scripts/ep_group_split.py      (CSV to $OUT/ep_group_split.csv)

For W = 2 and 4 with bench_moe_ep's inputs (seed 0, E 64, H 7168, I 2048, top-8, 4096 tokens per rank, mxfp4):
the copies each rank receives (routing imbalance), then on rank r's experts with its real counts:

* ``merged``: one call per projection, one group per local expert (what one GPU does with its experts);
* ``split``: one call, one group per (source, local expert) (``kept_first`` off);
* ``kept+received``: two calls, the kept rows' groups then the received rows' (the exchange's default).
"""

from __future__ import annotations

import csv
import os

import torch

from llmkernels.moe import MoEFeedForward

E, H, I, K, T = 64, 7168, 2048, 8, 4096


def time_ms(fn, reps=10):
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def inputs(world):
    device = torch.device("cuda")
    g = torch.Generator(device=device).manual_seed(0)
    router = torch.randn(E, H, device=device, generator=g) / H**0.5  # unit-scale logits, as bench_moe_ep
    w_gate_up = torch.randn(E, 2 * I, H, device=device, generator=g) / H**0.5
    w_down = torch.randn(E, H, I, device=device, generator=g) / I**0.5
    x_all = torch.randn(world * T, H, device=device, generator=g).to(torch.bfloat16)
    return router, w_gate_up, w_down, x_all


def main():
    out_dir = os.environ.get("OUT", "/tmp")
    rows = []
    for world in (2, 4):
        router, w_gate_up, w_down, x_all = inputs(world)
        per = E // world
        expert_ids = torch.topk(x_all.float() @ router.float().t(), K, dim=-1).indices  # [W·T, k]
        # counts[s, e]: copies source rank s sends to global expert e
        counts = torch.stack(
            [torch.bincount(expert_ids[s * T : (s + 1) * T].reshape(-1), minlength=E) for s in range(world)]
        )
        received = counts.sum(0).view(world, per).sum(1).tolist()
        print(f"W={world}: copies received per rank {received} (mean {world * T * K // world})")
        for rank in range(world):
            mine = slice(rank * per, (rank + 1) * per)
            block = MoEFeedForward.from_float(router[mine], w_gate_up[mine], w_down[mine], K, weight_format="mxfp4")
            local = counts[:, mine]  # [W, per]
            total = int(local.sum())
            a = torch.randn(total, H, device="cuda").to(torch.bfloat16)
            out = torch.empty(total, H, dtype=torch.bfloat16, device="cuda")
            ids = torch.arange(per, dtype=torch.int32, device="cuda")

            def offsets(c):
                return torch.nn.functional.pad(c.reshape(-1).cumsum(0), (1, 0)).to(torch.int32)

            merged = offsets(local.sum(0))
            order = [rank] + [s for s in range(world) if s != rank]
            by_source = local[order]  # kept rows first, then the other sources in rank order
            split = offsets(by_source)
            kept_rows = int(by_source[0].sum())
            kept, recv = offsets(by_source[:1]), offsets(by_source[1:])
            ids_split, ids_recv = ids.repeat(world), ids.repeat(world - 1)
            cases = {
                "merged": lambda: block._projections(a, merged, ids, out),
                "split": lambda: block._projections(a, split, ids_split, out),
                "kept+received": lambda: (
                    block._projections(a[:kept_rows], kept, ids, out[:kept_rows]),
                    block._projections(a[kept_rows:], recv, ids_recv, out[kept_rows:]),
                ),
            }
            flops = 2 * total * H * 3 * I
            for name, fn in cases.items():
                ms = time_ms(fn)
                rows.append(
                    dict(world=world, rank=rank, rows=total, case=name, ms=round(ms, 3), tflops=round(flops / ms / 1e9))
                )
                print(rows[-1])
    with open(f"{out_dir}/ep_group_split.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


if __name__ == "__main__":
    main()
