"""Compile the Gluon FP8-block grouped matmul (gluon_kernel.py) for sm_90a without a GPU and print what it runs.

    python3 lab/fp8_blocks/compile_gluon_sm90.py [--sass]
    PYTHONPATH=/path/to/triton-3.6 python3 lab/fp8_blocks/compile_gluon_sm90.py     # the lead's Triton

Per config: the wgmma kinds in the PTX (must be ``wgmma.mma_async...e4m3.e4m3``), ``wgmma.wait_group`` counts by
argument (``1`` = the pipelined variant keeps one wgmma group in flight while promoting), ``setmaxnreg`` values
(the partitions' register budgets), shared memory, the launch's registers per thread (``maxnreg``), spills
(``ptxas -v`` with the wheel's ptxas), ptxas warnings (C7515 / C7510: wgmma serialized), and in the SASS: QGMMA
instructions, full waits ``WARPGROUP.DEPBAR.LE gsb0, 0x0`` and spill instructions (STL/LDL). ``--sass`` dumps
each config's SASS next to this file's results/ folder for reading. Exits 1 if a config fails to compile or has
no e4m3 wgmma.
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

import triton
from gluon_kernel import ABLATION_CONFIGS, DEFAULT_CONFIG, MAX_REGS, GluonFp8Config, compile_signature, fp8_block_grouped_matmul_gluon_kernel
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource

_BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
CONFIGS = ABLATION_CONFIGS + [GluonFp8Config(128, 6, False, "vec", True), GluonFp8Config(128, 5, True)]


def _run(*command: str) -> str:
    done = subprocess.run(command, capture_output=True, text=True)
    return done.stdout + done.stderr


def _ptxas() -> str:
    from triton.backends.nvidia import compiler
    try:
        return compiler.get_ptxas(90).path
    except TypeError:
        return compiler.get_ptxas().path


def compile_config(config: GluonFp8Config, has_expert_scales: bool = False):
    signature, constexprs = compile_signature(config, has_expert_scales)
    names = fp8_block_grouped_matmul_gluon_kernel.arg_names
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n, t in signature.items() if t.startswith("*")}
    for name in ("stride_a_scale_row", "stride_b_scale_expert", "stride_out_row", "K", "N"):
        attrs[(names.index(name),)] = [["tt.divisibility", 16]]
    source = GluonASTSource(fp8_block_grouped_matmul_gluon_kernel, signature,
                            constexprs={(names.index(n),): v for n, v in constexprs.items()}, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, maxnreg=MAX_REGS))


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
    warnings = sorted(set(re.findall(r"warning\s*:?\s*(.{0,160})", verbose))
                      | set(re.findall(r"\((C75\d\d)\)", verbose)))
    return dict(
        wgmma=kinds, wgmma_count=len(re.findall(r"wgmma\.mma_async", ptx)), waits=waits,
        setmaxnreg=sorted(set(re.findall(r"setmaxnreg\.(?:inc|dec)\.sync\.aligned\.u32\s+(\d+)", ptx))),
        shared=compiled.metadata.shared, registers=int(re.search(r"REG:(\d+)", usage).group(1)),
        spill_stores=int(spill.group(1)) if spill else -1, spill_loads=int(spill.group(2)) if spill else -1,
        stl_ldl=len(re.findall(r"\b(STL|LDL)\b", sass)),
        qgmma=len(re.findall(r"\bQGMMA\.", sass)), hgmma=len(re.findall(r"\bHGMMA\.", sass)),
        full_waits=len(re.findall(r"WARPGROUP\.DEPBAR\.LE\s+gsb0,\s*0x0", sass)),
        waits_le1=len(re.findall(r"WARPGROUP\.DEPBAR\.LE\s+gsb0,\s*0x1", sass)),
        qgmma_kinds=sorted(set(re.findall(r"QGMMA\.(\w+\.\w+\.\w+\.\w+)", sass))),
        warnings=warnings, sass=sass)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sass", action="store_true", help="write each config's SASS to /tmp/gluon_fp8_*.sass")
    parser.add_argument("--configs", default="", help="comma-separated indices into CONFIGS (default: all, "
                        "then DEFAULT_CONFIG with expert_scales)")
    args = parser.parse_args()
    print(f"Triton {triton.__version__}, ptxas {_ptxas()}")
    print("| config | wgmma (PTX) | wait_group N x count | setmaxnreg | smem B | maxnreg | spill st/ld B | "
          "STL/LDL | QGMMA | DEPBAR 0 / 1 | ptxas warnings |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    failed = False
    todo = ([(CONFIGS[int(i)], False) for i in args.configs.split(",") if i] if args.configs
            else [(c, False) for c in CONFIGS] + [(DEFAULT_CONFIG, True)])
    for config, scales in todo:
        label = config.label + (" +expert_scales" if scales else "")
        try:
            result = inspect(compile_config(config, scales))
        except Exception as error:  # noqa: BLE001 - report and go on
            failed = True
            print(f"| {label} | COMPILE ERROR: {type(error).__name__}: {str(error)[:3000]} |")
            traceback.print_exc(file=sys.stderr)
            continue
        if not result["wgmma"] or any("e4m3.e4m3" not in kind for kind in result["wgmma"]):
            failed = True
        if args.sass:
            path = f"/tmp/gluon_fp8_{config.label.replace(' ', '_')}.sass"
            with open(path, "w") as file:
                file.write(result["sass"])
        waits = ", ".join(f"{k} x{v}" for k, v in sorted(result["waits"].items()))
        print(f"| {label} | {','.join(result['wgmma'])} ({result['wgmma_count']}) | {waits} | "
              f"{','.join(result['setmaxnreg'])} | {result['shared']} | {result['registers']} | "
              f"{result['spill_stores']}/{result['spill_loads']} | {result['stl_ldl']} | {result['qgmma']} "
              f"{','.join(result['qgmma_kinds'])} | {result['full_waits']} / {result['waits_le1']} | "
              f"{'; '.join(result['warnings']) or '-'} |", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
