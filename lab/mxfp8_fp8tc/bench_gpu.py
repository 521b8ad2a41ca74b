"""GPU check and benchmark of the Gluon MXFP8 x MXFP8 grouped matmul (gluon_kernel.py) on an H100 (one run, ~4 min).

    PYTHONPATH=src:lab/mxfp8_fp8tc python lab/mxfp8_fp8tc/bench_gpu.py OUT_DIR [--budget-s 240] [--timeout-s 90]
        [--gluon 0,1,...] [--shapes PREFIX,...] [--dry-run]

A Gluon deadlock hangs its process, so every (system, case) runs in a child process with a timeout
(``--timeout-s``): a child that does not finish is recorded "hang/timeout" and the run goes on.

1. Correctness first, each Gluon config of :data:`GLUON_CONFIGS` and the Triton prototype (kernel.py
   ``mxfp8_grouped_matmul``): ragged groups of 0, 1, 130, 77 rows and a -1 group of 9 rows (must be exact zeros),
   E = 3, N = 384, K = 256 and 512, the 32-blocks' scales spread over 2^±6; 13 rows past ``a_offsets[G]``
   poisoned with NaN must stay NaN; against a float64 product of ``llmkernels.dequantize`` of both operands.
   Bound (bf16 output): relative error <= 3e-3 Frobenius and <= 1e-2 max.
2. Timings (CUDA-graph replay of one call, median of event-timed replays) of the Gluon configs that passed, the
   Triton prototype (configs of results/compile_sm90.md without spills), ``torch._grouped_mm`` bf16 (bf16
   operands of the same shapes) and the library's MXFP8 path ``llmkernels.grouped_matmul(quantize(x, "mxfp8"),
   quantize(w, "mxfp8"), a_offsets, expert_ids)``, at E8x2048 N4096 K7168, E16x4096 N7168 K2048 and E256x256
   N7168 K2048 (balanced groups); every shape's peers and the two default Gluon variants first, the other Gluon
   configs after (the budget cuts those first). Each timed system is also checked on the first and last group
   against the float64 reference. The Gluon kernel's one-time weight conversion (fp32/bf16 column factors) is
   built before timing.
Writes OUT_DIR/mxfp8_fp8tc.md and OUT_DIR/mxfp8_fp8tc.csv after every child (a run cut short leaves what it had).
Past ``--budget-s`` no new child starts.

``--dry-run``: the CPU with TRITON_INTERPRET=1 and tiny shapes, through everything except the Gluon kernel (its
children report "skipped: dry run"), to check the script's logic.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
if "--dry-run" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"

START = time.perf_counter()
TOLERANCE = (3e-3, 1e-2)  # (Frobenius, max) relative error of a bf16 output
DRY_TOLERANCE = (5e-3, 1e-2)  # the interpreter truncates fp32 -> bf16


@dataclass(frozen=True)
class Shape:
    name: str
    experts: int
    tokens_per_expert: int
    n: int
    k: int


SHAPES = [
    Shape("E8x2048 N4096 K7168", 8, 2048, 4096, 7168),
    Shape("E16x4096 N7168 K2048", 16, 4096, 7168, 2048),
    Shape("E256x256 N7168 K2048", 256, 256, 7168, 2048),
]
DRY_SHAPES = [Shape("dry E3x40 N256 K256", 3, 40, 256, 256)]
RAGGED_K = [256, 512]
DRY_RAGGED_K = [256]
# (variant, stages, factors, late, volatile, tie): each variant's least-spilling config of
# results/compile_gluon_sm90.md first (v1: 2.4 KB of spills, v2: 72 B), then v2 options
GLUON_CONFIGS = [
    ("v1", 3, "bf16", True, False, False),
    ("v2", 4, "bf16", False, False, True),
    ("v2", 4, "bf16", False, True, True),
    ("v2", 4, "fp32", False, False, False),
]
# kernel.py configs without spills in results/compile_sm90.md: (block_m, block_n, block_k, warps, stages, rowcol)
TRITON_CONFIGS = [(64, 128, 128, 4, 3, True), (128, 128, 128, 8, 3, False)]


def log(message: str) -> None:
    print(f"[{time.perf_counter() - START:6.1f}s] {message}", flush=True)


# ------------------------------------------------------------------------------------------------ child side


def _device(dry: bool) -> str:
    return "cpu" if dry else "cuda"


def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def graph_time_us(fn, device: str, target_ms: float = 60.0) -> float:
    """Median GPU time (µs) of one replay of a CUDA graph holding one call of ``fn`` (CPU: one timed call)."""
    import torch

    if device == "cpu":
        begin = time.perf_counter()
        fn()
        return 1e6 * (time.perf_counter() - begin)
    fn()
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    graph.replay()
    end.record()
    torch.cuda.synchronize()
    replays = int(min(max(target_ms / max(begin.elapsed_time(end), 1e-3), 5), 200))
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(replays)]
    for first, last in events:
        first.record()
        graph.replay()
        last.record()
    torch.cuda.synchronize()
    times = sorted(first.elapsed_time(last) for first, last in events)
    return 1e3 * times[len(times) // 2]


def relative_errors(out, ref) -> tuple[float, float]:
    diff = out.double() - ref
    return (diff.norm() / ref.norm()).item(), (diff.abs().max() / ref.abs().max()).item()


def make_problem(sizes, ids, extra, experts, n, k, device, spread=True, seed=0):
    """MXFP8 operands (bf16 originals kept), offsets, ids; rows ``sum(sizes):`` belong to no group. Random numbers
    are drawn on ``device`` (the largest weights, E256 N7168 K2048, are 3.8 G elements)."""
    import torch

    import llmkernels

    generator = torch.Generator(device=device).manual_seed(seed)
    t = sum(sizes) + extra
    x = torch.randn(t, k, generator=generator, device=device, dtype=torch.bfloat16)
    w = torch.randn(experts, n, k, generator=generator, device=device, dtype=torch.bfloat16) * k**-0.5
    if spread:  # the 32-blocks' scales spread over 2^±6: a wrong exponent, block or orientation shows
        x = x * torch.exp2(
            torch.randint(-6, 7, (t, k // 32), generator=generator, device=device).to(torch.bfloat16)
        ).repeat_interleave(32, 1)
        w = w * torch.exp2(
            torch.randint(-6, 7, (experts, n, k // 32), generator=generator, device=device).to(torch.bfloat16)
        ).repeat_interleave(32, 2)
    qa, qb = llmkernels.quantize(x, "mxfp8"), llmkernels.quantize(w, "mxfp8")
    offsets = torch.tensor([0] + torch.tensor(sizes).cumsum(0).tolist(), dtype=torch.int32, device=device)
    expert_ids = torch.tensor(ids, dtype=torch.int32, device=device)
    return dict(x=x, w=w, qa=qa, qb=qb, offsets=offsets, ids=expert_ids, sizes=list(sizes), ids_list=list(ids))


def decode(data, scales):
    """float64 of MXFP8 ``data [..., K]`` with e8m0 ``scales [..., K/32]`` (2^(e − 127), e = 0 → 2^-127, 255 → NaN),
    for the operands' rows a reference needs (``llmkernels.dequantize`` of all 3.8 G weights would not fit)."""
    import torch

    e = scales.view(torch.uint8).to(torch.int64)
    factor = torch.where(e == 255, float("nan"), torch.exp2((e - 127).double()))
    return data.double() * factor.repeat_interleave(32, -1)


def reference_rows(problem, groups, plain=False) -> dict:
    """float64 ``A[rows of g] @ B[e]ᵀ`` per group g of ``groups`` (zeros for a bad expert id), of the decoded
    MXFP8 operands, or with ``plain`` of the bf16 originals (the bf16 peer's own reference)."""
    import torch

    qa, qb = problem["qa"], problem["qb"]
    starts = [0] + torch.tensor(problem["sizes"]).cumsum(0).tolist()
    result = {}
    for g in groups:
        rows = slice(starts[g], starts[g + 1])
        e = problem["ids_list"][g]
        if not 0 <= e < problem["w"].shape[0]:
            result[g] = torch.zeros(
                rows.stop - rows.start, problem["w"].shape[1], dtype=torch.float64, device=problem["x"].device
            )
        elif plain:
            result[g] = problem["x"][rows].double() @ problem["w"][e].double().T
        else:
            result[g] = decode(qa.data[rows], qa.scales[rows]) @ decode(qb.data[e], qb.scales[e]).T
    return result


def system_fn(spec: dict, problem: dict, out):
    """The call of ``spec["system"]`` writing into ``out`` (returns a no-argument function)."""
    import torch

    qa, qb, offsets, ids = problem["qa"], problem["qb"], problem["offsets"], problem["ids"]
    system = spec["system"]
    if system == "gluon":
        import gluon_kernel

        config = gluon_kernel.Mxfp8GluonConfig(*spec["config"])
        b_exps = qb.scales.view(torch.uint8)
        b_factors = gluon_kernel.b_exponent_factors(b_exps, config.factor_dtype)  # one-time weight conversion
        a_exps = qa.scales.view(torch.uint8)

        def fn():
            gluon_kernel.mxfp8_grouped_matmul_gluon(
                qa.data, a_exps, qb.data, b_exps, offsets, ids, out=out, config=config, b_factors=b_factors
            )

        return fn
    if system == "triton":
        from kernel import mxfp8_grouped_matmul

        block_m, block_n, block_k, warps, stages, rowcol = spec["config"]

        def fn():
            mxfp8_grouped_matmul(
                qa.data,
                qa.scales,
                qb.data,
                qb.scales,
                offsets,
                ids,
                out=out,
                block_m=block_m,
                block_n=block_n,
                block_k=block_k,
                num_warps=warps,
                num_stages=stages,
                promote_rowcol=rowcol,
            )

        return fn
    if system == "torch._grouped_mm bf16":
        w_t = problem["w"].transpose(-2, -1)
        return lambda: out.copy_(torch._grouped_mm(problem["x"], w_t, offs=offsets[1:], out_dtype=torch.bfloat16))
    if system == "llmkernels mxfp8":
        import llmkernels

        return lambda: llmkernels.grouped_matmul(qa, qb, offsets, ids, out=out)
    raise ValueError(f"system: unknown {system!r}")


def run_child(spec: dict) -> dict:
    """One (system, case): correctness on the ragged case, or a shape's check + timing."""
    import torch

    device = _device(spec["dry"])
    tolerance = DRY_TOLERANCE if spec["dry"] else TOLERANCE
    if spec.get("system") == "gluon" and spec["dry"]:
        return dict(status="skipped: dry run (Gluon has no interpreter)")
    if spec["mode"] == "ragged":
        notes, ok = [], True
        for k in spec["ks"]:
            sizes, ids, extra = [0, 1, 130, 77, 9], [1, 0, 2, 1, -1], 13
            problem = make_problem(sizes, ids, extra, 3, spec["n"], k, device, seed=k)
            out = torch.full((sum(sizes) + extra, spec["n"]), float("nan"), dtype=torch.bfloat16, device=device)
            system_fn(spec, problem, out)()
            _sync(device)
            refs = reference_rows(problem, [1, 2, 3])
            ref = torch.cat([refs[g] for g in (1, 2, 3)])
            got = out[0:208]
            fro, worst = relative_errors(got, ref)
            zeros_ok = bool((out[208:217] == 0).all())
            untouched = bool(torch.isnan(out[217:]).all())
            passed = fro <= tolerance[0] and worst <= tolerance[1] and zeros_ok and untouched
            ok &= passed
            notes.append(
                f"K{k} {fro:.1e}/{worst:.1e}{'' if zeros_ok else ' NONZERO -1 rows'}"
                f"{'' if untouched else ' TOUCHED rows past end'}{'' if passed else ' FAIL'}"
            )
        return dict(status="ok" if ok else "FAIL", note="; ".join(notes))
    shape = Shape(**spec["shape"])
    sizes = [shape.tokens_per_expert] * shape.experts
    problem = make_problem(sizes, list(range(shape.experts)), 0, shape.experts, shape.n, shape.k, device, spread=False)
    out = torch.full((sum(sizes), shape.n), float("nan"), dtype=torch.bfloat16, device=device)
    groups = sorted({0, shape.experts - 1})
    references = {}
    results = []
    for system, config in spec["systems"]:
        one = dict(spec, system=system, config=config)
        try:
            results.append(
                dict(system=system, config=config, **time_one(one, problem, out, groups, references, tolerance, device))
            )
        except Exception as error:  # noqa: BLE001 - a failing system is a result; the others still run
            note = f"{type(error).__name__}: {str(error)[:300]}".replace("\n", " ")
            results.append(dict(system=system, config=config, status="error", note=note))
        print("PARTIAL " + json.dumps(results[-1]), flush=True)
    return dict(results=results)


def time_one(spec, problem, out, groups, references, tolerance, device) -> dict:
    """Check one system on the first and last group, then time it."""
    plain = spec["system"] == "torch._grouped_mm bf16"
    if plain not in references:
        references[plain] = reference_rows(problem, groups, plain=plain)
    tokens = problem["sizes"][0]
    out.fill_(float("nan"))
    fn = system_fn(spec, problem, out)
    fn()
    _sync(device)
    errors = [relative_errors(out[g * tokens : (g + 1) * tokens], references[plain][g]) for g in groups]
    fro, worst = max(e[0] for e in errors), max(e[1] for e in errors)
    note = f"{fro:.2e} / {worst:.2e}" + (" (vs bf16 operands)" if plain else "")
    if not (fro <= tolerance[0] and worst <= tolerance[1]):
        return dict(status="FAIL", note=note)
    us = graph_time_us(fn, device)
    compiled = ""
    if spec["system"] == "gluon":
        import gluon_kernel

        kernel = next(iter(gluon_kernel.LAST_COMPILED.values()), None)
        if kernel is not None:
            compiled = f"regs {getattr(kernel, 'n_regs', '?')}, spills {getattr(kernel, 'n_spills', '?')}"
    return dict(status="ok", note=note, us=us, compiled=compiled)


# ------------------------------------------------------------------------------------------------ parent side


def label(spec: dict) -> str:
    config = spec.get("config")
    if spec["system"] == "gluon":
        variant, stages, factors, late, volatile, tie = config
        extras = (" late" if late else "") + (" volatile" if volatile else "") + (" tie" if tie else "")
        return f"{variant} 128x{256 if variant == 'v1' else 128}x128 s{stages} fb-{factors}{extras}"
    if spec["system"] == "triton":
        block_m, block_n, block_k, warps, stages, rowcol = config
        return f"{block_m}x{block_n}x{block_k} w{warps} s{stages}{' (p·fb)·fa' if rowcol else ''}"
    return ""


def spawn(spec: dict, timeout_s: float) -> dict:
    command = [sys.executable, os.path.abspath(__file__), "--child", json.dumps(spec)]
    if spec["dry"]:
        command.append("--dry-run")
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as expired:
        stdout = expired.stdout.decode() if isinstance(expired.stdout, bytes) else (expired.stdout or "")
        partial = [json.loads(line[len("PARTIAL ") :]) for line in stdout.splitlines() if line.startswith("PARTIAL ")]
        return dict(status="hang/timeout", note=f"no result in {timeout_s:.0f} s", results=partial)
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    partial = [json.loads(line[len("PARTIAL ") :]) for line in done.stdout.splitlines() if line.startswith("PARTIAL ")]
    if partial:
        return dict(results=partial)
    tail = (done.stdout + done.stderr).strip().splitlines()[-3:]
    return dict(status=f"error (rc {done.returncode})", note=" / ".join(tail)[-600:])


def write(out_dir: str, header: list[str], rows: list[dict]) -> None:
    base = {}
    for row in rows:
        if row["mode"] == "time" and row.get("us"):
            base.setdefault(row["shape"], {})[row["system"]] = row["us"]
    lines = list(header)
    lines += [
        "",
        "## Correctness (ragged: groups 0, 1, 130, 77 and a -1 group of 9; E=3, N=384; 13 NaN rows past the end)",
        "",
    ]
    lines += ["| system | config | status | K: rel. err Frobenius/max |", "| --- | --- | --- | --- |"]
    for row in rows:
        if row["mode"] == "ragged":
            lines.append(f"| {row['system']} | {row['label']} | {row['status']} | {row.get('note', '')} |")
    table = []
    for row in rows:
        if row["mode"] != "time":
            continue
        us = row.get("us")
        flops = row["flops"]
        peers = base.get(row["shape"], {})
        ratio_bf16 = f"{peers['torch._grouped_mm bf16'] / us:.2f}x" if us and "torch._grouped_mm bf16" in peers else "-"
        ratio_lib = f"{peers['llmkernels mxfp8'] / us:.2f}x" if us and "llmkernels mxfp8" in peers else "-"
        row["tflops"] = flops / us / 1e6 if us else None
        row["vs_grouped_mm_bf16"], row["vs_llmkernels_mxfp8"] = ratio_bf16, ratio_lib
        table.append(row)
    for shape in dict.fromkeys(r["shape"] for r in table):
        lines += [
            "",
            f"## {shape}",
            "",
            "| system | config | status | rel. err Frobenius / max (first, last group) | "
            "compiled | µs | TFLOP/s | vs _grouped_mm bf16 | vs llmkernels mxfp8 |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for row in (r for r in table if r["shape"] == shape):
            us = row.get("us")
            tflops = f"{row['tflops']:.0f}" if row["tflops"] else "-"
            lines.append(
                f"| {row['system']} | {row['label']} | {row['status']} | {row.get('note', '')} | "
                f"{row.get('compiled', '')} | {f'{us:.1f}' if us else '-'} | "
                f"{tflops} | {row['vs_grouped_mm_bf16']} | "
                f"{row['vs_llmkernels_mxfp8']} |"
            )
    lines.append(f"\nTotal time {time.perf_counter() - START:.0f} s.")
    with open(os.path.join(out_dir, "mxfp8_fp8tc.md"), "w") as file:
        file.write("\n".join(lines) + "\n")
    fields = [
        "mode",
        "shape",
        "system",
        "label",
        "status",
        "note",
        "compiled",
        "us",
        "tflops",
        "vs_grouped_mm_bf16",
        "vs_llmkernels_mxfp8",
    ]
    with open(os.path.join(out_dir, "mxfp8_fp8tc.csv"), "w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=fields, extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            writer.writerow({key: row.get(key, "") for key in fields})


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", nargs="?", default="")
    parser.add_argument("--budget-s", type=float, default=240.0, help="start no new child past this")
    parser.add_argument("--timeout-s", type=float, default=90.0, help="per child (Gluon hangs are killed)")
    parser.add_argument("--gluon", default="", help="comma-separated indices into GLUON_CONFIGS (default: all)")
    parser.add_argument("--shapes", default="", help="comma-separated prefixes of shape names (default: all)")
    parser.add_argument("--dry-run", action="store_true", help="CPU, interpreter, tiny shapes, no Gluon kernel")
    parser.add_argument("--child", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        try:
            result = run_child(json.loads(args.child))
        except Exception as error:  # noqa: BLE001 - a failing system is a result
            import traceback

            traceback.print_exc()
            result = dict(status="error", note=f"{type(error).__name__}: {str(error)[:400]}".replace("\n", " "))
        print("RESULT " + json.dumps(result), flush=True)
        return 0
    if not args.out_dir:
        parser.error("OUT_DIR is required")
    os.makedirs(args.out_dir, exist_ok=True)
    import torch
    import triton

    dry = args.dry_run
    if not dry and not torch.cuda.is_available():
        print("needs a CUDA GPU (or --dry-run)")
        return 1
    shapes, ragged_k = (DRY_SHAPES, DRY_RAGGED_K) if dry else (SHAPES, RAGGED_K)
    ragged_n = 256 if dry else 384
    timeout = max(args.timeout_s, 900.0) if dry else args.timeout_s
    gluon = [GLUON_CONFIGS[int(i)] for i in args.gluon.split(",") if i] if args.gluon else list(GLUON_CONFIGS)
    triton_configs = TRITON_CONFIGS[:1] if dry else TRITON_CONFIGS
    wanted = [s for s in args.shapes.split(",") if s]
    shapes = [s for s in shapes if not wanted or any(s.name.startswith(w) for w in wanted)]
    device = "CPU dry run (interpreter)" if dry else torch.cuda.get_device_name(0)
    header = [
        f"# MXFP8 x MXFP8 grouped matmul on FP8 tensor cores, per-32-K promotion (lab/mxfp8_fp8tc), {device}",
        f"\ntorch {torch.__version__}, Triton {triton.__version__}, CUDA {torch.version.cuda}. Each (system, case) in "
        f"a child process with a {timeout:.0f} s timeout. CUDA-graph replay, median. FLOPs 2·T·N·K.",
    ]
    rows: list[dict] = []
    passed = []
    # 1. correctness
    systems = [("gluon", c) for c in gluon] + [("triton", triton_configs[0])]
    for system, config in systems:
        if time.perf_counter() - START > args.budget_s:
            break
        spec = dict(mode="ragged", system=system, config=config, ks=ragged_k, n=ragged_n, dry=dry)
        result = spawn(spec, timeout)
        rows.append(dict(mode="ragged", shape="ragged", system=system, label=label(spec), **result))
        log(f"ragged {system} {label(spec)}: {result['status']} {result.get('note', '')}")
        if system == "gluon" and result["status"] == "ok":
            passed.append(config)
        write(args.out_dir, header, rows)
    # 2. timings. Work items (shape, systems of one child): first every shape's peers + Triton prototype (one
    # child: they cannot hang; 3x the timeout, the E256 prototype compiles two configs) and the two default Gluon
    # variants, the most important shape first; then the other Gluon configs. The budget cuts the tail.
    peers = [("torch._grouped_mm bf16", None), ("llmkernels mxfp8", None)] + [("triton", c) for c in triton_configs]
    defaults = [c for c in passed if c in GLUON_CONFIGS[:2]]
    work = [(shape, batch) for shape in shapes for batch in [peers] + [[("gluon", c)] for c in defaults]]
    work += [(shape, [("gluon", c)]) for shape in shapes for c in passed if c not in defaults]
    for shape, batch in work:
        flops = 2.0 * shape.experts * shape.tokens_per_expert * shape.n * shape.k
        spec = dict(mode="time", systems=batch, shape=asdict(shape), dry=dry)
        labels = [(system, label(dict(system=system, config=config))) for system, config in batch]
        if time.perf_counter() - START > args.budget_s:
            for system, name in labels:
                rows.append(
                    dict(
                        mode="time",
                        shape=shape.name,
                        system=system,
                        label=name,
                        status="skipped: time budget",
                        flops=flops,
                    )
                )
            continue
        result = spawn(spec, timeout if batch[0][0] == "gluon" else 3 * timeout)
        done = {(r["system"], label(r)): r for r in result.get("results", [])}
        for system, name in labels:
            one = done.get((system, name))
            if one is None:  # the child died or hung before this system
                one = dict(status=result.get("status", "error"), note=result.get("note", ""))
            one = {key: value for key, value in one.items() if key not in ("system", "config")}
            rows.append(dict(mode="time", shape=shape.name, system=system, label=name, flops=flops, **one))
            us = one.get("us")
            log(
                f"{shape.name} {system} {name}: {one['status']} {one.get('note', '')} "
                f"{f'{us:.1f} µs, {flops / us / 1e6:.0f} TFLOP/s' if us else ''}"
            )
        write(args.out_dir, header, rows)
    for shape in shapes:
        if not any(r["mode"] == "time" and r["shape"] == shape.name for r in rows):
            rows.append(
                dict(mode="time", shape=shape.name, system="-", label="", status="skipped: time budget", flops=1.0)
            )
    write(args.out_dir, header, rows)
    with open(os.path.join(args.out_dir, "mxfp8_fp8tc.md")) as file:
        print(file.read())
    return 0


if __name__ == "__main__":
    sys.exit(main())
