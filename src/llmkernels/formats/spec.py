"""The block-scaled formats: element type, scale type and block size of each."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["FormatSpec", "FORMATS", "FP8_BLOCKS", "format_spec", "E2M1_MAX", "E4M3_MAX"]

E2M1_MAX = 6.0
E4M3_MAX = 448.0


@dataclass(frozen=True)
class FormatSpec:
    """One microscaled format.

    ``element``: ``"e4m3"`` (one ``float8_e4m3fn`` per element) or ``"e2m1"`` (two per ``uint8``,
    low nibble = even element). ``scale``: ``"e8m0"`` (power of two, ``float8_e8m0fnu``),
    ``"e4m3"`` (``float8_e4m3fn``) or ``"f32"`` (``float32``, the fp8 block format's). ``block``: elements
    along the last dim sharing one scale (fp8: the columns of its ``(rows, 128)`` tiles, see
    :class:`~llmkernels.ScaledTensor`'s ``block``). ``emax``: exponent of the element type's largest power of
    two (the OCP MX spec's emax_elem).
    """

    name: str
    element: str
    scale: str
    block: int
    emax: int
    has_global_scale: bool

    def __post_init__(self):
        if self.element not in ("e4m3", "e2m1"):
            raise ValueError(f"FormatSpec.element must be 'e4m3' or 'e2m1', got {self.element!r}")
        if self.scale not in ("e8m0", "e4m3", "f32"):
            raise ValueError(f"FormatSpec.scale must be 'e8m0', 'e4m3' or 'f32', got {self.scale!r}")
        if isinstance(self.block, bool) or not isinstance(self.block, int) or self.block < 2 or self.block % 2:
            raise ValueError(f"FormatSpec.block must be an even int >= 2, got {self.block!r}")

    @property
    def packed(self) -> bool:
        return self.element == "e2m1"

    @property
    def data_dtype(self) -> torch.dtype:
        return torch.uint8 if self.packed else torch.float8_e4m3fn

    @property
    def scale_dtype(self) -> torch.dtype:
        return {"e8m0": torch.float8_e8m0fnu, "e4m3": torch.float8_e4m3fn, "f32": torch.float32}[self.scale]

    @property
    def scale_one_bits(self) -> int:
        """The scale's bit pattern for 1.0, used to pad scale tensors."""
        return {"e8m0": 127, "e4m3": 0x38, "f32": 0x3F800000}[self.scale]

    @property
    def element_max(self) -> float:
        return E2M1_MAX if self.packed else E4M3_MAX


FORMATS: dict[str, FormatSpec] = {
    "mxfp8": FormatSpec("mxfp8", "e4m3", "e8m0", 32, 8, False),
    "mxfp4": FormatSpec("mxfp4", "e2m1", "e8m0", 32, 2, False),
    "nvfp4": FormatSpec("nvfp4", "e2m1", "e4m3", 16, 2, True),
    "fp8": FormatSpec("fp8", element="e4m3", scale="f32", block=128, emax=8, has_global_scale=False),
}

FP8_BLOCKS = ((1, 128), (128, 128))  # fp8's block shapes: activations (per token) and weights


def format_spec(name: str) -> FormatSpec:
    try:
        return FORMATS[name]
    except (KeyError, TypeError):
        raise ValueError(f"format must be one of {sorted(FORMATS)}, got {name!r}") from None
