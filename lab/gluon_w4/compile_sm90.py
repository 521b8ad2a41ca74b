"""Compile the LAB Gluon w4 kernels (gluon_kernel.py: bf16 mode; gluon_w4a8.py: e4m3 mode) for sm_90a without a
GPU, and read what ptxas made of them.

    PYTHONPATH=src python3 lab/gluon_w4/compile_sm90.py [--mode bf16|e4m3|both] [--out FILE.md] [--sass DIR]

Per config: ``triton.compile`` ahead of time (``GPUTarget("cuda", 90, 32)``, the wheel's ptxas; nothing runs), then: the
wgmma kinds in the PTX (bf16 mode must be ``.bf16.bf16`` with A from registers: the PTX's A operand is a ``{...}``
register list, not a descriptor; e4m3 mode ``.e4m3.e4m3`` with A from registers), ``wgmma.wait_group`` counts by
argument, ``setmaxnreg``, shared memory, registers, spills (``ptxas -v``), ptxas warnings (C751x: wgmma serialized), and
inside the K loop (the innermost SASS loop holding an HGMMA): instructions, HGMMA, ``WARPGROUP.DEPBAR`` waits by
argument, LDS / STS (a STS in the loop means the decoded values went through shared memory between decode and wgmma),
HFMA2, LOP3, SHF/SHL, PRMT, LDG, FMUL, FFMA and spill instructions (STL/LDL). Exits 1 if a config fails to compile, has
a wgmma kind other than its mode's with A from registers, a STS or a spill in its K loop.
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

import gluon_kernel  # noqa: E402
import gluon_w4a8  # noqa: E402
import triton  # noqa: E402
from gluon_kernel import CONSUMER_REGS, LOADER_REGS, MAX_REGS  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.experimental.gluon._runtime import GluonASTSource  # noqa: E402

_BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


def _run(*command: str) -> str:
    done = subprocess.run(command, capture_output=True, text=True)
    return done.stdout + done.stderr


def _tool(name: str) -> str:
    """The wheel's tool for sm_90 (ptxas: the one Triton itself runs; the plain bin/ptxas may be too old for
    the PTX version Triton emits)."""
    from triton.backends.nvidia import compiler

    if name != "ptxas":
        return os.path.join(_BIN, name)

    try:
        return getattr(compiler, f"get_{name}")(90).path
    except TypeError:
        return getattr(compiler, f"get_{name}")().path


def compile_config(config):
    if config.mode == "e4m3":
        module, kernel, divisible = gluon_w4a8, gluon_w4a8.w4a8_gluon_kernel, ()
    else:
        module, kernel, divisible = gluon_kernel, gluon_kernel.w4_bf16_gluon_kernel, ()
    signature, constexprs = module.compile_signature(config)
    names = kernel.arg_names
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n, t in signature.items() if t.startswith("*")}
    for name in ("stride_out_row", "K", "N") + divisible:
        attrs[(names.index(name),)] = [["tt.divisibility", 16]]
    source = GluonASTSource(
        kernel,
        signature,
        constexprs={(names.index(n),): v for n, v in constexprs.items()},
        attrs=attrs,
    )
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, maxnreg=MAX_REGS))


_SASS_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")


def k_loops(sass: str) -> list[list[str]]:
    """The innermost SASS loops that hold an HGMMA (predicated backward branches only: an unconditional one is
    the return of an out-of-line mbarrier retry stub)."""
    lines = [(int(m.group(1), 16), m.group(2)) for m in _SASS_LINE.finditer(sass)]
    ranges = []
    for address, text in lines:
        branch = re.search(r"^@!?U?P\w+\s+BRA\b.*?0x([0-9a-f]+)", text)
        if branch and int(branch.group(1), 16) < address:
            start = int(branch.group(1), 16)
            if any("HGMMA" in t or "QGMMA" in t for a, t in lines if start <= a <= address):
                ranges.append((start, address))
    inner = [r for r in ranges if not any(o != r and r[0] <= o[0] and o[1] <= r[1] for o in ranges)]
    return [[t for a, t in lines if start <= a <= end] for start, end in sorted(set(inner))]


def _count(pattern: str, lines) -> int:
    return sum(1 for t in lines if re.search(pattern, t))


def inspect(compiled) -> dict:
    ptx, cubin = compiled.asm["ptx"], compiled.asm["cubin"]
    mmas = re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+\.\w+\.\w+\.\w+)\s+\{[^}]*\},\s*(\S)", ptx)
    kinds = sorted({kind + (" A-regs" if first == "{" else " A-smem") for kind, first in mmas})
    waits = {}
    for arg in re.findall(r"wgmma\.wait_group\.sync\.aligned\s+(\d+)", ptx):
        waits[arg] = waits.get(arg, 0) + 1
    with tempfile.TemporaryDirectory() as folder:
        ptx_path, cubin_path = os.path.join(folder, "k.ptx"), os.path.join(folder, "k.cubin")
        with open(ptx_path, "w") as file:
            file.write(ptx)
        with open(cubin_path, "wb") as file:
            file.write(cubin)
        verbose = _run(_tool("ptxas"), "--gpu-name=sm_90a", "-v", ptx_path, "-o", os.path.join(folder, "v.cubin"))
        sass = _run(_tool("cuobjdump"), "-sass", cubin_path)
        usage = _run(_tool("cuobjdump"), "-res-usage", cubin_path)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", verbose)
    warnings = sorted(
        set(re.findall(r"warning\s*:?\s*(.{0,160})", verbose))
        | {f"{code} {text[:90]}" for code, text in re.findall(r"\((C75\d\d)\)\s*([^\n]*)", verbose)}
    )
    loops = []
    for body in k_loops(sass):
        loops.append(
            dict(
                instructions=len(body),
                hgmma=_count(r"\b[HQ]GMMA\.", body),
                depbar0=_count(r"WARPGROUP\.DEPBAR\.LE\s+gsb0,\s*0x0", body),
                depbar1=_count(r"WARPGROUP\.DEPBAR\.LE\s+gsb0,\s*0x1", body),
                lds=_count(r"\bLDS\b", body),
                sts=_count(r"\bSTS\b", body),
                hfma2=_count(r"\b(HFMA2|HMUL2)\b", body),
                lop3=_count(r"\bLOP3\b", body),
                shift=_count(r"\b(SHF|SHL|SHR|IMAD\.SHL)\b", body),
                prmt=_count(r"\bPRMT\b", body),
                ldg=_count(r"\bLDG\b", body),
                fmul=_count(r"\bFMUL\b", body),
                ffma=_count(r"\bFFMA\b", body),
                spill=_count(r"\b(STL|LDL)\b", body),
            )
        )
    return dict(
        wgmma=kinds,
        wgmma_count=len(mmas),
        waits=waits,
        setmaxnreg=sorted(set(re.findall(r"setmaxnreg\.(?:inc|dec)\.sync\.aligned\.u32\s+(\d+)", ptx))),
        shared=compiled.metadata.shared,
        registers=int(re.search(r"REG:(\d+)", usage).group(1)) if re.search(r"REG:(\d+)", usage) else -1,
        spill_stores=int(spill.group(1)) if spill else -1,
        spill_loads=int(spill.group(2)) if spill else -1,
        stl_ldl=len(re.findall(r"\b(STL|LDL)\b", sass)),
        hgmma=len(re.findall(r"\b[HQ]GMMA\.", sass)),
        hgmma_kinds=sorted(set(re.findall(r"[HQ]GMMA\.(\w+\.\w+\.\w+(?:\.\w+)?)", sass))),
        loops=loops,
        warnings=warnings,
        sass=sass,
        ptx=ptx,
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="", help="markdown file to write the table to")
    parser.add_argument("--sass", default="", help="folder to write each config's SASS and PTX to")
    parser.add_argument("--mode", default="both", choices=("bf16", "e4m3", "both"))
    args = parser.parse_args()
    configs = (gluon_kernel.CONFIGS if args.mode != "e4m3" else []) + (
        gluon_w4a8.CONFIGS if args.mode != "bf16" else []
    )
    lines = [
        f"Triton {triton.__version__}, target sm_90a; launch num_warps=4, maxnreg={MAX_REGS} (setmaxnreg "
        f"{CONSUMER_REGS.value} consumers / {LOADER_REGS.value} load warp)",
        "",
        "| config | wgmma (PTX) | wait_group N x count | setmaxnreg | smem B | regs | spill st/ld B | STL/LDL | "
        "HGMMA (SASS) | K loops: instr, HGMMA, DEPBAR 0/1, LDS, STS, HFMA2+HMUL2, LOP3, shifts, PRMT, LDG, FMUL, FFMA, "
        "spill | "
        "ptxas warnings | verdict |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    print("\n".join(lines), flush=True)
    failed = False
    for config in configs:
        try:
            result = inspect(compile_config(config))
        except Exception as error:  # noqa: BLE001 - report and go on
            failed = True
            row = f"| {config.label} | COMPILE ERROR: {type(error).__name__}: {str(error)[:800]} |".replace("\n", " ")
            lines.append(row)
            print(row, flush=True)
            traceback.print_exc(file=sys.stderr)
            continue
        verdict = []
        kind = "e4m3.e4m3 A-regs" if config.mode == "e4m3" else "bf16.bf16 A-regs"
        if not result["wgmma"] or any(not k.endswith(kind) for k in result["wgmma"]):
            verdict.append("WRONG wgmma kind")
        if sum(lp["spill"] for lp in result["loops"]):
            verdict.append("SPILLS IN K LOOP")
        if sum(lp["sts"] for lp in result["loops"]):
            verdict.append("STS IN K LOOP")
        if not result["loops"]:
            verdict.append("no K loop found")
        if any("C75" in str(w) for w in result["warnings"]):
            verdict.append("wgmma serialized")
        failed = failed or (
            bool(verdict) and not getattr(config, "cross_step", False)
        )  # "cross" is the known counter-example
        if args.sass:
            os.makedirs(args.sass, exist_ok=True)
            stem = os.path.join(args.sass, config.label.replace(" ", "_"))
            with open(stem + ".sass", "w") as file:
                file.write(result["sass"])
            with open(stem + ".ptx", "w") as file:
                file.write(result["ptx"])
        waits = ", ".join(f"{k} x{v}" for k, v in sorted(result["waits"].items()))
        loops = "; ".join(
            f"{lp['instructions']}, {lp['hgmma']}, {lp['depbar0']}/{lp['depbar1']}, {lp['lds']}, {lp['sts']}, "
            f"{lp['hfma2']}, {lp['lop3']}, {lp['shift']}, {lp['prmt']}, {lp['ldg']}, {lp['fmul']}, {lp['ffma']}, "
            f"{lp['spill']}"
            for lp in result["loops"]
        )
        row = (
            f"| {config.label} | {','.join(result['wgmma'])} ({result['wgmma_count']}) | {waits} | "
            f"{','.join(result['setmaxnreg'])} | {result['shared']} | {result['registers']} | "
            f"{result['spill_stores']}/{result['spill_loads']} | {result['stl_ldl']} | {result['hgmma']} "
            f"{','.join(result['hgmma_kinds'])} | {loops or '-'} | {'; '.join(result['warnings']) or '-'} | "
            f"{', '.join(verdict) or 'ok'} |"
        )
        lines.append(row)
        print(row, flush=True)
    if args.out:
        with open(args.out, "w") as file:
            file.write("\n".join(lines) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
