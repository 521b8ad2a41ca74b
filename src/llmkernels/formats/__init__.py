"""Block-scaled formats (MXFP8, MXFP4, NVFP4; fp8 with DeepSeek-style float32 block scales): ScaledTensor, quantize,
dequantize and the scale layouts' conversions (the layouts themselves, one object each:
:mod:`llmkernels.formats.layouts`)."""

from .api import quantize
from .layouts import from_blocked_scales, from_grouped_blocked_scales, to_blocked_scales, to_grouped_blocked_scales
from .reference import dequantize, nvfp4_global_scale, quantize_reference
from .scaled_tensor import HOPPER_FORMATS, SCALE_LAYOUTS, ScaledTensor, scaled_tensor_from_parts, scaled_tensor_parts
from .spec import FORMATS, FormatSpec, format_spec
from .torchao import from_torchao, is_torchao_tensor, to_torchao, unwrap_torchao

__all__ = [
    "ScaledTensor",
    "quantize",
    "dequantize",
    "quantize_reference",
    "nvfp4_global_scale",
    "to_blocked_scales",
    "from_blocked_scales",
    "to_grouped_blocked_scales",
    "from_grouped_blocked_scales",
    "FORMATS",
    "FormatSpec",
    "format_spec",
    "SCALE_LAYOUTS",
    "HOPPER_FORMATS",
    "scaled_tensor_parts",
    "scaled_tensor_from_parts",
    "from_torchao",
    "to_torchao",
    "is_torchao_tensor",
    "unwrap_torchao",
]
