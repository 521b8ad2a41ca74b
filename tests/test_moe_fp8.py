"""fp8 blocks (DeepSeek-V3 / Qwen3-FP8: e4m3 weights with one float32 scale per 128x128 tile, activations with one
per token and 128 columns) through the MoE block, vLLM's ``fused_experts(..., use_fp8_w8a8=True,
block_shape=[128, 128], w1_scale=, w2_scale=)`` and transformers (``quantize_experts(model, "fp8")`` and a tiny
model loaded from an FP8 checkpoint the test writes), against a float64 reference on the same quantized weights
that quantizes both activations as the block does; every bad argument raises before any tensor operation.

Sizes are not multiples of 128 where the format allows it (H = 192 and K = 200: a partial last K tile; I = 160 and
N = 96: a 128-row weight tile that holds gate and up rows)."""

import json

import pytest
import torch
from test_fused_experts import _TensorOps

import llmkernels as lk
from llmkernels.moe import MoEFeedForward, fused_experts
from llmkernels.testing import assert_close_relative, on_gpu, relative_error

WEIGHT_BLOCK, ACTIVATION_BLOCK = (128, 128), (1, 128)
# Against the float64 reference of the same quantized weights and activations, which rounds to bf16 where the
# kernels do and as they do (_bf16): what is left is the final bf16 rounding of the output and fp32 summation
# order. Measured on the CPU: 3.2e-3 to 4.4e-3 (see each test); skipping either activation quantization moves the
# output by about 3e-2.
TOLERANCE = 1e-2


def _bf16(v: torch.Tensor) -> torch.Tensor:
    """``v`` rounded to bf16 as the kernels write it: to nearest even on the GPU; Triton's interpreter truncates
    (the float32 bits' upper half), and an fp8 quantization after it would turn that one-bit difference into
    flipped e4m3 roundings (1.3e-2 of relative error, measured) if the reference rounded to nearest."""
    if on_gpu():
        return v.to(torch.bfloat16)
    return (v.float().view(torch.int32) & -(1 << 16)).view(torch.float32).to(torch.bfloat16)


def _fp8_rows(v: torch.Tensor) -> torch.Tensor:
    """float64 values of ``v`` (bf16, or rounded to it by :func:`_bf16`) quantized to fp8 per row and 128 columns
    (the reference quantizer: the same bits as ``lk.quantize``, tested with the format)."""
    v = v if v.dtype == torch.bfloat16 else _bf16(v)
    return lk.dequantize(lk.quantize_reference(v, "fp8", block=ACTIVATION_BLOCK)).double()


def _experts_reference(x, w1, w2, topk_weights, topk_ids):
    """float64 ``Σ_j weight · w2[e] (silu(gate) · up)`` of ``w1 [E, 2N, K]`` / ``w2 [E, K, N]`` (float64 values of
    the quantized weights): the tokens and the hidden activations quantized to fp8 (1x128) from bf16, each
    expert's output rounded to bf16, as the kernels write it; a copy whose id lies outside [0, E) adds nothing."""
    w1, w2 = w1.double(), w2.double()
    num_experts, n = w1.shape[0], w2.shape[2]
    tokens = _fp8_rows(x)
    out = torch.zeros(x.shape, dtype=torch.float64, device=x.device)
    for slot in range(topk_ids.shape[1]):
        ids = topk_ids[:, slot].long()
        expert = ids.clamp(0, num_experts - 1)
        h = torch.einsum("tnk,tk->tn", w1[expert], tokens)
        act = _fp8_rows(torch.nn.functional.silu(h[:, :n]) * h[:, n:])
        y = _bf16(torch.einsum("tkn,tn->tk", w2[expert], act)).double()
        kept = ((ids >= 0) & (ids < num_experts))[:, None]
        out += torch.where(kept, topk_weights[:, slot, None].double() * y, 0.0)
    return out


def _float_moe(x, w_gate_up, w_down, weights, ids):
    """float64 MoE on unquantized weights and activations (what the bf16 block computes, up to bf16 rounding)."""
    w_gate_up, w_down, x = w_gate_up.double(), w_down.double(), x.double()
    intermediate = w_down.shape[2]
    out = torch.zeros_like(x)
    for slot in range(ids.shape[1]):
        h = torch.einsum("tnk,tk->tn", w_gate_up[ids[:, slot]], x)
        act = torch.nn.functional.silu(h[:, :intermediate]) * h[:, intermediate:]
        out += weights[:, slot, None] * torch.einsum("tkn,tn->tk", w_down[ids[:, slot]], act)
    return out


def _route(x, router_weight, top_k):
    """Softmax top-k routing, renormalized, in float64."""
    scores = (x.double() @ router_weight.double().t()).softmax(-1)
    weights, ids = scores.topk(top_k, -1)
    return weights / weights.sum(-1, keepdim=True), ids


def test_block_matches_float64_reference_of_its_quantized_weights(device):
    """``from_float(weight_format="fp8")``: fp8 (128, 128) weights with the reference's bits, fp8 activations by
    default, the output within TOLERANCE of the float64 reference (measured 4.4e-3) and within 0.12 of the float MoE
    on the unquantized weights, what the bf16 block computes up to its bf16 roundings (measured 6.5e-2: four e4m3
    roundings, of x, w_gate_up, the hidden activations and w_down, each of 3 mantissa bits)."""
    num_experts, hidden, intermediate, top_k = 3, 192, 160, 2
    router = torch.randn(num_experts, hidden, device=device)
    w_gate_up = torch.randn(num_experts, 2 * intermediate, hidden, device=device) / hidden**0.5
    w_down = torch.randn(num_experts, hidden, intermediate, device=device) / intermediate**0.5
    block = MoEFeedForward.from_float(router, w_gate_up, w_down, top_k, weight_format="fp8")
    assert block.activation_format == "fp8"
    for weight, source in ((block.w_gate_up, w_gate_up), (block.w_down, w_down)):
        expected = lk.quantize_reference(source, "fp8", block=WEIGHT_BLOCK)
        assert weight.format == "fp8" and weight.block == WEIGHT_BLOCK
        assert torch.equal(weight.data.view(torch.uint8), expected.data.view(torch.uint8))
        assert torch.equal(weight.scales, expected.scales)
    x = torch.randn(2, 3, hidden, device=device, dtype=torch.bfloat16)
    out = block(x)
    assert out.shape == x.shape and out.dtype == x.dtype
    flat = x.reshape(-1, hidden)
    weights, ids = _route(flat, router, top_k)
    expected = _experts_reference(flat, lk.dequantize(block.w_gate_up), lk.dequantize(block.w_down), weights, ids)
    assert_close_relative(out.reshape(-1, hidden).float(), expected, TOLERANCE, "fp8 block")
    unquantized = _float_moe(flat, w_gate_up, w_down, weights, ids)
    assert relative_error(out.reshape(-1, hidden).float(), unquantized) < 0.12


def _vllm_problem(device, tokens=5, experts=3, k=200, n=96, top_k=3):
    x = torch.randn(tokens, k, device=device).bfloat16()
    w1 = lk.quantize(torch.randn(experts, 2 * n, k, device=device) / k**0.5, "fp8", block=WEIGHT_BLOCK)
    w2 = lk.quantize(torch.randn(experts, k, n, device=device) / n**0.5, "fp8", block=WEIGHT_BLOCK)
    topk_ids = torch.stack([torch.randperm(experts, device=device)[:top_k] for _ in range(tokens)]).int()
    topk_weights = torch.rand(tokens, top_k, device=device).softmax(-1)
    return x, w1, w2, topk_weights, topk_ids


def test_fused_experts_vllm_fp8_call(device):
    """vLLM's fp8 block call on raw float8_e4m3fn weights and float32 block scales: top_k = 3 with -1 and
    out-of-range ids (their copies add nothing; token 0 has none left and is exactly 0) against the float64
    reference (measured 3.2e-3); scales read through strided views with ``inplace=True`` give the same bits."""
    x, w1, w2, topk_weights, topk_ids = _vllm_problem(device)
    topk_ids[0] = torch.tensor([-1, 3, 1 << 30])
    topk_ids[1, 2], topk_ids[2, 0] = -1, 7
    fp8 = dict(use_fp8_w8a8=True, block_shape=[128, 128])
    out = fused_experts(x, w1.data, w2.data, topk_weights, topk_ids, w1_scale=w1.scales, w2_scale=w2.scales, **fp8)
    assert out.shape == x.shape and out.dtype == x.dtype
    assert (out[0] == 0).all()
    expected = _experts_reference(x, lk.dequantize(w1), lk.dequantize(w2), topk_weights, topk_ids)
    assert_close_relative(out.float(), expected, TOLERANCE, "vLLM fp8 call")
    strided = [s.transpose(1, 2).contiguous().transpose(1, 2) for s in (w1.scales, w2.scales)]
    assert not strided[0].is_contiguous()
    y = x.clone()
    inplace = fused_experts(
        y, w1.data, w2.data, topk_weights, topk_ids, inplace=True, w1_scale=strided[0], w2_scale=strided[1], **fp8
    )
    assert inplace is y and torch.equal(y, out)


def test_fp8_arguments_are_checked_before_any_launch(device):
    """Each bad fp8 argument of fused_experts (inplace: hidden_states keeps its bits) and of the MoE block raises,
    naming it, before any tensor operation."""
    x, w1, w2, topk_weights, topk_ids = _vllm_problem(device, tokens=3, top_k=2)
    experts, k = w1.shape[0], w1.shape[2]
    fp8 = dict(use_fp8_w8a8=True, block_shape=[128, 128], w1_scale=w1.scales, w2_scale=w2.scales)
    rows_w1 = lk.quantize(lk.dequantize(w1), "fp8", block=ACTIVATION_BLOCK)  # per-row scales: not a weight's
    cases = {
        "no w1_scale": (ValueError, "needs w1_scale", dict(fp8, w1_scale=None)),
        "w1_scale off by one": (ValueError, "w1_scale must be", dict(fp8, w1_scale=w1.scales[:, :1])),
        "w2_scale of fp16": (TypeError, "w2_scale must be a float32", dict(fp8, w2_scale=w2.scales.half())),
        "block_shape 64x64": (ValueError, "block_shape", dict(fp8, block_shape=[64, 64])),
        "per-tensor fp8": (ValueError, "block_shape", dict(fp8, block_shape=None)),
        "bf16 w1": (TypeError, "w1 must be a float8_e4m3fn", dict(fp8, w1=lk.dequantize(w1).bfloat16())),
        "raw fp8 without use_fp8_w8a8": (TypeError, "use_fp8_w8a8", dict()),
        "scales without use_fp8_w8a8": (ValueError, "w1_scale goes with use_fp8_w8a8", dict(w1_scale=w1.scales)),
        "static a1_scale": (ValueError, "a1_scale", dict(fp8, a1_scale=torch.ones(1, device=device))),
        "per_act_token_quant": (ValueError, "per_act_token_quant", dict(fp8, per_act_token_quant=True)),
        "use_fp8_w8a8 not a bool": (TypeError, "use_fp8_w8a8", dict(fp8, use_fp8_w8a8=1)),
        "mxfp8 activations": (TypeError, "fp8 only with fp8", dict(fp8, activation_format="mxfp8")),
        "a 1x128 weight": (ValueError, "block", dict(w1=rows_w1, w2=w2)),
    }
    for name, (error, message, changes) in cases.items():
        call = {"w1": w1.data, "w2": w2.data, **changes}
        hidden_states = x.clone()
        with _TensorOps() as recorded, pytest.raises(error, match=message):
            fused_experts(hidden_states, call.pop("w1"), call.pop("w2"), topk_weights, topk_ids, inplace=True, **call)
        assert recorded.ops == [], f"{name}: ran {recorded.ops} before raising"
        assert torch.equal(hidden_states, x), name
    router = torch.randn(experts, k, device=device)
    w_gate_up, w_down = lk.dequantize(w1), lk.dequantize(w2)  # [E, 2I, H] and [E, H, I]
    for name, (message, changes) in {
        "hopper layout": ("weight_layout", dict(weight_format="fp8", weight_layout="hopper")),
        "mxfp8 activations, fp8 weights": ("does not pair", dict(weight_format="fp8", activation_format="mxfp8")),
        "fp8 activations, mxfp8 weights": ("does not pair", dict(weight_format="mxfp8", activation_format="fp8")),
    }.items():
        with _TensorOps() as recorded, pytest.raises(ValueError, match=message):
            MoEFeedForward.from_float(router, w_gate_up, w_down, 2, **changes)
        assert recorded.ops == [], f"{name}: ran {recorded.ops} before raising"
    with pytest.raises(ValueError, match="block"):
        MoEFeedForward(router, rows_w1, w2, 2)


def test_transformers_fp8_checkpoint_and_quantize_experts(device, tmp_path, monkeypatch):
    """A tiny Qwen3-MoE written as a fine-grained FP8 checkpoint (``quant_method: "fp8"``, ``weight_block_size:
    [128, 128]``: each expert's gate, up and down projection in e4m3 with its ``weight_scale_inv``, made by
    ``lk.quantize``) loads into transformers' ``FP8Experts`` and runs its experts through llmkernels: the weights
    read in place have the bits of ``quantize_experts(model, "fp8")`` on the bf16 model, the experts' output agrees
    with the float64 reference on the module's own inputs (measured 3.4e-3), and the logits with those of the
    bf16 model (eager) within 2e-2 (measured 6.7e-3)."""
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import load_file, save_file
    from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer

    from llmkernels.integrations import transformers as lk_transformers

    lk_transformers.register()
    config = transformers.Qwen3MoeConfig(
        vocab_size=64,
        hidden_size=128,
        intermediate_size=128,
        moe_intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        num_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=32,
    )
    bf16 = transformers.Qwen3MoeForCausalLM._from_config(config, attn_implementation="eager")
    bf16 = bf16.to(device=device, dtype=torch.bfloat16).eval()
    bf16.save_pretrained(tmp_path / "bf16")
    checkpoint = {}
    for key, value in load_file(tmp_path / "bf16" / "model.safetensors").items():
        if ".experts." in key:  # per-expert [rows, cols] projections, as the checkpoints store them
            quantized = lk.quantize(value.to(device), "fp8", block=WEIGHT_BLOCK)  # safetensors load to the CPU
            checkpoint[key] = quantized.data.cpu()
            checkpoint[key.replace(".weight", ".weight_scale_inv")] = quantized.scales.cpu()
        else:
            checkpoint[key] = value
    (tmp_path / "fp8").mkdir()
    save_file(checkpoint, tmp_path / "fp8" / "model.safetensors", metadata={"format": "pt"})
    fields = json.loads((tmp_path / "bf16" / "config.json").read_text())
    fields["quantization_config"] = {
        "quant_method": "fp8",
        "weight_block_size": [128, 128],
        "activation_scheme": "dynamic",
        "modules_to_not_convert": ["q_proj", "k_proj", "v_proj", "o_proj", "lm_head"],  # experts only
    }
    (tmp_path / "fp8" / "config.json").write_text(json.dumps(fields))
    # transformers' FP8 quantizer dequantizes a checkpoint on a host without a GPU and wants accelerate: the test
    # loads it as a GPU host would
    monkeypatch.setattr(FineGrainedFP8HfQuantizer, "validate_environment", lambda self, *args, **kwargs: None)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "fp8", attn_implementation="eager", experts_implementation="llmkernels", device_map=None
    )
    model = model.to(device).eval()
    experts = model.model.layers[0].mlp.experts
    assert type(experts).__name__ == "FP8Experts" and experts.gate_up_proj.dtype == torch.float8_e4m3fn

    ids = torch.randint(0, 64, (1, 8), device=device)
    with torch.no_grad():
        bf16_logits = bf16(ids).logits.float()
    assert lk_transformers.quantize_experts(bf16, "fp8") == 1
    assert lk_transformers.quantize_experts(model, "fp8") == 0  # quantized already: run as loaded
    calls = []
    experts.register_forward_hook(
        lambda module, args, kwargs, output: calls.append((args, kwargs, output)), with_kwargs=True
    )
    with torch.no_grad():
        logits = model(ids).logits.float()
    loaded = experts.llmkernels_weights
    ours = bf16.model.layers[0].mlp.experts.llmkernels_weights
    for name in ("w1", "w2"):
        a, b = getattr(loaded, name), getattr(ours, name)
        assert a.format == b.format == "fp8" and a.block == b.block == WEIGHT_BLOCK, name
        assert torch.equal(a.data.view(torch.uint8), b.data.view(torch.uint8)), name
        assert torch.equal(a.scales, b.scales), name
    assert loaded.w1.data.data_ptr() == experts.gate_up_proj.data_ptr(), (
        "the checkpoint's weights are not read in place"
    )
    args, kwargs, output = calls[0]
    names = ("hidden_states", "top_k_index", "top_k_weights")
    hidden_states, top_k_index, top_k_weights = (*args, *(kwargs[name] for name in names[len(args) :]))
    expected = _experts_reference(
        hidden_states, lk.dequantize(loaded.w1), lk.dequantize(loaded.w2), top_k_weights, top_k_index
    )
    assert_close_relative(output.float(), expected, TOLERANCE, "FP8Experts")
    assert relative_error(logits, bf16_logits) < 2e-2
