"""The attention plan: which backends launch a call, with their kernel specs and bound launches, kept per call
signature in :data:`PLANS`.

A backend is one kernel and the host code around it, behind one contract:

* ``supports(call, tiles) -> bool``: whether it runs a :class:`~llmkernels.attention.check.CheckedCall` with the
  :class:`~llmkernels.attention.config.Tiling` chosen for it (no tensor is read: the call holds the layout facts);
* ``spec(call, tiles) -> KernelSpec``: the launch it makes (function, grid, constexprs, options, argument types),
  the one description the library's launches and the ahead-of-time compile tools both read;
* ``launch(call, tiles)``: that launch for a plan, bound (:meth:`KernelSpec.bind`) on the first call's tensors and
  then called with each call's tensors.

A plan asks :data:`PASSES` in order (the Gluon FP8 prefill, the Gluon prefill, the Gluon split-KV pass, the portable
kernel, which takes every call) for the pass over the keys; a split-KV call of several splits then runs
:data:`COMBINE`. A call with a float8_e4m3fn input (FP8 attention) goes only to a pass whose backend says
``reads_fp8 = True`` (:func:`takes`): the Gluon FP8 prefill (e4m3 K/V with an e4m3 or 16-bit q, dense, ragged or
paged, on sm_90) and the portable kernel, which takes every other FP8 call.

The plan key (:func:`plan_key`) is the call's signature as :class:`~llmkernels.launch.PlanCache` makes it, except
for dense K/V without a mask tensor: there it holds, of Skv and the K/V strides, only what Triton specializes on
(equality with 1, divisibility by 16, 64-bit) and what the plan decides on (16-byte strides TMA reads, heads
contiguous in a token row, evenly spaced batches, no keys); the launches take Skv and the strides per call. A decode step whose cache grows by a token
(transformers' ``DynamicCache``) thus keeps its plan and its compiled kernels; only the split count, which follows
the key count, picks among the launches a plan keeps per count.
"""

from __future__ import annotations

import dataclasses

import torch

from .. import runtime
from ..launch import PlanCache, value_key
from ..runtime import cdiv, num_programs_hint
from . import config as attention_config
from . import portable, split_kv
from .check import CheckedCall
from .config import FA4Config, Tiling, default_config

__all__ = ["PLANS", "PASSES", "COMBINE", "Plan", "plan_key", "takes"]

PLANS = PlanCache("attention")


def _passes() -> tuple:
    backends = []
    try:  # Gluon's Hopper modules (Triton >= 3.5); without them the portable kernel runs
        from . import gluon_decode, gluon_fp8_prefill, gluon_hopper

        backends += [gluon_fp8_prefill.BACKEND, gluon_hopper.BACKEND, gluon_decode.BACKEND]
    except ImportError:
        pass
    return (*backends, portable.BACKEND)


PASSES = _passes()
COMBINE = split_kv.BACKEND


def _stride_class(n: int) -> int:
    """What a plan may depend on of a stride it takes per call: 0 and 1 as such (Triton makes 1 a constant),
    else divisibility by 16 (Triton's specialization) and by 8 (a 16-byte stride of 16-bit elements, which TMA
    needs), and whether it fits in int32 (Triton's argument width)."""
    return n if n < 2 else 2 + (n & 15 == 0) + 2 * (n & 7 == 0) + 4 * (n >= 2**31)


def _size_class(n: int) -> int:
    """What a plan may depend on of a key count it takes per call: 0 and 1 as such, else divisibility by 16 and
    the kernels' bound of 2**30 keys."""
    return n if n < 2 else 2 + (n & 15 == 0) + 2 * (n >= 2**30)


def _dense_kv_key(k: torch.Tensor, v: torch.Tensor) -> tuple:
    """The key of dense ``[B, Skv, Hkv, D]`` k and v with Skv and their batch, token and head strides abstracted
    (:func:`_size_class`, :func:`_stride_class`) but for the relations a plan decides on: heads contiguous in a
    token row, batches evenly spaced, k and v of one length."""
    k_shape, k_strides, v_shape, v_strides = k.shape, k.stride(), v.shape, v.stride()
    batch, seqlen, heads, head_dim = k_shape
    kb, ks, kh, kd = k_strides
    alike = v_shape == k_shape and v_strides == k_strides  # the usual case: v's part of the key is k's
    key = (
        k.dtype,
        v.dtype,
        k.device,
        v.device,
        k.requires_grad,
        v.requires_grad,
        k.data_ptr() % 16,
        v.data_ptr() % 16,
        batch,
        heads,
        head_dim,
        _size_class(seqlen),
        _stride_class(kb),
        _stride_class(ks),
        _stride_class(kh),
        kd,
        kh == head_dim,
        kb == seqlen * ks,
        alike,
    )
    if alike:
        return key
    vb, vs, vh, vd = v_strides
    return (
        *key,
        v_shape[0],
        v_shape[2],
        v_shape[3],
        v_shape[1] == seqlen,
        _stride_class(vb),
        _stride_class(vs),
        _stride_class(vh),
        vd,
        vh == head_dim,
        vb == seqlen * vs,
    )


def _has_mask_tensor(mask) -> bool:
    return isinstance(mask, torch.Tensor) or (
        type(mask) in (tuple, list) and any(isinstance(part, torch.Tensor) for part in mask)
    )


def plan_key(
    q,
    k,
    v,
    causal,
    mask,
    score_mod,
    sinks,
    softmax_scale,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    kv_cache,
    num_splits,
    return_lse,
    config,
    validate,
    q_descale=None,
    k_descale=None,
    v_descale=None,
):
    """The plan key of an :func:`~llmkernels.attention.attention` call (arguments in its order), or None for a call
    with an unhashable argument (planned, and checked, every time)."""
    try:
        if (
            kv_cache is None
            and cu_seqlens_k is None
            and type(k) is torch.Tensor
            and type(v) is torch.Tensor
            and k.dim() == 4
            and v.dim() == 4
            and (mask is None or not _has_mask_tensor(mask))
        ):
            kv = _dense_kv_key(k, v)
        else:
            kv = (None if k is None else value_key(k), None if v is None else value_key(v))
        return (
            torch.is_grad_enabled(),
            value_key(q),
            kv,
            value_key(causal),
            None if mask is None else value_key(mask),
            None if score_mod is None else value_key(score_mod),
            None if sinks is None else value_key(sinks),
            None if softmax_scale is None else value_key(softmax_scale),
            None if cu_seqlens_q is None else value_key(cu_seqlens_q),
            None if cu_seqlens_k is None else value_key(cu_seqlens_k),
            None if max_seqlen_q is None else value_key(max_seqlen_q),
            None if max_seqlen_k is None else value_key(max_seqlen_k),
            None if kv_cache is None else value_key(kv_cache),
            None if num_splits is None else value_key(num_splits),
            value_key(return_lse),
            None if config is None else value_key(config),
            value_key(validate),
            None if q_descale is None else value_key(q_descale),
            None if k_descale is None else value_key(k_descale),
            None if v_descale is None else value_key(v_descale),
        )
    except TypeError:
        return None


def takes(backend, call: CheckedCall, tiles: Tiling) -> bool:
    """Whether ``backend`` runs ``call``: its ``supports``, and for an FP8 call (float8_e4m3fn q or K/V, descales)
    its ``reads_fp8`` flag: a backend that does not load e4m3 tiles and apply the descales must never take one."""
    if call.fp8 and not getattr(backend, "reads_fp8", False):
        return False
    return backend.supports(call, tiles)


class _Launches:
    """What one split count of a plan launches: the pass and, with several splits, the combine."""

    def __init__(self, call: CheckedCall, tiles: Tiling, q_shape: tuple):
        self.tiles = tiles
        backend = next(backend for backend in PASSES if takes(backend, call, tiles))
        self.backend = backend.name
        self.run = backend.launch(call, tiles)
        self.combine = COMBINE.launch(call, tiles) if COMBINE.supports(call, tiles) else None
        self.partial_shapes = None
        if self.combine is not None:
            lse_shape = (
                (tiles.num_splits, call.num_q_heads, q_shape[0])
                if call.ragged
                else (tiles.num_splits, q_shape[0], call.num_q_heads, q_shape[1])
            )
            self.partial_shapes = ((tiles.num_splits, *q_shape), lse_shape)


class Plan:
    """Backends, tiling and bound launches of one call signature. Holds no tensor of a call: the launches bind at
    the first run, on its tensors, and keep none of them."""

    def __init__(self, call: CheckedCall, config: FA4Config | None, q_shape: tuple):
        self.has_slopes = call.mod_spec.slopes is not None
        self.call = call = dataclasses.replace(call, mod_spec=dataclasses.replace(call.mod_spec, slopes=None))
        self.q_shape, self.dtype, self.device, self.return_lse = q_shape, call.dtype, call.device, call.return_lse
        self.lse_shape = (call.num_q_heads, q_shape[0]) if call.ragged else (q_shape[0], call.num_q_heads, q_shape[1])
        self.empty = 0 in q_shape or call.batch == 0 or call.q_bound == 0
        split = attention_config.splits_kv(call.q_bound, call.num_splits)
        if config is None:
            config = default_config(
                call.head_dim,
                call.dtype,
                call.device,
                decode=split,
                num_q_heads=call.num_q_heads,
                num_kv_heads=call.num_kv_heads,
                visible_band=call.mask_spec.visible_band,
            )
        self.config = config
        self.tiles = attention_config.tiling(config, split, call.q_bound, call.group, call.batch, call.num_kv_heads)
        # A split call's split count follows the key count (and, under a window, whether a query sees every key
        # picks the pass): fixed by the key, except for dense K/V, whose Skv each call brings.
        self.per_key_count = split and call.dynamic_kv
        self.by_key_count, self.by_splits = {}, {}
        self.launches = None if self.per_key_count else self._launches(call.kv_bound)

    def specs(self) -> list:
        """The :class:`~llmkernels.launch.KernelSpec` of every launch made so far (per split count: the pass, then
        the combine), and the backends of the passes: ``[(backend name, spec), ...]``."""
        made = []
        for launches in self.by_splits.values():
            made.append((launches.backend, launches.run.spec))
            if launches.combine is not None:
                made.append((COMBINE.name, launches.combine.spec))
        return made

    def _launches(self, kv_bound: int) -> _Launches:
        call, tiles = self.call, self.tiles
        whole = self._sees_every_key(kv_bound)
        if tiles.split:
            num_splits = attention_config.split_count(
                tiles,
                max(1, cdiv(kv_bound, tiles.config.BN)),
                call.num_splits,
                num_programs_hint(call.device),
                call.fp8_kv,
            )
            tiles = dataclasses.replace(tiles, num_splits=num_splits)
        launches = self.by_splits.get((tiles.num_splits, whole))
        if launches is None:
            if call.kv_bound != kv_bound:
                call = dataclasses.replace(call, kv_bound=kv_bound, kv_rows=kv_bound)
            launches = self.by_splits.setdefault((tiles.num_splits, whole), _Launches(call, tiles, self.q_shape))
        return launches

    def _sees_every_key(self, kv_bound: int) -> bool:
        spec = self.call.mask_spec
        return not spec.has_window or (spec.window_left >= kv_bound and spec.window_right >= 0)

    def _for_key_count(self, kv_bound: int) -> _Launches:
        """The launches of a call of ``kv_bound`` keys (dense K/V on the split path)."""
        key = (cdiv(kv_bound, self.tiles.config.BN), self._sees_every_key(kv_bound))
        launches = self.by_key_count.get(key)
        if launches is None:
            if len(self.by_key_count) >= 4096:
                self.by_key_count.clear()
            launches = self.by_key_count[key] = self._launches(kv_bound)
        return launches

    def __call__(
        self, q, k, v, kv_cache, cu_seqlens_q, cu_seqlens_k, sinks, score_mod, attn_mask=None, descales=(None,) * 3
    ):
        out = runtime.new_buffer(self.q_shape, self.dtype, self.device)
        lse = runtime.new_buffer(self.lse_shape, torch.float32, self.device) if self.return_lse else None
        if self.empty:
            return (out, lse) if self.return_lse else out
        launches = self.launches or self._for_key_count(k.shape[1])
        o_partial = lse_partial = None
        if launches.partial_shapes is not None:
            o_partial = runtime.new_buffer(launches.partial_shapes[0], torch.float32, self.device)
            lse_partial = runtime.new_buffer(launches.partial_shapes[1], torch.float32, self.device)
        slopes = score_mod.slopes if self.has_slopes else None
        run_args = (q, k, v, kv_cache, cu_seqlens_q, cu_seqlens_k, sinks, slopes, attn_mask, out, lse)
        if self.call.fp8:  # only backends that read FP8 run these (takes), and only they take descales
            launches.run(*run_args, o_partial, lse_partial, descales)
        else:
            launches.run(*run_args, o_partial, lse_partial)
        if launches.combine is not None:
            launches.combine(o_partial, lse_partial, out, lse, sinks)
        return (out, lse) if self.return_lse else out
