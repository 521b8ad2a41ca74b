"""Where kernels run: CUDA, or the Triton interpreter on the CPU; input checks shared by the APIs."""
from __future__ import annotations

import functools
import os

import torch

__all__ = ["interpreting", "check_device", "num_programs_hint", "cdiv", "next_power_of_2"]


@torch.compiler.assume_constant_result  # a process-wide setting: a constant to torch.compile
def interpreting() -> bool:
    """True when Triton runs kernels through its CPU interpreter (``TRITON_INTERPRET=1``).

    The variable must be set before the first ``@triton.jit`` function is defined, i.e. before
    ``import llmkernels``; ``python -m llmkernels`` and the test suite set it themselves when no
    GPU is present.
    """
    try:
        import triton

        return bool(triton.knobs.runtime.interpret)
    except AttributeError:  # older Triton without knobs
        return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def check_device(**tensors: torch.Tensor | None) -> torch.device:
    """Checks that all given tensors share one device that the kernels can run on.

    Raises ``ValueError`` naming the argument that differs, or a CPU tensor outside interpreter mode.
    """
    device = None
    first = None
    for name, tensor in tensors.items():
        if tensor is None:
            continue
        if device is None:
            device, first = tensor.device, name
        elif tensor.device != device:
            raise ValueError(f"{name} is on {tensor.device} but {first} is on {device}; all tensors must share a device")
    if device is None:
        raise ValueError("no tensor given")
    if device.type != "cuda" and not interpreting():
        raise ValueError(
            f"{first} is on {device}: llmkernels runs on CUDA tensors, or on CPU tensors through the Triton "
            "interpreter (set TRITON_INTERPRET=1 before importing llmkernels)"
        )
    return device


@functools.lru_cache(maxsize=None)
def _capability_of(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def cuda_capability(device: torch.device) -> tuple[int, int] | None:
    """``(major, minor)`` of a CUDA device (cached per device), None for any other device."""
    if device.type != "cuda":
        return None
    return _capability_of(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _multiprocessor_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_programs_hint(device: torch.device) -> int:
    """Programs of a persistent grid that fill the device (4 in the interpreter, which runs them one by one)."""
    if device.type != "cuda":
        return 4
    return _multiprocessor_count(device.index if device.index is not None else torch.cuda.current_device())


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def first_true(bad: torch.Tensor) -> tuple[int, ...] | None:
    """Index of the first True of a bool tensor (row-major), or None."""
    hits = bad.nonzero()
    return None if hits.shape[0] == 0 else tuple(hits[0].tolist())


def first_bad_prefix_sum(values: torch.Tensor, total: int, max_step: int | None = None) -> int | None:
    """First index where host-side prefix sums ``[G + 1]`` break their contract (``values[0] == 0``,
    non-decreasing, ``<= total``, steps ``<= max_step``), or None; the caller words the error."""
    steps = values[1:] - values[:-1]
    bad_step = (steps < 0) | (values[1:] > total)
    if max_step is not None:
        bad_step |= steps > max_step
    first = first_true(torch.cat([values[:1] != 0, bad_step]))
    return None if first is None else first[0]
