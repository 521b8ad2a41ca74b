"""Shared benchmark plumbing: device ceilings, timing, tables (markdown + CSV) and plots."""

from __future__ import annotations

import csv
import os
import re
import sys

import torch

CANNOT_RUN = 2  # the exit status of a suite started where it cannot run (no suitable GPU, a missing optional package)


def gpu_slug() -> str:
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def default_out_dir(suite: str | None = None) -> str:
    """``benchmarks/results/<gpu>/<suite>/``: where a suite's latest results live (one folder per suite and GPU)."""
    folder = os.path.join(os.path.dirname(__file__), "results", gpu_slug())
    return os.path.join(folder, suite) if suite else folder


def require_gpu(suite: str, what: str = "a CUDA GPU", hopper: bool = False) -> None:
    """Exit with status ``CANNOT_RUN`` (2) and one line on stderr when this machine cannot run ``suite``: no CUDA
    GPU, or (``hopper``) one that is not sm_90. Suites call it after parsing their arguments (``--help`` works
    anywhere) and before touching the GPU."""
    found = torch.cuda.is_available()
    if found and hopper and torch.cuda.get_device_capability()[0] != 9:
        print(f"{suite}: needs {what}; this machine has {torch.cuda.get_device_name()}", file=sys.stderr)
        raise SystemExit(CANNOT_RUN)
    if not found:
        print(f"{suite}: needs {what}; no CUDA GPU on this machine", file=sys.stderr)
        raise SystemExit(CANNOT_RUN)


def zipf_offsets(num_experts: int, total_tokens: int, exponent: float = 1.2) -> torch.Tensor:
    """int32 CUDA ``[E + 1]`` group offsets: group sizes ∝ 1 / rank^exponent in a random expert order,
    summing to total_tokens (an imbalanced MoE routing)."""
    weights = 1.0 / torch.arange(1, num_experts + 1, dtype=torch.float64) ** exponent
    sizes = torch.floor(weights / weights.sum() * total_tokens).long()
    sizes[0] += total_tokens - sizes.sum()
    sizes = sizes[torch.randperm(num_experts)]
    return torch.cat([torch.zeros(1, dtype=torch.long), sizes.cumsum(0)]).to(torch.int32).cuda()


def e4m3_descale(amax: torch.Tensor) -> torch.Tensor:
    """float32 descales for storing values of max |x| ``amax`` as float8_e4m3fn: the power of two
    ``2^ceil(log2(amax / 448))``, so that ``x / descale`` fits e4m3 (<= 448) and ``e4m3 * descale`` is exact in bf16
    (an e4m3 value times a power of two): a bf16 system run on the dequantized values reads the very values the FP8
    one reads. Same shape as ``amax``."""
    return torch.exp2(torch.ceil(torch.log2(amax.float().clamp_min(2.0**-100) / 448.0)))


def time_ms(fn, warmup_ms: float = 25, rep_ms: float = 100) -> float:
    """Median time of ``fn()`` in milliseconds (CUDA events, via triton.testing.do_bench)."""
    import triton.testing

    return triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")


def graph_time_ms(fn, warmup_ms: float = 25, rep_ms: float = 100, blocks: int = 3) -> float:
    """Time of one CUDA-graph replay of ``fn()`` in milliseconds: the GPU time without the host's launch overhead,
    the lowest of the medians of ``blocks`` consecutive blocks of ``rep_ms / blocks`` each. Episodes of 10-35%
    slower GPU time lasting about a tenth of a second hit any system now and then (H200, lab/NOTES.md: one round in
    five of the same graph); a single median over the whole time can take one in, the lowest block median keeps it
    out. ``fn`` must already have run once (compiled) and be capturable."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # allocator warm-up on the capture stream
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    ms = time_ms(graph.replay, warmup_ms, rep_ms / blocks)
    for _ in range(blocks - 1):
        ms = min(ms, time_ms(graph.replay, 0, rep_ms / blocks))
    del graph
    return ms


def measure_ceilings() -> dict:
    """Copy bandwidth (GB/s, read + write), bf16 and fp8 matmul rates (TFLOP/s), measured now."""
    ceilings = {}
    src = torch.empty(2**30 // 2, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src))
    ceilings["copy_gbps"] = 2 * src.numel() * 2 / ms / 1e6
    del src, dst
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = time_ms(lambda: a @ b)
    ceilings["bf16_tflops"] = 2 * 8192**3 / ms / 1e9
    try:
        a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn).T.contiguous().T
        one = torch.tensor(1.0, device="cuda")
        ms = time_ms(lambda: torch._scaled_mm(a8, b8, one, one, out_dtype=torch.bfloat16))
        ceilings["fp8_tflops"] = 2 * 8192**3 / ms / 1e9
    except Exception:  # noqa: BLE001 - a peer that fails is reported, not fatal
        ceilings["fp8_tflops"] = float("nan")
    return ceilings


def write_table(rows: list[dict], out_dir: str, stem: str, title: str, notes: str = "") -> str:
    """Writes ``stem.csv`` and ``stem.md`` under out_dir and returns the markdown table."""
    os.makedirs(out_dir, exist_ok=True)
    columns = list(rows[0].keys()) if rows else []
    with open(os.path.join(out_dir, f"{stem}.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)

    def fmt(value):
        if isinstance(value, float):
            return "fails" if value != value else f"{value:.3g}" if abs(value) < 100 else f"{value:.0f}"
        return str(value)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(row[c]) for c in columns) + " |" for row in rows]
    table = "\n".join(lines)
    with open(os.path.join(out_dir, f"{stem}.md"), "w") as f:
        f.write(f"# {title}\n\n{notes}\n\n{table}\n")
    return table


def bar_plot(labels: list[str], series: dict[str, list[float]], ylabel: str, path: str, title: str) -> None:
    """Grouped bar chart; skipped quietly when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    width = 0.8 / max(len(series), 1)
    fig, ax = plt.subplots(figsize=(max(8, len(labels) * 1.4), 4.5))
    for i, (name, values) in enumerate(series.items()):
        positions = [x + i * width for x in range(len(labels))]
        ax.bar(positions, [0 if v != v else v for v in values], width, label=name)
    ax.set_xticks([x + width * (len(series) - 1) / 2 for x in range(len(labels))])
    ax.set_xticklabels(labels, rotation=20, ha="right", fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def line_plots(
    panels: dict[str, dict[str, list[tuple[float, float]]]], xlabel: str, ylabel: str, path: str, title: str
) -> None:
    """One subplot per panel, one line per series of (x, y) points, log2 x axis; skipped quietly
    when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    if not panels:
        return
    columns = min(3, len(panels))
    rows = -(-len(panels) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(6 * columns, 4.2 * rows), squeeze=False)
    for ax, (panel, series) in zip(axes.flat, panels.items()):
        for name, points in series.items():
            points = [(x, y) for x, y in points if y == y]
            if points:
                ax.plot(*zip(*points), marker="o", label=name)
        ax.set_xscale("log", base=2)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.set_title(panel, fontsize=10)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
