"""Masks and score modifiers: the user-facing objects and the fused ``@triton.jit`` code they become.

Positions. Query ``q_idx`` (0-based inside its sequence) is aligned bottom-right to the keys: its
position is ``pos = q_idx + seqlen_k - seqlen_q`` (the new tokens follow the cache).

* ``causal=True``: query sees keys ``kv_idx <= pos``.
* :class:`SlidingWindow` ``(left, right)``: flash-attn's ``window_size``: keys
  ``pos - left <= kv_idx <= pos + right``; any negative side (``-1`` by convention) is unbounded. With
  ``causal=True`` the right bound becomes ``min(right, 0)``.
* :class:`Chunked` ``(size)``: Llama 4's chunked local attention: query and key in the same chunk,
  ``pos // size == kv_idx // size`` (positions ``pos < 0`` are in no chunk and see nothing). Llama 4
  uses it together with causal (``causal=True``: ``kv_idx <= pos`` too); without ``causal`` each
  chunk attends bidirectionally.
* a user ``mask_mod(b, h, q_idx, kv_idx) -> bool`` ``@triton.jit`` function: ``True`` = visible.
  ``b`` is the batch index (int32 scalar), ``h`` the q head, ``q_idx`` / ``kv_idx`` the indices
  inside the sequence (not aligned), as broadcastable int32 tensors (``[M, 1]`` and ``[1, N]``).
  Indices of padding rows/columns are clamped into the valid range before the call.
* ``mask`` may also be a tuple combining at most one window, one chunk and one ``mask_mod`` (AND).

Score modifiers (applied to the scaled score ``softmax_scale * q.k`` in natural-log units, before
masking, as FlexAttention's ``score_mod``):

* :func:`softcap` ``(c)``: ``c * tanh(score / c)`` (Gemma 2 / flash-attn ``softcap``).
* :func:`alibi` ``(slopes)``: ``score - slopes[h] * |pos - kv_idx|`` (flash-attn's ``alibi_slopes``),
  slopes float32 ``[Hq]``.
* a user ``score_mod(score, b, h, q_idx, kv_idx) -> score`` ``@triton.jit`` function, same index
  conventions as ``mask_mod``.

Huge sizes. Sequences hold fewer than ``2**30`` queries and keys, so positions lie in ``(-2**30, 2**30)``
and a window side or chunk size of ``UNBOUNDED = 2**30`` or more never binds: :func:`resolve_mask`
clamps such values (any Python int, e.g. ``2**31 - 1`` or ``2**63 - 1``) to ``UNBOUNDED``, which keeps
the kernel's bound arithmetic (``pos - left``, ``pos + right + 1``, ``(chunk + 1) * size``) inside
int32. A window unbounded on both sides (and no ``causal``) is no window at all.

Tiles that the window / chunk / causal bounds hide completely are skipped by the loop bounds; tiles
they show completely run without any per-element masking. A ``mask_mod`` is opaque, so with one every
tile inside those bounds is masked per element.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..launch import value_key

__all__ = [
    "SlidingWindow",
    "Chunked",
    "ScoreMod",
    "softcap",
    "alibi",
    "MaskSpec",
    "ScoreModSpec",
    "resolve_mask",
    "resolve_score_mod",
    "UNBOUNDED",
]

# A window side or chunk size that never binds: no sequence holds 2**30 keys, and pos +- UNBOUNDED + 1
# stays inside int32 for every position |pos| < 2**30. Larger values are clamped to it.
UNBOUNDED = 1 << 30

# The score modifier kinds: ScoreModSpec.kind on the host, the kernels' SCORE_MOD_KIND constexpr.
SCORE_MOD_NONE, SCORE_MOD_SOFTCAP, SCORE_MOD_ALIBI, SCORE_MOD_USER = "none", "softcap", "alibi", "user"


def _store_int(owner, name: str, expected: str) -> None:
    """Stores ``owner.name`` as a Python int: ints and numpy / torch integer scalars (``operator.index``)
    pass; bools, floats and anything else raise TypeError naming the field."""
    value = getattr(owner, name)
    if type(value) is int:
        return
    message = f"{type(owner).__name__}.{name} must be {expected}, got {value!r}"
    if isinstance(value, bool) or getattr(value, "dtype", None) == torch.bool or getattr(value, "ndim", 0):
        raise TypeError(message)
    try:
        object.__setattr__(owner, name, operator.index(value))
    except TypeError:
        raise TypeError(message) from None


@dataclass(frozen=True)
class SlidingWindow:
    """Local attention window, flash-attn's ``window_size=(left, right)``.

    Any int is valid: a negative side (``-1`` by convention) is unbounded, and so is a side of
    ``2**30`` or more (see :data:`UNBOUNDED`), e.g. ``2**31 - 1`` as some configs spell "no window".

    Raises:
        TypeError: left or right is not an int (bool and float included; numpy / torch integer
            scalars are accepted and stored as int).
    """

    left: int
    right: int = 0

    def __post_init__(self):
        for name in ("left", "right"):
            _store_int(self, name, "an int (negative = unbounded)")


@dataclass(frozen=True)
class Chunked:
    """Chunked local attention (Llama 4): query and key in the same chunk of ``size`` positions.

    A size of ``2**30`` or more (see :data:`UNBOUNDED`) puts every position ``>= 0`` in one chunk.

    Raises:
        TypeError: size is not an int (bool and float included; numpy / torch integer scalars are
            accepted and stored as int).
        ValueError: size < 1.
    """

    size: int

    def __post_init__(self):
        _store_int(self, "size", "a positive int")
        if self.size < 1:
            raise ValueError(f"Chunked.size must be a positive int, got {self.size!r}")


@dataclass(frozen=True)
class ScoreMod:
    """A built-in score modifier; make one with :func:`softcap` or :func:`alibi`."""

    kind: str
    cap: float = 0.0
    slopes: torch.Tensor | None = None

    def plan_key(self) -> tuple:
        """What a plan depends on (:func:`llmkernels.launch.value_key`): kind, cap, the slopes' signature."""
        return "ScoreMod", *map(value_key, (self.kind, self.cap, self.slopes))


def softcap(cap: float) -> ScoreMod:
    """``score -> cap * tanh(score / cap)``. Raises ValueError unless ``cap`` is a positive finite number."""
    if isinstance(cap, bool) or not isinstance(cap, (int, float)) or not math.isfinite(cap) or cap <= 0:
        raise ValueError(f"softcap cap must be a positive finite number, got {cap!r}")
    return ScoreMod(SCORE_MOD_SOFTCAP, cap=float(cap))


def alibi(slopes: torch.Tensor) -> ScoreMod:
    """``score -> score - slopes[h] * |pos - kv_idx|``; slopes float32 ``[Hq]`` on the inputs' device.

    Raises:
        TypeError: slopes is not a float32 tensor.
        ValueError: slopes is not 1-D (its length is checked against Hq by :func:`attention`).
    """
    if not isinstance(slopes, torch.Tensor) or slopes.dtype != torch.float32:
        raise TypeError(f"alibi slopes must be a float32 tensor, got {getattr(slopes, 'dtype', type(slopes).__name__)}")
    if slopes.dim() != 1:
        raise ValueError(f"alibi slopes must be 1-D [Hq], got shape {tuple(slopes.shape)}")
    return ScoreMod(SCORE_MOD_ALIBI, slopes=slopes)


def _jit_function_types() -> tuple:
    types = [triton.runtime.JITFunction]
    try:  # what @triton.jit returns under TRITON_INTERPRET=1
        from triton.runtime.interpreter import InterpretedFunction

        types.append(InterpretedFunction)
    except ImportError:
        pass
    return tuple(types)


def is_jit_function(obj) -> bool:
    """True for a ``@triton.jit`` function (compiled or interpreted)."""
    return isinstance(obj, _jit_function_types())


@dataclass(frozen=True)
class MaskSpec:
    """What the kernel needs to know about the mask: compile-time flags and runtime bounds."""

    has_window: bool = False
    window_left: int = UNBOUNDED
    window_right: int = UNBOUNDED
    has_chunk: bool = False
    chunk_size: int = 1
    mask_mod: object = None

    @property
    def visible_band(self) -> int | None:
        """The most keys one query can see under the window and chunk (None: not bounded by them)."""
        band = None
        if self.has_window and max(self.window_left, self.window_right) < UNBOUNDED:
            band = self.window_left + self.window_right + 1
        if self.has_chunk and self.chunk_size < UNBOUNDED:
            band = self.chunk_size if band is None else min(band, self.chunk_size)
        return band


@dataclass(frozen=True)
class ScoreModSpec:
    kind: str = SCORE_MOD_NONE
    cap: float = 1.0
    slopes: torch.Tensor | None = None
    fn: object = None


def _clamp_size(value: int) -> int:
    """A window side or chunk size for the kernel: negative (window) or ``>= UNBOUNDED`` -> ``UNBOUNDED``."""
    return UNBOUNDED if value < 0 else min(value, UNBOUNDED)


MASK_TENSOR_DTYPES = (torch.bool, torch.float32, torch.float16, torch.bfloat16)


def split_mask_tensor(mask):
    """``(mask without its tensor part, the tensor or None)``: a torch.Tensor in ``mask`` (alone or in a tuple)
    is a materialized mask, SDPA's ``attn_mask``. Raises ValueError for more than one."""
    parts = () if mask is None else (tuple(mask) if isinstance(mask, (tuple, list)) else (mask,))
    tensors = [part for part in parts if isinstance(part, torch.Tensor)]
    if len(tensors) > 1:
        raise ValueError("mask: at most one materialized mask tensor")
    if not tensors:
        return mask, None
    rest = tuple(part for part in parts if not isinstance(part, torch.Tensor))
    return (rest if len(rest) > 1 else rest[0] if rest else None), tensors[0]


def mask_tensor_4d(tensor: torch.Tensor) -> torch.Tensor:
    """A materialized mask of at most 4 dims as the 4D view ``[B|1, Hq|1, Sq|1, Skv|1]`` it broadcasts as."""
    return tensor.reshape((1,) * (4 - tensor.dim()) + tuple(tensor.shape))


def mask_tensor_kind(tensor) -> str:
    """The kernel's ``MASK_TENSOR``: ``"none"``, ``"bool"`` (True: attend) or ``"additive"`` (added to the
    scaled score)."""
    if tensor is None:
        return "none"
    return "bool" if tensor.dtype == torch.bool else "additive"


def resolve_mask(causal: bool, mask) -> MaskSpec:
    """Folds ``causal`` and ``mask`` into one :class:`MaskSpec`. Raises TypeError/ValueError naming ``mask``.

    Window sides and the chunk size come out in ``[0, UNBOUNDED]`` (negative or ``>= UNBOUNDED``:
    ``UNBOUNDED``); ``has_window`` is False when neither side binds and ``causal`` is False."""
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    parts = () if mask is None else (tuple(mask) if isinstance(mask, (tuple, list)) else (mask,))
    window = chunk = mask_mod = None
    for part in parts:
        if isinstance(part, SlidingWindow):
            if window is not None:
                raise ValueError("mask: at most one SlidingWindow")
            window = part
        elif isinstance(part, Chunked):
            if chunk is not None:
                raise ValueError("mask: at most one Chunked")
            chunk = part
        elif is_jit_function(part):
            if mask_mod is not None:
                raise ValueError("mask: at most one mask_mod function")
            mask_mod = part
        else:
            raise TypeError(
                "mask must be None, SlidingWindow, Chunked, a @triton.jit mask_mod(b, h, q_idx, kv_idx), "
                f"or a tuple of those; got {type(part).__name__}"
            )
    left = right = UNBOUNDED
    if window is not None:
        left, right = _clamp_size(window.left), _clamp_size(window.right)
    if causal:
        right = min(right, 0)
    return MaskSpec(
        has_window=min(left, right) < UNBOUNDED,
        window_left=left,
        window_right=right,
        has_chunk=chunk is not None,
        chunk_size=_clamp_size(chunk.size) if chunk is not None else 1,
        mask_mod=mask_mod,
    )


def resolve_score_mod(score_mod) -> ScoreModSpec:
    """Turns ``score_mod`` into a :class:`ScoreModSpec`. Raises TypeError naming ``score_mod``."""
    if score_mod is None:
        return ScoreModSpec()
    if isinstance(score_mod, ScoreMod):
        if score_mod.kind == SCORE_MOD_SOFTCAP:
            return ScoreModSpec(kind=SCORE_MOD_SOFTCAP, cap=score_mod.cap)
        return ScoreModSpec(kind=SCORE_MOD_ALIBI, slopes=score_mod.slopes)
    if is_jit_function(score_mod):
        return ScoreModSpec(kind=SCORE_MOD_USER, fn=score_mod)
    raise TypeError(
        "score_mod must be None, softcap(c), alibi(slopes) or a @triton.jit score_mod(score, b, h, q_idx, kv_idx); "
        f"got {type(score_mod).__name__}"
    )


# ---------------------------------------------------------------------------------------------
# Fused device code
# ---------------------------------------------------------------------------------------------


@triton.jit
def tanh_via_exp2(x):
    """tanh from one exp2 (no libdevice, so the interpreter runs it too); saturates cleanly at +-1."""
    return 1.0 - 2.0 / (1.0 + tl.exp2(x * 2.8853900817779268))  # 2 * log2(e)


@triton.jit
def apply_score_mod(
    scores,
    batch,
    heads,
    q_idx,
    kv_idx,
    q_pos,
    softcap_value,
    alibi_slopes,
    SCORE_MOD_KIND: tl.constexpr,
    SCORE_MOD: tl.constexpr,
):
    """scores ``[M, N]`` float32 (natural units) -> modified scores. ``heads``/``q_idx``/``q_pos``/
    ``alibi_slopes`` are ``[M, 1]``, ``kv_idx`` ``[1, N]``."""
    if SCORE_MOD_KIND == "softcap":
        scores = softcap_value * tanh_via_exp2(scores / softcap_value)
    elif SCORE_MOD_KIND == "alibi":
        distance = tl.abs(q_pos - kv_idx).to(tl.float32)
        scores = scores - alibi_slopes * distance
    elif SCORE_MOD_KIND == "user":
        scores = SCORE_MOD(scores, batch, heads, q_idx, kv_idx).to(tl.float32)
    return scores


@triton.jit
def visible_mask(
    batch,
    heads,
    q_idx,
    kv_idx,
    q_pos,
    kv_raw,
    seqlen_k,
    window_left,
    window_right,
    chunk_size,
    HAS_WINDOW: tl.constexpr,
    HAS_CHUNK: tl.constexpr,
    HAS_MASK_MOD: tl.constexpr,
    MASK_MOD: tl.constexpr,
):
    """bool ``[M, N]``: which (query, key) pairs are visible. ``kv_raw`` is the unclamped key index
    ``[1, N]`` (for the length bound), ``kv_idx`` the clamped one handed to ``MASK_MOD``."""
    visible = (kv_raw < seqlen_k) & (q_pos == q_pos)  # broadcast to [M, N]
    if HAS_WINDOW:
        offset = kv_raw - q_pos
        visible = visible & (offset <= window_right) & (offset >= -window_left)
    if HAS_CHUNK:
        visible = visible & (q_pos >= 0) & ((q_pos // chunk_size) == (kv_raw // chunk_size))
    if HAS_MASK_MOD:
        visible = visible & MASK_MOD(batch, heads, q_idx, kv_idx)
    return visible
