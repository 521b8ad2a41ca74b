"""Decode tokens/s of transformers models with ``attn_implementation="llmkernels"`` and
``experts_implementation="llmkernels"`` against transformers' own defaults, one run.

    python -m benchmarks bench_hf_decode [--out DIR] [--quick]

Two-layer models at real layer sizes with random bf16 weights (no download): Qwen3-30B-A3B-like (128 experts,
top-8, H 2048, GQA 32/4, D 128) and gpt-oss-20b-like (32 experts, top-4, H 2880, GQA 64/8, D 64, sinks,
sliding window 128 on every other layer). The vocabulary is shrunk to 2048 so that the two layers carry the
step's time, as the 24-48 layers of the real models do. Batch 1 and 32, a 1024-token prompt in a static cache
of 1088 positions, one decode step timed eagerly and as a CUDA-graph replay.

Systems (the same weights): transformers' defaults (``sdpa`` attention, or ``eager`` for gpt-oss, which has
no SDPA path, and ``grouped_mm`` experts), llmkernels attention with the default experts, llmkernels attention
and experts in bf16, then with MXFP4 experts (``quantize_experts(..., "mxfp4", "hopper")``), and flash-attn's
``flash_attention_2`` where the package is installed. Each row's decode logits are compared with the
defaults' (relative error). Writes hf_decode.{csv,md,png} to DIR (default benchmarks/results/<gpu>/).
"""
from __future__ import annotations

import argparse
import copy
import time
import warnings

import torch

from benchmarks.common import bar_plot, default_out_dir, time_ms, write_table

PROMPT, CACHE = 1024, 1088
VOCAB = 2048


def _configs():
    import transformers

    qwen = transformers.Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=2048, num_hidden_layers=2, num_attention_heads=32, num_key_value_heads=4,
        head_dim=128, moe_intermediate_size=768, intermediate_size=6144, num_experts=128, num_experts_per_tok=8,
        norm_topk_prob=True, max_position_embeddings=4096)
    gpt_oss = transformers.GptOssConfig(
        vocab_size=VOCAB, hidden_size=2880, num_hidden_layers=2, num_attention_heads=64, num_key_value_heads=8,
        head_dim=64, intermediate_size=2880, num_local_experts=32, num_experts_per_tok=4, sliding_window=128,
        layer_types=["sliding_attention", "full_attention"], max_position_embeddings=4096)
    return {"Qwen3-30B-A3B-like": (qwen, transformers.Qwen3MoeForCausalLM, "sdpa"),
            "gpt-oss-20b-like": (gpt_oss, transformers.GptOssForCausalLM, "eager")}


def _build(config, model_class):
    torch.manual_seed(0)
    with warnings.catch_warnings(), torch.device("cuda"):
        warnings.simplefilter("ignore")
        model = model_class._from_config(copy.deepcopy(config), torch_dtype=torch.bfloat16)
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


def _static_cache(model, batch: int):
    from transformers import StaticCache

    try:
        return StaticCache(config=model.config, max_cache_len=CACHE)
    except TypeError:  # older signature
        return StaticCache(config=model.config, max_batch_size=batch, max_cache_len=CACHE, device="cuda",
                           dtype=torch.bfloat16)


def _decode_step(model, batch: int):
    """A prefilled static cache and a function running one decode step on it (the same position each time)."""
    cache = _static_cache(model, batch)
    prompt = torch.randint(0, VOCAB, (batch, PROMPT), device="cuda")
    with torch.no_grad():
        model(input_ids=prompt, past_key_values=cache, cache_position=torch.arange(PROMPT, device="cuda"),
              use_cache=True)
    token = torch.randint(0, VOCAB, (batch, 1), device="cuda")
    position = torch.tensor([PROMPT], device="cuda")
    # static layers count their tokens on the device and write at that count: set it back before every step,
    # so that each timed step (eager or replayed) writes position PROMPT again
    counters = [layer.cumulative_length for layer in getattr(cache, "layers", ())
                if isinstance(getattr(layer, "cumulative_length", None), torch.Tensor)]

    def step():
        for counter in counters:
            counter.fill_(PROMPT)
        with torch.no_grad():
            return model(input_ids=token, past_key_values=cache, cache_position=position, use_cache=True).logits

    return step


def _graph_ms(step):
    """(ms of one replay, logits) or (nan, None) when the step cannot be captured."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    try:
        with torch.cuda.stream(stream):
            step()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            logits = step()
    except Exception as error:  # noqa: BLE001 - reported in the table, not fatal
        print(f"    graph capture failed: {type(error).__name__}: {str(error)[:160]}")
        torch.cuda.synchronize()
        return float("nan"), None
    ms = time_ms(graph.replay)
    graph.replay()
    return ms, logits.float().clone()


def _flash_attn_installed() -> bool:
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return True


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=default_out_dir())
    parser.add_argument("--quick", action="store_true", help="batch 1 only")
    args = parser.parse_args(argv)

    import transformers

    from llmkernels.integrations import transformers as lk_transformers

    lk_transformers.register()
    print(f"transformers {transformers.__version__}, torch {torch.__version__}, {torch.cuda.get_device_name()}")
    rows = []
    for model_name, (config, model_class, default_attention) in _configs().items():
        model = _build(config, model_class)
        systems = [("defaults", default_attention, "grouped_mm", None),
                   ("llmkernels attention", "llmkernels", "grouped_mm", None),
                   ("llmkernels bf16 experts", "llmkernels", "llmkernels", None),
                   ("llmkernels mxfp4 experts", "llmkernels", "llmkernels", "mxfp4")]
        if _flash_attn_installed():
            systems.insert(1, ("flash_attention_2", "flash_attention_2", "grouped_mm", None))
        else:
            print("  flash-attn is not installed here: its row is left out")
        for batch in (1,) if args.quick else (1, 32):
            baseline = None
            for label, attention, experts, weight_format in systems:
                if weight_format is not None:
                    lk_transformers.quantize_experts(model, weight_format, scale_layout="hopper")
                _use(model, attention, experts)
                started = time.perf_counter()
                step = _decode_step(model, batch)
                expected = step().float()
                eager_ms = time_ms(step)
                graph_ms, logits = _graph_ms(step)
                logits = expected if logits is None else logits
                if baseline is None:
                    baseline = dict(logits=logits, eager_ms=eager_ms, graph_ms=graph_ms)
                error = ((logits - baseline["logits"]).norm() / baseline["logits"].norm()).item()
                rows.append(dict(
                    model=model_name, batch=batch, system=label, attention=attention, experts=experts,
                    weights=weight_format or "bf16", eager_step_ms=eager_ms, graph_step_ms=graph_ms,
                    graph_tokens_per_s=batch / graph_ms * 1e3, eager_tokens_per_s=batch / eager_ms * 1e3,
                    vs_defaults_graph=baseline["graph_ms"] / graph_ms, vs_defaults_eager=baseline["eager_ms"] / eager_ms,
                    logits_rel_err_vs_defaults=error))
                print(f"  {model_name} B={batch:3d} {label:28s} eager {eager_ms:7.3f} ms  graph {graph_ms:7.3f} ms"
                      f"  ({rows[-1]['vs_defaults_graph']:.2f}x defaults, logits err {error:.1e},"
                      f" {time.perf_counter() - started:.0f} s)")
            for module in model.modules():  # back to bf16 experts for the next batch size
                module.__dict__.pop("llmkernels_weights", None)
        del model
        torch.cuda.empty_cache()
    notes = (f"{torch.cuda.get_device_name()}, transformers {transformers.__version__}, torch {torch.__version__}. "
             f"2-layer models, random bf16 weights, vocabulary {VOCAB}, prompt {PROMPT} in a static cache of "
             f"{CACHE}; one decode step, median of CUDA-event timings (eager call, and one CUDA-graph replay). "
             "vs_defaults: the defaults' step time over this row's (>1 is faster).")
    print(write_table(rows, args.out, "hf_decode", "transformers decode step: llmkernels against the defaults",
                      notes))
    labels = [f"{r['model']} B{r['batch']}" for r in rows if r["system"] == "defaults"]
    series = {}
    for r in rows:
        series.setdefault(r["system"], []).append(r["graph_tokens_per_s"])
    bar_plot(labels, series, "decode tokens/s (CUDA graph)", f"{args.out}/hf_decode.png",
             "transformers decode: llmkernels against the defaults")


if __name__ == "__main__":
    main()
