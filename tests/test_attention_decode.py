"""Split-KV decode + combine: every num_splits (also more than keys) gives the same result, paged and
dense KV, GQA packing, short multi-token queries, sinks, masks; buffers poisoned with NaN."""

import pytest
import torch
from test_attention import _check, _cu_seqlens, _paged_cache, _qkv, checker_mask

from llmkernels import runtime
from llmkernels.attention import config as attention_config
from llmkernels.attention import layout as attention_layout
from llmkernels.attention.api import attention
from llmkernels.attention.config import FA4Config, choose_num_splits, decode_tiling, fp8_kv_splits
from llmkernels.attention.masks import SlidingWindow, softcap
from llmkernels.attention.paged import PagedKVCache
from llmkernels.attention.plan import PLANS
from llmkernels.attention.reference import attention_reference
from llmkernels.testing import assert_close_relative, on_gpu, poison, relative_error

# The interpreter evaluates both sides of tl.where: -inf - -inf of fully masked rows warns in numpy.
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")

# Relative-error tolerances, one table for the module.
TOLERANCE = {
    torch.float16: 4e-3,
    torch.bfloat16: 2e-2,
    "splits_agree": 6e-3,  # two num_splits of one bf16 problem: fp32 sums in another order, then bf16 rounding (1 ulp = 3.9e-3)
    "gpu_bf16": 2e-2,
}

DECODE_CONFIG = FA4Config(BM=16, BN=16, num_kv_stages=1)


@pytest.fixture(autouse=True)
def poisoned_buffers(monkeypatch):
    monkeypatch.setattr(
        runtime, "new_buffer", lambda shape, dtype, device: poison(torch.empty(shape, dtype=dtype, device=device))
    )


@pytest.mark.parametrize("heads", [(8, 2), (4, 4), (8, 1), (16, 2)], ids=["gqa4", "mha", "mqa8", "gqa8"])
@pytest.mark.parametrize("page_size", [16, 64])
def test_paged_decode_every_num_splits(device, heads, page_size):
    if not on_gpu() and (heads in ((8, 2), (8, 1))) != (page_size == 16):
        pytest.skip("CPU interpreter: each head layout at one page size (every pair on the GPU)")
    seqlens = [70, 1, 0, 33]
    cache = _paged_cache(seqlens, page_size, heads[1], 32, torch.bfloat16, device)
    q = torch.randn(4, 1, heads[0], 32, dtype=torch.bfloat16, device=device)
    sinks = torch.randn(heads[0], device=device)
    outputs = []
    for num_splits in (1, 2, 3, 5, 100):
        out, _ = _check(
            q,
            None,
            None,
            kv_cache=cache,
            num_splits=num_splits,
            sinks=sinks,
            config=DECODE_CONFIG,
            tolerance=TOLERANCE[torch.bfloat16],
            what=f"splits={num_splits}",
        )
        outputs.append(out)
    for out in outputs[1:]:
        assert relative_error(out, outputs[0]) <= TOLERANCE["splits_agree"]


def test_combine_in_one_block_and_in_blocks(device):
    """The combine loads up to 64 splits' partials in one block and walks more in blocks of 64: 40 and 80 splits
    of a 1280-key sequence (80 tiles of 16 keys), with sinks and the LSE, match the one-pass result."""
    q, k, v = _qkv(2, 1, 1280, 4, 1, 16, torch.bfloat16, device)
    sinks = torch.randn(4, device=device)
    expected, _ = _check(q, k, v, num_splits=1, sinks=sinks, config=DECODE_CONFIG, what="one pass")
    for num_splits in (40, 80):
        out, _ = _check(
            q,
            k,
            v,
            num_splits=num_splits,
            sinks=sinks,
            config=DECODE_CONFIG,
            tolerance=TOLERANCE[torch.bfloat16],
            what=f"splits={num_splits}",
        )
        assert relative_error(out, expected) <= TOLERANCE["splits_agree"]


def _decode_float64(q, k, v, sinks):
    """Attention from its definition, in float64: ``out = sum_j p_j v_j`` with ``p_j = exp(s_j) / (sum_i exp(s_i)
    + exp(sink_h))``, ``s = q·k / sqrt(D)``, the natural-log sink not scaled, and ``lse = log(sum_i exp(s_i) +
    exp(sink_h))``. q ``[B, Sq, Hq, D]``, k and v ``[B, Skv, Hkv, D]`` (q head h reads KV head
    ``h // (Hq / Hkv)``), sinks float ``[Hq]`` or None. Returns float64 out ``[B, Sq, Hq, D]``, lse ``[B, Hq, Sq]``."""
    group = q.shape[2] // k.shape[2]
    k64, v64 = (t.double().repeat_interleave(group, dim=2) for t in (k, v))
    scores = torch.einsum("bqhd,bkhd->bhqk", q.double(), k64) / q.shape[-1] ** 0.5
    logits = scores
    if sinks is not None:
        logits = torch.cat([scores, sinks.double()[None, :, None, None].expand(*scores.shape[:3], 1)], dim=-1)
    lse = torch.logsumexp(logits, dim=-1)
    return torch.einsum("bhqk,bkhd->bqhd", torch.exp(scores - lse[..., None]), v64), lse


# A correct bf16 decode with sinks against _decode_float64, the cases below over 10 seeds (4 for 1088 keys):
# out at most 6.4e-3 relative (the output's bf16 rounding), lse at most 7.2e-7 absolute; bounds about 3x those.
# Dropping the sinks moves out by at least 1.0 there.
SINK_DECODE_BOUND = {"out": 2e-2, "lse": 2e-6}


@pytest.mark.parametrize(
    "num_splits,batch,seqlen_k",
    [(1, 2, 96), (5, 2, 96), (80, 1, 1088)],
    ids=["one_pass", "combine_one_block", "combine_blocked"],
)
def test_decode_with_sinks_against_the_definition(device, num_splits, batch, seqlen_k):
    """Sinks holding from a quarter to four fifths of each row's weight, so that a combine that drops them
    moves the output far past the bound: one pass, the combine's one-block path (<= 64 splits: 5 over 6 key
    tiles, two of them empty) and its blocked path (> 64 splits: 80 asked, 68 run, one per key tile, in two
    blocks of 64)."""
    q, k, v = _qkv(batch, 1, seqlen_k, 4, 1, 16, torch.bfloat16, device)
    dropped, lse_without_sinks = _decode_float64(q, k, v, None)
    sinks = lse_without_sinks.mean(dim=(0, 2)).float() + torch.tensor([-1.0, 0.0, 0.5, 1.5], device=device)
    expected, expected_lse = _decode_float64(q, k, v, sinks)
    assert relative_error(dropped, expected) > 20 * SINK_DECODE_BOUND["out"]  # the sinks matter

    out, lse = attention(q, k, v, sinks=sinks, num_splits=num_splits, return_lse=True, config=DECODE_CONFIG)
    assert_close_relative(out, expected, SINK_DECODE_BOUND["out"], f"splits={num_splits} out")
    lse_error = (lse.double() - expected_lse).abs().max().item()
    assert lse_error <= SINK_DECODE_BOUND["lse"], f"splits={num_splits} lse: {lse_error:.2e}"


@pytest.mark.parametrize("seqlen_q", [1, 4, 16])
@pytest.mark.parametrize("num_splits", [None, 1, 4])
def test_short_queries_causal(device, seqlen_q, num_splits):
    """Speculative-decoding style: a few new tokens per sequence, causal against the cache."""
    q, k, v = _qkv(2, seqlen_q, 45, 8, 2, 16, torch.float16, device)
    _check(q, k, v, causal=True, num_splits=num_splits, config=DECODE_CONFIG, what=f"sq={seqlen_q}")


def test_ragged_q_paged_decode(device):
    lengths_q = [1, 3, 0, 2]
    seqlens = [20, 50, 5, 2]
    cache = _paged_cache(seqlens, 16, 2, 32, torch.float16, device)
    q = torch.randn(sum(lengths_q), 8, 32, dtype=torch.float16, device=device)
    for num_splits in (None, 2, 64):
        _check(
            q,
            None,
            None,
            kv_cache=cache,
            cu_seqlens_q=_cu_seqlens(lengths_q, device),
            max_seqlen_q=3,
            causal=True,
            num_splits=num_splits,
            config=DECODE_CONFIG,
            what=f"ragged paged {num_splits}",
        )


@pytest.mark.parametrize(
    "kwargs",
    [dict(mask=SlidingWindow(10, 0), causal=True), dict(mask=checker_mask), dict(score_mod=softcap(3.0), causal=True)],
    ids=["window", "mask_mod", "softcap"],
)
def test_decode_masks_and_mods(device, kwargs):
    q, k, v = _qkv(2, 2, 60, 4, 1, 16, torch.float16, device)
    for num_splits in (1, 3):
        _check(q, k, v, num_splits=num_splits, config=DECODE_CONFIG, what=str(kwargs), **kwargs)


def test_long_queries_with_splits(device):
    """num_splits > 1 also works for prefill-sized q (the split path tiles q as well)."""
    q, k, v = _qkv(1, 40, 50, 4, 2, 16, torch.float16, device)
    for num_splits in (2, 7):
        _check(q, k, v, causal=True, num_splits=num_splits, config=DECODE_CONFIG, what=f"long q {num_splits}")


def test_pack_gqa_heads_config(device):
    q, k, v = _qkv(2, 1, 40, 16, 2, 16, torch.float16, device)
    for pack in (1, 2, 8, 16):
        config = FA4Config(BM=16, BN=16, pack_gqa_heads=pack)
        _check(q, k, v, num_splits=3, config=config, what=f"pack={pack}")


def test_fully_masked_decode_rows(device):
    q, k, v = _qkv(2, 1, 0, 4, 2, 16, torch.float16, device)  # no keys at all
    out, lse = attention(q, k, v, num_splits=4, return_lse=True, config=DECODE_CONFIG)
    assert torch.all(out == 0) and torch.all(lse == float("-inf"))


def test_one_split_writes_the_output_directly(device, monkeypatch):
    """A decode with one split (the heuristic's choice once sequences x KV heads fill the GPU) allocates no
    partials and launches no combine: the kernel stores O and the LSE, sinks included, itself."""
    written = []

    def recording_empty(shape, dtype, device):
        written.append(tuple(shape))
        return poison(torch.empty(shape, dtype=dtype, device=device))

    monkeypatch.setattr(runtime, "new_buffer", recording_empty)
    monkeypatch.setattr(attention_config, "choose_num_splits", lambda *bounds: 1)
    cache = _paged_cache([70, 1, 0, 33], 16, 2, 32, torch.bfloat16, device)
    q = torch.randn(4, 1, 8, 32, dtype=torch.bfloat16, device=device)
    sinks = torch.randn(8, device=device)
    _check(
        q,
        None,
        None,
        kv_cache=cache,
        sinks=sinks,
        config=DECODE_CONFIG,
        tolerance=TOLERANCE[torch.bfloat16],
        what="one split",
    )
    (plan,) = PLANS.plans()
    ((backend, spec),) = plan.specs()  # no combine
    assert plan.tiles.split and backend == "portable" and spec.grid[1] == 1 and not spec.constexprs["SPLIT"]
    assert written and all(shape in {(4, 1, 8, 32), (4, 8, 1)} for shape in written), written


def test_page_offsets_in_int64_give_the_int32_bits(device, monkeypatch):
    """Pages whose element offsets fit in int32 gather with int32 offsets; a cache past 2**31 elements takes the
    int64 variant (``PAGE_OFFSETS_64``). Forcing that variant on a small cache gives the same bits, paged decode
    and paged prefill; the plan's extent helper sees strided and offset views."""
    assert attention_layout.last_offset(torch.empty(0, 16, 2, 32)) == 0
    storage = torch.empty(10, 2, 16, 2, 32)  # K and V pages interleaved: a page stride of 2 pages
    view = storage[:, 0]
    assert attention_layout.last_offset(view) == 9 * view.stride(0) + 15 * 64 + 63
    cache = _paged_cache([70, 1, 0, 33], 16, 2, 32, torch.bfloat16, device)
    calls = [
        (torch.randn(4, 1, 8, 32, dtype=torch.bfloat16, device=device), dict(num_splits=3)),
        (torch.randn(4, 40, 8, 32, dtype=torch.bfloat16, device=device), dict(causal=True)),
    ]

    def bound_flags():
        return {
            spec.constexprs["PAGE_OFFSETS_64"]
            for plan in PLANS.plans()
            for name, spec in plan.specs()
            if name == "portable"
        }

    PLANS.clear()
    expected = [attention(q, None, None, kv_cache=cache, config=DECODE_CONFIG, **kwargs) for q, kwargs in calls]
    assert bound_flags() == {False}
    PLANS.clear()
    monkeypatch.setattr(attention_layout, "last_offset", lambda t: 2**31)
    for (q, kwargs), want in zip(calls, expected):
        assert torch.equal(attention(q, None, None, kv_cache=cache, config=DECODE_CONFIG, **kwargs), want)
    assert bound_flags() == {True}
    PLANS.clear()


@pytest.mark.parametrize("page_size,block_n", [(16, 16), (32, 16), (64, 16), (16, 32)])
def test_page_aligned_tiles_give_the_gather_bits(device, page_size, block_n):
    """A tile inside one page (page_size >= BN, no ``starts``) reads one clamped page id per tile
    (``page_aligned_tile_ptrs``); the per-row gather, which ``starts`` (all 0 here) and pages smaller than a tile
    take, must give the same bits, bad block-table entries (negative, past the pages) clamped alike. Decode over
    3 splits and a causal prefill, NaN-poisoned output buffers."""
    if not on_gpu() and (page_size, block_n) in ((16, 16), (64, 16)):
        pytest.skip("CPU interpreter: a page larger than the tile and one smaller (all four on the GPU)")
    cache = _paged_cache([70, 1, 0, 33, 64], page_size, 2, 32, torch.bfloat16, device)
    table = cache.block_table.clone()
    table[0, 1], table[3, 0] = -7, 2**30  # used entries: clamped to page 0 / the last page by both loads
    hostile = PagedKVCache(cache.k_pages, cache.v_pages, table, cache.seqlens)
    leftpad = PagedKVCache(cache.k_pages, cache.v_pages, table, cache.seqlens, torch.zeros_like(cache.seqlens))
    config = FA4Config(BM=16, BN=block_n, num_kv_stages=1)
    for q, kwargs in [
        (torch.randn(5, 1, 8, 32, dtype=torch.bfloat16, device=device), dict(num_splits=3)),
        (torch.randn(5, 40, 8, 32, dtype=torch.bfloat16, device=device), dict(causal=True)),
    ]:
        aligned, lse = attention(q, None, None, kv_cache=hostile, config=config, return_lse=True, **kwargs)
        gathered, lse_gathered = attention(q, None, None, kv_cache=leftpad, config=config, return_lse=True, **kwargs)
        assert torch.equal(aligned, gathered) and torch.equal(lse, lse_gathered)
        clamped = table.clamp(0, cache.num_pages - 1)
        reference = attention_reference(
            q, None, None, kv_cache=PagedKVCache(cache.k_pages, cache.v_pages, clamped, cache.seqlens), **kwargs
        )
        assert_close_relative(aligned, reference, TOLERANCE[torch.bfloat16])


def test_heuristics():
    assert choose_num_splits(1000, 64, 132) == 1
    assert choose_num_splits(8, 1, 132) == 1
    assert choose_num_splits(8, 512, 132) == 33
    assert choose_num_splits(1, 4, 132) == 4
    assert choose_num_splits(256, 128, 132) == 2 and choose_num_splits(264, 128, 132) == 1
    # over an FP8 cache: one whole wave of 4 programs per SM, never a partial second one
    assert fp8_kv_splits(64, 512, 132) == 8 and fp8_kv_splits(256, 128, 132) == 2 and fp8_kv_splits(8, 2048, 132) == 66
    assert fp8_kv_splits(1000, 64, 132) == 1 and fp8_kv_splits(8, 40, 132) == 40
    for max_q, group in [(1, 1), (1, 8), (1, 64), (16, 8), (5, 3), (200, 8)]:
        block_q, heads_per_tile = decode_tiling(max_q, group)
        rows = block_q * heads_per_tile
        assert 16 <= rows <= 128 and heads_per_tile <= max(1, group) * 2


@pytest.mark.gpu
@pytest.mark.parametrize("batch,context", [(1, 8192), (8, 4096), (64, 1024), (4, 32768)])
def test_gpu_paged_decode(device, batch, context):
    seqlens = [context - (17 * b) % (context // 2) for b in range(batch)]
    cache = _paged_cache(seqlens, 16, 8, 128, torch.bfloat16, device)
    q = torch.randn(batch, 1, 32, 128, dtype=torch.bfloat16, device=device)
    out, lse = attention(q, None, None, kv_cache=cache, return_lse=True)
    ref, ref_lse = attention_reference(q, None, None, kv_cache=cache, return_lse=True)
    assert_close_relative(out, ref, TOLERANCE["gpu_bf16"], "gpu decode")
    assert_close_relative(lse, ref_lse, 1e-4, "gpu decode lse")
