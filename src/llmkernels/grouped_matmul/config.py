"""BlockScaledMatmulConfig: the launch parameters of the grouped matmul kernel, and their defaults."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch
import triton.language as tl

from ..formats.layouts import HOPPER, ROW, Layout
from ..runtime import cuda_capability, interpreting, next_power_of_2, num_programs_hint, triton_version

__all__ = [
    "BlockScaledMatmulConfig",
    "ALL_GROUP_SIZES",
    "DECODE_CLASSES",
    "UPCAST_TILE",
    "default_config",
    "default_launches",
    "hopper_config",
    "fp8_config",
    "w4a8_config",
    "HOPPER_MIN_BLOCK_K",
    "FP8_BLOCK_K",
    "compute_dtype",
    "packed_decode",
    "retires_mma",
    "takes_upcast",
    "resolve_mma",
    "reads_scale_words",
    "block_groups",
]
# The Hopper-layout kernel's smallest K step: one 64-wide chunk of the layout. (Such steps once gave
# wrong results on the H100, traced to Triton 3.6's register-operand wgmma pipeline and fixed by
# kernel.retire_mma: lab/NOTES.md.)
HOPPER_MIN_BLOCK_K = 64
# fp8 blocks: one scale per 128 K columns, and the kernels promote each 128-wide K step's partial product
FP8_BLOCK_K = 128

_MMA_PATHS = ("auto", "dot_scaled", "dequant")
ALL_GROUP_SIZES = (-1, 2**31 - 1)  # (min exclusive, max inclusive) rows of the groups a launch takes
# Size classes of the decode regime, (min exclusive, max inclusive, tokens per group its config is chosen for):
# each group gets a tile height that covers it, so its expert's weights are read once (or a few times for the
# largest), whatever the routing's imbalance.
DECODE_CLASSES = ((ALL_GROUP_SIZES[0], 16, 16), (16, 64, None), (64, ALL_GROUP_SIZES[1], 4096))
UPCAST_TILE = (16, 256, 4)  # rows, K columns, warps of one program of the A pre-pass (memory bound)
_SPLIT_MIN_WEIGHT_BYTES = 1 << 30


def _is_power_of_2(n: int) -> bool:
    return isinstance(n, int) and n > 0 and n & (n - 1) == 0


@dataclass(frozen=True)
class BlockScaledMatmulConfig:
    """Tile shape, pipelining and MMA path of :func:`llmkernels.grouped_matmul`.

    Mirrors the seed's ``BlockScaledMatmulConfig``; the fields that mean something in Triton:

    ==========================  ========================================================================
    seed field                  here
    ==========================  ========================================================================
    ``block_tile_shape``        ``(block_m, block_n, block_k)``: output tile rows (tokens), output
                                columns, K step. Tiles never straddle two groups.
    ``num_pipeline_stages``     ``num_stages``: Triton's software-pipelining depth of the K loop.
    grid of the persistent      ``num_programs``: programs of the persistent grid (``None``: one per
    work iterator               SM); program p takes tiles p, p + num_programs, ...
    ``AB_swapped``              ``ab_swapped``: compute ``Cᵀ = B·Aᵀ`` per tile, so the weights are the
                                MMA's M side and the (few) tokens its N side: decode-time groups.
    ``scaling_kind``            follows from the operands' formats.
    ``mma_shape``, swizzles,    chosen by the Triton compiler (wgmma on Hopper, tcgen05 on Blackwell),
    ``cta_group``, cluster,     not settable from Triton.
    accumulator/output stages,
    ``register_based_epilogue``
    ==========================  ========================================================================

    ``mma`` picks how block scales reach the tensor cores: ``"dot_scaled"`` hands the raw MX operands
    and scales to ``tl.dot_scaled`` (native block-scaled MMA on Blackwell; Triton emulates it on
    Hopper), ``"dequant"`` decodes each tile to bf16/fp16 in registers and uses ``tl.dot``, and
    ``"auto"`` takes ``dot_scaled`` on compute capability ≥ 10 whenever both operands are block-scaled
    alike (MX × MX, NVFP4 × NVFP4: the native block-scaled ``tcgen05`` MMA) or the weights are MX under
    bf16 activations, and on Hopper for e2m1 MX weights (measured faster there); ``dequant`` elsewhere
    (NVFP4 off Blackwell included: Triton's Hopper lowering of e4m3-scaled ``dot_scaled`` fails).

    Switches of the ``dequant`` path: ``prefetch_scales`` loads each K step's block scales one step
    ahead; ``scale_words`` reads them as int32 words of four scale columns where alignment allows
    (``K`` and ``block_k`` multiples of four scale blocks), which Triton pipelines with the data;
    ``upcast_a`` decodes a quantized A once, in a pre-pass, and multiplies bf16 × B. bf16 tiles of e2m1
    data always decode through packed PTX on NVIDIA GPUs (``prmt`` lookups and bf16x2 ``fma``); fp16
    tiles and the interpreter take the float32 decode (same values).

    Raises ``ValueError`` on construction when a field is out of range.
    """

    block_m: int = 128
    block_n: int = 128
    block_k: int = 128
    num_stages: int = 3
    num_warps: int = 8
    num_programs: int | None = None
    mma: str = "auto"
    ab_swapped: bool = False
    prefetch_scales: bool = True
    scale_words: bool = False
    upcast_a: bool = False

    # fp8 blocks (``fp8_blocks`` backend): block_k must be 128; a block_n of 256 is two 128-row sub-tiles;
    # num_programs None launches one program per tile (the grid the lab measured); the mma and scale switches
    # do not apply (the e4m3 tiles go to tl.dot as they are).

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n"):
            value = getattr(self, name)
            if not _is_power_of_2(value) or not 16 <= value <= 256:
                raise ValueError(f"{name} must be a power of two in [16, 256], got {value!r}")
        if not _is_power_of_2(self.block_k) or not 32 <= self.block_k <= 512:
            raise ValueError(f"block_k must be a power of two in [32, 512], got {self.block_k!r}")
        if not isinstance(self.num_stages, int) or not 1 <= self.num_stages <= 8:
            raise ValueError(f"num_stages must be an int in [1, 8], got {self.num_stages!r}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"num_warps must be one of 1, 2, 4, 8, 16, got {self.num_warps!r}")
        if self.num_programs is not None and (not isinstance(self.num_programs, int) or self.num_programs < 1):
            raise ValueError(f"num_programs must be None or a positive int, got {self.num_programs!r}")
        for name in ("ab_swapped", "prefetch_scales", "scale_words", "upcast_a"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.mma not in _MMA_PATHS:
            raise ValueError(f"mma must be one of {_MMA_PATHS}, got {self.mma!r}")


def default_config(
    num_tokens: int,
    num_groups: int,
    n_out: int,
    k: int,
    device: torch.device,
    a_element: str = "bf16",
    b_element: str = "bf16",
    swiglu: bool = False,
    b_scale_block: int = 32,
    b_layout: Layout | str = ROW,
    b_scale: str | None = None,
    a_scale: str | None = None,
) -> BlockScaledMatmulConfig:
    """A config from what the host knows without a sync: shapes, the operands' element types
    (``"bf16" | "fp16" | "e4m3" | "e2m1"``), whether the epilogue is SwiGLU, B's scale block
    (32 for MX, 16 for NVFP4) and B's layout (a layout or its name; the Hopper layout: :func:`hopper_config`),
    B's scale type (``"f32"``: fp8 blocks, :func:`fp8_config`), A's scale type (``"f32"`` with e2m1 weights:
    fp8 ``(1, 128)`` activations with MXFP4 weights, :func:`w4a8_config`).

    SwiGLU tiles load gate and up rows of B (``2 · block_n`` rows per K step): the 128×128×128 compute
    tile keeps its ``block_n`` (both B tiles fit shared memory), the 256-row compute tiles of quantized
    weights become 256×64×64 (two 256×128 fp32 accumulators would not fit the registers), the others
    halve ``block_n`` (the B bytes per stage the plain tiles were chosen with). What each choice measured
    is in ``lab/NOTES.md``.
    """
    if b_layout == HOPPER:
        return hopper_config(num_tokens, num_groups, device, swiglu, b_scale_block)
    if b_scale == "f32":
        return fp8_config(num_tokens, num_groups, device, swiglu)
    if a_scale == "f32":
        return w4a8_config(num_tokens, num_groups, device, swiglu)
    config = _measured_config(num_tokens, num_groups, n_out, k, device, a_element, b_element, b_scale_block)
    if swiglu and config.block_m == 256:
        # Two e2m1 products per step: the packed register decode beats tl.dot_scaled's upcast there
        # (the plain product keeps dot_scaled).
        mma = "dequant" if b_element == "e2m1" and cuda_capability(device)[0] < 10 else config.mma
        return dataclasses.replace(config, block_n=64, block_k=64, num_stages=3, mma=mma)
    if not swiglu or (config.block_m, config.block_n, config.block_k) == (128, 128, 128):
        return config
    if config.ab_swapped and cuda_capability(device)[0] >= 10 and b_element in ("e4m3", "e2m1"):
        # Blackwell decode: gate and up tiles keep the MMA's 128 rows each; 8 warps hold both fp32 tiles
        # and the epilogue without register spills (4 warps spilled up to 152 bytes per thread at sm_100a).
        return dataclasses.replace(config, num_warps=8)
    return dataclasses.replace(config, block_n=max(16, config.block_n // 2))


def hopper_config(
    num_tokens: int, num_groups: int, device: torch.device, swiglu: bool = False, b_scale_block: int = 32
) -> BlockScaledMatmulConfig:
    """The tiles of MXFP4 (``b_scale_block`` 32) and NVFP4 (16) weights in the Hopper layout
    (``grouped_matmul/hopper_kernel.py``; measured in ``lab/NOTES.md``): 128 weight rows per
    step (``block_n``, 64 gate and 64 up rows under SwiGLU) against 16, 64 or 128 tokens by the average group,
    ``block_k`` 128, 4 warps, 3 stages (4 lost 12% at K 2048 with 16 tokens). NVFP4's 128-token tiles: plain
    ones step 64 along K (1.1x faster there, 1.2x slower for MXFP4), SwiGLU ones take 2 stages (with 3 its
    scale buffers leave room for one program per SM instead of two: 1.3x slower). Since
    each K step waits for its MMAs under Triton 3.6 (``kernel.retire_mma``), 8-warp tiles lose 1.2x or more.
    Of the config's fields the kernel reads the tile, warps and stages (its grid is not persistent and its
    product always swapped); small tiles in the interpreter."""
    if device.type != "cuda" or interpreting():
        return BlockScaledMatmulConfig(
            block_m=16, block_n=32, block_k=128, num_stages=1, num_warps=4, ab_swapped=True, mma="dequant"
        )
    tokens_per_group = num_tokens / max(num_groups, 1)
    block_m = 16 if tokens_per_group <= 16 else 64 if tokens_per_group <= 64 else 128
    block_k, stages = 128, 3
    if block_m == 128 and b_scale_block == 16:
        block_k, stages = (128, 2) if swiglu else (64, 3)
    return BlockScaledMatmulConfig(
        block_m, 64 if swiglu else 128, block_k, num_stages=stages, num_warps=4, ab_swapped=True, mma="dequant"
    )


def fp8_config(num_tokens: int, num_groups: int, device: torch.device, swiglu: bool = False) -> BlockScaledMatmulConfig:
    """The tiles of fp8-block weights (the ``fp8_blocks`` backend), from the Triton prototype's H100 sweep
    (``lab/fp8_blocks/NOTES.md``, results/fp8_blocks_h100.md; Triton 3.6, CUDA-graph replay), by the average group:

    * ≤ 16 tokens (decode): 16 x 128 swap-AB, 4 warps, 4 stages: 1320 / 1284 µs at E128 x 16 / E128 x 1 tokens,
      N 4096, K 7168 (1.07x ``torch._scaled_grouped_mm``, 118-121% of the measured copy bandwidth; the other decode
      tiles were within 3%);
    * 17 to 64 tokens: 64 x 128, 4 warps, 4 stages (1316 µs at E128 x 16, 689-738 TFLOP/s in the compute shapes);
    * more (compute): 128 x 256 (two 128-row sub-tiles), 8 warps, 3 stages: 848 / 738 / 801 TFLOP/s at E8 x 2048
      K 7168 / E256 x 256 K 2048 / E16 x 4096 K 2048, against 794 / 643 / 744 for 128 x 128 w8 s4.

    All with one program per tile. SwiGLU tiles load gate and up rows: ``block_n`` halves (the registers and
    weight bytes per step of the plain tile). Small tiles in the interpreter, swap-AB for ≤ 16 tokens."""
    tokens_per_group = num_tokens / max(num_groups, 1)
    if device.type != "cuda" or interpreting():
        return BlockScaledMatmulConfig(
            16, 32, FP8_BLOCK_K, num_stages=1, num_warps=4, ab_swapped=tokens_per_group <= 16
        )
    if tokens_per_group <= 16:
        block_m, block_n, warps, stages, swap = 16, 128, 4, 4, True
    elif tokens_per_group <= 64:
        block_m, block_n, warps, stages, swap = 64, 128, 4, 4, False
    else:
        block_m, block_n, warps, stages, swap = 128, 256, 8, 3, False
    if swiglu:
        block_n //= 2
    return BlockScaledMatmulConfig(block_m, block_n, FP8_BLOCK_K, num_stages=stages, num_warps=warps, ab_swapped=swap)


def w4a8_config(
    num_tokens: int, num_groups: int, device: torch.device, swiglu: bool = False
) -> BlockScaledMatmulConfig:
    """The tiles of fp8 ``(1, 128)`` activations with MXFP4 weights on the portable ``w4a8_blocks`` backend, by the
    average group: ≤ 16 tokens 16 x 128 x 128 swap-AB (the decoded weights on the MMA's M side), 4 warps, 4 stages;
    17 to 64 tokens 64 x 128 x 64, 4 warps, 3 stages; more 128 x 128 x 64, 8 warps, 3 stages. The plain tiles step
    64 along K (two steps per scale block of A): with 128 they spilled 56-168 bytes a thread at sm_90a (Triton 3.9,
    ``tools/compile_defaults.py``), with 64 none. Chosen by analogy with :func:`fp8_config` (one 128-row weight
    tile: decoded bf16 weights take twice the registers of e4m3 ones), not timed on a GPU. SwiGLU tiles halve
    ``block_n``. Small tiles in the interpreter, swap-AB for ≤ 16 tokens; one program per tile."""
    tokens_per_group = num_tokens / max(num_groups, 1)
    if device.type != "cuda" or interpreting():
        return BlockScaledMatmulConfig(
            16, 32, FP8_BLOCK_K, num_stages=1, num_warps=4, ab_swapped=tokens_per_group <= 16
        )
    block_k = FP8_BLOCK_K
    if tokens_per_group <= 16:
        block_m, block_n, warps, stages, swap = 16, 128, 4, 4, True
    elif tokens_per_group <= 64:
        block_m, block_n, block_k, warps, stages, swap = 64, 128, 64, 4, 3, False
    else:
        block_m, block_n, block_k, warps, stages, swap = 128, 128, 64, 8, 3, False
    if swiglu:
        block_n //= 2
    return BlockScaledMatmulConfig(block_m, block_n, block_k, num_stages=stages, num_warps=warps, ab_swapped=swap)


def _measured_config(
    num_tokens: int,
    num_groups: int,
    n_out: int,
    k: int,
    device: torch.device,
    a_element: str,
    b_element: str,
    b_scale_block: int = 32,
) -> BlockScaledMatmulConfig:
    """The tiles of :func:`default_config` before the SwiGLU adjustment.

    Small tiles in the interpreter (each program runs as numpy on the CPU). On the GPU, the tiles that
    measured best on the H100 and H200 (the figures are in ``lab/NOTES.md``):

    * up to 64 tokens per group (decode, weight-bandwidth bound): one M tile covers a whole group, so
      each weight byte is read once (16, 32 or 64 rows); swap-AB for plain and e2m1 weights; two
      programs per SM, whose loads overlap each other's decoding; ``mma="dequant"`` on Hopper (the
      register decode beats ``tl.dot_scaled``'s upcast); at ≤ 16 rows e4m3 weights take 16×64×128 tiles,
      three programs per SM, and MX e2m1 weights load each step's scales in that step (as words under
      bf16 activations);
    * more tokens (compute bound): plain operands 128×256×64; quantized weights 256-row tiles (e4m3
      256×128×64 in 4 stages, e2m1 256×128×64 in 3, NVFP4 with its scales read as words), with a
      quantized A decoded ahead on Hopper (``upcast_a``: the fused path would decode A again for every
      N tile); one 8-warp program per SM.
    """
    if device.type != "cuda" or interpreting():
        return BlockScaledMatmulConfig(block_m=16, block_n=32, block_k=64, num_stages=1, num_warps=4)
    tokens_per_group = num_tokens / max(num_groups, 1)
    if tokens_per_group <= 64:
        two_per_sm = 2 * num_programs_hint(device)
        if cuda_capability(device)[0] >= 10 and b_element in ("e4m3", "e2m1"):
            # Blackwell: 128 weight rows fill the block-scaled MMA's M (swap-AB, the seed's AB_swapped),
            # the group's tokens its N; a narrower M would fall back to an unscaled MMA after a decode.
            block_m = 16 if tokens_per_group <= 16 else 32 if tokens_per_group <= 32 else 64
            return BlockScaledMatmulConfig(
                block_m, 128, 128, num_stages=4, num_warps=4, num_programs=two_per_sm, ab_swapped=True
            )
        swap = b_element != "e4m3"
        # Blackwell's block-scaled MMA needs no decode at all: keep "auto" (dot_scaled) there.
        mma = "dequant" if cuda_capability(device)[0] < 10 else "auto"
        if tokens_per_group <= 16:
            if b_element == "e4m3":  # narrow tiles, three programs per SM: more loads in flight per SM
                return BlockScaledMatmulConfig(
                    16, 64, 128, num_stages=4, num_warps=4, num_programs=3 * num_programs_hint(device), mma=mma
                )
            if b_element == "e2m1" and b_scale_block == 32:  # MX e2m1 weights: scales loaded in their step
                return BlockScaledMatmulConfig(
                    16,
                    128,
                    128,
                    num_stages=4,
                    num_warps=4,
                    num_programs=two_per_sm,
                    mma=mma,
                    ab_swapped=swap,
                    prefetch_scales=False,
                    scale_words=a_element in ("bf16", "fp16"),
                )
            return BlockScaledMatmulConfig(
                16, 128, 128, num_stages=4, num_warps=4, num_programs=two_per_sm, mma=mma, ab_swapped=swap
            )
        block_m = 32 if tokens_per_group <= 32 else 64
        # 4 warps measured best for e4m3×e4m3 and bf16×e2m1 at 64 rows, 8 warps for the others.
        if (a_element, b_element) in (("e4m3", "e4m3"), ("bf16", "e2m1"), ("fp16", "e2m1")):
            return BlockScaledMatmulConfig(
                block_m, 128, 128, num_stages=4, num_warps=4, num_programs=two_per_sm, mma=mma, ab_swapped=swap
            )
        return BlockScaledMatmulConfig(
            block_m, 128, 128, num_stages=3, num_warps=8, num_programs=two_per_sm, mma=mma, ab_swapped=swap
        )
    if b_element in ("bf16", "fp16"):
        return BlockScaledMatmulConfig(block_m=128, block_n=256, block_k=64, num_stages=3, num_warps=8)
    upcast = a_element in ("e4m3", "e2m1") and cuda_capability(device)[0] < 10
    if b_element == "e4m3":
        return BlockScaledMatmulConfig(256, 128, 64, num_stages=4, num_warps=8, upcast_a=upcast)
    if b_scale_block == 16:  # NVFP4 weights (e4m3 scales per 16): scales read as words, staged with the data
        return BlockScaledMatmulConfig(256, 128, 64, num_stages=3, num_warps=8, upcast_a=upcast, scale_words=True)
    return BlockScaledMatmulConfig(256, 128, 64, num_stages=3, num_warps=8, upcast_a=upcast)


@functools.lru_cache(maxsize=1024)
def default_launches(
    num_tokens: int,
    num_groups: int,
    n_out: int,
    k: int,
    device: torch.device,
    a_element: str = "bf16",
    b_element: str = "bf16",
    weight_bytes: int = 0,
    swiglu: bool = False,
    b_scale_block: int = 32,
    b_layout: Layout | str = ROW,
    b_scale: str | None = None,
    a_scale: str | None = None,
) -> tuple:
    """``((config, min_group_rows, max_group_rows), ...)``: the launches of one call by default.

    When the average group is small (decode, ≤ 64 tokens), the routing may still give a few experts
    hundreds of tokens; one tile height chosen from the average would cut those into many short
    tiles that each re-read the expert's weights. So groups are split by size on the device into
    three classes, ≤ 16 rows, 17–64 and more, each launched with the config of its size (a class
    with no group costs one empty launch). That pays when streaming the weights takes longer than
    the host needs for three launches: from ``weight_bytes`` ≥ 1 GiB on (a third of a millisecond
    at 3 TB/s), and always in the interpreter, where it is tested. Otherwise one launch takes every
    group. Each launch's config is :func:`default_config`'s for its class (``b_scale="f32"``: fp8-block weights,
    :func:`fp8_config`; ``a_scale="f32"`` with MXFP4 weights: :func:`w4a8_config`). Cached: the host work of a
    call is a dictionary lookup.
    """
    tokens_per_group = num_tokens / max(num_groups, 1)
    split = interpreting() or device.type != "cuda" or weight_bytes >= _SPLIT_MIN_WEIGHT_BYTES
    if tokens_per_group > 64 or not split:
        return (
            (
                default_config(
                    num_tokens,
                    num_groups,
                    n_out,
                    k,
                    device,
                    a_element,
                    b_element,
                    swiglu,
                    b_scale_block,
                    b_layout,
                    b_scale,
                    a_scale,
                ),
                *ALL_GROUP_SIZES,
            ),
        )
    launches = []
    for min_rows, max_rows, class_tokens in DECODE_CLASSES:
        # the middle class takes the average's tile height when the average falls in it
        class_tokens = class_tokens or max(tokens_per_group, 17)
        config = default_config(
            round(class_tokens * max(num_groups, 1)),
            max(num_groups, 1),
            n_out,
            k,
            device,
            a_element,
            b_element,
            swiglu,
            b_scale_block,
            b_layout,
            b_scale,
            a_scale,
        )
        launches.append((config, min_rows, max_rows))
    return tuple(launches)


# ------------------------------------------------------------------------------------------------
# Per launch: what the kernels are compiled with, from the operands (``grouped_matmul.check.Operand``) and config
# ------------------------------------------------------------------------------------------------


def compute_dtype(a_element: str):
    """The dtype the kernels multiply in: fp16 for fp16 activations, else bf16; float32 in the interpreter (which
    multiplies bf16 tiles as raw uint16 bits; decoded tiles are exact in bf16/fp16, so an fp32 dot gives the same
    products there)."""
    if interpreting():
        return tl.float32
    return tl.float16 if a_element == "fp16" else tl.bfloat16


def packed_decode(compute_dtype, device: torch.device) -> bool:
    """Whether e2m1 tiles take the packed PTX decode: bf16 tiles compiled for an NVIDIA GPU."""
    return compute_dtype == tl.bfloat16 and device.type == "cuda" and torch.version.hip is None and not interpreting()


def retires_mma(device: torch.device, decoded_left_operand: bool) -> bool:
    """Whether each K step waits for its wgmmas (``kernel.retire_mma``): on Hopper under Triton < 3.9 when
    the MMA's left operand is decoded in registers. Triton 3.6's PTX leaves such wgmmas reading registers
    that the next step overwrites (``tools/sass_hazards.py`` finds it in its SASS); 3.9's PTX waits for
    them itself. 3.7 and 3.8 are not checked, so they take the wait too."""
    return (
        decoded_left_operand
        and device.type == "cuda"
        and torch.version.hip is None
        and not interpreting()
        and cuda_capability(device)[0] == 9
        and triton_version() < (3, 9)
    )


def takes_upcast(config: BlockScaledMatmulConfig, a) -> bool:
    """Whether a launch of the grouped kernel reads A decoded ahead (``config.upcast_a``); A scales padded per
    group keep the fused decode (the pre-pass reads rows without their groups)."""
    return config.upcast_a and a.quantized and not a.scale_layout.grouped


def resolve_mma(config: BlockScaledMatmulConfig, a, b, device: torch.device) -> bool:
    """True when the grouped kernel should use ``tl.dot_scaled`` on operands ``a`` (as the kernel reads it: plain
    when decoded ahead) and ``b``: block-scaled weights with activations of their family (MX with MX, NVFP4 with
    NVFP4) or MX weights with bf16 activations. ``"auto"`` takes it on Blackwell (the native block-scaled MMA,
    NVFP4 included) and for MX e2m1 weights on Hopper (where Triton upcasts, which measured best for those);
    never in the interpreter (whose dot_scaled is checked through ``mma="dot_scaled"``).

    Raises:
        ValueError: ``mma="dot_scaled"`` for operands it does not take, or for nvfp4 off Blackwell.
    """
    scaled_pair = b.scale != "none" and (a.scale == b.scale or (a.element == "bf16" and b.scale == "e8m0"))
    blackwell = device.type == "cuda" and not interpreting() and cuda_capability(device)[0] >= 10
    if config.mma == "dequant":
        return False
    if config.mma == "dot_scaled":
        if not scaled_pair:
            raise ValueError(
                f"mma='dot_scaled' needs block-scaled weights with activations of their family or "
                f"MX weights with bf16 activations, got a={a.format}, b={b.format}"
            )
        if b.scale == "e4m3" and not blackwell:
            raise ValueError(
                "mma='dot_scaled' with nvfp4 runs on Blackwell (sm_100+) only: Triton's interpreter "
                "reads e4m3 scales as e8m0 and its Hopper lowering of them fails"
            )
        return True
    if not scaled_pair or interpreting() or device.type != "cuda":
        return False
    return blackwell or (b.element == "e2m1" and b.scale == "e8m0")


def reads_scale_words(operand, block_k: int, k: int) -> bool:
    """Whether the kernel may read ``operand``'s scales as int32 words of four scale columns (``SCALE_WORDS``):
    every word must start 4-byte aligned (``operand.scale_words_aligned``) and hold four columns of this row
    inside K."""
    if not operand.quantized:
        return True
    columns_per_step, columns = block_k // operand.scale_block, k // operand.scale_block
    return columns_per_step % 4 == 0 and columns % 4 == 0 and operand.scale_words_aligned


def block_groups(num_groups: int) -> int:
    """``BLOCK_GROUPS``: the width of the kernels' register vector of group metadata (all groups of a call)."""
    return max(16, next_power_of_2(num_groups))
