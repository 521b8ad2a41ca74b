"""attention(): validates its inputs, picks the config and the path (one pass, or split-KV + combine),
and launches the Triton kernels. The only module that launches."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
from triton.tools.tensor_descriptor import TensorDescriptor

from .. import runtime
from ..launch import BoundKernel, PlanCache, bind
from ..runtime import (cdiv, check_device, cuda_capability, first_bad_prefix_sum, first_true, forward_only,
                        interpreting, next_power_of_2, num_programs_hint, unit_last_stride)
from . import split_kv
from .config import SUPPORTED_HEAD_DIMS, FA4Config, default_config
from .kernel import attention_fwd_kernel
from .masks import (MASK_TENSOR_DTYPES, SCORE_MOD_ALIBI, SCORE_MOD_NONE, UNBOUNDED, MaskSpec, ScoreModSpec,
                    mask_tensor_4d, mask_tensor_kind, resolve_mask, resolve_score_mod, split_mask_tensor)
from .paged import PagedKVCache

__all__ = ["attention", "check_attention"]

_DTYPES = (torch.float16, torch.bfloat16)


def _dtype_name(x) -> str:
    return str(getattr(x, "dtype", type(x).__name__))


def _check_optional_int(name: str, value, minimum: int) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int or None, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


def _check_cu_seqlens(name: str, cu_seqlens, expected_len: int | None = None) -> None:
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"{name} must be an int32 tensor [B + 1], got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype != torch.int32:
        raise TypeError(f"{name} must be int32, got {cu_seqlens.dtype}")
    if cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 1:
        raise ValueError(f"{name} must be 1-D [B + 1] with at least one entry, got shape {tuple(cu_seqlens.shape)}")
    if expected_len is not None and cu_seqlens.shape[0] != expected_len:
        raise ValueError(f"{name} must have {expected_len} entries (B + 1), got {cu_seqlens.shape[0]}")


def _to_host(*tensors: torch.Tensor | None) -> list[torch.Tensor | None]:
    """int64 CPU copies of the given integer tensors (None stays None), with one device sync."""
    present = [t for t in tensors if t is not None]
    if not present:
        return list(tensors)
    flat = torch.cat([t.reshape(-1).to(torch.int64) for t in present]).cpu()
    parts = iter(flat.split([t.numel() for t in present]))
    return [None if t is None else next(parts).view(t.shape) for t in tensors]


def _check_cu_seqlens_values(name: str, cu_seqlens: torch.Tensor, total: int, rows: str,
                             max_seqlen: int | None, max_name: str) -> None:
    """Prefix sums on the host: ``[0] == 0``, non-decreasing, ``<= total``, lengths ``<= max_seqlen``;
    raises on the first bad entry."""
    i = first_bad_prefix_sum(cu_seqlens, total, max_seqlen)
    if i is None:
        return
    value = int(cu_seqlens[i])
    if i == 0:
        raise ValueError(f"{name}[0] = {value} != 0")
    if value > total:
        raise ValueError(f"{name}[{i}] = {value} > total {rows} {total}")
    previous = int(cu_seqlens[i - 1])
    if value < previous:
        raise ValueError(f"{name} must be non-decreasing: {name}[{i}] = {value} < {name}[{i - 1}] = {previous}")
    raise ValueError(f"{name}[{i}] - {name}[{i - 1}] = {value - previous} > {max_name} = {max_seqlen}")


def _check_paged_values(seqlens: torch.Tensor, block_table: torch.Tensor, num_pages: int, page_size: int,
                        max_seqlen_k: int | None) -> None:
    """Key counts in ``[0, max_pages * page_size]`` (and ``<= max_seqlen_k``); the pages each sequence
    uses (the first ``ceil(seqlens[b] / page_size)`` of its row) in ``[0, num_pages)``."""
    bound = block_table.shape[1] * page_size
    limit = bound if max_seqlen_k is None else min(bound, max_seqlen_k)
    first = first_true((seqlens < 0) | (seqlens > limit))
    if first is not None:
        b = first[0]
        value = int(seqlens[b])
        what = "< 0" if value < 0 else f"> max_pages * page_size = {bound}" if value > bound else (
            f"> max_seqlen_k = {max_seqlen_k}")
        raise ValueError(f"kv_cache.seqlens[{b}] = {value} {what}")
    pages_used = (seqlens + page_size - 1) // page_size
    used = torch.arange(block_table.shape[1])[None, :] < pages_used[:, None]
    first = first_true(used & ((block_table < 0) | (block_table >= num_pages)))
    if first is not None:
        b, i = first
        raise ValueError(f"kv_cache.block_table[{b}, {i}] = {int(block_table[b, i])} not in [0, num_pages={num_pages})")


def _validate_metadata_on_host(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, kv_cache) -> None:
    """The checks that need the metadata's values (one device sync); only with ``validate=True``."""
    paged = kv_cache is not None
    cu_q, cu_k, seqlens, block_table, starts = _to_host(
        cu_seqlens_q, cu_seqlens_k, kv_cache.seqlens if paged else None, kv_cache.block_table if paged else None,
        kv_cache.starts if paged else None)
    if cu_q is not None:
        _check_cu_seqlens_values("cu_seqlens_q", cu_q, q.shape[0], "queries", max_seqlen_q, "max_seqlen_q")
    if cu_k is not None:
        _check_cu_seqlens_values("cu_seqlens_k", cu_k, k.shape[0], "keys", max_seqlen_k, "max_seqlen_k")
    if paged:
        _check_paged_values(seqlens, block_table, kv_cache.num_pages, kv_cache.page_size, max_seqlen_k)
        if starts is not None:
            first = first_true((starts < 0) | (starts > seqlens))
            if first is not None:
                b = first[0]
                raise ValueError(f"kv_cache.starts[{b}] = {int(starts[b])} not in "
                                 f"[0, seqlens[{b}] = {int(seqlens[b])}]")


def _empty(shape, dtype, device) -> torch.Tensor:
    """Every buffer the kernels write (outputs and split partials); tests replace it to poison them."""
    return runtime.new_buffer(shape, dtype, device)


_DUMMIES: dict = {}


def _dummy(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A one-element tensor for pointer arguments that the compiled variant never reads."""
    key = (str(device), dtype)
    if key not in _DUMMIES:
        _DUMMIES[key] = torch.zeros(1, dtype=dtype, device=device)
    return _DUMMIES[key]


def _tma_capable(device: torch.device) -> bool:
    """Tensor descriptors run as TMA on sm90+; the interpreter emulates them (so CPU tests cover the path)."""
    capability = cuda_capability(device)
    return interpreting() or (capability is not None and capability[0] >= 9)


def _kv_token_descriptors(k: torch.Tensor, v: torch.Tensor, ragged: bool, block_n: int):
    """Tensor descriptors over K and V seen as ``[tokens, Hkv * D]`` (``[B * Skv]`` dense or ``[total_k]``
    ragged rows), blocks ``[block_n, D]``; None when a layout does not allow it (heads not contiguous in
    a token row, batches not evenly spaced, rows or base not 16-byte aligned, no rows)."""
    descriptors = []
    for t in (k, v):
        num_heads, head_dim = t.shape[-2:]
        row_stride = t.stride(-3)
        rows = t.shape[0] if ragged else t.shape[0] * t.shape[1]
        evenly_spaced = ragged or t.shape[0] == 1 or t.stride(0) == t.shape[1] * row_stride
        if (rows == 0 or t.stride(-1) != 1 or t.stride(-2) != head_dim or not evenly_spaced
                or (row_stride * t.element_size()) % 16 or t.data_ptr() % 16):
            return None
        descriptors.append(TensorDescriptor(t, [rows, num_heads * head_dim], [row_stride, 1], [block_n, head_dim]))
    return tuple(descriptors)


@dataclass(frozen=True)
class CheckedCall:
    """What :func:`check_attention` found: the layout, sizes, host-known bounds, mask and score modifier."""

    ragged: bool
    paged: bool
    batch: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    group: int
    q_bound: int  # most queries of one sequence (host-known)
    kv_bound: int  # most keys of one sequence (host-known)
    mask_spec: MaskSpec
    mod_spec: ScoreModSpec
    softmax_scale: float
    device: torch.device
    mask_kind: str = "none"  # the materialized mask: "none", "bool" or "additive"
    kv_starts: bool = False  # the paged cache has per-sequence key starts


def check_attention(q, k, v, causal, mask, score_mod, sinks, softmax_scale, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                    max_seqlen_k, kv_cache, num_splits, return_lse, config, validate) -> CheckedCall:
    """The checks of :func:`attention` that need no sync (no launch; safe while torch.compile traces)."""
    if not isinstance(q, torch.Tensor) or q.dtype not in _DTYPES:
        raise TypeError(f"q must be a float16 or bfloat16 tensor, got {_dtype_name(q)}")
    ragged = cu_seqlens_q is not None
    paged = kv_cache is not None
    if ragged and q.dim() != 3:
        raise ValueError(f"q must be [total_q, Hq, D] with cu_seqlens_q, got shape {tuple(q.shape)}")
    if not ragged and q.dim() != 4:
        raise ValueError(f"q must be [B, Sq, Hq, D] (or ragged [total_q, Hq, D] with cu_seqlens_q), "
                         f"got shape {tuple(q.shape)}")
    if ragged:
        _check_cu_seqlens("cu_seqlens_q", cu_seqlens_q)
    if paged:
        if not isinstance(kv_cache, PagedKVCache):
            raise TypeError(f"kv_cache must be a PagedKVCache, got {type(kv_cache).__name__}")
        if k is not None or v is not None:
            raise ValueError("with kv_cache, pass k = v = None (the keys and values live in the cache)")
        if cu_seqlens_k is not None:
            raise ValueError("cu_seqlens_k must be None with kv_cache (kv_cache.seqlens gives the key counts)")
        if kv_cache.dtype != q.dtype:
            raise TypeError(f"kv_cache.k_pages dtype {kv_cache.dtype} != q dtype {q.dtype}")
        batch = kv_cache.batch_size
        if ragged and cu_seqlens_q.shape[0] != batch + 1:
            raise ValueError(f"cu_seqlens_q must have {batch + 1} entries (kv_cache.block_table has {batch} rows), "
                             f"got {cu_seqlens_q.shape[0]}")
        if not ragged and q.shape[0] != batch:
            raise ValueError(f"q has batch {q.shape[0]} but kv_cache.block_table has {batch} rows")
        num_kv_heads, head_dim_k = kv_cache.num_kv_heads, kv_cache.head_dim
        kv_bound = kv_cache.max_seqlen_bound
        _check_optional_int("max_seqlen_k", max_seqlen_k, 0)
        if max_seqlen_k is not None:
            if max_seqlen_k > kv_bound:
                raise ValueError(f"block_table too small for max_seqlen_k={max_seqlen_k}: "
                                 f"{kv_cache.block_table.shape[1]} pages x {kv_cache.page_size} = {kv_bound} keys")
            kv_bound = max_seqlen_k
    else:
        for name, tensor in (("k", k), ("v", v)):
            if not isinstance(tensor, torch.Tensor):
                raise TypeError(f"{name} must be a tensor (or None with kv_cache), got {type(tensor).__name__}")
            if tensor.dtype != q.dtype:
                raise TypeError(f"{name} dtype {tensor.dtype} != q dtype {q.dtype}")
        if v.shape != k.shape:
            raise ValueError(f"v shape {tuple(v.shape)} != k shape {tuple(k.shape)}")
        if ragged != (cu_seqlens_k is not None):
            raise ValueError("cu_seqlens_q and cu_seqlens_k must be given together (ragged q and k)")
        if ragged:
            if k.dim() != 3:
                raise ValueError(f"k must be [total_k, Hkv, D] with cu_seqlens_k, got shape {tuple(k.shape)}")
            _check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, cu_seqlens_q.shape[0])
            batch = cu_seqlens_q.shape[0] - 1
        else:
            if k.dim() != 4:
                raise ValueError(f"k must be [B, Skv, Hkv, D], got shape {tuple(k.shape)}")
            if k.shape[0] != q.shape[0]:
                raise ValueError(f"k batch {k.shape[0]} != q batch {q.shape[0]}")
            batch = q.shape[0]
        num_kv_heads, head_dim_k = k.shape[-2], k.shape[-1]
        _check_optional_int("max_seqlen_k", max_seqlen_k, 0)
        kv_bound = (max_seqlen_k if max_seqlen_k is not None else k.shape[0]) if ragged else k.shape[1]
    num_q_heads, head_dim = q.shape[-2], q.shape[-1]
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head dim {head_dim} unsupported: q's last dim must be a multiple of 16 in [16, 256]")
    if head_dim_k != head_dim:
        raise ValueError(f"k/v head dim {head_dim_k} != q head dim {head_dim}")
    if num_kv_heads < 1 or num_q_heads % num_kv_heads:
        raise ValueError(f"q heads ({num_q_heads}) must be a multiple of k/v heads ({num_kv_heads})")
    group = num_q_heads // num_kv_heads
    _check_optional_int("max_seqlen_q", max_seqlen_q, 0)
    q_bound = (q.shape[0] if max_seqlen_q is None else min(max_seqlen_q, q.shape[0])) if ragged else q.shape[1]
    for name, bound in (("queries", q_bound), ("keys", kv_bound)):
        if bound >= UNBOUNDED:  # positions and window bounds are int32 in the kernel
            raise ValueError(f"a sequence may hold up to {UNBOUNDED - 1} {name}, got a bound of {bound} "
                             f"(ragged inputs: pass max_seqlen_q / max_seqlen_k)")
    _check_optional_int("num_splits", num_splits, 1)
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse must be a bool, got {type(return_lse).__name__}")
    if not isinstance(validate, bool):
        raise TypeError(f"validate must be a bool, got {type(validate).__name__}")
    mask, attn_mask = split_mask_tensor(mask)
    mask_spec = resolve_mask(causal, mask)
    if attn_mask is not None:
        _check_mask_tensor(attn_mask, ragged, batch, num_q_heads, q_bound,
                           kv_cache.max_seqlen_bound if paged else (k.shape[1] if not ragged else None))
    mod_spec = resolve_score_mod(score_mod)
    if mod_spec.kind == SCORE_MOD_ALIBI and mod_spec.slopes.shape[0] != num_q_heads:
        raise ValueError(f"alibi slopes must be [Hq] = [{num_q_heads}], got {tuple(mod_spec.slopes.shape)}")
    if sinks is not None:
        if not isinstance(sinks, torch.Tensor) or sinks.dtype != torch.float32:
            raise TypeError(f"sinks must be a float32 tensor [Hq], got {_dtype_name(sinks)}")
        if sinks.shape != (num_q_heads,):
            raise ValueError(f"sinks must be [Hq] = [{num_q_heads}], got {tuple(sinks.shape)}")
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(head_dim)
    elif isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)) or (
            # traced by torch.compile, its value is unknown while tracing: the op checks it when it runs
            not torch.compiler.is_compiling() and not math.isfinite(softmax_scale)):
        raise TypeError(f"softmax_scale must be a finite float or None, got {softmax_scale!r}")
    if config is not None:
        if not isinstance(config, FA4Config):
            raise TypeError(f"config must be an FA4Config, got {type(config).__name__}")
        for field, actual in (("depth", head_dim), ("num_q_heads", num_q_heads), ("num_kv_heads", num_kv_heads)):
            expected = getattr(config, field)
            if expected is not None and expected != actual:
                raise ValueError(f"config.{field}={expected} but the inputs have {actual}")
        if config.consumer_warpgroups == 3 and head_dim != 64:
            raise ValueError(f"config.consumer_warpgroups=3 needs head dim 64, the inputs have {head_dim}")
        if paged and config.page_size is not None and config.page_size != kv_cache.page_size:
            raise ValueError(f"config.page_size={config.page_size} but kv_cache has page size {kv_cache.page_size}")
    device = check_device(
        q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, sinks=sinks,
        alibi_slopes=mod_spec.slopes, mask=attn_mask,
        k_pages=kv_cache.k_pages if paged else None,
        block_table=kv_cache.block_table if paged else None,
        seqlens=kv_cache.seqlens if paged else None)
    forward_only("attention", q=q, k=k, v=v, sinks=sinks, alibi_slopes=mod_spec.slopes, mask=attn_mask,
                 k_pages=kv_cache.k_pages if paged else None, v_pages=kv_cache.v_pages if paged else None)

    return CheckedCall(ragged, paged, batch, num_q_heads, num_kv_heads, head_dim, group, q_bound, kv_bound, mask_spec,
                       mod_spec, softmax_scale, device, mask_tensor_kind(attn_mask),
                       paged and kv_cache.starts is not None)


def _check_mask_tensor(attn_mask, ragged: bool, batch: int, num_q_heads: int, seqlen_q: int, seqlen_k) -> None:
    """A materialized mask broadcastable to ``[B, Hq, Sq, Skv]`` (Skv: k's keys, or the block table's width)."""
    if attn_mask.dtype not in MASK_TENSOR_DTYPES:
        raise TypeError(f"mask tensor must be bool or float32/float16/bfloat16, got {attn_mask.dtype}")
    if ragged:
        raise ValueError("a mask tensor needs dense q [B, Sq, Hq, D] (ragged q: not supported)")
    full = (batch, num_q_heads, seqlen_q, seqlen_k)
    if attn_mask.dim() > 4 or any(size not in (1, want) for size, want in zip(mask_tensor_4d(attn_mask).shape, full)):
        raise ValueError(f"mask tensor of shape {tuple(attn_mask.shape)} does not broadcast to [B, Hq, Sq, Skv] = "
                         f"{list(full)}")


def attention(
    q: torch.Tensor,
    k: torch.Tensor | None,
    v: torch.Tensor | None,
    *,
    causal: bool = False,
    mask=None,
    score_mod=None,
    sinks: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    kv_cache: PagedKVCache | None = None,
    num_splits: int | None = None,
    return_lse: bool = False,
    config: FA4Config | None = None,
    validate: bool = False,
):
    """FA4-style attention forward, flash-attn conventions.

    ``O = softmax(score_mod(softmax_scale * Q K^T), masked) V`` per (sequence, q head h); q head h reads
    KV head ``h // (Hq / Hkv)`` (MHA, GQA, MQA).

    Layouts:
        * dense: q fp16/bf16 ``[B, Sq, Hq, D]``; k, v ``[B, Skv, Hkv, D]``.
        * ragged: q ``[total_q, Hq, D]``, k, v ``[total_k, Hkv, D]`` with int32 ``cu_seqlens_q`` /
          ``cu_seqlens_k`` ``[B + 1]`` (prefix sums; empty sequences allowed). ``max_seqlen_q`` (default
          ``total_q``) and ``max_seqlen_k`` are host-side bounds that size the grid: no device sync.
        * paged: ``kv_cache=PagedKVCache(...)`` and ``k = v = None``; q dense ``[B, Sq, Hq, D]`` or ragged
          with ``cu_seqlens_q``; ``kv_cache.seqlens[b]`` counts the keys of sequence b, new tokens included.
          ``max_seqlen_k`` is optional (bound: ``block_table.shape[1] * page_size``).
        D: any multiple of 16 up to 256 (64, 128, 256 are the tuned ones); the same for q, k and v.

    Kernels: on an sm_90 GPU, a call of more than 16 queries per sequence (``max_seqlen_q`` for ragged q), dense
    or ragged q and k/v or a paged cache (without ``starts``, its pages in a layout TMA reads: heads contiguous in
    a token row, 16-byte strides), D 64, 128 or 256, no mask but ``causal`` and / or a :class:`SlidingWindow`, no
    ``score_mod``, sinks or mask tensor, runs the warp-specialized Gluon kernel
    (:mod:`llmkernels.attention.gluon_hopper`: a load warp and two or three consumer warpgroups; q, k, v in a
    layout TMA cannot read are copied first) when the config has ``warp_specialized`` (the default there).
    Every other call, and every call on other GPUs or in the interpreter, runs the portable Triton kernel.

    Bad metadata (read on the device, never trusted with an address; ``validate=True`` reports it instead):
        * ``cu_seqlens_q`` / ``cu_seqlens_k`` are read as ``clamp(cummax(cu_seqlens), 0, total)`` (total =
          q's / k's rows): valid prefix sums are unchanged, a sequence never reaches past the tensor, a
          decreasing entry makes a sequence empty, and no q row belongs to two sequences (the earlier one
          keeps it), so no program writes another sequence's rows. Sequence b keeps its rows and its
          result when its own entries are sound (``cu[b] <= cu[b + 1] <= total``, ``cu[b]`` not below any
          earlier entry); an entry too large empties the later sequences it overlaps. Rows of q outside
          every sequence are not written (their out / LSE values are unspecified).
        * ``max_seqlen_q`` below a real query count: only the first ``max_seqlen_q`` queries of each
          sequence (rounded up to the q tile) are computed, with the sequence's real lengths (so the
          causal alignment is kept); its remaining rows are not written (unspecified values). With
          ``max_seqlen_q = 0`` nothing is written. ``max_seqlen_k`` below a real key count changes only the
          number of splits: every key is still attended.
        * ``kv_cache.seqlens[b]`` is clamped to ``[0, max_pages * page_size]``: a negative count is an empty
          sequence (output 0, LSE -inf); ``kv_cache.block_table`` entries are clamped to ``[0, num_pages - 1]``
          (a bad entry reads some page of the cache, never memory outside it). A bad ``seqlens[b]`` or
          ``block_table[b]`` changes only sequence b's result. A cache with no pages holds no keys.
        * In every layout no load or store leaves q, k, v, the pages, out or lse.

    Args:
        causal: bottom-right aligned: query i of Sq sees keys ``j <= i + Skv - Sq``.
        mask: None, :class:`SlidingWindow`, :class:`Chunked`, a ``@triton.jit`` ``mask_mod(b, h, q_idx,
            kv_idx) -> bool``, a materialized mask tensor, or a tuple of those (ANDed); see
            :mod:`llmkernels.attention.masks`. The tensor is SDPA's ``attn_mask``: bool (True: attend) or
            float32/float16/bfloat16 (natural-log bias added to the scaled score, after ``score_mod``),
            broadcastable to ``[B, Hq, Sq, Skv]`` (Skv: k's keys, or ``block_table.shape[1] * page_size``
            with a paged cache; key index j counts from the sequence's first key), any strides; read tile by
            tile (broadcast dims by stride 0, never expanded in memory). Dense q only.
        score_mod: None, :func:`softcap`, :func:`alibi` or a ``@triton.jit`` ``score_mod(score, b, h, q_idx,
            kv_idx) -> score`` applied to the scaled score.
        sinks: float32 ``[Hq]`` natural-log sink logits (not scaled): they join each row's softmax
            denominator only.
        softmax_scale: default ``1 / sqrt(D)``.
        num_splits: split the KV range of every (sequence, head) over this many programs (flash-decoding)
            and combine; any value >= 1 (more splits than KV tiles is clamped, results unchanged).
            None: split-KV with a GPU-filling heuristic when ``max_seqlen_q <= 16`` (decode), one pass otherwise.
        return_lse: also return the float32 natural-log LSE ``[B, Hq, Sq]`` (ragged: ``[Hq, total_q]``);
            it includes the sinks. Rows that see no key (and no sink) get output 0 and LSE -inf; a sink
            of +inf gives output 0 and LSE +inf, -inf is no sink, a NaN sink gives NaN.
        config: an :class:`FA4Config`; default :func:`default_config` for (D, dtype, GPU).
        validate: first read the metadata on the host (one device sync) and raise ``ValueError`` on the first
            bad entry: ``cu_seqlens_*[0] != 0``, a decreasing entry, an entry past q's / k's rows, a length
            above ``max_seqlen_q`` / ``max_seqlen_k``, ``kv_cache.seqlens`` negative or above ``max_pages *
            page_size`` (or ``max_seqlen_k``), a used ``kv_cache.block_table`` entry (the first
            ``ceil(seqlens[b] / page_size)`` of row b) outside ``[0, num_pages)``. Not capturable in a CUDA
            graph; under ``torch.compile`` the call stays on the Python path (no custom op).

    Every tensor argument may be any view (strided, expanded, offset, transposed): batch, token and head
    strides go to the kernels, other layouts are copied first; the result has the bits of the contiguous call.

    Returns:
        out in q's layout and dtype (contiguous), or ``(out, lse)``.

    Raises:
        TypeError: wrong dtypes (q not fp16/bf16, k/v/pages not q's dtype, cu_seqlens/seqlens/block_table not
            int32, sinks/alibi slopes not float32) or wrong argument types.
        ValueError: shape mismatches, Hq not a multiple of Hkv, unsupported head dim, cu_seqlens of the wrong
            length, block_table too small for max_seqlen_k, a sequence bound of 2**30 queries or keys or more,
            k/v given with kv_cache, config disagreeing with the inputs, tensors on different devices or on
            the CPU outside the Triton interpreter, an input that requires grad (forward-only); with
            ``validate=True`` bad metadata, the message naming the argument and its first bad index, e.g.
            ``"cu_seqlens_k[3] = 90 > total keys 64"`` or ``"kv_cache.block_table[0, 2] = 17 not in [0,
            num_pages=16)"``.
    """
    key, plan = _PLANS.lookup(q, k, v, causal, mask, score_mod, sinks, softmax_scale, cu_seqlens_q, cu_seqlens_k,
                              max_seqlen_q, max_seqlen_k, kv_cache, num_splits, return_lse, config, validate)
    if plan is None:
        call = check_attention(q, k, v, causal, mask, score_mod, sinks, softmax_scale, cu_seqlens_q, cu_seqlens_k,
                               max_seqlen_q, max_seqlen_k, kv_cache, num_splits, return_lse, config, validate)
        pages = (kv_cache.k_pages, kv_cache.v_pages) if kv_cache is not None else (k, v)
        plan = _PLANS.put(key, _Plan(call, q, *pages, sinks is not None, num_splits, return_lse, config))
    if validate:
        _validate_metadata_on_host(q, k, cu_seqlens_q, cu_seqlens_k if kv_cache is None else None,
                                   max_seqlen_q if cu_seqlens_q is not None else None, max_seqlen_k, kv_cache)
    return plan(q, k, v, kv_cache, cu_seqlens_q, cu_seqlens_k, sinks, score_mod, split_mask_tensor(mask)[1])


_PLANS = PlanCache("attention")


def _last_offset(t: torch.Tensor) -> int:
    """The largest element offset of a view from its first element (0 for an empty one)."""
    return sum((size - 1) * stride for size, stride in zip(t.shape, t.stride())) if t.numel() else 0


def _paged_metadata(kv_cache: PagedKVCache) -> tuple[torch.Tensor, torch.Tensor]:
    """(block table with unit stride along a row, contiguous seqlens) as both kernels read them (a copy of a few
    bytes when a view has other strides, no sync)."""
    block_table = kv_cache.block_table
    return (block_table if block_table.stride(1) == 1 else block_table.contiguous(), kv_cache.seqlens.contiguous())


def _strides3(t: torch.Tensor, ragged: bool) -> tuple[int, int, int]:
    """(batch, token, head) strides of a ``[B, S, H, D]`` tensor, or ``(0, token, head)`` of a ragged
    ``[total, H, D]`` one."""
    return (0, t.stride(0), t.stride(1)) if ragged else (t.stride(0), t.stride(1), t.stride(2))


def _runs_gluon(device: torch.device) -> bool:
    """Whether the Gluon kernels for Hopper can run on ``device``: an sm_90 GPU, not the interpreter."""
    return not interpreting() and cuda_capability(device) == (9, 0)


def _gluon_eligible(call: CheckedCall, config: FA4Config) -> bool:
    """What both Gluon paths ask of a call: a config with ``warp_specialized``, :func:`_runs_gluon`, and no key
    starts, chunked mask, mask_mod, mask tensor or score_mod."""
    spec = call.mask_spec
    return (config.warp_specialized and not call.kv_starts and not spec.has_chunk and spec.mask_mod is None
            and call.mask_kind == "none" and call.mod_spec.kind == SCORE_MOD_NONE and _runs_gluon(call.device))


def _gluon_hopper(call: CheckedCall, q, k, v, split: bool, has_sinks: bool, config: FA4Config):
    """The warp-specialized Gluon kernel module (``gluon_hopper``) when it runs this call, else None: a config
    with ``warp_specialized`` (sm_90's default), an sm_90 GPU (not the interpreter), dense or ragged q and k/v,
    or a paged cache without key starts (k, v: its pages), one pass, no mask but causal / a sliding window, no
    score_mod, sinks or mask tensor, and what :func:`gluon_hopper.supports` (``supports_ragged``,
    ``supports_paged``) asks of dtypes, head dim and strides."""
    if split or has_sinks or not _gluon_eligible(call, config):
        return None
    try:  # Gluon's Hopper modules (Triton >= 3.5); without them the portable kernel runs
        from . import gluon_hopper
    except ImportError:
        return None
    if call.paged:
        supported = gluon_hopper.supports_paged(q, k, v, call.softmax_scale, batch=call.batch,
                                                max_seqlen_q=call.q_bound)
    elif call.ragged:
        supported = gluon_hopper.supports_ragged(q, k, v, call.softmax_scale, call.batch, call.q_bound)
    else:
        supported = gluon_hopper.supports(q, k, v, call.softmax_scale)
    return gluon_hopper if supported else None


def _gluon_decode(call: CheckedCall, q, k, v, partials: bool, config: FA4Config):
    """The Gluon split-KV pass module (``gluon_decode``) when it runs this call's splits, else None: a config with
    ``warp_specialized`` (sm_90's default), an sm_90 GPU (not the interpreter), several splits, one query per
    sequence (dense q), no mask but a causal one (which that bottom-right query does not restrict), no score_mod
    or mask tensor, no key starts, and what :func:`gluon_decode.supports` asks (k, v: a paged cache's pages)."""
    spec = call.mask_spec
    whole = not spec.has_window or (spec.window_left >= call.kv_bound and spec.window_right >= 0)
    if not partials or call.ragged or call.q_bound != 1 or not whole or not _gluon_eligible(call, config):
        return None
    try:  # Gluon's Hopper modules (Triton >= 3.5); without them the portable kernel runs
        from . import gluon_decode
    except ImportError:
        return None
    supported = gluon_decode.supports(q, k, v, call.softmax_scale, paged=call.paged,
                                      num_head_programs=call.batch * call.num_kv_heads)
    return gluon_decode if supported else None


class _Plan:
    """Path (the Gluon kernel on Hopper, one pass, or split-KV + combine), config, tiles, grid and the bound
    kernels of one call signature. Holds no tensor: the kernels bind at the first run, on its tensors."""

    def __init__(self, call: CheckedCall, q, k, v, has_sinks: bool, num_splits, return_lse: bool, config):
        """k, v: the dense keys and values, or a paged cache's pages."""
        self.ragged, self.paged, self.device, self.has_sinks = call.ragged, call.paged, call.device, has_sinks
        self.mask_spec, self.mod_spec = call.mask_spec, dataclasses.replace(call.mod_spec, slopes=None)
        self.has_slopes = call.mod_spec.slopes is not None
        self.mask_kind, self.kv_starts = call.mask_kind, call.kv_starts
        self.softmax_scale, self.return_lse = call.softmax_scale, return_lse
        self.num_q_heads, self.num_kv_heads, self.head_dim = call.num_q_heads, call.num_kv_heads, call.head_dim
        self.q_shape, self.q_dtype = q.shape, q.dtype
        ragged, batch, q_bound, kv_bound, group = call.ragged, call.batch, call.q_bound, call.kv_bound, call.group
        self.q_bound = q_bound
        self.lse_shape = (call.num_q_heads, q.shape[0]) if ragged else (q.shape[0], call.num_q_heads, q.shape[1])
        self.empty = q.numel() == 0 or batch == 0 or q_bound == 0
        self.split = (num_splits is not None and num_splits > 1) or (
            num_splits is None and q_bound <= split_kv.MAX_DECODE_QUERIES)
        if config is None:
            config = default_config(call.head_dim, q.dtype, call.device, decode=self.split,
                                    num_q_heads=call.num_q_heads, num_kv_heads=call.num_kv_heads,
                                    visible_band=call.mask_spec.visible_band)
        self.gluon = _gluon_hopper(call, q, k, v, self.split, has_sinks, config)
        # which of q, k, v TMA cannot read in place (strides and 16-byte alignment are in the plan's key; a
        # paged cache, never copied, qualifies only when TMA reads it)
        self.gluon_copies = tuple(not self.gluon.tma_ready(t) for t in (q, k, v)) if self.gluon else ()
        spec = call.mask_spec
        self.window = (spec.window_left, spec.window_right) if spec.has_window else None
        self.config = config
        self.head_dim_pad = next_power_of_2(call.head_dim)
        if self.split:
            self.block_q, self.heads_per_tile = split_kv.decode_tiling(q_bound, group, config.pack_gqa_heads)
            self.num_q_tiles = 1
        else:
            self.block_q, self.heads_per_tile, self.num_q_tiles = config.MMA_M, 1, config.num_q_tiles
        num_q_blocks = cdiv(q_bound, self.block_q * self.num_q_tiles)
        self.num_head_programs = batch * call.num_kv_heads * cdiv(group, self.heads_per_tile)
        kv_tiles_bound = max(1, cdiv(kv_bound, config.BN))
        if self.split:
            if num_splits is None:
                num_splits = split_kv.choose_num_splits(num_q_blocks * self.num_head_programs, kv_tiles_bound,
                                                        num_programs_hint(call.device))
            self.num_splits = min(num_splits, kv_tiles_bound)  # extra splits would only see empty ranges
        else:
            self.num_splits = 1
        self.grid = (num_q_blocks * self.num_head_programs, self.num_splits)
        # One split (e.g. enough sequences x KV heads to fill the GPU): the decode tiles write O directly,
        # no partials and no combine launch. The in-launch merge of several splits was measured slower than
        # the combine kernel (lab/NOTES.md).
        self.partials = self.split and self.num_splits > 1
        # few sequences x KV heads: the Gluon split pass writes the partials (lab/NOTES.md)
        self.gluon_decode = _gluon_decode(call, q, k, v, self.partials, config)
        self.partial_shapes = None
        if self.partials:
            lse_partial_shape = (self.num_splits, call.num_q_heads, q.shape[0]) if ragged else (
                self.num_splits, q.shape[0], call.num_q_heads, q.shape[1])
            self.partial_shapes = ((self.num_splits, *q.shape), lse_partial_shape)
        # K and V through tensor descriptors (TMA on sm90+) where their layout allows it (seen at bind)
        self.tma_kv = (config.tma_kv and not call.paged and call.head_dim == self.head_dim_pad
                       and _tma_capable(call.device))
        self.forward = self.combine = self.decode_pass = None
        # one-element tensors for the pointers a compiled variant never reads (shared, never written)
        self.dummies = (_dummy(call.device, torch.int32), _dummy(call.device, torch.float32))

    def __call__(self, q, k, v, kv_cache, cu_seqlens_q, cu_seqlens_k, sinks, score_mod, attn_mask=None):
        device = self.device
        out = _empty(self.q_shape, self.q_dtype, device)
        lse = _empty(self.lse_shape, torch.float32, device) if self.return_lse else None
        if self.empty:
            return (out, lse) if self.return_lse else out
        if self.gluon is not None:
            paged = ragged = None
            if self.ragged:
                ragged = (cu_seqlens_q.contiguous(), None if self.paged else cu_seqlens_k.contiguous(), self.q_bound)
            if self.paged:
                k, v = kv_cache.k_pages, kv_cache.v_pages
                paged = _paged_metadata(kv_cache)
            if any(self.gluon_copies):  # the same values in a layout TMA reads: the contiguous call's bits
                q, k, v = (self.gluon.as_tma_ready(t) if copy else t for t, copy in zip((q, k, v), self.gluon_copies))
            with torch.cuda.device(device):
                self.gluon.launch(q, k, v, out, lse, self.window, float(self.softmax_scale),
                                  consumers=self.config.consumer_warpgroups, paged=paged, ragged=ragged)
            return (out, lse) if self.return_lse else out
        # Token / head / batch strides of q, k, v and the pages go to the kernel (zero ones included); a
        # head dim that is not unit-stride is copied. The kernel reads metadata vectors as dense: views of
        # other strides are copied (a few bytes, no sync).
        q = unit_last_stride(q)
        int_dummy, float_dummy = self.dummies
        if self.paged:
            k, v = unit_last_stride(kv_cache.k_pages), unit_last_stride(kv_cache.v_pages)
            block_table, seqlens = _paged_metadata(kv_cache)
            kv_starts = kv_cache.starts.contiguous() if self.kv_starts else int_dummy
        else:
            k, v = unit_last_stride(k), unit_last_stride(v)
            block_table = seqlens = kv_starts = int_dummy
        sinks = sinks.contiguous() if sinks is not None else float_dummy
        slopes = score_mod.slopes.contiguous() if self.has_slopes else float_dummy
        if attn_mask is not None:  # 4D, broadcast by strides (see _bind_forward); bool read as its bytes
            attn_mask = mask_tensor_4d(attn_mask.view(torch.uint8) if attn_mask.dtype == torch.bool else attn_mask)
        else:
            attn_mask = float_dummy
        if self.partials:
            o_partial = _empty(self.partial_shapes[0], torch.float32, device)
            lse_partial = _empty(self.partial_shapes[1], torch.float32, device)
            target_out, target_lse = o_partial, lse_partial
        else:
            target_out, target_lse = out, lse if lse is not None else float_dummy
        pointers = (q, k, v, target_out, target_lse,
                    cu_seqlens_q.contiguous() if self.ragged else int_dummy,
                    cu_seqlens_k.contiguous() if self.ragged and not self.paged else int_dummy,
                    seqlens, kv_starts, block_table, sinks, slopes, attn_mask, k, v)
        if self.gluon_decode is not None:
            if not self.paged:
                block_table = seqlens = lse_partial  # what the dense variant's unread pointers were bound to
            tensors = (q, k, v, o_partial, lse_partial, block_table, seqlens)
            (self.decode_pass or self._bind_decode_pass(tensors))(*tensors)
        else:
            (self.forward or self._bind_forward(pointers, out, lse))(*pointers)
        if self.partials:
            pointers = (o_partial, lse_partial, out, lse if lse is not None else float_dummy, sinks)
            (self.combine or self._bind_combine(pointers))(*pointers)
        return (out, lse) if self.return_lse else out

    def _bind_forward(self, pointers, out, lse) -> BoundKernel:
        q, k, v, target_out, target_lse, *_ = pointers
        ragged, paged, partials, config, mask_spec = self.ragged, self.paged, self.partials, self.config, self.mask_spec
        if paged:
            stride_k, stride_v = (k.stride(0), k.stride(1), k.stride(2)), (v.stride(0), v.stride(1), v.stride(2))
            block_table = pointers[9]
            stride_block_table, seqlen_k_dense, page_size = block_table.stride(0), 0, k.shape[1]
            num_pages = k.shape[0]
            paged_seqlen_bound = block_table.shape[1] * page_size if num_pages > 0 else 0  # no pages: no keys
        else:
            stride_k, stride_v = _strides3(k, ragged), _strides3(v, ragged)
            seqlen_k_dense = 0 if ragged else k.shape[1]
            stride_block_table, page_size, num_pages, paged_seqlen_bound = 0, 16, 0, 0
        attn_mask = pointers[12]  # [B|1, Hq|1, Sq|1, Skv|1]: a size-1 dim broadcasts with stride 0
        mask_strides = (0, 0, 0, 0)
        if self.mask_kind != "none":
            mask_strides = tuple(0 if size == 1 else stride
                                 for size, stride in zip(attn_mask.shape, attn_mask.stride()))
        descriptors = _kv_token_descriptors(k, v, ragged, config.BN) if self.tma_kv else None
        if descriptors is not None:
            pointers = (*pointers[:13], *descriptors)
        # out / lse strides as (b, token, head) and (b, head, token); ragged has no batch stride
        stride_o = _strides3(out, ragged)
        stride_lse = _strides3(lse, ragged) if lse is not None else (0, 0, 0)
        if partials:
            stride_target_o = _strides3(target_out[0], ragged)
            stride_target_lse = _strides3(target_lse[0], ragged)
            stride_o_split, stride_lse_split = target_out.stride(0), target_lse.stride(0)
        else:
            stride_target_o, stride_target_lse, stride_o_split, stride_lse_split = stride_o, stride_lse, 0, 0
        self.forward = bind(
            attention_fwd_kernel, self.grid, *pointers,
            *_strides3(q, ragged), *stride_k, *stride_v,
            *stride_target_o, stride_o_split,
            *stride_target_lse, stride_lse_split,
            stride_block_table, *mask_strides,
            0 if ragged else q.shape[1], seqlen_k_dense, q.shape[0], k.shape[0], num_pages, paged_seqlen_bound,
            self.num_kv_heads, self.num_q_heads // self.num_kv_heads, self.num_splits, self.num_head_programs,
            float(self.softmax_scale), mask_spec.window_left, mask_spec.window_right, mask_spec.chunk_size,
            float(self.mod_spec.cap),
            HEAD_DIM=self.head_dim, HEAD_DIM_PAD=self.head_dim_pad, BLOCK_Q=self.block_q,
            HEADS_PER_TILE=self.heads_per_tile, BLOCK_N=config.BN, NUM_Q_TILES=self.num_q_tiles,
            RAGGED_Q=ragged, RAGGED_K=ragged and not paged, PAGED=paged, PAGE_SIZE=page_size,
            HAS_WINDOW=mask_spec.has_window, HAS_CHUNK=mask_spec.has_chunk,
            HAS_MASK_MOD=mask_spec.mask_mod is not None, MASK_MOD=mask_spec.mask_mod,
            SCORE_MOD_KIND=self.mod_spec.kind, SCORE_MOD=self.mod_spec.fn,
            HAS_SINKS=self.has_sinks and not partials, SPLIT=partials,
            RETURN_LSE=self.return_lse and not partials,
            REVERSE_Q_BLOCKS=mask_spec.has_window and not self.split,
            RESCALE_THRESHOLD=config.rescale_threshold, POLY_EXP2_FRACTION=config.poly_exp2_fraction,
            TMA_KV=descriptors is not None,
            UPCAST=interpreting(), KV_STARTS=self.kv_starts, MASK_TENSOR=self.mask_kind,
            PAGE_OFFSETS_64=paged and max(_last_offset(k), _last_offset(v)) >= 2**31,
            num_warps=config.num_warps, num_stages=config.num_kv_stages,
        )
        return self.forward

    def _bind_decode_pass(self, tensors) -> BoundKernel:
        q, k, v, o_partial, lse_partial, block_table, seqlens = tensors
        self.decode_pass = self.gluon_decode.bind_launch(q, k, v, o_partial, lse_partial, float(self.softmax_scale),
                                                         paged=(block_table, seqlens) if self.paged else None)
        return self.decode_pass

    def _bind_combine(self, pointers) -> BoundKernel:
        o_partial, lse_partial, out, lse, sinks = pointers
        ragged = self.ragged
        rows_per_batch = out.shape[0] if ragged else out.shape[1]
        batches = 1 if ragged else out.shape[0]
        stride_lse = _strides3(lse, ragged) if self.return_lse else (0, 0, 0)
        self.combine = bind(
            split_kv.combine_splits_kernel, (batches * rows_per_batch, self.num_q_heads), *pointers,
            o_partial.stride(0), *_strides3(o_partial[0], ragged),
            lse_partial.stride(0), *_strides3(lse_partial[0], ragged),
            *_strides3(out, ragged), *stride_lse,
            rows_per_batch, self.num_splits,
            HEAD_DIM=self.head_dim, HEAD_DIM_PAD=self.head_dim_pad,
            # up to 64 splits in one block (one round trip to L2: H100, lab/NOTES.md)
            BLOCK_SPLITS=min(next_power_of_2(self.num_splits), 64),
            HAS_SINKS=self.has_sinks, RETURN_LSE=self.return_lse, ONE_BLOCK=self.num_splits <= 64,
            num_warps=4,
        )
        return self.combine
