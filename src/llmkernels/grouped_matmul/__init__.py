"""The grouped 1D-1D block-scaled matmul for Mixture-of-Experts."""

from .api import EPILOGUES, grouped_matmul
from .config import BlockScaledMatmulConfig, default_config, default_launches
from .epilogue import GPT_OSS_SWIGLU, SwiGLU
from .layout_cache import HOPPER_COPIES, prefers_hopper_layout
from .reference import grouped_matmul_reference

__all__ = [
    "grouped_matmul",
    "grouped_matmul_reference",
    "BlockScaledMatmulConfig",
    "default_config",
    "default_launches",
    "EPILOGUES",
    "SwiGLU",
    "GPT_OSS_SWIGLU",
    "HOPPER_COPIES",
    "prefers_hopper_layout",
]
