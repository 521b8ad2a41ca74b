"""``llmkernels.moe.fused_experts``: vLLM's call shape (``w1 [E, 2N, K]`` gate first, ``w2 [E, K, N]``) against a
float64 loop over tokens and their experts, for bf16 and quantized weights, expert maps and router weights on
the input."""
import pytest
import torch

import llmkernels as lk
from llmkernels._testing import assert_close_relative
from llmkernels.moe import fused_experts

TOLERANCE = {"bf16": 2e-2, "mxfp8": 3e-2, "mxfp4": 3e-2, "nvfp4": 3e-2}


def _swigluoai(h):
    """vLLM's / gpt-oss' activation on interleaved gate and up values."""
    gate, up = h[0::2].clamp(max=7.0), h[1::2].clamp(-7.0, 7.0)
    return gate * torch.sigmoid(1.702 * gate) * (up + 1)


def _reference(x, w1, w2, topk_weights, topk_ids, on_input=False, expert_map=None, b1=None, b2=None,
               activation="silu"):
    """float64: for each token and slot, the expert's gated MLP, weighted (on its input or its output)."""
    x, w1, w2 = x.double(), w1.double(), w2.double()
    n = w2.shape[2]
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for slot in range(topk_ids.shape[1]):
            e = int(topk_ids[t, slot])
            if expert_map is not None:
                e = int(expert_map[e])
                if e < 0:
                    continue
            weight = float(topk_weights[t, slot])
            token = x[t] * weight if on_input else x[t]
            h = w1[e] @ token + (0 if b1 is None else b1[e].double())
            act = _swigluoai(h) if activation == "swigluoai" else torch.nn.functional.silu(h[:n]) * h[n:]
            y = w2[e] @ act + (0 if b2 is None else b2[e].double())
            out[t] += y if on_input else weight * y
    return out


def _problem(device, tokens=9, experts=4, k=64, n=32, top_k=2):
    x = torch.randn(tokens, k, device=device).bfloat16()
    w1 = (torch.randn(experts, 2 * n, k, device=device) / k**0.5).bfloat16()
    w2 = (torch.randn(experts, k, n, device=device) / n**0.5).bfloat16()
    topk_ids = torch.stack([torch.randperm(experts, device=device)[:top_k] for _ in range(tokens)]).int()
    topk_weights = torch.rand(tokens, top_k, device=device).softmax(-1)
    return x, w1, w2, topk_weights, topk_ids


@pytest.mark.parametrize("fmt", ["bf16", "mxfp8", "mxfp4", "nvfp4"])
def test_matches_the_reference(fmt, device):
    x, w1, w2, topk_weights, topk_ids = _problem(device)
    if fmt == "bf16":
        b1, b2, r1, r2 = w1, w2, w1, w2
    else:
        b1, b2 = lk.quantize(w1, fmt), lk.quantize(w2, fmt)
        r1, r2 = lk.dequantize(b1), lk.dequantize(b2)
    out = fused_experts(x, b1, b2, topk_weights, topk_ids)
    assert out.shape == x.shape and out.dtype == x.dtype
    assert_close_relative(out.float(), _reference(x, r1, r2, topk_weights, topk_ids), TOLERANCE[fmt])


@pytest.mark.parametrize("fmt", ["bf16", "mxfp4"])
def test_swigluoai_with_biases(fmt, device):
    """gpt-oss through vLLM's call: interleaved w1 rows, ``activation="swigluoai"``, ``w1_bias`` / ``w2_bias``; values
    large enough that the clamp at 7 bites."""
    x, w1, w2, topk_weights, topk_ids = _problem(device, top_k=3)
    w1 = w1 * 8
    b1, b2 = torch.randn(w1.shape[:2], device=device), torch.randn(w2.shape[:2], device=device)
    q1, q2 = (w1, w2) if fmt == "bf16" else (lk.quantize(w1, fmt), lk.quantize(w2, fmt))
    out = fused_experts(x, q1, q2, topk_weights, topk_ids, activation="swigluoai", w1_bias=b1, w2_bias=b2)
    r1, r2 = (w1, w2) if fmt == "bf16" else (lk.dequantize(q1), lk.dequantize(q2))
    h = r1.float() @ x.float().T
    assert (h.abs() > 7).any(), "the clamp never bites"
    expected = _reference(x, r1, r2, topk_weights, topk_ids, b1=b1, b2=b2, activation="swigluoai")
    assert_close_relative(out.float(), expected, TOLERANCE[fmt])


def test_expert_map_inplace_and_weights_on_input(device):
    x, w1, w2, topk_weights, topk_ids = _problem(device, experts=4, top_k=1)
    # 6 global experts, this rank holds global 1, 3, 4, 5 as local 0..3 (0 and 2 live elsewhere)
    expert_map = torch.tensor([-1, 0, -1, 1, 2, 3], dtype=torch.int32, device=device)
    global_ids = torch.randint(0, 6, topk_ids.shape, device=device).int()
    out = fused_experts(x, w1, w2, topk_weights, global_ids, global_num_experts=6, expert_map=expert_map)
    expected = _reference(x, w1, w2, topk_weights, global_ids, expert_map=expert_map)
    assert_close_relative(out.float(), expected, TOLERANCE["bf16"])
    remote = (expert_map[global_ids.long()] < 0).all(1)
    assert (out[remote] == 0).all()
    on_input = fused_experts(x, w1, w2, topk_weights, topk_ids, apply_router_weight_on_input=True)
    assert_close_relative(on_input.float(), _reference(x, w1, w2, topk_weights, topk_ids, on_input=True),
                          TOLERANCE["bf16"])
    y = x.clone()
    assert fused_experts(y, w1, w2, topk_weights, topk_ids, inplace=True) is y
    assert torch.equal(y, fused_experts(x, w1, w2, topk_weights, topk_ids))


def test_errors(device):
    x, w1, w2, topk_weights, topk_ids = _problem(device)
    with pytest.raises(NotImplementedError, match="activation"):
        fused_experts(x, w1, w2, topk_weights, topk_ids, activation="gelu")
    with pytest.raises(ValueError, match="w2"):
        fused_experts(x, w1, w2.transpose(1, 2), topk_weights, topk_ids)
    with pytest.raises(ValueError, match="topk_ids"):
        fused_experts(x, w1, w2, topk_weights, topk_ids[:, :1])
    with pytest.raises(TypeError, match="topk_ids"):
        fused_experts(x, w1, w2, topk_weights, topk_ids.float())
    with pytest.raises(ValueError, match="w1_bias must be a \\[E, 64\\]"):
        fused_experts(x, w1, w2, topk_weights, topk_ids, w1_bias=torch.zeros(4, 32, device=device))
    with pytest.raises(ValueError, match="interleaved"):
        fused_experts(x, lk.quantize(w1, "mxfp4", scale_layout="hopper"), w2, topk_weights, topk_ids,
                      activation="swigluoai")
