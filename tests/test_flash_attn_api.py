"""``llmkernels.flash_attn``: flash-attn 2.8's API over our attention. The plain and varlen calls must give the bits of
the equivalent ``lk.attention`` call; ``flash_attn_with_kvcache`` (append in place, rotary, cache_batch_idx, dense
and paged caches) is checked against a float64 model of flash-attn's documented behaviour (``flash_attn_model.py``),
the cache after the append bit for bit."""

import math

import pytest
import torch
from flash_attn_model import assert_cache_after, flash_attn_model, kvcache_model

import llmkernels as lk
from llmkernels.flash_attn import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache
from llmkernels.testing import assert_close_relative

TOLERANCE = 2e-2  # bf16 inputs, float64 reference, relative error over the whole output


def _randn(*shape, device, dtype=torch.bfloat16):
    return torch.randn(*shape, device=device).to(dtype)


@pytest.mark.parametrize("case", ["plain", "causal", "window", "softcap", "alibi", "sink", "chunk"])
def test_func_is_attention(case, device):
    q, k, v = (
        _randn(2, 9, 4, 32, device=device),
        _randn(2, 13, 2, 32, device=device),
        _randn(2, 13, 2, 32, device=device),
    )
    kwargs, ours = {}, {}
    if case == "causal":
        kwargs, ours = dict(causal=True), dict(causal=True)
    elif case == "window":
        kwargs, ours = dict(causal=True, window_size=(3, 0)), dict(causal=True, mask=lk.SlidingWindow(3, 0))
    elif case == "softcap":
        kwargs, ours = dict(softcap=2.0), dict(score_mod=lk.softcap(2.0))
    elif case == "alibi":
        slopes = torch.rand(4, device=device)
        kwargs, ours = dict(alibi_slopes=slopes), dict(score_mod=lk.alibi(slopes))
    elif case == "sink":
        sinks = torch.randn(4, device=device)
        kwargs, ours = dict(learnable_sink=sinks.bfloat16()), dict(sinks=sinks.bfloat16().float())
    elif case == "chunk":
        kwargs, ours = dict(attention_chunk=4), dict(mask=lk.Chunked(4))
    out = flash_attn_func(q, k, v, **kwargs)
    assert torch.equal(out, lk.attention(q, k, v, **ours))
    out2, lse, probs = flash_attn_func(q, k, v, return_attn_probs=True, **kwargs)
    expected_out, expected_lse = lk.attention(q, k, v, return_lse=True, **ours)
    assert probs is None and lse.shape == (2, 4, 9) and lse.dtype == torch.float32
    assert torch.equal(out2, expected_out) and torch.equal(lse, expected_lse)


def _ragged(lengths, heads, device):
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    return _randn(int(cu[-1]), heads, 32, device=device), cu


def test_varlen_is_ragged_attention(device):
    q, cu_q = _ragged([3, 0, 8], 4, device)
    k, cu_k = _ragged([5, 4, 8], 2, device)
    v = _randn(*k.shape, device=device)
    out, lse, probs = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 8, 8, causal=True, return_attn_probs=True)
    expected, expected_lse = lk.attention(
        q, k, v, causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=8, max_seqlen_k=8, return_lse=True
    )
    assert probs is None and lse.shape == (4, q.shape[0])
    assert torch.equal(out, expected) and torch.equal(lse, expected_lse)


@pytest.mark.parametrize("total_k", [48, 45], ids=["pages_view", "padded_copy"])
def test_varlen_seqused_k(total_k, device):
    """FA3's seqused_k on ragged K: sequence b attends rows cu_seqlens_k[b] .. + seqused_k[b] only."""
    q, cu_q = _ragged([3, 2, 4], 4, device)
    k, v = _randn(total_k, 2, 32, device=device), _randn(total_k, 2, 32, device=device)
    cu_k = torch.tensor([0, 20, 20, total_k], dtype=torch.int32, device=device)
    used = [17, 0, total_k - 25]
    seqused = torch.tensor(used, dtype=torch.int32, device=device)
    out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 4, total_k, causal=True, seqused_k=seqused)
    kept = torch.cat([k[int(cu_k[b]) : int(cu_k[b]) + n] for b, n in enumerate(used)])
    kept_v = torch.cat([v[int(cu_k[b]) : int(cu_k[b]) + n] for b, n in enumerate(used)])
    cu_kept = torch.tensor([0, *torch.tensor(used).cumsum(0).tolist()], dtype=torch.int32, device=device)
    expected = flash_attn_varlen_func(q, kept, kept_v, cu_q, cu_kept, 4, total_k, causal=True)
    assert_close_relative(out.float(), expected.float(), 1e-2)


@pytest.mark.parametrize("table", ["block_table", "page_table"])
def test_varlen_over_pages_equals_ragged(table, device):
    """K / V as shuffled pages with block_table (or FA3's page_table): the ragged result, seqused_k included."""
    page, lengths = 16, [20, 0, 33]
    q, cu_q = _ragged([2, 1, 5], 4, device)
    k, cu_k = _ragged(lengths, 2, device)
    v = _randn(*k.shape, device=device)
    pages_per_seq = 3
    order = torch.randperm(len(lengths) * pages_per_seq, device=device).int()
    block_table = order.view(len(lengths), pages_per_seq)
    k_pages = torch.zeros(len(order), page, 2, 32, dtype=k.dtype, device=device)
    v_pages = torch.zeros_like(k_pages)
    for b, length in enumerate(lengths):
        for j in range(length):
            page_id = int(block_table[b, j // page])
            k_pages[page_id, j % page] = k[int(cu_k[b]) + j]
            v_pages[page_id, j % page] = v[int(cu_k[b]) + j]
    expected = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 5, 33, causal=True)
    out = flash_attn_varlen_func(q, k_pages, v_pages, cu_q, cu_k, 5, 33, causal=True, **{table: block_table})
    assert_close_relative(out.float(), expected.float(), 1e-2)
    seqused = torch.tensor(lengths, dtype=torch.int32, device=device)
    bogus_cu_k = torch.zeros_like(cu_k)  # seqused_k wins over cu_seqlens_k's differences
    out = flash_attn_varlen_func(
        q, k_pages, v_pages, cu_q, bogus_cu_k, 5, 33, causal=True, seqused_k=seqused, **{table: block_table}
    )
    assert_close_relative(out.float(), expected.float(), 1e-2)


def _attend(q, k, v, lengths, causal, window, starts=None):
    """float64 attention of q ``[B, Sq, Hq, D]`` over keys ``starts[b] .. lengths[b] - 1`` of k, v ``[B, S, Hkv,
    D]``, bottom-right aligned."""
    key = torch.arange(k.shape[1], device=q.device)
    first = torch.as_tensor(0 if starts is None else starts, device=q.device).reshape(-1, 1)
    key_keep = (key >= first) & (key < torch.as_tensor(lengths, device=q.device).reshape(-1, 1))
    return flash_attn_model(q, k, v, causal, window, 0.0, None, key_keep=key_keep)


# flash-attn's test_flash_attn_kvcache sizes on the GPU: (seqlen_q, new keys, head dim, capacity, page size,
# rotary dims / 2); its seqlen_q > new case too (queries past the appended keys see them causally)
KVCACHE_SIZES = {
    "small": (2, 2, 32, 48, 16, 8),
    "decode": (1, 1, 128, 1024, 64, 32),
    "spec": (3, 3, 64, 832, 16, 16),
    "chunk": (128, 128, 128, 2048, 64, 64),
    "q_past_new": (4, 1, 64, 512, 16, 32),
}


@pytest.mark.parametrize(
    "size", ["small", *(pytest.param(size, marks=pytest.mark.gpu) for size in KVCACHE_SIZES if size != "small")]
)
@pytest.mark.parametrize("cache", ["dense", "dense_odd_length", "paged", "dense_leftpad", "paged_leftpad"])
@pytest.mark.parametrize("rotary", [None, "interleaved", "neox"])
@pytest.mark.parametrize(
    "causal,window", [(True, (-1, -1)), (False, (-1, -1)), (True, (5, 0))], ids=["causal", "full", "window"]
)
def test_with_kvcache(size, cache, rotary, causal, window, device):
    seqlen_q, new, dim, capacity, page, rotary_half = KVCACHE_SIZES[size]
    batch, heads, kv_heads = 3, 4, 2
    capacity = capacity if cache != "dense_odd_length" else capacity - 7
    cache_seqlens = torch.tensor([0, capacity // 3, capacity - new], dtype=torch.int32, device=device)
    q = _randn(batch, seqlen_q, heads, dim, device=device)
    k_new, v_new = (_randn(batch, new, kv_heads, dim, device=device) for _ in range(2))
    rotary_kwargs = {}
    if rotary is not None:
        angle = torch.rand(capacity + seqlen_q, rotary_half, device=device) * 2 * math.pi
        rotary_kwargs = dict(
            rotary_cos=angle.cos().bfloat16(),
            rotary_sin=angle.sin().bfloat16(),
            rotary_interleaved=rotary == "interleaved",
        )
    leftpad = (
        torch.tensor([0, 3, capacity // 4], dtype=torch.int32, device=device) if cache.endswith("leftpad") else None
    )
    if cache.startswith("paged"):
        pages_per_seq = capacity // page
        k_cache = _randn(batch * pages_per_seq + 2, page, kv_heads, dim, device=device)
        v_cache = _randn(*k_cache.shape, device=device)
        block_table = torch.randperm(k_cache.shape[0], device=device)[: batch * pages_per_seq].int()
        block_table = block_table.view(batch, pages_per_seq)
        cache_kwargs = dict(block_table=block_table)
        logical = lambda c: c[block_table.long()].flatten(1, 2)  # noqa: E731 - [B, capacity, Hkv, D]
    else:
        k_cache = _randn(batch + 1, capacity, kv_heads, dim, device=device)
        v_cache = _randn(*k_cache.shape, device=device)
        cache_batch_idx = torch.tensor([3, 0, 1], dtype=torch.int32, device=device)
        cache_kwargs = dict(cache_batch_idx=cache_batch_idx)
        logical = lambda c: c[cache_batch_idx.long()]  # noqa: E731
    k_before, v_before = k_cache.clone(), v_cache.clone()
    expected, expected_k, expected_v = kvcache_model(
        q,
        logical(k_before),
        logical(v_before),
        k_new,
        v_new,
        cache_seqlens,
        interleaved=rotary == "interleaved",
        cos=rotary_kwargs.get("rotary_cos"),
        sin=rotary_kwargs.get("rotary_sin"),
        causal=causal,
        window=window,
        leftpad=leftpad,
    )

    out, lse = flash_attn_with_kvcache(
        q,
        k_cache,
        v_cache,
        k_new,
        v_new,
        cache_seqlens=cache_seqlens,
        causal=causal,
        window_size=window,
        return_softmax_lse=True,
        cache_leftpad=leftpad,
        **rotary_kwargs,
        **cache_kwargs,
    )
    assert out.shape == q.shape and lse.shape == (batch, heads, seqlen_q)
    assert_close_relative(out.float(), expected, TOLERANCE)
    # appended rows: the float32 rotation rounded once; every other row of the sequences keeps its bits
    assert_cache_after(logical(k_cache), expected_k, "k_cache")
    assert torch.equal(logical(v_cache), expected_v)
    if not cache.startswith("paged"):  # the sequence no batch row maps to is untouched
        assert torch.equal(k_cache[2], k_before[2]) and torch.equal(v_cache[2], v_before[2])
    else:  # and so are the pages no sequence uses
        unused = torch.ones(k_cache.shape[0], dtype=torch.bool, device=device)
        unused[block_table.long().flatten()] = False
        assert torch.equal(k_cache[unused], k_before[unused]) and torch.equal(v_cache[unused], v_before[unused])


def test_kvcache_without_new_keys_and_past_the_end(device):
    """No k / v: attention over cache_seqlens keys (an int too); new keys past the cache's end are dropped."""
    q = _randn(2, 1, 4, 32, device=device)
    k_cache, v_cache = _randn(2, 32, 2, 32, device=device), _randn(2, 32, 2, 32, device=device)
    out = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=20)
    expected = _attend(q, k_cache, v_cache, [20, 20], False, (-1, -1))
    assert_close_relative(out.float(), expected, TOLERANCE)
    before = k_cache.clone()
    k_new, v_new = _randn(2, 3, 2, 32, device=device), _randn(2, 3, 2, 32, device=device)
    flash_attn_with_kvcache(
        q, k_cache, v_cache, k_new, v_new, cache_seqlens=torch.tensor([31, 30], dtype=torch.int32, device=device)
    )
    assert torch.equal(k_cache[0, 31], k_new[0, 0]) and torch.equal(k_cache[1, 30:], k_new[1, :2])
    assert torch.equal(k_cache[0, :31], before[0, :31]) and torch.equal(k_cache[1, :30], before[1, :30])


def test_errors_name_the_argument(device):
    q, k, v = _randn(1, 4, 2, 32, device=device), _randn(1, 4, 2, 32, device=device), _randn(1, 4, 2, 32, device=device)
    with pytest.raises(ValueError, match="dropout_p"):
        flash_attn_func(q, k, v, dropout_p=0.1)
    with pytest.raises(ValueError, match="window_size"):
        flash_attn_func(q, k, v, window_size=3)
    with pytest.raises(NotImplementedError, match="alibi_slopes"):
        flash_attn_func(q, k, v, alibi_slopes=torch.rand(1, 2, device=device))
    with pytest.raises(NotImplementedError, match="softcap"):
        flash_attn_func(q, k, v, softcap=1.0, alibi_slopes=torch.rand(2, device=device))
    cache = _randn(1, 16, 2, 32, device=device)
    with pytest.raises(ValueError, match="k and v"):
        flash_attn_with_kvcache(q, cache, cache, k=k)
    table = torch.zeros(1, 1, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="page_table"):
        flash_attn_with_kvcache(q, cache, cache, block_table=table, page_table=table)
    with pytest.raises(ValueError, match="cache_batch_idx"):
        flash_attn_with_kvcache(q, cache, cache, block_table=table, cache_batch_idx=table[0])
    with pytest.raises(ValueError, match="grad"):
        flash_attn_func(q.requires_grad_(), k, v)


@pytest.mark.gpu
def test_kvcache_decode_step_replays_in_a_cuda_graph(device):
    """A decode step (append with rotary, attend) captured once reads cache_seqlens on the device: replays with
    new lengths equal eager calls."""
    batch, heads, kv_heads, dim, capacity = 4, 8, 2, 64, 256
    k_cache, v_cache = (
        _randn(batch, capacity, kv_heads, dim, device=device),
        _randn(batch, capacity, kv_heads, dim, device=device),
    )
    angle = torch.rand(capacity, dim // 2, device=device) * 2 * math.pi
    cos, sin = angle.cos().bfloat16(), angle.sin().bfloat16()
    q, k, v = (_randn(batch, 1, h, dim, device=device) for h in (heads, kv_heads, kv_heads))
    seqlens = torch.tensor([0, 5, 100, 200], dtype=torch.int32, device=device)
    out = torch.empty_like(q)

    def step():
        out.copy_(
            flash_attn_with_kvcache(
                q, k_cache, v_cache, k, v, rotary_cos=cos, rotary_sin=sin, cache_seqlens=seqlens, causal=True
            )
        )

    caches = (k_cache.clone(), v_cache.clone())
    step()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for lengths in ([7, 0, 255, 31], [1, 2, 3, 4]):
        seqlens.copy_(torch.tensor(lengths, dtype=torch.int32, device=device))
        k_cache.copy_(caches[0])
        v_cache.copy_(caches[1])
        graph.replay()
        replayed, replayed_cache = out.clone(), k_cache.clone()
        k_cache.copy_(caches[0])
        v_cache.copy_(caches[1])
        eager = flash_attn_with_kvcache(
            q, k_cache, v_cache, k, v, rotary_cos=cos, rotary_sin=sin, cache_seqlens=seqlens, causal=True
        )
        assert torch.equal(replayed, eager) and torch.equal(replayed_cache, k_cache)
