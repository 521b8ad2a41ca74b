"""Where the MoE block's time goes: each stage of llmkernels.moe.MoEFeedForward timed on its own
under CUDA-graph replay, on the GPU.

    python -m benchmarks profile_moe_layer [--out DIR]

Stages: router logits + top-k routing, dispatch (the Triton counting sort, and the PyTorch version
with a stable argsort next to it), activation quantize (with the row gather), gate/up grouped
matmul with SwiGLU, quantize of the intermediate, down grouped matmul, combine. Writes
profile_moe_layer.{csv,md}.
"""
from __future__ import annotations

import argparse

import torch

from benchmarks.bench_moe_layer import MODELS  # noqa: E402
from benchmarks.common import default_out_dir, graph_time_ms, write_table  # noqa: E402

from llmkernels.grouped_matmul import grouped_matmul  # noqa: E402
from llmkernels.moe import MoEFeedForward, combine, dispatch, dispatch_reference, route  # noqa: E402

TOKENS = (1, 64, 8192)


def stages(block: MoEFeedForward, x: torch.Tensor) -> dict:
    """The forward pass cut into stages, each a closure over the previous stages' outputs."""
    logits = x.float() @ block.router_weight.float().t()
    weights, ids = route(logits, block.top_k, correction_bias=block.correction_bias, **block.routing)
    token_of_row, a_offsets, row_of_copy = dispatch(ids, block.num_experts)
    a = block._activations(x, token_of_row)
    h = grouped_matmul(a, block.w_gate_up, a_offsets, block.expert_ids, epilogue="swiglu")
    h_act = block._activations(h)
    y = grouped_matmul(h_act, block.w_down, a_offsets, block.expert_ids)
    return {
        "route": lambda: route(x.float() @ block.router_weight.float().t(), block.top_k,
                               correction_bias=block.correction_bias, **block.routing),
        "dispatch": lambda: dispatch(ids, block.num_experts),
        "dispatch, torch.argsort version": lambda: dispatch_reference(ids, block.num_experts),
        "quantize x": lambda: block._activations(x, token_of_row),
        "gate_up + swiglu": lambda: grouped_matmul(a, block.w_gate_up, a_offsets, block.expert_ids, epilogue="swiglu"),
        "quantize h": lambda: block._activations(h),
        "down": lambda: grouped_matmul(h_act, block.w_down, a_offsets, block.expert_ids),
        "combine": lambda: combine(y, row_of_copy, weights, x.dtype),
        "whole block": lambda: block(x),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.manual_seed(0)
    rows = []
    for model in ("Qwen3-30B-A3B", "DeepSeek-V3"):
        experts, hidden, intermediate, top_k, routing = MODELS[model]
        router = torch.randn(experts, hidden, device="cuda", dtype=torch.bfloat16) * hidden**-0.5
        w_gate_up = torch.randn(experts, 2 * intermediate, hidden, device="cuda", dtype=torch.bfloat16) * hidden**-0.5
        w_down = torch.randn(experts, hidden, intermediate, device="cuda", dtype=torch.bfloat16) * intermediate**-0.5
        for weight_format in ("mxfp8", "bf16"):
            block = MoEFeedForward.from_float(router, w_gate_up, w_down, top_k, weight_format=weight_format, **routing)
            for tokens in TOKENS:
                x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
                times = {name: graph_time_ms(fn) * 1e3 for name, fn in stages(block, x).items()}
                total = times["whole block"]
                for name, us in times.items():
                    rows.append({"model": model, "weights": weight_format, "tokens": tokens, "stage": name,
                                 "us": us, "% of block": 100 * us / total})
                print(model, weight_format, tokens, {k: round(v, 1) for k, v in times.items()}, flush=True)
            del block
        del w_gate_up, w_down
        torch.cuda.empty_cache()
    notes = (f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}. Median CUDA-graph replay time of "
             "each stage on its own (do_bench); the stages' sum exceeds the whole block by the graph-launch "
             "cost of each stage. 'dispatch, torch.argsort version' is not part of the block (the alternative).")
    print(write_table(rows, args.out or default_out_dir(), "profile_moe_layer", "MoE block stages", notes))


if __name__ == "__main__":
    main()
