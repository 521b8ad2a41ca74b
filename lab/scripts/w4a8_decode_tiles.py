"""The w4a8 decode launch of the 17-64-token class under other tiles (``w4a8_decode.tile`` patched), E128 x 64 tokens
(N 4096, K 7168) and E32 x 64 (N 5760, K 2880), CUDA-graph replay, next to bf16 x MXFP4 on the same weights.

    PYTHONPATH=src:. python lab/scripts/w4a8_decode_tiles.py
"""

import dataclasses

import torch

import llmkernels as lk
from benchmarks.common import graph_time_ms
from llmkernels.grouped_matmul import config as gm_config
from llmkernels.grouped_matmul.backends import w4a8_decode, w4a8_hopper
from llmkernels.launch import clear_plans

ORIGINAL = w4a8_decode.tile
ORIGINAL_DECODE_SUPPORTS, ORIGINAL_HOPPER_SUPPORTS = w4a8_decode.supports, w4a8_hopper.supports


def hopper_takes_64(call, config):
    """w4a8_hopper's rule with the 17-64-token class's config (64-row tiles) let in."""
    if config.block_m == 64 and not config.ab_swapped:
        config = dataclasses.replace(config, block_m=128)
    return ORIGINAL_HOPPER_SUPPORTS(call, config)


VARIANTS = {
    "product": None,
    "64x64 w4": dict(block_m=64, block_n=64, num_warps=4),
    "32x128 w4": dict(block_m=32, block_n=128, num_warps=4),
    "16x128 w4": dict(block_m=16, block_n=128, num_warps=4),
    "64x64 w4 s2": dict(block_m=64, block_n=64, num_warps=4, num_stages=2),
    "64x64 w4 s4": dict(block_m=64, block_n=64, num_warps=4, num_stages=4),
    "gluon 128-token": "gluon",
}

for experts, n, k in ((128, 4096, 7168), (32, 5760, 2880)):
    w = lk.quantize(torch.randn(experts, n, k, device="cuda", dtype=torch.bfloat16) * k**-0.5, "mxfp4")
    x = torch.randn(experts * 64, k, device="cuda", dtype=torch.bfloat16)
    a = lk.quantize(x, "fp8", block=(1, 128))
    offsets = torch.arange(experts + 1, dtype=torch.int32, device="cuda") * 64
    ids = torch.arange(experts, dtype=torch.int32, device="cuda")
    bf16_us = 1e3 * graph_time_ms(lambda: lk.grouped_matmul(x, w, offsets, ids))
    expected = lk.grouped_matmul(a, w, offsets, ids).float()
    for name, change in VARIANTS.items():
        w4a8_decode.supports, w4a8_hopper.supports = ORIGINAL_DECODE_SUPPORTS, ORIGINAL_HOPPER_SUPPORTS
        if change == "gluon":
            w4a8_decode.tile = ORIGINAL
            w4a8_hopper.supports = hopper_takes_64
            w4a8_decode.supports = lambda call, config: config.block_m < 64 and ORIGINAL_DECODE_SUPPORTS(call, config)
        elif change is None:
            w4a8_decode.tile = ORIGINAL
        else:

            def tile(call, config, change=change):
                chosen = ORIGINAL(call, config)
                return dataclasses.replace(chosen, **change) if config.block_m == 64 else chosen

            w4a8_decode.tile = tile
        clear_plans()
        gm_config.default_launches.cache_clear()
        try:
            got = lk.grouped_matmul(a, w, offsets, ids).float()
            err = ((got - expected).norm() / expected.norm()).item()
            us = 1e3 * graph_time_ms(lambda: lk.grouped_matmul(a, w, offsets, ids))
            print(
                f"E{experts} {n}x{k} x64  {name:14s} {us:8.1f} us  bf16 x mxfp4 {bf16_us:8.1f}  "
                f"ratio {bf16_us / us:.3f}  err vs product {err:.1e}",
                flush=True,
            )
        except Exception as error:  # noqa: BLE001 - a failing variant is a finding
            print(f"E{experts} x64 {name}: {type(error).__name__}: {str(error)[:200]}", flush=True)
    w4a8_decode.tile = ORIGINAL
