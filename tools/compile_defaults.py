"""Compile every default grouped-matmul config for a GPU architecture, without a GPU, and report
shared memory against that GPU's limits, with registers and stack (spill) bytes per thread.

    TRITON_INTERPRET=0 python tools/compile_defaults.py [--arch 90] [--smem-limit 232448]

Uses Triton's ahead-of-time ``triton.compile`` on the kernel's source (ptxas runs, nothing is
launched), with the configs that ``default_launches`` picks for decode and compute sizes, every
format pair and both plain and SwiGLU epilogues. Exits 1 if a config does not fit.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

os.environ["TRITON_INTERPRET"] = "0"
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from llmkernels.grouped_matmul import config as gm_config  # noqa: E402
from llmkernels.grouped_matmul import api as gm_api  # noqa: E402
from llmkernels.grouped_matmul import kernel  # noqa: E402

# (a element, a scale, a block, b element, b scale, b block) of each format pair
PAIRS = {
    "bf16xbf16": ("bf16", "none", 1, "bf16", "none", 1),
    "mxfp8xmxfp8": ("e4m3", "e8m0", 32, "e4m3", "e8m0", 32),
    "mxfp4xmxfp4": ("e2m1", "e8m0", 32, "e2m1", "e8m0", 32),
    "nvfp4xnvfp4": ("e2m1", "e4m3", 16, "e2m1", "e4m3", 16),
    "bf16xmxfp8": ("bf16", "none", 1, "e4m3", "e8m0", 32),
    "bf16xmxfp4": ("bf16", "none", 1, "e2m1", "e8m0", 32),
    "bf16xnvfp4": ("bf16", "none", 1, "e2m1", "e4m3", 16),
}
POINTER = {"bf16": "*bf16", "e4m3": "*u8", "e2m1": "*u8"}  # the API passes MX data as bytes


def compile_one(pair, config, swiglu, arch, device):
    """Compiles the launch the library would make for this pair and config (its own MMA and upcast choices)."""
    a_el, a_sc, a_blk, b_el, b_sc, b_blk = PAIRS[pair]
    a_format, b_format = re.fullmatch(r"(bf16|mxfp8|mxfp4|nvfp4)x(\w+)", pair).groups()
    a_op = gm_api._Operand(None, None, None, a_el, a_sc, a_blk, "row", a_format, a_sc == "e4m3")
    b_op = gm_api._Operand(None, None, None, b_el, b_sc, b_blk, "row", b_format, b_sc == "e4m3")
    a_global = a_sc == "e4m3"
    if gm_api._takes_upcast(config, a_op):  # the kernel then reads A decoded ahead, in bf16
        a_op = gm_api._upcast_view(a_op)
        a_el, a_sc, a_blk = "bf16", "none", 1
    dot_scaled = gm_api._resolve_mma(config, a_op, b_op, device)
    fn = kernel.grouped_matmul_kernel
    constexprs = dict(
        A_ELEMENT=a_el, A_SCALE=a_sc, A_SCALE_BLOCK=a_blk, A_SCALE_LAYOUT="row",
        B_ELEMENT=b_el, B_SCALE=b_sc, B_SCALE_BLOCK=b_blk, B_SCALE_LAYOUT="row",
        A_GLOBAL_SCALE=a_global, B_GLOBAL_SCALE=b_sc == "e4m3",
        HAS_EXPERT_SCALES=True, EPILOGUE="swiglu" if swiglu else "none", EPILOGUE_FN=None,
        USE_DOT_SCALED=dot_scaled, SWAP_AB=config.ab_swapped, PREFETCH_SCALES=config.prefetch_scales,
        SCALE_WORDS=config.scale_words, PACKED_DECODE=True,
        COMPUTE_DTYPE=tl.bfloat16,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, BLOCK_GROUPS=16)
    signature = {}
    for name in fn.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in ("a_ptr", "b_ptr"):
            signature[name] = POINTER[a_el if name == "a_ptr" else b_el]
        elif name.endswith("scales_ptr") and name != "expert_scales_ptr":
            signature[name] = "*u8"
        elif name in ("a_global_scale_ptr", "b_global_scale_ptr", "expert_scales_ptr"):
            signature[name] = "*fp32"
        elif name == "out_ptr":
            signature[name] = "*bf16"
        elif name.endswith("_ptr"):
            signature[name] = "*i32"
        else:
            signature[name] = "i32"
    # As a launch specializes them: pointers, strides and sizes divisible by 16 (what enables
    # vectorized async copies and with them the software pipeline).
    aligned = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names)
               if name not in constexprs and name not in ("num_groups", "min_group_rows")}
    source = ASTSource(fn, signature, constexprs={(fn.arg_names.index(k),): v for k, v in constexprs.items()},
                       attrs=aligned)
    compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32),
                              options=dict(num_warps=config.num_warps, num_stages=config.num_stages))
    return compiled.metadata.shared, _registers_and_stack(compiled.asm["cubin"]), mma_kinds(compiled.asm["ptx"])


def mma_kinds(ptx: str) -> str:
    """The tensor-core instructions a PTX issues: ``tcgen05.mma`` kinds (Blackwell), ``wgmma`` (Hopper) or
    ``mma.sync`` (Ampere-class), comma-separated; "none" without any."""
    kinds = sorted(set(re.findall(r"tcgen05\.mma\.cta_group::\d\.kind::(\w+)(?:\.block_scale)?(?:\.block(\d+))?", ptx)))
    found = [f"tcgen05.{kind}" + (f".block{block}" if block else "") for kind, block in kinds]
    if "wgmma.mma_async" in ptx:
        found.append("wgmma")
    if re.search(r"\bmma\.sync", ptx):
        found.append("mma.sync")
    return ",".join(found) or "none"


def _registers_and_stack(cubin: bytes) -> tuple[int, int]:
    """Registers per thread and stack bytes per thread (ptxas spills land on the stack) of a cubin,
    read with cuobjdump; PTX shows no ptxas spills."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as file:
        file.write(cubin)
        file.flush()
        usage = subprocess.run([tool, "-res-usage", file.name], capture_output=True, text=True, check=True).stdout
    match = re.search(r"REG:(\d+) STACK:(\d+)", usage)
    return int(match.group(1)), int(match.group(2))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90)
    parser.add_argument("--smem-limit", type=int, default=232448, help="bytes per block (H100/H200: 232448)")
    parser.add_argument("--pairs", default=",".join(PAIRS))
    args = parser.parse_args()
    gm_config.num_programs_hint = lambda device: 132
    torch.cuda.get_device_capability = lambda device=None: (args.arch // 10, args.arch % 10)
    gm_config.default_launches.cache_clear()
    device = torch.device("cuda", 0)
    failures = 0
    n, k, groups = 4096, 7168, 64
    for pair in args.pairs.split(","):
        a_el, _, _, b_el, _, b_blk = PAIRS[pair]
        seen = set()
        for tokens_per_group in (8, 48, 2048):
            for swiglu in (False, True):
                launches = gm_config.default_launches(tokens_per_group * groups, groups, n // 2 if swiglu else n, k,
                                                      device, a_el, b_el, 1 << 40, swiglu, b_blk)
                for config, _, _ in launches:
                    if (config, swiglu) in seen:
                        continue
                    seen.add((config, swiglu))
                    shared, (registers, stack), mma = compile_one(pair, config, swiglu, args.arch, device)
                    fits = shared <= args.smem_limit
                    failures += not fits
                    print(f"{pair:12s} swiglu {swiglu!s:5s} {config.block_m}x{config.block_n}x{config.block_k} "
                          f"s{config.num_stages} w{config.num_warps} mma={config.mma:8s} swap={config.ab_swapped!s:5s} "
                          f"shared {shared:6d} registers {registers:3d} stack {stack:4d} {mma:28s} {'ok' if fits else 'DOES NOT FIT'}",
                          flush=True)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
