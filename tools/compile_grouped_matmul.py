"""The grouped-matmul launches ``tools/compile_defaults.py`` compiles: every default config per format pair, each as
the library plans it (the backend that takes it and the :class:`llmkernels.launch.KernelSpec` it binds)."""

from __future__ import annotations

import contextlib

import torch
from compile_common import GPUS, Case, expected_mma

from llmkernels import runtime
from llmkernels.formats import format_spec
from llmkernels.formats.layouts import HOPPER, ROW
from llmkernels.grouped_matmul import SwiGLU
from llmkernels.grouped_matmul import config as gm_config
from llmkernels.grouped_matmul.backends import backend_for, bf16_hopper, fp8_hopper, w4a8_hopper
from llmkernels.grouped_matmul.backends.base import read_a
from llmkernels.grouped_matmul.check import CheckedCall, Operand
from llmkernels.grouped_matmul.plan import launch_configs

# (a format, b format, b layout) of each pair; "@hopper": b in the Hopper layout (hopper_kernel.py)
PAIRS = {
    "bf16xbf16": ("bf16", "bf16", ROW),
    "mxfp8xmxfp8": ("mxfp8", "mxfp8", ROW),
    "mxfp4xmxfp4": ("mxfp4", "mxfp4", ROW),
    "mxfp8xmxfp4": ("mxfp8", "mxfp4", ROW),
    "nvfp4xnvfp4": ("nvfp4", "nvfp4", ROW),
    "bf16xmxfp8": ("bf16", "mxfp8", ROW),
    "bf16xmxfp4": ("bf16", "mxfp4", ROW),
    "bf16xnvfp4": ("bf16", "nvfp4", ROW),
    "bf16xmxfp4@hopper": ("bf16", "mxfp4", HOPPER),
    "bf16xnvfp4@hopper": ("bf16", "nvfp4", HOPPER),
    # fp8 blocks: (1, 128) activations, (128, 128) weights (a bf16 A is quantized to this ahead: the same launches)
    "fp8xfp8": ("fp8", "fp8", ROW),
    # w4a8: fp8 (1, 128) activations with MXFP4 weights (the portable w4a8_blocks kernel)
    "fp8xmxfp4": ("fp8", "mxfp4", ROW),
}
# The problem the grouped-matmul defaults are asked for: DeepSeek-V3-sized experts
GM_N, GM_K, GM_GROUPS, GM_TOKENS_PER_GROUP = 4096, 7168, 64, (2048, 48, 8)
# B200's published dense tensor-core rates (FLOP/s) per MMA kind and its HBM3e bandwidth (bytes/s)
B200_RATES = {
    "tcgen05.f16": 2.25e15,
    "tcgen05.mxf8f6f4.block32": 4.5e15,
    "tcgen05.mxf4.block32": 9e15,
    "tcgen05.mxf4nvf4.block16": 9e15,
}
B200_BANDWIDTH = 8e12
BYTES = {"bf16": 2.0, "e4m3": 1.0, "e2m1": 0.5}


def operand(format: str, layout=ROW, weights: bool = False) -> Operand:
    """What the library's checks find of an operand of ``format`` (``"bf16"`` or a block-scaled format) whose
    parts sit aligned in ``layout``; ``weights``: B (fp8 blocks: 128 rows per scale, A's 1)."""
    if format == "bf16":
        return Operand.plain("bf16")
    spec = format_spec(format)
    block_rows = spec.block if weights and format == "fp8" else 1
    return Operand(spec.element, spec.scale, spec.block, layout, format, spec.has_global_scale, block_rows=block_rows)


def described_call(pair: str, tokens_per_group: int, swiglu: bool, device: torch.device) -> CheckedCall:
    """The checked call (without tensors) of the default problem for ``pair`` at ``tokens_per_group``: expert
    scales, no bias, bf16 out, every expert's weights (1 TiB, so that decode sizes split into size classes)."""
    a_format, b_format, b_layout = PAIRS[pair]
    return CheckedCall(
        operand(a_format),
        operand(b_format, b_layout, weights=True),
        tokens_per_group * GM_GROUPS,
        GM_K,
        GM_GROUPS,
        GM_N,
        GM_N // 2 if swiglu else GM_N,
        GM_GROUPS,
        device,
        epilogue_kind="swiglu" if swiglu else "none",
        glu=SwiGLU() if swiglu else None,
        has_expert_scales=True,
        weight_bytes=1 << 40,
    )


@contextlib.contextmanager
def on_gpu(arch: int):
    """The library's device queries answer as the GPU of ``arch`` (:data:`compile_common.GPUS`) inside."""
    with runtime.pretend_gpu((arch // 10, arch % 10), GPUS[arch]["sms"]) as device:
        gm_config.default_launches.cache_clear()
        try:
            yield device
        finally:
            gm_config.default_launches.cache_clear()


def grouped_matmul_cases(arch: int, pairs=tuple(PAIRS)) -> list[Case]:
    """Every distinct config ``default_launches`` gives on ``arch`` for compute (2048 tokens per group) and
    decode (48, 8) sizes, each format pair, plain and SwiGLU epilogues: the launch each backend would bind."""
    cases = []
    with on_gpu(arch) as device:
        for pair in pairs:
            seen = set()
            for tokens_per_group in GM_TOKENS_PER_GROUP:
                for swiglu in (False, True):
                    call = described_call(pair, tokens_per_group, swiglu, device)
                    for config, min_rows, max_rows in launch_configs(call, None):
                        if (config, swiglu) not in seen:
                            seen.add((config, swiglu))
                            rows = min(max(tokens_per_group, min_rows + 1), max_rows)  # of the groups it takes
                            cases.append(_case(pair, call, config, (min_rows, max_rows), arch, rows))
    return cases


def _case(pair: str, call: CheckedCall, config, group_rows: tuple[int, int], arch: int, tokens_per_group: int) -> Case:
    backend = backend_for(call, config)
    spec = backend.kernel_spec(call, config, group_rows)
    source = spec.ast_source()
    a, b = read_a(call, backend.upcast_dtype(call, config)), call.b
    dot_scaled = spec.constexprs.get("USE_DOT_SCALED", False)
    swiglu = call.epilogue_kind == "swiglu"
    mma_m = config.block_n if config.ab_swapped else config.block_m  # the weights' rows under swap-AB
    warp_specialized = backend in (fp8_hopper, bf16_hopper, w4a8_hopper)
    if backend is w4a8_hopper:  # weight rows x tokens x K per stage
        tile = f"gluon {w4a8_hopper.kernel.BLOCK_W}x{w4a8_hopper.TOKENS}x128"
    elif warp_specialized:  # the Gluon kernel's own tile, whatever the config's
        kernel = fp8_hopper.kernel
        (_, k_step), _ = kernel.boxes(kernel.gl.float8e4nv if backend is fp8_hopper else kernel.gl.bfloat16)
        tile = f"gluon {kernel.BLOCK_M}x{kernel.BLOCK_N}x{k_step}"
    if warp_specialized:
        label = (
            f"{pair:11s} {'swiglu' if swiglu else 'plain ':6s} {tile} s{spec.constexprs['STAGES']} ws   {'wgmma':10s}"
        )
    else:
        label = (
            f"{pair:11s} {'swiglu' if swiglu else 'plain ':6s} {config.block_m}x{config.block_n}x{config.block_k} "
            f"s{config.num_stages} w{config.num_warps} {'swap' if config.ab_swapped else '    '} "
            f"{'dot_scaled' if dot_scaled else 'tl.dot':10s}"
        )
    expect = expected_mma(arch, mma_m, a.scale, b.scale, a.element, b.element, dot_scaled)
    roofline = b200_bound(call.a, b, tokens_per_group, swiglu, expect) if expect in B200_RATES else ""
    return Case(
        # the Gluon kernel waits for every wgmma on purpose (each K block's partial is promoted as it lands; the
        # other consumer warpgroup's wgmmas fill the gap): the check for wgmmas ptxas serialized is not for it
        "grouped_matmul_ws" if warp_specialized else "grouped_matmul",
        label,
        spec.fn,
        source.signature,
        dict(spec.constexprs),
        source.attrs,
        spec.options["num_warps"],
        spec.options.get("num_stages", 0),
        mma_m,
        expect,
        f"{tokens_per_group} tokens/group: B200 bound {roofline}" if roofline else "",
        spec if warp_specialized else None,
    )


def b200_bound(a: Operand, b: Operand, tokens_per_group: int, swiglu: bool, mma: str) -> str:
    """The roofline bound on B200 of the default problem at ``tokens_per_group``: FLOPs at the published
    dense rate of the MMA kind, against every weight, activation, scale and output byte read or written
    once at 8 TB/s; "compute" or "memory" says which is larger."""
    tokens = tokens_per_group * GM_GROUPS
    n_out = GM_N // 2 if swiglu else GM_N
    flops = 2.0 * tokens * GM_N * GM_K
    weights = GM_GROUPS * GM_N * GM_K * (BYTES[b.element] + (1 / b.scale_block if b.quantized else 0))
    activations = tokens * GM_K * (BYTES[a.element] + (1 / a.scale_block if a.quantized else 0))
    moved = weights + activations + tokens * n_out * 2
    compute_s, memory_s = flops / B200_RATES[mma], moved / B200_BANDWIDTH
    which = "compute" if compute_s > memory_s else "memory"
    return f"{max(compute_s, memory_s) * 1e6:.0f} us {which} ({flops / 1e12:.2f} TFLOP, {moved / 1e9:.2f} GB)"
