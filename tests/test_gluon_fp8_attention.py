"""The Gluon FP8 prefill (``llmkernels.attention.gluon_fp8_prefill``) through :func:`llmkernels.attention` on an
sm_90 GPU: e4m3 q, k, v against the float64 reference on the dequantized inputs; full and causal (bottom-right,
Sq != Skv, queries that see no key), GQA with per-(sequence, KV head) descales and their broadcasts, D 64 and 128,
sequences that are not multiples of the 128-key tile, the call's softmax scale, the LSE, strided and offset views,
repeated causal calls and a CUDA graph; every check also asserts that this backend ran. The kernel uses TMA, wgmma
and warp specialization: it cannot run elsewhere, nor in the interpreter (tests/test_attention_fp8.py checks the
routing on the CPU, tests/test_compile_targets.py its sm_90a compile)."""

import pytest
import torch

from llmkernels import runtime
from llmkernels.attention.api import attention
from llmkernels.attention.fp8_rows import quantize_rows
from llmkernels.attention.masks import SlidingWindow
from llmkernels.attention.paged import PagedKVCache
from llmkernels.attention.plan import PLANS
from llmkernels.attention.reference import attention_reference
from llmkernels.testing import assert_close_relative, poison


def _on_sm90() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _on_sm90(), reason="needs an sm_90 (Hopper) GPU")]

FP8 = torch.float8_e4m3fn
# Relative error (norm-wise) against float64 on the dequantized inputs. The products and the fp32 accumulation are
# near exact; P is rounded to e4m3 (3 mantissa bits) before P V: measured 1.1-2.4e-2 on randn inputs with these
# descales (H100, D 64 / 128, full / causal, 1000x1000, 300x700, 700x300; the lab's cases 2.0-2.5e-2, 0.6-0.7x cuDNN
# FP8's). The LSE comes from the fp32 scores and the unrounded probabilities: measured at most 3.2e-5.
TOLERANCE = {"out": 4e-2, "lse": 1e-4}
# A bf16 q over FP8 K/V is rounded to e4m3 per (token, head) row first (attention/fp8_rows.py: 2.6% per randn row):
# against the reference on q itself, rather than on that rounding, the output moved by up to 5.4e-2 (H100, q =
# 3 randn, descales to 2: logits of standard deviation ~6).
BF16_Q_BOUND = 0.1


@pytest.fixture(autouse=True)
def poisoned_buffers(monkeypatch):
    """Outputs start as NaN, so that an element the kernel leaves unwritten fails the check."""
    monkeypatch.setattr(
        runtime, "new_buffer", lambda shape, dtype, device: poison(torch.empty(shape, dtype=dtype, device=device))
    )


def _e4m3(batch, seqlen, heads, head_dim):
    return torch.randn(batch, seqlen, heads, head_dim, device="cuda").clamp(-448, 448).to(FP8)


def _descale(batch, kv_heads):
    """Factors that differ per sequence and per KV head (0.05 to 2): a kernel that reads the wrong one fails."""
    return torch.rand(batch, kv_heads, device="cuda") * 1.95 + 0.05


def _backends() -> set:
    return {name for plan in PLANS.plans() for name, _ in plan.specs()}


def _check(q, k, v, what="", **kwargs):
    """attention with the LSE against the reference; asserts that the Gluon FP8 prefill ran. Returns (out, lse).

    A 16-bit q is compared with the reference on the q the kernel computes with, its per-row e4m3 rounding
    (:func:`fp8_rows.quantize_rows`), to the FP8 tolerance; and with the reference on q itself to a looser bound
    (what the rounding of q costs: measured up to 5.4e-2 with logits of standard deviation ~6)."""
    PLANS.clear()
    out, lse = attention(q, k, v, return_lse=True, **kwargs)
    assert _backends() == {"gluon_fp8_prefill"}, (what, _backends())
    ref_out, ref_lse = attention_reference(_as_computed(q), k, v, return_lse=True, **kwargs)
    assert out.dtype == (torch.bfloat16 if q.dtype == FP8 else q.dtype) and out.shape == q.shape, what
    if q.dtype != FP8:
        exact_q = attention_reference(q, k, v, **kwargs)
        print(
            f"{what}: out rel {_relative(out, ref_out):.3e} (to the reference on q itself {_relative(out, exact_q):.3e})"
        )
        assert_close_relative(out, exact_q, BF16_Q_BOUND, f"{what} out against the reference on q itself")
    else:
        print(f"{what}: out rel {_relative(out, ref_out):.3e}")  # (pytest -rP shows the measured errors)
    assert_close_relative(out, ref_out, TOLERANCE["out"], f"{what} out")
    seen = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), seen), f"{what}: the rows of -inf LSE differ"
    assert_close_relative(lse[seen], ref_lse[seen], TOLERANCE["lse"], f"{what} lse")
    if out.dim() == 4:  # [B, Sq, Hq]: queries that see no key
        blind = ~seen.transpose(1, 2)
    else:  # ragged: LSE [Hq, total_q], out [total_q, Hq, D]
        blind = ~seen.t()
    assert (out[blind] == 0).all(), f"{what}: a query that sees no key must give 0"
    return out, lse


def _as_computed(q):
    """The q the kernel computes with: an e4m3 q itself, a 16-bit one's per-row e4m3 rounding (float64)."""
    if q.dtype == FP8:
        return q
    q8, scale = quantize_rows(q)
    return q8.double() * scale.double().view(*q.shape[:-1], 1)


def _relative(out, ref) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_gqa_with_per_head_descales(head_dim, causal):
    """GQA (4 q heads per KV head), 1000 queries and keys (the last tiles partial), descales per (sequence, KV
    head); the same call with another sequence's descales is far off."""
    batch, kv_heads = 2, 2
    q, k, v = _e4m3(batch, 1000, 8, head_dim), _e4m3(batch, 1000, 2, head_dim), _e4m3(batch, 1000, 2, head_dim)
    descales = {name: _descale(batch, kv_heads) for name in ("q_descale", "k_descale", "v_descale")}
    out, _ = _check(q, k, v, causal=causal, what=f"D={head_dim} causal={causal}", **descales)
    swapped = {name: descale.flip(0) for name, descale in descales.items()}
    expected = attention_reference(q, k, v, causal=causal, **swapped)
    assert (out.double() - expected).norm() > 0.05 * expected.norm()


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize(
    "seqlen_q, seqlen_kv, causal",
    [(300, 700, True), (300, 700, False), (700, 300, True), (129, 1, True), (17, 257, False)],
)
def test_more_or_fewer_queries_than_keys(head_dim, seqlen_q, seqlen_kv, causal):
    """Sq != Skv: causal is bottom-right aligned (query i sees keys ``j <= i + Skv - Sq``); with Sq > Skv the first
    ``Sq - Skv`` queries see no key and give 0 (LSE -inf). (At most 16 queries a call takes the split-KV path.)"""
    q, k, v = _e4m3(2, seqlen_q, 4, head_dim), _e4m3(2, seqlen_kv, 1, head_dim), _e4m3(2, seqlen_kv, 1, head_dim)
    descales = {name: _descale(2, 1) for name in ("q_descale", "k_descale", "v_descale")}
    _check(q, k, v, causal=causal, what=f"{seqlen_q}x{seqlen_kv} causal={causal}", **descales)


@pytest.mark.parametrize("shapes", [(None, None, None), ((1, 1), (2, 1), (1, 2))], ids=["none", "broadcast"])
def test_descale_broadcasts_and_softmax_scale(shapes):
    """Descales None (1.0), ``[1, 1]``, ``[B, 1]`` and ``[1, Hkv]``, and a softmax scale that is not ``D^-0.5``."""
    q, k, v = _e4m3(2, 200, 4, 128), _e4m3(2, 333, 2, 128), _e4m3(2, 333, 2, 128)
    descales = {
        name: None if shape is None else _descale(*shape)
        for name, shape in zip(("q_descale", "k_descale", "v_descale"), shapes)
    }
    _check(q, k, v, causal=True, softmax_scale=0.03, what=str(shapes), **descales)


def test_views_give_the_contiguous_bits():
    """Offset and strided views of q, k, v (TMA reads some in place, the kernel copies the others) and views of the
    descales give the bits of the contiguous call."""
    batch, seqlen, head_dim = 2, 300, 64
    q, k, v = _e4m3(batch, seqlen, 4, head_dim), _e4m3(batch, seqlen, 2, head_dim), _e4m3(batch, seqlen, 2, head_dim)
    qd, kd, vd = _descale(batch, 2), _descale(batch, 2), _descale(batch, 2)
    PLANS.clear()
    expected = attention(q, k, v, causal=True, q_descale=qd, k_descale=kd, v_descale=vd)

    def offset_tokens(x):  # tokens 16 rows into a longer buffer: batch stride larger, 16-byte aligned (in place)
        big = torch.zeros(x.shape[0], x.shape[1] + 32, *x.shape[2:], device="cuda").to(FP8)
        big[:, 16 : 16 + x.shape[1]] = x
        return big[:, 16 : 16 + x.shape[1]]

    def every_other_head(x):  # heads not contiguous in a token row: copied for TMA
        big = torch.zeros(*x.shape[:2], 2 * x.shape[2], x.shape[3], device="cuda").to(FP8)
        big[:, :, 1::2] = x
        return big[:, :, 1::2]

    for make in (offset_tokens, every_other_head):
        out = attention(
            make(q),
            make(k),
            make(v),
            causal=True,
            q_descale=qd.t().contiguous().t(),
            k_descale=kd,
            v_descale=vd,
        )
        assert torch.equal(out.view(torch.int16), expected.view(torch.int16)), make.__name__
    assert _backends() == {"gluon_fp8_prefill"}, _backends()


@pytest.mark.parametrize(
    "head_dim, seqlen_q, seqlen_kv, kv_heads, q_dtype, mask",
    [
        (128, 1000, 1000, 2, FP8, dict(causal=True)),
        (64, 700, 333, 1, FP8, {}),
        (256, 300, 1025, 2, FP8, dict(causal=True)),
        (128, 513, 97, 2, torch.bfloat16, dict(mask=SlidingWindow(64, 16))),
    ],
)
def test_v_transposed_in_memory_gives_the_producers_bits(
    monkeypatch, head_dim, seqlen_q, seqlen_kv, kv_heads, q_dtype, mask
):
    """Dense K/V: V transposed in memory first (:func:`fp8_vt.transposed_v`, taken from ``V_READS`` work tiles per
    KV head) and V transposed tile by tile by the producer hold the same values in the same key order: the same
    bits, with keys that are not a multiple of 32 or of the tile, GQA, a bf16 q, a window, and a V whose heads are
    not adjacent (read in place by the transpose, copied for the producer's TMA)."""
    from llmkernels.attention import gluon_fp8_prefill

    q = _e4m3(2, seqlen_q, 8, head_dim)
    q = q if q_dtype == FP8 else q.to(q_dtype)
    k = _e4m3(2, seqlen_kv, kv_heads, head_dim)
    wide = _e4m3(2, seqlen_kv, 2 * kv_heads, head_dim)
    v = wide[:, :, 1::2]
    descales = {name: _descale(2, kv_heads) for name in ("q_descale", "k_descale", "v_descale")}
    if q_dtype != FP8:
        descales.pop("q_descale")
    outs = {}
    for reads in (1, 10**9):
        monkeypatch.setattr(gluon_fp8_prefill, "V_READS", reads)
        PLANS.clear()
        outs[reads] = attention(q, k, v, **mask, **descales)
        (spec,) = [spec for plan in PLANS.plans() for name, spec in plan.specs() if name == "gluon_fp8_prefill"]
        assert spec.constexprs["V_TRANSPOSED"] == (reads == 1)
    assert torch.equal(outs[1].view(torch.int16), outs[10**9].view(torch.int16))
    _check(q, k, v, what=f"V^T in memory, D={head_dim}", **mask, **descales)


def test_repeated_causal_calls_and_a_cuda_graph_give_the_same_bits():
    """Causal calls take their work tiles from a counter zeroed without a sync: repeated calls and the replays of a
    captured graph give the first call's bits."""
    q, k, v = _e4m3(2, 1000, 8, 128), _e4m3(2, 1000, 2, 128), _e4m3(2, 1000, 2, 128)
    descales = {name: _descale(2, 2) for name in ("q_descale", "k_descale", "v_descale")}
    PLANS.clear()
    first = attention(q, k, v, causal=True, **descales)
    for _ in range(3):
        assert torch.equal(attention(q, k, v, causal=True, **descales).view(torch.int16), first.view(torch.int16))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        attention(q, k, v, causal=True, **descales)  # planned outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = attention(q, k, v, causal=True, **descales)
    for _ in range(2):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured.view(torch.int16), first.view(torch.int16))
    assert _backends() == {"gluon_fp8_prefill"}, _backends()


@pytest.mark.parametrize("mask", [SlidingWindow(100, 0), SlidingWindow(64, 16)], ids=["left100", "left64right16"])
def test_sliding_windows(mask):
    """Sliding windows (bottom-right aligned, Sq != Skv): the blocks' first key tiles and the band bounds move."""
    q, k, v = _e4m3(2, 500, 4, 128), _e4m3(2, 700, 2, 128), _e4m3(2, 700, 2, 128)
    descales = {name: _descale(2, 2) for name in ("q_descale", "k_descale", "v_descale")}
    _check(q, k, v, mask=mask, what=str(mask), **descales)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_bf16_q_over_fp8_keys(causal):
    """A bf16 q over e4m3 K/V: q is quantized per row and runs on the e4m3 wgmmas; fp16 too (the output keeps q's
    dtype)."""
    k, v = _e4m3(2, 777, 2, 128), _e4m3(2, 777, 2, 128)
    descales = dict(k_descale=_descale(2, 2), v_descale=_descale(2, 2))
    for dtype in (torch.bfloat16, torch.float16):
        q = (torch.randn(2, 300, 8, 128, device="cuda") * 3).to(dtype)
        _check(q, k, v, causal=causal, what=f"{dtype} q causal={causal}", **descales)


def _ragged(lengths, heads, head_dim, dtype=FP8):
    total = sum(lengths)
    x = torch.randn(total, heads, head_dim, device="cuda").clamp(-448, 448).to(dtype)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    return x, cu


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_ragged_sequences(causal):
    """Ragged q and K/V (``cu_seqlens``): an empty sequence, lengths that are not multiples of the tiles, more
    queries than keys (rows that see no key), a sequence longer than one block; the last V tile of a sequence holds
    the next one's rows (zeroed on the way)."""
    q, cu_q = _ragged([300, 0, 129, 700, 5], 4, 128)
    k, cu_k = _ragged([500, 17, 64, 300, 1000], 2, 128)
    v = torch.randn_like(k, dtype=torch.float32).to(FP8)
    descales = {name: _descale(5, 2) for name in ("q_descale", "k_descale", "v_descale")}
    _check(q, k, v, causal=causal, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, what=f"ragged causal={causal}", **descales)


def _paged_cache(seqlens, page_size, kv_heads, head_dim):
    """An e4m3 cache with pages in a random order, the rows past each sequence's keys and the spare pages NaN
    (0x7F) and block-table entries past a sequence's pages out of range: only masked or zeroed values may reach
    the output."""
    pages_of = [-(-n // page_size) for n in seqlens]
    num_pages = sum(pages_of) + 3
    order = torch.randperm(num_pages).tolist()
    table = torch.full((len(seqlens), max(pages_of) + 2), 10**6, dtype=torch.int32)
    shape = (num_pages, page_size, kv_heads, head_dim)
    nan = torch.full(shape, 0x7F, dtype=torch.uint8, device="cuda").view(FP8)
    k_pages, v_pages = nan.clone(), nan.clone()
    cursor = 0
    for b, (n, count) in enumerate(zip(seqlens, pages_of)):
        table[b, :count] = torch.tensor(order[cursor : cursor + count], dtype=torch.int32)
        cursor += count
        for i in range(count):
            rows = min(page_size, n - i * page_size)
            for pages in (k_pages, v_pages):
                pages[table[b, i], :rows] = torch.randn(rows, kv_heads, head_dim, device="cuda").to(FP8)
    seqlens = torch.tensor(seqlens, dtype=torch.int32, device="cuda")
    return PagedKVCache(k_pages, v_pages, table.to("cuda"), seqlens)


@pytest.mark.parametrize("page_size", [16, 64, 256])
def test_chunked_prefill_over_a_paged_fp8_cache(page_size):
    """Chunked prefill: bf16 chunks of new queries over an e4m3 paged cache (shuffled pages, NaN past the keys),
    bottom-right causal, descales per sequence and KV head; an e4m3 q too, and ragged q."""
    cache = _paged_cache([1000, 77, 300], page_size, 2, 128)
    descales = dict(k_descale=_descale(3, 2), v_descale=_descale(3, 2))
    q = torch.randn(3, 60, 8, 128, device="cuda").to(torch.bfloat16)
    _check(q, None, None, kv_cache=cache, causal=True, what=f"paged {page_size}", **descales)
    q8 = q.to(FP8)
    _check(
        q8,
        None,
        None,
        kv_cache=cache,
        causal=True,
        what=f"paged {page_size} e4m3 q",
        q_descale=_descale(3, 2),
        **descales,
    )
    ragged_q, cu_q = _ragged([200, 0, 77], 8, 128, torch.bfloat16)
    _check(
        ragged_q,
        None,
        None,
        kv_cache=cache,
        cu_seqlens_q=cu_q,
        causal=True,
        what=f"paged {page_size} ragged q",
        **descales,
    )


@pytest.mark.parametrize("q_dtype", [FP8, torch.bfloat16], ids=["e4m3_q", "bf16_q"])
def test_sinks_fold_into_the_last_step(q_dtype):
    """Attention sinks run this kernel (the sink joins the denominator after P's 2^8 shift is taken out): ordinary
    sinks, one far above every score, +inf (O = 0, LSE = +inf), -inf (no sink); causal with more queries than keys
    (rows that see no key: O = 0, LSE = the sink); per-head descales; the sinks as a strided view (every other
    element; the others NaN)."""
    q, k, v = _e4m3(2, 300, 8, 128), _e4m3(2, 200, 2, 128), _e4m3(2, 200, 2, 128)
    q = q if q_dtype == FP8 else q.to(q_dtype)
    values = [0.0, 1.5, -2.0, 30.0, float("inf"), float("-inf"), 3.0, -0.5]
    sinks = torch.tensor([x for value in values for x in (value, float("nan"))], device="cuda")[::2]  # strided
    descales = {name: _descale(2, 2) for name in ("k_descale", "v_descale")}
    out, lse = _check(q, k, v, causal=True, sinks=sinks, what=f"sinks {q_dtype}", **descales)
    assert (out[:, :, 4] == 0).all() and torch.isinf(lse[:, 4]).all()
    assert (out[:, :100] == 0).all()
    torch.testing.assert_close(lse[:, :, :100], sinks[None, :, None].expand(2, -1, 100))
