"""transformers with ``attn_implementation="llmkernels"`` (``llmkernels.integrations.transformers.register``): tiny
Llama-like, gpt-oss-like and Qwen3-MoE-like models built from configs (no download) generate the same greedy
tokens as ``"eager"`` on the same bf16 weights (a differing token only where eager's top two logits are within
twice the logits' difference: a near-tie of random tiny models, checked), and their logits agree at every
non-padding position."""
import copy
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")
from llmkernels.integrations import transformers as lk_transformers  # noqa: E402

TOLERANCE = 2e-2  # bf16 attention against transformers' eager bf16 attention, relative over the logits


def _models(device, config_class, model_class, experts=None, **fields):
    lk_transformers.register()
    torch.manual_seed(0)
    config = config_class(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
                          **fields)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        eager = model_class._from_config(copy.deepcopy(config), attn_implementation="eager")
        extra = {} if experts is None else {"experts_implementation": experts}
        ours = model_class._from_config(copy.deepcopy(config), attn_implementation="llmkernels", **extra)
    eager = eager.to(device=device, dtype=torch.bfloat16).eval()
    ours = ours.to(device=device, dtype=torch.bfloat16).eval()
    ours.load_state_dict(eager.state_dict())
    assert ours.config._attn_implementation == "llmkernels" and eager.config._attn_implementation == "eager"
    return eager, ours


def _compare(eager, ours, device, tolerance=TOLERANCE):
    ids = torch.randint(0, 128, (2, 9), device=device)
    padding = torch.ones_like(ids)
    padding[1, :3] = 0  # left padding: those query rows see no key (ours: 0, eager: uniform weights)
    calls = []
    forward = lk_transformers.attention_forward

    def counted(*args, **kwargs):
        calls.append(1)
        return forward(*args, **kwargs)

    transformers.AttentionInterface.register("llmkernels", counted)
    try:
        with torch.no_grad():
            expected = eager.generate(ids, attention_mask=padding, max_new_tokens=8, do_sample=False)
            tokens = ours.generate(ids, attention_mask=padding, max_new_tokens=8, do_sample=False)
            expected_logits = eager(ids, attention_mask=padding).logits.float()
            logits = ours(ids, attention_mask=padding).logits.float()
    finally:
        lk_transformers.register()
    assert calls, "the llmkernels attention was not called"
    keep = padding.bool()
    error = (logits[keep] - expected_logits[keep]).norm() / expected_logits[keep].norm()
    assert error < tolerance, f"logits differ by {error:.2e}"
    if not torch.equal(tokens, expected):  # only a near-tie of the eager logits may flip a greedy token
        row, step = next((r, s) for r in range(tokens.shape[0]) for s in range(tokens.shape[1])
                         if tokens[r, s] != expected[r, s])
        prefix = expected[row:row + 1, :step]
        prefix_mask = torch.ones_like(prefix)
        prefix_mask[0, :padding.shape[1]] = padding[row]
        with torch.no_grad():
            step_logits = eager(prefix, attention_mask=prefix_mask).logits[0, -1].float()
            ours_logits = ours(prefix, attention_mask=prefix_mask).logits[0, -1].float()
        gap = (step_logits[expected[row, step]] - step_logits[tokens[row, step]]).item()
        assert gap <= 2 * (ours_logits - step_logits).abs().max().item(), (
            f"token {step} of row {row} differs where eager's choice leads by {gap:.3f}: not a near-tie")


def test_llama_like(device):
    _compare(*_models(device, transformers.LlamaConfig, transformers.LlamaForCausalLM), device)


def test_gpt_oss_like_sinks_and_sliding_windows(device):
    # every token takes both experts: a routing decision flipped by bf16 noise would swamp the comparison
    eager, ours = _models(device, transformers.GptOssConfig, transformers.GptOssForCausalLM, num_local_experts=2,
                          num_experts_per_tok=2, sliding_window=4, layer_types=["sliding_attention", "full_attention"])
    with torch.no_grad():  # non-zero sinks, so that they matter
        for layer in (*eager.model.layers, *ours.model.layers):
            layer.self_attn.sinks.copy_(torch.linspace(-1, 1, 4))
    _compare(eager, ours, device)


def test_qwen3_moe_like_experts(device):
    """Experts through ``experts_implementation="llmkernels"`` (bf16, then MXFP4 from ``quantize_experts``
    against an eager model on the dequantized weights). Every token takes every expert (no routing flips)."""
    import llmkernels as lk

    eager, ours = _models(device, transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM, experts="llmkernels",
                          moe_intermediate_size=32, num_experts=4, num_experts_per_tok=4)
    assert ours.config._experts_implementation == "llmkernels"
    calls = []
    forward = lk_transformers.experts_forward

    def counted(*args, **kwargs):
        calls.append(1)
        return forward(*args, **kwargs)

    transformers.integrations.moe.ExpertsInterface.register("llmkernels", counted)
    try:
        _compare(eager, ours, device)
    finally:
        lk_transformers.register()
    assert calls, "the llmkernels experts were not called"
    assert lk_transformers.quantize_experts(ours, "mxfp4") == 2
    with torch.no_grad():  # the eager model on the weights the quantized one holds
        for module, reference in zip(ours.modules(), eager.modules()):
            if hasattr(module, "llmkernels_weights"):
                reference.gate_up_proj.copy_(lk.dequantize(module.llmkernels_weights[0]))
                reference.down_proj.copy_(lk.dequantize(module.llmkernels_weights[1]))
    _compare(eager, ours, device)


def test_dropout_is_refused(device):
    query = torch.zeros(1, 4, 2, 16, dtype=torch.bfloat16, device=device)
    key = torch.zeros(1, 2, 2, 16, dtype=torch.bfloat16, device=device)
    with pytest.raises(ValueError, match="dropout"):
        lk_transformers.attention_forward(torch.nn.Module(), query, key, key, None, dropout=0.1)
