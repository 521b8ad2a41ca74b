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
from dataclasses import dataclass, field

os.environ["TRITON_INTERPRET"] = "0"
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import sass_hazards  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from llmkernels import _runtime  # noqa: E402
from llmkernels.attention import config as attn_config  # noqa: E402
from llmkernels.attention import kernel as attn_kernel  # noqa: E402
from llmkernels.attention import split_kv  # noqa: E402
from llmkernels.grouped_matmul import api as gm_api  # noqa: E402
from llmkernels.grouped_matmul import config as gm_config  # noqa: E402
from llmkernels.grouped_matmul import hopper_kernel as gm_hopper_kernel  # noqa: E402
from llmkernels.grouped_matmul import kernel as gm_kernel  # noqa: E402

# Per architecture: streaming multiprocessors the defaults assume (H100 / B200), shared memory a block
# may take, registers per SM.
GPUS = {90: dict(sms=132, shared=232448, registers=65536), 100: dict(sms=148, shared=232448, registers=65536)}
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
# The attention calls: (label, head dim, decode, paged, visible band)
ATTENTION_CALLS = [(f"prefill d{d}", d, False, False, None) for d in (64, 128, 256)] + [
    ("prefill d128 window 1024", 128, False, False, 1024)] + [
    (f"decode d{d} paged gqa8", d, True, True, None) for d in (64, 128, 256)] + [
    ("decode d128 gqa8", 128, True, False, None)]


@dataclass(frozen=True)
class Case:
    """One kernel launch as the library would compile it."""

    family: str
    label: str
    fn: object = field(repr=False)
    signature: dict = field(repr=False)
    constexprs: dict = field(repr=False)
    attrs: dict = field(repr=False)  # Triton's specialization of the arguments (divisibility by 16)
    num_warps: int
    num_stages: int
    mma_m: int  # rows of the MMA's M side (the weights' rows under swap-AB); 0 without an MMA
    expect: str  # the MMA instruction the design says this path issues (see expected_mma)
    roofline: str = ""  # grouped matmul on Blackwell: the B200 time bound of the problem the config is for


@dataclass(frozen=True)
class Result:
    shared: int = 0
    registers: int = 0
    stack: int = 0
    mma: str = ""
    fa4: str = ""  # attention: the FA4 features the compiled code shows (fa4_features)
    error: str = ""
    hgmma: int = 0  # Hopper: HGMMA instructions in the SASS
    hgmma_waits: int = 0  # Hopper: full waits on them (WARPGROUP.DEPBAR.LE gsb0, 0x0)
    hgmma_hazards: int = 0  # Hopper: writes to the A registers of an HGMMA in flight (tools/sass_hazards.py)


def expected_mma(arch: int, mma_m: int, a_scale: str = "none", b_scale: str = "none", a_element: str = "bf16",
                 b_element: str = "bf16", dot_scaled: bool = False) -> str:
    """The tensor-core instruction a path should compile to.

    Hopper (sm_90a): ``wgmma`` for an MMA M of 64 rows or more, ``mma.sync`` below (decode tiles whose
    tokens are the M side). Blackwell (sm_100a): ``tcgen05.mma`` with block scales when both operands are
    block-scaled by the same kind of scale (``mxf8f6f4`` when either is e4m3, ``mxf4`` for MXFP4 × MXFP4,
    ``mxf4nvf4`` for NVFP4) and ``kind::f16`` otherwise (bf16 operands, and weight-only pairs, whose
    weights are decoded to bf16: docs/blackwell.md says why). tcgen05 takes an M of 64 rows or more
    (``mma.sync`` below: decode attention tiles); the block-scaled kinds need 128."""
    if mma_m == 0:
        return "none"
    if arch < 100:
        return "wgmma" if mma_m >= 64 else "mma.sync"
    if mma_m < 64:
        return "mma.sync"
    if dot_scaled and mma_m >= 128 and a_scale == b_scale == "e8m0":
        kind = "mxf8f6f4" if "e4m3" in (a_element, b_element) else "mxf4"
        return f"tcgen05.{kind}.block32"
    if dot_scaled and mma_m >= 128 and a_scale == b_scale == "e4m3":
        return "tcgen05.mxf4nvf4.block16"
    return "tcgen05.f16"


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


def _pretend_gpu(arch: int) -> torch.device:
    """The defaults ask the device for its capability and SM count: answer as the target GPU would."""
    _runtime._capability_of = lambda index: (arch // 10, arch % 10)
    _runtime._multiprocessor_count = lambda index: GPUS[arch]["sms"]
    torch.cuda.current_device = lambda: 0
    gm_config.default_launches.cache_clear()
    attn_config.default_config.cache_clear()
    return torch.device("cuda", 0)


def _aligned_signature(fn, constexprs: dict, kinds: dict, unaligned=()) -> tuple[dict, dict]:
    """Signature and specialization of a launch: ``kinds`` maps argument names to types (others are
    int32); pointers and the int32 strides and sizes not in ``unaligned`` are taken as divisible by 16, as a
    launch with aligned tensors and sizes specializes them (which enables vectorized async copies and with
    them the software pipeline)."""
    signature, attrs = {}, {}
    for index, name in enumerate(fn.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
            continue
        signature[name] = kinds.get(name, "i32")
        if signature[name].startswith("*") or (signature[name] == "i32" and name not in unaligned):
            attrs[(index,)] = [["tt.divisibility", 16]]
    return signature, attrs


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


def attention_cases(arch: int, calls=tuple(ATTENTION_CALLS)) -> list[Case]:
    """The attention launches of ``default_config`` on ``arch``: prefill (causal; TMA K/V where the library
    takes it), a windowed prefill, split-KV decode of 8 q heads per KV head (paged and dense) and the
    split combine."""
    device = _pretend_gpu(arch)
    cases = []
    for label, depth, decode, paged, band in calls:
        config = attn_config.default_config(depth, torch.bfloat16, device, decode=decode, num_q_heads=32,
                                            num_kv_heads=4, visible_band=band)
        group = 8
        if decode:
            block_q, heads_per_tile = split_kv.decode_tiling(1, group, config.pack_gqa_heads)
            num_q_tiles = 1
        else:
            block_q, heads_per_tile, num_q_tiles = config.MMA_M, 1, config.num_q_tiles
        tma = config.tma_kv and not paged and depth == 1 << (depth - 1).bit_length()
        fn = attn_kernel.attention_fwd_kernel
        constexprs = dict(
            HEAD_DIM=depth, HEAD_DIM_PAD=depth, BLOCK_Q=block_q, HEADS_PER_TILE=heads_per_tile, BLOCK_N=config.BN,
            NUM_Q_TILES=num_q_tiles, RAGGED_Q=False, RAGGED_K=False, PAGED=paged, PAGE_SIZE=64 if paged else 16,
            HAS_WINDOW=band is not None, HAS_CHUNK=False, HAS_MASK_MOD=False, MASK_MOD=None,
            SCORE_MOD_KIND="none", SCORE_MOD=None, HAS_SINKS=False, SPLIT=decode, RETURN_LSE=False,
            REVERSE_Q_BLOCKS=band is not None and not decode, RESCALE_THRESHOLD=config.rescale_threshold,
            POLY_EXP2_FRACTION=config.poly_exp2_fraction, TMA_KV=tma, UPCAST=False, KV_STARTS=False,
            PAGE_OFFSETS_64=False,
            MASK_TENSOR="none")
        kinds = {name: "*i32" for name in fn.arg_names if name.endswith("_ptr")}
        kinds.update(q_ptr="*bf16", k_ptr="*bf16", v_ptr="*bf16", out_ptr="*fp32" if decode else "*bf16",
                     lse_ptr="*fp32", sinks_ptr="*fp32", alibi_slopes_ptr="*fp32", softmax_scale="fp32",
                     softcap_value="fp32", k_desc="*bf16", v_desc="*bf16")
        if tma:
            kinds.update(k_desc=f"tensordesc<bf16[{config.BN},{depth}]>", v_desc=f"tensordesc<bf16[{config.BN},{depth}]>")
        signature, attrs = _aligned_signature(fn, constexprs, kinds, unaligned=(
            "group", "num_splits", "num_kv_heads", "num_head_programs", "window_left", "window_right", "chunk_size",
            "num_pages"))
        tiles = f"{num_q_tiles}x{block_q * heads_per_tile}x{config.BN}"
        full = (f"{label:24s} q-tiles x rows x keys {tiles:9s} s{config.num_kv_stages} w{config.num_warps} "
                f"{'tma' if tma else '   '} rescale>{config.rescale_threshold:g} poly {config.poly_exp2_fraction:g}")
        mma_m = block_q * heads_per_tile
        cases.append(Case("attention", full, fn, signature, constexprs, attrs, config.num_warps,
                          config.num_kv_stages, mma_m, expected_mma(arch, mma_m)))
    fn = split_kv.combine_splits_kernel
    kinds = {"o_partial_ptr": "*fp32", "lse_partial_ptr": "*fp32", "out_ptr": "*bf16", "lse_ptr": "*fp32",
             "sinks_ptr": "*fp32"}
    for one_block in (True, False):
        constexprs = dict(HEAD_DIM=128, HEAD_DIM_PAD=128, BLOCK_SPLITS=64, HAS_SINKS=True, RETURN_LSE=True,
                          ONE_BLOCK=one_block)
        signature, attrs = _aligned_signature(fn, constexprs, kinds, unaligned=("num_splits",))
        label = "split-KV combine d128" + (" one block" if one_block else " blocks")
        cases.append(Case("attention", label, fn, signature, constexprs, attrs, 4, 3, 0, "none"))
    return cases


def compile_case(case: Case, arch: int) -> Result:
    """Compiles one case for ``sm_<arch>a``; a compiler failure comes back as ``Result.error``."""
    names = case.fn.arg_names
    source = ASTSource(case.fn, case.signature,
                       constexprs={(names.index(k),): v for k, v in case.constexprs.items()}, attrs=case.attrs)
    try:
        with _hushed_stderr():
            compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32),
                                      options=dict(num_warps=case.num_warps, num_stages=case.num_stages))
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
    return Result(compiled.metadata.shared, registers, stack, mma_kinds(ptx), fa4, hgmma=hgmma,
                  hgmma_waits=hgmma_waits, hgmma_hazards=hazards)


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
    return (f"MMAs per K/V tile {sharing}, conditional rescales {rescales}, "
            f"exp2 MUFU {mufu} / poly {ptx.count(_POLY_EXP2_COEFFICIENT)}")


def mma_kinds(ptx: str) -> str:
    """The tensor-core instructions a PTX issues: ``tcgen05.mma`` kinds (Blackwell), ``wgmma`` (Hopper) or
    ``mma.sync`` (Ampere-class), comma-separated; "none" without any."""
    # Triton >= 3.8 writes the scale block (".block32"), older ones the scale vector (".scale_vec::2X").
    found = set()
    for kind, block, vector in re.findall(
            r"tcgen05\.mma\.cta_group::\d\.kind::(\w+)(?:\.block_scale)?(?:\.block(\d+)|\.scale_vec::(\d)X)?", ptx):
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
    return (sass.count("HGMMA."), sass.count("WARPGROUP.DEPBAR.LE gsb0, 0x0"),
            len(sass_hazards.hazards(sass)))


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


@functools.lru_cache(maxsize=None)  # once per process: a worker compiles many cases of one listing
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
    print(f"# Triton {triton.__version__}, torch {torch.__version__}; columns: config, shared bytes, registers, "
          f"stack (spill) bytes per thread, MMA instruction in the PTX (attention: and its FA4 features), verdict")
    failures = 0
    for arch in map(int, args.arch.split(",")):
        print(f"## sm_{arch}a")
        for case, result in compile_all(arch, args.family.split(","), tuple(args.pairs.split(",")), args.jobs):
            found = problems(case, result, arch)
            failures += bool(found)
            waits = (f"HGMMA {result.hgmma:3d} waits {result.hgmma_waits:3d} hazards {result.hgmma_hazards:3d} "
                     if result.hgmma else "")
            figures = (f"shared {result.shared:6d} registers {result.registers:3d} stack {result.stack:4d} "
                       f"{waits}{result.mma:26s}{result.fa4}") if not result.error else ""
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
            print(f"| {case.family} | {config} | {mma} | {result.shared / 1024:.1f} | {result.registers} | "
                  f"{result.stack} | {bound} |", flush=True)


if __name__ == "__main__":
    main()
