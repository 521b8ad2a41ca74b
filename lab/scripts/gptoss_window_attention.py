"""gpt-oss's attention where ours is slow (D 64, Hq 64, Hkv 8; short causal and the 128-token window): the Gluon
prefill as it is, with a third K/V stage, the portable kernel, and FlexAttention (compiled, block-sparse sliding
window) as the windowed peer; SDPA's cuDNN backend for causal.

    PYTHONPATH=src:. python lab/scripts/gptoss_window_attention.py [--out DIR]

Graph replay for ours and SDPA; FlexAttention timed eagerly after its compile (its own kernel, no host work to
speak of at these sizes). Every system is checked against the reference on q heads 0-7 of the first sequence.
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch

from benchmarks.common import graph_time_ms, time_ms
from benchmarks.peers import sdpa_runner
from lab.fp8_prefill_ablation.ablate import patched_module
from llmkernels.attention import gluon_hopper
from llmkernels.attention.api import attention
from llmkernels.attention.config import default_config
from llmkernels.attention.masks import SlidingWindow
from llmkernels.attention.plan import PLANS
from llmkernels.attention.reference import attention_reference
from llmkernels.testing import relative_error

SOURCE = os.path.join(os.path.dirname(__file__), "..", "..", "src", "llmkernels", "attention", "gluon_hopper.py")
SHAPES = ((1, 8192), (4, 4096), (16, 1024))
HEADS, KV_HEADS, HEAD_DIM, WINDOW = 64, 8, 64, 128


THREE_STAGES = patched_module(
    SOURCE,
    "three_stages",
    [("STAGES: gl.constexpr = 2  # a third stage", "STAGES: gl.constexpr = 3  # a third stage")],
    tempfile.mkdtemp(),
)
ORIGINAL_KERNEL = gluon_hopper.GluonPrefill.kernel


def flex_runner(q, k, v, window: bool):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    def keep(b, h, q_idx, kv_idx):
        seen = q_idx >= kv_idx
        return seen & (q_idx - kv_idx < WINDOW) if window else seen

    seqlen = q.shape[1]
    block_mask = create_block_mask(keep, None, None, seqlen, seqlen, device=q.device)
    compiled = torch.compile(flex_attention)
    q_t, k_t, v_t = (x.transpose(1, 2) for x in (q, k, v))
    return lambda: compiled(q_t, k_t, v_t, block_mask=block_mask, enable_gqa=True).transpose(1, 2)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    lines = [
        "| B x S | mask | gluon | gluon 3 stages | portable | flex | sdpa cudnn | (TFLOP/s) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    portable = default_config(HEAD_DIM, torch.bfloat16, torch.device("cuda")).replace(warp_specialized=False)
    for batch, seqlen in SHAPES:
        for window in (False, True):
            q = torch.randn(batch, seqlen, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
            k = torch.randn(batch, seqlen, KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
            v = torch.randn(batch, seqlen, KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
            mask = dict(causal=True, mask=SlidingWindow(WINDOW - 1, 0)) if window else dict(causal=True)
            expected = attention_reference(q[:1, :, :8], k[:1, :, :1], v[:1, :, :1], **mask)
            pairs = sum(min(i + 1, WINDOW) for i in range(seqlen)) if window else seqlen * (seqlen + 1) // 2
            flops = 4 * batch * HEADS * HEAD_DIM * pairs
            cells = []
            for name in ("gluon", "gluon3", "portable", "flex", "sdpa"):
                try:
                    gluon_hopper.GluonPrefill.kernel = (
                        THREE_STAGES._attention_fwd_kernel if name == "gluon3" else ORIGINAL_KERNEL
                    )
                    PLANS.clear()
                    if name == "flex":
                        run = flex_runner(q, k, v, window)
                    elif name == "sdpa":
                        if window:
                            cells.append("-")
                            continue
                        q_t, k_t, v_t = (x.transpose(1, 2) for x in (q, k, v))
                        sdpa = sdpa_runner("cudnn", q_t, k_t, v_t, causal=True)

                        def run(sdpa=sdpa):
                            return sdpa().transpose(1, 2)
                    else:
                        config = portable if name == "portable" else None

                        def run(config=config):
                            return attention(q, k, v, config=config, **mask)

                    out = run()
                    error = relative_error(out[:1, :, :8], expected)
                    if not error < 2e-2:
                        cells.append(f"WRONG {error:.1e}")
                        continue
                    ms = time_ms(run) if name == "flex" else graph_time_ms(run)
                    cells.append(f"{flops / ms / 1e9:.0f}")
                except Exception as failure:  # noqa: BLE001 - report and go on
                    cells.append(f"fails: {type(failure).__name__} {str(failure)[:60]}")
            row = f"| {batch}x{seqlen} | {'window 128' if window else 'causal'} | " + " | ".join(cells) + " | |"
            print(row, flush=True)
            lines.append(row)
    gluon_hopper.GluonPrefill.kernel = ORIGINAL_KERNEL
    table = "\n".join(lines)
    print(table)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "gptoss_window_attention.md"), "w") as f:
        f.write(f"# gpt-oss attention, short causal and window 128 ({torch.cuda.get_device_name()})\n\n{table}\n")


if __name__ == "__main__":
    main()
