"""Compile the FP8-block grouped matmul's configs for sm_90a without a GPU and print what each one runs.

    python3 lab/fp8_blocks/compile_sm90.py [--arch 90] [--defaults-only]

The cases are the launches bench_gpu.py times (every config of its sweeps on every shape, duplicates of one
specialization compiled once), plus three variants of the default prefill config: A's scales token-major,
``expert_scales``, and a K that is not a multiple of 16. Each launch is :func:`kernel.plan_launch` on meta
tensors; Triton's own specializer (``native_specialize_impl``) turns its arguments into the signature a real
launch has (16-byte pointer alignment, ints divisible by 16, ints equal to 1 as constants; the same rules
written out where that function does not exist), and
``triton.compile`` runs ahead of time (ptxas from the Triton wheel; nothing is launched). Per case:

* wgmma instructions in the PTX: must all be ``wgmma.mma_async...e4m3.e4m3`` (the FP8 tensor cores);
* shared memory (bytes), registers per thread, spill stores/loads (``ptxas -v`` with Triton's own ptxas), and
  whether any spill instruction (``STL``/``LDL``) sits inside the K loop (the SASS between the loop's backward
  branch and its target) — spills around the loop only cost a few instructions per tile;
* QGMMA (fp8 HGMMA) instructions and full waits (``WARPGROUP.DEPBAR.LE gsb0, 0x0``) in the SASS: the promotion
  needs a full wait once per 128-wide K step and sub-tile (4 k32 QGMMAs per warp group and 64-row block); a
  wait after every QGMMA would mean ptxas serialized them (its C7515 warning);
* programs per SM that shared memory and registers allow (H100: 227 KB, 64K registers).

Exits 1 when a default config fails: no compile, no e4m3 wgmma, a spill inside the K loop, or no fit.
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

import torch
import triton
from bench_gpu import SHAPES, SWEEPS, Shape
from kernel import (
    COMPUTE_CONFIG,
    DECODE_CONFIG,
    Fp8BlockConfig,
    fp8_block_grouped_matmul_kernel,
    plan_launch,
)
from triton.backends.compiler import BaseBackend, GPUTarget
from triton.compiler import ASTSource

H100 = dict(sms=132, shared=232448, registers=65536, max_threads=2048)
_BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
UNEVEN_K = Shape("E8x100 N4096 K7000 (K % 16 != 0)", 8, 100, 4096, 7000, "compute")


def cases(defaults_only: bool):
    """``(shape, config, variant)`` of every launch to compile."""
    for shape in SHAPES:
        for index, config in enumerate(SWEEPS[shape.regime]):
            if index == 0 or not defaults_only:
                yield shape, config, ""
    yield SHAPES[0], COMPUTE_CONFIG, "A scales token-major"
    yield SHAPES[0], COMPUTE_CONFIG, "expert_scales"
    yield UNEVEN_K, COMPUTE_CONFIG, ""


def meta_launch(shape: Shape, config: Fp8BlockConfig, variant: str):
    """plan_launch on meta tensors of the shape (no memory, same shapes, strides and dtypes)."""
    tokens, kb = shape.experts * shape.tokens_per_expert, triton.cdiv(shape.k, 128)
    meta = dict(device="meta")
    a = torch.empty(tokens, shape.k, dtype=torch.float8_e4m3fn, **meta)
    if variant == "A scales token-major":  # a [K/128, T] buffer seen transposed (DeepGEMM's, cuBLAS's layout)
        a_scales = torch.empty(kb, tokens, **meta).t()
    else:
        a_scales = torch.empty(tokens, kb, **meta)
    b = torch.empty(shape.experts, shape.n, shape.k, dtype=torch.float8_e4m3fn, **meta)
    b_scales = torch.empty(shape.experts, triton.cdiv(shape.n, 128), kb, **meta)
    out = torch.empty(tokens, shape.n, dtype=torch.bfloat16, **meta)
    offsets = torch.empty(shape.experts + 1, dtype=torch.int32, **meta)
    ids = torch.empty(shape.experts, dtype=torch.int32, **meta)
    expert_scales = torch.empty(shape.experts, **meta) if variant == "expert_scales" else None
    return plan_launch(a, a_scales, b, b_scales, offsets, ids, expert_scales, out, config, H100["sms"])


_TRITON_TYPES = {torch.float8_e4m3fn: "fp8e4nv", torch.float32: "fp32", torch.bfloat16: "bf16", torch.int32: "i32"}


def _specialize_one(value) -> tuple[str, object]:
    """``(type, key)`` of one argument: Triton's own C++ specializer where it exists (3.9), else the same rules
    written out (a tensor: its pointer type, 16-byte aligned; an int: 1 becomes a constant, a multiple of 16
    gets the divisibility attribute, 64-bit beyond int32)."""
    try:
        from triton._C.libtriton import native_specialize_impl
        return native_specialize_impl(BaseBackend, value, False, True, True)[:2]
    except ImportError:
        if isinstance(value, torch.Tensor):
            return "*" + _TRITON_TYPES[value.dtype], "D"
        if value == 1:
            return "constexpr", 1
        kind = "i32" if -2**31 <= value < 2**31 else "i64"
        return kind, "D" if value % 16 == 0 else ""


def specialize(arguments: dict, constexprs: dict) -> tuple[dict, dict, dict]:
    """``(signature, constants, attrs)`` as Triton's launcher specializes these arguments."""
    fn = fp8_block_grouped_matmul_kernel
    signature, constants, attrs = {}, {}, {}
    for index, name in enumerate(fn.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
            constants[(index,)] = constexprs[name]
            continue
        kind, key = _specialize_one(arguments[name])
        signature[name] = kind
        if kind == "constexpr":  # an int equal to 1
            constants[(index,)] = key
        elif key == "D":
            attrs[(index,)] = [["tt.divisibility", 16]]
    return signature, constants, attrs


def _ptxas(arch: int) -> str:
    """The assembler Triton itself uses for this architecture (the wheel carries two)."""
    from triton.backends.nvidia import compiler
    try:
        return compiler.get_ptxas(arch).path
    except TypeError:  # older Triton: no architecture argument
        return compiler.get_ptxas().path


def _run(*command: str) -> str:
    done = subprocess.run(command, capture_output=True, text=True)
    return done.stdout + done.stderr


def _spills_in_loop(sass: str) -> int:
    """Spill instructions (STL/LDL) inside a loop that contains a QGMMA (the K loop)."""
    lines = [(int(m.group(1), 16), line) for line in sass.splitlines()
             if (m := re.match(r"\s*/\*([0-9a-f]{4,})\*/", line))]
    count = 0
    for address, line in lines:
        branch = re.search(r"\bBRA\s+(?:`\(\.L_x_\d+\)\s*)?0x([0-9a-f]+)", line)
        if not branch or int(branch.group(1), 16) >= address:
            continue
        target = int(branch.group(1), 16)
        body = [text for where, text in lines if target <= where <= address]
        if any("GMMA" in text for text in body):
            count += sum(bool(re.search(r"\b(STL|LDL)\b", text)) for text in body)
    return count


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
    return dict(
        wgmma=kinds, shared=compiled.metadata.shared, registers=int(re.search(r"REG:(\d+)", usage).group(1)),
        spill_stores=int(spill.group(1)) if spill else -1, spill_loads=int(spill.group(2)) if spill else -1,
        spills_in_loop=_spills_in_loop(sass),
        qgmma=len(re.findall(r"\b[HQ]GMMA\.", sass)),
        full_waits=len(re.findall(r"WARPGROUP\.DEPBAR\.LE\s+gsb0,\s*0x0", sass)),
        c7515="C7515" in verbose)


def programs_per_sm(result: dict, num_warps: int) -> int:
    threads = 32 * num_warps
    by_shared = H100["shared"] // max(result["shared"], 1)
    by_registers = H100["registers"] // (max(result["registers"], 1) * threads)
    return min(by_shared, by_registers, H100["max_threads"] // threads)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90)
    parser.add_argument("--defaults-only", action="store_true", help="only the default config of each regime")
    args = parser.parse_args()
    print(f"Triton {triton.__version__}, target sm_{args.arch}a, ptxas {_ptxas(args.arch)}")
    print("| shape | config | variant | wgmma (PTX) | smem B | regs | spill st/ld B (in K loop) | QGMMA / full waits "
          "| programs/SM | verdict |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    failed, seen = 0, set()
    for shape, config, variant in cases(args.defaults_only):
        _, arguments, constexprs, options = meta_launch(shape, config, variant)
        signature, constants, attrs = specialize(arguments, constexprs)
        key = (str(signature), str(sorted(constants.items())), str(sorted(attrs)), str(sorted(options.items())))
        if key in seen:  # the same compiled kernel as an earlier case
            continue
        seen.add(key)
        is_default = config in (COMPUTE_CONFIG, DECODE_CONFIG)
        source = ASTSource(fp8_block_grouped_matmul_kernel, signature, constexprs=constants, attrs=attrs)
        try:
            compiled = triton.compile(source, target=GPUTarget("cuda", args.arch, 32), options=options)
        except Exception as error:  # noqa: BLE001 - a compile failure is a finding
            lines = [line for line in str(error).splitlines() if line.strip()]
            print(f"| {shape.name} | {config.label} | {variant or '-'} | compile error: "
                  f"{lines[-1][:120] if lines else error} | | | | | | FAIL |", flush=True)
            failed += is_default
            continue
        result = inspect(compiled, args.arch)
        problems = []
        if not result["wgmma"] or not all(kind.endswith("e4m3.e4m3") for kind in result["wgmma"]):
            problems.append("no e4m3 wgmma")
        if result["spills_in_loop"]:
            problems.append("spills in the K loop")
        fit = programs_per_sm(result, config.num_warps)
        if fit < 1:
            problems.append("does not fit an SM")
        if result["c7515"]:
            problems.append("ptxas C7515 (serialized wgmma)")
        failed += bool(problems) and is_default
        verdict = ("ok" if not problems else ", ".join(problems)) + (" (default)" if is_default else "")
        print(f"| {shape.name} | {config.label} | {variant or '-'} | {', '.join(result['wgmma'])} | {result['shared']} "
              f"| {result['registers']} | {result['spill_stores']}/{result['spill_loads']} "
              f"({result['spills_in_loop']} in loop) | {result['qgmma']} / {result['full_waits']} | {fit} "
              f"| {verdict} |", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
