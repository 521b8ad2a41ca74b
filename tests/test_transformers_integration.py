"""transformers with ``attn_implementation="llmkernels"`` and ``experts_implementation="llmkernels"``
(``llmkernels.integrations.transformers.register``): tiny Llama-like, gpt-oss-like, Qwen3-MoE-like, Mixtral-like and
DeepSeek-V3-like models built from configs (no download) generate the same greedy tokens as ``"eager"`` on the same
bf16 weights (a differing token only where eager's top two logits are within twice the logits' difference: a
near-tie of random tiny models, checked), and their logits agree at every non-padding position of the prompt, as on
an unpadded sequence (plain causal attention, no mask). With MXFP4 experts
(``quantize_experts``) the logits agree with an eager model on the dequantized weights within ``TOLERANCE``."""

import copy
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")
from llmkernels.integrations import transformers as lk_transformers  # noqa: E402
from llmkernels.moe.layer import prefers_hopper_layout  # noqa: E402

TOLERANCE = 2e-2  # bf16 attention against transformers' eager bf16 attention, relative over the logits
# SiLU-gated experts' weights times this: at the configs' initializer range their output is a few percent of the
# residual stream, and experts off by 10% moved the logits' error from 0.5% to 0.6% (Mixtral-like), well within
# TOLERANCE; times 3 it outweighs the residual stream, and the same fault reads 3.5% to 4.3%.
EXPERT_GAIN = 3.0


def _models(device, config_class, model_class, experts=None, gain=EXPERT_GAIN, **fields):
    lk_transformers.register()
    torch.manual_seed(0)
    sizes = dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,  # two where the layers differ (sliding and full attention; dense and MoE)
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=64,
    )
    config = config_class(**{**sizes, **fields})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        eager = model_class._from_config(copy.deepcopy(config), attn_implementation="eager")
        extra = {} if experts is None else {"experts_implementation": experts}
        ours = model_class._from_config(copy.deepcopy(config), attn_implementation="llmkernels", **extra)
    eager = eager.to(device=device, dtype=torch.bfloat16).eval()
    ours = ours.to(device=device, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        for module in eager.modules():
            for name in ("gate_up_proj", "down_proj"):
                weight = getattr(module, name, None)
                if isinstance(weight, torch.Tensor) and weight.dim() == 3:
                    weight.mul_(gain)
    ours.load_state_dict(eager.state_dict())
    assert ours.config._attn_implementation == "llmkernels" and eager.config._attn_implementation == "eager"
    return eager, ours


def _counted(calls: dict, name: str, forward):
    def counted(*args, **kwargs):
        calls[name] = calls.get(name, 0) + 1
        if name == "attention" and (args[4] if len(args) > 4 else kwargs.get("attention_mask")) is None:
            calls["attention without a mask"] = calls.get("attention without a mask", 0) + 1
        return forward(*args, **kwargs)

    return counted


def _compare(eager, ours, device, tolerance=TOLERANCE, experts=False, unpadded=True):
    """Greedy tokens and logits of ``ours`` against ``eager``; every attention call (and with ``experts``
    every experts call) must reach llmkernels. One ``generate`` per model on a left-padded batch (its prefill's
    hidden states give the prompt's logits, its per-step logits settle a differing token), and with ``unpadded`` one
    forward of an unpadded sequence, which full attention layers run without a mask (plain causal)."""
    # 2 x 9 prompt tokens: each expert that every token takes gets 18 rows in the prefill and 2 per decode step,
    # so both the prefill's and the decode's group sizes run; two decode steps: the second reads a cache that a
    # decode step appended to (and, past the window of 4, a sliding one).
    ids = torch.randint(0, 128, (2, 9), device=device)
    padding = torch.ones_like(ids)
    padding[1, :3] = 0  # left padding: those query rows see no key (ours: 0, eager: uniform weights)
    calls = {}
    transformers.AttentionInterface.register(
        "llmkernels", _counted(calls, "attention", lk_transformers.attention_forward)
    )
    transformers.integrations.moe.ExpertsInterface.register(
        "llmkernels", _counted(calls, "experts", lk_transformers.experts_forward)
    )
    options = dict(
        attention_mask=padding,
        max_new_tokens=3,
        do_sample=False,
        return_dict_in_generate=True,
        output_hidden_states=True,
        output_logits=True,
    )
    try:
        with torch.no_grad():
            expected = eager.generate(ids, **options)
            tokens = ours.generate(ids, **options)
            # the prefill's last hidden states are the final norm's output over the whole prompt
            expected_logits = eager.lm_head(expected.hidden_states[0][-1]).float()
            logits = ours.lm_head(tokens.hidden_states[0][-1]).float()
            if unpadded:
                expected_unpadded = eager(ids[:1]).logits.float()
                unpadded_logits = ours(ids[:1]).logits.float()
    finally:
        lk_transformers.register()
    assert calls.get("attention"), "the llmkernels attention was not called"
    assert calls.get("experts") if experts else True, "the llmkernels experts were not called"
    assert calls.get("attention without a mask") if unpadded else True, "no attention call ran without a mask"
    assert logits.shape == (*ids.shape, 128)
    keep = padding.bool()
    error = (logits[keep] - expected_logits[keep]).norm() / expected_logits[keep].norm()
    assert error < tolerance, f"logits differ by {error:.2e}"
    if unpadded:
        error = (unpadded_logits - expected_unpadded).norm() / expected_unpadded.norm()
        assert error < tolerance, f"the unpadded sequence's logits differ by {error:.2e}"
    if not torch.equal(tokens.sequences, expected.sequences):  # only a near-tie of eager's logits may flip a token
        row, step = next(
            (r, s)
            for s in range(ids.shape[1], tokens.sequences.shape[1])
            for r in range(ids.shape[0])
            if tokens.sequences[r, s] != expected.sequences[r, s]
        )
        # both models chose from the same prefix at this step (the first difference)
        step_logits = expected.logits[step - ids.shape[1]][row].float()
        ours_logits = tokens.logits[step - ids.shape[1]][row].float()
        gap = (step_logits[expected.sequences[row, step]] - step_logits[tokens.sequences[row, step]]).item()
        assert gap <= 2 * (ours_logits - step_logits).abs().max().item(), (
            f"token {step} of row {row} differs where eager's choice leads by {gap:.3f}: not a near-tie"
        )


def test_llama_like(device):
    _compare(*_models(device, transformers.LlamaConfig, transformers.LlamaForCausalLM), device)


def _quantized_twin(eager, ours, weight_format="mxfp4"):
    """Quantizes ours' experts and writes their dequantized values into eager's, in eager's own layout."""
    import llmkernels as lk

    count = lk_transformers.quantize_experts(ours, weight_format)
    with torch.no_grad():
        for module, reference in zip(ours.modules(), eager.modules()):
            weights = module.__dict__.get("llmkernels_weights")
            if weights is None:
                continue
            # the default layout: the Hopper one for 4-bit weights on a Hopper GPU (what reads fastest there)
            fast = weight_format in ("mxfp4", "nvfp4") and prefers_hopper_layout(module.gate_up_proj.device)
            assert weights.w1.scale_layout.name == ("hopper" if fast else "row"), weights.w1.scale_layout
            w1, w2 = lk.dequantize(weights.w1), lk.dequantize(weights.w2)
            if reference.is_transposed:  # gpt-oss: [gate | up] rows back to interleaved columns
                half = w1.shape[1] // 2
                w1 = torch.stack((w1[:, :half], w1[:, half:]), 2).flatten(1, 2)
                w1, w2 = w1.transpose(1, 2), w2.transpose(1, 2)
            reference.gate_up_proj.copy_(w1)
            reference.down_proj.copy_(w2)
    return count


def test_gpt_oss_like_sinks_sliding_windows_and_experts(device):
    """Sinks, per-layer sliding windows, and gpt-oss' experts fused (interleaved, transposed, biased, the clamped
    SwiGLU), bf16 then MXFP4."""
    # every token takes both experts: a routing decision flipped by bf16 noise would swamp the comparison
    eager, ours = _models(
        device,
        transformers.GptOssConfig,
        transformers.GptOssForCausalLM,
        experts="llmkernels",
        gain=1.0,  # the SwiGLU's up + 1 makes these experts' output outweigh the residual stream as they are
        num_hidden_layers=2,
        intermediate_size=64,  # 32 would make the down projection's MXFP4 scales one column: another specialization
        num_local_experts=2,
        num_experts_per_tok=2,
        sliding_window=4,
        layer_types=["sliding_attention", "full_attention"],
        swiglu_limit=1.0,
    )
    # non-zero sinks and biases, so that they matter; the output bias no larger than the experts' output: at the
    # gate and up biases' 0.5 it outweighed the rest, and the final norm left the logits blind to attention or
    # experts off by 10% (0.9% against TOLERANCE's 2%); at 0.02 the same faults read 3.8%
    with torch.no_grad():
        for layer in (*eager.model.layers, *ours.model.layers):
            layer.self_attn.sinks.copy_(torch.linspace(-1, 1, 4))
        for module, twin in zip(eager.modules(), ours.modules()):
            if hasattr(module, "gate_up_proj_bias"):
                for name, scale in (("gate_up_proj_bias", 0.5), ("down_proj_bias", 0.02)):
                    bias = torch.randn_like(getattr(module, name)) * scale
                    getattr(module, name).copy_(bias)
                    getattr(twin, name).copy_(bias)
    _compare(eager, ours, device, experts=True)
    assert _quantized_twin(eager, ours) == 2
    _compare(eager, ours, device, experts=True, unpadded=False)  # the bf16 run took the unpadded path


# DeepSeek-V3's correction bias per expert (groups of two): sums of two biased scores keep groups 1 and 2 for
# every token (>= 7.5 against <= 7.2; scores lie in (0, 1)), while scoring groups by their best expert would
# keep group 0 (>= 5.2 against <= 5); within the kept groups every expert is taken, so that bf16 noise
# between the two models never flips a routing decision, and the weights still vary per token.
DEEPSEEK_BIAS = (5.2, 0.0, 4.0, 4.0, 4.0, 3.5, 0.0, 0.0)


def _keep_two_groups(eager, ours):
    with torch.no_grad():
        for model in (eager, ours):
            for module in model.modules():
                if hasattr(module, "e_score_correction_bias"):
                    module.e_score_correction_bias.copy_(torch.tensor(DEEPSEEK_BIAS))


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "deepseek_v3"])
def test_moe_experts(family, device):
    """Experts in transformers' default layout through ``experts_implementation="llmkernels"`` (bf16, then
    MXFP4 from ``quantize_experts`` against an eager model on the dequantized weights). Every token takes every
    routed expert (no routing flips)."""
    if family == "qwen3_moe":
        models = _models(
            device,
            transformers.Qwen3MoeConfig,
            transformers.Qwen3MoeForCausalLM,
            experts="llmkernels",
            moe_intermediate_size=32,
            num_experts=2,
            num_experts_per_tok=2,
        )
    elif family == "mixtral":
        models = _models(
            device,
            transformers.MixtralConfig,
            transformers.MixtralForCausalLM,
            experts="llmkernels",
            intermediate_size=32,
            num_local_experts=2,
            num_experts_per_tok=2,
        )
    else:  # one dense layer, one MoE layer with a shared expert and grouped routing that keeps 2 of 4 groups
        models = _models(
            device,
            transformers.DeepseekV3Config,
            transformers.DeepseekV3ForCausalLM,
            experts="llmkernels",
            moe_intermediate_size=32,
            n_routed_experts=8,
            num_experts_per_tok=4,
            n_group=4,
            topk_group=2,
            num_hidden_layers=2,
            first_k_dense_replace=1,
            n_shared_experts=1,
            q_lora_rank=32,
            kv_lora_rank=16,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=16,
            head_dim=8,
            num_key_value_heads=4,
        )
        _keep_two_groups(*models)
    eager, ours = models
    assert ours.config._experts_implementation == "llmkernels"
    routed = []
    for module in ours.modules():
        if family == "deepseek_v3" and hasattr(module, "e_score_correction_bias"):
            module.register_forward_hook(lambda gate, inputs, outputs: routed.append(outputs[2]))
    _compare(eager, ours, device, experts=True)
    if family == "deepseek_v3":  # only the experts of the two kept groups
        assert set(torch.cat(routed).unique().tolist()) == {2, 3, 4, 5}
    assert _quantized_twin(eager, ours) == 1
    _compare(eager, ours, device, experts=True, unpadded=False)  # the bf16 run took the unpadded path


def test_dropout_is_refused(device):
    query = torch.zeros(1, 4, 2, 16, dtype=torch.bfloat16, device=device)
    key = torch.zeros(1, 2, 2, 16, dtype=torch.bfloat16, device=device)
    with pytest.raises(ValueError, match="dropout"):
        lk_transformers.attention_forward(torch.nn.Module(), query, key, key, None, dropout=0.1)
