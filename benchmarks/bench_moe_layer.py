"""The whole MoE feed-forward block (routing to combine) against the same block on torch._grouped_mm and a loop.

    python -m benchmarks bench_moe_layer [--out DIR] [--quick | --fp8 | --hf]

llmkernels.moe.MoEFeedForward next to the same block written with torch._grouped_mm (bf16) and with a loop over
experts, one run. DeepSeek-V3 (E=256, H=7168, I=2048, top-8 of sigmoid scores in 8 groups, 4 kept), Qwen3-30B-A3B
(E=128, H=2048, I=768, top-8 softmax) and gpt-oss-120b (E=128, H=2880, I=2880, top-4 softmax) at
1..8192 tokens. All three systems share the routing and dispatch code, so the table compares the
expert computation and combine. Writes moe_layer.{csv,md} and moe_layer.png (tokens/s against tokens,
one panel per model) to DIR (default benchmarks/results/<gpu>/bench_moe_layer/). ``--fp8``: the Qwen3-30B-A3B
layer at 1, 2048 and 16384 tokens, fp8 blocks (weights per 128 x 128 tile, activations per token per 128) next to
our bf16 and MXFP8 blocks and the torch._grouped_mm block (DIR's ``fp8/`` folder by default). ``--hf``: transformers'
own Qwen3-MoE sparse block (router, experts, combine; bf16) with each of its experts implementations against the
same module with ``experts_implementation="llmkernels"`` on bf16 and on MXFP4 experts (``quantize_experts``), 1 to
16384 tokens, eager and CUDA-graph replay, with the ratio to transformers' fastest implementation at each count
(DIR's ``hf/`` folder by default; needs transformers).
"""

from __future__ import annotations

import argparse
import os

import torch

from benchmarks.common import (  # noqa: E402
    default_out_dir,
    graph_time_ms,
    line_plots,
    measure_ceilings,
    require_gpu,
    time_ms,
    write_table,
)
from llmkernels import ScaledTensor, dequantize, quantize  # noqa: E402
from llmkernels.moe import MoEFeedForward, dispatch, route  # noqa: E402
from llmkernels.testing import relative_error  # noqa: E402

MODELS = {  # name: (experts, hidden, intermediate, top_k, routing)
    "DeepSeek-V3": (256, 7168, 2048, 8, dict(scoring="sigmoid", num_groups=8, topk_groups=4)),
    "Qwen3-30B-A3B": (128, 2048, 768, 8, dict(scoring="softmax")),
    "gpt-oss-120b": (128, 2880, 2880, 4, dict(scoring="softmax")),
}
TOKENS = (1, 8, 64, 512, 2048, 8192)
# label: (weight format, activation format, weight layout; None: from_float's default, "hopper" for mxfp4 and
# nvfp4 on Hopper)
FORMATS = (
    ("ours mxfp8", "mxfp8", None, None),
    ("ours bf16 x mxfp4", "mxfp4", "bf16", None),
    ("ours bf16 x mxfp4 row layout", "mxfp4", "bf16", "row"),
    ("ours nvfp4", "nvfp4", None, None),
    ("ours nvfp4 row layout", "nvfp4", None, "row"),
    ("ours bf16", "bf16", None, None),
    ("ours fp8 blocks", "fp8", None, None),
)
FP8_SYSTEMS = ("torch._grouped_mm bf16", "ours bf16", "ours mxfp8", "ours fp8 blocks")
HF_TOKENS = (1, 32, 512, 2048, 4096, 16384)
HF_EXPERTS = ("grouped_mm", "batched_mm", "eager")  # transformers' implementations (eager: a loop over experts)
FP8_TOKENS = (1, 2048, 16384)


class GroupedMMBlock:
    """The same block on torch._grouped_mm in bf16 (SwiGLU and combine as separate torch ops)."""

    def __init__(self, router, w_gate_up, w_down, top_k, routing):
        self.router, self.top_k, self.routing = router, top_k, routing
        self.w_gate_up_t = w_gate_up.to(torch.bfloat16).transpose(-2, -1)
        self.w_down_t = w_down.to(torch.bfloat16).transpose(-2, -1)
        self.intermediate = w_down.shape[2]

    def __call__(self, x):
        weights, ids = route(x.float() @ self.router.float().t(), self.top_k, **self.routing)
        token_of_row, offsets, row_of_copy = dispatch(ids, self.router.shape[0])
        rows = x[token_of_row]
        gate_up = torch._grouped_mm(rows, self.w_gate_up_t, offs=offsets[1:], out_dtype=torch.bfloat16)
        h = torch.nn.functional.silu(gate_up[:, : self.intermediate]) * gate_up[:, self.intermediate :]
        y = torch._grouped_mm(h, self.w_down_t, offs=offsets[1:], out_dtype=torch.bfloat16)
        return (y[row_of_copy].float() * weights[..., None]).sum(1).to(x.dtype)


class LoopBlock(GroupedMMBlock):
    """One matmul pair per expert that has tokens (the counts are read on the host: a sync)."""

    def __call__(self, x):
        weights, ids = route(x.float() @ self.router.float().t(), self.top_k, **self.routing)
        token_of_row, offsets, row_of_copy = dispatch(ids, self.router.shape[0])
        rows = x[token_of_row]
        y = torch.empty_like(rows)
        bounds = offsets.tolist()
        for expert in range(len(bounds) - 1):
            start, end = bounds[expert], bounds[expert + 1]
            if end > start:
                gate_up = rows[start:end] @ self.w_gate_up_t[expert]
                h = torch.nn.functional.silu(gate_up[:, : self.intermediate]) * gate_up[:, self.intermediate :]
                y[start:end] = h @ self.w_down_t[expert]
        return (y[row_of_copy].float() * weights[..., None]).sum(1).to(x.dtype)


def _expert(weight, expert: int) -> torch.Tensor:
    """float32 [N, K] weight of one expert (dequantized from the block's own buffers)."""
    if not isinstance(weight, ScaledTensor):
        return weight[expert].float()
    return dequantize(
        ScaledTensor(weight.data[expert], weight.scales[expert], weight.format, weight.global_scale, block=weight.block)
    )


def _rounded(t: torch.Tensor, activation_format: str) -> torch.Tensor:
    if activation_format == "bf16":
        return t.float()
    block = {"block": (1, 128)} if activation_format == "fp8" else {}  # fp8 blocks: per token per 128 columns
    return dequantize(quantize(t.contiguous(), activation_format, **block))


def same_weights_reference(block: MoEFeedForward, x: torch.Tensor) -> torch.Tensor:
    """float32 reference of ``block`` on its own (dequantized) weights and activation rounding, expert
    by expert (a host loop: the check, not a timed system)."""
    w_gate_up, w_down = (
        w.to_layout("row") if isinstance(w, ScaledTensor) and w.scale_layout == "hopper" else w
        for w in (block.w_gate_up, block.w_down)
    )
    weights, ids = route(
        x.float() @ block.router_weight.float().t(), block.top_k, correction_bias=block.correction_bias, **block.routing
    )
    token_of_row, offsets, row_of_copy = dispatch(ids, block.num_experts)
    a = _rounded(x.to(torch.bfloat16), block.activation_format)[token_of_row]
    hidden = torch.empty(a.shape[0], block.intermediate, device=x.device, dtype=torch.bfloat16)
    bounds = offsets.tolist()
    for expert in range(block.num_experts):
        start, end = bounds[expert], bounds[expert + 1]
        if end > start:
            gate_up = a[start:end] @ _expert(w_gate_up, expert).t()
            hidden[start:end] = (
                torch.nn.functional.silu(gate_up[:, : block.intermediate]) * gate_up[:, block.intermediate :]
            ).to(torch.bfloat16)
    h = _rounded(hidden, block.activation_format)
    y = torch.empty(a.shape[0], block.hidden, device=x.device, dtype=torch.bfloat16)
    for expert in range(block.num_experts):
        start, end = bounds[expert], bounds[expert + 1]
        if end > start:
            y[start:end] = (h[start:end] @ _expert(w_down, expert).t()).to(torch.bfloat16)
    return (y[row_of_copy].float() * weights[..., None]).sum(1)


def weight_bytes_per_expert(block) -> int:
    if isinstance(block, MoEFeedForward):
        return (
            sum(
                getattr(block, f"{name}_{part}").nbytes
                for name in ("w_gate_up", "w_down")
                for part in ("data", "scales")
                if getattr(block, f"{name}_{part}") is not None
            )
            // block.num_experts
        )
    return (block.w_gate_up_t.nbytes + block.w_down_t.nbytes) // block.w_gate_up_t.shape[0]


def hf_rows(ceilings: dict) -> list:
    """transformers' Qwen3-MoE sparse block with each experts implementation, and the same module through
    llmkernels (bf16, then MXFP4 experts), on the same weights and tokens; eager and graph-replay µs, errors against
    the grouped_mm implementation, and each system's speed against transformers' fastest at that token count."""
    import transformers

    from llmkernels.integrations import transformers as lk_transformers

    lk_transformers.register()
    experts, hidden, intermediate, top_k, _ = MODELS["Qwen3-30B-A3B"]
    config = transformers.Qwen3MoeConfig(
        hidden_size=hidden,
        num_hidden_layers=1,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        moe_intermediate_size=intermediate,
        num_experts=experts,
        num_experts_per_tok=top_k,
        norm_topk_prob=True,
        vocab_size=256,
    )
    with torch.device("cuda"):
        model = transformers.Qwen3MoeForCausalLM._from_config(config, dtype=torch.bfloat16).eval()
    block = model.model.layers[0].mlp

    def use(experts_implementation: str) -> None:
        if hasattr(model, "set_experts_implementation"):
            model.set_experts_implementation(experts_implementation)
        else:
            model.config._experts_implementation = experts_implementation

    systems = [(f"transformers {name}", name, None) for name in HF_EXPERTS]
    systems += [("ours bf16 (llmkernels experts)", "llmkernels", None), ("ours mxfp4", "llmkernels", "mxfp4")]
    rows = []
    results = {tokens: {} for tokens in HF_TOKENS}
    torch.manual_seed(0)  # every input made before any capture (a failed one leaves the generator unusable)
    inputs = {tokens: torch.randn(1, tokens, hidden, device="cuda", dtype=torch.bfloat16) for tokens in HF_TOKENS}
    for name, implementation, weight_format in systems:
        if weight_format is not None:
            lk_transformers.quantize_experts(model, weight_format)
        use(implementation)
        for tokens in HF_TOKENS:
            print(f"hf: {name}, {tokens} tokens", flush=True)
            x = inputs[tokens]
            eager = graphed = error = float("nan")
            try:
                with torch.no_grad():
                    out = block(x)
                    out = (out[0] if isinstance(out, tuple) else out).float()
                    reference = results[tokens].get("transformers grouped_mm", (None, None, out))[2]
                    error = relative_error(out, reference)
                    eager = time_ms(lambda: block(x))
            except Exception as exc:  # noqa: BLE001 - a failing system (out of memory) is a result too
                print(f"  {name} fails at {tokens} tokens: {type(exc).__name__}: {str(exc)[:160]}")
                torch.cuda.synchronize()
                out = None
            if out is not None and implementation != "eager":  # transformers' loop reads counts on the host
                try:
                    with torch.no_grad():
                        graphed = graph_time_ms(lambda: block(x))
                except Exception as exc:  # noqa: BLE001 - a host sync in the block: no capture
                    print(f"  {name}: no graph at {tokens} tokens: {type(exc).__name__}: {str(exc)[:120]}")
                    torch.cuda.synchronize()
            results[tokens][name] = (eager, graphed, out if name == "transformers grouped_mm" else None, error)
    for tokens, timings in results.items():
        fastest_eager = min(
            (t[0] for n, t in timings.items() if n.startswith("transformers") and t[0] == t[0]), default=float("nan")
        )
        fastest_graph = min(
            (t[1] for n, t in timings.items() if n.startswith("transformers") and t[1] == t[1]), default=float("nan")
        )
        for name, (eager, graphed, _, error) in timings.items():
            rows.append(
                {
                    "tokens": tokens,
                    "system": name,
                    "eager us": eager * 1e3,
                    "graph us": graphed * 1e3,
                    "vs transformers' fastest eager": fastest_eager / eager,
                    "vs transformers' fastest graph": fastest_graph / graphed,
                    "rel err vs grouped_mm": error,
                }
            )
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--quick", action="store_true", help="Qwen3 only, three token counts")
    parser.add_argument("--fp8", action="store_true", help="Qwen3 only: fp8 blocks against bf16 at 1, 2048, 16384")
    parser.add_argument("--hf", action="store_true", help="Qwen3 only: against transformers' sparse MoE block")
    args = parser.parse_args()
    require_gpu("bench_moe_layer")
    torch.manual_seed(0)
    ceilings = measure_ceilings()
    if args.hf:
        out_dir = args.out or default_out_dir("bench_moe_layer/hf")
        notes = (
            f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}. transformers' Qwen3-MoE sparse block "
            "(H 2048, I 768, 128 experts, top-8; random bf16 weights) with each of its experts implementations, "
            "and the same module with experts_implementation='llmkernels' (bf16 experts, then MXFP4 experts from "
            "quantize_experts). Median µs of eager calls and of CUDA-graph replays; 'vs' columns: transformers' "
            "fastest implementation at that token count / this system. Errors against transformers' grouped_mm."
        )
        print(write_table(hf_rows(ceilings), out_dir, "moe_hf", "MoE block against transformers' experts", notes))
        return
    models = {"Qwen3-30B-A3B": MODELS["Qwen3-30B-A3B"]} if args.quick or args.fp8 else MODELS
    token_counts = FP8_TOKENS if args.fp8 else (1, 64, 2048) if args.quick else TOKENS
    rows, panels = [], {}
    for model, (experts, hidden, intermediate, top_k, routing) in models.items():
        router = torch.randn(experts, hidden, device="cuda", dtype=torch.bfloat16) * hidden**-0.5
        w_gate_up = torch.randn(experts, 2 * intermediate, hidden, device="cuda", dtype=torch.bfloat16) * hidden**-0.5
        w_down = torch.randn(experts, hidden, intermediate, device="cuda", dtype=torch.bfloat16) * intermediate**-0.5
        systems = {
            "torch._grouped_mm bf16": GroupedMMBlock(router, w_gate_up, w_down, top_k, routing),
            "loop over experts bf16": LoopBlock(router, w_gate_up, w_down, top_k, routing),
        }
        for label, weight_format, activation_format, weight_layout in FORMATS:
            if args.fp8 and label not in FP8_SYSTEMS:
                continue
            systems[label] = MoEFeedForward.from_float(
                router,
                w_gate_up,
                w_down,
                top_k,
                weight_format=weight_format,
                activation_format=activation_format,
                weight_layout=weight_layout,
                **routing,
            )
        if args.fp8:
            systems = {name: block for name, block in systems.items() if name in FP8_SYSTEMS}
        for tokens in token_counts:
            print(f"{model}: {tokens} tokens", flush=True)
            x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
            bf16_block = systems["torch._grouped_mm bf16"]
            bf16_out = bf16_block(x).float()
            _, ids = route(x.float() @ router.float().t(), top_k, **routing)
            experts_hit = ids.unique().numel()
            timings = {}
            for name, block in systems.items():
                eager = graphed = check = float("nan")
                try:
                    out = block(x).float()
                    error = relative_error(out, bf16_out)
                    if isinstance(block, MoEFeedForward):
                        check = relative_error(out, same_weights_reference(block, x))
                    if not check > 3e-2:  # NaN (peers) or a pass
                        eager = time_ms(lambda: block(x))
                        if not isinstance(block, LoopBlock):  # the loop reads counts on the host
                            graphed = graph_time_ms(lambda: block(x))
                except Exception as exc:  # noqa: BLE001 - a failing system is a result too
                    print(f"  {name} fails: {type(exc).__name__}: {str(exc)[:160]}")
                    error = float("nan")
                timings[name] = (eager, graphed, error, check, weight_bytes_per_expert(block) * experts_hit)
            peer_eager, peer_graph = timings["torch._grouped_mm bf16"][:2]
            for name, (eager, graphed, error, check, weight_bytes) in timings.items():
                best = graphed if graphed == graphed else eager
                rows.append(
                    {
                        "model": model,
                        "tokens": tokens,
                        "system": name,
                        "eager us": eager * 1e3,
                        "graph us": graphed * 1e3,
                        "tokens/s (graph)": tokens / best * 1e3,
                        "weight GB/s": weight_bytes / best / 1e6,
                        "% copy BW": 100 * weight_bytes / best / 1e6 / ceilings["copy_gbps"],
                        "vs _grouped_mm eager": peer_eager / eager,
                        "vs _grouped_mm graph": peer_graph / graphed,
                        "rel err vs bf16 block": error,
                        "rel err vs own weights": check,
                    }
                )
                panels.setdefault(model, {}).setdefault(name, []).append((tokens, tokens / best * 1e3))
        del systems, w_gate_up, w_down
        torch.cuda.empty_cache()
    out_dir = args.out or default_out_dir("bench_moe_layer" + ("/fp8" if args.fp8 else ""))
    notes = (
        f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}; ceilings {ceilings}. Median times "
        "(do_bench) of eager calls and of CUDA-graph replays (the GPU time without the host's launch "
        "overhead; the per-expert loop reads counts on the host and cannot be captured); tokens/s, "
        "weight GB/s and % copy BW use the graph time where there is one. Weight bytes: the experts "
        "that the routing hit, gate_up + down (+ scales), read once. The same routing and dispatch in "
        "every system. 'rel err vs bf16 block': the quantization's effect; 'rel err vs own weights': "
        "against a float32 loop on the block's own dequantized weights and activation rounding "
        "(the correctness check; a system over 3e-2 is not timed)."
    )
    print(write_table(rows, out_dir, "moe_layer", "MoE feed-forward block", notes))
    line_plots(
        panels,
        "tokens",
        "tokens/s (CUDA graph)",
        os.path.join(out_dir, "moe_layer.png"),
        f"MoE block, {torch.cuda.get_device_name()}",
    )


if __name__ == "__main__":
    main()
