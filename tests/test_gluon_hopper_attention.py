"""The warp-specialized Gluon attention kernel for Hopper (``llmkernels.attention.gluon_hopper``) against a float32
PyTorch reference, on an sm_90 GPU (the kernel uses TMA, wgmma and warp specialization: it cannot run elsewhere,
nor in the interpreter). ``lk.attention`` takes this path on such a GPU: tests/test_attention*.py cover it there
too."""
import math

import pytest
import torch
import torch.nn.functional as F

from llmkernels.attention.gluon_hopper import gluon_attention, supports


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


def _reference(q, k, v, causal, softmax_scale):
    """float32 (out [B, Sq, Hq, D], natural-log lse [B, Hq, Sq]); causal bottom-right aligned."""
    qf, kf, vf = (x.float().transpose(1, 2) for x in (q, k, v))
    kf = kf.repeat_interleave(q.shape[2] // k.shape[2], dim=1)
    vf = vf.repeat_interleave(q.shape[2] // k.shape[2], dim=1)
    scores = softmax_scale * qf @ kf.transpose(-1, -2)
    if causal:
        seqlen_q, seqlen_kv = q.shape[1], k.shape[1]
        rows = torch.arange(seqlen_q, device=q.device)[:, None]
        cols = torch.arange(seqlen_kv, device=q.device)[None, :]
        scores = scores.masked_fill(cols > rows + seqlen_kv - seqlen_q, float("-inf"))
    lse = scores.logsumexp(-1)
    return (torch.softmax(scores, -1) @ vf).transpose(1, 2), lse


def _inputs(batch, seqlen_q, seqlen_kv, q_heads, kv_heads, head_dim, q_gain=1.0, dtype=torch.bfloat16):
    q = (torch.randn(batch, seqlen_q, q_heads, head_dim, device="cuda") * q_gain).to(dtype)
    k = torch.randn(batch, seqlen_kv, kv_heads, head_dim, device="cuda", dtype=dtype)
    v = torch.randn(batch, seqlen_kv, kv_heads, head_dim, device="cuda", dtype=dtype)
    return q, k, v


def _check(result, q, k, v, causal, softmax_scale):
    out, lse = result
    assert out.dtype == q.dtype and out.shape == q.shape and out.is_contiguous()
    assert not torch.isnan(out).any(), "NaN in the output"
    ref, ref_lse = _reference(q, k, v, causal, softmax_scale)
    error = ((out.float() - ref).norm() / ref.norm()).item()
    assert error < TOLERANCE, f"relative error {error:.2e}"
    assert lse.shape == ref_lse.shape and lse.dtype == torch.float32
    torch.testing.assert_close(lse, ref_lse, atol=2e-2, rtol=1e-3)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("seqlen", [128, 1000, 2048])
def test_matches_reference(attend, seqlen, head_dim, causal):
    q, k, v = _inputs(2, seqlen, seqlen, 8, 2, head_dim)
    _check(attend(q, k, v, causal=causal, return_lse=True), q, k, v, causal, head_dim ** -0.5)


@pytest.mark.parametrize("batch, seqlen_q, seqlen_kv, q_heads, kv_heads, head_dim, causal, q_gain, scale, dtype", [
    (1, 1, 1000, 4, 1, 128, False, 1.0, None, torch.bfloat16),  # MQA, one query: Sq far below the Q block
    (3, 300, 77, 8, 8, 64, False, 1.0, None, torch.bfloat16),  # Skv below one K/V tile
    (2, 513, 513, 6, 3, 128, True, 4.0, None, torch.bfloat16),  # peaked scores: the running max moves
    (2, 700, 700, 4, 2, 64, True, 1.0, 0.3, torch.bfloat16),  # explicit softmax_scale
    (2, 200, 1000, 4, 2, 128, True, 1.0, None, torch.bfloat16),  # causal, Sq < Skv: bottom-right aligned
    (1, 1, 300, 2, 1, 64, True, 1.0, None, torch.bfloat16),  # one query sees every key
    (2, 640, 640, 4, 4, 128, True, 1.0, None, torch.float16),
    (1, 3000, 3000, 2, 1, 64, False, 1.0, None, torch.float16),
    (2, 333, 900, 4, 1, 256, True, 4.0, None, torch.bfloat16),  # D = 256: 64-key tiles
], ids=["mqa-one-query", "mha-short-kv", "peaked-causal", "scale", "causal-bottom-right", "causal-one-query",
        "fp16-causal", "fp16-long", "d256-causal-bottom-right"])
def test_other_shapes(attend, batch, seqlen_q, seqlen_kv, q_heads, kv_heads, head_dim, causal, q_gain, scale, dtype):
    q, k, v = _inputs(batch, seqlen_q, seqlen_kv, q_heads, kv_heads, head_dim, q_gain, dtype)
    result = attend(q, k, v, causal=causal, softmax_scale=scale, return_lse=True)
    _check(result, q, k, v, causal, head_dim ** -0.5 if scale is None else scale)


def test_strided_views(attend):
    """q, k, v as slices of one packed [B, S, 3, H, D] tensor (token stride 3·H·D) and of a longer batch; the
    result equals the contiguous call's bit for bit."""
    packed = torch.randn(3, 700, 3, 4, 128, device="cuda", dtype=torch.bfloat16)
    q, k, v = packed[1:, :, 0], packed[1:, :, 1], packed[1:, :, 2]
    assert supports(q, k, v, True, 0.1)
    out, lse = attend(q, k, v, causal=True, return_lse=True)
    expected, expected_lse = attend(q.contiguous(), k.contiguous(), v.contiguous(), causal=True, return_lse=True)
    assert torch.equal(out, expected) and torch.equal(lse, expected_lse)
    _check((out, lse), q, k, v, True, 128 ** -0.5)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_next_sequence_is_never_read(attend, head_dim):
    """A sequence's last K/V tile runs past Skv: the rows there must be zeros, not the next sequence's. Sequence
    1 holds NaN and inf (its own output is garbage); sequence 0's must be exact."""
    q, k, v = _inputs(2, 100, 1000, 4, 2, head_dim)
    k[1], v[1] = float("nan"), float("inf")
    out, lse = attend(q, k, v, return_lse=True)
    _check((out[:1], lse[:1]), q[:1], k[:1], v[:1], False, head_dim ** -0.5)


def test_empty_query(attend):
    q, k, v = _inputs(2, 0, 16, 4, 2, 64)
    assert attend(q, k, v).shape == q.shape


def test_supports():
    q, k, v = _inputs(1, 64, 64, 4, 2, 64)
    assert supports(q, k, v, False, 0.1)
    assert not supports(q.float(), k.float(), v.float(), False, 0.1)  # dtype
    assert not supports(q[..., :32], k[..., :32], v[..., :32], False, 0.1)  # head dim 32
    assert supports(*_inputs(1, 64, 64, 4, 2, 256), True, 0.1)
    assert not supports(q, k, v, False, -0.1)  # scale
    assert not supports(q, k[:, :32], v[:, :32], True, 0.1)  # causal with Sq > Skv
    assert not supports(q.transpose(1, 2).contiguous().transpose(1, 2), k, v, False, 0.1)  # heads not contiguous
    q2 = torch.cat([q, q])
    assert not supports(q2, k.expand(2, -1, -1, -1), v.expand(2, -1, -1, -1), False, 0.1)  # batch stride 0
    assert not supports(q.cpu(), k.cpu(), v.cpu(), False, 0.1)


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
    with pytest.raises(ValueError, match="does not run"):
        gluon_attention(q, k[:, :32].contiguous(), v[:, :32].contiguous(), causal=True)
    with pytest.raises(ValueError, match="does not run"):
        gluon_attention(q[..., :32].contiguous(), k[..., :32].contiguous(), v[..., :32].contiguous())


def test_lk_attention_takes_this_kernel():
    """``lk.attention`` runs this kernel for dense causal / unmasked calls (same bits, LSE included), and the
    portable kernel when given a config."""
    import llmkernels as lk
    from llmkernels.attention.config import default_config

    q, k, v = _inputs(2, 1000, 1000, 8, 2, 128)
    for causal in (False, True):
        out, lse = lk.attention(q, k, v, causal=causal, return_lse=True)
        expected, expected_lse = gluon_attention(q, k, v, causal=causal, return_lse=True)
        assert torch.equal(out, expected) and torch.equal(lse, expected_lse)
    portable = lk.attention(q, k, v, causal=True, config=default_config(128, q.dtype, q.device))
    assert not torch.equal(portable, gluon_attention(q, k, v, causal=True))
