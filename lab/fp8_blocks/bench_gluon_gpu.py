"""GPU check and benchmark of the Gluon FP8-block grouped matmul (gluon_kernel.py) on an H100 (one run, < 3 min).

    PYTHONPATH=src python lab/fp8_blocks/bench_gluon_gpu.py OUT.md [--budget-s 200] [--shapes PREFIX,...]
        [--configs 0,3,...]

1. Correctness first, every Gluon config (each in try/except: a config that fails to compile or run is reported with
   its error and the run goes on):
   * ragged small cases against the float64 oracle: groups of 0, 1, 130, 77 rows and a -1 group (exact zeros),
     E = 3, N = 192 (a partial n-tile, a 256-wide tile's second half wholly past N), K = 320 (K % 128 != 0) and
     K = 200 (K % 16 != 0: the launcher's padded copy), with and without expert_scales; 13 rows past
     ``a_offsets[G]`` poisoned with NaN must stay NaN;
   * the bench shapes on 3 groups each (out poisoned with NaN before the call).
   Bound: relative error <= 3e-3 Frobenius and <= 1e-2 max (bf16 output, round to nearest: ~1.7e-3 expected).
2. Timings (CUDA-graph replay, median; bench_gpu.py's method) of the Gluon configs that passed, beside the Triton
   prototype (its default and best H100 configs), ``torch._scaled_grouped_mm`` fp8 rowwise and cuBLAS's dense
   block-scaled ``F.scaled_mm`` on the same total work. Also each Gluon config's compiled registers, spills, shared
   memory and wgmma kind as compiled on this machine.
Writes the tables to OUT.md after every shape (a run cut short leaves what it had).
"""
from __future__ import annotations

import argparse
import math
import os
import re
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch
import triton
from bench_gpu import (
    Problem,
    Shape,
    copy_bandwidth_gbs,
    graph_time_us,
    peer_dense_blockwise,
    peer_scaled_grouped_mm,
)
from gluon_kernel import ABLATION_CONFIGS, DEFAULT_CONFIG, GluonFp8Config, fp8_block_grouped_matmul_gluon
from kernel import COMPUTE_CONFIG, Fp8BlockConfig, fp8_block_grouped_matmul
from quantize import quantize_fp8_blocks, reference_grouped_matmul, relative_errors

START = time.perf_counter()
TOLERANCE = (3e-3, 1e-2)
SHAPES = [
    Shape("E8x2048 N4096 K7168", 8, 2048, 4096, 7168, "compute"),
    Shape("DSv3-down E16x4096 N7168 K2048", 16, 4096, 7168, 2048, "compute"),
    Shape("DSv3-down E256x256 N7168 K2048", 256, 256, 7168, 2048, "compute"),
]
GLUON_CONFIGS = ABLATION_CONFIGS  # gluon_kernel.py: the first run's kernel first, then one change per step
TRITON_CONFIGS = [COMPUTE_CONFIG, Fp8BlockConfig(128, 256, 8, 3, split_n=2)]


def log(message: str) -> None:
    print(f"[{time.perf_counter() - START:6.1f}s] {message}", flush=True)


def short(error: BaseException, limit: int = 300) -> str:
    return f"{type(error).__name__}: {str(error)[:limit]}".replace("\n", " ").replace("|", "/")


def compiled_report(config: GluonFp8Config) -> str:
    """Registers / spills / smem / wgmma kinds of this config's last launched kernel."""
    from gluon_kernel import LAST_COMPILED
    compiled = LAST_COMPILED.get(config)
    if compiled is None:
        return "?"
    try:
        kinds = sorted(set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+\.\w+\.\w+\.\w+)",
                                      compiled.asm["ptx"])))
        stores = sorted(set(re.findall(r"\b(st\.global[.\w]*|cp\.async\.bulk\.tensor\.\dd\.global\.shared)",
                                       compiled.asm["ptx"])))
        return (f"regs {getattr(compiled, 'n_regs', '?')}, spills {getattr(compiled, 'n_spills', '?')}, "
                f"smem {compiled.metadata.shared}, {','.join(kinds)}, stores {'+'.join(stores)}")
    except Exception as error:  # noqa: BLE001 - a report, not a result
        return f"(no report: {short(error, 80)})"


# ------------------------------------------------------------------------------------------------ correctness


def ragged_case(k: int, with_scales: bool, seed: int = 1):
    """Groups of 0, 1, 130, 77 rows and a -1 group of 9, E = 3, N = 192; 13 extra rows past a_offsets[G]."""
    torch.manual_seed(seed)
    sizes, ids = [0, 1, 130, 77, 9], [1, 0, 2, 1, -1]
    extra, e, n = 13, 3, 192
    t = sum(sizes) + extra
    x = torch.randn(t, k, device="cuda")
    w = torch.randn(e, n, k, device="cuda") * k**-0.5
    a, a_scales = quantize_fp8_blocks(x, (1, 128))
    b, b_scales = quantize_fp8_blocks(w, (128, 128))
    offsets = torch.tensor([0] + list(torch.tensor(sizes).cumsum(0)), dtype=torch.int32, device="cuda")
    expert_ids = torch.tensor(ids, dtype=torch.int32, device="cuda")
    expert_scales = torch.tensor([0.5, 2.0, 1.25], device="cuda") if with_scales else None
    reference = reference_grouped_matmul(a, a_scales, b, b_scales, offsets, expert_ids, expert_scales)
    return a, a_scales, b, b_scales, offsets, expert_ids, expert_scales, reference, sum(sizes)


def check_ragged(config: GluonFp8Config) -> str:
    notes = []
    for k, with_scales in ((320, False), (320, True), (200, False)):
        a, a_scales, b, b_scales, offsets, ids, scales, reference, end = ragged_case(k, with_scales)
        out = torch.full((a.shape[0], b.shape[1]), float("nan"), dtype=torch.bfloat16, device="cuda")
        fp8_block_grouped_matmul_gluon(a, a_scales, b, b_scales, offsets, ids, scales, out=out, config=config)
        if config.stream_k:  # twice: the second call checks that the first left the workspace zeroed
            out[:end].fill_(float("nan"))
            fp8_block_grouped_matmul_gluon(a, a_scales, b, b_scales, offsets, ids, scales, out=out, config=config)
        torch.cuda.synchronize()
        fro, worst = relative_errors(out, reference)
        zero_start = int(offsets[4])
        zeros_ok = bool((out[zero_start:end] == 0).all())
        untouched = bool(torch.isnan(out[end:]).all())
        ok = fro <= TOLERANCE[0] and worst <= TOLERANCE[1] and zeros_ok and untouched
        notes.append(f"K{k}{' scales' if with_scales else ''} {fro:.1e}/{worst:.1e}"
                     f"{'' if zeros_ok else ' NONZERO -1 rows'}{'' if untouched else ' TOUCHED rows past end'}"
                     f"{'' if ok else ' FAIL'}")
    return "; ".join(notes)


# ------------------------------------------------------------------------------------------------ timing


def run_shape(shape: Shape, budget_s: float, broken: set, selected: list) -> list[str]:
    log(f"{shape.name}: building operands")
    problem = Problem(shape)
    lines = [f"\n## {shape.name} ({problem.tokens} tokens, {problem.flops / 1e12:.3f} TFLOP)\n",
             f"Correctness: float64 reference on groups {problem.groups} (bf16 output, out poisoned with NaN).\n",
             "| system | config | compiled (this GPU) | rel. err Frobenius / max | µs | TFLOP/s | vs _scaled_grouped_mm "
             "fp8 | vs dense cuBLAS blockwise | vs Triton prototype default |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    rows = []
    times = {}

    def timed(system, label, fn, compiled="", check=True):
        try:
            error = ""
            if check:
                problem.out.fill_(float("nan"))
                fn()
                torch.cuda.synchronize()
                fro, worst = relative_errors(problem.out, problem.reference)
                error = f"{fro:.2e} / {worst:.2e}"
                if not (fro <= TOLERANCE[0] and worst <= TOLERANCE[1]):
                    rows.append((system, label, compiled, f"FAIL {error}", float("nan")))
                    log(f"  {system} {label}: FAIL {error}")
                    return
            us = graph_time_us(fn)
            if check and system == "Gluon":  # again after the graph replays (stream-K: the workspace's reset)
                problem.out.fill_(float("nan"))
                fn()
                torch.cuda.synchronize()
                fro, worst = relative_errors(problem.out, problem.reference)
                if not (fro <= TOLERANCE[0] and worst <= TOLERANCE[1]):
                    error += f"; FAIL after timing {fro:.2e} / {worst:.2e}"
            times[(system, label)] = us
            rows.append((system, label, compiled, error, us))
            log(f"  {system} {label}: {us:.1f} µs {error} {compiled}")
        except Exception as error:  # noqa: BLE001 - a failing system is a result
            rows.append((system, label, "", f"error: {short(error)}", float("nan")))
            log(f"  {system} {label}: {short(error, 2000)}")
            traceback.print_exc()

    timed("torch._scaled_grouped_mm fp8 rowwise", "", peer_scaled_grouped_mm(problem), check=False)
    try:
        dense, note = peer_dense_blockwise(problem)
        timed("F.scaled_mm dense 1x128/128x128 (cuBLAS)", note, dense, check=False)
    except Exception as error:  # noqa: BLE001
        rows.append(("F.scaled_mm dense (cuBLAS)", f"unavailable: {short(error)}", "", "", float("nan")))
    for index, config in enumerate(TRITON_CONFIGS):
        timed("Triton prototype", config.label + (" (default)" if index == 0 else ""),
              lambda config=config: fp8_block_grouped_matmul(problem.a, problem.a_scales, problem.b, problem.b_scales,
                                                             problem.offsets, problem.ids, out=problem.out,
                                                             config=config))
    for index, config in enumerate(GLUON_CONFIGS):
        if config in broken or config not in selected:
            rows.append(("Gluon", config.label, "", "skipped: failed the ragged check" if config in broken
                         else "not selected (--configs)", float("nan")))
            continue
        if index > 0 and config != DEFAULT_CONFIG and time.perf_counter() - START > budget_s:
            rows.append(("Gluon", config.label, "", "skipped: time budget", float("nan")))
            continue

        def fn(config=config):
            return fp8_block_grouped_matmul_gluon(problem.a, problem.a_scales, problem.b, problem.b_scales,
                                                  problem.offsets, problem.ids, out=problem.out, config=config)
        try:
            fn()
            torch.cuda.synchronize()
            compiled = compiled_report(config)
        except Exception:  # noqa: BLE001 - timed() below reports the error
            compiled = ""
        tag = " (first run's default)" if index == 0 else (" (new default)" if config == DEFAULT_CONFIG else "")
        timed("Gluon", config.label + tag, fn, compiled)

    scaled = times.get(("torch._scaled_grouped_mm fp8 rowwise", ""))
    dense = next((us for (system, _), us in times.items() if system.startswith("F.scaled_mm")), None)
    proto = next((us for (system, label), us in times.items() if label.endswith("(default)")
                  and system == "Triton prototype"), None)

    def ratio(us, base):
        return f"{base / us:.2f}x" if base and not math.isnan(us) else "-"

    for system, label, compiled, error, us in rows:
        tflops = f"{problem.flops / us / 1e6:.0f}" if not math.isnan(us) else "-"
        lines.append(f"| {system} | {label.replace('|', '/')} | {compiled} | {error} | {us:.1f} | {tflops} | "
                     f"{ratio(us, scaled)} | {ratio(us, dense)} | {ratio(us, proto)} |")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--budget-s", type=float, default=200.0, help="stop timing extra configs after this")
    parser.add_argument("--shapes", default="", help="comma-separated prefixes of shape names (default: all)")
    parser.add_argument("--configs", default="", help="comma-separated indices into GLUON_CONFIGS (default: all)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 1
    device = torch.cuda.get_device_name(0)
    copy_gbs = copy_bandwidth_gbs()
    lines = [f"# Gluon FP8-block grouped matmul (lab/fp8_blocks/gluon_kernel.py), {device}",
             f"\ntorch {torch.__version__}, Triton {triton.__version__}, CUDA {torch.version.cuda}; copy bandwidth "
             f"{copy_gbs:.0f} GB/s. CUDA-graph replay, median. FP8 dense peak (spec) 1979 TFLOP/s.",
             "\n## Correctness: ragged cases (groups 0, 1, 130, 77 rows and a -1 group of 9; E=3, N=192; "
             "13 NaN rows past a_offsets[G])\n",
             "| config | K=320 / K=320 + expert_scales / K=200 (padded copy): Frobenius/max error |",
             "| --- | --- |"]
    broken = set()
    selected = ([GLUON_CONFIGS[int(i)] for i in args.configs.split(",") if i] if args.configs else list(GLUON_CONFIGS))
    for config in selected:
        try:
            note = check_ragged(config)
            if "FAIL" in note or "NONZERO" in note or "TOUCHED" in note:
                broken.add(config)
        except Exception as error:  # noqa: BLE001 - compile errors included: print them whole
            note = f"error: {short(error)}"
            broken.add(config)
            log(f"ragged {config.label}: {short(error, 4000)}")
            traceback.print_exc()
        lines.append(f"| {config.label} | {note} |")
        log(f"ragged {config.label}: {note}")
    wanted = [s for s in args.shapes.split(",") if s]
    for shape in SHAPES:
        if wanted and not any(shape.name.startswith(w) for w in wanted):
            continue
        try:
            lines += run_shape(shape, args.budget_s, broken, selected)
            torch.cuda.empty_cache()
        except torch.OutOfMemoryError as error:
            lines.append(f"\n## {shape.name}\n\nout of memory: {short(error)}")
            torch.cuda.empty_cache()
        with open(args.out, "w") as file:
            file.write("\n".join(lines) + "\n")
    lines.append(f"\nTotal time {time.perf_counter() - START:.0f} s.")
    with open(args.out, "w") as file:
        file.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
