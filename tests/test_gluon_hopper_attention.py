"""The warp-specialized Gluon attention kernel for Hopper (``llmkernels.attention.gluon_hopper``) against a float32
PyTorch reference, on an sm_90 GPU (the kernel uses TMA, wgmma and warp specialization: it cannot run elsewhere,
nor in the interpreter). ``lk.attention`` takes this path on such a GPU: tests/test_attention*.py cover it there
too."""

import math

import pytest
import torch

from llmkernels.attention.gluon_hopper import gluon_attention, supports, tma_ready


def _on_sm90() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _on_sm90(), reason="needs an sm_90 (Hopper) GPU")]


@pytest.fixture
def attend():
    """The kernel, called after NaN was written to the memory its outputs will likely take (the caching
    allocator hands back the blocks just freed), so that an element it leaves unwritten fails the check."""

    def poisoned_call(q, k, v, **kwargs):
        torch.full(q.shape, float("nan"), dtype=q.dtype, device=q.device)
        torch.full((q.shape[0], q.shape[2], q.shape[1]), float("nan"), device=q.device)
        return gluon_attention(q, k, v, **kwargs)

    return poisoned_call


TOLERANCE = 1e-2  # relative error (Frobenius norms) of 16-bit inputs, P and output


def _reference(q, k, v, causal, softmax_scale, window=None):
    """float32 (out [B, Sq, Hq, D], natural-log lse [B, Hq, Sq]); masks bottom-right aligned, a row that sees no
    key gives 0 and -inf."""
    qf, kf, vf = (x.float().transpose(1, 2) for x in (q, k, v))
    kf = kf.repeat_interleave(q.shape[2] // k.shape[2], dim=1)
    vf = vf.repeat_interleave(q.shape[2] // k.shape[2], dim=1)
    scores = softmax_scale * qf @ kf.transpose(-1, -2)
    seqlen_q, seqlen_kv = q.shape[1], k.shape[1]
    pos = torch.arange(seqlen_q, device=q.device)[:, None] + seqlen_kv - seqlen_q
    cols = torch.arange(seqlen_kv, device=q.device)[None, :]
    hidden = torch.zeros(seqlen_q, seqlen_kv, dtype=torch.bool, device=q.device)
    if causal:
        hidden |= cols > pos
    if window is not None:
        left, right = window
        if left >= 0:
            hidden |= cols < pos - left
        if right >= 0:
            hidden |= cols > pos + right
    scores = scores.masked_fill(hidden, float("-inf"))
    lse = scores.logsumexp(-1)
    out = (torch.softmax(scores, -1).nan_to_num(0.0) @ vf).transpose(1, 2)
    return out, lse


def _inputs(batch, seqlen_q, seqlen_kv, q_heads, kv_heads, head_dim, q_gain=1.0, dtype=torch.bfloat16):
    q = (torch.randn(batch, seqlen_q, q_heads, head_dim, device="cuda") * q_gain).to(dtype)
    k = torch.randn(batch, seqlen_kv, kv_heads, head_dim, device="cuda", dtype=dtype)
    v = torch.randn(batch, seqlen_kv, kv_heads, head_dim, device="cuda", dtype=dtype)
    return q, k, v


def _check(result, q, k, v, causal, softmax_scale, window=None):
    out, lse = result
    assert out.dtype == q.dtype and out.shape == q.shape and out.is_contiguous()
    assert not torch.isnan(out).any(), "NaN in the output"
    ref, ref_lse = _reference(q, k, v, causal, softmax_scale, window)
    error = ((out.float() - ref).norm() / ref.norm().clamp_min(1e-6)).item()
    assert error < TOLERANCE, f"relative error {error:.2e}"
    assert lse.shape == ref_lse.shape and lse.dtype == torch.float32
    torch.testing.assert_close(lse, ref_lse, atol=2e-2, rtol=1e-3)
    blind = torch.isinf(ref_lse).transpose(1, 2)  # [B, Sq, Hq]: rows that see no key
    assert (out[blind] == 0).all(), "a row that sees no key must give 0"


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("seqlen", [128, 1000, 2048, 4500])
def test_matches_reference(attend, seqlen, head_dim, causal):
    q, k, v = _inputs(2, seqlen, seqlen, 8, 2, head_dim)
    _check(attend(q, k, v, causal=causal, return_lse=True), q, k, v, causal, head_dim**-0.5)


@pytest.mark.parametrize(
    "batch, seqlen_q, seqlen_kv, q_heads, kv_heads, head_dim, causal, q_gain, scale, dtype",
    [
        (1, 1, 1000, 4, 1, 128, False, 1.0, None, torch.bfloat16),  # MQA, one query: Sq far below the Q block
        (3, 300, 77, 8, 8, 64, False, 1.0, None, torch.bfloat16),  # Skv below one K/V tile
        (2, 513, 513, 6, 3, 128, True, 4.0, None, torch.bfloat16),  # peaked scores: the running max moves
        (2, 700, 700, 4, 2, 64, True, 1.0, 0.3, torch.bfloat16),  # explicit softmax_scale
        (2, 200, 1000, 4, 2, 128, True, 1.0, None, torch.bfloat16),  # causal, Sq < Skv: bottom-right aligned
        (1, 1, 300, 2, 1, 64, True, 1.0, None, torch.bfloat16),  # one query sees every key
        (2, 640, 640, 4, 4, 128, True, 1.0, None, torch.float16),
        (1, 3000, 3000, 2, 1, 64, False, 1.0, None, torch.float16),
        (2, 333, 900, 4, 1, 256, True, 4.0, None, torch.bfloat16),  # D = 256: 64-key tiles
    ],
    ids=[
        "mqa-one-query",
        "mha-short-kv",
        "peaked-causal",
        "scale",
        "causal-bottom-right",
        "causal-one-query",
        "fp16-causal",
        "fp16-long",
        "d256-causal-bottom-right",
    ],
)
def test_other_shapes(attend, batch, seqlen_q, seqlen_kv, q_heads, kv_heads, head_dim, causal, q_gain, scale, dtype):
    q, k, v = _inputs(batch, seqlen_q, seqlen_kv, q_heads, kv_heads, head_dim, q_gain, dtype)
    result = attend(q, k, v, causal=causal, softmax_scale=scale, return_lse=True)
    _check(result, q, k, v, causal, head_dim**-0.5 if scale is None else scale)


@pytest.mark.parametrize(
    "window", [(0, 0), (100, 50), (300, -1), (-1, 200), (128, 0), (1, 5000)], ids=lambda w: f"window{w[0]}_{w[1]}"
)
@pytest.mark.parametrize("causal", [False, True], ids=["", "causal"])
@pytest.mark.parametrize("seqlen_q, seqlen_kv", [(700, 700), (300, 1000), (1000, 300)])
def test_sliding_window(attend, seqlen_q, seqlen_kv, causal, window):
    """flash-attn's window_size, with and without causal, Sq below, equal to and above Skv (rows before the
    first key see nothing: output 0, LSE -inf)."""
    q, k, v = _inputs(2, seqlen_q, seqlen_kv, 4, 2, 128 if seqlen_q == 700 else 64)
    result = attend(q, k, v, causal=causal, window=window, return_lse=True)
    _check(result, q, k, v, causal, q.shape[-1] ** -0.5, window)


@pytest.mark.parametrize("consumers", [2, 3])
@pytest.mark.parametrize(
    "causal, window",
    [(False, None), (True, None), (False, (100, 50)), (True, (300, -1))],
    ids=["full", "causal", "window", "causal-window"],
)
def test_consumer_counts(attend, consumers, causal, window):
    """Head dim 64 runs two or three consumer warpgroups per block (192-row blocks with three)."""
    q, k, v = _inputs(2, 1000, 1200, 4, 2, 64)
    result = attend(q, k, v, causal=causal, window=window, return_lse=True, consumers=consumers)
    _check(result, q, k, v, causal, 64**-0.5, window)


def test_causal_rows_before_the_first_key(attend):
    """Causal with Sq > Skv: the first Sq - Skv queries see no key (0, LSE -inf); whole 128-row blocks of them."""
    q, k, v = _inputs(2, 1000, 200, 4, 4, 128)
    _check(attend(q, k, v, causal=True, return_lse=True), q, k, v, True, 128**-0.5)


def test_strided_views(attend):
    """q, k, v as slices of one packed [B, S, 3, H, D] tensor (token stride 3·H·D) and of a longer batch; the
    result equals the contiguous call's bit for bit."""
    packed = torch.randn(3, 700, 3, 4, 128, device="cuda", dtype=torch.bfloat16)
    q, k, v = packed[1:, :, 0], packed[1:, :, 1], packed[1:, :, 2]
    assert supports(q, k, v, 0.1)
    out, lse = attend(q, k, v, causal=True, return_lse=True)
    expected, expected_lse = attend(q.contiguous(), k.contiguous(), v.contiguous(), causal=True, return_lse=True)
    assert torch.equal(out, expected) and torch.equal(lse, expected_lse)
    _check((out, lse), q, k, v, True, 128**-0.5)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_next_sequence_is_never_read(attend, head_dim):
    """A sequence's last K/V tile runs past Skv: the rows there must be zeros, not the next sequence's. Sequence
    1 holds NaN and inf (its own output is garbage); sequence 0's must be exact."""
    q, k, v = _inputs(2, 100, 1000, 4, 2, head_dim)
    k[1], v[1] = float("nan"), float("inf")
    out, lse = attend(q, k, v, return_lse=True)
    _check((out[:1], lse[:1]), q[:1], k[:1], v[:1], False, head_dim**-0.5)


@pytest.mark.parametrize("causal", [False, True], ids=["strided", "counter"])
def test_more_work_tiles_than_a_grid_dimension_held(attend, causal):
    """70400 (batch, head) pairs, over the 65535 a grid's y dimension held before the kernel went persistent: every
    program runs hundreds of work tiles, handed out by striding (unmasked) or the counter (causal)."""
    q, k, v = _inputs(1100, 20, 20, 64, 16, 64)
    result = attend(q, k, v, causal=causal, return_lse=True)
    _check(result, q, k, v, causal, 64**-0.5)


def test_repeated_masked_calls_start_from_a_fresh_counter(attend):
    """The counter of masked calls starts at zero every call: the same call twice gives the same bits, under a
    CUDA graph replayed twice too."""
    q, k, v = _inputs(4, 1000, 1000, 8, 8, 128)
    first = attend(q, k, v, causal=True)
    assert torch.equal(first, attend(q, k, v, causal=True))
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        gluon_attention(q, k, v, causal=True)
        with torch.cuda.graph(graph):
            captured = gluon_attention(q, k, v, causal=True)
    torch.cuda.current_stream().wait_stream(stream)
    for _ in range(2):
        captured.fill_(float("nan"))
        graph.replay()
        assert torch.equal(captured, first)


def test_empty_query(attend):
    q, k, v = _inputs(2, 0, 16, 4, 2, 64)
    assert attend(q, k, v).shape == q.shape


def test_supports():
    q, k, v = _inputs(1, 64, 64, 4, 2, 64)
    assert supports(q, k, v, 0.1)
    assert supports(q, k[:, :32], v[:, :32], 0.1)  # Sq > Skv
    assert supports(*_inputs(1, 64, 64, 4, 2, 256), 0.1)
    assert not supports(q.float(), k.float(), v.float(), 0.1)  # dtype
    assert not supports(q[..., :32], k[..., :32], v[..., :32], 0.1)  # head dim 32
    assert not supports(q, k, v, -0.1)  # scale
    assert not supports(q, k[:, :0], v[:, :0], 0.1)  # no key
    assert not supports(q.cpu(), k.cpu(), v.cpu(), 0.1)
    heads_apart = q.transpose(1, 2).contiguous().transpose(1, 2)
    assert supports(heads_apart, k, v, 0.1) and not tma_ready(heads_apart)  # copied, then read by TMA
    assert tma_ready(q) and not tma_ready(q.expand(2, -1, -1, -1))  # batch stride 0


@pytest.mark.parametrize("view", ["heads-apart", "batch-expanded", "offset", "odd-token-stride"])
def test_views_tma_cannot_read_give_the_contiguous_bits(view):
    """Views TMA cannot read in place are copied first: the kernel and lk.attention give the contiguous call's
    bits (the library's any-strides convention)."""
    import llmkernels as lk

    q, k, v = _inputs(2, 700, 700, 4, 2, 128)
    if view == "heads-apart":
        k = k.transpose(1, 2).contiguous().transpose(1, 2)
    elif view == "batch-expanded":
        k = k[:1].expand(2, -1, -1, -1)
    elif view == "offset":
        k = torch.empty(k.numel() + 1, dtype=k.dtype, device=k.device)[1:].view(k.shape).copy_(k)
    else:  # heads contiguous, but a token stride of 257 elements (514 bytes)
        k = torch.empty(2, 700, 257, dtype=k.dtype, device=k.device)[..., :256].unflatten(-1, (2, 128)).copy_(k)
    assert not tma_ready(k)
    expected = gluon_attention(q, k.contiguous(), v, causal=True)
    assert torch.equal(gluon_attention(q, k, v, causal=True), expected)
    assert torch.equal(lk.attention(q, k, v, causal=True), expected)


def test_rejects_bad_arguments():
    q, k, v = _inputs(1, 64, 64, 4, 2, 64)
    with pytest.raises(TypeError, match="q must be float16 or bfloat16"):
        gluon_attention(q.float(), k, v)
    with pytest.raises(TypeError, match="v must be a torch.Tensor"):
        gluon_attention(q, k, None)
    with pytest.raises(TypeError, match="causal must be a bool"):
        gluon_attention(q, k, v, causal=1)
    with pytest.raises(TypeError, match="softmax_scale"):
        gluon_attention(q, k, v, softmax_scale="0.1")
    with pytest.raises(ValueError, match="softmax_scale must be finite and > 0"):
        gluon_attention(q, k, v, softmax_scale=-0.1)
    with pytest.raises(ValueError, match="softmax_scale must be finite and > 0"):
        gluon_attention(q, k, v, softmax_scale=math.inf)
    with pytest.raises(ValueError, match="consumers must be None"):
        gluon_attention(*_inputs(1, 64, 64, 4, 2, 128), consumers=3)
    with pytest.raises(TypeError, match="window must be None or a"):
        gluon_attention(q, k, v, window=(1, 2, 3))
    with pytest.raises(ValueError, match="does not run"):
        gluon_attention(q, k[:, :0], v[:, :0])
    with pytest.raises(ValueError, match="does not run"):
        gluon_attention(q[..., :32].contiguous(), k[..., :32].contiguous(), v[..., :32].contiguous())


def test_lk_attention_takes_this_kernel():
    """``lk.attention`` runs this kernel for dense causal / windowed / unmasked calls (same bits, LSE included),
    with the config's consumer count, and the portable kernel for a config without ``warp_specialized``."""
    import llmkernels as lk
    from llmkernels.attention.config import FA4Config, default_config

    q, k, v = _inputs(2, 1000, 1000, 8, 2, 128)
    for causal in (False, True):
        out, lse = lk.attention(q, k, v, causal=causal, return_lse=True)
        expected, expected_lse = gluon_attention(q, k, v, causal=causal, return_lse=True)
        assert torch.equal(out, expected) and torch.equal(lse, expected_lse)
    out = lk.attention(q, k, v, causal=True, mask=lk.SlidingWindow(100, 0))
    assert torch.equal(out, gluon_attention(q, k, v, causal=True, window=(100, 0)))
    default = default_config(128, q.dtype, q.device)
    assert default.warp_specialized
    portable = lk.attention(q, k, v, causal=True, config=default.replace(warp_specialized=False))
    assert not torch.equal(portable, gluon_attention(q, k, v, causal=True))
    q, k, v = _inputs(2, 1000, 1000, 4, 2, 64)
    for consumers in (2, 3):
        config = default_config(64, q.dtype, q.device).replace(consumer_warpgroups=consumers)
        assert torch.equal(lk.attention(q, k, v, config=config), gluon_attention(q, k, v, consumers=consumers))
    with pytest.raises(ValueError, match="consumer_warpgroups=3 needs head dim 64"):
        lk.attention(*_inputs(1, 64, 64, 2, 2, 128), config=FA4Config(consumer_warpgroups=3))


# --------------------------------------------------------------------------- paged KV cache (chunked prefill)


def _paged(k, v, page_size, seqlens, extra_pages=3, page_stride_pad=0):
    """A PagedKVCache of sequence b's first ``seqlens[b]`` keys of dense ``k, v [B, S, Hkv, D]`` in shuffled
    pages. Slots past a sequence's keys and the unused pages hold NaN (so that a kernel reading them into the
    output fails), block-table entries past a sequence's last page are garbage (10**6). ``page_stride_pad``:
    pages that many elements apart beyond their size (a cache inside a larger tensor)."""
    batch, _, kv_heads, head_dim = k.shape
    counts = [-(-max(n, 0) // page_size) for n in seqlens]
    num_pages = sum(counts) + extra_pages
    max_pages = max(max(counts), 1) + 1
    permutation = torch.randperm(num_pages).tolist()
    block_table = torch.full((batch, max_pages), 10**6, dtype=torch.int32)
    page_elems = page_size * kv_heads * head_dim
    storage = [
        torch.full((num_pages, page_elems + page_stride_pad), float("nan"), dtype=k.dtype, device=k.device)
        for _ in range(2)
    ]
    k_pages, v_pages = (s[:, :page_elems].unflatten(1, (page_size, kv_heads, head_dim)) for s in storage)
    cursor = 0
    for b, count in enumerate(counts):
        pages = permutation[cursor : cursor + count]
        cursor += count
        block_table[b, :count] = torch.tensor(pages, dtype=torch.int32)
        for i, page in enumerate(pages):
            keys = slice(i * page_size, min((i + 1) * page_size, seqlens[b]))
            k_pages[page, : keys.stop - keys.start] = k[b, keys]
            v_pages[page, : keys.stop - keys.start] = v[b, keys]
    from llmkernels.attention.paged import PagedKVCache

    return PagedKVCache(k_pages, v_pages, block_table.cuda(), torch.tensor(seqlens, dtype=torch.int32, device="cuda"))


def _record_launches(monkeypatch, kernel, describe) -> list:
    """From here on, each launch of the Gluon ``kernel`` (a bound launch: every launch of the library is one) appends
    ``describe(bound)`` to the returned list."""
    from llmkernels.launch import BoundKernel

    calls = []
    launch = BoundKernel.__call__

    def counting(bound, *values):
        if bound.fn is kernel:
            calls.append(describe(bound))
        return launch(bound, *values)

    monkeypatch.setattr(BoundKernel, "__call__", counting)
    return calls


def _bound_value(bound, name):
    return bound.values[bound.names.index(name)]


@pytest.fixture
def gluon_launches(monkeypatch):
    """The Gluon kernel's launches as ``(ragged, paged)`` pairs (so that a test knows lk.attention took it, and
    with which layout)."""
    from llmkernels.attention import gluon_hopper

    return _record_launches(
        monkeypatch,
        gluon_hopper.BACKEND.kernel,
        lambda bound: (_bound_value(bound, "RAGGED"), _bound_value(bound, "PAGE_SIZE") > 0),
    )


def _check_paged(out, lse, q, k, v, seqlens, causal, window=None):
    """Each sequence against the float32 reference over its own keys (bottom-right aligned to them)."""
    assert not torch.isnan(out).any(), "NaN in the output"
    for b, n in enumerate(seqlens):
        n = max(n, 0)
        ref, ref_lse = _reference(q[b : b + 1], k[b : b + 1, :n], v[b : b + 1, :n], causal, q.shape[-1] ** -0.5, window)
        error = ((out[b : b + 1].float() - ref).norm() / ref.norm().clamp_min(1e-6)).item()
        assert error < TOLERANCE, f"sequence {b} ({n} keys): relative error {error:.2e}"
        torch.testing.assert_close(lse[b : b + 1], ref_lse, atol=2e-2, rtol=1e-3)
        assert (out[b : b + 1][torch.isinf(ref_lse).transpose(1, 2)] == 0).all(), "a row that sees no key must give 0"


@pytest.mark.parametrize("mask", ["none", "causal", "window"])
@pytest.mark.parametrize("page_size", [16, 64, 256])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_paged_cache_matches_reference(gluon_launches, head_dim, page_size, mask):
    """Chunked prefill: 300 queries over a paged cache (shuffled pages, NaN past each sequence's keys and in unused
    pages), sequences of 1000 keys (whole tiles), 1537 (a tile's first key alone), 0 (no key: 0 and LSE -inf) and
    200 (fewer keys than queries: the first rows see none when causal)."""
    import llmkernels as lk

    seqlens = [1000, 1537, 0, 200]
    q, k, v = _inputs(4, 300, max(seqlens), 8, 2, head_dim)
    cache = _paged(k, v, page_size, seqlens)
    causal = mask == "causal"
    window = (400, 0) if mask == "window" else None
    torch.full(q.shape, float("nan"), dtype=q.dtype, device=q.device)  # poison what out will likely take
    out, lse = lk.attention(
        q,
        None,
        None,
        kv_cache=cache,
        causal=causal,
        return_lse=True,
        mask=lk.SlidingWindow(*window) if window else None,
    )
    assert gluon_launches == [(False, True)]
    _check_paged(out, lse, q, k, v, seqlens, causal, window)


@pytest.mark.parametrize("consumers", [2, 3])
def test_paged_cache_consumer_counts(gluon_launches, consumers):
    """D 64 with two and three consumer warpgroups over a paged cache, causal."""
    import llmkernels as lk
    from llmkernels.attention.config import default_config

    seqlens = [900, 4097]
    q, k, v = _inputs(2, 700, max(seqlens), 4, 4, 64)
    cache = _paged(k, v, 16, seqlens)
    config = default_config(64, q.dtype, q.device).replace(consumer_warpgroups=consumers)
    out, lse = lk.attention(q, None, None, kv_cache=cache, causal=True, return_lse=True, config=config)
    assert gluon_launches == [(False, True)]
    _check_paged(out, lse, q, k, v, seqlens, True)


def test_paged_cache_bad_metadata_matches_the_portable_kernel(gluon_launches):
    """Metadata the kernels clamp (a negative count, a count past the table, used block-table entries negative and
    past num_pages): the Gluon kernel reads what the portable kernel reads, and the sound sequence is exact."""
    import llmkernels as lk
    from llmkernels.attention.config import default_config
    from llmkernels.attention.paged import PagedKVCache

    seqlens = [700, 500, 300, 600]
    q, k, v = _inputs(4, 200, max(seqlens), 8, 2, 128)
    cache = _paged(k, v, 64, seqlens)
    block_table = cache.block_table.clone()
    block_table[2, 1], block_table[3, 0] = -7, cache.num_pages + 5
    bad_counts = torch.tensor([700, -5, 10**6, 600], dtype=torch.int32, device="cuda")
    hostile = PagedKVCache(cache.k_pages.nan_to_num(0.0), cache.v_pages.nan_to_num(0.0), block_table, bad_counts)
    out, lse = lk.attention(q, None, None, kv_cache=hostile, causal=True, return_lse=True)
    assert gluon_launches == [(False, True)]
    portable = default_config(128, q.dtype, q.device).replace(warp_specialized=False)
    expected, expected_lse = lk.attention(
        q, None, None, kv_cache=hostile, causal=True, return_lse=True, config=portable
    )
    assert not torch.isnan(out).any()
    error = ((out.float() - expected.float()).norm() / expected.float().norm()).item()
    assert error < TOLERANCE, f"relative error against the portable kernel {error:.2e}"
    assert torch.equal(torch.isinf(lse), torch.isinf(expected_lse))
    _check_paged(out[:1], lse[:1], q[:1], k[:1], v[:1], seqlens[:1], True)


def test_paged_cache_views(gluon_launches):
    """Pages inside a larger tensor (page stride beyond their size) run in place on this kernel; pages TMA cannot
    read (head dim not unit-stride) go to the portable kernel, and both agree with the reference."""
    import llmkernels as lk
    from llmkernels.attention.gluon_hopper import supports_paged
    from llmkernels.attention.paged import PagedKVCache

    seqlens = [333, 1000]
    q, k, v = _inputs(2, 100, max(seqlens), 4, 2, 128)
    cache = _paged(k, v, 16, seqlens, page_stride_pad=64)
    assert supports_paged(q, cache.k_pages, cache.v_pages, 0.1)
    out, lse = lk.attention(q, None, None, kv_cache=cache, return_lse=True)
    assert gluon_launches == [(False, True)]
    _check_paged(out, lse, q, k, v, seqlens, False)
    strided = cache.k_pages.transpose(1, 3).contiguous().transpose(1, 3)  # head dim strided
    assert not supports_paged(q, strided, cache.v_pages, 0.1)
    out, lse = lk.attention(
        q, None, None, kv_cache=PagedKVCache(strided, cache.v_pages, cache.block_table, cache.seqlens), return_lse=True
    )
    assert gluon_launches == [(False, True)]  # not this kernel
    _check_paged(out, lse, q, k, v, seqlens, False)


@pytest.mark.parametrize(
    "head_dim, q_heads, kv_heads, mask",
    [(64, 8, 1, dict(causal=True)), (64, 8, 2, dict(window=(127, 0))), (128, 8, 2, {}), (256, 8, 4, dict(causal=True))],
)
def test_sinks_fold_into_the_last_step(gluon_launches, head_dim, q_heads, kv_heads, mask):
    """Attention sinks (gpt-oss: a logit per q head in the softmax's denominator) run this kernel: against the
    library's reference with the LSE, for sinks that are ordinary, far above every score (the weight goes to the
    sink), +inf (O = 0, LSE = +inf) and -inf (no sink); with more queries than keys, causal rows that see no key get
    O = 0 and LSE = the sink. The sinks come as a strided view (every other element; the others NaN)."""
    import llmkernels as lk

    q, k, v = _inputs(2, 300, 200, q_heads, kv_heads, head_dim)
    values = [0.0, 1.5, -2.0, 30.0, float("inf"), float("-inf"), 3.0, -0.5]
    sinks = torch.tensor([x for value in values for x in (value, float("nan"))], device="cuda")[::2]  # strided
    if "window" in mask:
        mask = dict(mask=lk.SlidingWindow(*mask["window"]))
    torch.full(q.shape, float("nan"), dtype=q.dtype, device="cuda")  # poison the memory the output will take
    out, lse = lk.attention(q, k, v, sinks=sinks, return_lse=True, **mask)
    assert gluon_launches == [(False, False)], gluon_launches
    ref, ref_lse = lk.attention_reference(q, k, v, sinks=sinks, return_lse=True, **mask)
    assert not torch.isnan(out).any(), "NaN in the output"
    error = ((out.float() - ref).norm() / ref.norm()).item()
    assert error < TOLERANCE, f"relative error {error:.2e}"
    assert torch.equal(torch.isfinite(lse), torch.isfinite(ref_lse)) and torch.equal(lse.isinf(), ref_lse.isinf())
    finite = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse[finite], ref_lse[finite].float(), atol=2e-2, rtol=1e-3)
    assert (out[:, :, 4] == 0).all(), "a sink of +inf takes all the weight"
    if mask.get("causal"):  # queries 0..99 see no key: O = 0, LSE = the sink
        assert (out[:, :100] == 0).all()
        torch.testing.assert_close(lse[:, :, :100], sinks[None, :, None].expand(2, -1, 100))


# --------------------------------------------------------------------------- ragged q (and k / v)


def _cu(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")


def _check_ragged(out, lse, q, k, v, lengths_q, lengths_k, causal, window=None, skip=()):
    """Sequence b (rows ``cu_q[b]:cu_q[b + 1]`` of out, lse ``[Hq, total_q]``) against the float32 reference over
    its own keys; sequences in ``skip`` are not checked."""
    cu_q, cu_k = _cu(lengths_q).tolist(), _cu(lengths_k).tolist()
    for b in range(len(lengths_q)):
        if b in skip or lengths_q[b] == 0:
            continue
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        ref, ref_lse = _reference(q[None, rows], k[None, keys], v[None, keys], causal, q.shape[-1] ** -0.5, window)
        got = out[None, rows]
        assert not torch.isnan(got).any(), f"NaN in sequence {b}"
        error = ((got.float() - ref).norm() / ref.norm().clamp_min(1e-6)).item()
        assert error < TOLERANCE, f"sequence {b}: relative error {error:.2e}"
        torch.testing.assert_close(lse[None, :, rows], ref_lse, atol=2e-2, rtol=1e-3)
        assert (got[torch.isinf(ref_lse).transpose(1, 2)] == 0).all(), "a row that sees no key must give 0"


@pytest.mark.parametrize("mask", ["none", "causal", "window"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_ragged_matches_reference(gluon_launches, head_dim, mask):
    """Ragged q and k (flash-attn's varlen): sequences of 300 / 0 / 129 / 700 queries over 1000 / 50 / 0 / 700
    keys (an empty one, one with no key: 0 and LSE -inf), then a sequence of NaN keys and inf values that the
    700-key sequence's last tile runs into (its rows must be zeroed, not multiplied by P's zeros)."""
    import llmkernels as lk

    lengths_q, lengths_k = [300, 0, 129, 700, 64], [1000, 50, 0, 700, 100]
    q = torch.randn(sum(lengths_q), 8, head_dim, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(sum(lengths_k), 2, head_dim, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    k[-100:], v[-100:] = float("nan"), float("inf")
    causal = mask == "causal"
    window = (300, 0) if mask == "window" else None
    torch.full(q.shape, float("nan"), dtype=q.dtype, device=q.device)  # poison what out will likely take
    out, lse = lk.attention(
        q,
        k,
        v,
        cu_seqlens_q=_cu(lengths_q),
        cu_seqlens_k=_cu(lengths_k),
        max_seqlen_q=700,
        max_seqlen_k=1000,
        causal=causal,
        return_lse=True,
        mask=lk.SlidingWindow(*window) if window else None,
    )
    assert gluon_launches == [(True, False)]
    _check_ragged(out, lse, q, k, v, lengths_q, lengths_k, causal, window, skip=(4,))


@pytest.mark.parametrize("page_size", [16, 128])
def test_ragged_queries_over_a_paged_cache(gluon_launches, page_size):
    """Chunked prefill of several sequences (vLLM's varlen + block table): 300 / 17 / 0 / 500 new queries over
    paged caches of 1000 / 40 / 30 / 500 keys, causal (bottom-right), D 128."""
    import llmkernels as lk

    lengths_q, seqlens = [300, 17, 0, 500], [1000, 40, 30, 500]
    q = torch.randn(sum(lengths_q), 8, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(4, max(seqlens), 2, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    cache = _paged(k, v, page_size, seqlens)
    out, lse = lk.attention(
        q, None, None, kv_cache=cache, cu_seqlens_q=_cu(lengths_q), max_seqlen_q=500, causal=True, return_lse=True
    )
    assert gluon_launches == [(True, True)]
    k_ragged = torch.cat([k[b, :n] for b, n in enumerate(seqlens)])
    v_ragged = torch.cat([v[b, :n] for b, n in enumerate(seqlens)])
    _check_ragged(out, lse, q, k_ragged, v_ragged, lengths_q, seqlens, True)


def test_ragged_bad_cu_seqlens_match_the_portable_kernel(gluon_launches):
    """cu_seqlens the kernels clamp (a decreasing entry, entries past the tensors): every row some sequence owns
    under ``clamp(cummax(cu_seqlens), 0, total)`` matches the portable kernel's."""
    import llmkernels as lk
    from llmkernels.attention.config import default_config

    q = torch.randn(900, 8, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1200, 2, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    cu_q = torch.tensor([0, 300, 200, 700, 5000], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, 400, 900, 800, 9000], dtype=torch.int32, device="cuda")
    kwargs = dict(
        cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=600, max_seqlen_k=1200, causal=True, return_lse=True
    )
    out, lse = lk.attention(q, k, v, **kwargs)
    assert gluon_launches == [(True, False)]
    portable = default_config(128, q.dtype, q.device).replace(warp_specialized=False)
    expected, expected_lse = lk.attention(q, k, v, config=portable, **kwargs)
    owned = torch.cummax(cu_q.long(), 0).values.clamp(0, q.shape[0]).tolist()
    for b in range(4):
        rows = slice(owned[b], min(owned[b + 1], owned[b] + 600))
        if rows.start >= rows.stop:
            continue
        got, want = out[rows].float(), expected[rows].float()
        error = ((got - want).norm() / want.norm().clamp_min(1e-6)).item()
        assert error < TOLERANCE, f"sequence {b}: relative error against the portable kernel {error:.2e}"
        torch.testing.assert_close(lse[:, rows], expected_lse[:, rows], atol=2e-2, rtol=1e-3)


# --------------------------------------------------------------------------- split-KV decode (gluon_decode.py)


@pytest.fixture
def decode_launches(monkeypatch):
    """The Gluon split pass's launches, as ``paged`` flags (so that a test knows lk.attention took it)."""
    from llmkernels.attention import gluon_decode
    from llmkernels.launch import clear_plans

    clear_plans()
    yield _record_launches(monkeypatch, gluon_decode.BACKEND.kernel, lambda bound: _bound_value(bound, "PAGE_SIZE") > 0)
    clear_plans()


@pytest.mark.parametrize("page_size", [16, 64, 256])
@pytest.mark.parametrize("head_dim,q_heads,kv_heads", [(128, 32, 8), (64, 8, 1), (128, 64, 1), (64, 4, 4)])
def test_decode_split_pass_matches_reference(decode_launches, head_dim, q_heads, kv_heads, page_size):
    """One query token over a paged cache (shuffled pages, NaN past each sequence's keys and in unused pages): a
    sequence of whole tiles, one ending a key into its last tile, one with no key (0 and LSE -inf), one whose
    keys fit one tile; as many sequences as keep (sequence, KV head) pairs within the pass's limit."""
    import llmkernels as lk
    from llmkernels.attention.gluon_decode import MAX_HEAD_PROGRAMS

    seqlens = [4096, 2049, 0, 37][: max(1, MAX_HEAD_PROGRAMS // kv_heads)]
    q, k, v = _inputs(len(seqlens), 1, max(seqlens), q_heads, kv_heads, head_dim)
    cache = _paged(k, v, page_size, seqlens)
    torch.full((len(seqlens), 8, q_heads, head_dim), float("nan"), device="cuda")  # poison the partials' memory
    out, lse = lk.attention(q, None, None, kv_cache=cache, causal=True, return_lse=True)
    assert decode_launches == [True]
    _check_paged(out, lse, q, k, v, seqlens, True)


def test_decode_split_pass_dense_kv_sinks_and_splits(decode_launches):
    """Dense K/V (read through per-sequence descriptors: zeros past the keys), attention sinks (merged by the
    combine), and split counts from 2 to more than the tiles, against the reference and the portable pass."""
    import llmkernels as lk
    from llmkernels.attention.config import default_config

    q, k, v = _inputs(2, 1, 1000, 16, 4, 128)
    sinks = torch.randn(16, device="cuda")
    portable = default_config(128, q.dtype, q.device, decode=True).replace(warp_specialized=False)
    for num_splits in (2, 5, 100):
        decode_launches.clear()
        out, lse = lk.attention(q, k, v, sinks=sinks, num_splits=num_splits, return_lse=True)
        assert decode_launches == [False]
        expected, expected_lse = lk.attention(
            q, k, v, sinks=sinks, num_splits=num_splits, return_lse=True, config=portable
        )
        assert decode_launches == [False]
        error = ((out.float() - expected.float()).norm() / expected.float().norm()).item()
        assert error < TOLERANCE, f"{num_splits} splits: relative error against the portable pass {error:.2e}"
        torch.testing.assert_close(lse, expected_lse, atol=1e-3, rtol=1e-4)
    no_sinks, _ = lk.attention(q, k, v, num_splits=3, return_lse=True)
    ref, _ = _reference(q, k, v, False, 128**-0.5)
    assert ((no_sinks.float() - ref).norm() / ref.norm()).item() < TOLERANCE


def test_decode_split_pass_bad_metadata_matches_the_portable_pass(decode_launches):
    """Counts and block-table entries the kernels clamp (negative, past the table, past num_pages): the Gluon pass
    reads the keys the portable pass reads."""
    import llmkernels as lk
    from llmkernels.attention.config import default_config
    from llmkernels.attention.paged import PagedKVCache

    seqlens = [700, 500]
    q, k, v = _inputs(2, 1, max(seqlens), 16, 4, 128)
    cache = _paged(k, v, 16, seqlens)
    block_table = cache.block_table.clone()
    block_table[0, 3], block_table[1, 0] = -7, cache.num_pages + 5
    for counts in ([700, -5], [10**6, 500]):
        hostile = PagedKVCache(
            cache.k_pages.nan_to_num(0.0),
            cache.v_pages.nan_to_num(0.0),
            block_table,
            torch.tensor(counts, dtype=torch.int32, device="cuda"),
        )
        decode_launches.clear()
        out, lse = lk.attention(q, None, None, kv_cache=hostile, return_lse=True)
        assert decode_launches == [True]
        portable = default_config(128, q.dtype, q.device, decode=True).replace(warp_specialized=False)
        expected, expected_lse = lk.attention(q, None, None, kv_cache=hostile, return_lse=True, config=portable)
        assert not torch.isnan(out).any() and torch.equal(torch.isinf(lse), torch.isinf(expected_lse))
        error = ((out.float() - expected.float()).norm() / expected.float().norm()).item()
        assert error < TOLERANCE, f"counts {counts}: relative error against the portable pass {error:.2e}"


def test_decode_split_pass_views_and_fallbacks(decode_launches):
    """A strided q and pages inside a larger tensor run in place; pages TMA cannot read, more (sequence, KV head)
    pairs than the limit, a sliding window that hides keys, two query tokens and D 256 take the portable pass;
    every result matches the reference."""
    import llmkernels as lk
    from llmkernels.attention.gluon_decode import MAX_HEAD_PROGRAMS
    from llmkernels.attention.paged import PagedKVCache

    seqlens = [1500, 333]
    q_wide, k, v = _inputs(2, 1, max(seqlens), 32, 4, 128)
    q = q_wide.transpose(0, 1).contiguous().transpose(0, 1)  # batch and token strides swapped
    cache = _paged(k, v, 64, seqlens, page_stride_pad=128)
    out, lse = lk.attention(q, None, None, kv_cache=cache, return_lse=True)
    assert decode_launches == [True]
    _check_paged(out, lse, q, k, v, seqlens, False)

    decode_launches.clear()
    strided = PagedKVCache(
        cache.k_pages.transpose(2, 3).contiguous().transpose(2, 3), cache.v_pages, cache.block_table, cache.seqlens
    )  # head dim not unit-stride
    out, lse = lk.attention(q, None, None, kv_cache=strided, return_lse=True)
    assert decode_launches == []
    _check_paged(out, lse, q, k, v, seqlens, False)

    many = MAX_HEAD_PROGRAMS // 4 + 1  # sequences x 4 KV heads past the limit
    q_many, k_many, v_many = _inputs(many, 1, 300, 32, 4, 128)
    out, lse = lk.attention(q_many, None, None, kv_cache=_paged(k_many, v_many, 16, [300] * many), return_lse=True)
    assert decode_launches == []
    _check_paged(out, lse, q_many, k_many, v_many, [300] * many, False)

    out, lse = lk.attention(q, None, None, kv_cache=cache, mask=lk.SlidingWindow(100, 0), return_lse=True)
    assert decode_launches == []
    _check_paged(out, lse, q, k, v, seqlens, True, (100, 0))

    q2, k2, v2 = _inputs(2, 2, max(seqlens), 32, 4, 128)
    out, lse = lk.attention(q2, None, None, kv_cache=_paged(k2, v2, 16, seqlens), causal=True, return_lse=True)
    assert decode_launches == []
    _check_paged(out, lse, q2, k2, v2, seqlens, True)

    q256, k256, v256 = _inputs(1, 1, 500, 8, 2, 256)
    out, lse = lk.attention(q256, None, None, kv_cache=_paged(k256, v256, 16, [500]), return_lse=True)
    assert decode_launches == []
    _check_paged(out, lse, q256, k256, v256, [500], False)
