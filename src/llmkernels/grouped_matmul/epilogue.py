"""The fused epilogues of :func:`llmkernels.grouped_matmul`, as the host describes them to the kernels."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["EPILOGUES", "SwiGLU", "GPT_OSS_SWIGLU", "deinterleave_gate_up"]

EPILOGUES = ("silu", "gelu", "swiglu")


@dataclass(frozen=True)
class SwiGLU:
    """The gated epilogue ``gate · sigmoid(alpha · gate) · (up + up_shift)`` on B's gate and up rows, with
    ``gate`` clamped to ``<= limit`` and ``up`` to ``[-limit, limit]`` when ``limit`` is set (each after the
    bias). ``epilogue="swiglu"`` is ``SwiGLU()``: ``silu(gate) · up``.

    Attributes:
        alpha: the sigmoid's slope (gpt-oss: 1.702).
        limit: the clamp (gpt-oss: 7.0), or None for none. Must be > 0.
        up_shift: added to ``up`` after the clamp (gpt-oss: 1.0).
        interleaved: B's N rows alternate gate and up (``gate 0, up 0, gate 1, ...``, gpt-oss' order) instead
            of ``[gate | up]`` halves. Read in place for bf16/fp16 weights and row-scaled ones; weights in the
            128x4 or hopper layouts must be de-interleaved before their layout is made.
    """

    alpha: float = 1.0
    limit: float | None = None
    up_shift: float = 0.0
    interleaved: bool = False

    def __post_init__(self):
        for name in ("alpha", "up_shift"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not _finite(value):
                raise ValueError(f"SwiGLU.{name} must be a finite number, got {value!r}")
            object.__setattr__(self, name, float(value))
        if self.limit is not None:
            if (
                isinstance(self.limit, bool)
                or not isinstance(self.limit, (int, float))
                or not self.limit > 0
                or not _finite(self.limit)
            ):
                raise ValueError(f"SwiGLU.limit must be None or a finite number > 0, got {self.limit!r}")
            object.__setattr__(self, "limit", float(self.limit))
        if not isinstance(self.interleaved, bool):
            raise TypeError(f"SwiGLU.interleaved must be a bool, got {type(self.interleaved).__name__}")


def _finite(value) -> bool:
    # Comparisons, not math.isfinite: torch.compile traces them on a float it made symbolic (dynamic=True).
    return -math.inf < value < math.inf


GPT_OSS_SWIGLU = SwiGLU(alpha=1.702, limit=7.0, up_shift=1.0, interleaved=True)
"""gpt-oss' clamped SwiGLU on its interleaved gate/up rows."""


def deinterleave_gate_up(rows: torch.Tensor) -> torch.Tensor:
    """Rows ``gate 0, up 0, gate 1, ...`` along dim 1 (``SwiGLU.interleaved``) as ``[gate | up]`` halves, a new
    tensor."""
    return torch.cat((rows[:, 0::2], rows[:, 1::2]), dim=1)
