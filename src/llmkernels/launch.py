"""Plans and direct launches: the host side of every public call after its checks.

A public function runs **validate → plan → launch**. Its *plan* (kernel choice, config, grid, compiled
kernels) is a value that depends only on the call's *signature*: the shapes, dtypes, strides, pointer
alignment, device and grad state of its tensors, plus its flags and config. :class:`PlanCache` keeps plans
by signature, so a repeated call does a dictionary lookup, allocates its outputs and launches.

:func:`bind` turns one launch of a ``@triton.jit`` function into a :class:`BoundKernel`: the grid,
constexprs and scalar arguments fixed, the compiled kernel fetched once. Calling it with the call's
tensors (in the order they were bound) hands them to the compiled kernel's launcher directly, without
Triton's per-call argument binder (about half of an eager call's host time otherwise), and where the
launcher's layout is known, without its Python wrapper either (:class:`_DirectLaunch`). The compiled
variant fits every call of the same signature, because everything Triton specializes on (dtypes,
integers' divisibility by 16 and equality with 1, 16-byte pointer alignment) is part of the signature.
Under the Triton interpreter the same object calls ``fn[grid](...)``, so CPU tests run the same plans.
"""

from __future__ import annotations

import inspect
import sys
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from triton import knobs

from .runtime import capturing, interpreting

__all__ = [
    "PlanCache",
    "BoundKernel",
    "KernelSpec",
    "bind",
    "clear_plans",
    "tensor_key",
    "value_key",
    "DIRECT_LAUNCHER_LAYOUT",
    "TileCounters",
    "take_tile_counter",
]

_CACHES: list[PlanCache] = []
_INTERPRETER_LOCK = threading.Lock()


def tensor_key(t: torch.Tensor):
    """What a plan may depend on of one tensor: dtype, shape, strides, its address modulo 16 (Triton
    specializes pointers on 16-byte alignment, some plans read words), device and ``requires_grad``."""
    return t.dtype, t.shape, t.stride(), t.data_ptr() % 16, t.device, t.requires_grad


_SCALARS = frozenset((bool, int, float))
_TENSOR = torch.Tensor


def value_key(value):
    """The part of a call signature one argument contributes: :func:`tensor_key` of a tensor, ``plan_key()``
    of an object that has one (ScaledTensor, PagedKVCache, masks, score modifiers), scalars with their type
    (``True`` and ``1`` differ), tuples element-wise, other hashable objects (configs, ``@triton.jit``
    functions) with their type. Raises ``TypeError`` for an unhashable value."""
    cls = type(value)
    if cls is _TENSOR:  # the common case first, tensor_key inlined: this runs for every argument of every call
        return value.dtype, value.shape, value.stride(), value.data_ptr() % 16, value.device, value.requires_grad
    if value is None:
        return None
    if cls is str or cls is torch.dtype:
        return value
    if cls in _SCALARS:
        return cls, value
    if isinstance(value, torch.Tensor):
        return tensor_key(value)
    if cls is tuple:
        return tuple(map(value_key, value))
    plan_key = getattr(value, "plan_key", None)
    if plan_key is not None:
        return plan_key()
    hash(value)
    return cls, value


class PlanCache:
    """A bounded, thread-safe map from call signatures to plans.

    Lookups are plain dictionary reads; inserts take a lock and evict the oldest plan once ``max_size``
    plans are held (a serving process sees a handful of shapes per layer, a sweep may see thousands).
    """

    def __init__(self, name: str, max_size: int = 1024):
        self.name, self.max_size = name, max_size
        self._plans: dict = {}
        self._lock = threading.Lock()
        _CACHES.append(self)

    def lookup(self, *values):
        """``(key, plan)`` of a call whose signature is made of ``values`` (:func:`value_key` of each, and
        whether grad mode is on); the plan is None when none is cached, the key None when a value has no
        key (an unhashable argument: the call is planned, and checked, every time)."""
        try:
            key = (torch.is_grad_enabled(), *map(value_key, values))
            return key, self._plans.get(key)
        except TypeError:
            return None, None

    def get(self, key):
        """The plan stored under ``key`` (a key a family builds itself, see :meth:`lookup`), or None."""
        return self._plans.get(key)

    def put(self, key, plan):
        """Stores ``plan`` under ``key`` (a concurrent thread may have stored an equal one: either serves)
        and returns it; a None key stores nothing."""
        if key is None:
            return plan
        with self._lock:
            while len(self._plans) >= self.max_size:
                self._plans.pop(next(iter(self._plans)))
            self._plans[key] = plan
        return plan

    def plans(self) -> list:
        """The plans held now, oldest first (for tests and tools that inspect what a call planned)."""
        return list(self._plans.values())

    def clear(self) -> None:
        with self._lock:
            self._plans.clear()

    def __len__(self) -> int:
        return len(self._plans)

    def __repr__(self) -> str:
        return f"PlanCache({self.name!r}, {len(self)}/{self.max_size} plans)"


def clear_plans() -> None:
    """Forgets every plan of every family (tests that patch a planning rule call it)."""
    for cache in _CACHES:
        cache.clear()


def _is_descriptor(value) -> bool:
    return type(value).__name__ == "TensorDescriptor"


class _Unbased:
    """A host tensor descriptor without its base: shape, strides, block and options fixed by a plan."""

    def __init__(self, descriptor):
        self.cls = type(descriptor)
        self.fields = {name: value for name, value in vars(descriptor).items() if name != "base"}

    def on(self, base, checked: bool):
        """The descriptor on ``base`` (a tensor, or ``(tensor, shape, strides)`` for a shape that varies per call):
        a real ``TensorDescriptor`` (its checks run) when ``checked`` (the interpreter reads it), else a light
        object with its attributes, all the compiled launcher reads."""
        fields = self.fields
        if type(base) is tuple:
            base, shape, strides = base
            fields = {**fields, "shape": list(shape), "strides": list(strides)}
        if checked:
            return self.cls(base, **fields)
        descriptor = _DescriptorArg()
        descriptor.__dict__.update(fields)
        descriptor.base = base
        return descriptor


class _DescriptorArg:
    """A tensor descriptor's attributes, for the compiled launcher (its checks ran at bind time)."""


class BoundKernel:
    """One launch of a ``@triton.jit`` function with its grid, constexprs, scalars and options fixed.

    ``bound(*values)`` launches it on the values of a call, passed in the order their arguments had at
    :func:`bind`: every tensor and tensor descriptor argument, and the scalar arguments named ``per_call`` there
    (sizes and strides that vary between calls of one plan; the compiled kernel was specialized on the bound
    values, so a plan must only pass values Triton specializes alike: divisible by 16 or not, 1 or not). A
    descriptor slot takes the tensor to use as its base (shape and strides as bound), or ``(tensor, shape,
    strides)`` when they vary per call (block and layout as bound).
    """

    def __init__(self, fn, grid, names, values, options, per_call=()):
        self.fn, self.options, self.names = fn, options, names
        self.grid = tuple(grid) + (1,) * (3 - len(grid))
        per_call = {names.index(name) for name in per_call}
        self.slots = tuple(
            i
            for i, value in enumerate(values)
            if i in per_call or isinstance(value, torch.Tensor) or _is_descriptor(value)
        )
        self.tensors_lead = self.slots == tuple(range(len(self.slots)))  # every tensor before every scalar
        self._kernel = None
        # No tensor of the binding call stays referenced (a cached plan must not keep memory alive);
        # a descriptor slot keeps its shape, strides and block.
        self.templates = {i: _Unbased(values[i]) for i in self.slots if _is_descriptor(values[i])}
        if not interpreting():
            self._compile(values)
        self.values = tuple(None if i in self.slots else value for i, value in enumerate(values))

    def _compile(self, values) -> None:
        first = next(
            (values[i] for i in self.slots if isinstance(values[i], torch.Tensor) or _is_descriptor(values[i])), None
        )
        first = first.base if _is_descriptor(first) else first
        self.device_index = first.device.index if first is not None and first.is_cuda else None
        with torch.cuda.device(self.device_index):
            kernel = self.fn.warmup(*values, grid=self.grid, **self.options)
            if hasattr(kernel, "result"):  # an asynchronous compile's future
                kernel = kernel.result()
            self._launcher = kernel.run  # loads the module on the current device
        self._kernel = kernel
        self._function, self._packed_metadata = kernel.function, kernel.packed_metadata
        self._direct = _DirectLaunch.of(kernel, values, self.slots, self.templates, self._packed_metadata)

    def _arguments(self, tensors) -> list:
        values = list(self.values)
        if self.tensors_lead:
            values[: len(tensors)] = tensors
        else:
            for i, tensor in zip(self.slots, tensors):
                values[i] = tensor
        for i, template in self.templates.items():
            values[i] = template.on(values[i], checked=self._kernel is None)
        return values

    def __call__(self, *tensors) -> None:
        if len(tensors) != len(self.slots):
            raise TypeError(f"{self.fn.__name__}: bound with {len(self.slots)} values, called with {len(tensors)}")
        if self._kernel is None:  # the interpreter, whose grid state is global: one kernel at a time
            values = self._arguments(tensors)
            with _INTERPRETER_LOCK:
                self.fn[self.grid](**dict(zip(self.names, values)), **self.options)
            return
        enter_hook, exit_hook = _hook(knobs.runtime.launch_enter_hook), _hook(knobs.runtime.launch_exit_hook)
        current = torch._C._cuda_getDevice()
        if current != self.device_index:
            with torch.cuda.device(self.device_index):
                return self(*tensors)
        stream = torch._C._cuda_getCurrentRawStream(current)
        if self._direct is not None and enter_hook is None and exit_hook is None:
            return self._direct(self.grid, stream, self._function, tensors)
        values = self._arguments(tensors)
        metadata = self._kernel.launch_metadata(self.grid, stream, *values) if enter_hook is not None else None
        self._launcher(
            *self.grid, stream, self._function, self._packed_metadata, metadata, enter_hook, exit_hook, *values
        )

    @property
    def compiled(self):
        """The compiled kernel (None under the interpreter, which calls ``fn[grid]``)."""
        return self._kernel

    @property
    def direct(self) -> bool:
        """Whether calls go to the launcher's C entry point without Triton's wrapper (:class:`_DirectLaunch`)."""
        return self._kernel is not None and self._direct is not None

    @property
    def tma_maps(self) -> bool:
        """Whether a direct launch lays out TMA descriptor maps (a tensor-descriptor argument of the kernel)."""
        return self.direct and bool(self._direct.maps)

    def __repr__(self) -> str:
        return f"BoundKernel({self.fn.__name__}, grid={self.grid})"


class _DirectLaunch:
    """The compiled launcher's C entry point called without Triton's Python wrapper around it (Triton 3.6's
    ``CudaLauncher``: its per-call scratch allocation, and a loop over every argument when tensor
    descriptors are among them). Used only for a kernel that needs no scratch memory and where the
    launcher has exactly the layout this was written against; :meth:`of` returns None otherwise, and the
    wrapper runs.

    The argument list is laid out once: the bound scalars and constexprs in place, each descriptor expanded
    as the wrapper would (a TMA map, then its shape and strides); per call only the tensors and the TMA
    maps of descriptor bases are filled in. A map is a pure function of the base address here (shape,
    strides and block are the plan's), so the last few are kept by address.
    """

    # grid, stream, function, cooperative, pdl, 2 scratch buffers, packed metadata, launch metadata, 2 hooks
    _LAYOUT = "iiiKKppOOOOOO"

    @classmethod
    def of(cls, kernel, values, slots, templates, packed_metadata):
        launcher = kernel.run
        module = sys.modules.get(type(launcher).__module__)
        if (
            type(launcher).__name__ != "CudaLauncher"
            or getattr(module, "_BASE_ARGS_FORMAT", None) != cls._LAYOUT
            or getattr(launcher, "global_scratch_size", 1)
            or getattr(launcher, "profile_scratch_size", 1)
        ):
            return None
        launch, descriptor_meta = launcher.launch, {}
        if getattr(launch, "__name__", None) == "inner":  # wrapped to expand tensor descriptors
            cells = dict(zip(launch.__code__.co_freevars, (cell.cell_contents for cell in launch.__closure__ or ())))
            expand = getattr(module, "make_tensordesc_arg", None)
            if not {"launcher", "tensordesc_indices", "tensordesc_meta"} <= cells.keys() or expand is None:
                return None
            launch, metas = cells["launcher"], cells["tensordesc_meta"]
            descriptor_meta = dict(zip(sorted(cells["tensordesc_indices"]), metas))
        elif not callable(launch) or any(_is_descriptor(values[i]) for i in slots):
            return None
        return cls(
            launch,
            (launcher.launch_cooperative_grid, launcher.launch_pdl, None, None, packed_metadata, None, None, None),
            values,
            slots,
            templates,
            descriptor_meta,
            expand if descriptor_meta else None,
        )

    def __init__(self, launch, head, values, slots, templates, descriptor_meta, expand):
        self.launch, self.head = launch, head
        arguments, positions, self.maps, self.expands = [], [], {}, {}
        for i, value in enumerate(values):
            if i in descriptor_meta:
                meta = descriptor_meta[i]
                expanded = expand(value, meta)  # [TMA map or base, shape and strides...]
                # per base address, the map (shape and strides as bound); per (base, shape, strides), all of it
                self.expands[len(arguments)] = (templates[i], meta, expand, {} if meta is not None else None)
                if meta is not None:
                    self.maps[len(arguments)] = (templates[i], meta, expand, {})
                positions.append(len(arguments))
                arguments += [None, *expanded[1:]]  # no tensor of the binding call kept
            else:
                if i in slots:
                    positions.append(len(arguments))
                    value = None
                arguments.append(value)
        self.arguments, self.positions = arguments, tuple(positions)
        # Without descriptors and with the per-call values side by side (pointers lead most kernels), a call is
        # the bound values before them, the call's values and the bound values after them: no list to fill.
        self.around = None
        if not self.expands and positions and positions == list(range(positions[0], positions[0] + len(positions))):
            start, stop = positions[0], positions[0] + len(positions)
            self.around = (*head, *arguments[:start]), tuple(arguments[stop:])

    def _map(self, position, base):
        template, meta, expand, known = self.maps[position]
        address = base.data_ptr()
        tensor_map = known.get(address)
        if tensor_map is None:
            if len(known) >= 16:
                known.clear()
            tensor_map = known[address] = expand(template.on(base, checked=False), meta)[0]
        return tensor_map

    def _expanded(self, position, described) -> list:
        """A descriptor slot given ``(base, shape, strides)``: its map (or base), shape and strides."""
        template, meta, expand, known = self.expands[position]
        if known is None:  # no TMA map: the base tensor leads the expansion, nothing to keep
            return expand(template.on(described, checked=False), meta)
        base, shape, strides = described
        key = (base.data_ptr(), tuple(shape), tuple(strides))
        expanded = known.get(key)
        if expanded is None:
            if len(known) >= 16:
                known.clear()
            expanded = known[key] = expand(template.on(described, checked=False), meta)
        return expanded

    def __call__(self, grid, stream, function, tensors) -> None:
        around = self.around
        if around is not None:
            before, after = around
            self.launch(*grid, stream, function, *before, *tensors, *after)
            return
        arguments = self.arguments.copy()
        for position, tensor in zip(self.positions, tensors):
            if position not in self.expands:
                arguments[position] = tensor
            elif type(tensor) is tuple:
                expanded = self._expanded(position, tensor)
                arguments[position : position + len(expanded)] = expanded
            else:
                arguments[position] = self._map(position, tensor) if position in self.maps else tensor
        self.launch(*grid, stream, function, *self.head, *arguments)


# the argument layout of the Triton launcher that direct launches were written against (Triton 3.6's CUDA launcher)
DIRECT_LAUNCHER_LAYOUT = _DirectLaunch._LAYOUT


def _hook(hook):
    """A launch hook, or None when there is none to call (Triton's hook chains exist even when empty; the
    launcher skips a None hook, and the launch metadata it would need)."""
    return None if hook is None or getattr(hook, "calls", True) == [] else hook


_SIGNATURES: dict = {}


def bind(fn, grid, *args, per_call=(), **kwargs) -> BoundKernel:
    """The launch ``fn[grid](*args, **kwargs)`` as a :class:`BoundKernel` (compiled now on a GPU; nothing is
    launched). ``kwargs`` holds the kernel's keyword arguments and Triton's options (``num_warps``, ...);
    ``per_call`` names the scalar arguments the bound kernel takes on each call, as it takes tensors."""
    signature = _SIGNATURES.get(fn)
    if signature is None:
        signature = _SIGNATURES.setdefault(fn, inspect.signature(fn.fn))
    params = {name: value for name, value in kwargs.items() if name in signature.parameters}
    options = {name: value for name, value in kwargs.items() if name not in signature.parameters}
    bound = signature.bind(*args, **params)
    bound.apply_defaults()
    return BoundKernel(fn, grid, tuple(bound.arguments), tuple(bound.arguments.values()), options, per_call)


@dataclass(frozen=True)
class KernelSpec:
    """One launch as a backend plans it, the single description both the library's launches and the
    ahead-of-time compile tools read.

    ``fn`` is the ``@triton.jit`` (or ``@gluon.jit``) function, ``grid`` its launch grid, ``constexprs`` the
    values of its ``tl.constexpr`` parameters, ``options`` Triton's compile options (``num_warps``,
    ``num_stages``, ``maxnreg``, ...). ``per_call`` names the scalar arguments the bound launch takes on each call
    (:class:`BoundKernel`). ``arg_types`` gives the Triton type of each runtime argument that is not a 32-bit
    integer (``"*bf16"``, ``"fp32"``, ``"tensordesc<bf16[64,128]>"``); ``unaligned`` names the integer arguments a
    launch does not see divisible by 16 (the others, and every pointer, are specialized as 16-divisible, as
    aligned tensors and sizes make them), or ``divisible`` names the only arguments that are. These three matter
    only to :meth:`ast_source`: a launch binds real arguments, and Triton specializes on those.
    """

    fn: Any
    grid: tuple
    constexprs: Mapping[str, Any]
    options: Mapping[str, Any] = field(default_factory=dict)
    arg_types: Mapping[str, str] = field(default_factory=dict)
    unaligned: tuple = ()
    per_call: tuple = ()
    divisible: tuple | None = None

    def bind(self, *args) -> BoundKernel:
        """The launch on the runtime arguments ``args`` (positional, in the kernel's order) as a
        :class:`BoundKernel`; the spec's constexprs and options complete it."""
        return bind(self.fn, self.grid, *args, per_call=self.per_call, **self.constexprs, **self.options)

    def ast_source(self):
        """``ASTSource`` of this launch (``GluonASTSource`` for a ``@gluon.jit`` function) for
        ``triton.compile(..., target=...)``: what runs without a GPU (tools/compile_defaults.py, the compile
        tests)."""
        from triton.compiler import ASTSource

        names = self.fn.arg_names
        signature, attrs = {}, {}
        for index, name in enumerate(names):
            if name in self.constexprs:
                signature[name] = "constexpr"
                continue
            signature[name] = self.arg_types.get(name, "i32")
            if self.divisible is not None:
                aligned = name in self.divisible
            else:
                aligned = signature[name].startswith("*") or (signature[name] == "i32" and name not in self.unaligned)
            if aligned:
                attrs[(index,)] = [["tt.divisibility", 16]]
        constexprs = {(names.index(name),): value for name, value in self.constexprs.items()}
        if type(self.fn).__name__ == "GluonJITFunction":
            from triton.experimental.gluon._runtime import GluonASTSource as ASTSource
        return ASTSource(self.fn, signature, constexprs=constexprs, attrs=attrs)


class TileCounters:
    """Int32 tile counters of one stream, 16 bytes apart (the kernel is specialized on 16-byte aligned pointers),
    zeroed together: each launch takes the next one, and once all were taken one memset, ordered on the
    stream after every launch that used them, zeroes them again (one memset per 256 launches, not one each)."""

    COUNT = 256

    def __init__(self, device: torch.device):
        self.slab = torch.zeros(4 * self.COUNT, dtype=torch.int32, device=device)
        self.views = [self.slab[4 * i : 4 * i + 1] for i in range(self.COUNT)]
        self.taken = 0

    def take(self) -> torch.Tensor:
        if self.taken == self.COUNT:
            self.slab.zero_()
            self.taken = 0
        self.taken += 1
        return self.views[self.taken - 1]


def take_tile_counter(counters: dict, device: torch.device) -> torch.Tensor:
    """A zeroed int32 tile counter, without a sync: the next of a launch's own for the current stream
    (``counters`` maps streams to :class:`TileCounters`; the caller holds the launch's lock, so that two threads'
    launches on one stream take them in order), or a fresh one while a CUDA graph is captured (each captured launch
    keeps its own) and off the GPU."""
    if device.type != "cuda" or capturing(device):
        return torch.zeros(1, dtype=torch.int32, device=device)
    stream = torch._C._cuda_getCurrentRawStream(
        device.index if device.index is not None else torch.cuda.current_device()
    )
    tile_counters = counters.get(stream)
    if tile_counters is None:
        tile_counters = counters.setdefault(stream, TileCounters(device))
    return tile_counters.take()
