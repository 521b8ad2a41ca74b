"""``quantize(x, fmt, rows=)`` in one pass against x quantized once and its rows copied, and the MoE block around it.

    PYTHONPATH=src:. python lab/scripts/ablate_gather_after.py OUT.md

Qwen3-30B-A3B's layer (H 2048, top-8): CUDA-graph replay of the activation quantize with the dispatch's gather at
256 / 2048 / 16384 tokens, fp8 (1, 128) and mxfp8, both ways (``GATHER_AFTER_MIN_ELEMENTS`` 0 or never), bits
compared; then the whole fp8 / mxfp8 / bf16 blocks at 2048 and 16384 tokens with the rule as shipped.
"""

from __future__ import annotations

import sys

import torch

import llmkernels as lk
from benchmarks.bench_moe_layer import MODELS
from benchmarks.common import graph_time_ms
from llmkernels.formats import api as formats_api
from llmkernels.moe import MoEFeedForward


def main(out: str) -> None:
    torch.manual_seed(0)
    lines = ["| what | tokens | one pass us | quantize, then gather us | same bits |", "|---|---|---|---|---|"]
    shipped = formats_api.GATHER_AFTER_MIN_ELEMENTS
    for tokens in (256, 2048, 16384):
        x = torch.randn(tokens, 2048, device="cuda", dtype=torch.bfloat16)
        rows = torch.randint(0, tokens, (tokens * 8,), device="cuda", dtype=torch.int32)
        for fmt, kwargs in (("fp8", dict(block=(1, 128))), ("mxfp8", {})):
            times, results = [], []
            for threshold in (1 << 62, 0):
                formats_api.GATHER_AFTER_MIN_ELEMENTS = threshold
                call = lambda: lk.quantize(x, fmt, rows=rows, **kwargs)  # noqa: E731
                results.append(call())
                times.append(graph_time_ms(call) * 1e3)
            same = all(
                torch.equal(a.view(torch.uint8), b.view(torch.uint8))
                for a, b in ((results[0].data, results[1].data), (results[0].scales, results[1].scales))
            )
            lines.append(f"| quantize {fmt} rows | {tokens} | {times[0]:.1f} | {times[1]:.1f} | {same} |")
            print(lines[-1], flush=True)
    formats_api.GATHER_AFTER_MIN_ELEMENTS = shipped
    experts, hidden, intermediate, top_k, routing = MODELS["Qwen3-30B-A3B"]
    router = torch.randn(experts, hidden, device="cuda", dtype=torch.bfloat16) * hidden**-0.5
    w_gate_up = torch.randn(experts, 2 * intermediate, hidden, device="cuda", dtype=torch.bfloat16) * hidden**-0.5
    w_down = torch.randn(experts, hidden, intermediate, device="cuda", dtype=torch.bfloat16) * intermediate**-0.5
    lines += ["", "| block | tokens | graph us (one pass) | graph us (shipped rule) |", "|---|---|---|---|"]
    for weight_format in ("fp8", "mxfp8", "bf16"):
        block = MoEFeedForward.from_float(router, w_gate_up, w_down, top_k, weight_format=weight_format, **routing)
        for tokens in (1, 2048, 16384):
            x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
            times = []
            for threshold in (1 << 62, shipped):
                formats_api.GATHER_AFTER_MIN_ELEMENTS = threshold
                block(x)
                times.append(graph_time_ms(lambda: block(x)) * 1e3)
            lines.append(f"| {weight_format} | {tokens} | {times[0]:.1f} | {times[1]:.1f} |")
            print(lines[-1], flush=True)
        formats_api.GATHER_AFTER_MIN_ELEMENTS = shipped
    with open(out, "w") as handle:
        handle.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    with torch.inference_mode():
        main(sys.argv[1])
