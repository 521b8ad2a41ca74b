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
from llmkernels.attention.masks import SlidingWindow
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
    """attention with the LSE against the reference; asserts that the Gluon FP8 prefill ran. Returns (out, lse)."""
    PLANS.clear()
    out, lse = attention(q, k, v, return_lse=True, **kwargs)
    assert _backends() == {"gluon_fp8_prefill"}, (what, _backends())
    ref_out, ref_lse = attention_reference(q, k, v, return_lse=True, **kwargs)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape, what
    assert_close_relative(out, ref_out, TOLERANCE["out"], f"{what} out")
    seen = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), seen), f"{what}: the rows of -inf LSE differ"
    assert_close_relative(lse[seen], ref_lse[seen], TOLERANCE["lse"], f"{what} lse")
    blind = ~seen.transpose(1, 2)  # [B, Sq, Hq]: queries that see no key
    assert (out[blind] == 0).all(), f"{what}: a query that sees no key must give 0"
    return out, lse


@pytest.mark.parametrize("head_dim", [64, 128])
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


def test_other_fp8_calls_go_to_the_portable_kernel():
    """On the GPU too: a bf16 q over FP8 K/V, D = 256 and a sliding window run the portable kernel."""
    k, v = _e4m3(1, 300, 2, 128), _e4m3(1, 300, 2, 128)
    cases = [
        (torch.randn(1, 200, 4, 128, device="cuda").to(torch.bfloat16), k, v, {}),
        (_e4m3(1, 200, 4, 256), _e4m3(1, 300, 2, 256), _e4m3(1, 300, 2, 256), {}),
        (_e4m3(1, 200, 4, 128), k, v, dict(mask=SlidingWindow(64, 0))),
    ]
    for q, k, v, kwargs in cases:
        PLANS.clear()
        out = attention(q, k, v, **kwargs)
        assert _backends() == {"portable"}, (q.dtype, q.shape, kwargs, _backends())
        assert_close_relative(out, attention_reference(q, k, v, **kwargs), TOLERANCE["out"], str(kwargs))
