"""GPU check and benchmark of the lab bf16 Gluon grouped matmul (gluon_kernel.py) on an H100.

    PYTHONPATH=src:lab/gluon_bf16 python lab/gluon_bf16/bench_gpu.py OUT.md

Each part runs in a child process with a timeout (a Gluon deadlock hangs): first a ragged check (groups of 0, 1,
130, 77 rows and a -1 expert, N 384, K 320; rows past ``a_offsets[G]`` poisoned with NaN must stay NaN; the -1
group must be zeros) against a float64 product, bound 1e-2 relative (bf16 output); then CUDA-graph timings per
shape of the kernel, ``torch._grouped_mm`` bf16 and the library's bf16 ``grouped_matmul``.
"""

from __future__ import annotations

import subprocess
import sys

SHAPES = {  # name: (experts, tokens per expert, N, K)
    "E8x2048 N4096 K7168": (8, 2048, 4096, 7168),
    "E16x4096 N7168 K2048": (16, 4096, 7168, 2048),
    "E256x256 N7168 K2048": (256, 256, 7168, 2048),
    "E128x128 N4096 K7168": (128, 128, 4096, 7168),
    "gpt-oss E32x512 N5760 K2880": (32, 512, 5760, 2880),
}


def check(wide: bool = False) -> str:
    import torch

    if wide:
        from gluon_kernel_wide import bf16_grouped_matmul_gluon
    else:
        from gluon_kernel import bf16_grouped_matmul_gluon

    torch.manual_seed(0)
    sizes, ids = [0, 1, 130, 77, 40], [2, 0, 1, -1, 2]
    n, k, extra = 384, 320, 13
    rows = sum(sizes)
    a = torch.randn(rows + extra, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(3, n, k, device="cuda", dtype=torch.bfloat16)
    offsets = torch.tensor([0] + list(torch.tensor(sizes).cumsum(0)), device="cuda", dtype=torch.int32)
    out = torch.full((rows + extra, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    bf16_grouped_matmul_gluon(a, b, offsets, torch.tensor(ids, device="cuda", dtype=torch.int32), out)
    torch.cuda.synchronize()
    ref = torch.zeros(rows, n, dtype=torch.float64)
    for g, (start, end) in enumerate(zip(offsets[:-1].tolist(), offsets[1:].tolist())):
        if ids[g] >= 0:
            ref[start:end] = a[start:end].double().cpu() @ b[ids[g]].double().cpu().t()
    got = out[:rows].double().cpu()
    error = ((got - ref).norm() / ref.norm()).item()
    tail_nan = bool(out[rows:].isnan().all())
    zeros = bool((out[offsets[3] : offsets[4]] == 0).all())
    ok = error < 1e-2 and tail_nan and zeros and not got.isnan().any()
    return (
        f"check: {'ok' if ok else 'FAIL'} (rel err {error:.2e}, poisoned tail kept {tail_nan}, -1 group zeros {zeros})"
    )


def time_shape(name: str) -> str:
    import importlib.util
    import os

    import torch
    from gluon_kernel import bf16_grouped_matmul_gluon  # before fp8_blocks' folder joins sys.path
    from gluon_kernel_wide import bf16_grouped_matmul_gluon as wide_gluon

    import llmkernels as lk

    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "fp8_blocks", "bench_gpu.py")
    spec = importlib.util.spec_from_file_location("fp8_blocks_bench_gpu", path)
    fp8_bench = sys.modules["fp8_blocks_bench_gpu"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fp8_bench)
    graph_time_us = fp8_bench.graph_time_us

    experts, per, n, k = SHAPES[name]
    tokens = experts * per
    torch.manual_seed(0)
    a = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(experts, n, k, device="cuda", dtype=torch.bfloat16) * k**-0.5
    offsets = torch.arange(0, tokens + 1, per, device="cuda", dtype=torch.int32)
    ids = torch.arange(experts, device="cuda", dtype=torch.int32)
    out = torch.empty(tokens, n, device="cuda", dtype=torch.bfloat16)
    flops = 2 * tokens * n * k
    b_t = b.transpose(-2, -1)
    peer = torch._grouped_mm(a, b_t, offs=offsets[1:], out_dtype=torch.bfloat16)
    bf16_grouped_matmul_gluon(a, b, offsets, ids, out)
    error = ((out.float() - peer.float()).norm() / peer.float().norm()).item()
    cells = []
    times = {}
    for label, fn in (
        ("_grouped_mm", lambda: torch._grouped_mm(a, b_t, offs=offsets[1:], out_dtype=torch.bfloat16)),
        ("lk bf16", lambda: lk.grouped_matmul(a, b, offsets, ids)),
        ("gluon bf16", lambda: bf16_grouped_matmul_gluon(a, b, offsets, ids, out)),
        ("gluon bf16 4 stages, pointer stores", lambda: bf16_grouped_matmul_gluon(a, b, offsets, ids, out, 4, False)),
        ("gluon bf16 m64n256, 4 stages", lambda: wide_gluon(a, b, offsets, ids, out, 4, False)),
    ):
        times[label] = graph_time_us(fn)
        cells.append(f"{label} {times[label]:.1f} us {flops / times[label] / 1e6:.0f} TF")
    ratio = times["_grouped_mm"] / times["gluon bf16"]
    ours = times["lk bf16"] / times["gluon bf16"]
    return (
        f"| {name} | {' | '.join(cells)} | {ratio:.2f}x _grouped_mm | {ours:.2f}x lk bf16 | err vs peer {error:.1e} |"
    )


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        what = sys.argv[2]
        print(check(what == "check-wide") if what.startswith("check") else time_shape(what), flush=True)
        return
    lines = ["# lab/gluon_bf16 on the GPU", ""]
    for what in ["check", "check-wide", *SHAPES]:
        try:
            done = subprocess.run(
                [sys.executable, __file__, "--child", what], capture_output=True, text=True, timeout=120
            )
            text = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else done.stderr[-600:]
        except subprocess.TimeoutExpired:
            text = f"{what}: hang/timeout"
        print(text, flush=True)
        lines.append(text)
        if what.startswith("check") and "ok" not in text.split("(")[0]:
            break
    with open(sys.argv[1], "w") as handle:
        handle.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
