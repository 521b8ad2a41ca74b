"""The expert-parallel MoE block on W GPUs (torchrun) against one GPU holding every expert, one run.

    torchrun --nproc-per-node W -m benchmarks.bench_moe_ep [--out DIR] [--experts 64] [--hidden 7168]
        [--intermediate 2048] [--top-k 8] [--weight-format mxfp4] [--tokens 4096]
        [--dispatch-formats auto [bf16 fp8]] [--high-priority off [on]] [--batches 1]
    python -m benchmarks bench_moe_ep --cpu-smoke     (2 gloo ranks on the CPU, tiny shapes: checks the script)
    python -m benchmarks bench_moe_ep --scaling DIR... [--out DIR]     (the scaling table of earlier runs)

Each rank holds E / W experts and routes its own ``--tokens`` tokens. Rank 0 reports:

* **prefill**: MoE-block tokens/s of the W ranks (exact mode; W·T tokens per forward) against rank 0 alone running the
  one-process block with every expert on the same W·T tokens, and the ratio (``--batches``: both cycle through that
  many batches, so that the routing, and the exchange's row counts, change from one forward to the next); one row per
  exchange option (``dispatch_format`` × ``high_priority``: ``auto`` is the block's default, the activations' own
  format where its rows quantize alone; ``high_priority`` on: the block's process group made with NCCL's high-priority
  streams), each with ``exchange_bytes``, the bytes rank 0 sends to the other ranks per forward (one row per token and
  other rank that holds one of its experts, with its expert ids and weights, and the bf16 row returned, from this
  run's routing), and ``max_rank_load``, the most copies one rank's experts receive over the mean (1.0: balanced; the
  router has unit-scale logits, as a trained one);
* **all-to-all**: the time of one ``all_to_all_single`` of a forward's bf16 dispatch volume (rank 0's rows)
  against the bandwidth this run measures for the group (a large all-to-all), i.e. how close the exchange runs to
  the link;
* **decode**: bounded-mode latency at 1 to 64 tokens per rank (capacity = tokens · top_k, so nothing is dropped),
  under CUDA-graph replay on GPUs, against the one-GPU block on the same W·n tokens (``latency_ratio``).

Writes ``moe_ep.{csv,md,png}`` under DIR (default ``benchmarks/results/<gpu>/bench_moe_ep/``). With W = 1 (one GPU)
the exchange degenerates to local copies: the baseline and the block's overhead, not a scaling figure. Needs a CUDA
GPU per rank and torchrun, except with ``--cpu-smoke``.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time

import torch
import torch.distributed as dist


def _timer(device: torch.device):
    """``time_ms(fn, reps, warmup=1)``: mean milliseconds per call after ``warmup`` calls (every batch of a
    :func:`_cycled` call once: each batch's first forward plans its row counts' size classes), CUDA events on a GPU,
    wall clock on the CPU; every rank enters it together (a barrier first), so collective calls line up."""

    def time_ms(fn, reps: int, warmup: int = 1) -> float:
        for _ in range(warmup):
            fn()
        dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(reps):
                fn()
            end.record()
            torch.cuda.synchronize()
            return start.elapsed_time(end) / reps
        started = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - started) * 1e3 / reps

    return time_ms


def _graphed(fn, device: torch.device):
    """``fn`` replayed from a CUDA graph on a GPU (no host time), ``fn`` itself elsewhere."""
    if device.type != "cuda":
        return fn
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--intermediate", type=int, default=2048)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--weight-format", default="mxfp4")
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per rank (prefill)")
    parser.add_argument(
        "--batches",
        type=int,
        default=1,
        help="prefill: forwards cycle through this many batches of tokens (other routing each forward, as in "
        "serving: the exchange's row counts change; 1: one batch again and again)",
    )
    parser.add_argument(
        "--dispatch-formats",
        nargs="+",
        default=["auto"],
        choices=["auto", "bf16", "fp8"],
        help="prefill: the exact mode's dispatch formats to time (auto: the block's default)",
    )
    parser.add_argument(
        "--high-priority",
        nargs="+",
        default=["off"],
        choices=["on", "off"],
        help="prefill: the exchange on the default process group (off) or on one with NCCL's high-priority streams",
    )
    parser.add_argument("--cpu-smoke", action="store_true", help="2 gloo ranks, tiny shapes, the interpreter")
    parser.add_argument(
        "--scaling",
        nargs="+",
        metavar="DIR",
        help="no run: the scaling table and plot (scaling.{csv,md,png} under --out) of earlier runs' moe_ep.csv in DIRs",
    )
    args = parser.parse_args(argv)
    if args.scaling:
        print(scaling(args.scaling, args.out or os.path.dirname(os.path.abspath(args.scaling[0]))))
        return
    if args.cpu_smoke:
        import torch.multiprocessing as mp

        os.environ.update(
            TRITON_INTERPRET="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29631")
        )
        small = dict(
            experts=8,
            hidden=64,
            intermediate=32,
            top_k=2,
            tokens=16,
            weight_format=args.weight_format,
            out=args.out or "/tmp/moe_ep_smoke",
            dispatch_formats=args.dispatch_formats,
            high_priority=args.high_priority,
            batches=args.batches,
        )
        mp.spawn(_smoke_rank, args=(small,), nprocs=2)
        return
    from benchmarks.common import CANNOT_RUN, require_gpu

    require_gpu("bench_moe_ep", "a CUDA GPU per rank (--cpu-smoke checks the script on the CPU)")
    if "RANK" not in os.environ:
        print(
            "bench_moe_ep: start it under torchrun, one process per GPU: torchrun --nproc-per-node W -m "
            "benchmarks.bench_moe_ep [arguments]",
            file=sys.stderr,
        )
        raise SystemExit(CANNOT_RUN)
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    run(vars(args))
    dist.destroy_process_group()


def _smoke_rank(rank: int, options: dict):
    dist.init_process_group("gloo", rank=rank, world_size=2)
    run(options, decode_tokens=(1, 4))
    dist.destroy_process_group()


def run(options: dict, decode_tokens=(1, 2, 4, 8, 16, 32, 64)) -> None:
    from benchmarks.common import bar_plot, default_out_dir, write_table
    from llmkernels.moe import MoEFeedForward

    rank, world = dist.get_rank(), dist.get_world_size()
    device = (
        torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
        if torch.cuda.is_available()
        else (torch.device("cpu"))
    )
    if device.type == "cuda":
        torch.cuda.set_device(device)
    num_experts, hidden, intermediate, top_k = (options[key] for key in ("experts", "hidden", "intermediate", "top_k"))
    tokens, weight_format = options["tokens"], options["weight_format"]
    generator = torch.Generator(device=device).manual_seed(0)  # the same weights on every rank
    # logits of unit scale, as a trained router gives: unscaled, their softmax underflows to exact zeros and the
    # ties (lowest id first) send most copies to the first rank's experts
    router = torch.randn(num_experts, hidden, device=device, generator=generator) / hidden**0.5
    w_gate_up = torch.randn(num_experts, 2 * intermediate, hidden, device=device, generator=generator) / hidden**0.5
    w_down = torch.randn(num_experts, hidden, intermediate, device=device, generator=generator) / intermediate**0.5
    per_rank = num_experts // world
    mine = slice(rank * per_rank, (rank + 1) * per_rank)
    batches = [
        torch.randn(world * tokens, hidden, device=device, generator=generator).to(torch.bfloat16)
        for _ in range(options.get("batches", 1))
    ]
    x_all = batches[0]  # the decode rows, the routing statistics
    x = x_all[rank * tokens : (rank + 1) * tokens]
    time_ms = _timer(device)
    reps = 3 if device.type == "cpu" else 20
    rows = []

    # prefill: rank 0 alone with every expert on all W·T tokens, then the W ranks (exact mode) per option
    whole_ms, whole = float("nan"), None
    if rank == 0:
        whole = MoEFeedForward.from_float(router, w_gate_up, w_down, top_k, weight_format=weight_format)
        started = _timer_local(device)
        whole_ms = started(_cycled(whole, batches), reps, warmup=len(batches))
    dist.barrier()
    # rows of rank 0's tokens that leave it (every rank computes it: the all-to-all below needs one size)
    expert_ids = torch.topk(x_all[:tokens].float() @ router.float().t(), top_k, dim=-1).indices  # softmax's top-k
    holders = torch.zeros(tokens, world, dtype=torch.bool, device=device).scatter_(1, expert_ids // per_rank, True)
    sent_away = int(holders.sum() - holders[:, 0].sum())
    # the most copies one rank's experts receive over the mean: the slowest rank sets the forward's time
    all_ids = torch.topk(x_all.float() @ router.float().t(), top_k, dim=-1).indices
    per_rank_copies = torch.bincount((all_ids // per_rank).reshape(-1), minlength=world).float()
    rank_load = float(per_rank_copies.max() / per_rank_copies.mean())
    groups = {"off": dist.group.WORLD}
    if "on" in options.get("high_priority", ["off"]) and device.type == "cuda":
        groups["on"] = dist.new_group(
            backend="nccl", pg_options=dist.ProcessGroupNCCL.Options(is_high_priority_stream=True)
        )
    for dispatch_format in options.get("dispatch_formats", ["auto"]):
        for high_priority, group in groups.items():
            try:  # every rank raises the same ValueError, before any collective
                block = MoEFeedForward.from_float(
                    router,
                    w_gate_up[mine],
                    w_down[mine],
                    top_k,
                    weight_format=weight_format,
                    process_group=group,
                    dispatch_format=None if dispatch_format == "auto" else dispatch_format,
                )
            except ValueError as error:
                if rank == 0:
                    print(f"bench_moe_ep: skipped dispatch_format={dispatch_format}: {error}", file=sys.stderr)
                continue
            my_batches = [b[rank * tokens : (rank + 1) * tokens] for b in batches]
            ep_ms = time_ms(_cycled(block, my_batches), reps, warmup=len(batches))
            row_bytes = _row_bytes(block.dispatch_format, hidden) + 8 * top_k + 2 * hidden  # ids, weights, return
            rows.append(
                dict(
                    part="prefill",
                    dispatch_format=block.dispatch_format,
                    high_priority=high_priority,
                    batches=len(batches),
                    tokens_per_rank=tokens,
                    ranks=world,
                    ms=ep_ms,
                    tokens_per_s=world * tokens / ep_ms * 1e3,
                    one_gpu_ms=whole_ms,
                    one_gpu_tokens_per_s=world * tokens / whole_ms * 1e3,
                    speedup=whole_ms / ep_ms,
                    max_rank_load=rank_load,
                    exchange_bytes=sent_away * row_bytes,
                )
            )

    # all-to-all: a forward's dispatch volume against the group's measured bandwidth
    big = torch.empty(64 * 2**20 // 2 * world, dtype=torch.bfloat16, device=device)
    big_out = torch.empty_like(big)
    big_ms = time_ms(lambda: dist.all_to_all_single(big_out, big), reps)
    link_gbps = big.numel() * 2 * (world - 1) / world / big_ms / 1e6  # bytes leaving each rank
    per_peer = -(-max(sent_away, 1) // max(world - 1, 1))  # rank 0's bf16 rows, spread evenly over the others
    rows_x = torch.empty(world * per_peer, hidden, dtype=torch.bfloat16, device=device)
    rows_out = torch.empty_like(rows_x)
    a2a_ms = time_ms(lambda: dist.all_to_all_single(rows_out, rows_x), reps)
    dispatch_bytes = (world - 1) * per_peer * hidden * 2  # what leaves each rank
    rows.append(
        dict(
            part="all_to_all",
            tokens_per_rank=tokens,
            ranks=world,
            ms=a2a_ms,
            bytes_per_rank=dispatch_bytes,
            link_gbps=link_gbps,
            at_link_ms=dispatch_bytes / link_gbps / 1e6 if world > 1 else 0.0,
        )
    )

    # decode: bounded mode, capacity = tokens · top_k (nothing dropped), graph replay on GPUs
    for n in decode_tokens:
        decode_block = MoEFeedForward.from_float(
            router,
            w_gate_up[mine],
            w_down[mine],
            top_k,
            weight_format=weight_format,
            process_group=dist.group.WORLD,
            capacity=n * top_k,
        )
        xd = x[:n].contiguous()
        one_gpu_ms = float("nan")
        if rank == 0:  # the one-GPU block on the same W·n tokens, also replayed
            x_whole = x_all[: world * n].contiguous()
            one_gpu_ms = _timer_local(device)(_graphed(lambda: whole(x_whole), device), reps)
        ms = time_ms(_graphed(lambda: decode_block(xd), device), reps)
        rows.append(
            dict(
                part="decode",
                tokens_per_rank=n,
                ranks=world,
                ms=ms,
                tokens_per_s=world * n / ms * 1e3,
                one_gpu_ms=one_gpu_ms,
                latency_ratio=ms / one_gpu_ms,
            )
        )

    columns = list(dict.fromkeys(key for row in rows for key in row))
    rows = [{key: row.get(key, "") for key in columns} for row in rows]
    if rank == 0:
        out_dir = options.get("out") or default_out_dir("bench_moe_ep")
        name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU (gloo, interpreter)"
        print(
            write_table(
                rows,
                out_dir,
                "moe_ep",
                "Expert-parallel MoE block",
                f"{world} ranks of {name}, torch {torch.__version__}; E={num_experts}, H={hidden}, "
                f"I={intermediate}, top-{top_k}, {weight_format} weights; mean times per call.",
            )
        )
        decode = [r for r in rows if r["part"] == "decode"]
        bar_plot(
            [str(r["tokens_per_rank"]) for r in decode],
            {"decode ms": [r["ms"] for r in decode]},
            "ms per forward",
            os.path.join(out_dir, "moe_ep.png"),
            "Expert-parallel decode latency",
        )


def scaling(run_dirs: list, out_dir: str) -> str:
    """The speedup over one GPU of each run's default exchange (the block's dispatch format, the default process
    group) and of its best option, per weight format and rank count, from the ``moe_ep.csv`` of runs (one per format and W; the weight
    format is read from the directory name's suffix after the last ``_``). Writes ``scaling.{csv,md,png}``."""
    import csv

    from benchmarks.common import bar_plot, write_table

    rows = []
    for run_dir in run_dirs:
        with open(os.path.join(run_dir, "moe_ep.csv")) as f:
            prefill = [r for r in csv.DictReader(f) if r["part"] == "prefill"]
        if not prefill:
            continue
        default = next((r for r in prefill if r.get("high_priority", "off") == "off"), prefill[0])
        best = max(prefill, key=lambda r: float(r["speedup"]))
        rows.append(
            dict(
                weights=os.path.basename(os.path.normpath(run_dir)).rsplit("_", 1)[-1],
                ranks=int(default["ranks"]),
                one_gpu_ms=float(default["one_gpu_ms"]),
                ms=float(default["ms"]),
                speedup=float(default["speedup"]),
                best_option=f"{best['dispatch_format']} dispatch, high_priority {best.get('high_priority', 'off')}",
                best_speedup=float(best["speedup"]),
                max_rank_load=float(default.get("max_rank_load") or "nan"),
            )
        )
    rows.sort(key=lambda r: (r["weights"], r["ranks"]))
    table = write_table(
        rows,
        out_dir,
        "scaling",
        "Expert-parallel scaling",
        "Prefill speedup of W ranks over one GPU running every expert on the same W·T tokens (bench_moe_ep runs; "
        "`speedup`: the block's default exchange, `best_speedup`: the best option timed).",
    )
    bar_plot(
        [f"{r['weights']} W={r['ranks']}" for r in rows],
        {"speedup (default)": [r["speedup"] for r in rows], "best option": [r["best_speedup"] for r in rows]},
        "speedup over one GPU",
        os.path.join(out_dir, "scaling.png"),
        "Expert-parallel MoE block: prefill speedup over one GPU",
    )
    return table


def _row_bytes(dispatch_format: str, hidden: int) -> int:
    """The bytes one copy's row travels in: bf16, fp8 (1, 128) with float32 scales, mxfp8 or mxfp4 (e8m0 per 32)."""
    return {
        "bf16": 2 * hidden,
        "fp8": hidden + 4 * -(-hidden // 128),
        "mxfp8": hidden + hidden // 32,
        "mxfp4": hidden // 2 + hidden // 32,
    }[dispatch_format]


def _cycled(fn, inputs: list):
    """A call of ``fn`` on each of ``inputs`` in turn, one per call."""
    turn = itertools.cycle(inputs)
    return lambda: fn(next(turn))


def _timer_local(device: torch.device):
    """Like :func:`_timer` for one rank alone (no barrier: the other ranks do not take part)."""

    def time_ms(fn, reps: int, warmup: int = 1) -> float:
        for _ in range(warmup):
            fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        for _ in range(reps):
            fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return (time.perf_counter() - started) * 1e3 / reps

    return time_ms


if __name__ == "__main__":
    main()
