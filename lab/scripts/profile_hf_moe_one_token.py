"""The kernels of one transformers Qwen3-MoE sparse block call at one token (torch.profiler, 20 eager calls): through
llmkernels with MXFP4 and with bf16 experts, and transformers' batched_mm, its fastest at one token
(benchmarks/results/nvidia-h200/bench_moe_layer/hf: ours MXFP4 1.25x it under graph replay, the target 1.3x).

    PYTHONPATH=src:. python lab/scripts/profile_hf_moe_one_token.py OUT.txt
"""

from __future__ import annotations

import sys

import torch
import transformers

from llmkernels.integrations import transformers as lk_transformers


def main() -> None:
    lk_transformers.register()
    config = transformers.Qwen3MoeConfig(
        hidden_size=2048,
        num_hidden_layers=1,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        moe_intermediate_size=768,
        num_experts=128,
        num_experts_per_tok=8,
        norm_topk_prob=True,
        vocab_size=256,
    )
    with torch.device("cuda"):
        model = transformers.Qwen3MoeForCausalLM._from_config(config, dtype=torch.bfloat16).eval()
    block = model.model.layers[0].mlp
    x = torch.randn(1, 1, 2048, device="cuda", dtype=torch.bfloat16)
    lines = []
    for label, implementation, weight_format in (
        ("transformers batched_mm", "batched_mm", None),
        ("ours bf16", "llmkernels", None),
        ("ours mxfp4", "llmkernels", "mxfp4"),
    ):
        if weight_format:
            lk_transformers.quantize_experts(model, weight_format)
        model.set_experts_implementation(implementation)
        with torch.no_grad():
            for _ in range(5):
                block(x)
            torch.cuda.synchronize()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(20):
                    block(x)
                torch.cuda.synchronize()
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=90)
        lines += [f"## {label}", table]
        print(lines[-2], lines[-1], sep="\n", flush=True)
    with open(sys.argv[1], "w") as handle:
        handle.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
