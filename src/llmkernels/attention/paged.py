"""PagedKVCache: K/V in fixed-size pages found through a per-sequence block table (vLLM layout)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..launch import tensor_key

__all__ = ["PagedKVCache", "SUPPORTED_PAGE_SIZES"]

SUPPORTED_PAGE_SIZES = (16, 32, 64, 128, 256)


@dataclass(frozen=True)
class PagedKVCache:
    """A paged KV cache.

    Args:
        k_pages: fp16/bf16 or float8_e4m3fn ``[num_pages, page_size, Hkv, D]``; page_size a power of two in [16, 256].
            FP8 pages are read with ``attention``'s ``k_descale`` / ``v_descale`` (FA3's ``[B, Hkv]``; vLLM's
            per-tensor ``k_scale`` / ``v_scale`` are the ``[1, 1]`` case).
        v_pages: same shape, dtype and device as ``k_pages``.
        block_table: int32 ``[B, max_pages]``: ``block_table[b, i]`` is the page holding keys
            ``i * page_size ... (i + 1) * page_size - 1`` of sequence b (pages in any order).
            Entries past a sequence's last page are never read.
        seqlens: int32 ``[B]``: keys of sequence b in the cache, the new tokens included (with ``starts``: the
            end position, one past its last key).
        starts: optional int32 ``[B]``: sequence b's keys are cache positions ``starts[b] .. seqlens[b] - 1``
            (flash-attn's ``cache_leftpad``); default: from position 0. Positions count from the start of the
            sequence's first page; key indices (causal alignment, windows, score mods) from ``starts[b]``.

    Every tensor may be any view (strided, expanded, offset; pages whose head dim is not unit-stride are
    copied by :func:`attention`). The tensors are checked for shape, dtype and device here; their contents (page indices in range,
    ``0 <= seqlens[b] <= max_pages * page_size``) are the caller's contract and are not read on the host
    (``attention(..., validate=True)`` checks them, with one sync). The kernels never trust them with an
    address: ``seqlens[b]`` is read clamped to ``[0, max_pages * page_size]`` (negative: no keys, a fully
    masked row with output 0 and LSE -inf), ``starts[b]`` clamped to ``[0, seqlens[b]]`` and a block-table entry
    clamped to ``[0, num_pages - 1]``, so a
    bad entry reads the wrong page of this cache but never memory outside ``k_pages`` / ``v_pages``.

    Raises:
        TypeError: a field is not a tensor, or has the wrong dtype.
        ValueError: shapes disagree, page size unsupported, tensors on different devices.
    """

    k_pages: torch.Tensor
    v_pages: torch.Tensor
    block_table: torch.Tensor
    seqlens: torch.Tensor
    starts: torch.Tensor | None = None

    def __post_init__(self):
        for name in ("k_pages", "v_pages", "block_table", "seqlens"):
            if not isinstance(getattr(self, name), torch.Tensor):
                raise TypeError(f"PagedKVCache.{name} must be a torch.Tensor, got {type(getattr(self, name)).__name__}")
        k_pages, v_pages = self.k_pages, self.v_pages
        if k_pages.dtype not in (torch.float16, torch.bfloat16, torch.float8_e4m3fn):
            raise TypeError(f"PagedKVCache.k_pages must be float16, bfloat16 or float8_e4m3fn, got {k_pages.dtype}")
        if v_pages.dtype != k_pages.dtype:
            raise TypeError(f"PagedKVCache.v_pages dtype {v_pages.dtype} != k_pages dtype {k_pages.dtype}")
        if k_pages.dim() != 4:
            raise ValueError(f"PagedKVCache.k_pages must be [num_pages, page_size, Hkv, D], got {tuple(k_pages.shape)}")
        if v_pages.shape != k_pages.shape:
            raise ValueError(
                f"PagedKVCache.v_pages shape {tuple(v_pages.shape)} != k_pages shape {tuple(k_pages.shape)}"
            )
        if k_pages.shape[1] not in SUPPORTED_PAGE_SIZES:
            raise ValueError(
                f"PagedKVCache page_size (k_pages.shape[1]) must be one of {SUPPORTED_PAGE_SIZES}, "
                f"got {k_pages.shape[1]}"
            )
        if self.block_table.dtype != torch.int32 or self.block_table.dim() != 2:
            raise TypeError(
                f"PagedKVCache.block_table must be int32 [B, max_pages], got {self.block_table.dtype} "
                f"{tuple(self.block_table.shape)}"
            )
        if self.seqlens.dtype != torch.int32 or self.seqlens.dim() != 1:
            raise TypeError(
                f"PagedKVCache.seqlens must be int32 [B], got {self.seqlens.dtype} {tuple(self.seqlens.shape)}"
            )
        if self.starts is not None and (
            not isinstance(self.starts, torch.Tensor)
            or self.starts.dtype != torch.int32
            or tuple(self.starts.shape) != tuple(self.seqlens.shape)
        ):
            raise TypeError(
                f"PagedKVCache.starts must be None or int32 [B] like seqlens, got "
                f"{getattr(self.starts, 'dtype', type(self.starts).__name__)} "
                f"{tuple(getattr(self.starts, 'shape', ()))}"
            )
        if self.seqlens.shape[0] != self.block_table.shape[0]:
            raise ValueError(
                f"PagedKVCache.seqlens has {self.seqlens.shape[0]} entries but block_table has "
                f"{self.block_table.shape[0]} rows"
            )
        devices = {t.device for t in (k_pages, v_pages, self.block_table, self.seqlens, self.starts) if t is not None}
        if len(devices) != 1:
            raise ValueError(f"PagedKVCache tensors must share one device, got {sorted(map(str, devices))}")

    def plan_key(self) -> tuple:
        """What a plan depends on (:func:`llmkernels.launch.value_key`): the tensors' signatures."""
        key = ("PagedKVCache", *map(tensor_key, (self.k_pages, self.v_pages, self.block_table, self.seqlens)))
        return key if self.starts is None else (*key, tensor_key(self.starts))

    @property
    def page_size(self) -> int:
        return self.k_pages.shape[1]

    @property
    def num_kv_heads(self) -> int:
        return self.k_pages.shape[2]

    @property
    def head_dim(self) -> int:
        return self.k_pages.shape[3]

    @property
    def num_pages(self) -> int:
        return self.k_pages.shape[0]

    @property
    def batch_size(self) -> int:
        return self.block_table.shape[0]

    @property
    def max_seqlen_bound(self) -> int:
        """Most keys any sequence can hold: ``block_table.shape[1] * page_size`` (host-known, no sync)."""
        return self.block_table.shape[1] * self.page_size

    @property
    def dtype(self) -> torch.dtype:
        return self.k_pages.dtype

    @property
    def device(self) -> torch.device:
        return self.k_pages.device
