"""Decode tokens/s of transformers models with llmkernels attention and experts against transformers' defaults.

    python -m benchmarks bench_hf_decode [--out DIR] [--quick | --accuracy]

``attn_implementation="llmkernels"`` and ``experts_implementation="llmkernels"``, one run. Two-layer models at
real layer sizes with random bf16 weights (no download): Qwen3-30B-A3B-like (128 experts, top-8, H 2048, GQA 32/4,
D 128) and gpt-oss-20b-like (32 experts, top-4, H 2880, GQA 64/8, D 64, sinks, sliding window 128 on every other
layer). The vocabulary is shrunk to 2048 so that the two layers carry the
step's time, as the 24-48 layers of the real models do. Batch 1 and 32, a 1024-token prompt in transformers'
default cache (``DynamicCache``), one decode step timed eagerly (each call appends a token: the context grows
by the few dozen calls timed) and as a CUDA-graph replay of one step. (A ``StaticCache`` step of gpt-oss
cannot be captured in transformers 5.17: its sliding layers copy a host tensor on every step.)

Systems (the same weights): transformers' defaults (``sdpa`` attention, or ``eager`` for gpt-oss, which has
no SDPA path, and ``grouped_mm`` experts), llmkernels attention with the default experts, llmkernels attention
and experts in bf16, then with MXFP4 experts (``quantize_experts(..., "mxfp4", "hopper")``), and flash-attn's
``flash_attention_2`` where the package is installed. Each row's decode logits are compared with the
defaults' (relative error). Writes hf_decode.{csv,md,png} (``--accuracy``: hf_decode_accuracy.{csv,md}) to DIR
(default benchmarks/results/<gpu>/bench_hf_decode/). Needs a CUDA GPU and transformers (``.[hf]``).
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
import warnings

import torch

from benchmarks.common import CANNOT_RUN, bar_plot, default_out_dir, require_gpu, time_ms, write_table

PROMPT = 1024
VOCAB = 2048


def _configs():
    import transformers

    qwen = transformers.Qwen3MoeConfig(
        vocab_size=VOCAB,
        hidden_size=2048,
        num_hidden_layers=2,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        moe_intermediate_size=768,
        intermediate_size=6144,
        num_experts=128,
        num_experts_per_tok=8,
        norm_topk_prob=True,
        max_position_embeddings=4096,
    )
    gpt_oss = transformers.GptOssConfig(
        vocab_size=VOCAB,
        hidden_size=2880,
        num_hidden_layers=2,
        num_attention_heads=64,
        num_key_value_heads=8,
        head_dim=64,
        intermediate_size=2880,
        num_local_experts=32,
        num_experts_per_tok=4,
        sliding_window=128,
        layer_types=["sliding_attention", "full_attention"],
        max_position_embeddings=4096,
    )
    return {
        "Qwen3-30B-A3B-like": (qwen, transformers.Qwen3MoeForCausalLM, "sdpa"),
        "gpt-oss-20b-like": (gpt_oss, transformers.GptOssForCausalLM, "eager"),
    }


def _build(config, model_class):
    torch.manual_seed(0)
    with warnings.catch_warnings(), torch.device("cuda"):
        warnings.simplefilter("ignore")
        model = model_class._from_config(copy.deepcopy(config), dtype=torch.bfloat16)
    model = model.eval()
    with torch.no_grad():  # random but sane: sinks and biases non-zero where the model has them
        for name, p in model.named_parameters():
            if name.endswith("sinks"):
                p.normal_(0, 1)
            elif name.endswith("_bias"):
                p.normal_(0, 0.02)
    return model


def _use(model, attention: str, experts: str) -> None:
    model.set_attn_implementation(attention)
    if hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation(experts)
    else:
        model.config._experts_implementation = experts


def _decode_step(model, batch: int):
    """``(step, first logits, kept)``: a prompt prefilled into transformers' default cache (``DynamicCache``,
    exactly as long as the context), a function running one decode step on it, the logits of the first
    step, and the cache tensors a captured graph reads (kept alive with it). Each eager step appends one
    token; a replayed graph repeats the step it captured."""
    torch.manual_seed(1)  # the same prompt and token for every system
    prompt = torch.randint(0, VOCAB, (batch, PROMPT), device="cuda")
    token = torch.randint(0, VOCAB, (batch, 1), device="cuda")
    with torch.no_grad():
        cache = model(input_ids=prompt, use_cache=True).past_key_values

    def step():
        with torch.no_grad():
            return model(input_ids=token, past_key_values=cache, use_cache=True).logits

    first = step().float()
    return step, first, cache


def _graph_ms(step, cache):
    """ms of one CUDA-graph replay of ``step``, or nan when it cannot be captured."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    inputs = [(layer.keys, layer.values) for layer in cache.layers]  # what the graph reads: kept alive
    try:
        with torch.cuda.stream(stream):
            step()
        torch.cuda.current_stream().wait_stream(stream)
        inputs += [(layer.keys, layer.values) for layer in cache.layers]
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
    except Exception as error:  # noqa: BLE001 - reported in the table, not fatal
        print(f"    graph capture failed: {type(error).__name__}: {str(error)[:160]}")
        torch.cuda.synchronize()
        return float("nan")
    ms = time_ms(graph.replay)
    del graph, inputs
    return ms


def accuracy(batch: int = 4) -> list[dict]:
    """First-step logits of the defaults and of llmkernels (bf16 weights, bf16 and MXFP4 experts) against the
    same model in float32 with eager attention and experts: which of the bf16 systems is closer to exact.
    Errors are per sequence (median and worst over the batch)."""
    from llmkernels.integrations import transformers as lk_transformers

    rows = []
    for model_name, (config, model_class, default_attention) in _configs().items():
        model = _build(config, model_class)
        results = {}
        for label, attention, experts, weight_format in (
            ("defaults", default_attention, "grouped_mm", None),
            ("llmkernels attention", "llmkernels", "grouped_mm", None),
            ("llmkernels bf16 experts", "llmkernels", "llmkernels", None),
            ("llmkernels mxfp4 experts", "llmkernels", "llmkernels", "mxfp4"),
        ):
            if weight_format is not None:
                lk_transformers.quantize_experts(model, weight_format, scale_layout="hopper")
            _use(model, attention, experts)
            results[label] = _decode_step(model, batch)[1]
        reference_model = model.float()  # the bf16 weights, exactly, in float32
        for module in reference_model.modules():
            module.__dict__.pop("llmkernels_weights", None)
        _use(reference_model, "eager", "eager")
        reference = _decode_step(reference_model, batch)[1]
        for label, logits in results.items():
            errors = (logits - reference).norm(dim=-1).flatten() / reference.norm(dim=-1).flatten()
            rows.append(
                dict(
                    model=model_name,
                    batch=batch,
                    system=label,
                    err_vs_fp32_median=errors.median().item(),
                    err_vs_fp32_max=errors.max().item(),
                )
            )
            print(
                f"  {model_name} {label:28s} vs float32 eager: median {rows[-1]['err_vs_fp32_median']:.2e}, "
                f"max {rows[-1]['err_vs_fp32_max']:.2e}"
            )
        del model, reference_model
        torch.cuda.empty_cache()
    return rows


def _flash_attn_installed() -> bool:
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return True


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=default_out_dir("bench_hf_decode"))
    parser.add_argument("--quick", action="store_true", help="batch 1 only")
    parser.add_argument(
        "--accuracy",
        action="store_true",
        help="only compare first-step logits with a float32 eager model (hf_decode_accuracy.*)",
    )
    args = parser.parse_args(argv)
    require_gpu("bench_hf_decode")
    try:
        import transformers
    except ImportError:
        print('bench_hf_decode: needs transformers (pip install -e ".[hf]")', file=sys.stderr)
        raise SystemExit(CANNOT_RUN) from None

    from llmkernels.integrations import transformers as lk_transformers

    lk_transformers.register()
    print(f"transformers {transformers.__version__}, torch {torch.__version__}, {torch.cuda.get_device_name()}")
    if args.accuracy:
        print(
            write_table(
                accuracy(),
                args.out,
                "hf_decode_accuracy",
                "first-step logits against float32 eager",
                f"{torch.cuda.get_device_name()}, transformers {transformers.__version__}: the bf16 "
                "model's weights in float32 with eager attention and experts as the reference.",
            )
        )
        return
    rows = []
    for model_name, (config, model_class, default_attention) in _configs().items():
        model = _build(config, model_class)
        systems = [
            ("defaults", default_attention, "grouped_mm", None),
            ("llmkernels attention", "llmkernels", "grouped_mm", None),
            ("llmkernels bf16 experts", "llmkernels", "llmkernels", None),
            ("llmkernels mxfp4 experts", "llmkernels", "llmkernels", "mxfp4"),
        ]
        if _flash_attn_installed():
            systems.insert(1, ("flash_attention_2", "flash_attention_2", "grouped_mm", None))
        else:
            print("  flash-attn is not installed here: its row is left out")
        for batch in (1,) if args.quick else (1, 32):
            baseline, default_experts_ms = None, float("nan")
            for label, attention, experts, weight_format in systems:
                if weight_format is not None:
                    lk_transformers.quantize_experts(model, weight_format, scale_layout="hopper")
                _use(model, attention, experts)
                started = time.perf_counter()
                step, logits, cache = _decode_step(model, batch)
                eager_ms = time_ms(step)
                graph_ms = _graph_ms(step, cache)
                del cache
                if baseline is None:
                    baseline = dict(logits=logits, eager_ms=eager_ms, graph_ms=graph_ms)
                if attention == "llmkernels" and experts == "grouped_mm":
                    default_experts_ms = graph_ms
                # per sequence: a routing decision flipped by bf16 noise changes a few sequences a lot
                errors = ((logits - baseline["logits"]).norm(dim=-1) / baseline["logits"].norm(dim=-1)).flatten()
                error, worst = errors.median().item(), errors.max().item()
                rows.append(
                    dict(
                        model=model_name,
                        batch=batch,
                        system=label,
                        attention=attention,
                        experts=experts,
                        weights=weight_format or "bf16",
                        eager_step_ms=eager_ms,
                        graph_step_ms=graph_ms,
                        graph_tokens_per_s=batch / graph_ms * 1e3,
                        eager_tokens_per_s=batch / eager_ms * 1e3,
                        vs_defaults_graph=baseline["graph_ms"] / graph_ms,
                        vs_defaults_eager=baseline["eager_ms"] / eager_ms,
                        vs_default_experts_graph=default_experts_ms / graph_ms
                        if experts == "llmkernels"
                        else float("nan"),
                        logits_err_median=error,
                        logits_err_max=worst,
                    )
                )
                print(
                    f"  {model_name} B={batch:3d} {label:28s} eager {eager_ms:7.3f} ms  graph {graph_ms:7.3f} ms"
                    f"  ({rows[-1]['vs_defaults_graph']:.2f}x defaults, logits err {error:.1e} / {worst:.1e},"
                    f" {time.perf_counter() - started:.0f} s)"
                )
            for module in model.modules():  # back to bf16 experts for the next batch size
                module.__dict__.pop("llmkernels_weights", None)
        del model
        torch.cuda.empty_cache()
    notes = (
        f"{torch.cuda.get_device_name()}, transformers {transformers.__version__}, torch {torch.__version__}. "
        f"2-layer models, random bf16 weights, vocabulary {VOCAB}, prompt {PROMPT} in a DynamicCache; one "
        "decode step, median of CUDA-event timings (eager calls, and one CUDA-graph replay). "
        "logits_err_median / _max: relative error of each sequence's first-step logits against the defaults' "
        "(median and worst over the batch; a routing decision flipped by bf16 noise changes a few sequences a "
        "lot). vs_default_experts_graph: the step with llmkernels attention and grouped_mm experts over this "
        "row's (the experts' share; gpt-oss' default eager attention cannot be captured). "
        "vs_defaults: the defaults' step time over this row's (>1 is faster)."
    )
    print(write_table(rows, args.out, "hf_decode", "transformers decode step: llmkernels against the defaults", notes))
    labels = [f"{r['model']} B{r['batch']}" for r in rows if r["system"] == "defaults"]
    series = {}
    for r in rows:
        series.setdefault(r["system"], []).append(r["graph_tokens_per_s"])
    bar_plot(
        labels,
        series,
        "decode tokens/s (CUDA graph)",
        f"{args.out}/hf_decode.png",
        "transformers decode: llmkernels against the defaults",
    )


if __name__ == "__main__":
    main()
