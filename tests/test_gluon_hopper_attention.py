"""The Gluon Hopper attention kernels (``llmkernels.attention.gluon_hopper``: single warpgroup;
``gluon_hopper_ws``: warp-specialized, ping-pong on and off) against a float32 PyTorch reference, on an sm_90 GPU
(the kernels use TMA and wgmma: they cannot run elsewhere, nor in the interpreter)."""
import functools

import pytest
import torch
import torch.nn.functional as F

from llmkernels.attention.gluon_hopper import gluon_attention
from llmkernels.attention.gluon_hopper_ws import gluon_attention_ws


def _on_sm90() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _on_sm90(), reason="needs an sm_90 (Hopper) GPU")]

KERNELS = {"one-warpgroup": gluon_attention,
           "ws": gluon_attention_ws,
           "ws-no-pingpong": functools.partial(gluon_attention_ws, pingpong=False),
           "ws-3-stages": functools.partial(gluon_attention_ws, stages=3)}


@pytest.fixture(params=list(KERNELS))
def attend(request):
    """The kernel, called after NaN was written to the memory its output will likely take (the caching allocator
    hands back the block just freed), so that an element it leaves unwritten fails the check."""
    kernel = KERNELS[request.param]

    def poisoned_call(q, k, v, **kwargs):
        torch.full_like(q, float("nan"))
        return kernel(q, k, v, **kwargs)
    return poisoned_call


TOLERANCE = 1e-2  # relative error (Frobenius norms) of bf16 inputs, P and output


def _reference(q, k, v, causal, softmax_scale):
    """float32 SDPA on the [B, S, H, D] layout; causal is top-left aligned, which is the kernel's for Sq == Skv."""
    qf, kf, vf = (x.float().transpose(1, 2) for x in (q, k, v))
    out = F.scaled_dot_product_attention(qf, kf, vf, is_causal=causal, scale=softmax_scale, enable_gqa=True)
    return out.transpose(1, 2)


def _inputs(batch, seqlen_q, seqlen_kv, q_heads, kv_heads, head_dim, q_gain=1.0):
    q = (torch.randn(batch, seqlen_q, q_heads, head_dim, device="cuda") * q_gain).to(torch.bfloat16)
    k = torch.randn(batch, seqlen_kv, kv_heads, head_dim, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(batch, seqlen_kv, kv_heads, head_dim, device="cuda", dtype=torch.bfloat16)
    return q, k, v


def _check(out, q, k, v, causal, softmax_scale):
    assert out.dtype == torch.bfloat16 and out.shape == q.shape and out.is_contiguous()
    assert not torch.isnan(out).any(), "NaN in the output"
    ref = _reference(q, k, v, causal, softmax_scale)
    error = ((out.float() - ref).norm() / ref.norm()).item()
    assert error < TOLERANCE, f"relative error {error:.2e}"


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("seqlen", [128, 1000, 2048])
def test_matches_reference(attend, seqlen, head_dim, causal):
    q, k, v = _inputs(2, seqlen, seqlen, 8, 2, head_dim)
    out = attend(q, k, v, causal=causal)
    _check(out, q, k, v, causal, head_dim ** -0.5)


@pytest.mark.parametrize("batch, seqlen_q, seqlen_kv, q_heads, kv_heads, head_dim, causal, q_gain, scale", [
    (1, 1, 1000, 4, 1, 128, False, 1.0, None),  # MQA, one query: Sq far below the 128-row Q block
    (3, 300, 77, 8, 8, 64, False, 1.0, None),  # MHA, Skv below one K/V tile, rows of the next batch in it
    (2, 513, 513, 6, 3, 128, True, 4.0, None),  # peaked scores: the running max moves across tiles
    (2, 700, 700, 4, 2, 64, True, 1.0, 0.3),  # explicit softmax_scale
], ids=["mqa-one-query", "mha-short-kv", "peaked-causal", "scale"])
def test_other_shapes(attend, batch, seqlen_q, seqlen_kv, q_heads, kv_heads, head_dim, causal, q_gain, scale):
    q, k, v = _inputs(batch, seqlen_q, seqlen_kv, q_heads, kv_heads, head_dim, q_gain)
    out = attend(q, k, v, causal=causal, softmax_scale=scale)
    _check(out, q, k, v, causal, head_dim ** -0.5 if scale is None else scale)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_next_sequence_is_never_read(attend, head_dim):
    """A sequence's last K/V tile runs past Skv: the rows there must be zeros, not the next sequence's. Sequence
    1 holds NaN and inf (its own output is garbage); sequence 0's must be exact."""
    q, k, v = _inputs(2, 100, 1000, 4, 2, head_dim)
    k[1], v[1] = float("nan"), float("inf")
    out = attend(q, k, v)
    _check(out[:1], q[:1], k[:1], v[:1], False, head_dim ** -0.5)


def test_empty_query(attend):
    q, k, v = _inputs(2, 0, 16, 4, 2, 64)
    assert attend(q, k, v).shape == q.shape


def test_rejects_bad_arguments():
    q, k, v = _inputs(1, 64, 64, 4, 2, 64)
    with pytest.raises(TypeError, match="q must be bfloat16"):
        gluon_attention(q.half(), k, v)
    with pytest.raises(TypeError, match="v must be a torch.Tensor"):
        gluon_attention(q, k, None)
    with pytest.raises(ValueError, match="k must be contiguous"):
        gluon_attention(q, k.transpose(1, 2).contiguous().transpose(1, 2), v)
    with pytest.raises(ValueError, match="head dim"):
        gluon_attention(q[..., :32].contiguous(), k[..., :32].contiguous(), v[..., :32].contiguous())
    with pytest.raises(ValueError, match="multiple of k's 3 heads"):
        q3, k3, v3 = _inputs(1, 64, 64, 4, 3, 64)
        gluon_attention(q3, k3, v3)
    with pytest.raises(ValueError, match="causal needs"):
        gluon_attention(q, k[:, :32].contiguous(), v[:, :32].contiguous(), causal=True)
    with pytest.raises(TypeError, match="causal must be a bool"):
        gluon_attention(q, k, v, causal=1)
    with pytest.raises(TypeError, match="softmax_scale"):
        gluon_attention(q, k, v, softmax_scale="0.1")
    with pytest.raises(ValueError, match="q must be on a CUDA device"):
        gluon_attention(q.cpu(), k, v)
