"""Compile the MXFP8 per-32-K-promotion prototype for sm_90a without a GPU and print what it runs.

    python3 lab/mxfp8_fp8tc/compile_sm90.py [--arch 90]

Per config: ``triton.compile`` ahead of time (``GPUTarget("cuda", 90, 32)``, the wheel's ptxas; nothing is
launched), then from the PTX the wgmma kinds (must all be ``...e4m3.e4m3``: the FP8 tensor cores), from
``ptxas -v`` the spill bytes, from ``cuobjdump`` the registers per thread, and from the SASS the QGMMA count, the
full wgmma waits (``WARPGROUP.DEPBAR.LE gsb0, 0x0``; the promotion needs one per 32-K sub-step), and the FFMA /
FMUL counts (the promotion's CUDA-core work). Arguments are specialized as a launch on aligned tensors with M, N,
K multiples of 16 would be (pointers and ints carry ``tt.divisibility = 16``).
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

os.environ["TRITON_INTERPRET"] = "0"
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import triton
from kernel import mxfp8_grouped_matmul_kernel, mxfp8_matmul_kernel
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

_BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
H100 = dict(shared=232448, registers=65536)

# (block_m, block_n, block_k, num_warps, num_stages, promote_rowcol, out); "grouped" as out's suffix: the grouped
# kernel
CONFIGS = [
    (128, 128, 128, 8, 3, False, "bf16"),
    (128, 128, 128, 8, 3, True, "bf16"),
    (128, 256, 128, 8, 3, False, "bf16"),
    (64, 128, 128, 4, 4, False, "bf16"),
    (64, 128, 128, 4, 3, True, "bf16"),
    (64, 128, 32, 4, 2, True, "bf16"),
    (64, 64, 128, 4, 4, True, "bf16"),
    (128, 128, 64, 8, 4, False, "bf16"),
    (128, 128, 32, 8, 4, False, "bf16"),
    (128, 128, 128, 8, 3, False, "fp32"),
    (64, 128, 128, 4, 3, True, "bf16 grouped"),
    (64, 128, 128, 4, 3, False, "bf16 grouped"),
]


def _run(*command: str) -> str:
    done = subprocess.run(command, capture_output=True, text=True)
    return done.stdout + done.stderr


def compile_one(config, arch: int):
    block_m, block_n, block_k, warps, stages, rowcol, out = config
    if out.endswith(" grouped"):
        return compile_grouped(config, arch)
    signature = {"a_ptr": "*fp8e4nv", "a_exp_ptr": "*u8", "b_ptr": "*fp8e4nv", "b_exp_ptr": "*u8",
                 "out_ptr": "*" + out, "M": "i32", "N": "i32", "K": "i32", "stride_am": "i32",
                 "stride_aem": "i32", "stride_bn": "i32", "stride_ben": "i32", "stride_om": "i32",
                 "BLOCK_M": "constexpr", "BLOCK_N": "constexpr", "BLOCK_K": "constexpr",
                 "PROMOTE_ROWCOL": "constexpr", "EVEN_K": "constexpr"}
    names = mxfp8_matmul_kernel.arg_names
    constants = {(names.index("BLOCK_M"),): block_m, (names.index("BLOCK_N"),): block_n,
                 (names.index("BLOCK_K"),): block_k, (names.index("PROMOTE_ROWCOL"),): rowcol,
                 (names.index("EVEN_K"),): True}
    # every pointer and int divisible by 16 except the exponent rows' stride (K / 32: a multiple of 4 for K % 128)
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(names)
             if signature[name] != "constexpr" and name not in ("stride_aem", "stride_ben")}
    source = ASTSource(mxfp8_matmul_kernel, signature, constexprs=constants, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", arch, 32),
                          options=dict(num_warps=warps, num_stages=stages))


def compile_grouped(config, arch: int):
    block_m, block_n, block_k, warps, stages, rowcol, out = config
    fn = mxfp8_grouped_matmul_kernel
    signature = {name: "i32" for name in fn.arg_names}
    signature.update({"a_ptr": "*fp8e4nv", "a_exp_ptr": "*u8", "b_ptr": "*fp8e4nv", "b_exp_ptr": "*u8",
                      "out_ptr": "*" + out.split()[0], "a_offsets_ptr": "*i32", "expert_ids_ptr": "*i32"})
    values = dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, PROMOTE_ROWCOL=rowcol, EVEN_K=True)
    constants = {}
    for name, value in values.items():
        signature[name] = "constexpr"
        constants[(fn.arg_names.index(name),)] = value
    # divisibility 16 on pointers and the data strides; not on counts and exponent strides
    aligned = {"a_ptr", "a_exp_ptr", "b_ptr", "b_exp_ptr", "out_ptr", "a_offsets_ptr", "expert_ids_ptr", "N", "K",
               "stride_am", "stride_be", "stride_bn", "stride_bee", "stride_om"}
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names) if name in aligned}
    source = ASTSource(fn, signature, constexprs=constants, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", arch, 32),
                          options=dict(num_warps=warps, num_stages=stages))


def inspect(compiled, arch: int) -> dict:
    ptx, cubin = compiled.asm["ptx"], compiled.asm["cubin"]
    kinds = sorted(set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+\.\w+\.\w+\.\w+)", ptx)))
    with tempfile.TemporaryDirectory() as folder:
        ptx_path, cubin_path = os.path.join(folder, "k.ptx"), os.path.join(folder, "k.cubin")
        with open(ptx_path, "w") as file:
            file.write(ptx)
        with open(cubin_path, "wb") as file:
            file.write(cubin)
        from triton.backends.nvidia import compiler
        try:
            ptxas = compiler.get_ptxas(arch).path
        except TypeError:
            ptxas = compiler.get_ptxas().path
        verbose = _run(ptxas, f"--gpu-name=sm_{arch}a", "-v", ptx_path, "-o", os.path.join(folder, "v.cubin"))
        sass = _run(os.path.join(_BIN, "cuobjdump"), "-sass", cubin_path)
        usage = _run(os.path.join(_BIN, "cuobjdump"), "-res-usage", cubin_path)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", verbose)
    return dict(
        wgmma=kinds, shared=compiled.metadata.shared, registers=int(re.search(r"REG:(\d+)", usage).group(1)),
        spill="%s/%s" % spill.groups() if spill else "?",
        qgmma=len(re.findall(r"\bQGMMA\.", sass)), hgmma=len(re.findall(r"\bHGMMA\.", sass)),
        full_waits=len(re.findall(r"WARPGROUP\.DEPBAR\.LE\s+gsb0,\s*0x0", sass)),
        ffma=len(re.findall(r"\bFFMA\b", sass)), fmul=len(re.findall(r"\bFMUL\b", sass)),
        c7515="C7515" in verbose)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90)
    args = parser.parse_args()
    print(f"Triton {triton.__version__}, target sm_{args.arch}a")
    print("| BMxBNxBK warps stages | promotion | out | wgmma (PTX) | smem B | regs | spill st/ld B | QGMMA / HGMMA "
          "| full waits | FFMA / FMUL (SASS) | verdict |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    failed = 0
    for config in CONFIGS:
        block_m, block_n, block_k, warps, stages, rowcol, out = config
        label = f"{block_m}x{block_n}x{block_k} w{warps} s{stages}"
        promotion = "(acc·fb)·fa" if rowcol else "acc + p·(fa⊗fb)"
        try:
            result = inspect(compile_one(config, args.arch), args.arch)
        except Exception as error:  # noqa: BLE001 - a compile failure is a finding
            lines = [line for line in str(error).splitlines() if line.strip()]
            print(f"| {label} | {promotion} | {out} | compile error: {lines[-1][:150] if lines else error} "
                  "| | | | | | | FAIL |", flush=True)
            failed += 1
            continue
        problems = []
        if not result["wgmma"] or not all(kind.endswith("e4m3.e4m3") for kind in result["wgmma"]):
            problems.append("not e4m3 wgmma")
        if result["spill"] != "0/0":
            problems.append("spills")
        if result["c7515"]:
            problems.append("C7515")
        threads = 32 * warps
        fit = min(H100["shared"] // max(result["shared"], 1), H100["registers"] // (result["registers"] * threads))
        if fit < 1:
            problems.append("does not fit an SM")
        failed += bool(problems)
        print(f"| {label} | {promotion} | {out} | {', '.join(result['wgmma']) or '-'} | {result['shared']} "
              f"| {result['registers']} | {result['spill']} | {result['qgmma']} / {result['hgmma']} "
              f"| {result['full_waits']} | {result['ffma']} / {result['fmul']} "
              f"| {'ok' if not problems else ', '.join(problems)} ({fit}/SM) |", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
