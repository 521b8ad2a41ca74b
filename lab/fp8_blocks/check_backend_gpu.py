"""GPU check of the library's FP8-blocks grouped matmul backends through the public API (``lk.grouped_matmul``).

    PYTHONPATH=src python lab/fp8_blocks/check_backend_gpu.py OUT.md            # H100 (torch 2.11, Triton 3.6)
    python3 lab/fp8_blocks/check_backend_gpu.py /tmp/dry.md --dry-run            # CPU: interpreter, portable only
    (--cases silu,bias: only the cases whose names contain one of these)

Every case quantizes fresh random inputs with ``lk.quantize(x, "fp8", block=(1, 128))`` and ``lk.quantize(w, "fp8",
block=(128, 128))``, calls ``lk.grouped_matmul`` into an ``out`` poisoned with NaN, and checks against a float64
reference computed here from the quantized parts (decoded exactly: ``data · scale`` of the tile, float64):

* relative error ``|out - ref|_F / |ref|_F`` and ``max |out - ref| / max |ref|`` within the bound of the output
  dtype (bf16 3e-3 / 1e-2, fp16 1e-3 / 5e-3, fp32 5e-4 / 2e-3: fp8 wgmma accumulation and the output rounding;
  a wrong tile, scale or epilogue is off by O(1));
* rows of groups with expert id -1 or >= E are exactly zero; rows past ``a_offsets[G]`` are still NaN;
* the backend that took each launch (the plan's launches name theirs) is the expected one: ``fp8_hopper`` (the
  Gluon kernel) for plain launches on sm_90, ``fp8_blocks`` (portable) for what fp8_hopper declines (K % 16 != 0,
  interleaved SwiGLU, SwiGLU with N / 2 not a multiple of 128, tiles under 128 rows, swap-AB configs) and
  everywhere with ``--dry-run`` or off sm_90.

Cases: the ragged cases of ``bench_gluon_gpu.py``'s first section (groups of 0, 1, 130, 77 rows and a -1 group of
9, E = 3, N = 192, K = 320 and 200, with and without expert_scales, 13 NaN rows past the groups), every epilogue,
bias of each dtype, each out_dtype, an out-of-range id, bf16 activations (quantized inside the call), token-major
A scales, strided ``out=`` views (TMA-aligned and not), a cached plan called again on new tensors, and three
compute shapes on their default configs (two timed, eager calls: the lab measured the kernel at 1149 and 1157
TFLOP/s there, CUDA-graph replay).
Prints a table, writes it as markdown to OUT.md, exits 1 if any case fails.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from dataclasses import dataclass, field

DRY = "--dry-run" in sys.argv
if DRY:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402, F401 - the interpreter looks for it where a jit function is defined

import llmkernels as lk  # noqa: E402
from llmkernels.grouped_matmul.api import PLANS  # noqa: E402

BOUNDS = {torch.bfloat16: (3e-3, 1e-2), torch.float16: (1e-3, 5e-3), torch.float32: (5e-4, 2e-3)}
if DRY:  # Triton 3.9's interpreter rounds fp32 -> bf16 by truncation (NOTES.md): 3.3e-3 Frobenius measured
    BOUNDS[torch.bfloat16] = (5e-3, 1.5e-2)
START = time.perf_counter()


@triton.jit
def _halve(value, row, col):
    """A user epilogue."""
    return value * 0.5


@dataclass
class Case:
    name: str
    sizes: list
    ids: list
    num_experts: int
    n: int
    k: int
    extra_rows: int = 13
    expert_scales: bool = False
    epilogue: object = None
    bias: torch.dtype | None = None
    out_dtype: torch.dtype = torch.bfloat16
    bf16_a: bool = False
    token_major_scales: bool = False
    out_view: str = ""  # "", "padded" (row stride > N, TMA-aligned), "offset" (not 16-byte aligned)
    config: object = None
    expect: str = "fp8_hopper"
    repeat: bool = False  # call the cached plan again on fresh tensors
    timed: bool = False  # also time the call (GPU: CUDA events over 20 calls after 3 warm-up calls)
    notes: list = field(default_factory=list)


def _decode(st) -> torch.Tensor:
    """float64 ``data · scale`` of each element's tile (exact: 4-bit by 24-bit significands)."""
    data = st.data.to(torch.float64)
    rows, cols = st.block
    scales = st.scales.to(torch.float64)
    scales = scales.repeat_interleave(rows, dim=-2)[..., : data.shape[-2], :] if rows > 1 else scales
    scales = scales.repeat_interleave(cols, dim=-1)[..., : data.shape[-1]]
    return data * scales


def _activation(x: torch.Tensor, up: torch.Tensor | None, epilogue) -> torch.Tensor:
    if epilogue is None:
        return x
    if epilogue == "silu":
        return x * torch.sigmoid(x)
    if epilogue == "gelu":
        return 0.5 * x * (1.0 + torch.erf(x / 2**0.5))
    if epilogue is _halve:
        return x * 0.5
    glu = lk.SwiGLU() if epilogue == "swiglu" else epilogue
    if glu.limit is not None:
        x = x.clamp(max=glu.limit)
        up = up.clamp(-glu.limit, glu.limit)
    return x * torch.sigmoid(glu.alpha * x) * (up + glu.up_shift)


def reference(a_st, b_st, offsets, ids, expert_scales, bias, epilogue, num_tokens) -> torch.Tensor:
    """float64 ``[T, N_out]``; rows outside every group NaN (they must stay untouched)."""
    a, b = _decode(a_st), _decode(b_st)
    n = b.shape[1]
    swiglu = epilogue == "swiglu" or isinstance(epilogue, lk.SwiGLU)
    interleaved = swiglu and isinstance(epilogue, lk.SwiGLU) and epilogue.interleaved
    n_out = n // 2 if swiglu else n
    out = torch.full((num_tokens, n_out), float("nan"), dtype=torch.float64, device=a.device)
    bounds = offsets.tolist()
    for g, expert in enumerate(ids.tolist()):
        lo, hi = bounds[g], bounds[g + 1]
        if not 0 <= expert < b.shape[0]:
            out[lo:hi] = 0.0
            continue
        acc = a[lo:hi] @ b[expert].T
        if expert_scales is not None:
            acc = acc * float(expert_scales[expert])
        if bias is not None:
            acc = acc + bias[expert].to(torch.float64)
        if swiglu:
            gate, up = (acc[:, 0::2], acc[:, 1::2]) if interleaved else (acc[:, :n_out], acc[:, n_out:])
            out[lo:hi] = _activation(gate, up, epilogue)
        else:
            out[lo:hi] = _activation(acc, None, epilogue)
    return out


def run_case(case: Case, device: torch.device, seed: int) -> dict:
    torch.manual_seed(seed)
    grouped = sum(case.sizes)
    num_tokens = grouped + case.extra_rows
    x = torch.randn(num_tokens, case.k, device=device)
    w = torch.randn(case.num_experts, case.n, case.k, device=device) * case.k**-0.5
    a_st = lk.quantize(x.to(torch.bfloat16), "fp8", block=(1, 128))
    b_st = lk.quantize(w, "fp8", block=(128, 128))
    a_arg = x.to(torch.bfloat16) if case.bf16_a else a_st
    if case.token_major_scales and not case.bf16_a:  # [ceil(K/128), T] storage seen transposed
        a_arg = lk.ScaledTensor(a_st.data, a_st.scales.T.contiguous().T, "fp8", block=(1, 128))
    offsets = torch.tensor([0, *torch.tensor(case.sizes).cumsum(0).tolist()], dtype=torch.int32, device=device)
    ids = torch.tensor(case.ids, dtype=torch.int32, device=device)
    expert_scales = (
        torch.linspace(0.5, 2.0, case.num_experts, device=device, dtype=torch.float32) if case.expert_scales else None
    )
    bias = torch.randn(case.num_experts, case.n, device=device).to(case.bias) if case.bias is not None else None
    swiglu = case.epilogue == "swiglu" or isinstance(case.epilogue, lk.SwiGLU)
    n_out = case.n // 2 if swiglu else case.n
    if case.out_view == "padded":
        storage = torch.full((num_tokens, n_out + 64), float("nan"), dtype=case.out_dtype, device=device)
        out = storage[:, :n_out]
    elif case.out_view == "offset":
        storage = torch.full((num_tokens, n_out + 8), float("nan"), dtype=case.out_dtype, device=device)
        out = storage[:, 1 : n_out + 1]
    else:
        out = torch.full((num_tokens, n_out), float("nan"), dtype=case.out_dtype, device=device)
    PLANS.clear()
    kwargs = dict(epilogue=case.epilogue, bias=bias, out_dtype=case.out_dtype, out=out, config=case.config)
    result = lk.grouped_matmul(a_arg, b_st, offsets, ids, expert_scales, **kwargs)
    if case.repeat:  # same signature, new tensors: the cached plan's bound launch takes the new bases
        torch.manual_seed(seed + 1000)
        x = torch.randn(num_tokens, case.k, device=device)
        w = torch.randn(case.num_experts, case.n, case.k, device=device) * case.k**-0.5
        a_st = lk.quantize(x.to(torch.bfloat16), "fp8", block=(1, 128))
        b_st = lk.quantize(w, "fp8", block=(128, 128))
        a_arg = x.to(torch.bfloat16) if case.bf16_a else a_st
        out.fill_(float("nan"))
        result = lk.grouped_matmul(a_arg, b_st, offsets, ids, expert_scales, **kwargs)
    if device.type == "cuda":
        torch.cuda.synchronize()
    plans = PLANS.plans()
    backends = sorted({launch.backend.__name__.rsplit(".", 1)[-1] for plan in plans for launch in plan.launches})
    ref = reference(a_st, b_st, offsets, ids, expert_scales, bias, case.epilogue, num_tokens)
    got = result.to(torch.float64)
    inside = slice(0, grouped)
    diff = (got[inside] - ref[inside]).nan_to_num(nan=float("inf"))
    ref_norm = ref[inside].norm().item() or 1.0
    ref_max = ref[inside].abs().max().item() if grouped else 1.0
    fro = diff.norm().item() / ref_norm if grouped else 0.0
    worst = diff.abs().max().item() / (ref_max or 1.0) if grouped else 0.0
    zero_rows = [g for g, e in enumerate(case.ids) if not 0 <= e < case.num_experts]
    bounds = offsets.tolist()
    zeros_ok = all(bool((got[bounds[g] : bounds[g + 1]] == 0).all()) for g in zero_rows)
    untouched = bool(torch.isnan(got[grouped:]).all())
    if case.out_view:
        untouched = untouched and bool(
            torch.isnan(storage[:, n_out + 1 :] if case.out_view == "offset" else storage[:, n_out:]).all()
        )
    fro_bound, max_bound = BOUNDS[case.out_dtype]
    expect = "fp8_blocks" if DRY else case.expect
    ok = (
        fro <= fro_bound
        and worst <= max_bound
        and zeros_ok
        and untouched
        and result is out
        and backends == sorted({expect})
    )
    timing = ""
    if case.timed and device.type == "cuda":
        for _ in range(3):
            lk.grouped_matmul(a_arg, b_st, offsets, ids, expert_scales, **kwargs)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(20):
            lk.grouped_matmul(a_arg, b_st, offsets, ids, expert_scales, **kwargs)
        end.record()
        torch.cuda.synchronize()
        us = start.elapsed_time(end) * 1e3 / 20
        timing = f"{us:.0f} us, {2 * grouped * case.n * case.k / us / 1e6:.0f} TFLOP/s"
    return dict(
        backends=",".join(backends),
        expect=expect,
        fro=fro,
        worst=worst,
        zeros=zeros_ok,
        untouched=untouched,
        ok=ok,
        timing=timing,
    )


def cases(large: bool) -> list[Case]:
    """The cases; ``large``: also three compute shapes (GPU only; two timed). The ragged groups average 46 rows, for which the
    default config is the portable backend's 64-row tile: those cases pass the compute config (128 x 256, the
    default for larger groups) so that fp8_hopper takes them, or declines them for the reason the case names."""
    ragged = dict(sizes=[0, 1, 130, 77, 9], ids=[1, 0, 2, 1, -1], num_experts=3)
    big = lk.BlockScaledMatmulConfig(block_m=128, block_n=256, block_k=128, num_warps=8, num_stages=3)
    swap = lk.BlockScaledMatmulConfig(block_m=16, block_n=128, block_k=128, num_warps=4, num_stages=4, ab_swapped=True)
    wide = dict(ragged, config=big)
    listed = [
        # bench_gluon_gpu.py's first section
        Case("ragged K320", n=192, k=320, **wide),
        Case("ragged K320 expert_scales", n=192, k=320, expert_scales=True, **wide),
        Case("ragged K200 (K % 16: portable)", n=192, k=200, expect="fp8_blocks", **wide),
        Case("ragged K320 default config (small groups: portable)", n=192, k=320, expect="fp8_blocks", **ragged),
        # epilogues
        Case("silu", n=192, k=320, epilogue="silu", **wide),
        Case("gelu", n=192, k=320, epilogue="gelu", expert_scales=True, **wide),
        Case("swiglu N512", n=512, k=320, epilogue="swiglu", **wide),
        Case(
            "SwiGLU(1.702, 7, 1) N512 bias",
            n=512,
            k=320,
            epilogue=lk.SwiGLU(1.702, 7.0, 1.0),
            bias=torch.float32,
            expert_scales=True,
            **wide,
        ),
        Case("SwiGLU interleaved (portable)", n=512, k=320, epilogue=lk.GPT_OSS_SWIGLU, expect="fp8_blocks", **wide),
        Case("swiglu N/2=96 (portable)", n=192, k=320, epilogue="swiglu", expect="fp8_blocks", **wide),
        Case("user epilogue", n=192, k=320, epilogue=_halve, bias=torch.float32, **wide),
        # bias, out dtypes
        Case("bias fp32", n=192, k=320, bias=torch.float32, **wide),
        Case("bias bf16 silu", n=192, k=320, bias=torch.bfloat16, epilogue="silu", **wide),
        Case("bias fp16 fp16 out", n=192, k=320, bias=torch.float16, out_dtype=torch.float16, **wide),
        Case("fp32 out", n=192, k=320, out_dtype=torch.float32, expert_scales=True, **wide),
        Case(
            "fp32 out swiglu bias",
            n=512,
            k=256,
            out_dtype=torch.float32,
            epilogue="swiglu",
            bias=torch.bfloat16,
            **wide,
        ),
        # metadata, activations, views
        Case("id >= E writes zeros", n=192, k=320, sizes=[64, 70, 3], ids=[2, 5, 0], num_experts=3, config=big),
        Case("bf16 activations", n=192, k=320, bf16_a=True, expert_scales=True, **wide),
        Case("token-major A scales", n=192, k=320, token_major_scales=True, **wide),
        Case("out= padded rows (TMA store)", n=192, k=320, out_view="padded", **wide),
        Case("out= offset view (no TMA store)", n=192, k=320, out_view="offset", **wide),
        Case("K=96, 20 tokens (boxes past the tensor)", n=256, k=96, sizes=[20], ids=[0], num_experts=1, config=big),
        Case("swap-AB config (portable)", n=192, k=320, config=swap, expect="fp8_blocks", **ragged),
        Case("cached plan, new tensors", n=192, k=320, repeat=True, expert_scales=True, **wide),
        Case(
            "many groups (40), default config",
            n=256,
            k=128,
            sizes=[(7 * g) % 150 for g in range(40)],
            ids=[(g % 9) - (1 if g % 13 == 0 else 0) for g in range(40)],
            num_experts=8,
        ),
    ]
    if large:  # default configs
        listed += [
            Case(
                "E4x1024 N2048 K2048 swiglu bias",
                n=2048,
                k=2048,
                sizes=[1024] * 4,
                ids=[0, 1, 2, 3],
                num_experts=4,
                epilogue="swiglu",
                bias=torch.bfloat16,
                expert_scales=True,
                extra_rows=0,
            ),
            Case(
                "E8x2048 N4096 K7168",
                n=4096,
                k=7168,
                sizes=[2048] * 8,
                ids=list(range(8)),
                num_experts=8,
                extra_rows=0,
                timed=True,
            ),
            Case(
                "E16x4096 N7168 K2048",
                n=7168,
                k=2048,
                sizes=[4096] * 16,
                ids=list(range(16)),
                num_experts=16,
                extra_rows=0,
                timed=True,
            ),
        ]
    return listed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--dry-run", action="store_true", help="CPU, Triton interpreter: the portable backend only")
    parser.add_argument("--cases", default="", help="comma-separated substrings of case names (default: all)")
    args = parser.parse_args()
    if not args.dry_run and not torch.cuda.is_available():
        print("needs a CUDA GPU (or --dry-run)")
        return 1
    device = torch.device("cpu" if args.dry_run else "cuda")
    where = "CPU (interpreter)" if args.dry_run else torch.cuda.get_device_name(0)
    lines = [
        f"# FP8-blocks grouped matmul backends through lk.grouped_matmul, {where}",
        f"\ntorch {torch.__version__}, Triton {triton.__version__}. Error: Frobenius / max, relative to the float64 "
        "reference of the quantized operands; bounds "
        + ", ".join(f"{str(dtype)[6:]} {fro:g} / {worst:g}" for dtype, (fro, worst) in BOUNDS.items())
        + ".\n",
        "| case | backend (expected) | error | -1 / out-of-range rows zero | rows outside groups untouched | time | "
        "verdict |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    failures = 0
    wanted = [word for word in args.cases.split(",") if word]
    for index, case in enumerate(cases(large=not args.dry_run)):
        if wanted and not any(word in case.name for word in wanted):
            continue
        try:
            r = run_case(case, device, seed=index)
            verdict = "ok" if r["ok"] else "FAIL"
            row = (
                f"| {case.name} | {r['backends']} ({r['expect']}) | {r['fro']:.2e} / {r['worst']:.2e} | {r['zeros']} | "
                f"{r['untouched']} | {r['timing']} | {verdict} |"
            )
        except Exception as error:  # noqa: BLE001 - a failing case is a finding; the run goes on
            traceback.print_exc()
            verdict = "FAIL"
            row = f"| {case.name} | | error: {type(error).__name__}: {str(error)[:200]} | | | | FAIL |".replace(
                "\n", " "
            )
        failures += verdict != "ok"
        lines.append(row)
        print(f"[{time.perf_counter() - START:6.1f}s] {row}", flush=True)
        with open(args.out, "w") as file:
            file.write("\n".join(lines) + "\n")
    lines.append(f"\n{failures} failing case(s); {time.perf_counter() - START:.0f} s.")
    with open(args.out, "w") as file:
        file.write("\n".join(lines) + "\n")
    print(lines[-1])
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
