"""FP8 attention (FlashAttention-3's convention): float8_e4m3fn K/V (and q) with float32 ``q_descale`` /
``k_descale`` / ``v_descale`` ``[B, Hkv]`` through the portable Triton kernel, against the float64 reference on the
dequantized inputs; every layout (dense, ragged, paged with shuffled pages), masks, sinks, LSE, split-KV decode; the
descales' broadcasts and views; the errors; appends into an FP8 cache (bits of the e4m3 rounding, saturation)."""

import dataclasses

import pytest
import torch

from llmkernels import runtime
from llmkernels.attention import config as attention_config
from llmkernels.attention import gluon_fp8_prefill, gluon_hopper, portable
from llmkernels.attention.api import attention
from llmkernels.attention.check import check_attention, check_fp8_capability
from llmkernels.attention.config import FA4Config, default_config, tiling
from llmkernels.attention.masks import SlidingWindow
from llmkernels.attention.paged import PagedKVCache
from llmkernels.attention.plan import PASSES, takes
from llmkernels.attention.reference import attention_reference
from llmkernels.testing import assert_close_relative, poison, relative_error

# The interpreter evaluates both sides of tl.where: -inf - -inf of fully masked rows warns in numpy.
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")

FP8 = torch.float8_e4m3fn
# Relative error (norm-wise) against the float64 reference on the dequantized inputs. The inputs are exact (e4m3
# values are bf16 / fp16 values); what remains is P rounded to the compute dtype before PV and O rounded to the
# output dtype (bf16: 2**-9 = 2.0e-3 per rounding; measured 3.6e-3 to 4.8e-3 at these shapes).
TOLERANCE = {torch.bfloat16: 1.2e-2, torch.float16: 4e-3, FP8: 1.2e-2, "lse": 1e-4}
SMALL = FA4Config(BM=16, BN=16, num_kv_stages=1)


@pytest.fixture(autouse=True)
def poisoned_buffers(monkeypatch):
    monkeypatch.setattr(
        runtime, "new_buffer", lambda shape, dtype, device: poison(torch.empty(shape, dtype=dtype, device=device))
    )


def _e4m3(shape, device, spread=3.0):
    """Random e4m3 values over several binades (normals, and subnormals at the small end)."""
    values = torch.randn(shape, device=device) * torch.exp2(torch.randn(shape, device=device) * spread / 3)
    return values.clamp(-448, 448).to(FP8)


def _descale(batch, kv_heads, device):
    """Factors that differ per sequence and per KV head (0.05 to 2): a kernel that reads the wrong one fails."""
    return (torch.rand(batch, kv_heads, device=device) * 1.95 + 0.05).float()


def _check(q, k, v, what="", **kwargs):
    """attention with return_lse against the float64 reference; returns (out, lse)."""
    out, lse = attention(q, k, v, return_lse=True, **kwargs)
    ref_out, ref_lse = attention_reference(q, k, v, return_lse=True, **kwargs)
    want = torch.bfloat16 if q.dtype == FP8 else q.dtype
    assert out.dtype == want and out.shape == q.shape, what
    assert_close_relative(out, ref_out, TOLERANCE[q.dtype], f"{what} out")
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite), f"{what}: -inf LSE rows differ"
    assert_close_relative(lse[finite], ref_lse[finite], TOLERANCE["lse"], f"{what} lse")
    return out, lse


def test_reference_reads_descales_as_dequantization(device):
    """The reference with descales is the reference on ``x.double() * descale`` (what the tests compare with)."""
    q, k, v = _e4m3((2, 5, 4, 16), device), _e4m3((2, 9, 2, 16), device), _e4m3((2, 9, 2, 16), device)
    qd, kd, vd = (_descale(2, 2, device) for _ in range(3))
    out = attention_reference(q, k, v, q_descale=qd, k_descale=kd, v_descale=vd, causal=True)

    def dequantized(x, descale):
        return x.double() * descale.double().repeat_interleave(x.shape[2] // 2, 1)[:, None, :, None]

    plain = attention_reference(dequantized(q, qd), dequantized(k, kd), dequantized(v, vd), causal=True)
    assert out.dtype == torch.float64 and torch.allclose(out, plain, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float16, FP8], ids=["bf16_q", "fp16_q", "fp8_q"])
def test_dense_gqa_causal(device, q_dtype):
    """GQA (4 q heads per KV head), causal, per-(sequence, KV head) descales; fp8 q gives a bf16 output."""
    batch, kv_heads = 2, 2
    q = (
        _e4m3((batch, 12, 8, 32), device)
        if q_dtype == FP8
        else torch.randn(batch, 12, 8, 32, device=device).to(q_dtype)
    )
    k, v = _e4m3((batch, 29, kv_heads, 32), device), _e4m3((batch, 29, kv_heads, 32), device)
    descales = dict(k_descale=_descale(batch, kv_heads, device), v_descale=_descale(batch, kv_heads, device))
    if q_dtype == FP8:
        descales["q_descale"] = _descale(batch, kv_heads, device)
    out, _ = _check(q, k, v, causal=True, config=SMALL, what=str(q_dtype), **descales)
    # the descales matter: the same call with the factors of another sequence is far off
    swapped = {name: d.flip(0) for name, d in descales.items()}
    assert relative_error(out, attention_reference(q, k, v, causal=True, **swapped)) > 0.05


def test_window_and_sinks(device):
    """A sliding window and sinks (natural-log logits, not scaled by the descales) with FP8 K/V."""
    q = torch.randn(1, 24, 4, 32, device=device).to(torch.bfloat16)
    k, v = _e4m3((1, 40, 2, 32), device), _e4m3((1, 40, 2, 32), device)
    _check(
        q,
        k,
        v,
        mask=SlidingWindow(7, 2),
        sinks=torch.randn(4, device=device),
        k_descale=_descale(1, 2, device),
        v_descale=_descale(1, 2, device),
        config=SMALL,
        what="window + sinks",
    )


def test_varlen(device):
    """Ragged q and K/V (an empty sequence included), fp8 q, descales ``[B, 1]`` (one factor per sequence)."""
    lengths_q, lengths_k = [5, 0, 11], [9, 4, 16]
    cu_q = torch.tensor([0, 5, 5, 16], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, 9, 13, 29], dtype=torch.int32, device=device)
    q = _e4m3((sum(lengths_q), 4, 32), device)
    k, v = _e4m3((sum(lengths_k), 2, 32), device), _e4m3((sum(lengths_k), 2, 32), device)
    _check(
        q,
        k,
        v,
        causal=True,
        cu_seqlens_q=cu_q,
        cu_seqlens_k=cu_k,
        max_seqlen_q=11,
        max_seqlen_k=16,
        q_descale=_descale(3, 1, device),
        k_descale=_descale(3, 1, device),
        v_descale=_descale(3, 1, device),
        config=SMALL,
        what="varlen",
    )


def _fp8_paged_cache(seqlens, page_size, kv_heads, head_dim, device):
    """Pages in a random order (shuffled block table); entries past a sequence's pages hold garbage ids."""
    pages_per_sequence = [max(1, -(-n // page_size)) for n in seqlens]
    num_pages = sum(pages_per_sequence) + 2
    order = torch.randperm(num_pages).tolist()
    block_table = torch.full((len(seqlens), max(pages_per_sequence) + 1), 10**6, dtype=torch.int32)
    cursor = 0
    for b, count in enumerate(pages_per_sequence):
        block_table[b, :count] = torch.tensor(order[cursor : cursor + count], dtype=torch.int32)
        cursor += count
    shape = (num_pages, page_size, kv_heads, head_dim)
    return PagedKVCache(
        _e4m3(shape, device),
        _e4m3(shape, device),
        block_table.to(device),
        torch.tensor(seqlens, dtype=torch.int32, device=device),
    )


def test_paged_decode_split_kv(device):
    """A paged FP8 cache (shuffled pages, vLLM's page size 16) read by split-KV decode: every split count gives
    the reference (per-tensor descales ``[1, 1]``, vLLM's k_scale / v_scale), and a short causal prefill."""
    cache = _fp8_paged_cache([37, 1, 0, 20], 16, 2, 32, device)
    q = torch.randn(4, 1, 8, 32, device=device).to(torch.bfloat16)
    descales = dict(k_descale=_descale(1, 1, device), v_descale=_descale(1, 1, device))
    outputs = [
        _check(q, None, None, kv_cache=cache, num_splits=splits, config=SMALL, what=f"splits={splits}", **descales)[0]
        for splits in (1, 3)
    ]
    assert relative_error(outputs[1], outputs[0]) < 6e-3
    prefill = torch.randn(4, 3, 8, 32, device=device).to(torch.bfloat16)
    _check(prefill, None, None, kv_cache=cache, causal=True, config=SMALL, what="paged prefill", **descales)


def test_dense_decode_splits_fp8_q(device):
    """Dense split-KV decode with fp8 q, K, V: the v descale scales each split's partial O (the combine is linear)."""
    q, k, v = _e4m3((2, 1, 4, 32), device), _e4m3((2, 50, 1, 32), device), _e4m3((2, 50, 1, 32), device)
    descales = {name: _descale(2, 1, device) for name in ("q_descale", "k_descale", "v_descale")}
    _check(q, k, v, num_splits=4, config=SMALL, what="decode", **descales)


def test_views_give_the_contiguous_bits(device):
    """Strided / offset / expanded views of q, k, v and of each descale give the bits of the contiguous call."""
    q, k, v = _e4m3((2, 9, 4, 32), device), _e4m3((2, 13, 2, 32), device), _e4m3((2, 13, 2, 32), device)
    qd, kd, vd = _descale(2, 2, device), _descale(2, 1, device), _descale(2, 2, device)
    expected = attention(q, k, v, q_descale=qd, k_descale=kd.expand(2, 2).contiguous(), v_descale=vd, config=SMALL)

    def strided(x):  # every other row of a larger tensor, at an offset
        big = torch.zeros((x.shape[0], 2 * x.shape[1] + 1, *x.shape[2:]), dtype=x.dtype, device=device)
        big[:, 1::2] = x
        return big[:, 1::2]

    qd_view = torch.zeros(2, 5, device=device)
    qd_view[:, 1:5:2] = qd  # offset, strided columns
    vd_view = vd.t().contiguous().t()  # transposed storage
    out = attention(
        strided(q),
        strided(k),
        strided(v),
        q_descale=qd_view[:, 1:5:2],
        k_descale=kd.expand(2, 2),  # stride 0
        v_descale=vd_view,
        config=SMALL,
    )
    assert torch.equal(out.view(torch.int16), expected.view(torch.int16))


def test_fp8_calls_take_the_gluon_fp8_prefill_or_the_portable_kernel(monkeypatch, device):
    """On an sm_90 GPU: FP8 K/V with an e4m3 or a bf16 q, dense, ragged or paged (pages TMA reads), full, causal or
    a sliding window, GQA, D 64, 128 or 256, descales or none, LSE or not, sinks or not, go to the Gluon FP8
    prefill; a split-KV call, pages TMA cannot read or an interpreter run go to the portable kernel; a bf16 call
    to the Gluon bf16 prefill."""
    monkeypatch.setattr(attention_config, "runs_gluon", lambda device: True)  # as on an H100, not the interpreter
    with runtime.pretend_gpu((9, 0)) as gpu:

        def chosen(q, k, v, causal=False, mask=None, sinks=None, return_lse=False, split=False, **kwargs):
            call = check_attention(
                q,
                k,
                v,
                causal,
                mask,
                None,
                sinks,
                None,
                None,
                None,
                None,
                None,
                None,
                None,
                return_lse,
                None,
                False,
                **kwargs,
            )
            call = dataclasses.replace(call, device=gpu, tma_ready=(True, True, True))
            config = default_config(call.head_dim, call.dtype, gpu)
            tiles = tiling(config, split, call.q_bound, call.group, call.batch, call.num_kv_heads, num_splits=2)
            return next(backend for backend in PASSES if takes(backend, call, tiles)).name

        bf16 = torch.zeros(2, 256, 8, 128, dtype=torch.bfloat16, device=device)
        q8, kv8 = bf16.to(FP8), bf16[:, :, :2].to(FP8)
        descales = {name: _descale(2, 2, device) for name in ("q_descale", "k_descale", "v_descale")}
        assert chosen(q8, kv8, kv8) == "gluon_fp8_prefill"
        assert chosen(q8, kv8, kv8, causal=True, return_lse=True, **descales) == "gluon_fp8_prefill"
        assert chosen(q8[..., :64], kv8[..., :64], kv8[..., :64], causal=True) == "gluon_fp8_prefill"
        assert chosen(q8, kv8, kv8, mask=SlidingWindow(-1, 0)) == "gluon_fp8_prefill"  # causal by another name
        assert chosen(bf16, bf16, bf16) == "gluon_prefill"
        assert chosen(bf16, kv8, kv8, causal=True) == "gluon_fp8_prefill"  # q quantized per row
        assert chosen(q8, kv8, kv8, mask=SlidingWindow(100, 0)) == "gluon_fp8_prefill"
        assert chosen(q8, kv8, kv8, sinks=torch.zeros(8, device=device)) == "gluon_fp8_prefill"
        assert chosen(q8, kv8, kv8, split=True) == "portable"
        wide = torch.zeros(2, 256, 8, 256, device=device).to(FP8)
        assert chosen(wide, wide[:, :, :2], wide[:, :, :2]) == "gluon_fp8_prefill"
        cu = torch.tensor([0, 100, 256], dtype=torch.int32, device=device)
        ragged = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=156, max_seqlen_k=156)
        call = check_attention(
            q8[0], kv8[0], kv8[0], True, None, None, None, None, *ragged.values(), None, None, False, None, False
        )
        call = dataclasses.replace(call, device=gpu, tma_ready=(True, True, True))
        tiles = tiling(default_config(128, call.dtype, gpu), False, call.q_bound, call.group, 2, 2)
        assert next(backend for backend in PASSES if takes(backend, call, tiles)).name == "gluon_fp8_prefill"
        cache = _fp8_paged_cache([200, 256], 16, 2, 128, device)
        for q in (q8, bf16):
            call = check_attention(
                q, None, None, True, None, None, None, None, None, None, None, None, cache, None, False, None, False
            )
            call = dataclasses.replace(call, device=gpu, tma_ready=(True, True, True))
            assert next(backend for backend in PASSES if takes(backend, call, tiles)).name == "gluon_fp8_prefill"
        call = dataclasses.replace(call, tma_ready=(True, False, False))  # pages TMA cannot read are never copied
        assert next(backend for backend in PASSES if takes(backend, call, tiles)).name == "portable"
    # the interpreter (or any GPU but sm_90): the portable kernel
    monkeypatch.setattr(attention_config, "runs_gluon", lambda device: False)
    call = check_attention(
        q8, kv8, kv8, False, None, None, None, None, None, None, None, None, None, None, False, None, False
    )
    assert not gluon_fp8_prefill.BACKEND.supports(call, tiles) and gluon_fp8_prefill.BACKEND.reads_fp8
    assert not gluon_hopper.BACKEND.supports(call, tiles)


def _sigma_reference(v: torch.Tensor) -> torch.Tensor:
    """fp8_vt's layout by indexing: ``[B, Hkv * D, S']``, column x of a 32-key block holding key sigma(x)."""
    batch, seqlen, heads, head_dim = v.shape
    padded = -(-seqlen // 32) * 32
    keys = torch.zeros(batch, padded, heads, head_dim, dtype=torch.uint8)
    keys[:, :seqlen] = v.cpu().view(torch.uint8)
    x = torch.arange(padded)
    b, h, c, e, p = x // 32, x // 16 % 2, x // 4 % 4, x // 2 % 2, x % 2
    return keys[:, 32 * b + 16 * h + 8 * e + 2 * c + p].permute(0, 2, 3, 1).reshape(batch, heads * head_dim, padded)


@pytest.mark.parametrize(
    "shape, view",
    [
        ((2, 100, 3, 64), "contiguous"),
        ((1, 32, 1, 128), "contiguous"),
        ((2, 1, 2, 256), "heads apart"),
        ((1, 257, 2, 128), "head-major"),
        ((3, 70, 2, 64), "batch broadcast"),
        ((2, 0, 2, 64), "contiguous"),
    ],
)
def test_transposed_v_permutes_keys_within_32_key_blocks(device, shape, view):
    """:func:`fp8_vt.transposed_v` (the FP8 prefill's V^T in memory): every element of ``[B, Hkv * D, S']`` written
    (the buffer starts as NaN), keys past S zero, for views of V with any strides."""
    from llmkernels.attention.fp8_vt import transposed_v

    batch, seqlen, heads, head_dim = shape
    if view == "heads apart":
        v = _e4m3((batch, seqlen, 2 * heads, head_dim), device)[:, :, 1::2]
    elif view == "head-major":
        v = _e4m3((batch, heads, seqlen, head_dim), device).transpose(1, 2)
    elif view == "batch broadcast":
        v = _e4m3((1, seqlen, heads, head_dim), device).expand(batch, -1, -1, -1)
    else:
        v = _e4m3(shape, device)
    out = transposed_v(v)
    assert out.dtype == FP8 and out.is_contiguous()
    assert torch.equal(out.cpu().view(torch.uint8), _sigma_reference(v))


def test_dense_fp8_prefill_transposes_v_in_memory_from_16_reads(device):
    """The FP8 prefill transposes dense V in memory once 16 work tiles read each KV head's V (query blocks of 128
    times q heads per KV head); ragged and paged K/V keep the producer's transpose."""
    from llmkernels.attention.gluon_fp8_prefill import V_READS, transposes_v

    assert V_READS == 16
    bf16 = torch.zeros(1, 1, 8, 64, dtype=torch.bfloat16, device=device)

    def call(seqlen_q, q_heads, kv_heads, **kwargs):
        q = bf16.expand(1, seqlen_q, 8, 64)[:, :, :q_heads].to(FP8)
        kv = bf16.expand(1, 256, 8, 64)[:, :, :kv_heads].to(FP8)
        return check_attention(q, kv, kv, False, *[None] * 10, False, None, False)

    assert transposes_v(call(2048, 2, 2))  # 16 query blocks
    assert not transposes_v(call(1920, 2, 2))  # 15
    assert transposes_v(call(256, 8, 1))  # 2 blocks x 8 q heads per KV head
    assert not transposes_v(call(128, 8, 1))
    assert not transposes_v(dataclasses.replace(call(4096, 8, 1), ragged=True))
    assert not transposes_v(dataclasses.replace(call(4096, 8, 1), paged=True))


@pytest.mark.parametrize("bad", [0.0, -0.5, float("nan"), float("inf")])
def test_validate_names_a_descale_that_is_not_a_positive_factor(device, bad):
    """With ``validate=True`` a descale entry that is not a finite factor > 0 raises naming it and its index
    (the FP8 kernels take the softmax max on raw scores), before any launch: the poisoned output never appears."""
    q = _e4m3((2, 32, 4, 64), device)
    kv = _e4m3((2, 48, 2, 64), device)
    good = _descale(2, 2, device)
    for name in ("q_descale", "k_descale", "v_descale"):
        descale = good.clone()
        descale[1, 0] = bad
        with pytest.raises(ValueError, match=rf"{name}\[1, 0\] = .* must be a finite factor > 0"):
            attention(q, kv, kv, validate=True, **{name: descale})
    out = attention(q, kv, kv, validate=True, q_descale=good, k_descale=good, v_descale=good)
    assert torch.isfinite(out.float()).all()


def test_fp8_needs_sm89():
    """Ampere has no e4m3 conversion: FP8 inputs on an sm_80 GPU are refused by name (sm_89+ pass)."""
    with runtime.pretend_gpu((8, 0)) as gpu, pytest.raises(ValueError, match="k is float8_e4m3fn on an sm_80"):
        check_fp8_capability("k", gpu)
    with runtime.pretend_gpu((9, 0)) as gpu:
        check_fp8_capability("k", gpu)


def _errors_cases(device):
    bf16 = torch.randn(2, 4, 4, 16, device=device).to(torch.bfloat16)
    kv8 = _e4m3((2, 6, 2, 16), device)
    kv16 = torch.randn(2, 6, 2, 16, device=device).to(torch.bfloat16)
    q8 = _e4m3((2, 4, 4, 16), device)
    good = _descale(2, 2, device)
    return [
        ((q8, kv16, kv16), {}, TypeError, "k dtype"),
        ((bf16, kv8, kv16), {}, TypeError, "v dtype"),
        ((bf16, kv16, kv8), {}, TypeError, "v dtype"),
        ((bf16, kv16, kv16), dict(k_descale=good), ValueError, "k_descale"),
        ((bf16, kv8, kv8), dict(q_descale=good), ValueError, "q_descale"),
        ((bf16, kv8, kv8), dict(k_descale=good.double()), TypeError, "k_descale"),
        ((bf16, kv8, kv8), dict(v_descale=good.to(torch.bfloat16)), TypeError, "v_descale"),
        ((bf16, kv8, kv8), dict(k_descale=[[1.0]]), TypeError, "k_descale"),
        ((bf16, kv8, kv8), dict(k_descale=_descale(2, 3, device)), ValueError, "k_descale"),
        ((bf16, kv8, kv8), dict(v_descale=_descale(3, 2, device)), ValueError, "v_descale"),
        ((bf16, kv8, kv8), dict(v_descale=good[0]), ValueError, "v_descale"),
        ((q8, kv8, kv8), dict(q_descale=torch.ones(2, 2, device="meta")), ValueError, "q_descale"),
        ((kv16[:, :, :, :0].float(), kv8, kv8), {}, TypeError, "q must be"),
    ]


@pytest.mark.parametrize("case", range(13))
def test_errors_name_the_argument(device, case, monkeypatch):
    """Wrong dtypes, shapes, devices or a descale without its fp8 tensor: TypeError / ValueError naming the
    argument, before any launch."""
    launched = []
    monkeypatch.setattr(portable.PortableLaunch, "__call__", lambda *a, **k: launched.append(1))
    (q, k, v), kwargs, error, name = _errors_cases(device)[case]
    with pytest.raises(error, match=name):
        attention(q, k, v, **kwargs)
    assert not launched


def test_paged_cache_dtype_rules(device):
    """FP8 pages: k and v pages of one dtype; a bf16 q reads them, an fp8 q needs fp8 pages."""
    cache = _fp8_paged_cache([5], 16, 1, 16, device)
    with pytest.raises(TypeError, match="v_pages"):
        PagedKVCache(cache.k_pages, cache.v_pages.to(torch.bfloat16), cache.block_table, cache.seqlens)
    bf16_cache = PagedKVCache(
        cache.k_pages.to(torch.bfloat16), cache.v_pages.to(torch.bfloat16), cache.block_table, cache.seqlens
    )
    with pytest.raises(TypeError, match="kv_cache.k_pages"):
        attention(_e4m3((1, 1, 2, 16), device), None, None, kv_cache=bf16_cache)


# --------------------------------------------------------------------------- appends into an e4m3 cache


def _e4m3_ties(count, device):
    """Values halfway between neighbouring e4m3 values (both signs; subnormal and normal binades): the cases round
    to nearest even decides."""
    codes = torch.arange(256, dtype=torch.uint8).view(FP8).float()
    values = codes[torch.isfinite(codes)].unique().sort().values
    middles = (values[1:] + values[:-1]) / 2
    middles = torch.cat([middles, -middles])
    return middles[torch.randint(middles.numel(), (count,))].to(device)


def _expected_e4m3(x: torch.Tensor, descale: torch.Tensor) -> torch.Tensor:
    """The bits an append stores: round to nearest even of ``x / descale`` (float32), saturated at ±448."""
    return (x.float() / descale).clamp(-448, 448).to(FP8).view(torch.uint8)


def test_append_bits_rounding_and_saturation(device):
    """``append_to_cache`` of bf16 keys into an e4m3 cache: the bits of the round-to-nearest-even e4m3 of ``k /
    descale`` (ties, subnormals, saturation at ±448 past the range, NaN kept), at positions ``start[b] + i`` of
    sequence ``cache_batch_idx[b]``; canary bytes around the cache (other positions, a head beyond Hkv, rows
    outside it) are untouched. Descales 0.5 / 2 / 0.25 (powers of two: the ties stay ties) and 0.3."""
    from llmkernels.attention.kv_append import append_to_cache

    batch, new_tokens, heads, head_dim, capacity = 3, 4, 2, 16, 8
    descale = torch.tensor([[0.5, 2.0], [0.25, 0.3], [1.0, 0.5]], device=device)
    ties = _e4m3_ties(batch * new_tokens * heads * head_dim, device).view(batch, new_tokens, heads, head_dim)
    new = (ties * descale[:, None, :, None]).to(torch.bfloat16)
    new[0, 0, 0, :4] = torch.tensor([1e4, -1e4, 460.0, float("nan")])  # x 0.5 descale: past 448 (and NaN)
    new[1, 1, 1] = torch.randn(head_dim) * 3  # not ties, a descale that is not a power of two
    buffer = torch.full((batch + 1, capacity + 2, heads + 1, head_dim), 0xA5, dtype=torch.uint8, device=device)
    cache = buffer[1:, 1 : capacity + 1, :heads].view(FP8)  # canaries on every side
    start = torch.tensor([0, 5, 2], dtype=torch.int32, device=device)  # sequence 1 reaches past the capacity
    cache_batch_idx = torch.tensor([2, 0, 1], dtype=torch.int32, device=device)
    append_to_cache(new, cache, start, cache_batch_idx=cache_batch_idx, descale=descale)

    expected = torch.full_like(buffer, 0xA5)
    for b in range(batch):
        for i in range(new_tokens):
            position = int(start[b]) + i
            if position < capacity:
                row = expected[1 + int(cache_batch_idx[b]), 1 + position, :heads]
                row.copy_(_expected_e4m3(new[b, i], descale[b][:, None]))
    nan = expected.view(FP8).float().isnan() & buffer.view(FP8).float().isnan()
    assert torch.equal(buffer[~nan], expected[~nan]), (buffer != expected).nonzero()[:5]
    assert buffer[3, 1, 0, 3] & 0x7F == 0x7F, "NaN stays NaN"
    # the descale as a transposed-storage view, new as a strided view: the same bits
    again = torch.full_like(buffer, 0xA5)
    wide = torch.zeros(batch, new_tokens, heads, 2 * head_dim, dtype=torch.bfloat16, device=device)
    wide[..., ::2] = new
    append_to_cache(
        wide[..., ::2],
        again[1:, 1 : capacity + 1, :heads].view(FP8),
        start,
        cache_batch_idx=cache_batch_idx,
        descale=descale.t().contiguous().t(),
    )
    assert torch.equal(again, buffer)
    assert buffer[3, 1, 0, :3].view(FP8).float().tolist() == [448.0, -448.0, 448.0], "saturated at 448"


def test_flash_attn_with_kvcache_fp8_paged(device):
    """flash_attn_with_kvcache on e4m3 pages (shuffled): bf16 k / v appended (bits of the rounding; every other
    byte of the pages unchanged), then attention over the cache with the descales matches the float64 reference,
    per-(sequence, KV head) k_descale and a per-tensor v_descale ``[1, 1]`` (vLLM's v_scale)."""
    from llmkernels.flash_attn import flash_attn_with_kvcache

    cache = _fp8_paged_cache([20, 33], 16, 2, 32, device)
    before = cache.k_pages.view(torch.uint8).clone(), cache.v_pages.view(torch.uint8).clone()
    cache_seqlens = torch.tensor([20, 33], dtype=torch.int32, device=device)
    q = torch.randn(2, 2, 8, 32, device=device).to(torch.bfloat16)
    k_new, v_new = (torch.randn(2, 2, 2, 32, device=device).to(torch.bfloat16) for _ in range(2))
    k_descale, v_descale = _descale(2, 2, device), _descale(1, 1, device)
    out = flash_attn_with_kvcache(
        q,
        cache.k_pages,
        cache.v_pages,
        k_new,
        v_new,
        cache_seqlens=cache_seqlens,
        block_table=cache.block_table,
        causal=True,
        k_descale=k_descale,
        v_descale=v_descale,
    )
    expected_k, expected_v = before[0].clone(), before[1].clone()
    for b in range(2):
        for i in range(2):
            position = int(cache_seqlens[b]) + i
            page = int(cache.block_table[b, position // 16])
            expected_k[page, position % 16] = _expected_e4m3(k_new[b, i], k_descale[b][:, None])
            expected_v[page, position % 16] = _expected_e4m3(v_new[b, i], v_descale[0][:, None])
    assert torch.equal(cache.k_pages.view(torch.uint8), expected_k)
    assert torch.equal(cache.v_pages.view(torch.uint8), expected_v)
    after = PagedKVCache(cache.k_pages, cache.v_pages, cache.block_table, cache_seqlens + 2)
    reference = attention_reference(
        q, None, None, kv_cache=after, causal=True, k_descale=k_descale, v_descale=v_descale
    )
    assert out.dtype == torch.bfloat16
    assert_close_relative(out, reference, TOLERANCE[torch.bfloat16], "flash_attn_with_kvcache fp8")


def test_flash_attn_functions_pass_the_descales(device):
    """flash_attn_func and flash_attn_varlen_func with FA3's descales give the bits of ``attention``'s call."""
    from llmkernels.flash_attn import flash_attn_func, flash_attn_varlen_func

    q, k, v = _e4m3((2, 6, 4, 32), device), _e4m3((2, 10, 2, 32), device), _e4m3((2, 10, 2, 32), device)
    descales = {name: _descale(2, 2, device) for name in ("q_descale", "k_descale", "v_descale")}
    expected = attention(q, k, v, causal=True, **descales)
    assert torch.equal(flash_attn_func(q, k, v, causal=True, **descales), expected)
    cu_q = torch.tensor([0, 6, 12], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, 10, 20], dtype=torch.int32, device=device)
    out = flash_attn_varlen_func(
        q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu_q, cu_k, 6, 10, causal=True, **descales
    )
    assert torch.equal(out.view(2, 6, 4, 32), expected)


def test_append_errors_name_the_argument(device):
    """Before anything is written: a descale for a 16-bit cache, float32 keys into an e4m3 cache, a descale of the
    wrong shape."""
    from llmkernels.flash_attn import flash_attn_with_kvcache

    q = torch.randn(2, 1, 4, 16, device=device).to(torch.bfloat16)
    cache8 = torch.zeros(2, 16, 2, 16, device=device).to(FP8)
    cache16 = torch.zeros(2, 16, 2, 16, device=device).to(torch.bfloat16)
    new = torch.randn(2, 1, 2, 16, device=device).to(torch.bfloat16)
    seqlens = torch.zeros(2, dtype=torch.int32, device=device)
    cases = [
        (cache16, new, dict(k_descale=_descale(2, 2, device)), ValueError, "k_descale"),
        (cache8, new.float(), {}, TypeError, "k dtype"),
        (cache8, new, dict(v_descale=_descale(2, 3, device)), ValueError, "v_descale"),
        (cache8, new, dict(k_descale=_descale(2, 2, device).half()), TypeError, "k_descale"),
    ]
    for cache, k_new, kwargs, error, name in cases:
        snapshot = cache.clone()
        with pytest.raises(error, match=name):
            flash_attn_with_kvcache(q, cache, cache.clone(), k_new, k_new, cache_seqlens=seqlens, **kwargs)
        assert torch.equal(
            cache.view(torch.uint8) if cache.dtype == FP8 else cache,
            snapshot.view(torch.uint8) if cache.dtype == FP8 else snapshot,
        )


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9), reason="needs an sm_89+ GPU"
)
def test_e4m3_to_bf16_on_the_gpu_gives_every_value_exactly():
    """The kernels' e4m3 -> bf16 conversion (PTX on the GPU) against torch's cast, bit for bit, over every finite
    e4m3 value (signs, zeros, subnormals, 448) in each of the four positions of a packed register."""
    import triton
    import triton.language as tl

    from llmkernels.attention.kernel import e4m3_to

    @triton.jit
    def convert(x_ptr, out_ptr, N: tl.constexpr):
        offsets = tl.arange(0, N)
        tl.store(out_ptr + offsets, e4m3_to(tl.load(x_ptr + offsets), tl.bfloat16, True))

    codes = torch.arange(256, dtype=torch.uint8)
    finite = codes[(codes & 0x7F) != 0x7F]  # 0x7F / 0xFF are NaN
    for shift in range(4):
        x = torch.roll(finite.repeat(5)[:1024], shift).cuda().view(FP8)
        out = torch.empty(1024, dtype=torch.bfloat16, device="cuda")
        convert[(1,)](x, out, N=1024)
        assert torch.equal(out.view(torch.int16), x.to(torch.bfloat16).view(torch.int16)), shift


_E4M3_SASS_SCRIPT = """
import os, re, subprocess, sys, tempfile
sys.path.insert(0, {tools!r})
import compile_common  # noqa: F401 - sets TRITON_INTERPRET=0 and the path to src first
import triton
from compile_attention import ATTENTION_CALLS, attention_cases
from triton.backends.compiler import GPUTarget

cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
calls = [call for call in ATTENTION_CALLS if call[0] == "decode d128 paged fp8 kv"]
case = attention_cases(90, calls)[0]
compiled = triton.compile(case.spec.ast_source(), target=GPUTarget("cuda", 90, 32), options=dict(case.spec.options))
with tempfile.NamedTemporaryFile(suffix=".cubin") as file:
    file.write(compiled.asm["cubin"])
    file.flush()
    sass = subprocess.run([cuobjdump, "-sass", file.name], capture_output=True, text=True, check=True).stdout
print(sass.count("F2F.BF16.F16"), sass.count("F2FP.F16.E4M3.UNPACK_B"), sass.count("F2FP.BF16.F32.PACK_AB"))
"""


def test_fp8_cache_decode_converts_without_the_quarter_rate_unit_on_sm90():
    """The paged FP8-cache decode pass built for sm_90a converts its e4m3 tiles by pairs (e4m3x2 -> f16x2 -> bf16x2
    packs), never through the one-element ``F2F.BF16.F16`` that Triton's own cast emits."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    if runtime.triton_version() < runtime.MIN_TRITON[9]:
        pytest.skip("this Triton does not compile for sm_90a")
    root = Path(__file__).resolve().parents[1]
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(root / "src"), env.get("PYTHONPATH", "")])
    script = _E4M3_SASS_SCRIPT.format(tools=str(root / "tools"))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    one_by_one, pairs, packs = map(int, done.stdout.split()[-3:])
    assert one_by_one == 0 and pairs > 0 and packs >= pairs, (one_by_one, pairs, packs)


def test_quantize_rows_rounds_each_row_to_its_own_scale(device):
    """:func:`fp8_rows.quantize_rows` (what the Gluon FP8 prefill does to a 16-bit q): a strided, offset view in,
    e4m3 out with the bits of torch's nearest-even cast of ``x / scale``, ``scale = amax / 448`` per (token, head)
    row (the row's largest element becomes ±448), a zero row kept 0; a ``[B, S, H, D]`` view strided in every dim
    gives the bits of its flattened copy."""
    from llmkernels.attention.fp8_rows import quantize_rows

    base = torch.randn(40, 6, 128, device=device) * torch.exp2(torch.randn(40, 6, 1, device=device) * 4)
    base[7, 2] = 0.0  # x[1, 1]
    x = base.to(torch.bfloat16)[5:37:2, 1:5]  # [16, 4, 128], token stride 2 rows, an offset head
    x8, scale = quantize_rows(x)
    assert x8.shape == x.shape and x8.dtype == FP8 and x8.is_contiguous() and scale.shape == (16, 4)
    amax = x.float().abs().amax(dim=-1)
    torch.testing.assert_close(scale, amax.clamp_min(1e-30) / 448, rtol=0, atol=0)
    expected = (x.float() / scale[..., None]).clamp(-448, 448).to(FP8)
    assert torch.equal(x8.view(torch.uint8), expected.view(torch.uint8))
    nonzero = amax > 0
    assert (x8.float().abs().amax(dim=-1)[nonzero] == 448).all()
    assert (x8[~nonzero].float() == 0).all() and (~nonzero).any()
    assert relative_error(x8.float() * scale[..., None], x.float()) < 0.04
    # [B, S, H, D] views too (the Gluon FP8 prefill's dense q), token-major scales, nothing copied
    wide = base.to(torch.bfloat16)[:32].view(4, 8, 6, 128)[:, 1:7, 2:5]  # [4, 6, 3, 128], strided in B, S and H
    w8, wscale = quantize_rows(wide)
    assert w8.shape == wide.shape and wscale.shape == (24, 3)
    flat8, flat_scale = quantize_rows(wide.reshape(24, 3, 128))
    assert torch.equal(w8.view(torch.uint8).reshape(24, 3, 128), flat8.view(torch.uint8))
    assert torch.equal(wscale, flat_scale)
