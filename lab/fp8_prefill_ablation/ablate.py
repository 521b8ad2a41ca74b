"""Where the product FP8 prefill's time goes: the same kernel with one piece of work removed at a time.

    PYTHONPATH=src:. python lab/fp8_prefill_ablation/ablate.py [--compile-only] [--out DIR] [--producer-transpose]

Each variant is the product module (``llmkernels/attention/gluon_fp8_prefill.py``) with text substitutions,
written to a temporary file and imported as a sibling module, its kernel swapped into the product backend (the
attention plan cache cleared between variants). Removing work makes the results wrong: only the times mean
anything. A variant that gets much faster names the critical resource:

* ``no_transpose``: the producer waits and signals as before but moves no V bytes (V^T stays stale);
* ``no_exp``: P = the exp2's argument (no MUFU for P; alpha's exp2 per row stays);
* ``no_exp_no_max``: also no row max (m stays -inf; the row sum stays);
* ``no_exp_no_transpose``: both;
* ``poly_1_8`` / ``poly_1_4``: not a removal: an eighth / a quarter of P's exp2s on the FMA units
  (``lab/gluon_fp8_attention``'s ``_exp2_mixed``, FA4's emulation), the rest on MUFU; its output is checked
  against the base's.

``--compile-only`` (no GPU): compiles every variant for sm_90a and prints its consumer-loop instruction counts.
``--producer-transpose``: every call transposes V in the producer (``V_READS`` out of reach), as the product did when
the removal table of ``lab/NOTES.md`` was recorded; without it dense calls at these shapes take V^T from memory and
``no_transpose`` removes nothing (the ``poly_*`` rows were recorded that way).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import tempfile

import torch

SOURCE = os.path.join(os.path.dirname(__file__), "..", "..", "src", "llmkernels", "attention", "gluon_fp8_prefill.py")

NO_TRANSPOSE = [("for c in gl.static_range(HEAD_DIM // V_CHUNK):", "for c in gl.static_range(0):")]
NO_EXP = [
    (
        "p = gl.exp2(gl.fma(s, gl.expand_dims(scale, 1), gl.expand_dims(P_SHIFT - m_scaled, 1)))",
        "p = gl.fma(s, gl.expand_dims(scale, 1), gl.expand_dims(P_SHIFT - m_scaled, 1))",
    ),
    (
        "p = gl.exp2(gl.fma(s, scale, gl.expand_dims(P_SHIFT - m_scaled, 1)))",
        "p = gl.fma(s, scale, gl.expand_dims(P_SHIFT - m_scaled, 1))",
    ),
]
_POLY_SOURCE = (
    "@gluon.jit\ndef _exp2_poly(x):"
    + (
        open(os.path.join(os.path.dirname(__file__), "..", "gluon_fp8_attention", "fp8_attention.py"))
        .read()
        .split("@gluon.jit\ndef _exp2_poly(x):")[1]
        .split("@gluon.jit\ndef _softmax_cond(")[0]
    )
)


def poly(fraction: float) -> list:
    """P's exp2 through ``_exp2_mixed(., fraction)``, the lab kernel's functions inserted before the softmax."""
    return [
        ("@gluon.jit\ndef _softmax_tile(", _POLY_SOURCE + "@gluon.jit\ndef _softmax_tile("),
        (
            "p = gl.exp2(gl.fma(s, scale, gl.expand_dims(P_SHIFT - m_scaled, 1)))",
            f"p = _exp2_mixed(gl.fma(s, scale, gl.expand_dims(P_SHIFT - m_scaled, 1)), {fraction})",
        ),
    ]


NO_MAX = [("m_new = gl.maximum(m_i, gl.max(s, axis=1))", "m_new = m_i")]

VARIANTS = {
    "base": [],
    "no_transpose": NO_TRANSPOSE,
    "no_exp": NO_EXP,
    "no_exp_no_max": NO_EXP + NO_MAX,
    "no_exp_no_transpose": NO_EXP + NO_TRANSPOSE,
    "poly_1_8": poly(0.125),
    "poly_1_4": poly(0.25),
}

# (batch, heads, seqlen, head_dim, causal)
SHAPES = [(4, 16, 4096, 128, False), (4, 16, 4096, 128, True), (4, 16, 4096, 64, False), (4, 16, 4096, 64, True)]


def patched_module(source: str, name: str, substitutions: list, directory: str):
    """The attention module at ``source`` with ``(old, new)`` text substitutions, written to ``directory`` and
    imported as ``llmkernels.attention._lab_<name>`` (a sibling of the product modules: its relative imports work)."""
    text = open(source).read()
    for old, new in substitutions:
        if old not in text:
            raise SystemExit(f"{name}: {old!r} not in {source}")
        text = text.replace(old, new)
    path = os.path.join(directory, f"_lab_{name}.py")
    with open(path, "w") as f:
        f.write(text)
    module_name = f"llmkernels.attention._lab_{name}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    return module


def load_variant(name: str, directory: str):
    """The product FP8 prefill module with the variant's substitutions."""
    return patched_module(SOURCE, f"ablate_{name}", VARIANTS[name], directory)


def use(module) -> None:
    """Routes the product backend's launches to ``module``'s kernel."""
    from llmkernels.attention import gluon_fp8_prefill
    from llmkernels.attention.plan import PLANS

    gluon_fp8_prefill.GluonFp8Prefill.kernel = module._fp8_attention_fwd_kernel
    PLANS.clear()


def compile_only(modules: dict) -> None:
    import re

    for name, module in modules.items():
        use(module)
        from llmkernels.attention import gluon_fp8_prefill

        for head_dim in (128, 64):
            asm = gluon_fp8_prefill.compile_for_sm90(head_dim, False)
            sass = asm.get("sass") or ""
            ptx = asm["ptx"]
            counts = {op: len(re.findall(rf"\b{op}\b", ptx)) for op in ("ex2.approx.f32", "ex2.approx.ftz.f32")}
            print(f"{name:22s} D {head_dim}: ptx lines {ptx.count(chr(10))}, {counts}, sass {len(sass)} chars")


def time_variants(modules: dict, out_dir: str) -> None:
    from benchmarks.bench_attention_prefill import fp8_inputs
    from benchmarks.common import graph_time_ms
    from llmkernels.attention.api import attention

    lines = ["| B x H x S x D | causal | " + " | ".join(modules) + " |", "|---|---|" + "---|" * len(modules)]
    for batch, heads, seqlen, head_dim, causal in SHAPES:
        inputs = fp8_inputs(batch, heads, seqlen, head_dim, "cuda")
        descales = {key: inputs[key] for key in ("q_descale", "k_descale", "v_descale")}
        flops = 4 * batch * heads * seqlen * seqlen * head_dim * (0.5 if causal else 1.0)
        cells, base = [], None
        for name, module in modules.items():
            use(module)

            def run():
                return attention(inputs["q8"], inputs["k8"], inputs["v8"], causal=causal, **descales)

            out = run().float()
            torch.cuda.synchronize()
            base = out if base is None else base
            moved = ((out - base).norm() / base.norm()).item()
            ms = graph_time_ms(run)
            cells.append(f"{flops / ms / 1e9:.0f}")
            print(
                f"{batch}x{heads}x{seqlen}x{head_dim} causal={causal} {name}: {ms:.3f} ms, {cells[-1]} TFLOP/s, "
                f"output moved {moved:.2e} from the first variant's",
                flush=True,
            )
        lines.append(f"| {batch}x{heads}x{seqlen}x{head_dim} | {causal} | " + " | ".join(cells) + " |")
    table = "\n".join(lines)
    print(table)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "ablation.md"), "w") as f:
        f.write(f"# FP8 prefill ablation, {torch.cuda.get_device_name()} (TFLOP/s, graph replay)\n\n{table}\n")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--compile-only", action="store_true")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--producer-transpose", action="store_true", help="V transposed by the producer only")
    args = parser.parse_args()
    if args.producer_transpose:
        from llmkernels.attention import gluon_fp8_prefill

        gluon_fp8_prefill.V_READS = 10**9
    with tempfile.TemporaryDirectory() as directory:
        modules = {name: load_variant(name, directory) for name in args.variants.split(",")}
        if args.compile_only:
            compile_only(modules)
        else:
            time_variants(modules, args.out)


if __name__ == "__main__":
    main()
