"""Compile the lab bf16 Gluon grouped matmul for sm_90a without a GPU: wgmma kinds, waits, registers, spills.

python3 lab/gluon_bf16/compile_sm90.py
"""

from __future__ import annotations

import os
import re
import sys

os.environ["TRITON_INTERPRET"] = "0"
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import triton  # noqa: E402

if "--wide" in sys.argv:  # the one-wgmma-per-step variant
    from gluon_kernel_wide import A_BOX, B_BOX, MAX_REGS, OUT_BOX, STAGES, fp8_hopper_grouped_kernel  # noqa: E402
else:
    from gluon_kernel import A_BOX, B_BOX, MAX_REGS, OUT_BOX, STAGES, fp8_hopper_grouped_kernel  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon._runtime import GluonASTSource  # noqa: E402


def _desc(block) -> str:
    layout = gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16)
    return f"tensordesc<bf16[{', '.join(map(str, block))}],{layout!r}>"


def compile_variant(stages: int, tma_store: bool) -> None:
    fn = fp8_hopper_grouped_kernel
    names = fn.arg_names
    constexprs = dict(
        STAGES=stages,
        HAS_EXPERT_SCALES=False,
        HAS_BIAS=False,
        EPILOGUE="none",
        EPILOGUE_FN=None,
        GLU_ALPHA=1.0,
        GLU_LIMIT=None,
        GLU_UP_SHIFT=0.0,
        TMA_STORE=tma_store,
    )
    types = dict(
        a_ptr=_desc(A_BOX),
        b_ptr=_desc(B_BOX),
        out_desc=_desc(OUT_BOX),
        a_scales_ptr="*fp32",
        b_scales_ptr="*fp32",
        out_ptr="*bf16",
        a_offsets_ptr="*i32",
        expert_ids_ptr="*i32",
        expert_scales_ptr="*fp32",
        bias_ptr="*fp32",
    )
    signature = {name: types.get(name, "i32") for name in names if name not in constexprs}
    signature.update({name: "constexpr" for name in constexprs})
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n, t in signature.items() if t.startswith("*")}
    source = GluonASTSource(
        fn, signature, constexprs={(names.index(n),): v for n, v in constexprs.items()}, attrs=attrs
    )
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, maxnreg=MAX_REGS))
    ptx = compiled.asm["ptx"]
    kinds = sorted(set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+\.\w+\.\w+\.\w+)", ptx)))
    waits = re.findall(r"wgmma\.wait_group\.sync\.aligned\s+(\d+)", ptx)
    print(
        f"Triton {triton.__version__}: wgmma {kinds} x {len(re.findall(r'wgmma.mma_async', ptx))}, "
        f"wait_group args {waits}, shared {compiled.metadata.shared} B, regs {getattr(compiled, 'n_regs', '?')}, "
        f"spills {getattr(compiled, 'n_spills', '?')}"
    )


if __name__ == "__main__":
    for stages, tma_store in ((STAGES, True), (4, False)):
        compile_variant(stages, tma_store)
