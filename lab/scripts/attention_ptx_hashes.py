"""sha256 of the PTX of every attention compile case, keyed by its label (no GPU needed).

    TRITON_INTERPRET=0 python lab/scripts/attention_ptx_hashes.py --arch 90,100 --jobs 2 > before.json
    TRITON_INTERPRET=0 python lab/scripts/attention_ptx_hashes.py --arch 90 --gluon-only > before.json
    python lab/scripts/attention_ptx_hashes.py --compare before.json after.json

The cases: what ``tools/compile_defaults.py --family attention`` lists (portable prefill and decode, the
combine), and the Gluon kernels for sm_90a as ``tests/test_compile_targets.py`` builds them
(``gluon_hopper.compile_for_sm90`` at seven configs, ``gluon_decode.compile_for_sm90`` at three,
``gluon_fp8_prefill.compile_for_sm90`` at five). Two hashes per
case: ``ptx`` of the PTX as Triton writes it, and ``code`` of the PTX without its debug lines (``.file`` /
``.loc`` directives and the ``.debug_*`` sections, which name source files and line numbers: a refactor that
moves kernel code or the lines above it keeps ``code`` and changes ``ptx``). ``--compare`` prints per label
whether each hash agrees and exits 1 when a ``code`` hash differs or a label is missing.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import hashlib
import json
import multiprocessing
import os
import re
import sys

TOOLS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tools")

# (label, head dim, window, return_lse, consumers, page size, ragged): tests/test_compile_targets.py's calls
GLUON_PREFILL = [("d64 3 consumers", 64, False, False, 3, 0, False), ("d64 window lse", 64, True, True, 2, 0, False),
                 ("d128 window lse", 128, True, True, 2, 0, False), ("d256 window", 256, True, False, 2, 0, False),
                 ("d128 window paged16 lse", 128, True, True, None, 16, False),
                 ("d256 paged256 ragged lse", 256, False, True, None, 256, True),
                 ("d64 window ragged lse", 64, True, True, None, 0, True)]
GLUON_DECODE = [("d128 paged16", 128, 16), ("d128 paged64", 128, 64), ("d64 dense", 64, 0)]
# (label, head dim, causal, options): gluon_fp8_prefill.compile_for_sm90's calls in tests/test_compile_targets.py
GLUON_FP8_PREFILL = [("d64", 64, False, {}), ("d128 ragged", 128, False, dict(ragged=True)),
                     ("d128 causal lse", 128, True, dict(return_lse=True)), ("d256 causal", 256, True, {}),
                     ("d128 causal bf16q paged16", 128, True, dict(fp8_q=False, page_size=16))]


def _listing(arch: int) -> tuple:
    os.environ["TRITON_INTERPRET"] = "0"
    sys.path.insert(0, TOOLS)
    import compile_defaults  # noqa: F401  (puts src/ on the path)

    return compile_defaults._cases(arch, ("attention",), ())


def code_of(ptx: str) -> str:
    """The PTX without its debug information: ``.file`` and ``.loc`` lines, the ``.section .debug_*`` blocks and
    the ``$L__tmp`` labels they reference."""
    ptx = re.sub(r"^\s*\.section\s+\.debug_\w+\s*\{.*?^\s*\}\s*$", "", ptx, flags=re.MULTILINE | re.DOTALL)
    # $L__tmpN: labels mark inlined functions' ranges for the debug sections only: a helper factored out renumbers them
    return "\n".join(line for line in ptx.splitlines() if not re.match(r"\s*(\.(file|loc)\b|\$L__tmp\d+:$)", line))


def _case_ptx(arch: int, index: int) -> tuple[str, str]:
    import triton
    from triton.backends.compiler import GPUTarget

    case = _listing(arch)[index]
    spec = getattr(case, "spec", None)
    if spec is not None:  # a case that holds its backend's KernelSpec
        source, options = spec.ast_source(), dict(spec.options)
    else:
        from triton.compiler import ASTSource

        names = case.fn.arg_names
        source = ASTSource(case.fn, case.signature, attrs=case.attrs,
                           constexprs={(names.index(k),): v for k, v in case.constexprs.items()})
        options = dict(num_warps=case.num_warps, num_stages=case.num_stages)
    compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)
    return f"sm_{arch}a {' '.join(case.label.split())}", compiled.asm["ptx"]


def _gluon_ptx(kind: str, index: int) -> tuple[str, str]:
    os.environ["TRITON_INTERPRET"] = "0"
    sys.path.insert(0, os.path.join(TOOLS, "..", "src"))
    if kind == "prefill":
        from llmkernels.attention.gluon_hopper import compile_for_sm90

        label, head_dim, window, lse, consumers, page_size, ragged = GLUON_PREFILL[index]
        asm = compile_for_sm90(head_dim, window, return_lse=lse, consumers=consumers, page_size=page_size,
                               ragged=ragged)
    elif kind == "fp8 prefill":
        from llmkernels.attention.gluon_fp8_prefill import compile_for_sm90

        label, head_dim, causal, options = GLUON_FP8_PREFILL[index]
        asm = compile_for_sm90(head_dim, causal, **options)
    else:
        from llmkernels.attention.gluon_decode import compile_for_sm90

        label, head_dim, page_size = GLUON_DECODE[index]
        asm = compile_for_sm90(head_dim, page_size)
    return f"sm_90a gluon {kind} {label}", asm["ptx"]


def _compile(job) -> tuple[str, str, str]:
    kind, first, second = job
    label, ptx = _case_ptx(first, second) if kind == "case" else _gluon_ptx(kind, second)
    return label, hashlib.sha256(ptx.encode()).hexdigest(), hashlib.sha256(code_of(ptx).encode()).hexdigest()


def hashes(archs, jobs: int, gluon_only: bool = False) -> dict:
    work = [] if gluon_only else [("case", arch, index) for arch in archs for index in range(len(_listing(arch)))]
    if 90 in archs:
        work += [("prefill", 90, index) for index in range(len(GLUON_PREFILL))]
        work += [("decode", 90, index) for index in range(len(GLUON_DECODE))]
        work += [("fp8 prefill", 90, index) for index in range(len(GLUON_FP8_PREFILL))]
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
    parser.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"))
    parser.add_argument("--gluon-only", action="store_true", help="only the Gluon kernels (sm_90a)")
    args = parser.parse_args()
    if args.compare:
        with open(args.compare[0]) as first, open(args.compare[1]) as second:
            sys.exit(1 if compare(json.load(first), json.load(second)) else 0)
    archs = list(map(int, args.arch.split(",")))
    print(json.dumps(hashes(archs, args.jobs, args.gluon_only), indent=1, sort_keys=True))


if __name__ == "__main__":
    main()
