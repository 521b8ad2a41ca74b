"""Compile every default config of both kernel families for an NVIDIA architecture, without a GPU, and
check what a user of that GPU would run: the MMA instruction of each path, shared memory and registers
against the GPU's limits.

    TRITON_INTERPRET=0 python tools/compile_defaults.py [--arch 90,100] [--family grouped_matmul,attention]
                                                      [--pairs mxfp8xmxfp8,...] [--jobs 2]

Triton's ahead-of-time ``triton.compile`` runs on the kernels' source (ptxas from the Triton wheel runs,
nothing is launched) with the configs that ``default_launches`` / ``default_config`` pick on that GPU,
and the constexprs the library binds for them. Prints one line per config and exits 1 when a config
fails to compile, misses its expected MMA instruction (:func:`expected_mma`) or does not fit the GPU.
``tests/test_compile_targets.py`` runs the same checks in CI.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import functools
import os
import re
import subprocess
import sys
import tempfile

os.environ["TRITON_INTERPRET"] = "0"
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import sass_hazards  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402
from compile_attention import attention_cases  # noqa: E402
from compile_common import GPUS, Case, Result  # noqa: E402
from compile_grouped_matmul import PAIRS, grouped_matmul_cases  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402


@contextlib.contextmanager
def _hushed_stderr():
    """Triton's C++ passes print MLIR reproducers to fd 2 when they fail: keep them out of the report."""
    saved = os.dup(2)
    with tempfile.TemporaryFile() as sink:
        os.dup2(sink.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def compile_case(case: Case, arch: int) -> Result:
    """Compiles one case for ``sm_<arch>a``; a compiler failure comes back as ``Result.error``."""
    if case.spec is not None:  # a backend's KernelSpec: what the library launches
        source, options = case.spec.ast_source(), dict(case.spec.options)
    else:
        names = case.fn.arg_names
        source = ASTSource(
            case.fn,
            case.signature,
            constexprs={(names.index(k),): v for k, v in case.constexprs.items()},
            attrs=case.attrs,
        )
        options = dict(num_warps=case.num_warps, num_stages=case.num_stages)
    try:
        with _hushed_stderr():
            compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)
    except Exception as error:  # noqa: BLE001 - any compiler failure is a finding, reported per case
        lines = [line for line in str(error).splitlines() if line.strip()]
        return Result(error=f"{type(error).__name__}: {lines[-1] if lines else ''}"[:160])
    ptx = compiled.asm["ptx"]
    if re.search(r"^\s*trap;", ptx, re.MULTILINE):
        # What Triton emits for a kernel it cannot lower (e.g. accumulators that over-subscribe the 512
        # columns of Blackwell's tensor memory): it would fault on the GPU.
        return Result(compiled.metadata.shared, error="compiled to a trap instruction")
    registers, stack = _registers_and_stack(compiled.asm["cubin"])
    fa4 = fa4_features(compiled.asm["ttgir"], ptx) if case.family == "attention" and case.mma_m else ""
    hgmma, hgmma_waits, hazards = _hgmma_waits(compiled.asm["cubin"]) if arch == 90 else (0, 0, 0)
    return Result(
        compiled.metadata.shared,
        registers,
        stack,
        mma_kinds(ptx),
        fa4,
        hgmma=hgmma,
        hgmma_waits=hgmma_waits,
        hgmma_hazards=hazards,
    )


_POLY_EXP2_COEFFICIENT = "0f3D9DD09C"  # exp2_poly's cubic coefficient (0.0770580...) as a PTX float


def fa4_features(ttgir: str, ptx: str) -> str:
    """FA4's pieces as the compiled attention shows them: how many MMAs read each K (or V) tile in
    shared memory (the fewest over tiles: 2 with two Q tiles), how many block-uniform branches guard the O rescale
    (conditional rescaling: an ``scf.if`` yielding the fp32 O tile), and the exp2 split (MUFU
    ``ex2.approx`` instructions; FMA polynomial uses of its cubic coefficient)."""
    operands = re.findall(r"(?:ttng\.tc_gen5_mma|ttng\.warp_group_dot|tt\.dot) %[\w.]+, (%[\w.#]+)", ttgir)
    sharing = min((operands.count(operand) for operand in set(operands)), default=0)
    rescales = len(re.findall(r"scf\.if %\w+ -> \(tensor<\d+x\d+xf32", ttgir))
    mufu = len(re.findall(r"\bex2\.approx", ptx))
    return (
        f"MMAs per K/V tile {sharing}, conditional rescales {rescales}, "
        f"exp2 MUFU {mufu} / poly {ptx.count(_POLY_EXP2_COEFFICIENT)}"
    )


def mma_kinds(ptx: str) -> str:
    """The tensor-core instructions a PTX issues: ``tcgen05.mma`` kinds (Blackwell), ``wgmma`` (Hopper) or
    ``mma.sync`` (Ampere-class), comma-separated; "none" without any."""
    # Triton >= 3.8 writes the scale block (".block32"), older ones the scale vector (".scale_vec::2X").
    found = set()
    for kind, block, vector in re.findall(
        r"tcgen05\.mma\.cta_group::\d\.kind::(\w+)(?:\.block_scale)?(?:\.block(\d+)|\.scale_vec::(\d)X)?", ptx
    ):
        block = block or ({"4": "16"}.get(vector, "32") if vector else "")
        found.add(f"tcgen05.{kind}" + (f".block{block}" if block else ""))
    found = sorted(found)
    if "wgmma.mma_async" in ptx:
        found.append("wgmma")
    if re.search(r"\bmma\.sync", ptx):
        found.append("mma.sync")
    return ",".join(found) or "none"


def _sass(cubin: bytes, *flags: str) -> str:
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as file:
        file.write(cubin)
        file.flush()
        return subprocess.run([tool, *flags, file.name], capture_output=True, text=True, check=True).stdout


def _hgmma_waits(cubin: bytes) -> tuple[int, int, int]:
    """HGMMA instructions, full waits on them and register-operand hazards in a Hopper cubin. When ptxas
    cannot prove a wgmma pipeline safe it serializes it (its C7515 note, which Triton does not show): a full
    wait after every HGMMA, so a warpgroup's tensor cores idle while it decodes the next operand. A hazard
    (``sass_hazards``) is a write to the A registers of an HGMMA that may still be reading them."""
    sass = _sass(cubin, "-sass")
    return (sass.count("HGMMA."), sass.count("WARPGROUP.DEPBAR.LE gsb0, 0x0"), len(sass_hazards.hazards(sass)))


def _registers_and_stack(cubin: bytes) -> tuple[int, int]:
    """Registers per thread and stack bytes per thread (ptxas spills land on the stack) of a cubin,
    read with cuobjdump; PTX shows no ptxas spills."""
    usage = _sass(cubin, "-res-usage")
    match = re.search(r"REG:(\d+) STACK:(\d+)", usage)
    return int(match.group(1)), int(match.group(2))


def problems(case: Case, result: Result, arch: int) -> list[str]:
    """What is wrong with a compiled case: a compiler error, another MMA than expected, shared memory over
    the block limit, registers that do not let one program run on an SM, a register-operand HGMMA whose A
    registers are overwritten in flight, a grouped matmul whose wgmma ptxas serialized."""
    if result.error:
        return [result.error]
    found = []
    if result.mma != case.expect:
        found.append(f"MMA {result.mma}, expected {case.expect}")
    limits = GPUS[arch]
    if result.shared > limits["shared"]:
        found.append(f"shared {result.shared} > {limits['shared']}")
    if result.registers * 32 * case.num_warps > limits["registers"]:
        found.append(f"registers {result.registers} x {32 * case.num_warps} threads > {limits['registers']}")
    if result.hgmma_hazards:
        found.append(f"{result.hgmma_hazards} writes to the A registers of an HGMMA in flight (sass_hazards)")
    if case.family == "grouped_matmul" and result.hgmma_waits > 2 and 2 * result.hgmma_waits >= result.hgmma:
        found.append(f"wgmma serialized by ptxas ({result.hgmma_waits} full waits for {result.hgmma} HGMMA)")
    return found


@functools.cache  # once per process: a worker compiles many cases of one listing
def _cases(arch: int, families: tuple, pairs: tuple) -> tuple:
    cases = []
    if "grouped_matmul" in families:
        cases += grouped_matmul_cases(arch, pairs)
    if "attention" in families:
        cases += attention_cases(arch)
    return tuple(cases)


def _compile_listed(job) -> Result:
    """A worker's job: the ``index``-th case of the listing (cases hold jit functions, which do not pickle)."""
    arch, families, pairs, index = job
    return compile_case(_cases(arch, families, pairs)[index], arch)


def compile_all(arch: int, families=("grouped_matmul", "attention"), pairs=tuple(PAIRS), jobs: int = 1):
    """``[(case, result), ...]`` for every default config of ``families`` on ``arch``, compiled by
    ``jobs`` processes."""
    families, pairs = tuple(families), tuple(pairs)
    cases = _cases(arch, families, pairs)
    if jobs <= 1:
        results = [compile_case(case, arch) for case in cases]
    else:
        import multiprocessing

        work = [(arch, families, pairs, index) for index in range(len(cases))]
        with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
            results = list(pool.map(_compile_listed, work))
    return list(zip(cases, results))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="90,100", help="comma-separated compute capabilities (90, 100)")
    parser.add_argument("--family", default="grouped_matmul,attention")
    parser.add_argument("--pairs", default=",".join(PAIRS), help="grouped-matmul format pairs")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--markdown", action="store_true", help="a markdown table per architecture instead")
    args = parser.parse_args()
    if args.markdown:
        return markdown(args)
    print(
        f"# Triton {triton.__version__}, torch {torch.__version__}; columns: config, shared bytes, registers, "
        f"stack (spill) bytes per thread, MMA instruction in the PTX (attention: and its FA4 features), verdict"
    )
    failures = 0
    for arch in map(int, args.arch.split(",")):
        print(f"## sm_{arch}a")
        for case, result in compile_all(arch, args.family.split(","), tuple(args.pairs.split(",")), args.jobs):
            found = problems(case, result, arch)
            failures += bool(found)
            waits = (
                f"HGMMA {result.hgmma:3d} waits {result.hgmma_waits:3d} hazards {result.hgmma_hazards:3d} "
                if result.hgmma
                else ""
            )
            figures = (
                (
                    f"shared {result.shared:6d} registers {result.registers:3d} stack {result.stack:4d} "
                    f"{waits}{result.mma:26s}{result.fa4}"
                )
                if not result.error
                else ""
            )
            print(f"{case.family:14s} {case.label} {figures} {'; '.join(found) or 'ok'}", flush=True)
    sys.exit(1 if failures else 0)


def markdown(args) -> None:
    """The tables of docs/blackwell.md: per config its MMA, shared memory, registers, spills and bound."""
    for arch in map(int, args.arch.split(",")):
        print(f"\n### sm_{arch}a, Triton {triton.__version__}\n")
        print("| family | config | MMA | shared KiB | registers | spill B | B200 bound (tokens/group: time, kind) |")
        print("| --- | --- | --- | --- | --- | --- | --- |")
        for case, result in compile_all(arch, args.family.split(","), tuple(args.pairs.split(",")), args.jobs):
            found = problems(case, result, arch)
            config = " ".join(case.label.split())
            mma = result.mma if not found else f"{result.mma or ''} **{'; '.join(found)}**"
            bound = case.roofline.replace(" tokens/group: B200 bound ", ": ") or result.fa4
            print(
                f"| {case.family} | {config} | {mma} | {result.shared / 1024:.1f} | {result.registers} | "
                f"{result.stack} | {bound} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
