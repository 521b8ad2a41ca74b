"""llmkernels: Triton kernels for LLM inference.

* :func:`grouped_matmul`: the grouped 1D-1D block-scaled matmul for Mixture-of-Experts.
* :func:`quantize` / :func:`dequantize` / :class:`ScaledTensor`: MXFP8, MXFP4 and NVFP4.
"""
from .formats import FORMATS, ScaledTensor, dequantize, quantize, quantize_reference
from .grouped_matmul import BlockScaledMatmulConfig, grouped_matmul, grouped_matmul_reference

__version__ = "0.1.0"

__all__ = [
    "ScaledTensor", "quantize", "dequantize", "quantize_reference", "FORMATS",
    "grouped_matmul", "grouped_matmul_reference", "BlockScaledMatmulConfig",
]
