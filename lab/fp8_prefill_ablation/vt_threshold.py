"""The FP8 prefill with V transposed in memory first against the producer's transpose, per shape: where the pass
pays (``gluon_fp8_prefill.V_READS``: work tiles per KV head from which it is taken).

    PYTHONPATH=src:. python lab/fp8_prefill_ablation/vt_threshold.py [--out DIR]

Each shape runs both ways in one process (``V_READS`` 1: always in memory; 10**9: never), graph replay; the
transposing pass is inside the timed call.
"""

from __future__ import annotations

import argparse
import os

import torch

from benchmarks.bench_attention_prefill import fp8_inputs
from benchmarks.common import graph_time_ms
from llmkernels.attention import gluon_fp8_prefill
from llmkernels.attention.api import attention
from llmkernels.attention.plan import PLANS

# (batch, heads, seqlen, head_dim, causal): query blocks x group = seqlen / 128 (Hq = Hkv)
SHAPES = [
    (4, 16, 4096, 128, False),
    (4, 16, 4096, 128, True),
    (8, 16, 2048, 64, False),
    (4, 8, 4096, 256, True),
    (16, 16, 1024, 128, False),
    (16, 16, 1024, 128, True),
    (32, 16, 512, 128, False),
    (64, 16, 256, 128, False),
]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    lines = [
        "| B x H x S x D | causal | reads | producer TFLOP/s | in memory TFLOP/s | in memory / producer |",
        "|---|---|---|---|---|---|",
    ]
    for batch, heads, seqlen, head_dim, causal in SHAPES:
        inputs = fp8_inputs(batch, heads, seqlen, head_dim, "cuda")
        descales = {key: inputs[key] for key in ("q_descale", "k_descale", "v_descale")}
        flops = 4 * batch * heads * seqlen * seqlen * head_dim * (0.5 if causal else 1.0)
        ms, outs = {}, {}
        for reads in (10**9, 1):
            gluon_fp8_prefill.V_READS = reads
            PLANS.clear()

            def run():
                return attention(inputs["q8"], inputs["k8"], inputs["v8"], causal=causal, **descales)

            outs[reads] = run()
            torch.cuda.synchronize()
            ms[reads] = graph_time_ms(run)
        same = torch.equal(outs[1].view(torch.int16), outs[10**9].view(torch.int16))
        producer, memory = flops / ms[10**9] / 1e9, flops / ms[1] / 1e9
        row = (
            f"| {batch}x{heads}x{seqlen}x{head_dim} | {causal} | {seqlen // 128} | {producer:.0f} | {memory:.0f} | "
            f"{ms[10**9] / ms[1]:.3f} |"
        )
        print(row, "same bits" if same else "BITS DIFFER", flush=True)
        lines.append(row)
    table = "\n".join(lines)
    print(table)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "vt_threshold.md"), "w") as f:
        f.write(f"# FP8 prefill: V^T in memory vs the producer's transpose, {torch.cuda.get_device_name()}\n\n")
        f.write(table + "\n")


if __name__ == "__main__":
    main()
