"""GPU check and benchmark of the w4a8 grouped matmul prototype (MXFP4 weights on the FP8 tensor cores), one run.

    PYTHONPATH=src:lab/w4a8 python lab/w4a8/bench_gpu.py OUT_DIR [--budget-s 200] [--shapes NAME,...] [--dry-run]

1. Correctness first: a small ragged problem (empty group, 1 row, 37 rows, an expert id of -1, rows outside every
   group poisoned with NaN and checked unchanged; K 384 and 352; weight exponents spread by 0, 3 and 11 within a
   128-K block, the last taking the exact four-dot branch) on the first two configs of each sweep, bf16 output;
   then each bench shape on three groups, every config before it is timed. Against the float64 product of
   ``llmkernels.dequantize`` of both operands; bound (GPU fp8 MMA accumulation, bf16 output): relative Frobenius
   3e-3, max 1e-2. A config that fails is reported FAIL and not timed.
2. CUDA-graph replay timings (median, ``graph_time_us`` of lab/fp8_blocks/bench_gpu.py) per shape of: ours over
   ``kernel.SWEEPS`` (first = default), ``torch._grouped_mm`` bf16, the library's bf16 x MXFP4 Hopper-layout path
   (``llmkernels.grouped_matmul`` of bf16 activations and ``quantize(w, "mxfp4", scale_layout="hopper")``), the
   library's FP8-blocks path on the same FP8 activations (weights ``quantize(w, "fp8", block=(128, 128))``), and
   the activation quantize ``quantize(x, "fp8", block=(1, 128))`` on its own (ours and the FP8-blocks path need it
   in a layer; the "+ quantize" column adds it). On the compute shape also ours on weights whose every 128-K block
   spreads by 9 (the checking loop and its four-dot branch everywhere: the worst case).

Writes OUT_DIR/w4a8.md and OUT_DIR/w4a8.csv (µs, TFLOP/s, ratios), after every shape. Written for torch 2.11 and
Triton 3.6. ``--dry-run``: the same logic on the CPU through the Triton interpreter at tiny shapes (no graphs).
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import math
import os
import re
import sys
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ["TRITON_INTERPRET"] = "1" if "--dry-run" in sys.argv else os.environ.get("TRITON_INTERPRET", "0")

import torch
import triton
from kernel import SWEEPS, W4A8Config, plan_launch, w4a8_grouped_matmul, w4a8_grouped_matmul_kernel

import llmkernels as lk

HERE = os.path.dirname(os.path.abspath(__file__))


def _load_fp8_blocks_bench():
    """lab/fp8_blocks/bench_gpu.py as a module (its timing helpers); it imports its own ``kernel`` and ``quantize``
    modules by those names, so ours are set aside while it loads."""
    folder = os.path.join(os.path.dirname(HERE), "fp8_blocks")
    saved = {name: sys.modules.pop(name) for name in ("kernel", "quantize") if name in sys.modules}
    spec = importlib.util.spec_from_file_location("fp8_blocks_bench_gpu", os.path.join(folder, "bench_gpu.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (its dataclasses look their module up there)
    try:
        spec.loader.exec_module(module)
    finally:
        for name in ("kernel", "quantize"):
            sys.modules.pop(name, None)
        sys.modules.update(saved)
        while folder in sys.path:
            sys.path.remove(folder)
    return module


FP8_BENCH = _load_fp8_blocks_bench()
graph_time_us, copy_bandwidth_gbs, log = FP8_BENCH.graph_time_us, FP8_BENCH.copy_bandwidth_gbs, FP8_BENCH.log
DEVICE = "cuda"
TOLERANCE = (3e-3, 1e-2)  # (Frobenius, max) relative error: GPU fp8 MMA accumulation, bf16 output
DRY_RUN_TOLERANCE = (5e-3, 1e-2)  # the interpreter truncates fp32 -> bf16


@dataclass(frozen=True)
class Shape:
    name: str
    experts: int
    tokens_per_expert: int
    n: int
    k: int
    regime: str  # "compute" or "decode": which sweep


SHAPES = [  # the most important first: a run that hits the budget still times every default
    Shape("E8x2048 N4096 K7168", 8, 2048, 4096, 7168, "compute"),
    Shape("decode E128x16 N4096 K7168", 128, 16, 4096, 7168, "decode"),
    Shape("E128x128 N4096 K7168", 128, 128, 4096, 7168, "compute"),
    Shape("gpt-oss E32x512 N5760 K2880", 32, 512, 5760, 2880, "compute"),
]


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def relative_errors(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    diff = out.double() - ref
    return (diff.norm() / ref.norm()).item(), (diff.abs().max() / ref.abs().max()).item()


def expert_slice(w: lk.ScaledTensor, expert: int) -> lk.ScaledTensor:
    return lk.ScaledTensor(w.data[expert], w.scales[expert], "mxfp4")


def reference_rows(a_q, w_q, rows: slice, expert: int) -> torch.Tensor:
    """float64 ``A[rows] @ W[expert]ᵀ`` of the dequantized operands."""
    a = lk.dequantize(lk.ScaledTensor(a_q.data[rows], a_q.scales[rows], "fp8", block=(1, 128))).double()
    return a @ lk.dequantize(expert_slice(w_q, expert)).double().T


def spread_weights(experts, n, k, spread, generator=None) -> torch.Tensor:
    """bf16 ``[E, N, K]`` ~ N(0, 1/K) whose 32-wide blocks are scaled by 2^-s, s in [0, spread] with s = 0 and
    s = spread in every 128-K block (the spread is reached)."""
    w = torch.randn(experts, n, k, device=DEVICE, generator=generator) * k**-0.5
    blocks = -(-k // 128) * 4
    shifts = torch.randint(0, spread + 1, (experts, n, blocks), device=DEVICE, generator=generator).float()
    shifts[..., ::4], shifts[..., 1::4] = 0, spread
    return (w * torch.exp2(-shifts[..., : k // 32]).repeat_interleave(32, -1)).to(torch.bfloat16)


def small_ragged_check(configs) -> list[str]:
    """The small ragged problem on each of ``configs``, bf16 output; table rows."""
    lines = [
        "\n## Small ragged check (bf16 output, groups [0, 1, 37, 20, 6, 130] rows, experts [1, 2, 0, -1, 2, 1], "
        "7 rows outside every group)\n",
        "| K | spread | config | rel. err Frobenius / max | outside rows kept | verdict |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    generator = torch.Generator(device=DEVICE).manual_seed(1)
    rows, ids = [0, 1, 37, 20, 6, 130], [1, 2, 0, -1, 2, 1]
    offsets = torch.tensor([0] + list(torch.tensor(rows).cumsum(0)), dtype=torch.int32, device=DEVICE)
    expert_ids = torch.tensor(ids, dtype=torch.int32, device=DEVICE)
    tokens = sum(rows) + 7
    tolerance = TOLERANCE if DEVICE == "cuda" else DRY_RUN_TOLERANCE
    for k in (384, 352):
        x = torch.randn(tokens, k, device=DEVICE, generator=generator)
        a_q = lk.quantize(x, "fp8", block=(1, 128))
        for spread in (0, 3, 11):
            w_q = lk.quantize(spread_weights(3, 256, k, spread, generator).float(), "mxfp4")
            ref = torch.zeros(tokens, 256, dtype=torch.float64, device=DEVICE)
            for g, e in enumerate(ids):
                if e >= 0 and rows[g]:
                    span = slice(int(offsets[g]), int(offsets[g + 1]))
                    ref[span] = reference_rows(a_q, w_q, span, e)
            inside = slice(0, sum(rows))
            for config in configs:
                out = torch.full((tokens, 256), float("nan"), device=DEVICE, dtype=torch.bfloat16)
                try:
                    w4a8_grouped_matmul(a_q, w_q, offsets, expert_ids, out=out, config=config)
                    sync()
                except Exception as error:  # noqa: BLE001 - a failing config is a result
                    lines.append(
                        f"| {k} | {spread} | {config.label} | {type(error).__name__}: {str(error)[:150]} | | FAIL |"
                    )
                    continue
                kept = bool(torch.isnan(out[sum(rows) :]).all())
                fro, worst = relative_errors(out[inside].nan_to_num(1e30), ref[inside])
                ok = kept and fro <= tolerance[0] and worst <= tolerance[1]
                lines.append(
                    f"| {k} | {spread} | {config.label} | {fro:.2e} / {worst:.2e} | {kept} | {'ok' if ok else 'FAIL'} |"
                )
                log(f"  small K{k} spread {spread} {config.label}: {fro:.2e} / {worst:.2e}, kept {kept}")
    return lines


class Problem:
    """One shape's operands: bf16 originals, FP8 activations, MXFP4 weights (row and Hopper layouts), FP8-block
    weights, metadata and the float64 reference on three groups."""

    def __init__(self, shape: Shape, spread: int | None = None):
        self.shape = shape
        e, n, k = shape.experts, shape.n, shape.k
        self.tokens = t = e * shape.tokens_per_expert
        generator = torch.Generator(device=DEVICE).manual_seed(0)
        self.x = torch.randn(t, k, device=DEVICE, generator=generator).to(torch.bfloat16)
        chunks = [min(8, e - first) for first in range(0, e, 8)]  # a few experts at a time: fp32 temporaries
        if spread is None:
            self.w = torch.cat(
                [
                    (torch.randn(c, n, k, device=DEVICE, generator=generator) * k**-0.5).to(torch.bfloat16)
                    for c in chunks
                ]
            )
        else:
            self.w = torch.cat([spread_weights(c, n, k, spread, generator) for c in chunks])
        self.a_q = lk.quantize(self.x, "fp8", block=(1, 128))
        self.w_q = lk.quantize(self.w, "mxfp4")
        self.offsets = torch.arange(e + 1, device=DEVICE, dtype=torch.int32) * shape.tokens_per_expert
        self.ids = torch.arange(e, device=DEVICE, dtype=torch.int32)
        self.out = torch.empty(t, n, device=DEVICE, dtype=torch.bfloat16)
        self.groups = sorted({0, e // 2, e - 1})
        self.reference = {
            g: reference_rows(
                self.a_q, self.w_q, slice(g * shape.tokens_per_expert, (g + 1) * shape.tokens_per_expert), g
            )
            for g in self.groups
        }
        self.flops = 2.0 * t * n * k

    def errors(self, out: torch.Tensor) -> tuple[float, float]:
        per = self.shape.tokens_per_expert
        got = torch.cat([out[g * per : (g + 1) * per] for g in self.groups])
        want = torch.cat([self.reference[g] for g in self.groups])
        return relative_errors(got.nan_to_num(1e30), want)


def compiled_report(problem: Problem, config: W4A8Config) -> str:
    """Registers, spills, shared memory and wgmma kinds of the kernel this config compiles to here."""
    if DEVICE == "cpu":
        return "interpreter"
    grid, arguments, constexprs, options = plan_launch(
        problem.a_q, problem.w_q, problem.offsets, problem.ids, problem.out, config
    )
    kernel = w4a8_grouped_matmul_kernel[grid](**arguments, **constexprs, **options)  # one launch: the compiled kernel
    ptx = kernel.asm["ptx"]
    kinds = sorted(set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+\.\w+\.\w+\.\w+)", ptx)))
    return (
        f"regs {getattr(kernel, 'n_regs', '?')}, spills {getattr(kernel, 'n_spills', '?')}, "
        f"smem {kernel.metadata.shared}, {','.join(kinds) or 'no wgmma'}"
    )


def peers(problem: Problem) -> dict:
    """name -> callable of the peers (built lazily: each may raise, reported as unavailable)."""
    w_t = problem.w.transpose(-2, -1)
    made = {}

    def hopper_mxfp4():
        w_h = made.setdefault("w_h", lk.quantize(problem.w, "mxfp4", scale_layout="hopper"))
        return lambda: lk.grouped_matmul(problem.x, w_h, problem.offsets, problem.ids, out=problem.out)

    def fp8_blocks():
        w_f = made.setdefault("w_f", lk.quantize(problem.w, "fp8", block=(128, 128)))
        return lambda: lk.grouped_matmul(problem.a_q, w_f, problem.offsets, problem.ids, out=problem.out)

    return {
        "torch._grouped_mm bf16": lambda: (
            lambda: torch._grouped_mm(problem.x, w_t, offs=problem.offsets[1:], out_dtype=torch.bfloat16)
        ),
        "lk bf16 x mxfp4 (hopper layout)": hopper_mxfp4,
        "lk fp8 blocks (same fp8 activations)": fp8_blocks,
        "lk.quantize activations fp8 (1,128)": lambda: lambda: lk.quantize(problem.x, "fp8", block=(1, 128)),
    }


PEER_BASES = ("torch._grouped_mm bf16", "lk bf16 x mxfp4 (hopper layout)", "lk fp8 blocks (same fp8 activations)")
QUANTIZE = "lk.quantize activations fp8 (1,128)"


def run_shape(shape: Shape, budget_s: float, worst_case: bool) -> tuple[list[str], list[dict]]:
    log(f"{shape.name}: building operands")
    problem = Problem(shape)
    tolerance = TOLERANCE if DEVICE == "cuda" else DRY_RUN_TOLERANCE
    rows = []  # dicts: system, config, compiled, error, us, needs_quantize

    times = {}
    for name, make in peers(problem).items():
        try:
            fn = make()
            if name != QUANTIZE:  # the peers' own accuracy on the same groups (informative, not a gate)
                problem.out.fill_(float("nan"))
                result = fn()
                sync()
                fro, worst = problem.errors(result)
                error = f"{fro:.2e} / {worst:.2e}"
            else:
                error = ""
            us = graph_time_us(fn)
            times[name] = us
            rows.append(
                dict(system=name, config="", compiled="", error=error, us=us, quantize=name.startswith("lk fp8"))
            )
            log(f"  {name}: {us:.1f} µs {error}")
        except Exception as error:  # noqa: BLE001 - a failing peer is a result
            rows.append(
                dict(
                    system=name,
                    config="",
                    compiled="",
                    error=f"unavailable: {type(error).__name__}: {str(error)[:200]}",
                    us=float("nan"),
                    quantize=False,
                )
            )
            log(f"  {name}: unavailable ({type(error).__name__}: {str(error)[:200]})")

    def time_ours(prob: Problem, config: W4A8Config, label: str):
        try:
            compiled = compiled_report(prob, config)
            prob.out.fill_(float("nan"))
            w4a8_grouped_matmul(prob.a_q, prob.w_q, prob.offsets, prob.ids, out=prob.out, config=config)
            sync()
            fro, worst = prob.errors(prob.out)
            error = f"{fro:.2e} / {worst:.2e}"
            if not (fro <= tolerance[0] and worst <= tolerance[1]):
                rows.append(
                    dict(
                        system="ours",
                        config=label,
                        compiled=compiled,
                        error=f"FAIL {error}",
                        us=float("nan"),
                        quantize=True,
                    )
                )
                log(f"  ours {label}: FAIL {error}")
                return
            us = graph_time_us(
                lambda: w4a8_grouped_matmul(prob.a_q, prob.w_q, prob.offsets, prob.ids, out=prob.out, config=config)
            )
            rows.append(dict(system="ours", config=label, compiled=compiled, error=error, us=us, quantize=True))
            log(f"  ours {label}: {us:.1f} µs, error {error}, {compiled}")
        except Exception as error:  # noqa: BLE001 - a failing config is a result
            rows.append(
                dict(
                    system="ours",
                    config=label,
                    compiled="",
                    error=f"error: {type(error).__name__}: {str(error)[:200]}",
                    us=float("nan"),
                    quantize=True,
                )
            )
            log(f"  ours {label}: {type(error).__name__}: {str(error)[:300]}")

    for index, config in enumerate(SWEEPS[shape.regime]):
        if index > 0 and FP8_BENCH.elapsed() > budget_s:
            rows.append(
                dict(
                    system="ours",
                    config=config.label,
                    compiled="",
                    error="skipped: time budget",
                    us=float("nan"),
                    quantize=True,
                )
            )
            continue
        time_ours(problem, config, config.label + (" (default)" if index == 0 else ""))
    if worst_case and FP8_BENCH.elapsed() <= budget_s:
        del problem
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
        problem = Problem(shape, spread=9)
        time_ours(problem, SWEEPS[shape.regime][0], SWEEPS[shape.regime][0].label + " [every block spread 9]")

    lines = [
        f"\n## {shape.name} ({shape.regime}; {problem.tokens} tokens, {problem.flops / 1e12:.3f} TFLOP)\n",
        f"Correctness: float64 product of the w4a8 operands (fp8 activations, mxfp4 weights) on groups "
        f"{problem.groups}, bf16 output; the peers quantize differently (bf16 activations, fp8 weights), so their "
        "errors against it are informative, not a gate. "
        f"Activation quantize: {times.get(QUANTIZE, float('nan')):.1f} µs.\n",
        "| system | config | compiled (this GPU) | rel. err Frobenius / max | µs | TFLOP/s | µs + quantize | "
        + " | ".join(f"vs {name}" for name in PEER_BASES)
        + " | vs _grouped_mm, both + quantize |",
        "| --- " * (8 + len(PEER_BASES)) + "|",
    ]
    records = []
    quantize_us = times.get(QUANTIZE, float("nan"))
    for row in rows:
        us = row["us"]
        timed = not math.isnan(us)
        total = us + quantize_us if row["quantize"] else us
        ratios = [f"{times[b] / us:.2f}x" if timed and b in times else "-" for b in PEER_BASES]
        base = times.get(PEER_BASES[0])
        with_quantize = f"{base / total:.2f}x" if timed and base and not math.isnan(total) else "-"
        tflops = problem.flops / us / 1e6 if timed and row["system"] != QUANTIZE else float("nan")
        error = row["error"].replace("|", "/")
        lines.append(
            f"| {row['system']} | {row['config']} | {row['compiled']} | {error} | {us:.1f} | {tflops:.0f} | "
            f"{total:.1f} | " + " | ".join(ratios) + f" | {with_quantize} |"
        )
        records.append(
            dict(
                shape=shape.name,
                system=row["system"],
                config=row["config"],
                error=row["error"],
                us=f"{us:.2f}",
                tflops=f"{tflops:.1f}",
                us_with_quantize=f"{total:.2f}",
                **{f"ratio_vs_{b}": r for b, r in zip(PEER_BASES, ratios)},
            )
        )
    del problem
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    return lines, records


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", help="folder for w4a8.md and w4a8.csv")
    parser.add_argument("--shapes", default="", help="comma-separated prefixes of shape names (default: all)")
    parser.add_argument(
        "--budget-s",
        type=float,
        default=200.0,
        help="stop timing new configs (beyond each shape's default) after this many seconds",
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="check the script's logic on the CPU: Triton interpreter, tiny shapes, no graphs",
    )
    args = parser.parse_args()
    global DEVICE, SHAPES
    if args.dry_run:
        DEVICE = FP8_BENCH.DEVICE = "cpu"
        SHAPES = [
            Shape("dry compute E3x40 N128 K352", 3, 40, 128, 352, "compute"),
            Shape("dry decode E4x2 N64 K256", 4, 2, 64, 256, "decode"),
        ]
        for name in SWEEPS:
            SWEEPS[name] = [
                W4A8Config(c.block_m if c.swap_ab else 32, 64, 4, 1, c.swap_ab, c.tile_reference)
                for c in SWEEPS[name][:2]
            ]
    elif not torch.cuda.is_available():
        print("needs a CUDA GPU (or --dry-run)")
        return 1
    os.makedirs(args.out_dir, exist_ok=True)
    wanted = [s for s in args.shapes.split(",") if s]
    shapes = [s for s in SHAPES if not wanted or any(s.name.startswith(w) for w in wanted)]
    device = torch.cuda.get_device_name(0) if DEVICE == "cuda" else "CPU dry run (interpreter)"
    copy_gbs = copy_bandwidth_gbs()
    lines = [
        f"# w4a8 grouped matmul prototype (lab/w4a8), {device}",
        f"\ntorch {torch.__version__}, Triton {triton.__version__}, CUDA {torch.version.cuda}; copy bandwidth "
        f"{copy_gbs:.0f} GB/s (same run). CUDA-graph replay, median µs. 'µs + quantize': the FP8-activation "
        "systems plus the activation quantize they need; ratios > 1: ours faster.",
    ]
    log(f"{device}: copy {copy_gbs:.0f} GB/s")
    # the first two of each sweep (default, tile_reference): each config of the small check is one more compile
    lines += small_ragged_check(list(dict.fromkeys(c for configs in SWEEPS.values() for c in configs[:2])))
    records = []
    md, csv_path = os.path.join(args.out_dir, "w4a8.md"), os.path.join(args.out_dir, "w4a8.csv")
    for index, shape in enumerate(shapes):
        try:
            shape_lines, shape_records = run_shape(shape, args.budget_s, worst_case=index == 0)
            lines += shape_lines
            records += shape_records
        except torch.OutOfMemoryError as error:
            lines.append(f"\n## {shape.name}\n\nout of memory: {str(error)[:200]}")
            torch.cuda.empty_cache()
        with open(md, "w") as file:  # after every shape: a partial run still leaves its tables
            file.write("\n".join(lines) + "\n")
        if records:
            with open(csv_path, "w", newline="") as file:
                writer = csv.DictWriter(file, fieldnames=list(records[0]))
                writer.writeheader()
                writer.writerows(records)
    lines.append(f"\nTotal time {FP8_BENCH.elapsed():.0f} s.")
    with open(md, "w") as file:
        file.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
