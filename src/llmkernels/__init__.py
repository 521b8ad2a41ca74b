"""llmkernels: Triton kernels for LLM inference.

* :func:`grouped_matmul`: the grouped 1D-1D block-scaled matmul for Mixture-of-Experts.
* :func:`quantize` / :func:`dequantize` / :class:`ScaledTensor`: MXFP8, MXFP4 and NVFP4.
* :func:`attention`: FA4-style attention forward (dense, ragged, paged KV; masks, score mods, sinks, split-KV).
"""
from .formats import FORMATS, ScaledTensor, dequantize, quantize_reference
from .grouped_matmul import GPT_OSS_SWIGLU, BlockScaledMatmulConfig, SwiGLU, grouped_matmul_reference
from .attention import FA4Config, Chunked, PagedKVCache, SlidingWindow, alibi, attention_reference, softcap
from .ops import attention, grouped_matmul, quantize  # also registers torch.ops.llmkernels.*
from . import moe

__version__ = "0.1.0"

__all__ = [
    "ScaledTensor", "quantize", "dequantize", "quantize_reference", "FORMATS",
    "grouped_matmul", "grouped_matmul_reference", "BlockScaledMatmulConfig", "SwiGLU", "GPT_OSS_SWIGLU",
    "attention", "attention_reference", "FA4Config", "PagedKVCache", "SlidingWindow", "Chunked", "softcap", "alibi",
]
