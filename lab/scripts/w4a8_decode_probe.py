"""Which kernels a w4a8 decode call (fp8 (1, 128) activations x row-layout MXFP4 weights, E128 x 1 / 16 tokens,
N 4096, K 7168) runs on this GPU and how long each takes, next to bf16 x MXFP4 on the same weights (profiler,
eager, after a warm call).

    PYTHONPATH=src python lab/scripts/w4a8_decode_probe.py [tokens per expert ...]
"""

import sys

import torch
from torch.profiler import ProfilerActivity, profile

import llmkernels as lk
from llmkernels.grouped_matmul.backends.w4a8_decode import W4A8DecodeLaunch

calls = {"hopper": 0, "portable": 0}
original = W4A8DecodeLaunch.__call__


def counting(self, *args):
    original(self, *args)
    calls["hopper" if self.hopper is not None else "portable"] += 1


W4A8DecodeLaunch.__call__ = counting
E, N, K = 128, 4096, 7168
w = lk.quantize(torch.randn(E, N, K, device="cuda", dtype=torch.bfloat16) * K**-0.5, "mxfp4")
for tokens in [int(t) for t in sys.argv[1:]] or (1, 16):
    x = torch.randn(E * tokens, K, device="cuda", dtype=torch.bfloat16)
    a = lk.quantize(x, "fp8", block=(1, 128))
    offsets = torch.arange(E + 1, dtype=torch.int32, device="cuda") * tokens
    ids = torch.arange(E, dtype=torch.int32, device="cuda")
    for name, act in (("w4a8", a), ("bf16", x)):
        lk.grouped_matmul(act, w, offsets, ids)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                lk.grouped_matmul(act, w, offsets, ids)
            torch.cuda.synchronize()
        print(f"== {name} E{E} x {tokens}: launches {calls}")
        for event in prof.key_averages():
            if event.device_type.name == "CUDA":
                print(f"   {event.key[:90]:90s} {event.count:3d} x {event.device_time / 1:9.1f} us")
