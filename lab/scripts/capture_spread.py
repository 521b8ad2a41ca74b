"""Why one CUDA-graph capture in five of the bf16 Gluon kernel runs ~30% slower (lab/NOTES.md, DeepSeek down x 256 on
the H200): times ours, torch._grouped_mm and the lab's TMA-store variant over several captures, each with a fresh
output buffer, then ours recaptured several times on one buffer, then ours on each of the fresh buffers again.
If the slow rounds follow the buffer, the output's placement is the cause; if they follow the capture, something
made per capture is.

    PYTHONPATH=src:.:lab/gluon_bf16 python lab/scripts/capture_spread.py [E T N K] [CAPTURES]
"""

from __future__ import annotations

import sys

import torch
from gluon_kernel import bf16_grouped_matmul_gluon as tma_store_kernel

import llmkernels as lk
from benchmarks.common import graph_time_ms


def main() -> None:
    experts, per, n, k = (int(v) for v in sys.argv[1:5]) if len(sys.argv) > 4 else (256, 256, 7168, 2048)
    captures = int(sys.argv[5]) if len(sys.argv) > 5 else 8
    torch.manual_seed(0)
    tokens = experts * per
    a = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(experts, n, k, device="cuda", dtype=torch.bfloat16) * k**-0.5
    b_t = b.transpose(-2, -1)
    offsets = torch.arange(0, tokens + 1, per, device="cuda", dtype=torch.int32)
    ids = torch.arange(experts, device="cuda", dtype=torch.int32)
    outs = [torch.empty(tokens, n, device="cuda", dtype=torch.bfloat16) for _ in range(captures)]
    print(f"{torch.cuda.get_device_name()}: E{experts} x {per}, N {n}, K {k}; µs per capture", flush=True)

    def us(fn):
        fn()
        return round(graph_time_ms(fn) * 1e3)

    rows = {
        "ours, fresh out each": [us(lambda o=o: lk.grouped_matmul(a, b, offsets, ids, out=o)) for o in outs],
        "_grouped_mm (own out)": [
            us(lambda: torch._grouped_mm(a, b_t, offs=offsets[1:], out_dtype=torch.bfloat16)) for _ in outs
        ],
        "lab TMA store, fresh out each": [us(lambda o=o: tma_store_kernel(a, b, offsets, ids, o)) for o in outs],
        "ours, out 0 recaptured": [us(lambda: lk.grouped_matmul(a, b, offsets, ids, out=outs[0])) for _ in outs],
        "ours, fresh out each, again": [us(lambda o=o: lk.grouped_matmul(a, b, offsets, ids, out=o)) for o in outs],
        "ours, new out per call": [us(lambda: lk.grouped_matmul(a, b, offsets, ids)) for _ in outs],
    }
    for label, times in rows.items():
        print(f"{label}: {times}", flush=True)
    print(
        "out buffer addresses (MB offsets from the first):", [(o.data_ptr() - outs[0].data_ptr()) >> 20 for o in outs]
    )


if __name__ == "__main__":
    main()
