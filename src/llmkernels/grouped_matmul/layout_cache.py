"""Row-layout 4-bit expert weights read through a copy in the Hopper layout, made once per weight.

``llmkernels.quantize`` returns MXFP4 / NVFP4 weights with row-major scales (a convention), which the Hopper
kernels read 2.3-2.6x slower than the same weights in the Hopper register-fragment layout (H100, bf16 x MXFP4,
E128 x 16 tokens to E8 x 2048, N 4096, K 7168). On a Hopper GPU :func:`llmkernels.grouped_matmul` therefore
converts such weights to the Hopper layout at their first call and keeps the copy for as long as the weights live,
so that the README's ``grouped_matmul(x, lk.quantize(w, "mxfp4"), ...)`` runs the fast kernel.

The rules:

* **What is converted**: an MXFP4 or NVFP4 ScaledTensor ``[E, N, K]`` with row scales on a Hopper GPU, called without a
  ``config`` (an explicit config chooses the row-layout kernel), with bf16 activations or quantized ones whose scales
  are not padded per group; and MXFP4 weights with fp8 ``block=(1, 128)`` activations (w4a8) in the decode sizes, which
  the ``w4a8_decode`` backend reads through the same copy (:meth:`HopperCopies.get`: at its launch, so the 128-token
  launches of the same call keep the row-layout weights their kernel reads). Interleaved SwiGLU rows (gpt-oss'
  ``GPT_OSS_SWIGLU``) are de-interleaved into ``[gate | up]`` halves in the copy; the call's bias is de-interleaved
  alongside (a copy of ``[E, N]`` per call) and the epilogue reads halves. The result is the one of
  ``b.to_layout("hopper")``, bit for bit.
* **Identity**: the copy is keyed on the memory of the data and scales (storage, offset, shape, strides), so
  every view or re-wrap of the same tensors (a module's parameters through ``torch.compile``, a ScaledTensor
  rebuilt from checkpoint parts on each call) finds it; it is dropped when the data's storage is freed.
* **Never stale**: an in-place write to the data or the scales (their version counters) makes the next call
  convert again. Tensors made under ``torch.inference_mode`` have no version counter: they are not converted
  (the row-layout kernel reads them).
* **CUDA graphs**: no conversion while a stream is being captured (the row-layout kernel runs; a copy made
  before the capture is used).
* **Memory**: the copy is as large as the weights (4.25 bits per MXFP4 weight), so the weights take twice their
  memory while both live. Convert ahead (``w = w.to_layout("hopper")``, or ``quantize(..., scale_layout=
  "hopper")``) to keep one copy; set ``HOPPER_COPIES.enabled = False`` to turn the conversion off, and
  ``HOPPER_COPIES.clear()`` frees the copies made.
"""

from __future__ import annotations

import dataclasses
import weakref

import torch

from ..formats import ScaledTensor, format_spec
from ..formats.layouts import HOPPER, ROW
from ..runtime import capturing, cuda_capability, interpreting
from .epilogue import SwiGLU, deinterleave_gate_up

__all__ = ["HOPPER_COPIES", "HopperCopies", "WeightCopies", "prefers_hopper_layout"]


def prefers_hopper_layout(device: torch.device) -> bool:
    """Whether MXFP4 and NVFP4 weights run fastest in the Hopper layout on ``device``: a Hopper GPU (compute
    capability 9.x), outside the interpreter."""
    return device.type == "cuda" and not interpreting() and cuda_capability(device)[0] == 9


@dataclasses.dataclass
class _Copy:
    storage: weakref.ref  # the source data's storage: the entry is valid while it lives
    versions: tuple[int, int]  # the data's and the scales' version counters when converted
    weights: object  # the copy (None: the source cannot be converted; remembered until it changes)


class WeightCopies:
    """Copies of weights made once per weight memory (the rules of this module): keyed on the memory of the data and
    scales, valid while the data's storage lives and their version counters are unchanged. ``enabled``: whether
    calls use and make copies."""

    def __init__(self):
        self.enabled = True
        self._copies: dict[tuple, _Copy] = {}

    def __len__(self) -> int:
        return len(self._copies)

    def clear(self) -> None:
        """Frees every copy (later calls convert again)."""
        self._copies.clear()

    def _copy_of(self, data: torch.Tensor, scales: torch.Tensor, extra: tuple, convert):
        """The copy of ``data`` / ``scales`` (``extra``: the rest of the key), made now by ``convert()`` where there is
        none or it is stale; None where the rules make none (no version counter, a capture without a copy made
        before) or ``convert`` made none (a source it cannot convert: remembered until the source changes)."""
        try:
            versions = (data._version, scales._version)
        except RuntimeError:  # inference-mode tensors: no version counter, so no way to see them change
            return None
        key = (_memory_key(data), _memory_key(scales), *extra)
        copy = self._copies.get(key)
        if copy is None or copy.storage() is None or copy.versions != versions:
            if capturing(data.device):
                return None
            storage = data.untyped_storage()
            copy = self._copies[key] = _Copy(weakref.ref(storage, self._forget(key)), versions, convert())
        return copy.weights

    def _forget(self, key):
        cache = weakref.ref(self)

        def forget(_):
            held = cache()
            if held is not None:
                held._copies.pop(key, None)

        return forget


class HopperCopies(WeightCopies):
    """The Hopper-layout copies of row-layout expert weights that :func:`llmkernels.grouped_matmul` made (see the
    module for the rules). ``enabled``: whether calls convert (True by default)."""

    def substitute(self, a, b, epilogue, bias, config):
        """``(b, epilogue, bias)`` as the call should run them: ``b``'s Hopper-layout copy (made now if needed),
        the epilogue and bias on its de-interleaved rows; or the arguments unchanged where the rules of the
        module do not convert. Never raises for arguments the call's checks would refuse: those pass unchanged."""
        if (
            type(b) is not ScaledTensor
            or b.scale_layout is not ROW
            or not HOPPER.holds(b.format)
            or config is not None
            or not self.enabled
        ):
            return b, epilogue, bias
        data, scales = b.data, b.scales
        if (
            not isinstance(data, torch.Tensor)
            or not isinstance(scales, torch.Tensor)
            or data.dim() != 3
            or not prefers_hopper_layout(data.device)
            or not _reads_hopper_weights(a)
        ):
            return b, epilogue, bias
        interleaved = isinstance(epilogue, SwiGLU) and epilogue.interleaved
        if (epilogue == "swiglu" or isinstance(epilogue, SwiGLU)) and b.shape[1] % (2 * HOPPER.rows_per_block):
            return b, epilogue, bias  # the layout's SwiGLU halves are whole row blocks
        if interleaved and bias is not None and (not isinstance(bias, torch.Tensor) or bias.dim() != 2):
            return b, epilogue, bias
        weights = self._copy_of(data, scales, (b.format, interleaved), lambda: _converted(b, interleaved))
        if weights is None:  # no copy: a capture, no version counter, or parts that do not fit
            return b, epilogue, bias
        if interleaved:
            epilogue = dataclasses.replace(epilogue, interleaved=False)
            if bias is not None:
                bias = deinterleave_gate_up(bias)
        return weights, epilogue, bias

    def get(self, data: torch.Tensor, scales: torch.Tensor, interleaved: bool = False) -> ScaledTensor | None:
        """The Hopper-layout copy of row-layout MXFP4 weights given as the kernels read them (packed e2m1 bytes
        ``data`` ``[E, N, K / 2]``, e8m0 bytes ``scales`` ``[E, N, K / 32]``; ``interleaved``: SwiGLU's gate and up
        rows alternate, and the copy holds them as ``[gate | up]`` halves), made now if needed: the copy
        :meth:`substitute` gives the same memory (one copy per weight, whatever the activations). None where the
        rules of the module make none (disabled, no version counter, a capture without a copy made before) or the
        layout cannot hold the parts (remembered until they change). Never raises for parts that fit no
        ScaledTensor."""
        if not self.enabled:
            return None
        scales = scales.view(_MXFP4_SCALE_DTYPE)  # the dtype of the ScaledTensor's scales: substitute's key
        return self._copy_of(data, scales, ("mxfp4", interleaved), lambda: _converted_parts(data, scales, interleaved))


_MXFP4_SCALE_DTYPE = format_spec("mxfp4").scale_dtype


def _converted_parts(data: torch.Tensor, scales: torch.Tensor, interleaved: bool) -> ScaledTensor | None:
    try:
        return _to_hopper(ScaledTensor(data, scales, "mxfp4"), interleaved)
    except (TypeError, ValueError):  # parts that do not fit
        return None


def _converted(b: ScaledTensor, interleaved: bool) -> ScaledTensor | None:
    try:
        return _to_hopper(b, interleaved)
    except (TypeError, ValueError):  # parts that do not fit: the call's checks say so
        return None


def _reads_hopper_weights(a) -> bool:
    """Whether the Hopper-layout kernel takes activations ``a``: bf16, or quantized with scales not padded per
    group (decoded ahead to bf16), fp8 blocks aside (their product with MXFP4 weights is the w4a8 pair's)."""
    if type(a) is ScaledTensor:
        return not a.scale_layout.grouped and a.format != "fp8"
    return isinstance(a, torch.Tensor) and a.dtype == torch.bfloat16


def _memory_key(t: torch.Tensor) -> tuple:
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype, t.device)


def _to_hopper(b: ScaledTensor, interleaved: bool) -> ScaledTensor:
    if interleaved:
        scales = deinterleave_gate_up(b.scales.view(torch.uint8)).view(b.scales.dtype)  # CUDA cannot cat 8-bit floats
        b = ScaledTensor(deinterleave_gate_up(b.data), scales, b.format, b.global_scale, block=b.block)
    return b.to_layout(HOPPER)


HOPPER_COPIES = HopperCopies()
"""The copies :func:`llmkernels.grouped_matmul` reads row-layout 4-bit weights through on a Hopper GPU."""
