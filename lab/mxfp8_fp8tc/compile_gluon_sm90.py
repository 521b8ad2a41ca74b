"""Compile the Gluon MXFP8 grouped matmul (gluon_kernel.py, variants v1 and v2) for sm_90a without a GPU.

    PYTHONPATH=src python3 lab/mxfp8_fp8tc/compile_gluon_sm90.py [--out lab/mxfp8_fp8tc/results/compile_gluon_sm90.md]
        [--sass DIR]

Per variant: ``triton.compile`` ahead of time (``GPUTarget("cuda", 90, 32)``, the wheel's ptxas; nothing runs),
then: the wgmma kinds in the PTX (must be only ``m64n128k32.f32.e4m3.e4m3``), ``wgmma.wait_group`` counts by
argument, ``setmaxnreg`` values, shared memory, registers per thread (the launch's maxnreg), spills (``ptxas -v``),
ptxas warnings (C7515: wgmma serialized), and from the SASS: QGMMA kinds and count, ``WARPGROUP.DEPBAR.LE`` waits
(gsb0 0x0 = full, 0x1 = one group left in flight), and inside the K loops (the SASS loops, found from backward
branches, that hold a QGMMA): instructions, QGMMA, DEPBAR, FFMA, FMUL, loads and spill instructions (STL/LDL).
Exits 1 if a variant fails to compile, has a wgmma kind other than e4m3.e4m3 m64n128k32, or spills in a K loop.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import traceback

os.environ["TRITON_INTERPRET"] = "0"
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import triton  # noqa: E402
from gluon_kernel import (  # noqa: E402
    CONSUMER_REGS,
    LOADER_REGS,
    MAX_REGS,
    VARIANTS,
    Mxfp8GluonConfig,
    compile_signature,
    mxfp8_fp8tc_kernel,
)
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.experimental.gluon._runtime import GluonASTSource  # noqa: E402

_BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
EXPECTED_KIND = "m64n128k32.f32.e4m3.e4m3"
# extra rows of the table: the ring depths around the defaults (shared memory: v1 48 KB a stage, v2 32 KB)
EXTRA = [  # the options one at a time, then combined
    Mxfp8GluonConfig("v1", 3, "bf16"),
    Mxfp8GluonConfig("v2", 4, "bf16"),
    Mxfp8GluonConfig("v2", 4, "fp32"),
    Mxfp8GluonConfig("v2", 4, "bf16", late=True),
    Mxfp8GluonConfig("v1", 3, "bf16", volatile=True),
    Mxfp8GluonConfig("v2", 4, "bf16", volatile=True),
    Mxfp8GluonConfig("v1", 3, "bf16", tie=True),
    Mxfp8GluonConfig("v2", 4, "fp32", tie=True),
    Mxfp8GluonConfig("v2", 4, "bf16", volatile=True, tie=True),
    Mxfp8GluonConfig("v2", 4, "bf16", late=True, tie=True),
    Mxfp8GluonConfig("v1", 3, "bf16", late=True, tie=True),
    Mxfp8GluonConfig("v2", 3, "bf16", tie=True),
]


def _run(*command: str) -> str:
    done = subprocess.run(command, capture_output=True, text=True)
    return done.stdout + done.stderr


def _ptxas() -> str:
    from triton.backends.nvidia import compiler

    try:
        return compiler.get_ptxas(90).path
    except TypeError:
        return compiler.get_ptxas().path


def compile_config(config: Mxfp8GluonConfig):
    signature, constexprs = compile_signature(config)
    names = mxfp8_fp8tc_kernel.arg_names
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n, t in signature.items() if t.startswith("*")}
    for name in ("stride_a_exp_row", "stride_bf_expert", "stride_bf_k32", "stride_out_row", "K", "N"):
        attrs[(names.index(name),)] = [["tt.divisibility", 16]]
    source = GluonASTSource(
        mxfp8_fp8tc_kernel,
        signature,
        constexprs={(names.index(n),): v for n, v in constexprs.items()},
        attrs=attrs,
    )
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, maxnreg=MAX_REGS))


_SASS_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")


def k_loops(sass: str) -> list[list[str]]:
    """The innermost SASS loops that hold a QGMMA (a predicated backward branch's target to the branch; a loop
    that encloses another such loop, e.g. a tile loop, is left out)."""
    lines = [(int(m.group(1), 16), m.group(2)) for m in _SASS_LINE.finditer(sass)]
    ranges = []
    for address, text in lines:
        # predicated backward branches only: an unconditional one is the return of an out-of-line mbarrier
        # try-wait retry stub placed after the function's body
        branch = re.search(r"^@!?U?P\w+\s+BRA\b.*?0x([0-9a-f]+)", text)
        if branch and int(branch.group(1), 16) < address:
            start = int(branch.group(1), 16)
            if any("QGMMA" in t for a, t in lines if start <= a <= address):
                ranges.append((start, address))
    inner = [r for r in ranges if not any(o != r and r[0] <= o[0] and o[1] <= r[1] for o in ranges)]
    return [[t for a, t in lines if start <= a <= end] for start, end in sorted(set(inner))]


def _count(pattern: str, lines) -> int:
    return sum(1 for t in lines if re.search(pattern, t))


def inspect(compiled) -> dict:
    ptx, cubin = compiled.asm["ptx"], compiled.asm["cubin"]
    kinds = sorted(set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+\.\w+\.\w+\.\w+)", ptx)))
    waits = {}
    for arg in re.findall(r"wgmma\.wait_group\.sync\.aligned\s+(\d+)", ptx):
        waits[arg] = waits.get(arg, 0) + 1
    with tempfile.TemporaryDirectory() as folder:
        ptx_path, cubin_path = os.path.join(folder, "k.ptx"), os.path.join(folder, "k.cubin")
        with open(ptx_path, "w") as file:
            file.write(ptx)
        with open(cubin_path, "wb") as file:
            file.write(cubin)
        verbose = _run(_ptxas(), "--gpu-name=sm_90a", "-v", ptx_path, "-o", os.path.join(folder, "v.cubin"))
        sass = _run(os.path.join(_BIN, "cuobjdump"), "-sass", cubin_path)
        usage = _run(os.path.join(_BIN, "cuobjdump"), "-res-usage", cubin_path)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", verbose)
    warnings = sorted(
        set(re.findall(r"warning\s*:?\s*(.{0,160})", verbose)) | set(re.findall(r"\((C75\d\d)\)", verbose))
    )
    loops = []
    for body in k_loops(sass):
        loops.append(
            dict(
                instructions=len(body),
                qgmma=_count(r"\bQGMMA\.", body),
                depbar0=_count(r"WARPGROUP\.DEPBAR\.LE\s+gsb0,\s*0x0", body),
                depbar1=_count(r"WARPGROUP\.DEPBAR\.LE\s+gsb0,\s*0x1", body),
                ffma=_count(r"^(@!?U?P\w+\s+)?FFMA\b", body),
                fmul=_count(r"^(@!?U?P\w+\s+)?FMUL\b", body),
                ldg=_count(r"\bLDG\b", body),
                lds=_count(r"\bLDS\b", body),
                spill=_count(r"\b(STL|LDL)\b", body),
            )
        )
    return dict(
        wgmma=kinds,
        wgmma_count=len(re.findall(r"wgmma\.mma_async", ptx)),
        waits=waits,
        setmaxnreg=sorted(set(re.findall(r"setmaxnreg\.(?:inc|dec)\.sync\.aligned\.u32\s+(\d+)", ptx))),
        shared=compiled.metadata.shared,
        registers=int(re.search(r"REG:(\d+)", usage).group(1)),
        spill_stores=int(spill.group(1)) if spill else -1,
        spill_loads=int(spill.group(2)) if spill else -1,
        stl_ldl=len(re.findall(r"\b(STL|LDL)\b", sass)),
        qgmma=len(re.findall(r"\bQGMMA\.", sass)),
        qgmma_kinds=sorted(set(re.findall(r"QGMMA\.(\w+\.\w+\.\w+\.\w+)", sass))),
        full_waits=len(re.findall(r"WARPGROUP\.DEPBAR\.LE\s+gsb0,\s*0x0", sass)),
        waits_le1=len(re.findall(r"WARPGROUP\.DEPBAR\.LE\s+gsb0,\s*0x1", sass)),
        loops=loops,
        warnings=warnings,
        sass=sass,
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="", help="markdown file to write the table to")
    parser.add_argument("--sass", default="", help="folder to write each variant's SASS to")
    parser.add_argument("--only", default="", help="comma-separated indices into VARIANTS + EXTRA (default: all)")
    args = parser.parse_args()
    lines = [
        f"Triton {triton.__version__}, target sm_90a, ptxas {os.path.basename(_ptxas())}; launch num_warps=4, "
        f"maxnreg={MAX_REGS} (setmaxnreg {CONSUMER_REGS.value} consumers / {LOADER_REGS.value} load warp)",
        "",
        "| variant | wgmma (PTX) | wait_group N x count | setmaxnreg | smem B | regs | spill st/ld B | STL/LDL | "
        "QGMMA (SASS) | DEPBAR 0x0 / 0x1 | K loops: instr, QGMMA, DEPBAR 0/1, FFMA, FMUL, LDG, LDS, spill instr | "
        "ptxas warnings | verdict |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    print("\n".join(lines), flush=True)
    failed = False
    configs = VARIANTS + EXTRA
    if args.only:
        configs = [configs[int(i)] for i in args.only.split(",")]
    for config in configs:
        try:
            result = inspect(compile_config(config))
        except Exception as error:  # noqa: BLE001 - report and go on
            failed = True
            row = f"| {config.label} | COMPILE ERROR: {type(error).__name__}: {str(error)[:600]} |"
            row = row.replace("\n", " ")
            lines.append(row)
            print(row, flush=True)
            traceback.print_exc(file=sys.stderr)
            continue
        loop_spills = sum(loop["spill"] for loop in result["loops"])
        bad_kind = result["wgmma"] != [EXPECTED_KIND]
        verdict = []
        if bad_kind:
            verdict.append("WRONG wgmma kind")
        if loop_spills:
            verdict.append("SPILLS IN K LOOP")
        if any("C7515" in w for w in result["warnings"]):
            verdict.append("wgmma serialized (C7515)")
        if config in VARIANTS and (bad_kind or loop_spills):
            failed = True
        if args.sass:
            os.makedirs(args.sass, exist_ok=True)
            with open(os.path.join(args.sass, config.label.replace(" ", "_") + ".sass"), "w") as file:
                file.write(result["sass"])
        waits = ", ".join(f"{k} x{v}" for k, v in sorted(result["waits"].items()))
        loops = "; ".join(
            f"{lp['instructions']}, {lp['qgmma']}, {lp['depbar0']}/{lp['depbar1']}, {lp['ffma']}, {lp['fmul']}, "
            f"{lp['ldg']}, {lp['lds']}, {lp['spill']}"
            for lp in result["loops"]
        )
        row = (
            f"| {config.label} | {','.join(result['wgmma'])} ({result['wgmma_count']}) | {waits} | "
            f"{','.join(result['setmaxnreg'])} | {result['shared']} | {result['registers']} | "
            f"{result['spill_stores']}/{result['spill_loads']} | {result['stl_ldl']} | {result['qgmma']} "
            f"{','.join(result['qgmma_kinds'])} | {result['full_waits']} / {result['waits_le1']} | {loops or '-'} | "
            f"{'; '.join(result['warnings']) or '-'} | {', '.join(verdict) or 'ok'} |"
        )
        lines.append(row)
        print(row, flush=True)
    if args.out:
        with open(args.out, "w") as file:
            file.write("\n".join(lines) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
