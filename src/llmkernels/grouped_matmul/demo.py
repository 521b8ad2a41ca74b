"""The grouped matmul's part of ``python -m llmkernels demo``: a default MoE problem, checked and timed."""

from __future__ import annotations

import torch

from ..formats import quantize
from ..testing import random_group_offsets, relative_error
from .api import grouped_matmul
from .reference import grouped_matmul_reference

# (label, a format, b format, epilogue); "bf16" is a plain tensor.
CASES = [
    ("bf16 x bf16", "bf16", "bf16", None),
    ("mxfp8 x mxfp8", "mxfp8", "mxfp8", "swiglu"),
    ("mxfp4 x mxfp4", "mxfp4", "mxfp4", None),
    ("nvfp4 x nvfp4", "nvfp4", "nvfp4", "swiglu"),
    ("bf16 x mxfp4 (w4a16)", "bf16", "mxfp4", "swiglu"),
]
TOLERANCE = 1e-2  # bf16 output


def run_demo(device: torch.device) -> list[dict]:
    """Runs each format pair on one problem; returns rows {kernel, problem, rel_error, ok, time_ms}."""
    on_gpu = device.type == "cuda"
    num_experts, tokens_per_expert, n, k = (64, 128, 2048, 7168) if on_gpu else (4, 12, 64, 128)
    generator = torch.Generator().manual_seed(0)
    sizes = torch.poisson(torch.full((num_experts,), float(tokens_per_expert)), generator=generator).int()
    sizes[0] = 0  # an empty group
    a_offsets = random_group_offsets(sizes.tolist(), device=device)
    expert_ids = torch.randperm(num_experts, generator=generator).int().to(device)
    num_tokens = int(sizes.sum())
    x = torch.randn(num_tokens, k, generator=generator).to(device)
    w = (torch.randn(num_experts, n, k, generator=generator) / k**0.5).to(device)
    expert_scales = (torch.rand(num_experts, generator=generator) + 0.5).to(device)
    problem = f"E={num_experts} T={num_tokens} N={n} K={k}"
    rows = []
    for label, a_format, b_format, epilogue in CASES:
        a = x.bfloat16() if a_format == "bf16" else quantize(x, a_format)
        b = w.bfloat16() if b_format == "bf16" else quantize(w, b_format)
        out = grouped_matmul(a, b, a_offsets, expert_ids, expert_scales, epilogue=epilogue)
        expected = grouped_matmul_reference(a, b, a_offsets, expert_ids, expert_scales, epilogue=epilogue)
        error = relative_error(out.float(), expected)
        time_ms = None
        if on_gpu:
            import triton.testing

            time_ms = triton.testing.do_bench(
                lambda: grouped_matmul(a, b, a_offsets, expert_ids, expert_scales, epilogue=epilogue),
                return_mode="median",
            )
        rows.append(
            {
                "kernel": f"grouped_matmul {label}" + (f" +{epilogue}" if epilogue else ""),
                "problem": problem,
                "rel_error": error,
                "ok": error <= TOLERANCE,
                "time_ms": time_ms,
            }
        )
    return rows
