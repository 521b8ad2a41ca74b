"""flash-attn's own forward tests (``tests/test_flash_attn.py`` of flash-attn 2.8: ``test_flash_attn_output``,
``test_flash_attn_varlen_output``, ``test_flash_attn_causal``, ``test_flash_attn_splitkv``), rewritten for
``llmkernels.flash_attn`` with their grids and their acceptance rule: the error against a float64 reference may be
at most twice the error of the same reference computed in the inputs' own dtype (plus a rounding floor). Shapes
and flags as flash-attn draws them: head dims that are not multiples of 16, seqlen_q > seqlen_k and the reverse,
MHA / MQA / GQA, causal and local windows, ALiBi, softcap, random key and query padding for varlen. The
interpreter runs a sampled subset; the GPU (marker ``gpu``) a grid of every flag combination at fewer sizes than
flash-attn's (each combination compiles a kernel).

Not ported: dropout, attention probabilities and backward (out of scope: they raise), and ALiBi combined with
softcap (one score modifier per call: it raises ``NotImplementedError``, checked here).
"""

import itertools

import pytest
import torch
from flash_attn_model import flash_attn_model

from llmkernels.flash_attn import flash_attn_func, flash_attn_varlen_func


def _assert_flash_attn_rule(out, q, k, v, causal, window, softcap, alibi_slopes, query_keep=None, key_keep=None):
    exact = flash_attn_model(q, k, v, causal, window, softcap, alibi_slopes, query_keep, key_keep)
    same_dtype = flash_attn_model(q, k, v, causal, window, softcap, alibi_slopes, query_keep, key_keep, exact=False)
    ours = (out.double() - exact).abs().max().item()
    theirs = (same_dtype.double() - exact).abs().max().item()
    floor = 2 * torch.finfo(q.dtype).eps * exact.abs().max().item()
    assert ours <= 2 * theirs + floor, f"error {ours:.2e} > 2 x {theirs:.2e} (the same reference in {q.dtype})"


def _heads(mha_type):
    return {"mha": (6, 6), "mqa": (6, 1), "gqa": (6, 2)}[mha_type]


def _window(local, causal, seqlen_k):
    if not local:
        return (-1, -1)
    left = int(torch.randint(0, seqlen_k, (1,)))
    right = 0 if causal else int(torch.randint(0, seqlen_k, (1,)))
    return (left, right)


def _scores(score, heads, device):
    """(softcap, alibi slopes) of one case: flash-attn draws slopes in [0, 0.3) per head."""
    if score == "alibi":
        return 0.0, (torch.rand(heads) * 0.3).to(device)
    return (50.0 if score == "softcap" else 0.0), None


HEAD_DIMS = (32, 40, 59, 64, 96, 111, 128, 160, 192, 224, 256)
SEQLENS = (
    (113, 203),
    (128, 217),
    (113, 211),
    (108, 256),
    (256, 512),
    (512, 256),
    (1024, 1024),
    (1023, 1024),
    (1024, 1023),
    (2048, 2048),
    (1, 339),
    (3, 799),
)
# every flag combination at five head dims and four length pairs (each combination compiles its own kernel on the
# GPU: flash-attn's full grid would take most of a session's device time), MQA at one of them
GPU_GRID = [
    pytest.param(*case, marks=pytest.mark.gpu)
    for case in itertools.product(
        (40, 59, 64, 128, 256),
        ((113, 203), (512, 256), (1023, 1024), (1, 339)),
        ("mha", "gqa"),
        (False, True),
        (False, True),
        ("none", "alibi", "softcap"),
    )
] + [pytest.param(111, (2048, 2048), "mqa", causal, False, "none", marks=pytest.mark.gpu) for causal in (False, True)]
# the interpreter's sample: every flag, odd head dims, both seqlen orders, small sizes
CPU_GRID = [
    (59, (113, 203), "gqa", True, False, "none"),
    (40, (128, 67), "mqa", False, True, "alibi"),
    (32, (1, 147), "mha", True, True, "softcap"),
    (96, (97, 61), "gqa", False, False, "softcap"),
    (64, (64, 128), "mqa", True, True, "alibi"),
    (111, (33, 33), "mha", False, True, "none"),
]


@pytest.mark.parametrize("d, seqlens, mha_type, causal, local, score", CPU_GRID + GPU_GRID)
def test_flash_attn_output(d, seqlens, mha_type, causal, local, score, device):
    dtype = torch.float16 if d in (59, 128) else torch.bfloat16
    seqlen_q, seqlen_k = seqlens
    heads, kv_heads = _heads(mha_type)
    batch = 2 if device.type == "cpu" or seqlen_k > 1024 else 4  # the interpreter: fewer sequences
    q = torch.randn(batch, seqlen_q, heads, d).to(device, dtype)
    k, v = (torch.randn(batch, seqlen_k, kv_heads, d).to(device, dtype) for _ in range(2))
    window = _window(local, causal, seqlen_k)
    softcap, slopes = _scores(score, heads, device)
    out = flash_attn_func(q, k, v, causal=causal, window_size=window, softcap=softcap, alibi_slopes=slopes)
    assert out.shape == q.shape and out.dtype == dtype and out.is_contiguous()
    _assert_flash_attn_rule(out, q, k, v, causal, window, softcap, slopes)


VARLEN_GPU_GRID = [
    pytest.param(*case, marks=pytest.mark.gpu)
    for case in itertools.product(
        (59, 128), ((113, 203), (1023, 1024)), ("gqa",), (False, True), (False, True), ("none", "alibi", "softcap")
    )
]
VARLEN_CPU_GRID = [
    (59, (70, 90), "gqa", True, False, "none"),
    (32, (40, 25), "mha", False, True, "alibi"),
    (48, (33, 100), "mqa", True, True, "softcap"),
]


def _padding(batch, seqlen, device):
    """flash-attn's "random" padding: each sequence keeps its first ``length`` positions, length in
    [seqlen / 3, seqlen], one sequence empty-free."""
    lengths = torch.randint(max(1, seqlen // 3), seqlen + 1, (batch,))
    keep = torch.arange(seqlen)[None, :] < lengths[:, None]
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]).to(torch.int32)
    return keep.to(device), cu.to(device), int(lengths.max())


@pytest.mark.parametrize("d, seqlens, mha_type, causal, local, score", VARLEN_CPU_GRID + VARLEN_GPU_GRID)
def test_flash_attn_varlen_output(d, seqlens, mha_type, causal, local, score, device):
    dtype = torch.bfloat16
    seqlen_q, seqlen_k = seqlens
    heads, kv_heads = _heads(mha_type)
    batch = 3 if device.type == "cpu" else 4
    q = torch.randn(batch, seqlen_q, heads, d).to(device, dtype)
    k, v = (torch.randn(batch, seqlen_k, kv_heads, d).to(device, dtype) for _ in range(2))
    query_keep, cu_q, max_q = _padding(batch, seqlen_q, device)
    key_keep, cu_k, max_k = _padding(batch, seqlen_k, device)
    window = _window(local, causal, seqlen_k)
    softcap, slopes = _scores(score, heads, device)
    out_unpad = flash_attn_varlen_func(
        q[query_keep],
        k[key_keep],
        v[key_keep],
        cu_q,
        cu_k,
        max_q,
        max_k,
        causal=causal,
        window_size=window,
        softcap=softcap,
        alibi_slopes=slopes,
    )
    out = torch.zeros_like(q)
    out[query_keep] = out_unpad
    _assert_flash_attn_rule(out, q, k, v, causal, window, softcap, slopes, query_keep, key_keep)


@pytest.mark.parametrize("num_splits", [1, 3, 0])
def test_flash_attn_splitkv(num_splits, device):
    """flash-attn's split-KV test: decode-like shapes with several KV splits give the unsplit rule's accuracy."""
    q = torch.randn(2, 1, 8, 64).to(device, torch.bfloat16)
    k, v = (torch.randn(2, 339, 2, 64).to(device, torch.bfloat16) for _ in range(2))
    out = flash_attn_func(q, k, v, causal=True, num_splits=num_splits)
    _assert_flash_attn_rule(out, q, k, v, True, (-1, -1), 0.0, None)


def test_alibi_with_softcap_raises(device):
    q = torch.zeros(1, 2, 2, 32, dtype=torch.bfloat16, device=device)
    with pytest.raises(NotImplementedError, match="softcap together with alibi_slopes"):
        flash_attn_func(q, q, q, softcap=5.0, alibi_slopes=torch.ones(2, device=device))
