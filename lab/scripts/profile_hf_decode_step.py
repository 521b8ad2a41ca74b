"""Where an eager decode step of bench_hf_decode's gpt-oss-like model goes: GPU kernel time against wall time, per
system (transformers' defaults, our attention with grouped_mm experts, our attention and bf16 / MXFP4 experts).

    PYTHONPATH=src python lab/scripts/profile_hf_decode_step.py OUT.md [--batch 32] [--steps 20]

For each system: wall ms per eager step (CUDA-synchronized), the sum of its kernels' GPU time per step and the
kernel count (torch.profiler), so host-bound (wall >> GPU) and kernel-bound steps separate; then the top kernels by
GPU time and the top CPU-side ops by self CPU time.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, ".")
from benchmarks.bench_hf_decode import _build, _configs, _decode_step, _use  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--model", default="gpt-oss-20b-like")
    args = parser.parse_args()
    from llmkernels.integrations import transformers as lk_transformers

    lk_transformers.register()
    config, model_class, default_attention = _configs()[args.model]
    model = _build(config, model_class)
    lines = [f"# eager decode step profile: {args.model}, batch {args.batch}, {torch.cuda.get_device_name()}", ""]
    systems = [
        ("defaults", default_attention, "grouped_mm", None),
        ("llmkernels attention", "llmkernels", "grouped_mm", None),
        ("llmkernels bf16 experts", "llmkernels", "llmkernels", None),
        ("llmkernels mxfp4 experts", "llmkernels", "llmkernels", "mxfp4"),
    ]
    summary = ["| system | wall ms/step | GPU kernel ms/step | kernels/step | host-bound share |", "|---|---|---|---|---|"]
    details = []
    for label, attention, experts, weight_format in systems:
        if weight_format is not None:
            lk_transformers.quantize_experts(model, weight_format, scale_layout="hopper")
        _use(model, attention, experts)
        step, _, cache = _decode_step(model, args.batch)
        for _ in range(40):  # past every residue of Skv mod 16 that Triton specializes a compile on
            step()
        torch.cuda.synchronize()
        started = time.perf_counter()
        for _ in range(args.steps):
            step()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - started) * 1e3 / args.steps
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(args.steps):
                step()
            torch.cuda.synchronize()
        events = prof.key_averages()
        gpu_us = sum(e.self_device_time_total for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
        kernels = sum(e.count for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
        gpu_ms = gpu_us / 1e3 / args.steps
        summary.append(
            f"| {label} | {wall:.3f} | {gpu_ms:.3f} | {kernels / args.steps:.0f} | {max(0.0, 1 - gpu_ms / wall):.0%} |"
        )
        details += [f"## {label}", "", "```", prof.key_averages().table(sort_by="self_device_time_total", row_limit=15),
                    prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15), "```", ""]
        print(summary[-1], flush=True)
        del cache
    text = "\n".join(lines + summary + [""] + details)
    with open(args.out, "w") as f:
        f.write(text)


if __name__ == "__main__":
    main()
