"""GPU check and benchmark of the LAB Gluon x MXFP4 grouped matmul, bf16 mode (gluon_kernel.py) and e4m3 mode
(w4a8, gluon_w4a8.py), one run.

    PYTHONPATH=src:lab/gluon_w4 python lab/gluon_w4/bench_gpu.py OUT_DIR [--budget-s 240] [--shapes PREFIX,...]
        [--mode bf16|e4m3|both] [--dry-run]

e4m3 mode: the activations are ``quantize(x, "fp8", block=(1, 128))``, the reference the float64 product of the
dequantized fp8 activations and the weights (``dequantize(w)``: the prepared weights are exact there); its small
check adds weights whose 32-K exponents spread by 11 inside a 128-K block (exact: the decode's range is 14) and by
20 (prepared with ``allow_rounding``: the check bounds the weights' error by the stated ``2^(R - 137)``). Its peers
are ``_grouped_mm`` bf16, the library's fp8-blocks path on the same fp8 activations and the bf16 mode (default
config). Under ``--dry-run`` the e4m3 "ours" is :func:`gluon_w4a8.emulate_decode` times the dequantized
activations, and its check also compares ``emulate_decode`` with ``dequantize`` bit for bit.

Every Gluon step runs in a child process with a timeout (a warp-specialized kernel that deadlocks hangs its
process, not the run):

1. Correctness first, per config, in the first child that runs it (one compile): a small ragged problem (groups of
   0, 1, 130, 77 and 40 rows, one of expert -1 → zeros, 9 rows past ``a_offsets[G]`` poisoned with NaN and checked
   unchanged, K 384 and 320, N 256) against the float64 product of ``llmkernels.dequantize`` of both operands;
   bound (bf16 output): relative Frobenius 3e-3, max 1e-2. Then each shape on three groups, before it is timed.
   A config that fails or hangs is not run again.
2. CUDA-graph replay timings (median µs) at E8x2048 N4096 K7168, E128x128 N4096 K7168, gpt-oss E32x512 N5760
   K2880 and decode E128x16 N4096 K7168: ours per config (weights prepared once, outside timing), against
   ``torch._grouped_mm`` bf16 and the library's bf16 x MXFP4 hopper path (``llmkernels.grouped_matmul(a,
   quantize(w, "mxfp4", scale_layout="hopper"), ...)``), in one child per shape. The e4m3 mode's peers: see below.

Order: per shape the peers and two configs (the default and the tile height that suits the shape), shape after
shape; then the other configs. Writes OUT_DIR/gluon_w4.md and OUT_DIR/gluon_w4.csv (µs, TFLOP/s, ratios) after every
child. ``--budget-s``: no new child starts past it (a child costs ~20-60 s on the GPU: 240 s covers about the first
two shapes; 500 s the first pass). ``--dry-run``: the non-Gluon logic on the CPU through the Triton interpreter at
tiny shapes (children included): "ours" is then :func:`gluon_kernel.emulate_decode` (the kernel's decode, in
torch) times the activations, so the harness, the references and the prepared weights are checked, not the kernel.
Written for torch 2.11 and Triton 3.6 (Gluon).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import subprocess
import sys
import time
from dataclasses import dataclass

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
DRY = "--dry-run" in sys.argv
MODE = next((sys.argv[i + 1] for i, arg in enumerate(sys.argv[:-1]) if arg == "--mode"), "both")
os.environ["TRITON_INTERPRET"] = "1" if DRY else os.environ.get("TRITON_INTERPRET", "0")

import torch  # noqa: E402

import llmkernels as lk  # noqa: E402

DEVICE = "cpu" if DRY else "cuda"
TOLERANCE = (3e-3, 1e-2)  # relative (Frobenius, max): bf16 output
START = time.perf_counter()
RESULT = "RESULT "


@dataclass(frozen=True)
class Shape:
    name: str
    experts: int
    tokens_per_expert: int
    n: int
    k: int


SHAPES = [  # the most important first: a run cut by its budget still has these
    Shape("E8x2048 N4096 K7168", 8, 2048, 4096, 7168),
    Shape("E128x128 N4096 K7168", 128, 128, 4096, 7168),
    Shape("gpt-oss E32x512 N5760 K2880", 32, 512, 5760, 2880),
    Shape("decode E128x16 N4096 K7168", 128, 16, 4096, 7168),
]
DRY_SHAPES = [Shape("dry E3x40 N128 K256", 3, 40, 128, 256), Shape("dry decode E4x2 N128 K128", 4, 2, 128, 128)]


def log(message: str) -> None:
    print(f"[{time.perf_counter() - START:6.0f} s] {message}", file=sys.stderr, flush=True)


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def graph_time_us(fn, target_ms: float = 60.0) -> float:
    """Median GPU time (µs) of one replay of a CUDA graph holding one call of ``fn`` (CPU: one timed call)."""
    if DEVICE == "cpu":
        begin = time.perf_counter()
        fn()
        return 1e6 * (time.perf_counter() - begin)
    fn()
    sync()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    sync()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    graph.replay()
    end.record()
    sync()
    replays = int(min(max(target_ms / max(begin.elapsed_time(end), 1e-3), 5), 200))
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(replays)]
    for first, last in events:
        first.record()
        graph.replay()
        last.record()
    sync()
    times = sorted(first.elapsed_time(last) for first, last in events)
    return 1e3 * times[len(times) // 2]


def relative_errors(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    diff = out.double() - ref
    return (diff.norm() / ref.norm()).item(), (diff.abs().max() / ref.abs().max()).item()


# ------------------------------------------------------------------------------------------------------ children


def _configs():
    import gluon_kernel
    import gluon_w4a8

    return (gluon_kernel.CONFIGS if MODE != "e4m3" else []) + (gluon_w4a8.CONFIGS if MODE != "bf16" else [])


def prepare_for(config, w_q, allow_rounding=False):
    if config.mode == "e4m3":
        from gluon_w4a8 import prepare_weights

        return prepare_weights(w_q, reference=config.reference, allow_rounding=allow_rounding)
    from gluon_kernel import prepare_weights

    return prepare_weights(w_q)


def activations(config, x):
    """The kernel's A operand: bf16 x, or its fp8 (1, 128) blocks in e4m3 mode."""
    return lk.quantize(x, "fp8", block=(1, 128)) if config.mode == "e4m3" else x


def ours(a, prepared, offsets, ids, out, config):
    """The Gluon kernel, or under --dry-run its decode emulated in torch (the kernel cannot run on the CPU)."""
    if config.mode == "e4m3":
        if not DRY:
            from gluon_w4a8 import w4a8_grouped_matmul_gluon

            return w4a8_grouped_matmul_gluon(a, prepared, offsets, ids, out=out, config=config)
        from gluon_w4a8 import emulate_decode

        weights, a = emulate_decode(prepared), lk.dequantize(a)
    elif DRY:
        from gluon_kernel import emulate_decode

        weights = emulate_decode(prepared)
    else:
        from gluon_kernel import w4_grouped_matmul_gluon

        return w4_grouped_matmul_gluon(a, prepared, offsets, ids, out=out, config=config)
    bounds = offsets.tolist()
    for g, e in enumerate(ids.tolist()):
        rows = slice(bounds[g], bounds[g + 1])
        if e < 0:
            out[rows] = 0
        else:
            out[rows] = (a[rows].float() @ weights[e].T).to(out.dtype)
    return out


def reference(a, w_q, offsets: list[int], ids: list[int], groups) -> dict:
    """float64 ``a[rows of g] @ dequantize(w)[e]ᵀ`` (zeros for e = -1) per group g of ``groups``; a fp8 ScaledTensor
    is dequantized first."""
    if not isinstance(a, torch.Tensor):
        a = lk.dequantize(a)
    refs = {}
    for g in groups:
        rows = slice(offsets[g], offsets[g + 1])
        if ids[g] < 0:
            refs[g] = torch.zeros(offsets[g + 1] - offsets[g], w_q.shape[1], dtype=torch.float64, device=DEVICE)
        else:
            w = lk.dequantize(lk.ScaledTensor(w_q.data[ids[g]], w_q.scales[ids[g]], "mxfp4")).double()
            refs[g] = a[rows].double() @ w.T
    return refs


def child_check(config_index: int) -> dict:
    """The small ragged problem on one config, at K 384 (3 steps of 128) and K 320 (the last step half zeros); e4m3
    mode adds K 384 with exponent spreads 11 (exact) and 20 (rounded, within the stated bound)."""
    config = _configs()[config_index]
    e4m3 = config.mode == "e4m3"
    generator = torch.Generator(device=DEVICE).manual_seed(1)
    rows, ids = [0, 1, 130, 77, 40], [1, 2, 0, -1, 2]
    offsets = [0]
    for r in rows:
        offsets.append(offsets[-1] + r)
    tokens, n = offsets[-1] + 9, 256
    offsets_t = torch.tensor(offsets, dtype=torch.int32, device=DEVICE)
    ids_t = torch.tensor(ids, dtype=torch.int32, device=DEVICE)
    result = dict(config=config.label, fro=0.0, max=0.0, kept=True, zeros=True, bits=True, rounded=0, bound=True)
    for k, spread in [(384, 0), (320, 0)] + ([(384, 11), (384, 20)] if e4m3 else []):
        x = torch.randn(tokens, k, device=DEVICE, generator=generator).to(torch.bfloat16)
        w = torch.randn(3, n, k, device=DEVICE, generator=generator) * k**-0.5
        if spread:  # one 32-K block of every 5th row, in each 128-K step, 2^-spread smaller than its neighbours
            for start in range(32, k, 128):
                w[:, ::5, start : start + 32] *= 2.0**-spread
        w_q = lk.quantize(w, "mxfp4")
        a = activations(config, x)
        prepared = prepare_for(config, w_q, allow_rounding=spread > 14)
        if e4m3:
            from gluon_w4a8 import emulate_decode

            exact = lk.dequantize(w_q)
            decoded = emulate_decode(prepared)
            if spread <= 14:
                same = decoded.view(torch.int32) == exact.view(torch.int32)
                result["bits"] &= bool((same | (decoded.isnan() & exact.isnan())).all())
            else:  # rounded blocks: each weight within 2^(R - 137) = its row factor x 2^-10
                factors = prepared.row_factors.repeat_interleave(128, dim=-1)[..., :k]
                result["bound"] &= bool(((decoded - exact).abs() <= factors * 2.0**-10).all())
                result["rounded"] += prepared.rounded_blocks
        out = torch.full((tokens, n), float("nan"), dtype=torch.bfloat16, device=DEVICE)
        ours(a, prepared, offsets_t, ids_t, out, config)
        sync()
        refs = reference(a, w_q, offsets, ids, range(len(rows)))
        want = torch.cat([refs[g] for g in range(len(rows))])
        fro, worst = relative_errors(out[: offsets[-1]].nan_to_num(1e30), want)
        result["fro"], result["max"] = max(result["fro"], fro), max(result["max"], worst)
        result["kept"] &= bool(torch.isnan(out[offsets[-1] :]).all())
        result["zeros"] &= bool((out[offsets[3] : offsets[4]] == 0).all())
    result["ok"] = (
        result["kept"]
        and result["zeros"]
        and result["bits"]
        and result["bound"]
        and result["fro"] <= TOLERANCE[0]
        and result["max"] <= TOLERANCE[1]
    )
    return result


class Problem:
    """One shape's operands: bf16 activations and weights, MXFP4 weights (row layout) prepared for the kernel,
    offsets of equal groups, and the float64 reference on three groups."""

    def __init__(self, shape: Shape, config=None):
        e, n, k = shape.experts, shape.n, shape.k
        self.shape, self.tokens = shape, e * shape.tokens_per_expert
        generator = torch.Generator(device=DEVICE).manual_seed(0)
        self.x = torch.randn(self.tokens, k, device=DEVICE, generator=generator).to(torch.bfloat16)
        chunks = [min(8, e - first) for first in range(0, e, 8)]  # fp32 temporaries a few experts at a time
        self.w = torch.cat(
            [(torch.randn(c, n, k, device=DEVICE, generator=generator) * k**-0.5).to(torch.bfloat16) for c in chunks]
        )
        self.w_q = lk.quantize(self.w, "mxfp4")
        self.config = config or _configs()[0]
        self.prepared = prepare_for(self.config, self.w_q)
        self.a = activations(self.config, self.x)
        self.offsets_list = [g * shape.tokens_per_expert for g in range(e + 1)]
        self.offsets = torch.tensor(self.offsets_list, dtype=torch.int32, device=DEVICE)
        self.ids = torch.arange(e, device=DEVICE, dtype=torch.int32)
        self.out = torch.empty(self.tokens, n, device=DEVICE, dtype=torch.bfloat16)
        self.groups = sorted({0, e // 2, e - 1})
        self.refs = reference(self.a, self.w_q, self.offsets_list, list(range(e)), self.groups)
        self.flops = 2.0 * self.tokens * n * k

    def errors(self, out: torch.Tensor) -> tuple[float, float]:
        got = torch.cat([out[self.offsets_list[g] : self.offsets_list[g + 1]] for g in self.groups])
        return relative_errors(got.nan_to_num(1e30), torch.cat([self.refs[g] for g in self.groups]))


def child_time(shape_name: str, config_index: int, with_check: bool) -> dict:
    """One config on one shape: the small ragged check first when ``with_check`` (same process: one compile),
    then correctness on three groups of the shape, then the graph timing."""
    check = child_check(config_index) if with_check else None
    shape = next(s for s in SHAPES + DRY_SHAPES if s.name == shape_name)
    config = _configs()[config_index]
    if check is not None and not check["ok"]:
        return dict(system="ours", config=config.label, us=float("nan"), error="small check FAIL", check=check)
    problem = Problem(shape, config)
    problem.out.fill_(float("nan"))
    ours(problem.a, problem.prepared, problem.offsets, problem.ids, problem.out, config)
    sync()
    fro, worst = problem.errors(problem.out)
    result = dict(system="ours", config=config.label, fro=fro, max=worst, us=float("nan"), compiled="", check=check)
    if not (fro <= TOLERANCE[0] and worst <= TOLERANCE[1]):
        result["error"] = "FAIL"
        return result
    result["us"] = graph_time_us(
        lambda: ours(problem.a, problem.prepared, problem.offsets, problem.ids, problem.out, config)
    )
    if not DRY:
        import gluon_kernel
        import gluon_w4a8

        LAST_COMPILED = gluon_w4a8.LAST_COMPILED if config.mode == "e4m3" else gluon_kernel.LAST_COMPILED

        compiled = LAST_COMPILED.get(config)
        if compiled is not None:
            result["compiled"] = (
                f"regs {getattr(compiled, 'n_regs', '?')}, spills {getattr(compiled, 'n_spills', '?')}, "
                f"smem {compiled.metadata.shared}"
            )
    return result


PRODUCT_W4A8 = "lk w4a8 (fp8 x row mxfp4: the product's call)"


def child_peers(shape_name: str) -> list[dict]:
    """The peers on one shape (each may be unavailable: reported, not fatal)."""
    import gluon_kernel

    shape = next(s for s in SHAPES + DRY_SHAPES if s.name == shape_name)
    problem = Problem(shape, gluon_kernel.CONFIGS[0])  # bf16 activations: the peers' errors against their product
    results = []

    def grouped_mm():
        w_t = problem.w.transpose(-2, -1)
        return lambda: torch._grouped_mm(problem.x, w_t, offs=problem.offsets[1:], out_dtype=torch.bfloat16)

    def hopper():
        w_h = lk.quantize(problem.w, "mxfp4", scale_layout="hopper")
        return lambda: lk.grouped_matmul(problem.x, w_h, problem.offsets, problem.ids, out=problem.out)

    def fp8_blocks():
        a_q = lk.quantize(problem.x, "fp8", block=(1, 128))
        w_f = lk.quantize(problem.w, "fp8", block=(128, 128))
        return lambda: lk.grouped_matmul(a_q, w_f, problem.offsets, problem.ids, out=problem.out)

    def product_w4a8():  # lk.grouped_matmul on the pair: the moved kernel (w4a8_hopper) where it takes the launch
        a_q = lk.quantize(problem.x, "fp8", block=(1, 128))
        w_row = lk.quantize(problem.w, "mxfp4")
        return lambda: lk.grouped_matmul(a_q, w_row, problem.offsets, problem.ids, out=problem.out)

    def bf16_mode():
        return lambda: ours(problem.x, problem.prepared, problem.offsets, problem.ids, problem.out, problem.config)

    peers = {
        "torch._grouped_mm bf16": grouped_mm,
        "lk bf16 x mxfp4 (hopper layout)": hopper,
        "lk fp8 blocks (fp8 activations; e4m3 mode's peer)": fp8_blocks,
    }
    if MODE != "bf16":
        peers[PRODUCT_W4A8] = product_w4a8
    if MODE == "e4m3":  # the bf16 mode's default config as a peer (in "both" it is timed as ours)
        peers["gluon-w4 bf16 mode (default config)"] = bf16_mode
    for name, make in peers.items():
        try:
            fn = make()
            problem.out.fill_(float("nan"))
            result = fn()
            sync()
            fro, worst = problem.errors(result)
            us = graph_time_us(fn)
            results.append(dict(system=name, config="", fro=fro, max=worst, us=us, compiled=""))
        except Exception as error:  # noqa: BLE001 - an unavailable peer is a result
            results.append(
                dict(
                    system=name,
                    config="",
                    fro=float("nan"),
                    max=float("nan"),
                    us=float("nan"),
                    compiled="",
                    error=f"unavailable: {type(error).__name__}: {str(error)[:160]}",
                )
            )
    return results


def child_main(task: dict) -> None:
    if task["task"] == "check":
        result = child_check(task["config"])
    elif task["task"] == "time":
        result = child_time(task["shape"], task["config"], task["check"])
    else:
        result = child_peers(task["shape"])
    print(RESULT + json.dumps(result), flush=True)


# -------------------------------------------------------------------------------------------------------- parent


def run_child(task: dict, timeout_s: float):
    """``(result or None, message)``: the child's RESULT line, or why there is none (timeout = a hang)."""
    command = [sys.executable, os.path.abspath(__file__), "unused", "--child", json.dumps(task)]
    if DRY:
        command.append("--dry-run")
    command += ["--mode", MODE]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return None, f"TIMEOUT after {timeout_s:.0f} s (hang?)"
    for line in done.stdout.splitlines():
        if line.startswith(RESULT):
            return json.loads(line[len(RESULT) :]), ""
    tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
    return None, f"exit {done.returncode}: {' / '.join(tail)[:300]}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", help="folder for gluon_w4.md and gluon_w4.csv")
    parser.add_argument("--budget-s", type=float, default=240.0, help="start no child past this many seconds")
    parser.add_argument("--shapes", default="", help="comma-separated prefixes of shape names (default: all)")
    parser.add_argument("--timeout-s", type=float, default=0.0, help="per child (default 120, 600 on --dry-run)")
    parser.add_argument("--dry-run", action="store_true", help="CPU, interpreter, tiny shapes, kernel emulated")
    parser.add_argument("--mode", default="both", choices=("bf16", "e4m3", "both"), help="which modes to run")
    parser.add_argument("--child", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child_main(json.loads(args.child))
        return 0
    if not DRY and not torch.cuda.is_available():
        print("needs a CUDA GPU (or --dry-run)")
        return 1
    timeout_s = args.timeout_s or (600.0 if DRY else 120.0)
    shapes = DRY_SHAPES if DRY else SHAPES
    wanted = [s for s in args.shapes.split(",") if s]
    shapes = [s for s in shapes if not wanted or any(s.name.startswith(w) for w in wanted)]
    configs = _configs()
    os.makedirs(args.out_dir, exist_ok=True)
    md, csv_path = os.path.join(args.out_dir, "gluon_w4.md"), os.path.join(args.out_dir, "gluon_w4.csv")
    device = torch.cuda.get_device_name(0) if DEVICE == "cuda" else "CPU dry run (interpreter, kernel emulated)"
    import triton

    lines = [
        f"# LAB Gluon x MXFP4 grouped matmul (lab/gluon_w4), modes: {MODE}, {device}",
        f"\ntorch {torch.__version__}, Triton {triton.__version__}; CUDA-graph replay, median µs; ratios > 1: ours "
        "faster. Each Gluon step in a child process with a timeout.",
        "\n## Small ragged check (groups 0, 1, 130, 77, 40 rows; experts 1, 2, 0, -1, 2; 9 poisoned rows past the "
        "last group; K 384 and 320 (worst of the two), N 256)\n",
        "| config | rel. err Frobenius / max | -1 group zeros | poisoned rows kept | e4m3: decode bits / rounded "
        "blocks within bound | verdict |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    records = []

    def write() -> None:
        with open(md, "w") as file:
            file.write("\n".join(lines) + "\n")
        if records:
            with open(csv_path, "w", newline="") as file:
                writer = csv.DictWriter(file, fieldnames=list(records[0]))
                writer.writeheader()
                writer.writerows(records)

    checks = {}  # config index -> its check-table row, filled by the first child that runs the config
    failed = set()  # configs whose check failed or whose child hung or crashed: not run again

    def check_lines() -> list[str]:
        return [checks.get(i, f"| {c.label} | not run (time budget) | | | | |") for i, c in enumerate(configs)]

    def e4m3_column(index: int, check: dict) -> str:
        if configs[index].mode != "e4m3":
            return "-"
        return f"{check['bits']} / {check['rounded']} {check['bound']}"

    def record_check(index: int, check: dict | None, message: str = "") -> None:
        if index in checks:
            return
        if check is None:
            checks[index] = f"| {configs[index].label} | {message} | | | | FAIL |"
            return
        checks[index] = (
            f"| {configs[index].label} | {check['fro']:.2e} / {check['max']:.2e} | {check['zeros']} | "
            f"{check['kept']} | {e4m3_column(index, check)} | "
            f"{'ok' if check['ok'] else 'FAIL'} |"
        )
        log(f"check {configs[index].label}: {checks[index]}")

    lines.append(
        f"\nModes run: {MODE}. e4m3 mode (w4a8): rel. errors against the float64 product of the dequantized fp8 "
        "activations and weights; the peers' against bf16 activations x dequantize(w)."
    )
    rows = {shape.name: [] for shape in shapes}
    base_names = ["torch._grouped_mm bf16", "lk bf16 x mxfp4 (hopper layout)"]
    if MODE != "bf16":
        base_names.append("lk fp8 blocks (fp8 activations; e4m3 mode's peer)")
        base_names.append(PRODUCT_W4A8)
    if MODE == "e4m3":
        base_names.append("gluon-w4 bf16 mode (default config)")

    def shape_lines() -> list[str]:
        """The per-shape tables and the CSV records of everything measured so far."""
        out, records[:] = [], []
        for shape in shapes:
            flops = 2.0 * shape.experts * shape.tokens_per_expert * shape.n * shape.k
            bases = {
                r["system"]: r["us"] for r in rows[shape.name] if r["system"] != "ours" and not math.isnan(r["us"])
            }
            out += [
                f"\n## {shape.name} ({shape.experts * shape.tokens_per_expert} tokens, {flops / 1e12:.3f} TFLOP)\n",
                "| system | config | compiled | rel. err Frobenius / max | µs | TFLOP/s | "
                + " | ".join(f"vs {b}" for b in base_names)
                + " |",
                "| --- " * (6 + len(base_names)) + "|",
            ]
            for row in rows[shape.name]:
                us = row.get("us", float("nan"))
                timed = not math.isnan(us)
                tflops = flops / us / 1e6 if timed else float("nan")
                ratios = [f"{bases[b] / us:.2f}x" if timed and b in bases else "-" for b in base_names]
                error = row.get("error") or (f"{row['fro']:.2e} / {row['max']:.2e}" if "fro" in row else "")
                error = error.replace("|", "/")
                out.append(
                    f"| {row['system']} | {row.get('config', '')} | {row.get('compiled', '')} | {error} | {us:.1f} | "
                    f"{tflops:.0f} | " + " | ".join(ratios) + " |"
                )
                records.append(
                    dict(
                        shape=shape.name,
                        system=row["system"],
                        config=row.get("config", ""),
                        error=error,
                        us=f"{us:.2f}",
                        tflops=f"{tflops:.1f}",
                        **{f"ratio_vs_{b}": r for b, r in zip(base_names, ratios)},
                    )
                )
        return out

    head = list(lines)  # title and check-table header; the check rows follow, then the e4m3 note
    note = head.pop()

    def preferred(shape: Shape) -> list[int]:
        """Configs in the order this shape times them: the default, the tile height that suits the shape (16
        tokens for groups of <= 16, 64 for <= 64, else 256), then the rest."""
        per = shape.tokens_per_expert
        want = 16 if per <= 16 else 64 if per <= 64 else 256
        everything = range(len(configs))
        first = [0] + [i for i in everything if i != 0 and configs[i].block_t == want][:1]
        e4m3 = [i for i in everything if configs[i].mode == "e4m3"]
        if e4m3 and e4m3[0] not in first:  # the e4m3 default early, in "both"
            first.append(e4m3[0])
        if MODE == "e4m3" and len(first) == 1 and want < 128:  # no 16-token e4m3 tile: its smallest (64)
            first.append(min(everything, key=lambda i: configs[i].block_t))
        return first + [i for i in everything if i not in first]

    # pass 1: every shape's peers and its first two configs; pass 2: the other configs, while the budget lasts
    lead = 3 if MODE == "both" else 2
    plan = [item for shape in shapes for item in [(shape, "peers")] + [(shape, i) for i in preferred(shape)[:lead]]]
    plan += [(shape, i) for shape in shapes for i in preferred(shape)[lead:]]
    for shape, what in plan:
        if time.perf_counter() - START > args.budget_s:
            label = "peers" if what == "peers" else configs[what].label
            rows[shape.name].append(
                dict(
                    system="ours" if what != "peers" else "peers",
                    config=label,
                    us=float("nan"),
                    error="skipped: time budget",
                )
            )
        elif what == "peers":
            result, message = run_child(dict(task="peers", shape=shape.name), 3 * timeout_s)
            rows[shape.name] += (
                result if result is not None else [dict(system="peers", config="", us=float("nan"), error=message)]
            )
        elif what in failed:
            rows[shape.name].append(
                dict(system="ours", config=configs[what].label, us=float("nan"), error="not run: failed before")
            )
        else:
            task = dict(task="time", shape=shape.name, config=what, check=what not in checks)
            result, message = run_child(task, timeout_s)
            if result is None:
                if message.startswith("TIMEOUT") or what not in checks:  # a hang, or a crash before any result
                    failed.add(what)
                record_check(what, None, message)
                result = dict(system="ours", config=configs[what].label, us=float("nan"), error=message)
            else:
                if result.get("check") is not None:
                    record_check(what, result["check"])
                    if not result["check"]["ok"]:
                        failed.add(what)
            rows[shape.name].append({k: v for k, v in result.items() if k != "check"})
            log(f"{shape.name} {configs[what].label}: {result.get('us')} µs {result.get('error', '')}")
        lines[:] = head + check_lines() + [note] + shape_lines()
        write()
    lines.append(f"\nTotal time {time.perf_counter() - START:.0f} s.")
    write()
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
