"""llmkernels: Triton kernels for LLM inference.

* :func:`grouped_matmul`: the grouped 1D-1D block-scaled matmul for Mixture-of-Experts.
* :func:`quantize` / :func:`dequantize` / :class:`ScaledTensor`: MXFP8, MXFP4 and NVFP4.
* :func:`attention`: FA4-style attention forward (dense, ragged, paged KV; masks, score mods, sinks, split-KV).
"""

import sys

from . import moe as moe  # llmkernels.moe, reachable as an attribute
from .attention import Chunked, FA4Config, PagedKVCache, SlidingWindow, alibi, attention_reference, softcap
from .formats import FORMATS, ScaledTensor, dequantize, quantize_reference
from .grouped_matmul import GPT_OSS_SWIGLU, BlockScaledMatmulConfig, SwiGLU, grouped_matmul_reference
from .ops import attention, grouped_matmul, quantize  # also registers torch.ops.llmkernels.*


def _reachable_as_package(function, package) -> None:
    """``llmkernels.attention`` (and ``.grouped_matmul``) is both a package and, once this package is imported,
    the attribute holding the function of the same name, which is what ``torch.compile`` traces (it cannot trace a
    callable module). The package's public names and submodules become attributes of the function, so
    ``llmkernels.attention.FA4Config`` reads as it would on the package; ``from llmkernels.attention import
    FA4Config`` reads the package itself."""
    for name in package.__all__:
        setattr(function, name, getattr(package, name))
    for name, value in vars(package).items():
        if isinstance(value, type(package)) and value.__name__.startswith(package.__name__ + "."):
            setattr(function, name, value)


_reachable_as_package(attention, sys.modules[__name__ + ".attention"])
_reachable_as_package(grouped_matmul, sys.modules[__name__ + ".grouped_matmul"])
del _reachable_as_package

__version__ = "0.1.0"

__all__ = [
    "ScaledTensor",
    "quantize",
    "dequantize",
    "quantize_reference",
    "FORMATS",
    "grouped_matmul",
    "grouped_matmul_reference",
    "BlockScaledMatmulConfig",
    "SwiGLU",
    "GPT_OSS_SWIGLU",
    "attention",
    "attention_reference",
    "FA4Config",
    "PagedKVCache",
    "SlidingWindow",
    "Chunked",
    "softcap",
    "alibi",
]
