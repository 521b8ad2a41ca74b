"""llmkernels.attention against the float32 reference (and SDPA): layouts, GQA, masks, score mods, sinks,
FA4 switches, LSE, fully masked rows, tile skipping, bad input. Tiny shapes on the CPU interpreter;
realistic ones are marked ``gpu``. Every buffer the API allocates is poisoned with NaN first."""

import pytest
import torch
import triton
import triton.language as tl

from llmkernels import runtime
from llmkernels.attention import config as attention_config
from llmkernels.attention import layout as attention_layout
from llmkernels.attention.api import attention
from llmkernels.attention.config import FA4Config
from llmkernels.attention.kernel import exp2_poly
from llmkernels.attention.masks import Chunked, SlidingWindow, alibi, resolve_mask, softcap
from llmkernels.attention.paged import PagedKVCache
from llmkernels.attention.plan import PLANS
from llmkernels.attention.reference import attention_reference, paged_to_dense
from llmkernels.runtime import interpreting
from llmkernels.testing import assert_close_relative, poison

# The interpreter evaluates both sides of tl.where: -inf - -inf of fully masked rows warns in numpy.
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")

# Relative-error tolerances (‖out − ref‖ / ‖ref‖), one table for the module.
TOLERANCE = {
    torch.float16: 4e-3,  # P and O rounded to fp16
    torch.bfloat16: 2e-2,  # P and O rounded to bf16 (8-bit mantissa)
    "lse": 1e-4,  # float32 LSE; the exp2 polynomial adds <= 9e-5 relative to l
    "gpu_bf16": 2e-2,
}

CPU_CONFIG = FA4Config(BM=32, BN=16, num_q_tiles=2, num_kv_stages=1)  # small tiles: many tiles per problem


@pytest.fixture(autouse=True)
def poisoned_buffers(monkeypatch):
    """Every output / partial buffer starts as NaN, so an element the kernels forget to write fails."""
    monkeypatch.setattr(
        runtime, "new_buffer", lambda shape, dtype, device: poison(torch.empty(shape, dtype=dtype, device=device))
    )


def _qkv(batch, seqlen_q, seqlen_k, num_q_heads, num_kv_heads, head_dim, dtype, device):
    q = torch.randn(batch, seqlen_q, num_q_heads, head_dim, dtype=dtype, device=device)
    k = torch.randn(batch, seqlen_k, num_kv_heads, head_dim, dtype=dtype, device=device)
    v = torch.randn(batch, seqlen_k, num_kv_heads, head_dim, dtype=dtype, device=device)
    return q, k, v


def _check(q, k, v, tolerance=None, what="", **kwargs):
    """Runs attention with return_lse and compares out and LSE with the reference; returns (out, lse)."""
    out, lse = attention(q, k, v, return_lse=True, **kwargs)
    ref_out, ref_lse = attention_reference(q, k, v, return_lse=True, **kwargs)
    assert out.dtype == q.dtype and out.shape == q.shape
    assert_close_relative(out, ref_out, tolerance or TOLERANCE[q.dtype], f"{what} out")
    _check_lse(lse, ref_lse, what)
    return out, lse


def _check_lse(lse, ref_lse, what=""):
    assert lse.shape == ref_lse.shape, f"{what}: lse shape {tuple(lse.shape)} != {tuple(ref_lse.shape)}"
    assert not torch.isnan(lse).any(), f"{what}: NaN in lse"
    ref_empty = torch.isinf(ref_lse)
    assert torch.equal(torch.isinf(lse), ref_empty), f"{what}: -inf LSE rows differ"
    if (~ref_empty).any():
        assert_close_relative(lse[~ref_empty], ref_lse[~ref_empty], TOLERANCE["lse"], f"{what} lse")


def _paged_cache(seqlens, page_size, num_kv_heads, head_dim, dtype, device, extra_pages=3):
    """A cache whose pages are a random permutation (shuffled block table); unused entries hold garbage."""
    pages_per_seq = [max(1, -(-n // page_size)) for n in seqlens]
    max_pages = max(pages_per_seq) + 1
    num_pages = sum(pages_per_seq) + extra_pages
    permutation = torch.randperm(num_pages).tolist()
    block_table = torch.full((len(seqlens), max_pages), 10**6, dtype=torch.int32)
    cursor = 0
    for b, count in enumerate(pages_per_seq):
        block_table[b, :count] = torch.tensor(permutation[cursor : cursor + count], dtype=torch.int32)
        cursor += count
    k_pages = torch.randn(num_pages, page_size, num_kv_heads, head_dim, dtype=dtype, device=device)
    v_pages = torch.randn(num_pages, page_size, num_kv_heads, head_dim, dtype=dtype, device=device)
    return PagedKVCache(
        k_pages, v_pages, block_table.to(device), torch.tensor(seqlens, dtype=torch.int32, device=device)
    )


def _cu_seqlens(lengths, device):
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    return torch.tensor(offsets, dtype=torch.int32, device=device)


@triton.jit
def checker_mask(b, h, q_idx, kv_idx):
    return ((q_idx + kv_idx + h + b) % 3) != 0


@triton.jit
def biased_score(score, b, h, q_idx, kv_idx):
    return score + 0.25 * h - 0.05 * (q_idx - kv_idx) + 0.1 * b


# --------------------------------------------------------------------------- dense prefill


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("heads", [(2, 2), (4, 1), (8, 2), (8, 1)], ids=["mha", "mqa", "gqa4", "gqa8"])
@pytest.mark.parametrize("causal", [False, True])
def test_dense(device, dtype, heads, causal):
    q, k, v = _qkv(2, 37, 45, heads[0], heads[1], 32, dtype, device)
    _check(q, k, v, causal=causal, config=CPU_CONFIG, what=f"{heads} causal={causal}")


@pytest.mark.parametrize("head_dim", [16, 48, 64, 128])
def test_head_dims(device, head_dim):
    q, k, v = _qkv(1, 20, 33, 2, 1, head_dim, torch.float16, device)
    _check(q, k, v, causal=True, config=CPU_CONFIG, what=f"D={head_dim}")


@pytest.mark.parametrize("seqlens", [(1, 1), (1, 30), (30, 1), (17, 0), (64, 64)])
def test_short_and_empty_sequences(device, seqlens):
    q, k, v = _qkv(2, seqlens[0], seqlens[1], 2, 2, 16, torch.float16, device)
    out, lse = _check(q, k, v, causal=True, config=CPU_CONFIG, num_splits=1, what=str(seqlens))
    if seqlens[1] == 0:
        assert torch.all(out == 0) and torch.all(lse == float("-inf"))


def test_default_config_and_scale(device):
    q, k, v = _qkv(1, 24, 24, 4, 2, 32, torch.bfloat16, device)
    _check(q, k, v, causal=True, softmax_scale=0.3, what="default config")


@pytest.mark.parametrize(
    "causal, mask, band",
    [
        (False, None, None),
        (True, None, None),
        (False, SlidingWindow(100, 27), 128),
        (True, SlidingWindow(63, -1), 64),
        (False, SlidingWindow(-1, 5), None),
        (True, Chunked(256), 256),
        (False, (SlidingWindow(500, 500), Chunked(64)), 64),
    ],
)
def test_visible_band_of_masks(causal, mask, band):
    assert resolve_mask(causal, mask).visible_band == band


def test_hopper_defaults_narrow_tiles_for_short_windows(monkeypatch):
    """On sm90 a D=128 prefill whose queries see at most 4096 keys takes 64 x 64 tiles; wider bands, other
    head dims and decode keep their tiles."""
    monkeypatch.setattr(attention_config, "cuda_capability", lambda device: (9, 0))
    default = attention_config.default_config.__wrapped__
    device = torch.device("cuda", 0)
    wide = default(128, torch.bfloat16, device)
    assert (wide.BM, wide.BN) == (128, 128)
    assert default(128, torch.bfloat16, device, visible_band=8193) == wide
    narrow = default(128, torch.bfloat16, device, visible_band=4096)
    assert (narrow.BM, narrow.BN, narrow.num_warps) == (64, 64, 4)
    assert default(64, torch.bfloat16, device, visible_band=128) == default(64, torch.bfloat16, device)
    assert default(128, torch.bfloat16, device, decode=True, visible_band=128) == default(
        128, torch.bfloat16, device, decode=True
    )


def test_strided_inputs(device):
    """q/k/v as transposed views of [B, H, S, D] tensors (flash-attn layout from SDPA layout)."""
    q = torch.randn(2, 4, 19, 32, dtype=torch.float16, device=device).transpose(1, 2)
    k = torch.randn(2, 2, 26, 32, dtype=torch.float16, device=device).transpose(1, 2)
    v = torch.randn(2, 2, 26, 32, dtype=torch.float16, device=device).transpose(1, 2)
    _check(q, k, v, causal=False, config=CPU_CONFIG, what="strided")


def test_matches_sdpa(device):
    q, k, v = _qkv(2, 40, 40, 4, 2, 32, torch.float16, device)
    out = attention(q, k, v, causal=True, config=CPU_CONFIG)
    expected = torch.nn.functional.scaled_dot_product_attention(
        q.float().transpose(1, 2), k.float().transpose(1, 2), v.float().transpose(1, 2), is_causal=True, enable_gqa=True
    ).transpose(1, 2)
    assert_close_relative(out, expected, TOLERANCE[torch.float16], "sdpa")


# --------------------------------------------------------------------------- FA4 switches

FA4_CONFIGS = [
    FA4Config(BM=16, BN=16, num_q_tiles=1, rescale_threshold=0.0),
    FA4Config(BM=32, BN=16, num_q_tiles=2, rescale_threshold=0.0),
    FA4Config(BM=32, BN=16, num_q_tiles=2, rescale_threshold=8.0),
    FA4Config(BM=32, BN=32, num_q_tiles=2, rescale_threshold=15.0, poly_exp2_fraction=0.5),
    FA4Config(BM=16, BN=16, num_q_tiles=1, rescale_threshold=4.0, poly_exp2_fraction=0.25),
    FA4Config(BM=32, BN=16, num_q_tiles=2, rescale_threshold=8.0, poly_exp2_fraction=0.75),
    FA4Config(BM=64, BN=32, num_q_tiles=2, rescale_threshold=2.0, poly_exp2_fraction=1.0),
    FA4Config(BM=16, BN=16, num_q_tiles=1, rescale_threshold=8.0, tma_kv=False),
]


@pytest.mark.parametrize(
    "config",
    FA4_CONFIGS,
    ids=lambda c: (
        f"BM{c.BM}BN{c.BN}x{c.num_q_tiles}"
        f"-t{c.rescale_threshold:g}-p{c.poly_exp2_fraction:g}"
        f"{'' if c.tma_kv else '-notma'}"
    ),
)
def test_fa4_switches(device, config):
    q, k, v = _qkv(1, 50, 61, 4, 2, 32, torch.float16, device)
    _check(q, k, v, causal=True, sinks=torch.randn(4, device=device), config=config, what="fa4")


@pytest.mark.parametrize("threshold", [0.0, 3.0, 8.0])
def test_conditional_rescale_exact_with_growing_scores(device, threshold):
    """Scores that grow steadily along the keys (the running max moves every tile by less or more than
    the threshold) and a large softmax_scale: the stale-max path must still be exact and finite."""
    seqlen = 64
    q = torch.ones(1, 8, 1, 16, dtype=torch.float16, device=device)
    ramp = torch.linspace(-4, 4, seqlen, device=device).view(1, seqlen, 1, 1)
    k = (ramp + 0.1 * torch.randn(1, seqlen, 1, 16, device=device)).half()
    v = torch.randn(1, seqlen, 1, 16, dtype=torch.float16, device=device)
    config = FA4Config(BM=16, BN=16, rescale_threshold=threshold, poly_exp2_fraction=0.5)
    _check(q, k, v, softmax_scale=2.0, config=config, what=f"ramp t={threshold}")


@triton.jit
def run_exp2_poly(x_ptr, y_ptr, N: tl.constexpr):
    offsets = tl.arange(0, N)
    tl.store(y_ptr + offsets, exp2_poly(tl.load(x_ptr + offsets)))


def test_exp2_polynomial(device):
    x = torch.cat([torch.linspace(-130, 15, 1016), torch.tensor([float("-inf"), 0.0, -126.0, 1.0] + [0.5] * 4)])
    x = x.to(device)
    y = torch.empty_like(x)
    run_exp2_poly[(1,)](x, y, N=x.numel())
    expected = torch.exp2(x.double())
    normal = x >= -126
    assert (y[~normal] == 0).all()
    assert ((y[normal].double() - expected[normal]).abs() / expected[normal]).max() < 1e-4


# --------------------------------------------------------------------------- ragged


@pytest.mark.parametrize("heads", [(4, 4), (4, 1), (8, 2)], ids=["mha", "mqa", "gqa4"])
@pytest.mark.parametrize("causal", [False, True])
def test_ragged(device, heads, causal):
    lengths_q = [5, 0, 1, 33, 17]
    lengths_k = [9, 4, 1, 33, 40]
    q = torch.randn(sum(lengths_q), heads[0], 32, dtype=torch.bfloat16, device=device)
    k = torch.randn(sum(lengths_k), heads[1], 32, dtype=torch.bfloat16, device=device)
    v = torch.randn_like(k)
    kwargs = dict(
        cu_seqlens_q=_cu_seqlens(lengths_q, device),
        cu_seqlens_k=_cu_seqlens(lengths_k, device),
        causal=causal,
        sinks=torch.randn(heads[0], device=device),
    )
    _check(q, k, v, config=CPU_CONFIG, max_seqlen_q=33, max_seqlen_k=40, what="ragged", **kwargs)
    if heads == (4, 4):  # the bounds read from cu_seqlens: one head layout is enough (CI time)
        _check(q, k, v, config=CPU_CONFIG, what="ragged, no max_seqlen", **kwargs)


# --------------------------------------------------------------------------- paged


@pytest.mark.parametrize("page_size", [16, 32])
@pytest.mark.parametrize("ragged_q", [False, True])
def test_paged_prefill(device, page_size, ragged_q):
    seqlens = [40, 7, 0, 65]
    cache = _paged_cache(seqlens, page_size, 2, 32, torch.float16, device)
    if ragged_q:
        lengths_q = [12, 7, 0, 20]
        q = torch.randn(sum(lengths_q), 8, 32, dtype=torch.float16, device=device)
        kwargs = dict(cu_seqlens_q=_cu_seqlens(lengths_q, device))
    else:
        q = torch.randn(4, 6, 8, 32, dtype=torch.float16, device=device)
        kwargs = {}
    _check(q, None, None, kv_cache=cache, causal=True, config=CPU_CONFIG, num_splits=1, what="paged", **kwargs)


def test_paged_matches_dense(device):
    seqlens = [33, 33]
    cache = _paged_cache(seqlens, 16, 2, 16, torch.float16, device)
    k = torch.stack([paged_to_dense(cache, b, 33)[0] for b in range(2)])
    v = torch.stack([paged_to_dense(cache, b, 33)[1] for b in range(2)])
    q = torch.randn(2, 9, 4, 16, dtype=torch.float16, device=device)
    paged = attention(q, None, None, kv_cache=cache, causal=True, config=CPU_CONFIG, num_splits=1)
    dense = attention(q, k, v, causal=True, config=CPU_CONFIG, num_splits=1)
    assert torch.equal(paged, dense)


@pytest.mark.parametrize("split", [1, 3])
def test_paged_starts_skip_leading_positions(device, split):
    """``PagedKVCache.starts`` (flash-attn's cache_leftpad): sequence b attends cache positions starts[b] ..
    seqlens[b] - 1 as its keys 0, 1, ... (causal alignment from there); a start past the end clamps (no keys)."""
    seqlens, starts = [40, 7, 65, 20], [5, 7, 0, 30]
    cache = _paged_cache(seqlens, 16, 2, 32, torch.float16, device)
    cache = PagedKVCache(
        cache.k_pages,
        cache.v_pages,
        cache.block_table,
        cache.seqlens,
        torch.tensor(starts, dtype=torch.int32, device=device),
    )
    q = torch.randn(4, 6, 8, 32, dtype=torch.float16, device=device)
    _check(q, None, None, kv_cache=cache, causal=True, config=CPU_CONFIG, num_splits=split, what="paged starts")
    out = attention(q, None, None, kv_cache=cache, causal=True, config=CPU_CONFIG, num_splits=split)
    for b in (0, 2):  # against the dense call on the same keys
        k, v = paged_to_dense(cache, b, seqlens[b])
        dense = attention(
            q[b : b + 1], k[starts[b] :][None], v[starts[b] :][None], causal=True, config=CPU_CONFIG, num_splits=split
        )
        assert_close_relative(out[b : b + 1].float(), dense.float(), 1e-3)
    assert not out[1].any() and not out[3].any()  # no keys: zero output
    with pytest.raises(ValueError, match="starts"):
        attention(
            q,
            None,
            None,
            kv_cache=PagedKVCache(cache.k_pages, cache.v_pages, cache.block_table, cache.seqlens, cache.starts + 50),
            validate=True,
        )
    with pytest.raises(TypeError, match="starts"):
        PagedKVCache(cache.k_pages, cache.v_pages, cache.block_table, cache.seqlens, cache.starts.long())


# --------------------------------------------------------------------------- materialized masks (SDPA's attn_mask)


def _mask_inputs(device, batch=3, seqlen_q=37, seqlen_k=53, heads=4, kv_heads=2, dim=32):
    q = torch.randn(batch, seqlen_q, heads, dim, dtype=torch.float16, device=device)
    k = torch.randn(batch, seqlen_k, kv_heads, dim, dtype=torch.float16, device=device)
    v = torch.randn(batch, seqlen_k, kv_heads, dim, dtype=torch.float16, device=device)
    return q, k, v


@pytest.mark.parametrize("split", [1, 3])
def test_bool_padding_mask(device, split):
    """[B, 1, 1, Skv] key padding (one sequence with no key left: output 0, LSE -inf), with causal."""
    q, k, v = _mask_inputs(device)
    keep = torch.ones(3, 1, 1, 53, dtype=torch.bool, device=device)
    keep[0, ..., 40:] = False
    keep[1] = False
    keep[2, ..., ::3] = False
    out, lse = _check(q, k, v, mask=keep, causal=True, config=CPU_CONFIG, num_splits=split, what="padding")
    assert not out[1].any() and torch.isneginf(lse[1]).all()


def test_additive_bias_with_window_sinks_and_gqa(device):
    """A float bias [1, Hq, Sq, Skv] (some -inf) added to the scaled scores, under a window, sinks and GQA."""
    q, k, v = _mask_inputs(device)
    bias = torch.randn(1, 4, 37, 53, device=device)
    bias[..., 5] = float("-inf")
    sinks = torch.randn(4, device=device)
    _check(q, k, v, mask=(bias, SlidingWindow(12, 4)), sinks=sinks, config=CPU_CONFIG, num_splits=1, what="bias")
    _check(q, k, v, mask=bias.to(torch.bfloat16), causal=True, config=CPU_CONFIG, num_splits=2, what="bf16 bias")


def test_mask_views_and_paged_decode(device):
    """A full [B, Hq, Sq, Skv] bool mask as a transposed view and as an expanded one; paged decode with a mask
    over the block table's width."""
    q, k, v = _mask_inputs(device)
    dense = torch.rand(3, 4, 53, 37, device=device).transpose(-1, -2) > 0.3
    _check(q, k, v, mask=dense, config=CPU_CONFIG, num_splits=1, what="transposed mask")
    expanded = (torch.rand(1, 1, 37, 53, device=device) > 0.5).expand(3, 4, 37, 53)
    assert torch.equal(
        attention(q, k, v, mask=expanded, config=CPU_CONFIG, num_splits=1),
        attention(q, k, v, mask=expanded.contiguous(), config=CPU_CONFIG, num_splits=1),
    )
    cache = _paged_cache([40, 7, 65], 16, 2, 32, torch.float16, device)
    q1 = torch.randn(3, 2, 4, 32, dtype=torch.float16, device=device)
    keep = torch.rand(3, 1, 2, cache.max_seqlen_bound, device=device) > 0.4
    _check(q1, None, None, kv_cache=cache, mask=keep, causal=True, config=CPU_CONFIG, num_splits=3, what="paged mask")


def test_mask_tensor_errors(device):
    q, k, v = _mask_inputs(device)
    with pytest.raises(ValueError, match="broadcast"):
        attention(q, k, v, mask=torch.ones(3, 4, 37, 52, dtype=torch.bool, device=device))
    with pytest.raises(TypeError, match="mask tensor"):
        attention(q, k, v, mask=torch.ones(1, 53, dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match="at most one"):
        keep = torch.ones(53, dtype=torch.bool, device=device)
        attention(q, k, v, mask=(keep, keep))
    with pytest.raises(ValueError, match="grad"):
        attention(q, k, v, mask=torch.zeros(53, device=device, requires_grad=True))
    ragged_q = q.reshape(-1, 4, 32)
    cu = _cu_seqlens([37, 37, 37], device)
    with pytest.raises(ValueError, match="dense q"):
        attention(
            ragged_q,
            k.reshape(-1, 2, 32)[:111],
            v.reshape(-1, 2, 32)[:111],
            cu_seqlens_q=cu,
            cu_seqlens_k=cu,
            mask=torch.ones(53, dtype=torch.bool, device=device),
        )


# --------------------------------------------------------------------------- masks and score mods

MASKS = {
    "window": dict(mask=SlidingWindow(7, 3)),
    "window_causal": dict(mask=SlidingWindow(9, -1), causal=True),
    "window_left_only": dict(mask=SlidingWindow(-1, 2)),
    "window_0_0": dict(mask=SlidingWindow(0, 0)),
    "chunked": dict(mask=Chunked(16)),
    "chunked_causal": dict(mask=Chunked(12), causal=True),
    "mask_mod": dict(mask=checker_mask),
    "mask_mod_causal": dict(mask=checker_mask, causal=True),
    "window_and_mask_mod": dict(mask=(SlidingWindow(10, 10), checker_mask)),
    "chunk_and_window": dict(mask=(Chunked(20), SlidingWindow(5, 0))),
}


@pytest.mark.parametrize("name", list(MASKS))
def test_masks(device, name):
    q, k, v = _qkv(2, 30, 52, 4, 2, 16, torch.float16, device)
    _check(q, k, v, config=CPU_CONFIG, what=name, **MASKS[name])


@pytest.mark.parametrize("name", ["softcap", "alibi", "user"])
@pytest.mark.parametrize("causal", [False, True])
def test_score_mods(device, name, causal):
    q, k, v = _qkv(2, 21, 35, 4, 2, 32, torch.bfloat16, device)
    mod = {"softcap": softcap(2.5), "alibi": alibi(torch.rand(4, device=device)), "user": biased_score}[name]
    _check(q, k, v, config=CPU_CONFIG, causal=causal, score_mod=mod, softmax_scale=0.5, what=name)


def test_score_mod_with_mask_and_sinks_ragged(device):
    lengths = [12, 0, 29]
    q = torch.randn(sum(lengths), 4, 16, dtype=torch.float16, device=device)
    k = torch.randn(sum(lengths), 4, 16, dtype=torch.float16, device=device)
    v = torch.randn_like(k)
    cu = _cu_seqlens(lengths, device)
    _check(
        q,
        k,
        v,
        cu_seqlens_q=cu,
        cu_seqlens_k=cu,
        max_seqlen_q=29,
        causal=True,
        mask=SlidingWindow(6, 0),
        score_mod=softcap(5.0),
        sinks=torch.randn(4, device=device),
        config=CPU_CONFIG,
        what="combo",
    )


def test_hidden_tiles_are_skipped(device):
    """Keys that no query can see are NaN: a kernel that loads such tiles and discards them gets NaN
    (0 * NaN in P @ V); one that skips them by its loop bounds gets the right answer."""
    q, k, v = _qkv(1, 16, 80, 2, 2, 16, torch.float16, device)
    k[:, :48] = float("nan")
    v[:, :48] = float("nan")  # queries sit at positions 64..79 and see 8 keys back at most
    config = FA4Config(BM=16, BN=16, num_q_tiles=1)
    for num_splits in (1, 3):
        out = attention(q, k, v, causal=True, mask=SlidingWindow(8, 0), config=config, num_splits=num_splits)
        ref = attention_reference(q, k.nan_to_num(), v.nan_to_num(), causal=True, mask=SlidingWindow(8, 0))
        assert_close_relative(out, ref, TOLERANCE[torch.float16], f"skip, splits={num_splits}")
    k2, v2 = k.clone(), v.clone()
    k2[:, 64:] = float("nan")  # chunked: the first chunk of 64 is invisible to the queries in the second
    v2[:, 64:] = float("nan")
    k2[:, :48] = torch.randn(1, 48, 2, 16, dtype=torch.float16, device=device)
    v2[:, :48] = torch.randn(1, 48, 2, 16, dtype=torch.float16, device=device)
    q2 = torch.randn(1, 80, 2, 16, dtype=torch.float16, device=device)
    out = attention(q2[:, :64], k2[:, :64], v2[:, :64], causal=True, mask=Chunked(32), config=config)
    ref = attention_reference(q2[:, :64], k2[:, :64], v2[:, :64], causal=True, mask=Chunked(32))
    assert_close_relative(out, ref, TOLERANCE[torch.float16], "chunked skip")


def test_tma_descriptors_only_for_token_row_layouts(device):
    """K/V descriptors ([tokens, Hkv * D] views) exist for contiguous dense and ragged K/V and for
    q/k/v split from one packed qkv projection; not for a head-major layout (heads not contiguous in
    a token row) or misaligned rows."""
    _, k, v = _qkv(2, 1, 40, 2, 2, 32, torch.float16, device)
    assert attention_layout.kv_token_rows(k, v, False)
    k_desc = attention_layout.token_row_descriptor(k, False, 16)
    assert k_desc.shape == [80, 64] and k_desc.strides == [64, 1] and k_desc.block_shape == [16, 32]
    qkv = torch.randn(2, 40, 3, 2, 32, dtype=torch.float16, device=device)  # packed projection
    assert attention_layout.kv_token_rows(qkv[:, :, 1], qkv[:, :, 2], False)
    k_desc = attention_layout.token_row_descriptor(qkv[:, :, 1], False, 16)
    assert k_desc.shape == [80, 64] and k_desc.strides == [192, 1]
    assert attention_layout.kv_token_rows(k[0], v[0], True)  # ragged [total_k, Hkv, D]
    head_major = torch.randn(2, 2, 40, 32, dtype=torch.float16, device=device).transpose(1, 2)
    assert not attention_layout.kv_token_rows(head_major, head_major, False)
    odd_rows = torch.randn(2, 40, 2, 36, dtype=torch.float16, device=device)[..., :32]  # 72-byte rows
    assert not attention_layout.kv_token_rows(odd_rows, odd_rows, False)


def _tma_kv(plans) -> list[bool]:
    """Per plan made, whether its portable launches read K/V through tensor descriptors."""
    return [spec.constexprs["TMA_KV"] for plan in plans for name, spec in plan.specs() if name == "portable"]


@pytest.mark.parametrize("layout", ["dense", "ragged", "packed_qkv"])
@pytest.mark.parametrize("causal", [False, True])
def test_tma_kv_loads_match_pointer_loads(device, layout, causal):
    """The fully visible band loaded through tensor descriptors gives the same bits as pointer loads,
    and matches the reference; the sequences' lengths are not multiples of BN, and the next batch's
    / sequence's keys are NaN past each end (a descriptor tile reaching past the sequence would read
    them and poison P @ V)."""
    if layout == "ragged":
        cu = torch.tensor([0, 45, 115, 148], dtype=torch.int32, device=device)
        q = torch.randn(148, 4, 32, dtype=torch.float16, device=device)
        k = torch.randn(148, 2, 32, dtype=torch.float16, device=device)
        v = torch.randn(148, 2, 32, dtype=torch.float16, device=device)
        kwargs = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=70, max_seqlen_k=70)
        outs = [
            attention(q, k, v, causal=causal, config=CPU_CONFIG.replace(tma_kv=tma), **kwargs) for tma in (True, False)
        ]
        refs = [
            attention_reference(q[a:b][None], k[a:b][None], v[a:b][None], causal=causal)[0]
            for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())
        ]
        ref = torch.cat(refs)
    else:
        if layout == "packed_qkv":
            qkv = torch.randn(3, 70, 3, 2, 32, dtype=torch.float16, device=device)
            q, k, v = qkv[:, :, 0].repeat_interleave(2, dim=2), qkv[:, :, 1], qkv[:, :, 2]
        else:
            q, k, v = _qkv(3, 70, 70, 4, 2, 32, torch.float16, device)
        outs = [attention(q, k, v, causal=causal, config=CPU_CONFIG.replace(tma_kv=tma)) for tma in (True, False)]
        ref = attention_reference(q, k, v, causal=causal)
    assert _tma_kv(PLANS.plans()) == [True, False], "the tma_kv=True call did not get descriptors"
    assert torch.equal(outs[0], outs[1])
    assert_close_relative(outs[0], ref, TOLERANCE[torch.float16], f"tma {layout}")


@pytest.mark.parametrize("score_mod", [None, "softcap", "alibi"])
@pytest.mark.parametrize("layout", ["dense", "ragged"])
def test_visible_band_with_score_mods(device, score_mod, layout):
    """The fully visible band against the reference, with score mods (which read the tile's key indices)
    and bands of 1 and several tiles."""
    mod = {None: None, "softcap": softcap(5.0), "alibi": alibi(torch.rand(4, device=device))}[score_mod]
    config = FA4Config(BM=16, BN=16, num_q_tiles=1, rescale_threshold=0.0)
    if layout == "ragged":
        cu = torch.tensor([0, 20, 90, 107], dtype=torch.int32, device=device)  # bands of 1, 4 and 1 tiles
        q = torch.randn(107, 4, 32, dtype=torch.float16, device=device)
        k, v = (torch.randn(107, 2, 32, dtype=torch.float16, device=device) for _ in range(2))
        out = attention(
            q, k, v, score_mod=mod, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=70, max_seqlen_k=70, config=config
        )
        ref = torch.cat(
            [
                attention_reference(q[a:b][None], k[a:b][None], v[a:b][None], score_mod=mod)[0]
                for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())
            ]
        )
    else:
        q, k, v = _qkv(2, 40, 70, 4, 2, 32, torch.float16, device)
        out = attention(q, k, v, score_mod=mod, config=config)
        ref = attention_reference(q, k, v, score_mod=mod)
    assert_close_relative(out, ref, TOLERANCE[torch.float16], f"band {layout} {score_mod}")


def test_tma_band_never_reads_past_a_sequence(device):
    """Dense K/V with Skv = 45 (not a multiple of BN = 16): batch 0's last partial tile would, through a
    [B * Skv]-row descriptor, read batch 1's first keys. Those are NaN here; batch 0 stays finite and
    equal to the reference."""
    q, k, v = _qkv(2, 45, 45, 2, 2, 32, torch.float16, device)
    k[1], v[1] = float("nan"), float("nan")
    out = attention(q, k, v, config=CPU_CONFIG.replace(tma_kv=True))
    ref = attention_reference(q[:1], k[:1], v[:1])
    assert_close_relative(out[:1], ref, TOLERANCE[torch.float16], "batch 0 next to a NaN batch")


# --------------------------------------------------------------------------- sinks, fully masked rows


@pytest.mark.parametrize("num_splits", [None, 1, 4])
def test_sinks(device, num_splits):
    q, k, v = _qkv(2, 3, 40, 8, 2, 32, torch.bfloat16, device)
    sinks = torch.randn(8, device=device) * 2
    _check(q, k, v, sinks=sinks, causal=True, num_splits=num_splits, config=CPU_CONFIG, what="sinks")


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_fully_masked_rows(device, num_splits, with_sinks):
    """Causal with Sq > Skv: the first Sq - Skv queries see no key -> output 0, LSE -inf (or the sink)."""
    q, k, v = _qkv(2, 24, 10, 2, 1, 16, torch.float16, device)
    sinks = torch.randn(2, device=device) if with_sinks else None
    out, lse = _check(q, k, v, causal=True, sinks=sinks, num_splits=num_splits, config=CPU_CONFIG, what="masked")
    assert torch.all(out[:, :14] == 0)
    if with_sinks:
        assert torch.allclose(lse[:, :, :14], sinks.view(1, 2, 1).expand(2, 2, 14))
    else:
        assert torch.all(lse[:, :, :14] == float("-inf"))
    assert torch.isfinite(lse[:, :, 14:]).all()


def test_mask_mod_hiding_whole_rows(device):
    @triton.jit
    def even_queries_only(b, h, q_idx, kv_idx):
        return (q_idx % 2 == 0) & (kv_idx >= 0)

    q, k, v = _qkv(1, 20, 20, 2, 2, 16, torch.float16, device)
    out, lse = _check(q, k, v, mask=even_queries_only, config=CPU_CONFIG, what="row mask")
    assert torch.all(out[:, 1::2] == 0) and torch.all(lse[:, :, 1::2] == float("-inf"))


# --------------------------------------------------------------------------- config and bad input


def test_config_validation():
    cases = [
        ("BM", dict(BM=24)),
        ("BN", dict(BN=8)),
        ("num_q_tiles", dict(num_q_tiles=3)),
        ("depth", dict(depth=20)),
        ("num_kv_stages", dict(num_kv_stages=0)),
        ("num_warps", dict(num_warps=3)),
        ("rescale_threshold", dict(rescale_threshold=-1.0)),
        ("rescale_threshold", dict(rescale_threshold=20.0)),
        ("poly_exp2_fraction", dict(poly_exp2_fraction=0.3)),
        ("num_q_heads", dict(num_q_heads=6, num_kv_heads=4)),
        ("page_size", dict(page_size=8)),
        ("pack_gqa_heads", dict(pack_gqa_heads=3)),
        ("padded_depth", dict(depth=64, padded_depth=32)),
        ("warp_specialized", dict(warp_specialized=1)),
        ("consumer_warpgroups", dict(consumer_warpgroups=4)),
        ("consumer_warpgroups", dict(depth=128, consumer_warpgroups=3)),
    ]
    for field, kwargs in cases:
        with pytest.raises(ValueError, match=field):
            FA4Config(**kwargs)
    config = FA4Config(BM=256, num_q_tiles=2, depth=96, num_q_heads=32, num_kv_heads=8)
    assert config.MMA_M == 128 and config.two_q_tiles and config.group == 4 and config.padded_depth == 128


def test_bad_inputs(device):
    q, k, v = _qkv(2, 8, 8, 4, 2, 16, torch.float16, device)
    cu = _cu_seqlens([4, 4], device)
    cache = _paged_cache([8, 8], 16, 2, 16, torch.float16, device)
    cases = [
        (TypeError, "q", lambda: attention(q.float(), k, v)),
        (TypeError, "k dtype", lambda: attention(q, k.bfloat16(), v)),
        (ValueError, "v shape", lambda: attention(q, k, v[:, :4])),
        (ValueError, "multiple", lambda: attention(q[:, :, :3], k, v)),
        (ValueError, "head dim", lambda: attention(q[..., :8], k[..., :8], v[..., :8])),
        (ValueError, "head dim", lambda: attention(q, k[..., :8].contiguous(), v[..., :8].contiguous())),
        (ValueError, "k batch", lambda: attention(q, k[:1], v[:1])),
        (ValueError, "q must be", lambda: attention(q[0], k, v)),
        (ValueError, "cu_seqlens_k", lambda: attention(q[0], k[0], v[0], cu_seqlens_q=cu)),
        (TypeError, "cu_seqlens_q", lambda: attention(q[0], k[0], v[0], cu_seqlens_q=cu.long(), cu_seqlens_k=cu)),
        (ValueError, "cu_seqlens_k", lambda: attention(q[0], k[0], v[0], cu_seqlens_q=cu, cu_seqlens_k=cu[:2])),
        (ValueError, "k = v = None", lambda: attention(q, k, v, kv_cache=cache)),
        (TypeError, "kv_cache", lambda: attention(q, None, None, kv_cache=(k, v))),
        (ValueError, "block_table too small", lambda: attention(q, None, None, kv_cache=cache, max_seqlen_k=100)),
        (ValueError, "batch", lambda: attention(q[:1], None, None, kv_cache=cache)),
        (TypeError, "sinks", lambda: attention(q, k, v, sinks=torch.zeros(4, dtype=torch.float16, device=device))),
        (ValueError, "sinks", lambda: attention(q, k, v, sinks=torch.zeros(3, device=device))),
        (ValueError, "alibi", lambda: attention(q, k, v, score_mod=alibi(torch.zeros(3, device=device)))),
        (TypeError, "alibi", lambda: alibi(torch.zeros(4, dtype=torch.float64))),
        (TypeError, "mask", lambda: attention(q, k, v, mask="causal")),
        (TypeError, "score_mod", lambda: attention(q, k, v, score_mod=lambda s: s)),
        (ValueError, "num_splits", lambda: attention(q, k, v, num_splits=0)),
        (TypeError, "num_splits", lambda: attention(q, k, v, num_splits=2.0)),
        (ValueError, "max_seqlen_q", lambda: attention(q, k, v, max_seqlen_q=-1)),
        (TypeError, "causal", lambda: attention(q, k, v, causal=1)),
        (ValueError, "config.num_q_heads", lambda: attention(q, k, v, config=FA4Config(num_q_heads=8))),
        (TypeError, "SlidingWindow.left", lambda: SlidingWindow(1.5, 0)),
        (ValueError, "Chunked.size", lambda: Chunked(0)),
        (ValueError, "softcap", lambda: softcap(0.0)),
        (
            ValueError,
            "page_size",
            lambda: PagedKVCache(cache.k_pages[:, :8], cache.v_pages[:, :8], cache.block_table, cache.seqlens),
        ),
        (
            TypeError,
            "block_table",
            lambda: PagedKVCache(cache.k_pages, cache.v_pages, cache.block_table.long(), cache.seqlens),
        ),
        (
            ValueError,
            "seqlens",
            lambda: PagedKVCache(cache.k_pages, cache.v_pages, cache.block_table, cache.seqlens[:1]),
        ),
    ]
    for error, match, call in cases:
        with pytest.raises(error, match=match):
            call()


def test_cpu_tensors_rejected_outside_interpreter(device, monkeypatch):
    import llmkernels.runtime as runtime

    monkeypatch.setattr(runtime, "interpreting", lambda: False)
    q, k, v = _qkv(1, 4, 4, 1, 1, 16, torch.float16, torch.device("cpu"))
    with pytest.raises(ValueError, match="q is on cpu"):
        attention(q, k, v)


# --------------------------------------------------------------------------- realistic shapes (GPU)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(2, 16, 1024, 64), (2, 16, 2048, 128), (1, 8, 1024, 256), (1, 32, 777, 96)])
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_prefill_vs_sdpa(device, shape, causal):
    batch, heads, seqlen, head_dim = shape
    q, k, v = _qkv(batch, seqlen, seqlen, heads, heads // 4 if heads >= 4 else heads, head_dim, torch.bfloat16, device)
    out = attention(q, k, v, causal=causal)
    expected = torch.nn.functional.scaled_dot_product_attention(
        q.float().transpose(1, 2),
        k.float().transpose(1, 2),
        v.float().transpose(1, 2),
        is_causal=causal,
        enable_gqa=True,
    ).transpose(1, 2)
    assert_close_relative(out, expected, TOLERANCE["gpu_bf16"], f"{shape} causal={causal}")


@pytest.mark.gpu
@pytest.mark.parametrize(
    "config",
    [
        FA4Config(BM=128, BN=64, num_q_tiles=2, num_warps=8, poly_exp2_fraction=0.5),
        FA4Config(BM=128, BN=128, num_q_tiles=1, num_warps=8, rescale_threshold=0.0),
    ],
)
def test_gpu_fa4_switches(device, config):
    q, k, v = _qkv(2, 1500, 2000, 16, 4, 128, torch.bfloat16, device)
    _check(
        q,
        k,
        v,
        causal=True,
        sinks=torch.randn(16, device=device),
        config=config,
        tolerance=TOLERANCE["gpu_bf16"],
        what="gpu fa4",
    )


@pytest.mark.gpu
def test_gpu_ragged_masks(device):
    lengths = [1000, 0, 1, 513, 2048]
    q = torch.randn(sum(lengths), 16, 128, dtype=torch.bfloat16, device=device)
    k = torch.randn(sum(lengths), 4, 128, dtype=torch.bfloat16, device=device)
    v = torch.randn_like(k)
    cu = _cu_seqlens(lengths, device)
    for kwargs in (
        dict(causal=True),
        dict(mask=SlidingWindow(256, 0), causal=True),
        dict(mask=Chunked(512), causal=True),
        dict(score_mod=softcap(30.0), causal=True),
        dict(mask=checker_mask),
        dict(score_mod=biased_score),
    ):
        _check(
            q,
            k,
            v,
            cu_seqlens_q=cu,
            cu_seqlens_k=cu,
            max_seqlen_q=2048,
            max_seqlen_k=2048,
            tolerance=TOLERANCE["gpu_bf16"],
            what=str(kwargs),
            **kwargs,
        )


LOG2E = 1.4426950408889634  # the Gluon launches bind softmax_scale * log2(e)


def _gluon_stand_in(monkeypatch, backend, record):
    """From here on, the Gluon kernels can be chosen (an sm_90 GPU is pretended) and a bound launch of
    ``backend``'s kernel calls ``record(bound, *values)`` instead (the interpreter cannot run Gluon); other
    launches run."""
    from llmkernels.launch import BoundKernel

    monkeypatch.setattr(attention_config, "runs_gluon", lambda device: True)
    launch = BoundKernel.__call__

    def stand_in(bound, *values):
        return record(bound, *values) if bound.fn is backend.kernel else launch(bound, *values)

    monkeypatch.setattr(BoundKernel, "__call__", stand_in)


def _bound_value(bound, name):
    """The value a bound launch fixed for the kernel argument ``name``."""
    return bound.values[bound.names.index(name)]


def _base(value):
    """The tensor of a descriptor slot's value (a tensor, or ``(tensor, shape, strides)``)."""
    return value[0] if isinstance(value, tuple) else value


@pytest.mark.skipif(not interpreting(), reason="CPU tensors through the interpreter (a stand-in for the GPU kernel)")
def test_gluon_decode_dispatch(monkeypatch):
    """The plan's hand-over to the Hopper Gluon split pass for decode, checked on the CPU with the pass replaced by a
    stand-in that writes known partials (O = 1, LSE = 0; the real combine merges them to 1): one query token over a
    paged cache (causal or not) or dense K/V takes it, with the pages, block table and key counts (dense: the LSE
    partials in those two slots) and partials ``[splits, B, 1, Hq, D]`` / ``[splits, B, Hq, 1]``. A window that
    hides keys, two query tokens, one split, a softcap, key starts, more (sequence, KV head) pairs than
    ``MAX_HEAD_PROGRAMS``, more than 64 q heads per KV head, pages TMA cannot read and a config without
    ``warp_specialized`` take the portable pass, whose results match the reference."""
    from llmkernels.attention import gluon_decode, gluon_hopper
    from llmkernels.launch import clear_plans

    seen = []

    def record(bound, *values):
        names = ("q", "k", "v", "o", "lse", "block_table", "seqlens")
        seen.append(
            dict(
                zip(names, values),
                scale=_bound_value(bound, "qk_scale") / LOG2E,
                paged=_bound_value(bound, "PAGE_SIZE") > 0,
            )
        )
        values[3].fill_(1.0)
        values[4].fill_(0.0)

    _gluon_stand_in(monkeypatch, gluon_decode.BACKEND, record)
    # one split runs one pass, which the Gluon prefill would take: the portable one here
    monkeypatch.setattr(gluon_hopper.GluonPrefill, "supports", lambda self, call, tiles: False)
    clear_plans()
    config = FA4Config(BM=16, BN=16, num_kv_stages=1, warp_specialized=True)
    cache = _paged_cache([40, 60], 16, 2, 64, torch.bfloat16, "cpu")
    q = torch.randn(2, 1, 8, 64, dtype=torch.bfloat16)
    for causal in (False, True):
        out = attention(q, None, None, kv_cache=cache, causal=causal, config=config, softmax_scale=0.5)
        assert torch.equal(out, torch.ones_like(q))
        call = seen[-1]
        assert call["q"] is q and call["k"] is cache.k_pages and call["v"] is cache.v_pages and call["paged"]
        assert call["block_table"] is cache.block_table and call["seqlens"] is cache.seqlens
        assert call["scale"] == pytest.approx(0.5)
        splits = call["o"].shape[0]
        assert splits > 1 and call["o"].shape == (splits, 2, 1, 8, 64) and call["lse"].shape == (splits, 2, 8, 1)
    k, v = torch.randn(2, 50, 2, 64, dtype=torch.bfloat16), torch.randn(2, 50, 2, 64, dtype=torch.bfloat16)
    assert torch.equal(attention(q, k, v, config=config), torch.ones_like(q))
    call = seen[-1]
    assert _base(call["k"]) is k and _base(call["v"]) is v and not call["paged"]
    assert call["block_table"] is call["lse"] and call["seqlens"] is call["lse"]

    handed_over = len(seen)
    starts = PagedKVCache(
        cache.k_pages, cache.v_pages, cache.block_table, cache.seqlens, torch.tensor([3, 0], dtype=torch.int32)
    )
    many = _paged_cache([20] * 9, 16, 2, 64, torch.bfloat16, "cpu")  # 18 (sequence, KV head) pairs
    strided = PagedKVCache(
        cache.k_pages.transpose(2, 3).contiguous().transpose(2, 3), cache.v_pages, cache.block_table, cache.seqlens
    )
    portable_calls = [
        (q, dict(kv_cache=cache, mask=SlidingWindow(5, 0))),
        (torch.randn(2, 2, 8, 64, dtype=torch.bfloat16), dict(kv_cache=cache, causal=True)),
        (q, dict(kv_cache=cache, num_splits=1)),
        (q, dict(kv_cache=cache, score_mod=softcap(30.0))),
        (q, dict(kv_cache=starts)),
        (torch.randn(9, 1, 8, 64, dtype=torch.bfloat16), dict(kv_cache=many)),
        (torch.randn(2, 1, 130, 64, dtype=torch.bfloat16), dict(kv_cache=cache)),
        (q, dict(kv_cache=strided)),
        (q, dict(kv_cache=cache, config=FA4Config(BM=16, BN=16, num_kv_stages=1))),
    ]
    for q_call, kwargs in portable_calls:
        _check(q_call, None, None, **{"config": config, **kwargs}, tolerance=2e-2, what=str(sorted(kwargs)))
    assert len(seen) == handed_over, "a call the Gluon pass does not take was handed over"
    clear_plans()


@pytest.mark.skipif(not interpreting(), reason="CPU tensors through the interpreter (a stand-in for the GPU kernel)")
def test_gluon_dispatch_hands_over_tma_readable_tensors(monkeypatch):
    """The plan's hand-over to the Hopper Gluon kernel, checked on the CPU with a stand-in for its launch: the window
    (causal: ``(UNBOUNDED, 0)``), the config's consumer count, and q/k/v that TMA could not read in place (here:
    a head-major slice) replaced by contiguous copies with the same values, so any view gives the contiguous call's
    bits; a readable tensor is passed as is; sinks as a contiguous float32 ``[Hq]``; ragged calls hand over their
    cumulative lengths, paged ones the pages, block table and key counts."""
    from llmkernels.attention import gluon_hopper
    from llmkernels.attention.masks import UNBOUNDED

    seen = {}

    def record(bound, *values):
        seen.update(
            q=_base(values[0]),
            k=_base(values[1]),
            v=_base(values[2]),
            sinks=values[5] if _bound_value(bound, "HAS_SINKS") else None,
            cu=values[7:9],
            window=(_bound_value(bound, "window_left"), _bound_value(bound, "window_right")),
            consumers=_bound_value(bound, "CONSUMERS"),
            scale=_bound_value(bound, "qk_scale") / LOG2E,
            paged=_bound_value(bound, "PAGE_SIZE") > 0,
            ragged=_bound_value(bound, "RAGGED"),
            seqlen_q=_bound_value(bound, "seqlen_q"),
            pages=values[9:11],
        )
        values[3].fill_(1.0)

    _gluon_stand_in(monkeypatch, gluon_hopper.BACKEND, record)
    q = torch.randn(2, 40, 4, 64, dtype=torch.bfloat16)
    k = torch.randn(2, 4, 50, 64, dtype=torch.bfloat16).transpose(1, 2)[:, :, :2]  # heads apart, a slice
    v = torch.randn(2, 50, 2, 64, dtype=torch.bfloat16)
    config = FA4Config(warp_specialized=True, consumer_warpgroups=3)
    out = attention(q, k, v, causal=True, config=config, softmax_scale=0.25)
    assert torch.equal(out, torch.ones_like(q))
    assert seen["q"] is q and seen["v"] is v
    assert seen["k"].is_contiguous() and torch.equal(seen["k"], k) and seen["k"].data_ptr() != k.data_ptr()
    assert seen["window"] == (UNBOUNDED, 0) and seen["consumers"] == 3 and seen["scale"] == pytest.approx(0.25)
    attention(q, k, v, mask=SlidingWindow(7, 2), config=config)
    assert seen["window"] == (7, 2) and not seen["paged"] and not seen["ragged"] and seen["sinks"] is None
    # sinks (gpt-oss) are handed over too: a strided view as a contiguous copy of its values
    sinks = torch.randn(8)[::2]
    attention(q, k, v, causal=True, sinks=sinks, config=config)
    assert seen["sinks"].is_contiguous() and torch.equal(seen["sinks"], sinks)
    # ragged q and k: the cumulative lengths and the host bound on one sequence's queries
    cu = _cu_seqlens([30, 50], "cpu")
    q_ragged, k_ragged = torch.randn(80, 4, 64, dtype=torch.bfloat16), torch.randn(80, 2, 64, dtype=torch.bfloat16)
    attention(
        q_ragged, k_ragged, k_ragged, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=50, max_seqlen_k=50, config=config
    )
    assert seen["cu"][0] is cu and seen["cu"][1] is cu and seen["seqlen_q"] == 50 and seen["ragged"]
    assert not seen["paged"]
    # a paged cache: the pages as k and v, the block table and key counts beside them
    cache = _paged_cache([40, 60], 16, 2, 64, torch.bfloat16, "cpu")
    attention(q, None, None, kv_cache=cache, causal=True, config=config)
    assert seen["k"] is cache.k_pages and seen["v"] is cache.v_pages and not seen["ragged"] and seen["paged"]
    assert seen["pages"][0] is cache.block_table and seen["pages"][1] is cache.seqlens
