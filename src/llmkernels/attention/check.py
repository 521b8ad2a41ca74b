"""check_attention: every check of an attention call that needs no device sync, once per plan; and the checks of
metadata values (``validate=True``, one sync). What the checks found is a :class:`CheckedCall`."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..runtime import check_device, cuda_capability, first_bad_prefix_sum, first_true, forward_only
from . import layout
from .config import SUPPORTED_HEAD_DIMS, FA4Config
from .masks import (
    MASK_TENSOR_DTYPES,
    SCORE_MOD_ALIBI,
    UNBOUNDED,
    MaskSpec,
    ScoreModSpec,
    mask_tensor_4d,
    mask_tensor_kind,
    resolve_mask,
    resolve_score_mod,
    split_mask_tensor,
)
from .paged import PagedKVCache

__all__ = ["CheckedCall", "check_attention", "check_metadata_values", "check_fp8_capability"]

_DTYPES = (torch.float16, torch.bfloat16)
FP8 = torch.float8_e4m3fn  # FP8 attention's storage dtype (FA3's e4m3 K/V and q)
DESCALE_NAMES = ("q_descale", "k_descale", "v_descale")


def _check_fp8(q, k_dtype, v_dtype, k_name: str, v_name: str) -> tuple[bool, bool]:
    """The dtype rules of FP8 attention: q fp16/bf16 with k, v in q's dtype or both float8_e4m3fn; or q, k, v all
    float8_e4m3fn. Returns ``(fp8_q, fp8_kv)``."""
    fp8_q = q.dtype == FP8
    if k_dtype != FP8 and (fp8_q or k_dtype != q.dtype):
        rule = "with a float8_e4m3fn q, k and v must be float8_e4m3fn" if fp8_q else "or float8_e4m3fn"
        raise TypeError(f"{k_name} dtype {k_dtype} != q dtype {q.dtype} ({rule})")
    if v_dtype != k_dtype:
        raise TypeError(f"{v_name} dtype {v_dtype} != {k_name} dtype {k_dtype} (k and v share one dtype)")
    fp8_kv = k_dtype == FP8
    return fp8_q, fp8_kv


def check_fp8_capability(name: str, device: torch.device) -> None:
    """float8_e4m3fn tensors on a GPU before sm_89 (Ampere): Triton has no e4m3 conversion there. Raises
    ``ValueError`` naming ``name``."""
    capability = cuda_capability(device)
    if capability is not None and capability < (8, 9):
        raise ValueError(
            f"{name} is float8_e4m3fn on an sm_{capability[0]}{capability[1]} GPU: FP8 attention needs sm_89 or newer"
        )


def _check_descales(descales, fp8: tuple, batch: int, num_kv_heads: int) -> None:
    """FA3's descales: float32 ``[B, Hkv]``, each dim 1 (broadcast) or full; only for a float8_e4m3fn tensor."""
    for name, descale, is_fp8 in zip(DESCALE_NAMES, descales, fp8):
        if descale is None:
            continue
        tensor = name[0]
        if not is_fp8:
            raise ValueError(f"{name} given but {tensor} is not float8_e4m3fn (descales scale FP8 inputs only)")
        if not isinstance(descale, torch.Tensor) or descale.dtype != torch.float32:
            raise TypeError(f"{name} must be a float32 tensor [B, Hkv], got {_dtype_name(descale)}")
        if descale.dim() != 2 or any(size not in (1, want) for size, want in zip(descale.shape, (batch, num_kv_heads))):
            raise ValueError(
                f"{name} must be [B, Hkv] = [{batch}, {num_kv_heads}] (or [1, 1], [B, 1], [1, Hkv]), "
                f"got shape {tuple(descale.shape)}"
            )


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


def _check_cu_seqlens_values(
    name: str, cu_seqlens: torch.Tensor, total: int, rows: str, max_seqlen: int | None, max_name: str
) -> None:
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


def _check_paged_values(
    seqlens: torch.Tensor, block_table: torch.Tensor, num_pages: int, page_size: int, max_seqlen_k: int | None
) -> None:
    """Key counts in ``[0, max_pages * page_size]`` (and ``<= max_seqlen_k``); the pages each sequence
    uses (the first ``ceil(seqlens[b] / page_size)`` of its row) in ``[0, num_pages)``."""
    bound = block_table.shape[1] * page_size
    limit = bound if max_seqlen_k is None else min(bound, max_seqlen_k)
    first = first_true((seqlens < 0) | (seqlens > limit))
    if first is not None:
        b = first[0]
        value = int(seqlens[b])
        what = (
            "< 0"
            if value < 0
            else f"> max_pages * page_size = {bound}"
            if value > bound
            else (f"> max_seqlen_k = {max_seqlen_k}")
        )
        raise ValueError(f"kv_cache.seqlens[{b}] = {value} {what}")
    pages_used = (seqlens + page_size - 1) // page_size
    used = torch.arange(block_table.shape[1])[None, :] < pages_used[:, None]
    first = first_true(used & ((block_table < 0) | (block_table >= num_pages)))
    if first is not None:
        b, i = first
        raise ValueError(f"kv_cache.block_table[{b}, {i}] = {int(block_table[b, i])} not in [0, num_pages={num_pages})")


def check_metadata_values(
    q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, kv_cache, descales=(None, None, None)
) -> None:
    """The checks that need the metadata's values (one device sync); only with ``validate=True``. Raises
    ValueError naming the argument and its first bad entry."""
    for name, descale in zip(("q_descale", "k_descale", "v_descale"), descales):
        if descale is not None:  # the FP8 kernels take the softmax max on raw scores: factors must be positive
            values = descale.detach().float().cpu()
            first = first_true(~(values > 0) | ~torch.isfinite(values))
            if first is not None:
                raise ValueError(f"{name}{list(first)} = {values[first].item()} must be a finite factor > 0")
    paged = kv_cache is not None
    cu_q, cu_k, seqlens, block_table, starts = _to_host(
        cu_seqlens_q,
        cu_seqlens_k,
        kv_cache.seqlens if paged else None,
        kv_cache.block_table if paged else None,
        kv_cache.starts if paged else None,
    )
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
                raise ValueError(
                    f"kv_cache.starts[{b}] = {int(starts[b])} not in [0, seqlens[{b}] = {int(seqlens[b])}]"
                )


@dataclass(frozen=True)
class CheckedCall:
    """What :func:`check_attention` found: the layout, sizes, host-known bounds, mask and score modifier, and the
    layout facts the backends ask about (:mod:`llmkernels.attention.layout`). Everything a plan and a
    backend's :class:`~llmkernels.launch.KernelSpec` depend on; the tools build one by hand to compile a call
    without a GPU."""

    ragged: bool
    paged: bool
    batch: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    group: int
    q_bound: int  # most queries of one sequence (host-known)
    kv_bound: int  # most keys of one sequence (host-known; dense K/V: Skv, which a plan takes per call)
    mask_spec: MaskSpec
    mod_spec: ScoreModSpec
    softmax_scale: float
    device: torch.device
    mask_kind: str = "none"  # the materialized mask: "none", "bool" or "additive"
    kv_starts: bool = False  # the paged cache has per-sequence key starts
    dtype: torch.dtype = torch.bfloat16
    q_rows: int = 0  # rows of q along its token dim: Sq (dense) or total_q (ragged)
    kv_rows: int = 0  # rows of k along its token dim: Skv (dense) or total_k (ragged); pages: num_pages
    page_size: int = 0  # keys per page of a paged cache (0: not paged)
    has_sinks: bool = False
    return_lse: bool = False
    num_splits: int | None = None  # as asked for (None: the heuristic's)
    kv_token_rows: bool = False  # dense or ragged K and V are token rows of Hkv * D (layout.kv_token_rows)
    tma_ready: tuple = (False, False, False)  # TMA reads q, k, v (or the pages) in place (layout.tma_ready)
    page_offsets_64: bool = False  # some element offset of the pages needs more than 31 bits (layout.read_extent)
    fp8_q: bool = False  # q is float8_e4m3fn (dtype is then bfloat16: the compute and output dtype)
    fp8_kv: bool = False  # k and v (or the pages) are float8_e4m3fn
    descales: tuple = (False, False, False)  # q_descale, k_descale, v_descale given

    @property
    def fp8(self) -> bool:
        """Some input is float8_e4m3fn: only backends that read FP8 take the call (:mod:`.plan`)."""
        return self.fp8_q or self.fp8_kv

    @property
    def dynamic_kv(self) -> bool:
        """Dense K/V without a mask tensor: the plan key holds what Triton specializes Skv and the K/V strides on,
        not their values (a cache growing by a token per call keeps its plan), and the launches take them per
        call."""
        return not self.ragged and not self.paged and self.mask_kind == "none"


def check_attention(
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
) -> CheckedCall:
    """The checks of :func:`attention` that need no sync (no launch; safe while torch.compile traces)."""
    if not isinstance(q, torch.Tensor) or (q.dtype not in _DTYPES and q.dtype != FP8):
        raise TypeError(f"q must be a float16, bfloat16 or float8_e4m3fn tensor, got {_dtype_name(q)}")
    ragged = cu_seqlens_q is not None
    paged = kv_cache is not None
    if ragged and q.dim() != 3:
        raise ValueError(f"q must be [total_q, Hq, D] with cu_seqlens_q, got shape {tuple(q.shape)}")
    if not ragged and q.dim() != 4:
        raise ValueError(
            f"q must be [B, Sq, Hq, D] (or ragged [total_q, Hq, D] with cu_seqlens_q), got shape {tuple(q.shape)}"
        )
    if ragged:
        _check_cu_seqlens("cu_seqlens_q", cu_seqlens_q)
    if paged:
        if not isinstance(kv_cache, PagedKVCache):
            raise TypeError(f"kv_cache must be a PagedKVCache, got {type(kv_cache).__name__}")
        if k is not None or v is not None:
            raise ValueError("with kv_cache, pass k = v = None (the keys and values live in the cache)")
        if cu_seqlens_k is not None:
            raise ValueError("cu_seqlens_k must be None with kv_cache (kv_cache.seqlens gives the key counts)")
        fp8_q, fp8_kv = _check_fp8(
            q, kv_cache.k_pages.dtype, kv_cache.v_pages.dtype, "kv_cache.k_pages", "kv_cache.v_pages"
        )
        batch = kv_cache.batch_size
        if ragged and cu_seqlens_q.shape[0] != batch + 1:
            raise ValueError(
                f"cu_seqlens_q must have {batch + 1} entries (kv_cache.block_table has {batch} rows), "
                f"got {cu_seqlens_q.shape[0]}"
            )
        if not ragged and q.shape[0] != batch:
            raise ValueError(f"q has batch {q.shape[0]} but kv_cache.block_table has {batch} rows")
        num_kv_heads, head_dim_k = kv_cache.num_kv_heads, kv_cache.head_dim
        kv_bound = kv_cache.max_seqlen_bound
        _check_optional_int("max_seqlen_k", max_seqlen_k, 0)
        if max_seqlen_k is not None:
            if max_seqlen_k > kv_bound:
                raise ValueError(
                    f"block_table too small for max_seqlen_k={max_seqlen_k}: "
                    f"{kv_cache.block_table.shape[1]} pages x {kv_cache.page_size} = {kv_bound} keys"
                )
            kv_bound = max_seqlen_k
    else:
        for name, tensor in (("k", k), ("v", v)):
            if not isinstance(tensor, torch.Tensor):
                raise TypeError(f"{name} must be a tensor (or None with kv_cache), got {type(tensor).__name__}")
        fp8_q, fp8_kv = _check_fp8(q, k.dtype, v.dtype, "k", "v")
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
    descales = (q_descale, k_descale, v_descale)
    _check_descales(descales, (fp8_q, fp8_kv, fp8_kv), batch, num_kv_heads)
    _check_optional_int("max_seqlen_q", max_seqlen_q, 0)
    q_bound = (q.shape[0] if max_seqlen_q is None else min(max_seqlen_q, q.shape[0])) if ragged else q.shape[1]
    for name, bound in (("queries", q_bound), ("keys", kv_bound)):
        if bound >= UNBOUNDED:  # positions and window bounds are int32 in the kernel
            raise ValueError(
                f"a sequence may hold up to {UNBOUNDED - 1} {name}, got a bound of {bound} "
                f"(ragged inputs: pass max_seqlen_q / max_seqlen_k)"
            )
    _check_optional_int("num_splits", num_splits, 1)
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse must be a bool, got {type(return_lse).__name__}")
    if not isinstance(validate, bool):
        raise TypeError(f"validate must be a bool, got {type(validate).__name__}")
    mask, attn_mask = split_mask_tensor(mask)
    mask_spec = resolve_mask(causal, mask)
    if attn_mask is not None:
        _check_mask_tensor(
            attn_mask,
            ragged,
            batch,
            num_q_heads,
            q_bound,
            kv_cache.max_seqlen_bound if paged else (k.shape[1] if not ragged else None),
        )
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
    elif (
        isinstance(softmax_scale, bool)
        or not isinstance(softmax_scale, (int, float))
        or (
            # traced by torch.compile, its value is unknown while tracing: the op checks it when it runs
            not torch.compiler.is_compiling() and not math.isfinite(softmax_scale)
        )
    ):
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
        q=q,
        k=k,
        v=v,
        cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_k=cu_seqlens_k,
        sinks=sinks,
        alibi_slopes=mod_spec.slopes,
        mask=attn_mask,
        k_pages=kv_cache.k_pages if paged else None,
        block_table=kv_cache.block_table if paged else None,
        seqlens=kv_cache.seqlens if paged else None,
        q_descale=q_descale,
        k_descale=k_descale,
        v_descale=v_descale,
    )
    if fp8_q or fp8_kv:
        check_fp8_capability("q" if fp8_q else ("kv_cache.k_pages" if paged else "k"), device)
    forward_only(
        "attention",
        q=q,
        k=k,
        v=v,
        sinks=sinks,
        alibi_slopes=mod_spec.slopes,
        mask=attn_mask,
        k_pages=kv_cache.k_pages if paged else None,
        v_pages=kv_cache.v_pages if paged else None,
        q_descale=q_descale,
        k_descale=k_descale,
        v_descale=v_descale,
    )

    pages = (kv_cache.k_pages, kv_cache.v_pages) if paged else (k, v)
    kv_rows, page_size = (kv_cache.num_pages, kv_cache.page_size) if paged else (k.shape[0 if ragged else 1], 0)
    token_rows, page_offsets_64, readable = False, False, (False, False, False)
    if not torch.compiler.is_compiling():  # traced tensors have no address: a plan is made when the op runs
        readable = tuple(map(layout.tma_ready, (q, *pages)))
        if paged:
            page_offsets_64 = max(map(layout.read_extent, pages)) >= 2**31
        else:
            token_rows = layout.kv_token_rows(k, v, ragged)
    return CheckedCall(
        ragged,
        paged,
        batch,
        num_q_heads,
        num_kv_heads,
        head_dim,
        group,
        q_bound,
        kv_bound,
        mask_spec,
        mod_spec,
        softmax_scale,
        device,
        mask_tensor_kind(attn_mask),
        paged and kv_cache.starts is not None,
        torch.bfloat16 if fp8_q else q.dtype,
        q.shape[0 if ragged else 1],
        kv_rows,
        page_size,
        sinks is not None,
        return_lse,
        num_splits,
        token_rows,
        readable,
        page_offsets_64,
        fp8_q,
        fp8_kv,
        tuple(descale is not None for descale in descales),
    )


def _check_mask_tensor(attn_mask, ragged: bool, batch: int, num_q_heads: int, seqlen_q: int, seqlen_k) -> None:
    """A materialized mask broadcastable to ``[B, Hq, Sq, Skv]`` (Skv: k's keys, or the block table's width)."""
    if attn_mask.dtype not in MASK_TENSOR_DTYPES:
        raise TypeError(f"mask tensor must be bool or float32/float16/bfloat16, got {attn_mask.dtype}")
    if ragged:
        raise ValueError("a mask tensor needs dense q [B, Sq, Hq, D] (ragged q: not supported)")
    full = (batch, num_q_heads, seqlen_q, seqlen_k)
    if attn_mask.dim() > 4 or any(size not in (1, want) for size, want in zip(mask_tensor_4d(attn_mask).shape, full)):
        raise ValueError(
            f"mask tensor of shape {tuple(attn_mask.shape)} does not broadcast to [B, Hq, Sq, Skv] = {list(full)}"
        )
