"""Compile the FP8 attention prototype (fp8_attention.py) for sm_90a without a GPU and print what it runs.

    python lab/gluon_fp8_attention/compile_check.py [--sass DIR]

Per variant (D = 128, 64 and 256, non-causal and causal; keys permuted (default) or P reshuffled across lanes): the wgmma kinds in the PTX (both products must be e4m3 x e4m3:
``m64n{keys}k32`` for S = Q K^T from shared memory, ``m64n{D}k32`` for P V with P in registers; 64-key tiles
at D = 256), ``wgmma.wait_group``
counts by argument, ``setmaxnreg`` values, shared memory, registers per thread, spills (``ptxas -v`` with the
wheel's ptxas), ptxas warnings (C7515 / C7510: wgmma serialized), and SASS counts: QGMMA / HGMMA, full waits,
SHFL (P's register reshuffle from the accumulator layout to the e4m3 A-operand layout), STS / LDS (shared
stores / loads: the V transpose and the tile handoff), PRMT (byte permutes), F2FP (fp32 -> e4m3 packs), MUFU.EX2.
tools/sass_hazards.py's count (register-A wgmma fragments written while in flight). Exits 1 if a variant fails
to compile or its wgmmas are not all e4m3 x e4m3. Run with TRITON_INTERPRET unset. For the GPU machine's Triton
3.6: ``PYTHONPATH=/path/to/triton-3.6 python lab/gluon_fp8_attention/compile_check.py``.
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
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import triton  # noqa: E402
from fp8_attention import compile_for_sm90  # noqa: E402

_BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
_HAZARDS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tools", "sass_hazards.py")


def _hazards(sass: str) -> str:
    """tools/sass_hazards.py (writes to a register-A wgmma's fragment while it may be in flight) on this SASS,
    with QGMMA read as HGMMA (the tool knows the HGMMA spelling; the A fragment is 4 registers in both)."""
    if not os.path.exists(_HAZARDS):
        return "tool not found"
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "k.sass")
        with open(path, "w") as file:
            file.write(sass.replace("QGMMA", "HGMMA"))
        out = _run(sys.executable, _HAZARDS, path).strip().splitlines()
    return out[-1].split(": ", 1)[-1] if out else "?"


def _run(*command: str) -> str:
    done = subprocess.run(command, capture_output=True, text=True)
    return done.stdout + done.stderr


def _ptxas() -> str:
    from triton.backends.nvidia import compiler

    try:
        return compiler.get_ptxas(90).path
    except TypeError:
        return compiler.get_ptxas().path


def inspect(compiled) -> dict:
    ptx, cubin = compiled.asm["ptx"], compiled.asm["cubin"]
    kinds = {}
    for kind in re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+\.\w+\.\w+\.\w+)", ptx):
        kinds[kind] = kinds.get(kind, 0) + 1
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

    def count(pattern):
        return len(re.findall(pattern, sass))

    return dict(
        wgmma=kinds,
        waits=waits,
        setmaxnreg=sorted(set(re.findall(r"setmaxnreg\.(?:inc|dec)\.sync\.aligned\.u32\s+(\d+)", ptx))),
        shared=compiled.metadata.shared,
        registers=int(re.search(r"REG:(\d+)", usage).group(1)),
        spills=f"{spill.group(1)}/{spill.group(2)}" if spill else "?",
        stl_ldl=count(r"\b(?:STL|LDL)\b"),
        qgmma=count(r"\bQGMMA\."),
        qgmma_kinds=sorted(set(re.findall(r"QGMMA\.(\w+\.\w+\.\w+\.\w+)", sass))),
        hgmma=count(r"\bHGMMA\."),
        full_waits=count(r"WARPGROUP\.DEPBAR\.LE\s+gsb0,\s*0x0"),
        shfl=count(r"\bSHFL\."),
        sts=count(r"\bSTS\b|\bSTS\."),
        lds=count(r"\bLDS\b|\bLDS\."),
        prmt=count(r"\bPRMT\b"),
        f2fp=count(r"\bF2FP\."),
        ex2=count(r"MUFU\.EX2"),
        warnings=warnings,
        hazards=_hazards(sass),
        sass=sass,
        ptx=ptx,
        ttgir=compiled.asm.get("ttgir", ""),
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sass", default="", help="write each variant's SASS, PTX and TTGIR into this folder")
    args = parser.parse_args()
    print(f"Triton {triton.__version__}, ptxas {_ptxas()}")
    failed = False
    # (D, causal, permute_keys, stages, fused_pv[, pingpong]); the first two are the defaults
    variants = (
        (128, False, True, 2, True),
        (128, True, True, 2, True),
        (128, False, True, 3, True),
        (128, True, True, 3, True),
        (64, False, True, 2, True),
        (64, True, True, 2, True),
        (256, False, True, 2, True),
        (256, True, True, 2, True),
        (128, False, True, 2, False),
        (128, True, True, 2, False),
        (128, False, False, 2, False),
        (128, True, False, 2, False),
        (128, False, True, 2, True, True),
        (64, False, True, 2, True, True),
    )
    for head_dim, causal, permute, stages, fused, *pingpong in variants:
        label = (
            f"D={head_dim} {'causal' if causal else 'full'} {'permuted keys' if permute else 'P reshuffled'} "
            f"{stages} stages {'fused P V' if fused else 'loop-carried P'}{' ping-pong' if pingpong else ''}"
        )
        try:
            result = inspect(compile_for_sm90(head_dim, causal, permute, stages, fused, bool(pingpong)))
        except Exception as error:  # noqa: BLE001 - report and go on
            failed = True
            print(f"{label}: COMPILE ERROR {type(error).__name__}: {str(error)[:3000]}")
            traceback.print_exc(file=sys.stderr)
            continue
        if not result["wgmma"] or any("e4m3.e4m3" not in kind for kind in result["wgmma"]):
            failed = True
        if args.sass:
            os.makedirs(args.sass, exist_ok=True)
            stem = os.path.join(
                args.sass,
                f"fp8_attention_d{head_dim}_{'causal' if causal else 'full'}"
                f"{'' if permute else '_reshuffle'}_s{stages}{'' if fused else '_carried'}",
            )
            for ext in ("sass", "ptx", "ttgir"):
                with open(f"{stem}.{ext}", "w") as file:
                    file.write(result[ext])
        print(f"{label}:")
        print(f"  wgmma (PTX): {', '.join(f'{k} x{v}' for k, v in sorted(result['wgmma'].items()))}")
        print(f"  QGMMA (SASS): {result['qgmma']} {','.join(result['qgmma_kinds'])}; HGMMA {result['hgmma']}")
        print(
            f"  wgmma.wait_group: {', '.join(f'{k} x{v}' for k, v in sorted(result['waits'].items()))}; "
            f"full waits in SASS {result['full_waits']}"
        )
        print(
            f"  setmaxnreg: {','.join(result['setmaxnreg'])}; registers/thread (launch) {result['registers']}; "
            f"spill stores/loads {result['spills']} B; STL/LDL {result['stl_ldl']}"
        )
        print(f"  shared memory: {result['shared']} B")
        print(
            f"  SASS: SHFL {result['shfl']}, STS {result['sts']}, LDS {result['lds']}, PRMT {result['prmt']}, "
            f"F2FP {result['f2fp']}, MUFU.EX2 {result['ex2']}"
        )
        print(
            f"  ptxas warnings: {'; '.join(result['warnings']) or '-'}; sass_hazards: {result['hazards']}", flush=True
        )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
