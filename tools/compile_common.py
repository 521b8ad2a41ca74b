"""What the ahead-of-time compile tools share: the GPUs they pretend to be, one compiled launch (:class:`Case`) and
what it should contain (:func:`expected_mma`). The cases of each kernel family live in ``compile_<family>.py``;
``compile_defaults.py`` compiles and checks them."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field

os.environ["TRITON_INTERPRET"] = "0"
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

import torch  # noqa: E402

from llmkernels import runtime  # noqa: E402
from llmkernels.attention import config as attn_config  # noqa: E402
from llmkernels.grouped_matmul import config as gm_config  # noqa: E402

# Per architecture: streaming multiprocessors the defaults assume (H100 / B200), shared memory a block
# may take, registers per SM.
GPUS = {90: dict(sms=132, shared=232448, registers=65536), 100: dict(sms=148, shared=232448, registers=65536)}


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
    spec: object = field(default=None, repr=False)  # the backend's KernelSpec, when the case is one (it compiles that)


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


def expected_mma(
    arch: int,
    mma_m: int,
    a_scale: str = "none",
    b_scale: str = "none",
    a_element: str = "bf16",
    b_element: str = "bf16",
    dot_scaled: bool = False,
) -> str:
    """The tensor-core instruction a path should compile to.

    Hopper (sm_90a): ``wgmma`` for an MMA M of 64 rows or more, ``mma.sync`` below (decode tiles whose
    tokens are the M side). Blackwell (sm_100a): ``tcgen05.mma`` with block scales when both operands are
    block-scaled by the same kind of scale (``mxf8f6f4`` when either is e4m3, ``mxf4`` for MXFP4 × MXFP4,
    ``mxf4nvf4`` for NVFP4), ``kind::f8f6f4`` for fp8 blocks (float32 scales: e4m3 × e4m3 ``tl.dot``, the
    scales applied after each K step) and ``kind::f16`` otherwise (bf16 operands, and weight-only pairs, whose
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
    if a_scale == b_scale == "f32":  # fp8 blocks: the e4m3 tiles go to tl.dot as they are
        return "tcgen05.f8f6f4"
    return "tcgen05.f16"


_PRETENDING: list = []


def _pretend_gpu(arch: int) -> torch.device:
    """The defaults ask the device for its capability and SM count: from here on they answer as the target GPU
    would (:func:`llmkernels.runtime.pretend_gpu`, left entered: a listing is made and compiled in one process)."""
    while _PRETENDING:
        _PRETENDING.pop().__exit__(None, None, None)
    pretending = runtime.pretend_gpu((arch // 10, arch % 10), GPUS[arch]["sms"])
    device = pretending.__enter__()
    _PRETENDING.append(pretending)
    torch.cuda.current_device = lambda: 0
    gm_config.default_launches.cache_clear()
    attn_config.default_config.cache_clear()
    return device


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
