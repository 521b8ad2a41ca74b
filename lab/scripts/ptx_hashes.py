"""sha256 of the PTX of every grouped-matmul compile case, keyed by its label (no GPU needed).

    TRITON_INTERPRET=0 python lab/scripts/ptx_hashes.py --arch 90,100 --jobs 2 [--tree DIR] [--pin NAME=1] > x.json
    python lab/scripts/ptx_hashes.py --compare before.json after.json

Compiles what ``tools/compile_defaults.py --family grouped_matmul`` lists, its grouped-kernel cases again with A
and B scales in the 128x4 layouts (the tool lists row scales only), and the A pre-pass and quantize kernels per
format; ``--tree`` compiles another checkout (a ``git worktree`` of an older commit), ``--pin`` sets constexprs of
every grouped-kernel case (to compare listings that differ in one). Two hashes per case: ``ptx`` of the PTX as
Triton writes it, and ``code`` of the PTX without its debug information (``.file`` / ``.loc`` directives, the
``.debug_*`` sections and the ``$L__tmp`` labels they point at), which names source files, lines and inlined
scopes: a refactor that moves kernel code keeps ``code`` and changes ``ptx``. ``--dump DIR`` also writes each PTX
(to diff two listings); ``--compare`` prints per label whether each hash agrees.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import functools
import hashlib
import json
import multiprocessing
import os
import re
import sys

REPOSITORY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")


@functools.lru_cache(maxsize=None)
def _listing(arch: int) -> tuple:
    """The cases of ``arch``: the tool's listing, its grouped-kernel cases again with 128x4 and grouped 128x4
    scales, and the formats' kernels; from the tree ``PTX_HASHES_TREE`` names (default: this one), with the
    constexprs ``PTX_HASHES_PIN`` names (``NAME=value,...``) set in every grouped-kernel case."""
    os.environ["TRITON_INTERPRET"] = "0"
    sys.path.insert(0, os.path.join(os.environ.get("PTX_HASHES_TREE", REPOSITORY), "tools"))
    import compile_defaults  # noqa: F401  (puts the tree's src/ on the path)
    from compile_grouped_matmul import PAIRS

    cases = compile_defaults._cases(arch, ("grouped_matmul",), tuple(PAIRS))
    cases = (*cases, *_layout_cases(cases), *_format_cases())
    pins = dict(pin.split("=") for pin in os.environ.get("PTX_HASHES_PIN", "").split(",") if pin)
    return tuple(dataclasses.replace(case, constexprs={**case.constexprs, **{name: int(value) for name, value in
                                                                               pins.items()}})
                 if case.fn.__name__ == "grouped_matmul_kernel" else case for case in cases)


def _layout_cases(cases) -> list:
    """The tool lists row-scaled operands only: each quantized pair's first plain and first SwiGLU case whose A the
    kernel reads quantized, again with A in 128x4 tiles, A in 128x4 tiles padded per group, and both operands in
    128x4 tiles (B in the grouped layout is not a case: weights are never grouped)."""
    variants = (("128x4", "row"), ("128x4_grouped", "row"), ("128x4", "128x4"))
    picked, seen = [], set()
    for case in cases:
        pair, epilogue = case.label.split()[:2]
        if (case.fn.__name__ == "grouped_matmul_kernel" and case.constexprs["A_SCALE"] != "none"
                and (pair, epilogue) not in seen):
            seen.add((pair, epilogue))
            picked.append(case)
    out = []
    for case in picked:
        for a_layout, b_layout in variants:
            if "A_SCALE_LAYOUT" in case.fn.arg_names:  # the tree before layouts became objects
                layouts = dict(A_SCALE_LAYOUT=a_layout, B_SCALE_LAYOUT=b_layout)
            else:
                from llmkernels.formats.layouts import as_layout
                a, b = as_layout(a_layout), as_layout(b_layout)
                layouts = dict(A_SCALE_ROWS=a.token_scale_rows, A_SCALE_COLS=a.scale_cols,
                               A_SCALES_MAY_MISS=a.rows_may_miss_scales, B_SCALE_ROWS=b.expert_scale_rows,
                               B_SCALE_COLS=b.scale_cols)
            out.append(dataclasses.replace(case, label=f"{case.label} A:{a_layout} B:{b_layout}",
                                           constexprs={**case.constexprs, **layouts}))
    return out


# (element, scale, scale block, emax) of each block-scaled format
_FORMATS = {"mxfp8": ("e4m3", "e8m0", 32, 8), "mxfp4": ("e2m1", "e8m0", 32, 2), "nvfp4": ("e2m1", "e4m3", 16, 2)}


def _upcast_spec(format: str, layout: str) -> tuple:
    """``(constexprs, signature, attrs)`` of the A pre-pass the library plans for an A of ``format`` in ``layout``
    (bf16 out, on an H100)."""
    import torch
    from compile_grouped_matmul import operand
    from llmkernels import runtime
    from llmkernels.formats.layouts import as_layout
    from llmkernels.grouped_matmul.backends.upcast import upcast_spec
    from llmkernels.grouped_matmul.check import CheckedCall

    with runtime.pretend_gpu((9, 0)) as device:
        call = CheckedCall(operand(format, as_layout(layout)), operand(format), 4096, 7168, 8, 4096, 4096, 8, device)
        spec = upcast_spec(call, torch.bfloat16)
    source = spec.ast_source()
    return dict(spec.constexprs), source.signature, source.attrs


@functools.lru_cache(maxsize=None)
def _format_cases() -> tuple:
    """The launches outside the tool's listing that the grouped matmul and quantize make: the A pre-pass
    (``upcast_rows_kernel``, row and 128x4 scales, bf16 out) and the quantize kernel, per format."""
    from compile_common import Case, _aligned_signature
    from llmkernels.formats import kernel as formats_kernel

    cases = []
    fn = formats_kernel.upcast_rows_kernel
    for name, (element, scale, block, _) in _FORMATS.items():
        for layout in ("row", "128x4"):
            if "SCALE_LAYOUT" in fn.arg_names:  # the tree before layouts became objects
                constexprs = dict(ELEMENT=element, SCALE=scale, SCALE_BLOCK=block, SCALE_LAYOUT=layout,
                                  PACKED_DECODE=True, BLOCK_ROWS=16, BLOCK_K=256)
                kinds = dict(data_ptr="*u8", scales_ptr="*u8", out_ptr="*bf16")
                signature, attrs = _aligned_signature(fn, constexprs, kinds)
            else:  # the library's own spec of the pre-pass
                constexprs, signature, attrs = _upcast_spec(name, layout)
            cases.append(Case("formats", f"upcast_rows {name} {layout}", fn, signature, constexprs, attrs, 4, 3, 0, ""))
    fn = formats_kernel.quantize_kernel
    for name, (element, scale, block, emax) in _FORMATS.items():
        for gather in (False, True):
            constexprs = dict(ELEMENT=element, SCALE=scale, SCALE_BLOCK=block, EMAX=emax, GATHER=gather,
                              BLOCK_ROWS=16, BLOCK_COLS=256)
            kinds = dict(x_ptr="*bf16", data_ptr="*u8", scales_ptr="*u8", global_scale_ptr="*fp32",
                         source_rows_ptr="*i64")
            signature, attrs = _aligned_signature(fn, constexprs, kinds)
            cases.append(Case("formats", f"quantize {name}{' gather' if gather else ''}", fn, signature, constexprs,
                              attrs, 4, 3, 0, ""))
    return tuple(cases)


def code_of(ptx: str) -> str:
    """The PTX without its debug information: ``.file`` and ``.loc`` lines, the ``.section .debug_*`` blocks and
    the labels only they refer to (``$L__tmp<n>``, ``$L__func_begin/end<n>``)."""
    ptx = re.sub(r"^\s*\.section\s+\.debug_\w+\s*\{.*?\}\s*$", "", ptx, flags=re.MULTILINE | re.DOTALL)
    return "\n".join(line for line in ptx.splitlines()
                     if not re.match(r"\s*(\.(file|loc)\b|\$L__(tmp|func_begin|func_end)\d+:)", line))


def _compile(job) -> tuple[str, str, str]:
    arch, index, dump = job
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    case = _listing(arch)[index]
    names = case.fn.arg_names
    source = ASTSource(case.fn, case.signature, constexprs={(names.index(k),): v for k, v in case.constexprs.items()},
                       attrs=case.attrs)
    compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32),
                              options=dict(num_warps=case.num_warps, num_stages=case.num_stages))
    ptx = compiled.asm["ptx"]
    label = f"sm_{arch}a {' '.join(case.label.split())}"
    if dump:
        with open(os.path.join(dump, re.sub(r"\W+", "_", label) + ".ptx"), "w") as file:
            file.write(ptx)
    return label, hashlib.sha256(ptx.encode()).hexdigest(), hashlib.sha256(code_of(ptx).encode()).hexdigest()


def hashes(archs, jobs: int, dump: str | None = None) -> dict:
    if dump:
        os.makedirs(dump, exist_ok=True)
    work = [(arch, index, dump) for arch in archs for index in range(len(_listing(arch)))]
    with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        results = list(pool.map(_compile, work))
    table = {}
    for label, ptx, code in results:
        if label in table:
            raise SystemExit(f"two cases share the label {label!r}")
        table[label] = {"ptx": ptx, "code": code}
    return table


def compare(before: dict, after: dict) -> int:
    """Prints one line per label; returns how many code hashes differ or are missing."""
    differ = 0
    for label in sorted(set(before) | set(after)):
        old, new = before.get(label), after.get(label)
        if old is None or new is None:
            differ += 1
            print(f"{'only before' if new is None else 'only after ':11s}  {label}")
            continue
        same_code, same_ptx = old["code"] == new["code"], old["ptx"] == new["ptx"]
        differ += not same_code
        print(f"code {'same' if same_code else 'DIFF'}  ptx {'same' if same_ptx else 'diff'}  {label}")
    print(f"{len(set(before) & set(after))} labels in both, {differ} with another code hash or missing")
    return differ


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="90,100")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--dump", help="a folder to write each case's PTX to")
    parser.add_argument("--tree", help="the repository whose tools/ and src/ to compile (default: this one)")
    parser.add_argument("--pin", default="", help="NAME=int,...: constexprs set in every grouped-kernel case")
    parser.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"))
    args = parser.parse_args()
    if args.compare:
        with open(args.compare[0]) as first, open(args.compare[1]) as second:
            sys.exit(1 if compare(json.load(first), json.load(second)) else 0)
    if args.tree:
        os.environ["PTX_HASHES_TREE"] = os.path.abspath(args.tree)
    os.environ["PTX_HASHES_PIN"] = args.pin
    print(json.dumps(hashes(list(map(int, args.arch.split(","))), args.jobs, args.dump), indent=1, sort_keys=True))


if __name__ == "__main__":
    main()
