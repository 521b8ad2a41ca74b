"""Where kernels run: CUDA, or the Triton interpreter on the CPU; input checks shared by the APIs."""

from __future__ import annotations

import contextlib
import functools
import os

import torch

__all__ = [
    "interpreting",
    "check_device",
    "check_triton",
    "forward_only",
    "check_out",
    "new_buffer",
    "unit_last_stride",
    "describe",
    "num_programs_hint",
    "cdiv",
    "next_power_of_2",
    "cuda_capability",
    "triton_version",
    "per_device",
    "pretend_gpu",
]

# The oldest Triton that compiles every default config for a GPU generation (major compute capability):
# tools/compile_defaults.py on each release. Triton 3.6 (torch 2.11) and 3.7 compile Hopper's, but their
# compilers fail on Blackwell's block-scaled MX MMA and on the FA4 prefill's conditional rescale.
MIN_TRITON = {9: (3, 6), 10: (3, 8)}


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
            raise ValueError(
                f"{name} is on {tensor.device} but {first} is on {device}; all tensors must share a device"
            )
    if device is None:
        raise ValueError("no tensor given")
    if device.type != "cuda" and not interpreting():
        raise ValueError(
            f"{first} is on {device}: llmkernels runs on CUDA tensors, or on CPU tensors through the Triton "
            "interpreter (set TRITON_INTERPRET=1 before importing llmkernels)"
        )
    if device.type == "cuda":
        check_triton(device)
    return device


# What pretend_gpu answers in place of the driver and the installed Triton (empty: the real answers)
_PRETENDED: dict = {}
# Caches whose values depend on the device's answers (per_device): cleared when pretend_gpu changes them
_DEVICE_CACHES: list = []


def per_device(function):
    """``functools.lru_cache`` for a function of device properties (a default config, a tiling choice):
    :func:`pretend_gpu` clears it when it changes what the device answers."""
    cached = functools.lru_cache(maxsize=None)(function)
    _DEVICE_CACHES.append(cached)
    return cached


def triton_version() -> tuple[int, int]:
    """``(major, minor)`` of the installed Triton (or the one :func:`pretend_gpu` names)."""
    pretended = _PRETENDED.get("triton_version")
    if pretended is not None:
        return pretended
    import triton

    return tuple(int(part) for part in triton.__version__.split(".")[:2])


_triton_version = triton_version  # the name older callers patch


@contextlib.contextmanager
def pretend_gpu(capability: tuple[int, int], multiprocessors: int = 132, triton_version: tuple[int, int] | None = None):
    """Inside the block, device queries answer as a GPU of compute ``capability`` with ``multiprocessors`` SMs
    (and, given ``triton_version``, as that Triton): how the ahead-of-time compile tools and tests ask the
    library what it would launch on a GPU the machine does not have (``torch.device("cuda", 0)`` then names it;
    nothing can run on it). Caches of device-dependent choices are cleared on entry and exit."""
    saved = dict(_PRETENDED)
    _PRETENDED.update(capability=tuple(capability), multiprocessors=multiprocessors)
    if triton_version is not None:
        _PRETENDED["triton_version"] = tuple(triton_version)
    _clear_device_caches()
    try:
        yield torch.device("cuda", 0)
    finally:
        _PRETENDED.clear()
        _PRETENDED.update(saved)
        _clear_device_caches()


def _clear_device_caches() -> None:
    for cache in (*_DEVICE_CACHES, _triton_problem, _capability_of, _multiprocessor_count):
        cache.cache_clear()


@functools.cache
def _triton_problem(capability: tuple[int, int]) -> str | None:
    needed = MIN_TRITON.get(min(capability[0], max(MIN_TRITON)))
    found = triton_version()
    if needed is None or found >= needed:
        return None
    return (
        f"llmkernels on this GPU (compute capability {capability[0]}.{capability[1]}) needs Triton >= "
        f"{needed[0]}.{needed[1]}, found {found[0]}.{found[1]}: its compiler fails on kernels the library "
        f"launches there (docs/blackwell.md). Install triton>={needed[0]}.{needed[1]}"
    )


def check_triton(device: torch.device) -> None:
    """Raises ``RuntimeError`` naming the Triton version needed when the installed one cannot compile the
    kernels for ``device``'s GPU generation (``MIN_TRITON``), before anything is compiled or launched."""
    problem = _triton_problem(cuda_capability(device))
    if problem is not None:
        raise RuntimeError(problem)


def forward_only(function: str, **tensors: torch.Tensor | None) -> None:
    """Raises ``ValueError`` naming the first input that requires grad while grad mode is on.

    The kernels have no backward: returning an output that silently drops the gradient would make a
    training step learn nothing without a word. Under ``torch.no_grad()`` / ``torch.inference_mode()``
    (or with ``.detach()``-ed inputs) the call runs.
    """
    if not torch.is_grad_enabled():
        return
    for name, tensor in tensors.items():
        if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
            raise ValueError(
                f"{name} requires grad, but {function} is forward-only (no autograd): call it under "
                f"torch.no_grad() / torch.inference_mode(), or pass {name}.detach()"
            )


def has_internal_overlap(tensor: torch.Tensor) -> bool:
    """True when two elements of ``tensor`` share memory (a zero stride, or strides that interleave).

    Sorted by stride, each dimension must step past everything the smaller ones span; that is exact
    for the layouts PyTorch's views make and conservative for exotic ``as_strided`` ones.
    """
    extent = 1  # elements spanned by the dimensions seen so far
    for stride, size in sorted((s, n) for n, s in zip(tensor.shape, tensor.stride()) if n > 1):
        if stride < extent:
            return True
        extent += stride * (size - 1)
    return False


def _byte_range(tensor: torch.Tensor) -> tuple[int, int]:
    start = tensor.storage_offset() * tensor.element_size()
    span = sum((n - 1) * s for n, s in zip(tensor.shape, tensor.stride())) + 1
    return start, start + span * tensor.element_size()


def shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True when the storage bytes spanned by ``a`` and ``b`` intersect (conservative for interleaved views)."""
    if a.numel() == 0 or b.numel() == 0 or a.device != b.device:
        return False
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False
    (a_start, a_end), (b_start, b_end) = _byte_range(a), _byte_range(b)
    return a_start < b_end and b_start < a_end


def check_out(out, shape: tuple, dtype: torch.dtype, **inputs: torch.Tensor | None) -> None:
    """Checks an ``out=`` argument: a tensor of ``shape`` and ``dtype`` (any strides) whose elements do not
    overlap each other (no zero strides) nor any of ``inputs``.

    Raises:
        TypeError: out is not a tensor, or has another dtype.
        ValueError: another shape, overlapping elements, or memory shared with an input (named).
    """
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"out must be a torch.Tensor or None, got {type(out).__name__}")
    if out.dtype != dtype:
        raise TypeError(f"out must be {dtype}, got {out.dtype}")
    if tuple(out.shape) != tuple(shape):
        raise ValueError(f"out must have shape {tuple(shape)}, got {tuple(out.shape)}")
    if has_internal_overlap(out):
        raise ValueError(
            f"out has elements that share memory (strides {out.stride()}, e.g. an expanded view): its rows would race"
        )
    for name, tensor in inputs.items():
        if isinstance(tensor, torch.Tensor) and shares_memory(out, tensor):
            raise ValueError(f"out shares memory with {name}: the kernel would read what it overwrites")


def capturing(device: torch.device) -> bool:
    """Whether a CUDA graph is being captured on ``device``'s current stream (False off CUDA)."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def new_buffer(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Every buffer a kernel writes is allocated here (tests replace it with guarded, poisoned buffers)."""
    return torch.empty(shape, dtype=dtype, device=device)


def unit_last_stride(x: torch.Tensor) -> torch.Tensor:
    """x itself when its last dim is unit-stride (the kernels take every other stride, zero ones included),
    else a contiguous copy."""
    return x if x.stride(-1) == 1 or x.shape[-1] <= 1 else x.contiguous()


def describe(x) -> str:
    """``"<dtype> tensor of shape (...)"``, or the type's name: what an error message says was given."""
    if isinstance(x, torch.Tensor):
        return f"{x.dtype} tensor of shape {tuple(x.shape)}"
    return type(x).__name__


@functools.cache
def _capability_of(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def cuda_capability(device: torch.device) -> tuple[int, int] | None:
    """``(major, minor)`` of a CUDA device (cached per device), None for any other device."""
    if device.type != "cuda":
        return None
    if "capability" in _PRETENDED:
        return _PRETENDED["capability"]
    return _capability_of(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _multiprocessor_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_programs_hint(device: torch.device) -> int:
    """Programs of a persistent grid that fill the device (4 in the interpreter, which runs them one by one)."""
    if device.type != "cuda":
        return 4
    if "multiprocessors" in _PRETENDED:
        return _PRETENDED["multiprocessors"]
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
