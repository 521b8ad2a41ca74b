"""Focused GPU timing of the lab kernel's softmax variants (conditional rescale, exp2 partly on FMA units), each in
a child process with a timeout (a hang is a timeout, not a stuck GPU job): relative error on one small case, then
CUDA-graph replay TFLOP/s at 4x16x4096x128 full / causal and 2x16x8192x128 causal. Writes
$OUT/time_variants.csv when OUT is set.

    PYTHONPATH=src:. python lab/gluon_fp8_attention/time_variants.py [--timeout S] [variant ...]
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys

NAMES = ["default", "cond rescale + poly 1/8", "3 stages + cond rescale + poly 1/8"]
SHAPES = [(4, 4096, 16, False), (4, 4096, 16, True), (2, 8192, 16, True)]


def child(name: str) -> None:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import torch
    from fp8_attention import fp8_attention
    from run_gpu import VARIANTS, errors, graph_time, make_inputs, pick, reference

    kwargs = VARIANTS[name]
    q8, k8, v8, qd, kd, vd = make_inputs(2, 1000, 1000, 4, 2, 128, True)
    out = fp8_attention(q8, k8, v8, qd, kd, vd, causal=True, **kwargs)
    ref, pairs = reference(q8, k8, v8, qd, kd, vd, True)
    row = {"variant": name, "rel_error": errors(pick(out, pairs), ref)[0]}
    for batch, seq, heads, causal in SHAPES:
        q8, k8, v8, qd, kd, vd = make_inputs(batch, seq, seq, heads, heads, 128, False)
        ms = graph_time(lambda: fp8_attention(q8, k8, v8, qd, kd, vd, causal=causal, **kwargs))
        flops = 4 * batch * heads * seq * seq * 128 / (2 if causal else 1)
        row[f"{batch}x{heads}x{seq} {'causal' if causal else 'full'} TFLOP/s"] = flops / ms / 1e9
        torch.cuda.empty_cache()
    print("ROW " + json.dumps(row), flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--timeout", type=float, default=100.0)
    parser.add_argument("--child", default=None)
    parser.add_argument("variants", nargs="*", default=NAMES)
    args = parser.parse_args()
    if args.child:
        child(args.child)
        return 0
    rows = []
    for name in args.variants:
        try:
            done = subprocess.run(
                [sys.executable, __file__, "--child", name], capture_output=True, text=True, timeout=args.timeout
            )
            found = [line[4:] for line in done.stdout.splitlines() if line.startswith("ROW ")]
            row = json.loads(found[0]) if found else {"variant": name, "note": done.stderr[-300:]}
        except subprocess.TimeoutExpired:
            row = {"variant": name, "note": f"timeout after {args.timeout:.0f} s"}
        rows.append(row)
        print({k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
    if os.environ.get("OUT"):
        keys = sorted({key for row in rows for key in row})
        with open(os.path.join(os.environ["OUT"], "time_variants.csv"), "w", newline="") as file:
            writer = csv.DictWriter(file, fieldnames=keys)
            writer.writeheader()
            writer.writerows(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
