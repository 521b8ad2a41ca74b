"""The grouped-matmul launches ``tools/compile_defaults.py`` compiles: every default config per format pair."""
from __future__ import annotations

import re

import triton.language as tl

from compile_common import Case, _aligned_signature, _pretend_gpu, expected_mma
from llmkernels.grouped_matmul import api as gm_api
from llmkernels.grouped_matmul import config as gm_config
from llmkernels.grouped_matmul import hopper_kernel as gm_hopper_kernel
from llmkernels.grouped_matmul import kernel as gm_kernel

# (a element, a scale, a block, b element, b scale, b block) of each format pair
PAIRS = {
    "bf16xbf16": ("bf16", "none", 1, "bf16", "none", 1),
    "mxfp8xmxfp8": ("e4m3", "e8m0", 32, "e4m3", "e8m0", 32),
    "mxfp4xmxfp4": ("e2m1", "e8m0", 32, "e2m1", "e8m0", 32),
    "mxfp8xmxfp4": ("e4m3", "e8m0", 32, "e2m1", "e8m0", 32),
    "nvfp4xnvfp4": ("e2m1", "e4m3", 16, "e2m1", "e4m3", 16),
    "bf16xmxfp8": ("bf16", "none", 1, "e4m3", "e8m0", 32),
    "bf16xmxfp4": ("bf16", "none", 1, "e2m1", "e8m0", 32),
    "bf16xnvfp4": ("bf16", "none", 1, "e2m1", "e4m3", 16),
    "bf16xmxfp4@hopper": ("bf16", "none", 1, "e2m1", "e8m0", 32),  # b in the hopper layout: hopper_kernel
    "bf16xnvfp4@hopper": ("bf16", "none", 1, "e2m1", "e4m3", 16),
}
POINTER = {"bf16": "*bf16", "e4m3": "*u8", "e2m1": "*u8"}  # the API passes MX data as bytes
# The problem the grouped-matmul defaults are asked for: DeepSeek-V3-sized experts
GM_N, GM_K, GM_GROUPS, GM_TOKENS_PER_GROUP = 4096, 7168, 64, (2048, 48, 8)
# B200's published dense tensor-core rates (FLOP/s) per MMA kind and its HBM3e bandwidth (bytes/s)
B200_RATES = {"tcgen05.f16": 2.25e15, "tcgen05.mxf8f6f4.block32": 4.5e15, "tcgen05.mxf4.block32": 9e15,
              "tcgen05.mxf4nvf4.block16": 9e15}
B200_BANDWIDTH = 8e12
BYTES = {"bf16": 2.0, "e4m3": 1.0, "e2m1": 0.5}
def grouped_matmul_cases(arch: int, pairs=tuple(PAIRS)) -> list[Case]:
    """Every distinct config ``default_launches`` gives on ``arch`` for compute (2048 tokens per group) and
    decode (48, 8) sizes, each format pair, plain and SwiGLU epilogues."""
    device = _pretend_gpu(arch)
    cases = []
    for pair in pairs:
        a_el, a_sc, a_blk, b_el, b_sc, b_blk = PAIRS[pair]
        a_format, b_format, b_layout = re.fullmatch(r"(bf16|mxfp8|mxfp4|nvfp4)x(\w+?)(?:@(hopper))?", pair).groups()
        seen = set()
        for tokens_per_group in GM_TOKENS_PER_GROUP:
            for swiglu in (False, True):
                launches = gm_config.default_launches(tokens_per_group * GM_GROUPS, GM_GROUPS,
                                                      GM_N // 2 if swiglu else GM_N, GM_K, device, a_el, b_el,
                                                      1 << 40, swiglu, b_blk, b_layout or "row")
                for config, min_rows, max_rows in launches:
                    if (config, swiglu) not in seen:
                        seen.add((config, swiglu))
                        rows = min(max(tokens_per_group, min_rows + 1), max_rows)  # of the groups it takes
                        make = _hopper_layout_case if b_layout else _grouped_matmul_case
                        cases.append(make(pair, config, swiglu, arch, device, a_format, b_format, rows))
    return cases


def b200_bound(pair: str, tokens_per_group: int, swiglu: bool, mma: str) -> str:
    """The roofline bound on B200 of the default problem at ``tokens_per_group``: FLOPs at the published
    dense rate of the MMA kind, against every weight, activation, scale and output byte read or written
    once at 8 TB/s; "compute" or "memory" says which is larger."""
    a_el, _, a_blk, b_el, _, b_blk = PAIRS[pair]
    tokens = tokens_per_group * GM_GROUPS
    n_out = GM_N // 2 if swiglu else GM_N
    flops = 2.0 * tokens * GM_N * GM_K
    weights = GM_GROUPS * GM_N * GM_K * (BYTES[b_el] + (1 / b_blk if b_blk > 1 else 0))
    moved = weights + tokens * GM_K * (BYTES[a_el] + (1 / a_blk if a_blk > 1 else 0)) + tokens * n_out * 2
    compute_s, memory_s = flops / B200_RATES[mma], moved / B200_BANDWIDTH
    which = "compute" if compute_s > memory_s else "memory"
    return f"{max(compute_s, memory_s) * 1e6:.0f} us {which} ({flops / 1e12:.2f} TFLOP, {moved / 1e9:.2f} GB)"


# what a call without bias and with epilogue "swiglu" (or none) passes
_NO_BIAS_PLAIN_GLU = dict(HAS_BIAS=False, GLU_ALPHA=1.0, GLU_LIMIT=None, GLU_UP_SHIFT=0.0)


def _grouped_matmul_case(pair, config, swiglu, arch, device, a_format, b_format, tokens_per_group) -> Case:
    a_el, a_sc, a_blk, b_el, b_sc, b_blk = PAIRS[pair]
    a_op = gm_api._Operand(None, None, None, a_el, a_sc, a_blk, "row", a_format, a_sc == "e4m3")
    b_op = gm_api._Operand(None, None, None, b_el, b_sc, b_blk, "row", b_format, b_sc == "e4m3")
    a_global = a_sc == "e4m3"
    if gm_api._takes_upcast(config, a_op):  # the kernel then reads A decoded ahead, in bf16
        a_op = gm_api._upcast_view(a_op)
        a_el, a_sc, a_blk = "bf16", "none", 1
    dot_scaled = gm_api._resolve_mma(config, a_op, b_op, device)
    fn = gm_kernel.grouped_matmul_kernel
    constexprs = dict(
        A_ELEMENT=a_el, A_SCALE=a_sc, A_SCALE_BLOCK=a_blk, A_SCALE_LAYOUT="row",
        B_ELEMENT=b_el, B_SCALE=b_sc, B_SCALE_BLOCK=b_blk, B_SCALE_LAYOUT="row",
        A_GLOBAL_SCALE=a_global, B_GLOBAL_SCALE=b_sc == "e4m3",
        HAS_EXPERT_SCALES=True, EPILOGUE="swiglu" if swiglu else "none", EPILOGUE_FN=None, **_NO_BIAS_PLAIN_GLU,
        GLU_INTERLEAVED=False,
        USE_DOT_SCALED=dot_scaled, SWAP_AB=config.ab_swapped, PREFETCH_SCALES=config.prefetch_scales,
        SCALE_WORDS=config.scale_words, PACKED_DECODE=True,
        RETIRE_MMA=gm_api._retire_mma(device, (b_el if config.ab_swapped else a_el) not in ("bf16", "fp16")),
        COMPUTE_DTYPE=tl.bfloat16, BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, BLOCK_GROUPS=16)
    kinds = {name: "*i32" for name in fn.arg_names if name.endswith("_ptr")}
    kinds.update(a_ptr=POINTER[a_el], b_ptr=POINTER[b_el], out_ptr="*bf16", a_scales_ptr="*u8",
                 b_scales_ptr="*u8", a_global_scale_ptr="*fp32", b_global_scale_ptr="*fp32",
                 expert_scales_ptr="*fp32")
    signature, attrs = _aligned_signature(fn, constexprs, kinds, unaligned=("num_groups", "min_group_rows"))
    mma_m = config.block_n if config.ab_swapped else config.block_m
    label = (f"{pair:11s} {'swiglu' if swiglu else 'plain ':6s} {config.block_m}x{config.block_n}x{config.block_k} "
             f"s{config.num_stages} w{config.num_warps} {'swap' if config.ab_swapped else '    '} "
             f"{'dot_scaled' if dot_scaled else 'tl.dot':10s}")
    expect = expected_mma(arch, mma_m, a_sc, b_sc, a_el, b_el, dot_scaled)
    roofline = b200_bound(pair, tokens_per_group, swiglu, expect) if expect in B200_RATES else ""
    return Case("grouped_matmul", label, fn, signature, constexprs, attrs, config.num_warps, config.num_stages,
                mma_m, expect, f"{tokens_per_group} tokens/group: B200 bound {roofline}" if roofline else "")


def _hopper_layout_case(pair, config, swiglu, arch, device, a_format, b_format, tokens_per_group) -> Case:
    """A launch of ``hopper_kernel`` (bf16 activations × MXFP4 or NVFP4 weights in the hopper layout): the weight
    tile is the MMA's M side (``block_n`` rows), decoded in registers."""
    fn = gm_hopper_kernel.hopper_fp4_matmul_kernel
    nvfp4 = b_format == "nvfp4"
    constexprs = dict(B_SCALE="e4m3" if nvfp4 else "e8m0", A_GLOBAL_SCALE=False, B_GLOBAL_SCALE=nvfp4,
                      HAS_EXPERT_SCALES=True, EPILOGUE="swiglu" if swiglu else "none", EPILOGUE_FN=None,
                      **_NO_BIAS_PLAIN_GLU, EVEN_K=GM_K % config.block_k == 0, PACKED_DECODE=True,
                      RETIRE_MMA=gm_api._retire_mma(device, True), COMPUTE_DTYPE=tl.bfloat16,
                      BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, BLOCK_GROUPS=64)
    kinds = {name: "*i32" for name in fn.arg_names if name.endswith("_ptr")}
    kinds.update(a_ptr="*bf16", b_ptr="*u8", b_scales_ptr="*u8", out_ptr="*bf16", expert_scales_ptr="*fp32",
                 a_global_scale_ptr="*fp32", b_global_scale_ptr="*fp32")
    signature, attrs = _aligned_signature(fn, constexprs, kinds, unaligned=("num_groups", "min_group_rows"))
    label = (f"{pair:11s} {'swiglu' if swiglu else 'plain ':6s} {config.block_m}x{config.block_n}x{config.block_k} "
             f"s{config.num_stages} w{config.num_warps} swap {'tl.dot':10s}")
    expect = expected_mma(arch, config.block_n)
    roofline = b200_bound(pair.split("@")[0], tokens_per_group, swiglu, expect) if expect in B200_RATES else ""
    return Case("grouped_matmul", label, fn, signature, constexprs, attrs, config.num_warps, config.num_stages,
                config.block_n, expect, f"{tokens_per_group} tokens/group: B200 bound {roofline}" if roofline else "")
