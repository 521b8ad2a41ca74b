"""Compile the w4a8 grouped matmul prototype's configs for sm_90a without a GPU and print what each one runs.

    python3 lab/w4a8/compile_sm90.py [--arch 90] [--out lab/w4a8/results/compile_sm90.md]

Each config of ``kernel.SWEEPS`` on the E8x2048 N4096 K7168 problem: :func:`kernel.plan_launch` on meta-device
stand-ins, arguments specialized as Triton's launcher would (``native_specialize_impl``: 16-byte aligned pointers,
ints divisible by 16, ints equal to 1 as constants), then ``triton.compile`` ahead of time for
``GPUTarget("cuda", arch, 32)`` (the wheel's ptxas; nothing is launched). Per config:

* wgmma kinds in the PTX (must all be ``...e4m3.e4m3``: the FP8 tensor cores, no bf16 upcast);
* shared memory, registers per thread (``cuobjdump -res-usage``), spill bytes (``ptxas -v``);
* SASS counts of the instructions that matter: QGMMA (fp8 wgmma), full waits (``WARPGROUP.DEPBAR.LE gsb0, 0x0``),
  the decode (``HMUL2``: the fp16 shift; ``F2FP``: packs and the fp16 → e4m3 conversion; ``LOP3``/``SHF``/``PRMT``:
  nibble and bit work) and the promotion (``FMUL``/``FFMA``), each the static count in the whole kernel (both
  branches), for NOTES.md's per-element cost estimate.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from types import SimpleNamespace

os.environ["TRITON_INTERPRET"] = "0"
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch
import triton
from kernel import SWEEPS, plan_launch, w4a8_grouped_matmul_kernel
from triton._C.libtriton import native_specialize_impl
from triton.backends.compiler import BaseBackend, GPUTarget
from triton.compiler import ASTSource

H100 = dict(shared=232448, registers=65536, max_threads=2048)
_BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
SHAPE = dict(experts=8, tokens=8 * 2048, n=4096, k=7168)
OPCODES = ["QGMMA", "HMUL2", "F2FP", "LOP3", "SHF", "PRMT", "IMAD", "FMUL", "FFMA", "LDS", "STS", "LDGSTS", "BAR"]


def meta_launch(config):
    meta = dict(device="meta")
    t, e, n, k = SHAPE["tokens"], SHAPE["experts"], SHAPE["n"], SHAPE["k"]
    a = SimpleNamespace(data=torch.empty(t, k, dtype=torch.uint8, **meta), scales=torch.empty(t, k // 128, **meta))
    w = SimpleNamespace(
        data=torch.empty(e, n, k // 2, dtype=torch.uint8, **meta),
        scales=torch.empty(e, n, k // 32, dtype=torch.uint8, **meta),
    )
    out = torch.empty(t, n, dtype=torch.bfloat16, **meta)
    offsets = torch.empty(e + 1, dtype=torch.int32, **meta)
    ids = torch.empty(e, dtype=torch.int32, **meta)
    return plan_launch(a, w, offsets, ids, out, config)


def specialize(arguments: dict, constexprs: dict):
    """``(signature, constants, attrs)`` as Triton's launcher specializes these arguments."""
    signature, constants, attrs = {}, {}, {}
    for index, name in enumerate(w4a8_grouped_matmul_kernel.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
            constants[(index,)] = constexprs[name]
            continue
        kind, key = native_specialize_impl(BaseBackend, arguments[name], False, True, True)[:2]
        signature[name] = kind
        if kind == "constexpr":
            constants[(index,)] = key
        elif key == "D":
            attrs[(index,)] = [["tt.divisibility", 16]]
    return signature, constants, attrs


def _ptxas(arch: int) -> str:
    from triton.backends.nvidia import compiler

    try:
        return compiler.get_ptxas(arch).path
    except TypeError:
        return compiler.get_ptxas().path


def _run(*command: str) -> str:
    done = subprocess.run(command, capture_output=True, text=True)
    return done.stdout + done.stderr


def fast_loop(sass: str) -> list[str]:
    """The SASS lines of the branch-free K loop: of the loops (a backward branch and its target) that hold a
    QGMMA, the one with the fewest QGMMAs (the checking loop holds both branches' QGMMAs)."""
    lines = [
        (int(m.group(1), 16), line) for line in sass.splitlines() if (m := re.match(r"\s*/\*([0-9a-f]{4,})\*/", line))
    ]
    best = []
    for address, line in lines:
        branch = re.search(r"\bBRA\s+(?:`\(\.L_x_\d+\)\s*)?0x([0-9a-f]+)", line)
        if not branch or int(branch.group(1), 16) >= address:
            continue
        body = [text for where, text in lines if int(branch.group(1), 16) <= where <= address]
        qgmma = sum("QGMMA" in text for text in body)
        if qgmma and (not best or qgmma < sum("QGMMA" in text for text in best)):
            best = body
    return best


def inspect(compiled, arch: int) -> dict:
    ptx, cubin = compiled.asm["ptx"], compiled.asm["cubin"]
    kinds = sorted(set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+\.\w+\.\w+\.\w+)", ptx)))
    with tempfile.TemporaryDirectory() as folder:
        ptx_path, cubin_path = os.path.join(folder, "k.ptx"), os.path.join(folder, "k.cubin")
        with open(ptx_path, "w") as file:
            file.write(ptx)
        with open(cubin_path, "wb") as file:
            file.write(cubin)
        verbose = _run(_ptxas(arch), f"--gpu-name=sm_{arch}a", "-v", ptx_path, "-o", os.path.join(folder, "v.cubin"))
        sass = _run(os.path.join(_BIN, "cuobjdump"), "-sass", cubin_path)
        usage = _run(os.path.join(_BIN, "cuobjdump"), "-res-usage", cubin_path)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", verbose)
    counts = {op: len(re.findall(rf"\b{op}\b[.\s]", sass)) for op in OPCODES}
    counts["F2FP.e4m3"] = len(re.findall(r"F2FP\.SATFINITE\.E4M3", sass))
    loop = fast_loop(sass)
    loop_text = "\n".join(loop)
    loop_counts = {op: len(re.findall(rf"\b{op}\b[.\s]", loop_text)) for op in OPCODES}
    loop_counts["all"] = len(loop)
    loop_counts["spills"] = len(re.findall(r"\b(STL|LDL)\b", loop_text))
    return dict(
        wgmma=kinds,
        shared=compiled.metadata.shared,
        registers=int(re.search(r"REG:(\d+)", usage).group(1)),
        spills=f"{spill.group(1)}/{spill.group(2)}" if spill else "?",
        full_waits=len(re.findall(r"WARPGROUP\.DEPBAR\.LE\s+gsb0,\s*0x0", sass)),
        counts=counts,
        loop=loop_counts,
        c7515="C7515" in verbose,
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90)
    parser.add_argument("--out", default="", help="also write the table to this markdown file")
    args = parser.parse_args()
    lines = [
        f"# w4a8 prototype compiled for sm_{args.arch}a (Triton {triton.__version__}, no GPU)",
        "",
        f"Problem E{SHAPE['experts']}x{SHAPE['tokens'] // SHAPE['experts']} N{SHAPE['n']} K{SHAPE['k']}, bf16 out. "
        "SASS counts are static (whole kernel: fast branch + four-dot branch + prologue/epilogue).",
        "",
        "| regime | config | wgmma (PTX) | smem B | regs | spill st/ld B | full waits | "
        + " | ".join(OPCODES + ["F2FP.e4m3"])
        + " | programs/SM | verdict |",
        "| --- " * (10 + len(OPCODES)) + "|",
    ]
    loop_lines = [
        "",
        "Branch-free K loop (one 128-K step per iteration), SASS instructions per thread and iteration:",
        "",
        "| config | all | spill ld/st | " + " | ".join(OPCODES) + " |",
        "| --- " * (3 + len(OPCODES)) + "|",
    ]
    failed = 0
    for regime, configs in SWEEPS.items():
        for index, config in enumerate(configs):
            _, arguments, constexprs, options = meta_launch(config)
            signature, constants, attrs = specialize(arguments, constexprs)
            source = ASTSource(w4a8_grouped_matmul_kernel, signature, constexprs=constants, attrs=attrs)
            label = config.label + (" (default)" if index == 0 else "")
            try:
                compiled = triton.compile(source, target=GPUTarget("cuda", args.arch, 32), options=options)
            except Exception as error:  # noqa: BLE001 - a compile failure is a finding
                text = [line for line in str(error).splitlines() if line.strip()]
                lines.append(f"| {regime} | {label} | compile error: {text[-1][:150] if text else error} |")
                failed += index == 0
                print(lines[-1], flush=True)
                continue
            result = inspect(compiled, args.arch)
            threads = 32 * config.num_warps
            fit = min(
                H100["shared"] // max(result["shared"], 1),
                H100["registers"] // (result["registers"] * threads),
                H100["max_threads"] // threads,
            )
            problems = []
            if not result["wgmma"] or not all(kind.endswith("e4m3.e4m3") for kind in result["wgmma"]):
                problems.append("no e4m3 wgmma")
            if fit < 1:
                problems.append("does not fit an SM")
            if result["c7515"]:
                problems.append("ptxas C7515 (serialized wgmma)")
            failed += bool(problems) and index == 0
            counts = " | ".join(str(result["counts"][op]) for op in OPCODES + ["F2FP.e4m3"])
            lines.append(
                f"| {regime} | {label} | {', '.join(result['wgmma'])} | {result['shared']} | {result['registers']} "
                f"| {result['spills']} | {result['full_waits']} | {counts} | {fit} | {', '.join(problems) or 'ok'} |"
            )
            print(lines[-1], flush=True)
            loop = result["loop"]
            loop_lines.append(
                f"| {label} | {loop['all']} | {loop['spills']} | " + " | ".join(str(loop[op]) for op in OPCODES) + " |"
            )
            print(loop_lines[-1], flush=True)
    lines += loop_lines
    if args.out:
        with open(args.out, "w") as file:
            file.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
