"""attention(): the public call, thin: its checks once per call signature (:mod:`.check`), the plan of that
signature (:mod:`.plan`: backends, tiling, bound launches), the launches."""

from __future__ import annotations

import torch

from .check import CheckedCall, check_attention, check_metadata_values
from .config import FA4Config
from .masks import SlidingWindow, split_mask_tensor
from .paged import PagedKVCache
from .plan import PLANS, Plan, plan_key

__all__ = ["attention", "check_attention", "CheckedCall"]


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
    q_descale: torch.Tensor | None = None,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
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

    FP8 (FlashAttention-3's convention): k and v (dense, ragged or the pages of a :class:`PagedKVCache`) may be
    ``float8_e4m3fn`` with a bf16/fp16 q, or q, k and v all ``float8_e4m3fn`` (output bfloat16). ``q_descale``,
    ``k_descale``, ``v_descale``: float32 ``[B, Hkv]`` (``[1, 1]``, ``[B, 1]`` and ``[1, Hkv]`` broadcast; None
    is 1.0; any strides) multiply the stored values: the result is ``attention(q * q_descale, k * k_descale, v *
    v_descale)`` per (sequence, KV head), q head h taking its KV head's ``q_descale``. vLLM's per-tensor
    ``k_scale`` / ``v_scale`` are the ``[1, 1]`` case. The kernel converts the e4m3 tiles to the compute dtype
    (q's, bf16 for an fp8 q) in registers and folds ``q_descale * k_descale`` into the softmax scale and
    ``v_descale`` into the output (scores are linear in k, O in v): one load of each factor per program, no
    host sync (capturable in a CUDA graph). FP8 calls run the portable Triton kernel (the Gluon kernels do not
    read FP8 yet).

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
            ``ceil(seqlens[b] / page_size)`` of row b) outside ``[0, num_pages)``, a descale that is not a
            finite factor > 0 (unchecked without ``validate``: the FP8 kernels need them positive). Not
            capturable in a CUDA graph; under ``torch.compile`` the call stays on the Python path (no custom op).

    Every tensor argument may be any view (strided, expanded, offset, transposed): batch, token and head
    strides go to the kernels, other layouts are copied first; the result has the bits of the contiguous call.

    Returns:
        out in q's layout and dtype (bfloat16 for an fp8 q; contiguous), or ``(out, lse)``.

    Raises:
        TypeError: wrong dtypes (q not fp16/bf16/float8_e4m3fn, k/v/pages neither q's dtype nor float8_e4m3fn, an fp8
            q with non-fp8 k/v, k and v of different dtypes, cu_seqlens/seqlens/block_table not int32, sinks/alibi
            slopes/descales not float32) or wrong argument types.
        ValueError: shape mismatches (a descale not broadcastable to ``[B, Hkv]``), a descale given for a tensor
            that is not float8_e4m3fn, Hq not a multiple of Hkv, unsupported head dim, cu_seqlens of the wrong
            length, block_table too small for max_seqlen_k, a sequence bound of 2**30 queries or keys or more,
            k/v given with kv_cache, config disagreeing with the inputs, tensors on different devices or on
            the CPU outside the Triton interpreter, an input that requires grad (forward-only); with
            ``validate=True`` bad metadata, the message naming the argument and its first bad index, e.g.
            ``"cu_seqlens_k[3] = 90 > total keys 64"`` or ``"kv_cache.block_table[0, 2] = 17 not in [0,
            num_pages=16)"``.
    """
    key = plan_key(
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
        q_descale,
        k_descale,
        v_descale,
    )
    plan = PLANS.get(key)
    if plan is None:
        call = check_attention(
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
            q_descale,
            k_descale,
            v_descale,
        )
        plan = PLANS.put(key, Plan(call, config, tuple(q.shape)))
    if validate:
        check_metadata_values(
            q,
            k,
            cu_seqlens_q,
            cu_seqlens_k if kv_cache is None else None,
            max_seqlen_q if cu_seqlens_q is not None else None,
            max_seqlen_k,
            kv_cache,
            (q_descale, k_descale, v_descale),
        )
    if mask is not None and type(mask) is not SlidingWindow:
        mask = split_mask_tensor(mask)[1]
    else:
        mask = None
    descales = (q_descale, k_descale, v_descale)
    return plan(q, k, v, kv_cache, cu_seqlens_q, cu_seqlens_k, sinks, score_mod, mask, descales)


def _empty(shape, dtype, device) -> torch.Tensor:
    """Unused: plans allocate through :func:`llmkernels.runtime.new_buffer` (what tests replace to poison
    buffers); kept while a caller still patches this name."""
    return torch.empty(shape, dtype=dtype, device=device)
